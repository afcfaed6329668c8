"""What the torch op adds to a cold GEMV: one 2-bit matrix copied into a
~600 MiB rotation, then in turn every round (common.time_interleaved)
  - the op, torch.ops.ulb.linear.default(x, blob, None, M), as the modules
    call it when their eager call does not serve (tracing, autograd, ...);
  - the modules' eager call, ulbtorch.runtime.eager_linear (csrc/eager.cpp);
  - a Linear2Bit module called, module(x): its C module call
    (runtime.eager_module_call) runs nn.Module.__call__'s checks and the
    eager call; and nn.Module.__call__(module, x), the way it took before:
    hook checks and forward in Python, then the eager call (the modules are
    copies, one per blob of the rotation);
  - the same C function, ulb_linear, through ctypes with raw pointers and a
    preallocated output (no tensor touched per call);
  - ulb_read_probe_streams through ctypes with raw pointers (the stream
    roofline), reading each blob as one run or as four, whichever read a
    big buffer faster at that thread count (common.measure_read_bandwidth);
Prints µs per call, each one's % of the probe and the module call's speed-up over
nn.Module.__call__ (medians of per-round ratios).

On two threads or more it then splits the op's and the probe's call in two,
over one more pass of the rotation each, every call timed on its own: the
time inside the parallel region (the largest per-thread time of the
scheduler table, ulbtorch.runtime.scheduler_stats, which runs from the job's
publication to the end of a thread's share) and the rest of the call
(Python, dispatch, argument checks, allocation, the return; the activations
are quantised inside the region). Medians.

  python benchmarks/op_overhead.py --shapes 640x2560,2048x2048,4096x4096 --threads 1,2
"""
from __future__ import annotations

import argparse
import copy
import ctypes
import os
import statistics
import sys
import time

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

import ulbtorch  # noqa: E402
from ulbtorch.runtime import _lib  # noqa: E402

ULB_DT_BF16 = 1  # ulb_dtype in kernels/include/ulb/ulb.h
PARALLEL_MIN_BYTES = 64 * 1024  # ULB_PARALLEL_MIN_BYTES in kernels/src/internal.h
_lib.ulb_linear.restype = ctypes.c_int
_lib.ulb_linear.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int,
                            ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p,
                            ctypes.c_int, ctypes.c_int64, ctypes.c_int]


def measure(M: int, K: int, threads: int, streams: int, reps: int, rotate_mib: float) -> str:
    gen = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 4, (M, K), dtype=torch.uint8, generator=gen)
    blob = ulbtorch.ops.pack(codes, torch.rand(M, 1, generator=gen) * 0.02 + 0.01, "int2_sym", 0)
    x = torch.randn(1, K, dtype=torch.bfloat16, generator=gen)
    y = torch.empty(1, M, dtype=torch.bfloat16)
    rotate = int(rotate_mib * common.MiB)
    blobs = common.replicate([blob], common.cold_rotation(blob.numel(), rotate, min(rotate, 256 * common.MiB)))
    ptrs = [b.data_ptr() for b in blobs]
    nbytes, xp, yp = blob.numel(), x.data_ptr(), y.data_ptr()
    op = torch.ops.ulb.linear.default
    eager = ulbtorch.runtime.eager_linear
    if eager is None:
        common.die("the eager fast path is off or not built for this torch")

    def c_linear(p):
        if _lib.ulb_linear(p, nbytes, 1, xp, ULB_DT_BF16, K, 1, None, 0, yp, ULB_DT_BF16, M, threads):
            raise RuntimeError("ulb_linear failed")

    module = ulbtorch.Linear2Bit(K, M, bias=False)
    module.packed = blob
    modules = [copy.deepcopy(module) for _ in blobs]

    expect = op(x, blob, None, M)
    c_linear(ptrs[0])
    torch.testing.assert_close(y, expect, rtol=0, atol=0)  # the paths compute the same thing
    assert torch.equal(eager(x, blob, None, M), expect) and torch.equal(module(x), expect)
    samples: list[list[float]] = []
    probe, probe_items = common.raw_probe(threads, streams), [common.probe_item(b) for b in blobs]
    t = common.time_interleaved([(blobs, lambda b: op(x, b, None, M)), (blobs, lambda b: eager(x, b, None, M)),
                                 (ptrs, c_linear), (probe_items, probe),
                                 (modules, lambda m: m(x)), (modules, lambda m: nn.Module.__call__(m, x))],
                                reps=reps, samples_out=samples)
    pct = [100 * common.median_ratio(samples[3], samples[i]) for i in range(3)]
    line = (f"{f'{M}x{K}':<11} {threads:>3}  {t[0] * 1e6:6.1f}  {t[1] * 1e6:8.1f}  {t[2] * 1e6:11.1f}  "
            f"{t[3] * 1e6:8.1f}  {t[4] * 1e6:9.1f}  {t[5] * 1e6:12.1f}  {pct[0]:7.0f}%  {pct[1]:10.0f}%  "
            f"{pct[2]:6.0f}%  {common.median_ratio(samples[5], samples[4]):17.2f}x")
    # One thread, or a matrix under the kernels' 64 KiB threshold for forking
    # (ULB_PARALLEL_MIN_BYTES), runs no parallel region and records no times.
    if threads < 2 or nbytes < PARALLEL_MIN_BYTES:
        return line + "            -             -               -              -"
    op_in, op_out = split_call(blobs, lambda b: op(x, b, None, M), 2)
    ea_in, ea_out = split_call(blobs, lambda b: eager(x, b, None, M), 2)
    pr_in, pr_out = split_call(probe_items, probe, 0)
    return line + f"  {op_in:9.1f}  {pr_in:12.1f}  {op_out:10.1f}  {ea_out:13.1f}  {pr_out:13.1f}"


def split_call(items, fn, bits: int) -> tuple[float, float]:
    """Median µs inside the parallel region and outside it, over one pass."""
    inside, outside = [], []
    for item in items:
        t0 = time.perf_counter()
        fn(item)
        wall = (time.perf_counter() - t0) * 1e6
        region = max(ulbtorch.runtime.scheduler_stats(bits)["last_us"])
        inside.append(region)
        outside.append(wall - region)
    return statistics.median(inside), statistics.median(outside)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="640x2560,1024x2048,2048x2048,4096x4096", help="MxK list")
    p.add_argument("--threads", default="1,2", help="thread counts (default 1,2)")
    p.add_argument("--reps", type=int, default=15, help="rounds of samples (default 15)")
    p.add_argument("--rotate-mib", type=float, default=common.COLD_MIB,
                   help="MiB of distinct blobs and of the bandwidth probe's buffer (default: cold, past the L3; "
                        "a small value only checks that the script runs)")
    args = p.parse_args()
    shapes = [tuple(int(v) for v in s.split("x")) for s in common.parse_list(args.shapes)]
    threads = common.parse_list(args.threads, int)
    common.print_environment()
    bw = common.measure_read_bandwidth(threads, size_bytes=int(args.rotate_mib * common.MiB),
                                       methods=["probe", "probe.x4"], verbose=True)
    print("shape       thr  us op  us eager  us C (ctypes)  us probe  us module  us nn.Module  op/probe  eager/probe"
          "  C/probe  module call speed-up  op region  probe region  op outside  eager outside  probe outside")
    for M, K in shapes:
        for n in threads:
            with common.num_threads(n):
                print(measure(M, K, n, bw[n]["probe_streams"], args.reps, args.rotate_mib), flush=True)


if __name__ == "__main__":
    main()

"""Software-prefetch distances through the op, as the modules call it: one
matrix copied into a ~600 MiB rotation of torch tensors, then in turn every
round (common.time_interleaved) torch.ops.ulb.linear at each distance
(runtime.set_prefetch_distance) and the read probe. Prints µs per call, % of
the probe and the speed against the first distance (medians of per-round
ratios). benchmarks/c/prefetch_sweep.c does the same through the C API.

  python benchmarks/prefetch_ab.py --shapes 2048x2048,4096x4096 --threads 1,2 --dists auto,0,8192
  python benchmarks/prefetch_ab.py --format int4 --group-size 32 --shapes 8192x2048 --threads 1
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

from ulbtorch import ops, runtime  # noqa: E402
from ulbtorch.formats import get_format  # noqa: E402


def measure(fmt: str, M: int, K: int, gs: int, threads: int, dists: list, reps: int) -> list[str]:
    f = get_format(fmt)
    gen = torch.Generator().manual_seed(0)
    codes = torch.randint(0, f.max_code + 1, (M, K), dtype=torch.uint8, generator=gen)
    scales = torch.rand(M, K // gs if gs else 1, generator=gen) * 0.02 + 0.01
    blob = ops.pack(codes, scales, fmt, gs)
    x = torch.randn(1, K, dtype=torch.bfloat16, generator=gen)
    blobs = common.replicate([blob], common.cold_rotation(blob.numel()))
    op = torch.ops.ulb.linear.default
    current = [None]  # the (bits, distance) set last: set again only when another candidate changed it
    before = {f.prefetch_bits: runtime.prefetch_distance(f.prefetch_bits), 2: runtime.prefetch_distance(2)}

    def setting(bits, d, fn):
        def call(b):
            if current[0] != (bits, d):
                runtime.set_prefetch_distance(bits, d)
                current[0] = (bits, d)
            fn(b)
        return call

    # The probe prefetches at the 2-bit setting: it keeps the one in force at the start.
    probe = setting(2, before[2], lambda b: runtime.read_probe(b, threads))
    samples: list[list[float]] = []
    try:
        with common.num_threads(threads):
            t = common.time_interleaved([(blobs, setting(f.prefetch_bits, d, lambda b: op(x, b, None, M))) for d in dists]
                                        + [(blobs, probe)], reps=reps, samples_out=samples)
    finally:
        for bits, d in before.items():
            runtime.set_prefetch_distance(bits, d)
    probe_s = samples[-1]
    return [f"{fmt:<9} {f'{M}x{K}':<11} {gs:>4} {threads:>3}  {str(d):>6}  {t[i] * 1e6:9.1f}  "
            f"{100 * common.median_ratio(probe_s, samples[i]):8.0f}%  {common.median_ratio(samples[0], samples[i]):9.3f}"
            for i, d in enumerate(dists)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="2048x2048,4096x4096", help="comma-separated MxK")
    p.add_argument("--format", default="int2_sym")
    p.add_argument("--group-size", type=int, default=0, help="0 = per-channel scales")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--dists", default="auto,0,8192", help="'auto' or bytes, comma-separated; the first is the baseline")
    p.add_argument("--reps", type=int, default=12)
    a = p.parse_args()
    dists = [d if d == "auto" else int(d) for d in a.dists.split(",")]
    common.print_environment()
    print(f"{'format':<9} {'M x K':<11} {'gs':>4} {'thr':>3}  {'dist':>6}  {'us/call':>9}  {'% probe':>9}  "
          f"{'x vs ' + str(dists[0]):>9}")
    for shape in a.shapes.split(","):
        M, K = (int(v) for v in shape.split("x"))
        for threads in common.parse_list(a.threads, int):
            for line in measure(a.format, M, K, a.group_size, threads, dists, a.reps):
                print(line, flush=True)


if __name__ == "__main__":
    main()

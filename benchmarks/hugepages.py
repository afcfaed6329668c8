"""What 2 MiB pages buy ulbtorch (ulbtorch.hugepages), both placements in one
process, timed in turn.

Two copies of the same bytes: one in a mapping advised MADV_NOHUGEPAGE (4 KiB
pages), one in ulbtorch's HugePageArena (2 MiB pages). Memory a process
faults later can stream faster on the VMs here (benchmarks/results/archive),
so the copies are faulted in turn (copy i of one right after copy i of the
other) or the 4 KiB one last, and every round of timing starts with the
other placement.

  1. GEMV: a cold rotation of each format and shape in both placements; the
     modules' eager call and the read probe over each (time_interleaved).
  2. Decode (--config): the model quantize_ makes (lm_head on the bf16 GEMV)
     moved into 2 MiB pages, and a deep copy of it in 4 KiB pages faulted
     after it; likewise the bf16 model (move_to_hugepages(plain_linears=True));
     greedy generate() of each in turn.

  python benchmarks/hugepages.py                       # falcon3-1b + llama3-8b shapes, 2-bit and 1-bit, 1 and 2 threads
  python benchmarks/hugepages.py --no-decode --models bitnet-b1.58-2b --formats ternary
  python benchmarks/hugepages.py --quick               # smoke test
"""
from __future__ import annotations

import argparse
import copy
import gc
import mmap
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
from decode import build_model, generate  # noqa: E402
from gemv import random_codes_scales  # noqa: E402

import ulbtorch  # noqa: E402
from ulbtorch.hugepages import HUGE_PAGE, HugePageArena  # noqa: E402

MiB = 1 << 20


def small_page_copies(blob: torch.Tensor, count: int):
    """A mapping advised MADV_NOHUGEPAGE and a function that writes copy i of
    blob into it (so the caller decides when its pages are faulted)."""
    step = -(-blob.numel() // 64) * 64
    mm = mmap.mmap(-1, count * step, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # page-aligned
    mm.madvise(mmap.MADV_NOHUGEPAGE)
    return lambda i: torch.frombuffer(mm, dtype=torch.uint8, count=blob.numel(), offset=i * step).copy_(blob)


def gemv_rows(args, table):
    shapes = common.load_shapes(args.shapes)["gemv_shapes"]
    gen = torch.Generator().manual_seed(0)
    for model in common.parse_list(args.models):
        for M, K in shapes[model]:
            for fmt in common.parse_formats(args.formats):
                codes, scales = random_codes_scales(M, K, fmt, 0, gen)
                blob = ulbtorch.ops.pack(codes, scales, fmt, 0)
                count = common.cold_rotation(blob.numel(), args.rotate_mib * MiB, min(256, args.rotate_mib) * MiB)
                small, huge = small_page_copies(blob, count), HugePageArena(count * -(-blob.numel() // 64) * 64)
                rot = {"4k": [], "2m": []}
                for i in range(count):  # pages faulted in turn
                    rot["4k"].append(small(i))
                    rot["2m"].append(huge.tensor(blob))
                x = torch.randn(1, K, generator=gen).to(torch.bfloat16)
                for nt in common.parse_list(args.threads, int):
                    torch.set_num_threads(nt)
                    call = lambda b: ulbtorch.runtime.eager_linear(x, b, None, M)  # noqa: E731
                    probe = lambda b: ulbtorch.runtime.read_probe(b, nt)  # noqa: E731
                    samples = []
                    t = common.time_interleaved([(rot["4k"], call), (rot["2m"], call), (rot["4k"], probe),
                                                 (rot["2m"], probe)], reps=args.reps, samples_out=samples)
                    gb = lambda s: blob.numel() / s / 1e9  # noqa: E731
                    table.add(dict(model=model, shape=f"{M}x{K}", threads=nt, format=fmt, rot=f"{count}x{blob.numel() / MiB:.2f}M",
                                   us_4k=1e6 * t[0], us_2m=1e6 * t[1], gbps_4k=gb(t[0]), gbps_2m=gb(t[1]),
                                   x=common.median_ratio(samples[0], samples[1]),
                                   probe_4k=gb(t[2]), probe_2m=gb(t[3]),
                                   x_probe=common.median_ratio(samples[2], samples[3]),
                                   pct_probe=100 * common.median_ratio(samples[3], samples[1])), echo=True)
                del rot, small, huge
                gc.collect()


def decode_rows(args, table):
    cfg = dict(common.load_shapes(args.shapes)["configs"][args.config])
    if args.quick:
        cfg.update(num_hidden_layers=1, vocab_size=32000)
    base = build_model(cfg, 0)
    ids = torch.randint(3, cfg["vocab_size"], (1, 16), generator=torch.Generator().manual_seed(0))
    variants = [("bf16", lambda m: m, True)] + [
        (fmt, lambda m, f=fmt: ulbtorch.quantize_(m, format=f, hugepages=False), False)
        for fmt in common.parse_formats(args.formats)]
    for name, make, plain in variants:
        huge = make(copy.deepcopy(base))
        report = ulbtorch.hugepages.move_to_hugepages(huge, plain_linears=plain)
        small = copy.deepcopy(huge)  # 4 KiB pages, faulted after the 2 MiB copy
        runs = {"4k": [], "2m": []}
        for m in (small, huge):
            generate(m, ids, args.tokens)  # warm-up
        for r in range(args.decode_reps):
            for key, m in ((("4k", small), ("2m", huge)) if r % 2 else (("2m", huge), ("4k", small))):
                t0 = time.perf_counter()
                generate(m, ids, args.tokens)
                runs[key].append(args.tokens / (time.perf_counter() - t0))
        ratios = [b / a for a, b in zip(runs["4k"], runs["2m"])]
        table.add(dict(variant=name, moved=f"{report.nbytes / MiB:.0f} MiB, {report.huge_bytes // HUGE_PAGE} x 2M",
                       tok_4k=statistics.median(runs["4k"]), tok_2m=statistics.median(runs["2m"]),
                       x=statistics.median(ratios), x_min=min(ratios), x_max=max(ratios)), echo=True)
        del huge, small
        gc.collect()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_shapes_arg(p)
    p.add_argument("--models", default="falcon3-1b,llama3-8b", help="shapes.json gemv_shapes keys")
    p.add_argument("--formats", default="int2_sym,binary", help="comma-separated (2, ternary, 1, int4, ...)")
    p.add_argument("--threads", default="1,2", help="GEMV thread counts; decode runs on the last")
    p.add_argument("--rotate-mib", type=int, default=common.COLD_MIB, help="cold rotation per placement (MiB)")
    p.add_argument("--reps", type=int, default=9, help="GEMV timing rounds")
    p.add_argument("--config", default="falcon3-1b", help="decode: a shapes.json config")
    p.add_argument("--tokens", type=int, default=32, help="decode: new tokens per generate()")
    p.add_argument("--decode-reps", type=int, default=6, help="decode: generate() runs per placement")
    p.add_argument("--no-decode", action="store_true")
    p.add_argument("--no-gemv", action="store_true")
    p.add_argument("--quick", action="store_true",
                   help="smoke test: the falcon3-1b shapes, 2-bit, 2 threads, 1-layer model, few runs")
    p.add_argument("--json", help="write every row as JSON here")
    p.add_argument("--markdown", help="write the tables as markdown here")
    args = p.parse_args(argv)
    if args.quick:
        args.models, args.formats, args.threads = "falcon3-1b", "int2_sym", "2"
        args.rotate_mib, args.reps, args.tokens, args.decode_reps = 64, 2, 4, 2
    if not ulbtorch.hugepages.available():
        common.die(f"no transparent huge pages here (mode {ulbtorch.hugepages.thp_mode()!r})")
    env = common.print_environment()
    tables = []
    if not args.no_gemv:
        gemv = common.Table([("model", "model", None), ("shape", "M x K", None), ("threads", "thr", None),
                             ("format", "format", None), ("rot", "rot", None), ("us_4k", "us 4K", ".1f"),
                             ("us_2m", "us 2M", ".1f"), ("gbps_4k", "GB/s 4K", ".1f"), ("gbps_2m", "GB/s 2M", ".1f"),
                             ("x", "x 2M", ".2f"), ("probe_4k", "probe GB/s 4K", ".1f"),
                             ("probe_2m", "probe GB/s 2M", ".1f"), ("x_probe", "probe x 2M", ".2f"),
                             ("pct_probe", "2M % probe", ".0f")],
                            title="GEMV N=1, cold, 4 KiB / 2 MiB pages (x 2M: median of per-round ratios)",
                            min_widths=dict(model=16, shape=10))
        gemv_rows(args, gemv)
        tables.append(gemv)
    if not args.no_decode:
        torch.set_num_threads(common.parse_list(args.threads, int)[-1])
        dec = common.Table([("variant", "variant", None), ("moved", "in 2 MiB pages", None),
                            ("tok_4k", "tok/s 4K", ".2f"), ("tok_2m", "tok/s 2M", ".2f"), ("x", "x 2M", ".3f"),
                            ("x_min", "min", ".3f"), ("x_max", "max", ".3f")],
                           title=f"decode, 2 MiB / 4 KiB pages: {args.config}, {args.tokens} new tokens, "
                                 f"{torch.get_num_threads()} threads", min_widths=dict(variant=10, moved=22))
        decode_rows(args, dec)
        tables.append(dec)
    common.write_outputs(tables, json_path=args.json, md_path=args.markdown, meta=dict(env=env, args=vars(args)))


if __name__ == "__main__":
    main()

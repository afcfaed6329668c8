"""One-token bf16 GEMV (torch.ops.ulb.linear_bf16, what nn.LinearBF16 runs for
the layers left in bf16) against bf16 F.linear and a stream read of the same
weights, cold, sampled in turn in one run.

Shapes: each config's lm_head (vocab x hidden, a single matrix is far larger
than L3) and, with --gemv-shapes, the decode shapes of shapes.json.

  python benchmarks/gemv_bf16.py                      # lm_head of every config, 1 and 2 threads
  python benchmarks/gemv_bf16.py --gemv-shapes --models falcon3-1b
  python benchmarks/gemv_bf16.py --int8               # + the same matrices packed to int8 (lm_head_bits=8)
  python benchmarks/gemv_bf16.py --hugepages          # every buffer in 2 MiB pages, where quantize_ puts them
  python benchmarks/gemv_bf16.py --packed int8,int4:32  # + int8, and int4 in groups of 32 (lm_head_bits=4,
                                                        #   lm_head_group_size=32)
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
from common import MiB  # noqa: E402

import ulbtorch  # noqa: E402


def shapes_to_run(doc: dict, models: list[str] | None, gemv_shapes: bool) -> list[tuple[str, str, int, int]]:
    out = []
    for name, cfg in doc["configs"].items():
        if models is None or name in models:
            out.append((name, "lm_head", cfg["vocab_size"], cfg["hidden_size"]))
    if gemv_shapes:
        for name, shapes in doc["gemv_shapes"].items():
            if models is None or name in models:
                out += [(name, "gemv", M, K) for M, K in shapes]
    return out


def faster(a: list[float], b: list[float]) -> list[float]:
    """The samples of whichever of two timings has the lower median."""
    return a if statistics.median(a) <= statistics.median(b) else b


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_shapes_arg(p)
    p.add_argument("--models", help="comma-separated subset of shapes.json's configs / gemv_shapes")
    p.add_argument("--gemv-shapes", action="store_true", help="also the decode GEMV shapes of shapes.json")
    p.add_argument("--threads", default="1,2", help="thread counts (default 1,2)")
    p.add_argument("--packed", default="",
                   help="also each matrix packed to these formats, FORMAT or FORMAT:GROUP_SIZE, comma-separated "
                        "(what quantize_(..., lm_head_bits=8 or 4, lm_head_group_size=...) makes of lm_head), "
                        "through torch.ops.ulb.linear, each with a stream read of its blobs")
    p.add_argument("--int8", action="store_true", help="shorthand for --packed int8")
    p.add_argument("--hugepages", action="store_true",
                   help="every timed buffer in 2 MiB pages (ulbtorch.hugepages, where quantize_ puts LinearBF16 "
                        "weights); default: where PyTorch allocates them, 4 KiB pages")
    p.add_argument("--reps", type=int, default=9, help="rounds of samples (median of per-round ratios)")
    p.add_argument("--json", help="write results as JSON here")
    p.add_argument("--markdown", help="write the results table as markdown here")
    args = p.parse_args(argv)
    try:
        packed = common.parse_grouped(args.packed) + ([("int8", 0)] if args.int8 else [])
        for fmt, gs in packed:
            if ulbtorch.get_format(fmt).bits < 4:
                raise ValueError(f"it is for the formats an lm_head may take (int8, int4), got {fmt!r}")
            ulbtorch.formats.normalize_group_size(gs, 1 << 30, fmt)
    except ValueError as e:
        p.error(f"--packed: {e}")
    labels = [f"{fmt}" + (f" g{gs}" if gs else "") for fmt, gs in packed]

    doc = common.load_shapes(args.shapes)
    threads = common.parse_list(args.threads, int)
    env = common.print_environment()
    print(f"# {'every buffer in 2 MiB pages' if args.hugepages else '4 KiB pages (no --hugepages)'}")
    if not ulbtorch.runtime.bf16_gemv_native:
        print(f"# note: no vector kernel for ISA {ulbtorch.runtime.get_isa()}, so ulb.linear_bf16 runs its scalar "
              "reference (nn.LinearBF16 would use F.linear)")
    table = common.Table([("model", "model", None), ("what", "layer", None), ("shape", "M x K", None),
                          ("threads", "thr", None), ("rot", "rot", None), ("us", "us ours", ".0f"),
                          ("us_bf16", "us F.linear", ".0f"), ("gbps", "GB/s ours", ".1f"),
                          ("gbps_bf16", "GB/s F.linear", ".1f"), ("gbps_stream", "GB/s stream", ".1f"),
                          ("pct_stream", "% stream", ".0f"), ("pct_stream_bf16", "F.linear % stream", ".0f"),
                          ("speedup", "x vs F.linear", ".2f")]
                         + [c for i, lab in enumerate(labels)
                            for c in ((f"us_{i}", f"us {lab}", ".0f"), (f"pct_stream_{i}", f"{lab} % stream", ".0f"),
                                      (f"x_{i}", f"{lab} x vs ours", ".2f"))],
                         title="One-token bf16 GEMV, cold", min_widths=dict(model=16, what=8, shape=12))
    gen = torch.Generator().manual_seed(0)
    prev = torch.get_num_threads()
    try:
        for model, what, M, K in shapes_to_run(doc, common.parse_list(args.models), args.gemv_shapes):
            nbytes = M * K * 2
            count = common.cold_rotation(nbytes)
            ws = common.replicate([torch.randn(M, K, generator=gen).to(torch.bfloat16)], count)
            if args.hugepages:
                ws = common.in_hugepages(ws)
            x = torch.randn(1, K, generator=gen).to(torch.bfloat16)
            rotations = []
            for fmt, gs in packed:
                f = ulbtorch.get_format(fmt)
                codes = torch.randint(0, f.max_code + 1, (M, K), generator=gen, dtype=torch.uint8)
                G = ulbtorch.formats.n_groups(ulbtorch.formats.normalize_group_size(gs, K, f), K)
                blob = ulbtorch.ops.pack(codes, torch.rand(M, G, generator=gen) * 1e-3 + 1e-4, fmt, gs)
                del codes
                blobs = common.replicate([blob], common.cold_rotation(blob.numel()))
                rotations.append(common.in_hugepages(blobs) if args.hugepages else blobs)
                del blob
            for nt in threads:
                torch.set_num_threads(nt)
                samples = []
                # The stream read as one run per thread and as four (the
                # faster is the roofline: benchmarks/README.md, gemv.py).
                cands = [(ws, lambda w: torch.ops.ulb.linear_bf16(x, w, None)), (ws, lambda w: F.linear(x, w))]
                cands += [(ws, lambda w, k=k: ulbtorch.runtime.read_probe(w.view(-1), nt, k)) for k in (1, 4)]
                for bs in rotations:
                    cands += [(bs, lambda b: torch.ops.ulb.linear(x, b, None, M))]
                    cands += [(bs, lambda b, k=k: ulbtorch.runtime.read_probe(b, nt, k)) for k in (1, 4)]
                common.time_interleaved(cands, reps=args.reps, samples_out=samples)
                samples = [samples[0], samples[1], faster(samples[2], samples[3])] + [
                    s for i in range(len(packed)) for s in (samples[4 + 3 * i],
                                                            faster(samples[5 + 3 * i], samples[6 + 3 * i]))]
                ours, ref, stream = (statistics.median(s) for s in samples[:3])
                table.add(dict(model=model, what=what, shape=f"{M}x{K}", threads=nt,
                               rot=f"{count}x{nbytes / MiB:.1f}M", us=1e6 * ours, us_bf16=1e6 * ref,
                               gbps=nbytes / ours / 1e9, gbps_bf16=nbytes / ref / 1e9,
                               gbps_stream=nbytes / stream / 1e9,
                               pct_stream=100 * common.median_ratio(samples[2], samples[0]),
                               pct_stream_bf16=100 * common.median_ratio(samples[2], samples[1]),
                               speedup=common.median_ratio(samples[1], samples[0]),
                               **{k: v for i in range(len(packed)) for k, v in (
                                   (f"us_{i}", 1e6 * statistics.median(samples[3 + 2 * i])),
                                   (f"pct_stream_{i}", 100 * common.median_ratio(samples[4 + 2 * i], samples[3 + 2 * i])),
                                   (f"x_{i}", common.median_ratio(samples[0], samples[3 + 2 * i])))}),
                          echo=True)
            del ws, rotations
    finally:
        torch.set_num_threads(prev)

    notes = []
    print("\n## Summary (ratios measured in this run)")
    for nt in threads:
        rs = [r for r in table.rows if r["threads"] == nt]
        if rs:
            line = (f"{nt} thr: ulb.linear_bf16 median {statistics.median(r['pct_stream'] for r in rs):.0f}% of a "
                    f"stream read of the same weights, F.linear {statistics.median(r['pct_stream_bf16'] for r in rs):.0f}%;"
                    f" geomean {common.geomean(r['speedup'] for r in rs):.2f}x faster than F.linear, {len(rs)} shapes")
            for i, lab in enumerate(labels):
                line += (f"; {lab}: median {statistics.median(r[f'pct_stream_{i}'] for r in rs):.0f}% of a stream "
                         f"read of its blobs, geomean {common.geomean(r[f'x_{i}'] for r in rs):.2f}x faster than the "
                         "bf16 GEMV")
            print(line)
            notes.append(line)
    common.write_outputs([table], json_path=args.json, md_path=args.markdown,
                         meta=dict(env=env, args=vars(args)), notes=notes)


if __name__ == "__main__":
    main()

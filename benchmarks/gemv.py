"""Roofline GEMV (decode, N=1) and GEMM (prefill) benchmark of ulbtorch's
low-bit linear against bf16 torch.nn.functional.linear, in one run.

Cold by default: every timed call reads a different matrix out of a rotation
of ~600 MiB (more than 256 MiB even for the smallest shapes), so the weights
stream from DRAM as in a real model's decode step; a loop over one matrix
(--hot, labelled) measures L3 instead and flatters every kernel.

  python benchmarks/gemv.py --quick                    # smoke test: one small model, few reps
  python benchmarks/gemv.py                            # all models and shapes of shapes.json, 1 and 2 threads
  python benchmarks/gemv.py --models llama3-8b --hot   # add hot (single-matrix) columns
  python benchmarks/gemv.py --call module              # time LinearXBit.forward (default: its eager call)
  python benchmarks/gemv.py --call op                  # time torch.ops.ulb.linear (the dispatcher path)
  python benchmarks/gemv.py --prefill                  # also GEMM at N in shapes.json's prefill_tokens
"""
from __future__ import annotations

import argparse
import copy
import gc
import os
import statistics
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
from common import MiB  # noqa: E402

import ulbtorch  # noqa: E402
from ulbtorch.formats import get_format  # noqa: E402
from ulbtorch.nn import MODULE_FOR_FORMAT  # noqa: E402

N_DISTINCT = 2  # genuinely different random matrices per shape; the rest of a rotation are copies


def effective_group_size(group_size: int, K: int) -> int:
    """0 (one scale per row) when group_size is 0 or covers the whole row, as ulbtorch does."""
    return group_size if 0 < group_size < K else 0


def random_codes_scales(M: int, K: int, fmt: str, group_size: int, gen: torch.Generator):
    f = get_format(fmt)
    codes = torch.randint(0, f.max_code + 1, (M, K), dtype=torch.uint8, generator=gen)
    group_size = effective_group_size(group_size, K)
    G = 1 if not group_size else -(-K // group_size)
    scales = torch.rand(M, G, generator=gen) * 0.02 + 0.01  # per-channel (or per-group) scales
    return codes, scales


class OursRotation:
    """Distinct packed weights of one shape/format (raw blobs or nn modules)."""

    def __init__(self, M, K, fmt, group_size, rotate_bytes, min_bytes, module, gen, hugepages=False):
        self.M, self.K, self.fmt, self.module = M, K, fmt, module
        group_size = effective_group_size(group_size, K)
        bases = [random_codes_scales(M, K, fmt, group_size, gen) for _ in range(N_DISTINCT)]
        blobs = [ulbtorch.ops.pack(c, s, fmt, group_size) for c, s in bases]
        self.blob_bytes = blobs[0].numel()  # codes + scales + header: all the kernel reads of W
        self.count = common.cold_rotation(self.blob_bytes, rotate_bytes, min_bytes)
        if module:
            cls = MODULE_FOR_FORMAT[fmt]
            mods = [cls.from_codes(c, s, format=fmt, group_size=group_size) for c, s in bases]
            self.items = mods[:self.count]
            while len(self.items) < self.count:
                self.items.append(copy.deepcopy(mods[len(self.items) % len(mods)]))
        else:
            self.items = common.replicate(blobs, self.count)
        if hugepages and module:
            ulbtorch.hugepages.move_to_hugepages(torch.nn.ModuleList(self.items))
        elif hugepages:
            self.items = common.in_hugepages(self.items)
        self.total_bytes = self.count * self.blob_bytes

    def call(self, x, how):
        if self.module:
            return lambda m: m(x)
        return blob_call(how, x, self.M)


def blob_call(how, x, M):
    """fn(blob) = x W^T through `how`: "eager", the call the modules make first
    in eager mode (runtime.eager_linear), or "op", torch.ops.ulb.linear."""
    if how == "eager":
        eager = ulbtorch.runtime.eager_linear
        if eager is None:
            common.die("the eager fast path is off or not built for this torch; use --call op")
        return lambda b: eager(x, b, None, M)
    op = torch.ops.ulb.linear.default  # the overload the modules fall back to
    return lambda b: op(x, b, None, M)


def bf16_rotation(M, K, rotate_bytes, min_bytes, gen, hugepages=False):
    bases = [torch.randn(M, K, generator=gen).to(torch.bfloat16) * 0.02 for _ in range(N_DISTINCT)]
    count = common.cold_rotation(M * K * 2, rotate_bytes, min_bytes)
    items = common.replicate(bases, count)
    return common.in_hugepages(items) if hugepages else items


def time_hot(fn, reps):
    est = common.median_time(fn, reps=3, warmup=3)
    return common.median_time(fn, reps=reps, warmup=2, inner=common.calls_per_sample(est))


def call_cost_excess(fmt, how, reps):
    """Seconds a call of ours costs beyond a call of the read probe, apart
    from streaming and forking: both timed hot on work too small to fork, ours
    on one 64 x 64 panel, the probe on 8 KiB (one unit). Ours pays its way in
    (the torch dispatcher for the op), activation quantisation and an output
    tensor, the probe a ctypes call. A kernel that streamed as fast as the
    probe would still take this much longer per call, so t_stream / (t_stream
    + excess) estimates the most "% stream" that ours can reach on a shape
    (timed hot, the excess is a little smaller than a cold call's)."""
    gen = torch.Generator().manual_seed(1)
    codes, scales = random_codes_scales(64, 64, fmt, 0, gen)
    blob = ulbtorch.ops.pack(codes, scales, fmt, 0)
    x = torch.randn(1, 64, generator=gen).to(torch.bfloat16)
    buf = torch.zeros(8 * 1024, dtype=torch.uint8)
    call = blob_call(how, x, 64)
    t_op = time_hot(lambda: call(blob), reps)
    read, buf_item = common.raw_probe(1, 1), common.probe_item(buf)
    t_probe = time_hot(lambda: read(buf_item), reps)
    return max(0.0, t_op - t_probe)


def check_pool_threads(fmt, nt):
    bits = get_format(fmt).bits
    try:
        n = ulbtorch.runtime.scheduler_stats(bits)["nthreads"]
    except Exception:  # noqa: BLE001  (stats are informational)
        return
    if nt > 1 and n not in (0, nt):
        print(f"  WARNING: ulb thread pool used {n} threads while torch.get_num_threads() = {nt}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_shapes_arg(p)
    p.add_argument("--models", help="comma-separated subset of shapes.json's gemv_shapes (default: all)")
    p.add_argument("--threads", default="1,2", help="thread counts (default 1,2)")
    p.add_argument("--formats", default="int2_sym,ternary,binary",
                   help="comma-separated: int2_sym (2), int2, ternary, binary (1), int4 (4), int8 (8). "
                        "Default int2_sym,ternary,binary")
    p.add_argument("--group-size", type=int, default=0, help="0 = per-channel scales (default)")
    p.add_argument("--act-dtype", choices=["bf16", "fp32"], default="bf16",
                   help="dtype of the activations fed to our op (bf16 F.linear always gets bf16)")
    p.add_argument("--rotate-mib", type=float, default=common.COLD_MIB,
                   help=f"target size of each cold rotation (MiB; default {common.COLD_MIB}: 600, or 2.5x the L3)")
    p.add_argument("--min-rotate-mib", type=float, default=256, help="never rotate over less than this (MiB)")
    p.add_argument("--reps", type=int, default=15, help="timing samples per measurement (median)")
    p.add_argument("--hot", action="store_true", help="also time a single matrix over and over (L3-hot, labelled)")
    p.add_argument("--call", choices=["eager", "op", "module"], default="eager",
                   help="what to time: the modules' eager call of the kernel (runtime.eager_linear, default), "
                        "torch.ops.ulb.linear (the dispatcher path they fall back to), or LinearXBit.forward "
                        "(all per-call overhead)")
    p.add_argument("--module", action="store_true", help="same as --call module")
    p.add_argument("--prefill", nargs="?", const="", default=None, metavar="N1,N2",
                   help="also time GEMM at these token counts (default: shapes.json prefill_tokens); hot")
    p.add_argument("--no-gemv", action="store_true", help="skip the N=1 table (with --prefill)")
    p.add_argument("--isa", choices=ulbtorch.runtime.ISAS, help="force one kernel ISA")
    p.add_argument("--bw-mib", type=int, default=common.COLD_MIB,
                   help=f"buffer size of the read-bandwidth probe (MiB; default {common.COLD_MIB}, as the rotations)")
    p.add_argument("--quick", action="store_true",
                   help="smoke test: smollm2-135m only, 3 reps, 64 MiB rotations (indicative numbers only)")
    p.add_argument("--hugepages", action="store_true",
                   help="every buffer timed (our rotations, bf16's and the read probe's) in 2 MiB pages "
                        "(ulbtorch.hugepages, where quantize_ puts a model's packed weights); default: where "
                        "PyTorch allocates them, 4 KiB pages")
    p.add_argument("--json", help="write all rows as JSON here")
    p.add_argument("--markdown", help="write the tables as markdown here")
    args = p.parse_args(argv)
    if args.module:
        args.call = "module"
    args.module = args.call == "module"

    shapes_doc = common.load_shapes(args.shapes)
    all_models = shapes_doc["gemv_shapes"]
    if args.quick:
        args.models = args.models or "smollm2-135m"
        args.reps = min(args.reps, 3)
        args.rotate_mib = min(args.rotate_mib, 64)
        args.min_rotate_mib = min(args.min_rotate_mib, 48)  # cold only above the L3: quick_note says
        args.bw_mib = min(args.bw_mib, 256)
    models = common.parse_list(args.models) or list(all_models)
    for m in models:
        if m not in all_models:
            common.die(f"unknown model {m!r}; shapes.json has {sorted(all_models)}")
    threads = common.parse_list(args.threads, int)
    formats = common.parse_formats(args.formats)
    prefill_ns = None
    if args.prefill is not None:
        prefill_ns = common.parse_list(args.prefill, int) or list(shapes_doc.get("prefill_tokens", [32, 128, 512]))
        if args.quick and not args.prefill:
            prefill_ns = prefill_ns[:1]
    act_dtype = torch.bfloat16 if args.act_dtype == "bf16" else torch.float32
    rotate_bytes, min_bytes = int(args.rotate_mib * MiB), int(args.min_rotate_mib * MiB)

    common.select_isa(args.isa)
    env = common.print_environment()
    what = {"module": "LinearXBit.forward (module)", "op": "torch.ops.ulb.linear (dispatcher)",
            "eager": "runtime.eager_linear (the modules' eager call)"}[args.call]
    print(f"# ours: {what}, activations {args.act_dtype}; baseline: F.linear bf16; "
          f"cold rotation ~{args.rotate_mib:.0f} MiB (>= {args.min_rotate_mib:.0f} MiB); median of {args.reps}; "
          f"{'every buffer in 2 MiB pages' if args.hugepages else '4 KiB pages (no --hugepages)'}")

    bw = {}
    big_read = []  # 64 MiB slices of a --bw-mib buffer: beta, read in turn with the candidates
    if not args.no_gemv:
        print("# measuring DRAM read bandwidth ...")
        bw = common.measure_read_bandwidth(threads, size_bytes=args.bw_mib * MiB, reps=3 if args.quick else 5,
                                           verbose=True, hugepages=args.hugepages)
        big_read = common.beta_slices(args.bw_mib, args.hugepages)
    gen = torch.Generator().manual_seed(0)
    call_excess = {}  # format -> seconds an op call costs beyond a probe call (call_cost_excess)
    prev_threads = torch.get_num_threads()

    cols = [("model", "model", None), ("shape", "M x K", None), ("threads", "thr", None),
            ("format", "format", None), ("rot", "rot", None),
            ("us", "us ours", ".1f"), ("us_bf16", "us bf16", ".1f"),
            ("gbps", "GB/s ours", ".1f"), ("pct_bw", "% read BW", ".0f"),
            ("gbps_stream", "GB/s stream", ".1f"), ("pct_stream", "% stream", ".0f"),
            ("pct_ceiling", "call ceiling %", ".0f"),
            ("gbps_bf16", "GB/s bf16", ".1f"), ("speedup", "x vs bf16", ".2f")]
    if args.hot:
        cols += [("us_hot", "us hot", ".1f"), ("us_bf16_hot", "us bf16 hot", ".1f"),
                 ("speedup_hot", "x hot", ".2f")]
    widths = dict(model=max(map(len, models)), shape=11, rot=13, format=8)
    gemv = common.Table(cols, title="GEMV N=1, cold" + (" (+hot columns, L3-resident, labelled)" if args.hot else ""),
                        min_widths=widths)
    pre = common.Table([("model", "model", None), ("shape", "M x K", None), ("threads", "thr", None),
                        ("format", "format", None), ("N", "N", None),
                        ("us", "us ours", ".1f"), ("us_bf16", "us bf16", ".1f"),
                        ("gops", "GOP/s ours", ".1f"), ("gops_bf16", "GOP/s bf16", ".1f"),
                        ("speedup", "x vs bf16", ".2f")],
                       title="Prefill GEMM, hot (one matrix, weights L3/cache-resident where they fit)",
                       min_widths=widths)

    try:
        for model in models:
            for M, K in all_models[model]:
                shape = f"{M}x{K}"
                # -- GEMV, cold: bf16, every format and a read of each format's blobs,
                # sampled in turn so that their ratios share the same DRAM moment.
                if not args.no_gemv:
                    wb = bf16_rotation(M, K, rotate_bytes, min_bytes, gen, args.hugepages)
                    xb = torch.randn(1, K, generator=gen).to(torch.bfloat16)
                    bf16_rot_mib = len(wb) * M * K * 2 / MiB
                    rots = {fmt: OursRotation(M, K, fmt, args.group_size, rotate_bytes, min_bytes, args.module, gen,
                                              args.hugepages)
                            for fmt in formats}
                    x = torch.randn(1, K, generator=gen).to(act_dtype)
                    calls = {fmt: rot.call(x, args.call) for fmt, rot in rots.items()}
                    for nt in threads:
                        torch.set_num_threads(nt)
                        # The same blobs, read with the same pool, split and
                        # thread count, as one run per thread or several
                        # (whichever read the big buffer faster): the
                        # roofline for these blobs.
                        read = common.raw_probe(nt, bw[nt]["probe_streams"])
                        stream = [([common.probe_item(m.packed if args.module else m) for m in rot.items], read)
                                  for rot in rots.values()]
                        # beta in the same rounds (common.beta_slices)
                        stream.append(([common.probe_item(b) for b in big_read], read))
                        samples = []
                        times = common.time_interleaved(
                            [(wb, lambda w: F.linear(xb, w))] + [(rots[f].items, calls[f]) for f in formats] + stream,
                            reps=args.reps, samples_out=samples)
                        t_bf16, t_ours, t_stream = times[0], times[1:1 + len(formats)], times[1 + len(formats):-1]
                        s_ours, s_stream, s_big = samples[1:1 + len(formats)], samples[1 + len(formats):-1], samples[-1]
                        read_bw = common.BETA_SLICE / times[-1] / 1e9
                        bf16_us = 1e6 * t_bf16
                        for f in formats:
                            if not args.module and f not in call_excess:
                                call_excess[f] = call_cost_excess(f, args.call, args.reps)
                        if args.hot:
                            w0 = wb[0]
                            bf16_hot_us = 1e6 * time_hot(lambda: F.linear(xb, w0), args.reps)
                        for fmt, t, ts, so, ss in zip(formats, t_ours, t_stream, s_ours, s_stream):
                            rot = rots[fmt]
                            check_pool_threads(fmt, nt)
                            us = 1e6 * t
                            gbps = rot.blob_bytes / t / 1e9
                            row = dict(model=model, shape=shape, M=M, K=K, threads=nt, format=fmt,
                                       rot=f"{rot.count}x{rot.blob_bytes / MiB:.2f}M",
                                       rot_count=rot.count, blob_bytes=rot.blob_bytes,
                                       rot_mib=rot.total_bytes / MiB, bf16_rot_mib=bf16_rot_mib,
                                       us=us, us_bf16=bf16_us, gbps=gbps,
                                       pct_bw=common.pct_of_beta(rot.blob_bytes, s_big, so),
                                       read_bw=read_bw,
                                       gbps_stream=rot.blob_bytes / ts / 1e9,
                                       pct_stream=100 * common.median_ratio(ss, so),
                                       pct_ceiling=None if args.module else 100 * ts / (ts + call_excess[fmt]),
                                       gbps_bf16=M * K * 2 / (bf16_us * 1e-6) / 1e9,
                                       speedup=bf16_us / us, mode=args.call)
                            if args.hot:
                                item, call = rot.items[0], calls[fmt]
                                row["us_hot"] = 1e6 * time_hot(lambda: call(item), args.reps)
                                row["us_bf16_hot"] = bf16_hot_us
                                row["speedup_hot"] = bf16_hot_us / row["us_hot"]
                            gemv.add(row, echo=True)
                    del wb, rots, calls, stream
                    gc.collect()
                for fmt in formats:
                    # -- prefill GEMM, hot ----------------------------------------------
                    if prefill_ns:
                        gs = effective_group_size(args.group_size, K)
                        codes, scales = random_codes_scales(M, K, fmt, gs, gen)
                        blob = ulbtorch.ops.pack(codes, scales, fmt, gs)
                        mod = MODULE_FOR_FORMAT[fmt].from_codes(codes, scales, format=fmt, group_size=gs)
                        w = torch.randn(M, K, generator=gen).to(torch.bfloat16) * 0.02
                        for nt in threads:
                            torch.set_num_threads(nt)
                            for n in prefill_ns:
                                xp = torch.randn(n, K, generator=gen).to(torch.bfloat16)
                                xo = xp.to(act_dtype)
                                if args.module:
                                    t = time_hot(lambda: mod(xo), args.reps)
                                else:
                                    call = blob_call(args.call, xo, M)
                                    t = time_hot(lambda: call(blob), args.reps)
                                tb = time_hot(lambda: F.linear(xp, w), args.reps)
                                ops_ = 2 * M * K * n
                                pre.add(dict(model=model, shape=shape, M=M, K=K, threads=nt, format=fmt, N=n,
                                             us=1e6 * t, us_bf16=1e6 * tb, gops=ops_ / t / 1e9,
                                             gops_bf16=ops_ / tb / 1e9, speedup=tb / t,
                                             mode=args.call),
                                        echo=args.no_gemv)
                        del blob, mod, w
    finally:
        torch.set_num_threads(prev_threads)

    if pre.rows and not args.no_gemv:
        pre.print()

    # -- summary -------------------------------------------------------------------
    notes = []
    print("\n## Summary (ratios measured in this run)")
    for nt in bw:
        print(f"read bandwidth {nt} thread(s): {bw[nt]['gbps']:.1f} GB/s at the start ({bw[nt]['method']})" +
              common.in_round_beta_note([r["read_bw"] for r in gemv.rows if r["threads"] == nt]))
    if gemv.rows:
        for fmt in formats:
            for nt in threads:
                rs = [r for r in gemv.rows if r["format"] == fmt and r["threads"] == nt]
                if not rs:
                    continue
                line = (f"GEMV cold {fmt:8s} {nt} thr: geomean {common.geomean(r['speedup'] for r in rs):.2f}x vs bf16, "
                        f"median {statistics.median(r['pct_bw'] for r in rs):.0f}% of read BW, "
                        f"{statistics.median(r['pct_stream'] for r in rs):.0f}% of a stream read of the same blobs, "
                        f"which itself reads a median {statistics.median(100 * r['gbps_stream'] / r['read_bw'] for r in rs):.0f}% "
                        f"of read BW "
                        f"(bf16 median {statistics.median(100 * r['gbps_bf16'] / r['read_bw'] for r in rs):.0f}%), "
                        f"{len(rs)} shapes")
                if not args.module:
                    low = min(rs, key=lambda r: r["pct_ceiling"])
                    line += (f"; the call cost allows about {low['pct_ceiling']:.0f}% of stream at most "
                             f"on {low['model']} {low['shape']}")
                if args.hot:
                    line += f"; hot geomean {common.geomean(r['speedup_hot'] for r in rs):.2f}x"
                print(line)
                notes.append(line)
        # Weights a second of each format against the first, shape by shape (the same weights, in turn).
        for fmt in formats[1:]:
            pairs = {nt: [] for nt in threads}
            for r in gemv.rows:
                if r["format"] == formats[0]:
                    other = [o for o in gemv.rows if o["format"] == fmt and o["threads"] == r["threads"]
                             and o["model"] == r["model"] and o["shape"] == r["shape"]]
                    pairs[r["threads"]] += [r["us"] / o["us"] for o in other]
            every = [v for vs in pairs.values() for v in vs]
            if every:
                line = (f"GEMV cold weights/s {fmt} vs {formats[0]}: median "
                        + ", ".join(f"{statistics.median(vs):.3f}x ({nt} thr)" for nt, vs in pairs.items() if vs)
                        + f", {statistics.median(every):.3f}x over all {len(every)} shape x thread pairs")
                print(line)
                notes.append(line)
    if pre.rows:
        for fmt in formats:
            for nt in threads:
                for n in prefill_ns:
                    rs = [r for r in pre.rows if r["format"] == fmt and r["threads"] == nt and r["N"] == n]
                    if rs:
                        line = (f"prefill hot {fmt:8s} {nt} thr N={n}: geomean "
                                f"{common.geomean(r['speedup'] for r in rs):.2f}x vs bf16, {len(rs)} shapes")
                        print(line)
                        notes.append(line)
    if args.quick:
        print(common.quick_note(args.rotate_mib))
    meta = dict(env=env, args=vars(args), read_bw={k: v["gbps"] for k, v in bw.items()})
    common.write_outputs([t for t in (gemv, pre) if t.rows], json_path=args.json, md_path=args.markdown,
                         meta=meta, notes=notes)


if __name__ == "__main__":
    main()

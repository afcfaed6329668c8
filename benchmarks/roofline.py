"""Roofline model of ulbtorch's GEMV (decode, N=1) checked against measurement.

Seed 000, section III-F: a core needs T = max(B/beta, gamma) to produce an
output vector from B bytes of weights, so its effective bandwidth is
e_bw = min(beta, B/gamma): the memory read rate or the kernel's up-convert &
compute throughput, whichever is lower. Here both terms are measured in GB/s
of packed weight bytes, in one process:

  beta_T   DRAM read bandwidth with T threads (common.measure_read_bandwidth)
  gamma    in-cache throughput of one thread: torch.ops.ulb.linear at N=1 on a
           matrix that sits in L2 (256 x 4096 by default), looped over, per
           format and ISA, in GB/s of packed blob bytes. "GB/s call" is
           bytes / whole-call time; the op also pays a fixed cost per call
           (dispatch, activation quantisation) that a 256 KiB matrix
           does not hide, so by default (--gamma-mode fit) gamma is the inverse
           slope of time vs bytes over M/2, M and 2M rows (all L2-resident),
           and the intercept is reported as "ovh us"
  model_T  min(beta_T, T * gamma); "model+ovh" adds the fixed cost back for
           each cold shape: bytes / (ovh + bytes / model_T)

then the cold GEMV bandwidth of real model shapes (rotating ~600 MiB of
distinct blobs, as gemv.py does) is printed next to model_T and beta_T, and
plotted (PNG, one panel per thread count).

  python benchmarks/roofline.py --quick                     # smoke test: falcon3-1b, 64 MiB rotations, 3 reps
  python benchmarks/roofline.py --png roofline.png --markdown roofline.md --json roofline.json
  python benchmarks/roofline.py --models llama3-8b --formats 2,1 --threads 2
  python benchmarks/roofline.py --hugepages          # beta and the weights in 2 MiB pages, as quantize_ places them
"""
from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
from common import MiB  # noqa: E402
from gemv import OursRotation, blob_call, check_pool_threads, random_codes_scales, time_hot  # noqa: E402

import ulbtorch  # noqa: E402

DEFAULT_MODELS = "falcon3-1b,bitnet-b1.58-2b,llama3-8b"
FORMAT_COLORS = {"int2_sym": "tab:orange", "int2": "tab:red", "ternary": "tab:blue", "binary": "tab:green"}


def parse_shape(s: str) -> tuple[int, int]:
    try:
        m, k = (int(v) for v in s.lower().split("x"))
    except ValueError:
        raise SystemExit(f"--gamma-shape wants MxK, e.g. 256x4096, got {s!r}")
    return m, k


def measure_gamma(isas, formats, M, K, act_dtype, reps, gen, how) -> dict:
    """{(isa, fmt): row} of one thread's in-cache throughput.

    gamma_call: bytes of the M x K blob / time of one whole call (its fixed
    per-call cost included). The call (`how`, as gemv.blob_call: the cold
    rows' call, so that "model+ovh" adds back what they pay) has a fixed cost
    (dispatch, activation quantisation, output) that a 256 KiB matrix does not
    hide, so it is timed at M/2, M and 2M rows (all L2-resident) and a line
    t = ovh + bytes / gamma is fitted: gamma (the kernel's throughput, the
    seed's B/gamma) is its inverse slope, ovh its intercept. Each ISA's
    blobs are packed under it, in the tile order it prefers (1-bit codes take
    "lanes" tiles under AVX2), as quantize_ would pack them on such a CPU.
    """
    out = {}
    row_counts = sorted({max(64, M // 2), M, 2 * M})
    with common.num_threads(1):
        for fmt in formats:
            bases = {m: random_codes_scales(m, K, fmt, 0, gen) for m in row_counts}
            x = torch.randn(1, K, generator=gen).to(act_dtype)
            for isa in isas:
                with ulbtorch.runtime.use_isa(isa):
                    blobs = {m: ulbtorch.ops.pack(c, s, fmt) for m, (c, s) in bases.items()}
                    ts = {m: time_hot(lambda b=b, f=blob_call(how, x, m): f(b), reps) for m, b in blobs.items()}
                xs = [blobs[m].numel() for m in row_counts]
                ys = [ts[m] for m in row_counts]
                slope, icpt = _fit_line(xs, ys)
                t = ts[M]
                nb = blobs[M].numel()
                gamma_call = nb / t / 1e9
                gamma_fit = 1 / slope / 1e9 if slope > 0 else float("nan")
                # A noisy fit can come out below the whole-call rate, which is a lower bound of it.
                fit_ok = slope > 0 and gamma_fit >= gamma_call
                out[(isa, fmt)] = dict(isa=isa, format=fmt, shape=f"{M}x{K}", kib=nb / 1024, blob_bytes=nb,
                                       us=1e6 * t, gamma_call=gamma_call, gcodes_call=M * K / t / 1e9,
                                       gamma_fit=gamma_fit if fit_ok else float("nan"),
                                       gcodes_fit=gamma_fit * M * K / nb if fit_ok else float("nan"),
                                       ovh_us=1e6 * icpt if fit_ok else float("nan"),
                                       fit_rows=",".join(map(str, row_counts)), fit_us=[1e6 * y for y in ys])
                del blobs
    return out


def _fit_line(xs, ys):
    """Least-squares slope and intercept."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    return slope, my - slope * mx


def model_bw(beta: float, gamma: float, nt: int) -> tuple[float, str]:
    """min(beta_T, T * gamma) and which term binds."""
    c = nt * gamma
    return (beta, "beta") if beta <= c else (c, "gamma")


def plot(path, rows, threads, formats, beta_gbps, gammas, isa, title_extra=""):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.lines import Line2D
    except ImportError:
        print(f"matplotlib is not installed: no plot ({path}). Install it with `pip install matplotlib` "
              "and run again.")
        return
    shapes = []  # (model, shape) in measurement order
    for r in rows:
        key = (r["model"], r["shape"])
        if key not in shapes:
            shapes.append(key)
    fig, axes = plt.subplots(len(threads), 1, figsize=(max(9, 0.9 * len(shapes) + 6), 4.4 * len(threads)),
                             squeeze=False)
    width = 0.8 / max(1, len(formats))
    ymax = max([beta_gbps[nt] for nt in threads] + [r["gbps"] for r in rows]) * 1.12
    for ax, nt in zip(axes[:, 0], threads):
        beta = beta_gbps[nt]
        ax.axhline(beta, color="black", lw=2.5, label=f"β read BW, {nt} thr = {beta:.1f}", zorder=2)
        for j, fmt in enumerate(formats):
            xs, ys = [], []
            for i, key in enumerate(shapes):
                r = next((r for r in rows if (r["model"], r["shape"]) == key and r["format"] == fmt
                          and r["threads"] == nt), None)
                if r:
                    xs.append(i - 0.4 + width * (j + 0.5))
                    ys.append(r["gbps"])
            color = FORMAT_COLORS.get(fmt)
            ax.bar(xs, ys, width, color=color, label=f"{fmt}: measured", zorder=1)
        model_handles = []
        for j, fmt in enumerate(formats):
            g = gammas.get((isa, fmt))
            if g:
                m, bind = model_bw(beta, g["gamma"], nt)
                # Interleaved dashes: model lines that coincide (all = beta) stay visible side by side.
                n = max(1, len(formats))
                ax.axhline(m, color=FORMAT_COLORS.get(fmt), lw=2,
                           ls=(4 * j, (4, 4 * (n - 1) + 0.01)) if n > 1 else "--", zorder=3)
                model_handles.append(Line2D([], [], color=FORMAT_COLORS.get(fmt), lw=2, ls="--",
                                            label=f"{fmt}: model min(β, {nt}·γ) = {m:.1f} "
                                                  + ("(γ-bound)" if bind == "gamma" else "(= β)")))
        prev = None
        for i, (model, _) in enumerate(shapes):  # separators between models
            if prev is not None and model != prev:
                ax.axvline(i - 0.5, color="grey", lw=0.8, ls=":")
            prev = model
        ax.set_xticks(range(len(shapes)))
        ax.set_xticklabels([f"{m}\n{s}" for m, s in shapes], fontsize=8)
        ax.set_xlim(-0.6, len(shapes) - 0.4)
        ax.set_ylim(0, ymax)
        ax.set_ylabel("attained GB/s\n(packed bytes / time)")
        ax.set_title(f"cold GEMV N=1, {nt} thread{'s' if nt > 1 else ''}, ISA {isa}{title_extra}")
        ax.grid(axis="y", alpha=0.3, zorder=0)
        handles, _ = ax.get_legend_handles_labels()
        ax.legend(handles=handles[:1] + model_handles + handles[1:], fontsize=8, loc="upper left",
                  bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    print(f"wrote {path}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_shapes_arg(p)
    p.add_argument("--models", default=DEFAULT_MODELS,
                   help=f"comma-separated models of shapes.json (default {DEFAULT_MODELS})")
    p.add_argument("--threads", default="1,2", help="thread counts (default 1,2)")
    p.add_argument("--formats", default="int2_sym,ternary,binary", help="default int2_sym,ternary,binary")
    p.add_argument("--isas", default="avx512,avxvnni,avx2",
                   help="ISAs whose in-cache gamma is measured (unsupported ones are skipped; default "
                        "avx512,avxvnni,avx2)")
    p.add_argument("--isa", choices=ulbtorch.runtime.ISAS,
                   help="ISA of the cold GEMV measurements (default: the library's default)")
    p.add_argument("--gamma-shape", default="256x4096",
                   help="M x K of the in-cache matrix (default 256x4096: 256 KiB at 2 bits, in L2)")
    p.add_argument("--gamma-reps", type=int, default=21, help="timing samples for gamma (median)")
    p.add_argument("--gamma-mode", choices=["fit", "call"], default="fit",
                   help="gamma of the model: 'fit' = kernel throughput without the fixed per-call cost (inverse "
                        "slope of time vs bytes over M/2, M, 2M rows; default), 'call' = bytes / whole-call time at M")
    p.add_argument("--act-dtype", choices=["bf16", "fp32"], default="bf16",
                   help="activations fed to the op (default bf16)")
    p.add_argument("--rotate-mib", type=float, default=common.COLD_MIB,
                   help=f"target size of each cold rotation (MiB; default {common.COLD_MIB}: 600, or 2.5x the L3)")
    p.add_argument("--min-rotate-mib", type=float, default=256, help="never rotate over less than this (MiB)")
    p.add_argument("--reps", type=int, default=15, help="timing samples per cold measurement (median)")
    p.add_argument("--bw-mib", type=int, default=common.COLD_MIB,
                   help=f"buffer size of the read-bandwidth probe (MiB; default {common.COLD_MIB}, as the rotations)")
    p.add_argument("--hugepages", action="store_true",
                   help="beta's buffer and the cold rotations in 2 MiB pages (ulbtorch.hugepages, where quantize_ "
                        "puts a model's packed weights), as gemv.py --hugepages; default: 4 KiB pages")
    p.add_argument("--png", help="write the plot here (default: no plot)")
    p.add_argument("--markdown", help="write the tables as markdown here")
    p.add_argument("--json", help="write all rows as JSON here")
    p.add_argument("--quick", action="store_true",
                   help="smoke test: falcon3-1b only, 64 MiB rotations, 3 reps (indicative numbers only)")
    args = p.parse_args(argv)

    shapes_doc = common.load_shapes(args.shapes)
    all_models = shapes_doc["gemv_shapes"]
    if args.quick:
        if args.models == DEFAULT_MODELS:
            args.models = "falcon3-1b"
        args.reps = min(args.reps, 3)
        args.gamma_reps = min(args.gamma_reps, 5)
        args.rotate_mib = min(args.rotate_mib, 64)
        args.min_rotate_mib = min(args.min_rotate_mib, 48)  # cold only above the L3: quick_note says
        args.bw_mib = min(args.bw_mib, 256)
    models = common.parse_list(args.models)
    for m in models:
        if m not in all_models:
            common.die(f"unknown model {m!r}; shapes.json has {sorted(all_models)}")
    threads = common.parse_list(args.threads, int)
    formats = common.parse_formats(args.formats)
    gM, gK = parse_shape(args.gamma_shape)
    act_dtype = torch.bfloat16 if args.act_dtype == "bf16" else torch.float32
    rotate_bytes, min_bytes = int(args.rotate_mib * MiB), int(args.min_rotate_mib * MiB)

    common.select_isa(args.isa)
    env = common.print_environment()
    cold_isa = ulbtorch.runtime.get_isa()
    supported = ulbtorch.runtime.supported_isas()
    isas = [i for i in common.parse_list(args.isas) if i in supported]
    skipped = [i for i in common.parse_list(args.isas) if i not in supported]
    if cold_isa not in isas:
        isas.append(cold_isa)  # the model of the cold rows needs its gamma
    print(f"# activations {args.act_dtype}; gamma on {args.gamma_shape}, 1 thread, ISAs {', '.join(isas)}"
          + (f" (unsupported here, skipped: {', '.join(skipped)})" if skipped else "")
          + f"; cold GEMV on ISA {cold_isa}, rotation ~{args.rotate_mib:.0f} MiB (>= {args.min_rotate_mib:.0f}), "
          f"median of {args.reps}; "
          + ("beta's buffer and the rotations in 2 MiB pages" if args.hugepages else "4 KiB pages (no --hugepages)"))

    # -- beta ----------------------------------------------------------------------
    print("# measuring DRAM read bandwidth (beta) ...")
    bw = common.measure_read_bandwidth(threads, size_bytes=args.bw_mib * MiB, reps=3 if args.quick else 5,
                                       verbose=True, hugepages=args.hugepages)
    gen = torch.Generator().manual_seed(0)

    # -- gamma ---------------------------------------------------------------------
    print(f"# measuring in-cache throughput (gamma), {args.gamma_shape}, 1 thread ...")
    # The modules' call (gemv.py's default), or the op where that is not built:
    # the cold rows' call, and the call whose fixed cost gamma's fit measures.
    cold_call = "eager" if ulbtorch.runtime.eager_linear is not None else "op"
    gammas = measure_gamma(isas, formats, gM, gK, act_dtype, args.gamma_reps, gen, cold_call)
    for g in gammas.values():
        use_fit = args.gamma_mode == "fit" and g["gamma_fit"] == g["gamma_fit"]  # not NaN
        g["gamma"] = g["gamma_fit"] if use_fit else g["gamma_call"]
        g["gamma_src"] = "fit" if use_fit else "call"
        if args.gamma_mode == "fit" and not use_fit:
            print(f"  WARNING: {g['isa']} {g['format']}: the time-vs-bytes fit was not usable (noise?); "
                  "the model uses the whole-call gamma")
    gcols = [("isa", "ISA", None), ("format", "format", None), ("kib", "KiB", ".0f"), ("us", "us/call", ".2f"),
             ("gamma_call", "GB/s call", ".1f"), ("gcodes_call", "Gcodes/s call", ".1f"),
             ("gamma_fit", "gamma GB/s", ".1f"), ("gcodes_fit", "Gcodes/s", ".1f"), ("ovh_us", "ovh us", ".1f")]
    for nt in threads:
        gcols += [(f"model{nt}", f"model {nt}thr GB/s", ".1f"), (f"bind{nt}", f"bound {nt}thr", None)]
    gtab = common.Table(gcols, title=(f"In-cache throughput per thread (gamma; {args.gamma_shape}, hot, 1 thread) "
                                      "and modelled effective bandwidth min(beta_T, T*gamma) "
                                      f"[gamma: {args.gamma_mode}]"))
    for isa in isas:
        for fmt in formats:
            g = gammas[(isa, fmt)]
            row = dict(g)
            for nt in threads:
                row[f"model{nt}"], bind = model_bw(bw[nt]["gbps"], g["gamma"], nt)
                row[f"bind{nt}"] = "memory (beta)" if bind == "beta" else "compute (gamma)"
            gtab.add(row)
    gtab.print()

    # -- cold GEMV -----------------------------------------------------------------
    cols = [("model", "model", None), ("shape", "M x K", None), ("threads", "thr", None),
            ("format", "format", None), ("rot", "rot", None), ("us", "us", ".1f"),
            ("gbps", "GB/s meas", ".1f"), ("model_gbps", "GB/s model", ".1f"),
            ("model_ovh_gbps", "model+ovh", ".1f"), ("beta", "beta GB/s", ".1f"),
            ("pct_beta", "% beta", ".0f"), ("pct_model", "% model", ".0f"), ("pct_model_ovh", "% model+ovh", ".0f")]
    widths = dict(model=max(map(len, models)), shape=11, rot=13, format=8, threads=3)
    cold = common.Table(cols, title=f"Cold GEMV N=1 (ISA {cold_isa}): measured vs modelled vs beta", min_widths=widths)
    prev_threads = torch.get_num_threads()
    beta_bufs = common.beta_slices(args.bw_mib, args.hugepages)  # kept: the items below are their addresses
    beta_items = [common.probe_item(b) for b in beta_bufs]
    try:
        for model in models:
            for M, K in all_models[model]:
                for fmt in formats:
                    rot = OursRotation(M, K, fmt, 0, rotate_bytes, min_bytes, False, gen, args.hugepages)
                    x = torch.randn(1, K, generator=gen).to(act_dtype)
                    call = rot.call(x, cold_call)
                    for nt in threads:
                        torch.set_num_threads(nt)
                        read = common.raw_probe(nt, bw[nt]["probe_streams"])
                        samples = []
                        t, t_beta = common.time_interleaved([(rot.items, call), (beta_items, read)],
                                                            reps=args.reps, samples_out=samples)
                        check_pool_threads(fmt, nt)
                        gbps = rot.blob_bytes / t / 1e9
                        # beta of the same rounds (common.beta_slices); the model's memory term too
                        beta = common.BETA_SLICE / t_beta / 1e9
                        pct_beta = common.pct_of_beta(rot.blob_bytes, samples[1], samples[0])
                        g = gammas[(cold_isa, fmt)]
                        mod, bind = model_bw(beta, g["gamma"], nt)
                        ovh = g["ovh_us"] * 1e-6 if g["gamma_src"] == "fit" else 0.0
                        mod_ovh = rot.blob_bytes / (ovh + rot.blob_bytes / (mod * 1e9)) / 1e9
                        cold.add(dict(model=model, shape=f"{M}x{K}", M=M, K=K, threads=nt, format=fmt,
                                      rot=f"{rot.count}x{rot.blob_bytes / MiB:.2f}M", rot_count=rot.count,
                                      blob_bytes=rot.blob_bytes, us=1e6 * t, gbps=gbps, model_gbps=mod,
                                      model_ovh_gbps=mod_ovh, bound=bind, beta=beta, pct_beta=pct_beta,
                                      pct_model=100 * gbps / mod, pct_model_ovh=100 * gbps / mod_ovh,
                                      isa=cold_isa), echo=True)
                    del rot, call
                    gc.collect()
    finally:
        torch.set_num_threads(prev_threads)

    # -- summary -------------------------------------------------------------------
    notes = []
    print("\n## Summary (measured in this run)")
    # The betas of the rounds, which % beta and the model used; the picture's beta line.
    in_rounds = {nt: [r["beta"] for r in cold.rows if r["threads"] == nt] for nt in threads}
    for nt in threads:
        line = (f"beta {nt} thread(s): {bw[nt]['gbps']:.1f} GB/s at the start ({bw[nt]['method']})" +
                common.in_round_beta_note(in_rounds[nt]))
        print(line)
        notes.append(line)
    for fmt in formats:
        for nt in threads:
            rs = [r for r in cold.rows if r["format"] == fmt and r["threads"] == nt]
            if not rs:
                continue
            g = gammas[(cold_isa, fmt)]
            line = (f"{fmt:8s} {nt} thr: gamma({cold_isa}) {g['gamma']:.1f} GB/s/thread, model "
                    f"{statistics.median(r['model_gbps'] for r in rs):.1f} GB/s (median; "
                    f"{'memory' if rs[0]['bound'] == 'beta' else 'compute'}-bound); "
                    f"cold median {statistics.median(r['gbps'] for r in rs):.1f} GB/s = "
                    f"{statistics.median(r['pct_beta'] for r in rs):.0f}% of beta, "
                    f"{statistics.median(r['pct_model'] for r in rs):.0f}% of model "
                    f"(min {min(r['pct_model'] for r in rs):.0f}%, max {max(r['pct_model'] for r in rs):.0f}%), "
                    f"{statistics.median(r['pct_model_ovh'] for r in rs):.0f}% of model+ovh, "
                    f"{len(rs)} shapes")
            print(line)
            notes.append(line)
    if args.quick:
        print(common.quick_note(args.rotate_mib))

    if args.png:
        plot(args.png, cold.rows, threads, formats, {nt: statistics.median(v) for nt, v in in_rounds.items() if v},
             gammas, cold_isa,
             (" (--quick)" if args.quick else "") + (", 2 MiB pages" if args.hugepages else ""))
    meta = dict(env=env, args=vars(args), read_bw={k: v["gbps"] for k, v in bw.items()}, cold_isa=cold_isa)
    common.write_outputs([gtab, cold], json_path=args.json, md_path=args.markdown, meta=meta, notes=notes)


if __name__ == "__main__":
    main()

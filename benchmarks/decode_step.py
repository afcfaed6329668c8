"""Where one greedy decode step of a quantized HF model goes, on the CPU: a
shapes.json config with random weights, quantize_ (ternary body and int8
head by default; --formats takes several, timed in the same rounds), in one
process, at each thread count, in rounds of:

  - layers only: every ulbtorch layer of the model called once on one
    token, in the model's order, nothing between the calls: the kernels'
    share of a step (the weights stream from DRAM as in a step);
  - eager: transformers' generate as it comes, ms per token after the first;
  - compiled: a copy after ulbtorch.compile_decode (static cache, compiled
    step, "ulb" attention);
  - compiled frozen: a copy after compile_decode(frozen=True) (no checks on
    the modules before each step);

each against the bound, the bytes a step reads over a plain read's GB/s
(best of before and after the rounds). Then torch.profiler over one generate
of the frozen copy: the ops by CPU time they take themselves, per decode
token, and what the step spends outside the layers.

  python benchmarks/decode_step.py                          # falcon3-1b, ternary + int8 head, 1 and 2 threads
  python benchmarks/decode_step.py --formats int4 --lm-head-bits 0 --threads 1
  python benchmarks/decode_step.py --formats ternary,ternary_base3 --variants layers,frozen --rounds 9
  python benchmarks/decode_step.py --quick                  # smoke test (2 layers, small vocabulary)

Generate runs without an EOS token (decode.build_model), as llama-bench's tg."""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
import decode  # noqa: E402

import ulbtorch  # noqa: E402
from ulbtorch.nn.linear import LowBitLinear  # noqa: E402

# --variants key -> row name
VARIANTS = {"layers": "layers only", "eager": "eager", "compiled": "compiled", "frozen": "compiled frozen"}


def layers_pass(layers: list, inputs: dict) -> float:
    """Seconds of one call of every layer, in order, on one token each."""
    t0 = time.perf_counter()
    for layer in layers:
        layer(inputs[layer.in_features])
    return time.perf_counter() - t0


def profile_step(model, ids, tokens: int, top: int) -> tuple[list[dict], float]:
    """torch.profiler over one generate: the `top` ops by self CPU time, in
    ms per decode token (the prompt's share included, spread over the
    tokens), and the self CPU ms per token outside ulb::linear."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        decode.generate(model, ids, tokens)
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    rows = [dict(op=e.key[:60], calls=e.count, ms_per_token=e.self_cpu_time_total / 1e3 / tokens,
                 us_per_call=e.self_cpu_time_total / max(e.count, 1)) for e in events[:top]]
    outside = sum(e.self_cpu_time_total for e in events if e.key != "ulb::linear") / 1e3 / tokens
    return rows, outside


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_shapes_arg(p)
    p.add_argument("--config", default="falcon3-1b", help="a key of shapes.json 'configs' (default falcon3-1b)")
    p.add_argument("--layers", type=int, help="override num_hidden_layers")
    p.add_argument("--vocab-size", type=int, help="override vocab_size")
    p.add_argument("--formats", default="ternary", help="comma-separated quantize_ formats of the body, each its "
                                                         "own models in the same rounds (default ternary)")
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help=f"comma-separated, of {','.join(VARIANTS)} (default all; the profile needs frozen)")
    p.add_argument("--lm-head-bits", type=int, default=8, help="8 or 4: lm_head packed, groups of 32; 0: bf16 "
                                                               "(quantize_'s default, the bf16 GEMV)")
    p.add_argument("--threads", default="1,2", help="comma-separated thread counts (default 1,2)")
    p.add_argument("--context", type=int, default=16, help="prompt tokens (default 16)")
    p.add_argument("--tokens", type=int, default=32, help="new tokens per sample (default 32)")
    p.add_argument("--rounds", type=int, default=5, help="rounds of every candidate in turn, median (default 5)")
    p.add_argument("--top", type=int, default=12, help="ops listed from the profile (default 12; 0: no profile)")
    p.add_argument("--quick", action="store_true", help="smoke test: 2 layers, vocabulary 1024, 8 tokens, 1 round")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write results as JSON here")
    args = p.parse_args(argv)
    if args.quick:
        args.layers, args.vocab_size, args.tokens, args.rounds = 2, 1024, 8, 1
    if args.tokens < 2:
        p.error("--tokens must be at least 2 (the rate leaves the first token out)")
    threads = common.parse_list(args.threads, int)
    formats = common.parse_formats(args.formats)
    variants = common.parse_list(args.variants)
    if not variants or any(v not in VARIANTS for v in variants):
        p.error(f"--variants: {args.variants!r}; choose from {', '.join(VARIANTS)}")
    top = args.top if "frozen" in variants else 0

    env = common.print_environment()
    cfg = dict(common.load_shapes(args.shapes)["configs"][args.config])
    for key, value in (("num_hidden_layers", args.layers), ("vocab_size", args.vocab_size)):
        if value:
            cfg[key] = value
    base = decode.build_model(cfg, args.seed)
    head = dict(lm_head_bits=args.lm_head_bits, lm_head_group_size=32) if args.lm_head_bits else {}
    cands, step_bytes, layer_lists = [], {}, {}
    for fmt in formats:
        model = ulbtorch.quantize_(copy.deepcopy(base), format=fmt, method="absmax", **head)
        step_bytes[fmt] = common.step_bytes(model)
        layer_lists[fmt] = [m for m in model.modules() if isinstance(m, LowBitLinear)]
        for v in variants:
            m = model
            if v in ("compiled", "frozen"):
                m = copy.deepcopy(model)
                ulbtorch.hugepages.move_to_hugepages(m)  # a deep copy is in 4 KiB pages again
                ulbtorch.compile_decode(m, frozen=v == "frozen")
            cands.append(dict(fmt=fmt, variant=v, model=m))
        print(f"# {fmt}: {len(layer_lists[fmt])} ulbtorch layers, {step_bytes[fmt] / 2**20:.1f} MiB read a step")
    del base
    inputs = {k: torch.randn(1, 1, k, dtype=torch.bfloat16)
              for k in {m.in_features for ls in layer_lists.values() for m in ls}}
    ids = torch.randint(3, cfg["vocab_size"], (1, args.context), generator=torch.Generator().manual_seed(args.seed))
    print(f"# {args.config} ({cfg['num_hidden_layers']} layers), head "
          f"{f'int{args.lm_head_bits} g32' if args.lm_head_bits else 'bf16'}; {args.tokens} tokens after "
          f"{args.context}, {args.rounds} rounds of {len(cands)} in turn")

    def sample(c):
        if c["variant"] == "layers":
            return statistics.median(layers_pass(layer_lists[c["fmt"]], inputs) for _ in range(5))
        return decode.decode_seconds(c["model"], ids, args.tokens)

    table = common.Table([("threads", "thr", "d"), ("format", "format", None), ("variant", "variant", None),
                          ("ms", "ms/token", ".2f"), ("tok_s", "tok/s", ".2f"), ("pct_bound", "% of bound", ".1f"),
                          ("outside_ms", "ms beyond layers", ".2f")],
                         title=f"One decode step, {args.config}", min_widths={"format": 13, "variant": 15})
    profiles = common.Table([("threads", "thr", "d"), ("format", "format", None),
                             ("op", "op (compiled frozen)", None), ("calls", "calls", "d"),
                             ("ms_per_token", "self ms/token", ".3f"), ("us_per_call", "us/call", ".1f")],
                            title="Profile of a compiled frozen generate", min_widths={"op": 40})
    for nt in threads:
        with common.num_threads(nt), torch.inference_mode():
            beta = common.measure_read_bandwidth((nt,))[nt]["gbps"]
            # Warm up: compile, size the static caches for the timed length. The
            # frozen ones first: a frozen model whose first step finds the
            # guarded step of a copy compiled before it takes that step (torch's
            # isolate_recompiles falls back to shared steps), guards and all.
            for c in sorted(cands, key=lambda c: c["variant"] != "frozen"):
                sample(c)
            samples = [[] for _ in cands]
            for r in range(args.rounds):
                for j in range(len(cands)):
                    i = (r + j) % len(cands)
                    samples[i].append(sample(cands[i]))
            beta = max(beta, common.measure_read_bandwidth((nt,))[nt]["gbps"])
            print(f"  {nt} thread(s): plain read {beta:.1f} GB/s")
            layers_s = {c["fmt"]: statistics.median(s) for c, s in zip(cands, samples) if c["variant"] == "layers"}
            for c, s in zip(cands, samples):
                t, bound = statistics.median(s), step_bytes[c["fmt"]] / (beta * 1e9)
                outside = (t - layers_s[c["fmt"]]) * 1e3 if c["variant"] != "layers" and c["fmt"] in layers_s else None
                table.add(dict(threads=nt, format=c["fmt"], variant=VARIANTS[c["variant"]], ms=t * 1e3, tok_s=1 / t,
                               pct_bound=100 * bound / t, outside_ms=outside, samples_ms=[x * 1e3 for x in s],
                               read_gbps=beta, step_mib=step_bytes[c["fmt"]] / 2**20), echo=True)
            for c in cands:
                if top and c["variant"] == "frozen":
                    rows, outside = profile_step(c["model"], ids, args.tokens, top)
                    for row in rows:
                        profiles.add(dict(threads=nt, format=c["fmt"], **row))
                    profiles.add(dict(threads=nt, format=c["fmt"], op="(all but ulb::linear)", ms_per_token=outside))
    if profiles.rows:
        profiles.print()
    common.write_outputs([table] + ([profiles] if profiles.rows else []), json_path=args.json,
                         meta=dict(env=env, config=args.config, layers=cfg["num_hidden_layers"], formats=formats,
                                   lm_head_bits=args.lm_head_bits, step_bytes=step_bytes, tokens=args.tokens,
                                   context=args.context, rounds=args.rounds))


if __name__ == "__main__":
    main()

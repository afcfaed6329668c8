"""End-to-end greedy decode tokens/s: a Llama-architecture model with random
bf16 weights (built from a config in shapes.json) against deep copies of it
quantized with ulbtorch.quantize_, in one process, at one thread count.

  python benchmarks/decode.py --quick                          # smoke test (1 layer, 8 tokens, 1 rep)
  python benchmarks/decode.py                                  # falcon3-1b, bf16 vs 2-bit
  python benchmarks/decode.py --config bitnet-b1.58-2b --formats 2,ternary,1
  python benchmarks/decode.py --profile                        # + share of time in linear layers, Amdahl bound
  python benchmarks/decode.py --compile                        # + ulbtorch.compile_decode variants
  python benchmarks/decode.py --prompt-len 512 --tokens 8      # time to the first token of a long prompt
  python benchmarks/decode.py --config qwen3-30b-a3b --layers 4   # a mixture-of-experts model (packed experts)

Random weights are fine for speed: decode cost does not depend on values.
"""
from __future__ import annotations

import argparse
import copy
import gc
import os
import statistics
import sys
import time
import traceback
from collections import defaultdict

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

import ulbtorch  # noqa: E402
from ulbtorch import LowBitLinear, QuantConfig, get_format  # noqa: E402
from ulbtorch.integrations.hf_experts import is_fused_experts, parse_expert_layer_name  # noqa: E402
from ulbtorch.quantizers import default_method  # noqa: E402

LLAMA_DEFAULTS = dict(rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=4096,
                      tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)


# Mixture-of-experts configs (shapes.json has dense Llama ones only), each
# built as its own model type: the experts ulbtorch packs one layer per expert.
# The whole models do not fit in memory in bf16: run them with --layers 4.
MOE_CONFIGS = {
    "olmoe-1b-7b": dict(model_type="olmoe", hidden_size=2048, intermediate_size=1024, num_hidden_layers=16,
                        num_attention_heads=16, num_key_value_heads=16, num_experts=64, num_experts_per_tok=8,
                        vocab_size=50304),
    "qwen3-30b-a3b": dict(model_type="qwen3_moe", hidden_size=2048, intermediate_size=6144,
                          moe_intermediate_size=768, num_hidden_layers=48, num_attention_heads=32,
                          num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
                          vocab_size=151936),
}


def build_model(cfg: dict, seed: int):
    from transformers import AutoConfig, AutoModelForCausalLM
    torch.manual_seed(seed)
    cfg = dict(cfg)
    config = AutoConfig.for_model(cfg.pop("model_type", "llama"), **{**LLAMA_DEFAULTS, **cfg})
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.eval()
    model.generation_config.pad_token_id = config.pad_token_id
    # No EOS: generate runs every step without min_new_tokens' masking, an
    # arange + isin + where over the vocabulary a step (llama-bench's tg
    # samples nothing).
    model.generation_config.eos_token_id = None
    return model


def n_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def model_bytes(model: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))


@torch.inference_mode()
def generate(model, ids, n_new):
    return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n_new,
                          min_new_tokens=n_new, do_sample=False, use_cache=True)


def decode_seconds(model, ids, n_new: int) -> float:
    """One sample of seconds per token after the first: generate(n_new) less
    generate(1) (the prompt and the first token), over n_new - 1."""
    t0 = time.perf_counter()
    generate(model, ids, n_new)
    t1 = time.perf_counter()
    generate(model, ids, 1)
    return ((t1 - t0) - (time.perf_counter() - t1)) / (n_new - 1)


def time_decode(model, ids, n_new, reps, warmup=1):
    """Median seconds of generate(n_new) and of generate(1) (= prefill + 1 token)."""
    for _ in range(warmup):
        out = generate(model, ids, n_new)
    assert out.shape[1] == ids.shape[1] + n_new, out.shape
    t_full, t_one = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        out = generate(model, ids, n_new)
        t_full.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        generate(model, ids, 1)
        t_one.append(time.perf_counter() - t0)
    return statistics.median(t_full), statistics.median(t_one), out


def experts_ab(model, ids, n_new, rounds):
    """Decode tok/s with each packed experts module's layers in two calls of
    ulb.linear_many, and with one call a layer (what the experts do where one
    call would not serve), in turn, the order swapped every round."""
    import ulbtorch.integrations.hf_experts as experts
    one_call = experts._one_call_serves
    paths = {"two calls": one_call, "a call a layer": lambda layers, xs: False}
    tps, outs = {k: [] for k in paths}, {}
    try:
        for r in range(rounds):
            for name in (list(paths) if r % 2 == 0 else list(paths)[::-1]):
                experts._one_call_serves = paths[name]
                t0 = time.perf_counter()
                outs[name] = generate(model, ids, n_new)
                tps[name].append(n_new / (time.perf_counter() - t0))
    finally:
        experts._one_call_serves = one_call
    ratios = [a / b for a, b in zip(*tps.values())]
    print(f"  experts in two calls: {statistics.median(tps['two calls']):.2f} tok/s, a call a layer: "
          f"{statistics.median(tps['a call a layer']):.2f}; per round "
          f"{', '.join(f'{x:.3f}' for x in ratios)}x (median {statistics.median(ratios):.3f}x); "
          f"same tokens: {torch.equal(*outs.values())}")


class LinearTimer:
    """Forward hooks that add up wall time spent inside selected modules."""

    def __init__(self, model: nn.Module, classify):
        self.totals = defaultdict(float)
        self.calls = defaultdict(int)
        self.handles = []
        self._t0 = {}
        for name, m in model.named_modules():
            cat = classify(name, m)
            if cat is None:
                continue
            self.handles.append(m.register_forward_pre_hook(self._pre(name)))
            self.handles.append(m.register_forward_hook(self._post(name, cat)))

    def _pre(self, name):
        def hook(mod, inp):
            self._t0[name] = time.perf_counter()
        return hook

    def _post(self, name, cat):
        def hook(mod, inp, out):
            self.totals[cat] += time.perf_counter() - self._t0.pop(name)
            self.calls[cat] += 1
        return hook

    def reset(self):
        self.totals.clear()
        self.calls.clear()

    def remove(self):
        for h in self.handles:
            h.remove()


def profile_decode(model, ids, n_new, classify, reps=2):
    """Fractions of generate() wall time spent per module category (median over reps)."""
    timer = LinearTimer(model, classify)
    try:
        generate(model, ids, n_new)  # warm
        shares, totals = defaultdict(list), []
        for _ in range(reps):
            timer.reset()
            t0 = time.perf_counter()
            generate(model, ids, n_new)
            total = time.perf_counter() - t0
            totals.append(total)
            for cat, t in timer.totals.items():
                shares[cat].append(t)
        total = statistics.median(totals)
        return total, {cat: statistics.median(v) for cat, v in shares.items()}
    finally:
        timer.remove()


def amdahl(f: float, s: float) -> float:
    return 1.0 / ((1.0 - f) + f / s)


def head_variant(bits: int, group_size: int) -> str:
    """Row-name suffix of a variant with quantize_(..., lm_head_bits=bits)."""
    return f" +int{bits} lm_head" + (f" g{group_size}" if group_size else "")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_shapes_arg(p)
    p.add_argument("--config", default="falcon3-1b",
                   help="a key of shapes.json 'configs' or of MOE_CONFIGS here (default falcon3-1b)")
    p.add_argument("--layers", type=int, help="override num_hidden_layers (quick runs)")
    p.add_argument("--vocab-size", type=int, help="override vocab_size (quick runs)")
    p.add_argument("--formats", default="2", help="comma-separated: 2 (int2_sym), int2, ternary, 1 (binary); default 2")
    p.add_argument("--group-size", type=int, default=0, help="0 = per-channel scales (default)")
    p.add_argument("--method", default="fast",
                   help="scale rule passed to quantize_: absmax|absmean|mse|auto (library default)|fast. Default "
                        "fast = the library default unless that is the slow mse search (2-bit, ternary per "
                        "channel), then absmax: decode speed does not depend on it, and mse takes minutes on 1B+ "
                        "models on 2 cores")
    p.add_argument("--quantize-lm-head", action="store_true",
                   help="quantize lm_head too (quantize_ leaves it in bf16 by default)")
    p.add_argument("--bf16-gemv", action="store_true",
                   help="also time the bf16 model and each quantized variant with ulbtorch.bf16_gemv_ applied "
                        "(the bf16 linear layers, for quantized models lm_head, through ulbtorch's one-token bf16 "
                        "GEMV)")
    p.add_argument("--lm-head-bits", default="",
                   help="comma-separated B or B:GROUP_SIZE, B in {8, 4}: also time each quantized variant with "
                        "quantize_(..., lm_head_bits=B, lm_head_group_size=GROUP_SIZE): lm_head packed to int8 "
                        "(half the bytes of bf16) or int4 (a quarter); e.g. 8,4:32")
    p.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch.set_num_threads (default: current)")
    p.add_argument("--prompt-len", type=int, default=16, help="random prompt token ids (default 16)")
    p.add_argument("--tokens", type=int, default=32, help="max_new_tokens = min_new_tokens (default 32)")
    p.add_argument("--reps", type=int, default=3, help="timed generations per variant, median (default 3)")
    p.add_argument("--compile", action="store_true", help="also run each variant after ulbtorch.compile_decode "
                   "(static KV cache, compiled decode step)")
    p.add_argument("--profile", action="store_true",
                   help="share of decode time in linear layers (bf16) / ulb ops (quantized) and the Amdahl bound")
    p.add_argument("--experts-ab", type=int, default=0, metavar="ROUNDS",
                   help="MoE configs: also time each quantized variant's decode with the experts' layers in two "
                        "ulb.linear_many calls and with a call a layer, in turn for ROUNDS rounds")
    p.add_argument("--isa", choices=ulbtorch.runtime.ISAS, help="force one kernel ISA")
    p.add_argument("--thread-pool", choices=["torch", "ulb"], default="torch",
                   help="where ulbtorch's parallel regions run: PyTorch's intra-op threads (default) "
                        "or ulbtorch's own pool")
    p.add_argument("--no-hugepages", action="store_true",
                   help="quantize_(..., hugepages=False): packed weights left where PyTorch allocates them "
                        "(default: quantize_ moves them into 2 MiB pages; benchmarks/hugepages.py times both)")
    p.add_argument("--bf16-hugepages", action="store_true",
                   help="move the bf16 baseline's weights into 2 MiB pages too (move_to_hugepages(plain_linears="
                        "True)), so that \"x vs bf16\" compares the kernels in the same pages (default: the bf16 "
                        "model where PyTorch allocates it, as a stock user has it; 4 KiB pages under THP madvise)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="smoke test: 1 layer, vocab 32000, 8 tokens, 1 rep")
    p.add_argument("--json", help="write results as JSON here")
    p.add_argument("--markdown", help="write the results table as markdown here")
    args = p.parse_args(argv)
    try:
        args.lm_head_bits = common.parse_grouped(args.lm_head_bits, int)
        for head_bits, head_gs in args.lm_head_bits:
            ulbtorch.QuantConfig(lm_head_bits=head_bits, lm_head_group_size=head_gs)
        if any(b not in (4, 8) for b, _ in args.lm_head_bits):
            raise ValueError("bits must be 8 or 4")
    except ValueError as e:
        p.error(f"--lm-head-bits: {e}")
    if args.quantize_lm_head and args.lm_head_bits:
        p.error("--quantize-lm-head (lm_head in the layers' format) and --lm-head-bits exclude each other")

    if args.quick:
        args.layers = args.layers or 1
        args.vocab_size = args.vocab_size or 32000
        args.tokens = min(args.tokens, 8)
        args.reps = 1
    shapes_doc = common.load_shapes(args.shapes)
    configs = {**shapes_doc["configs"], **MOE_CONFIGS}
    if args.config not in configs:
        common.die(f"unknown config {args.config!r}; shapes.json has {sorted(shapes_doc['configs'])}, and this "
                   f"script {sorted(MOE_CONFIGS)}")
    cfg = dict(configs[args.config])
    if args.layers:
        cfg["num_hidden_layers"] = args.layers
    if args.vocab_size:
        cfg["vocab_size"] = args.vocab_size
    formats = common.parse_formats(args.formats)
    def method_for(fmt):
        if args.method == "auto":
            return None
        if args.method == "fast":
            gran = "group" if args.group_size else "channel"
            return "absmax" if default_method(get_format(fmt), gran) == "mse" else None
        return args.method

    torch.set_num_threads(args.threads)
    common.select_isa(args.isa)
    ulbtorch.runtime.set_thread_pool(args.thread_pool)
    env = common.print_environment()
    print(f"# config {args.config}: " + ", ".join(f"{k}={v}" for k, v in cfg.items()))
    print(f"# threads {torch.get_num_threads()}, prompt {args.prompt_len} random ids, greedy "
          f"{args.tokens} new tokens, median of {args.reps} (+1 warmup)")

    t0 = time.perf_counter()
    base = build_model(cfg, args.seed)
    print(f"# built bf16 model: {n_params(base) / 1e6:.0f} M params, {model_bytes(base) / 2**20:.0f} MiB "
          f"({time.perf_counter() - t0:.1f} s)")
    gen = torch.Generator().manual_seed(args.seed)
    ids = torch.randint(3, cfg["vocab_size"], (1, args.prompt_len), generator=gen)

    # lm_head stock here; --bf16-gemv adds each variant again with quantize_'s default (lm_head on the GEMV).
    qcfg_kw = dict(group_size=args.group_size, bf16_gemv=False, hugepages=not args.no_hugepages)
    if args.quantize_lm_head:
        qcfg_kw["exclude"] = []

    table = common.Table([("variant", "variant", None), ("mib", "weights MiB", ".0f"),
                          ("tok_s", "tok/s", ".2f"), ("decode_tok_s", "decode tok/s", ".2f"),
                          ("ms_tok", "ms/token", ".1f"), ("speedup", "x vs bf16", ".2f"),
                          ("decode_speedup", "x decode", ".2f"), ("ttft_ms", "ms 1st token", ".1f"),
                          ("ttft_speedup", "x 1st token", ".2f")],
                         title=f"Greedy decode, {args.config} ({cfg['num_hidden_layers']} layers), "
                               f"{torch.get_num_threads()} threads", min_widths=dict(variant=28))
    results = {}

    def run_variant(name, model):
        t_full, t_one, out = time_decode(model, ids, args.tokens, args.reps)
        dec = (t_full - t_one) / max(1, args.tokens - 1) if args.tokens > 1 else float("nan")
        r = dict(variant=name, mib=model_bytes(model) / 2**20, t_generate_s=t_full, t_prefill_plus1_s=t_one,
                 tok_s=args.tokens / t_full, decode_tok_s=1.0 / dec if dec > 0 else float("nan"),
                 ms_tok=1e3 * t_full / args.tokens, ttft_ms=1e3 * t_one)
        ref = results.get("bf16")
        r["speedup"] = r["tok_s"] / ref["tok_s"] if ref else 1.0
        r["decode_speedup"] = r["decode_tok_s"] / ref["decode_tok_s"] if ref else 1.0
        # The prompt's forward (prefill, a GEMM per layer) and the first token.
        r["ttft_speedup"] = ref["ttft_ms"] / r["ttft_ms"] if ref else 1.0
        results[name] = r
        table.add(r, echo=True)
        return out

    def run_compiled(name, model):
        if not args.compile:
            return
        try:
            m = copy.deepcopy(model)
            if not args.no_hugepages:  # a deep copy is in 4 KiB pages again
                ulbtorch.hugepages.move_to_hugepages(m)
            ulbtorch.compile_decode(m, frozen=True)
            t0 = time.perf_counter()
            generate(m, ids, args.tokens)  # compiles
            print(f"  (torch.compile warmup of {name}: {time.perf_counter() - t0:.1f} s)")
            run_variant(name + " +compile", m)
        except Exception as e:  # noqa: BLE001
            print(f"  torch.compile of {name} failed: {type(e).__name__}: {str(e).splitlines()[0][:300]}")
            results[name + " +compile"] = dict(variant=name + " +compile", error=f"{type(e).__name__}: {e}"[:2000])
            if os.environ.get("ULB_BENCH_TRACEBACK"):
                traceback.print_exc()
        finally:
            torch._dynamo.reset()
            gc.collect()

    # -- bf16 baseline ----------------------------------------------------------------
    sel = QuantConfig(bits=2, **{k: v for k, v in qcfg_kw.items() if k == "exclude"})
    if args.bf16_hugepages:
        print(f"  bf16 baseline: {ulbtorch.hugepages.move_to_hugepages(base, plain_linears=True)}")
    ref_out = run_variant("bf16", base)
    run_compiled("bf16", base)
    prof = {}
    if args.profile:
        cls_bf16 = lambda n, m: (("quantizable" if sel.selects(n) else "other_linear")  # noqa: E731
                                 if type(m) is nn.Linear else "quantizable" if is_fused_experts(m) else None)
        total, parts = profile_decode(base, ids, args.tokens, cls_bf16)
        prof["bf16"] = dict(total_s=total, **{k + "_s": v for k, v in parts.items()})
    if args.bf16_gemv:  # the bf16 model itself with every linear layer on ulbtorch's bf16 GEMV
        gm = ulbtorch.bf16_gemv_(copy.deepcopy(base))
        if args.bf16_hugepages:  # the deep copy is in ordinary pages again
            ulbtorch.hugepages.move_to_hugepages(gm)
        run_variant("bf16 +bf16 gemv", gm)
        del gm
        gc.collect()

    # -- quantized variants -----------------------------------------------------------
    for fmt in formats:
        name = f"ulb {fmt}"
        t0 = time.perf_counter()
        method = method_for(fmt)
        qm = ulbtorch.quantize_(copy.deepcopy(base), format=fmt, method=method, **qcfg_kw)
        n_low = sum(isinstance(m, LowBitLinear) for m in qm.modules())
        print(f"  quantize_({fmt}, method={method or 'library default'}): {n_low} layers, "
              f"{time.perf_counter() - t0:.1f} s")
        out = run_variant(name, qm)
        results[name]["same_tokens_as_bf16"] = bool(torch.equal(out, ref_out))
        run_compiled(name, qm)
        if args.experts_ab and any(hasattr(m, "packed_down_proj") for m in qm.modules()):
            experts_ab(qm, ids, args.tokens, args.experts_ab)
        if args.profile:
            # a packed experts module whole (routing and gating included), not its layers again
            cls_q = lambda n, m: (None if parse_expert_layer_name(n) else  # noqa: E731
                                  "ulb" if isinstance(m, LowBitLinear) or hasattr(m, "packed_down_proj")
                                  else "other_linear" if type(m) is nn.Linear else None)
            total, parts = profile_decode(qm, ids, args.tokens, cls_q)
            prof[name] = dict(total_s=total, **{k + "_s": v for k, v in parts.items()})
        if args.bf16_gemv:
            ulbtorch.bf16_gemv_(qm)
            if not args.no_hugepages:  # the LinearBF16 weights too, as quantize_'s default would
                ulbtorch.hugepages.move_to_hugepages(qm)
            out = run_variant(name + " +bf16 gemv", qm)
            results[name + " +bf16 gemv"]["same_tokens_as_bf16"] = bool(torch.equal(out, ref_out))
            run_compiled(name + " +bf16 gemv", qm)
        del qm
        gc.collect()
        for head_bits, head_gs in args.lm_head_bits:
            vname = f"{name}{head_variant(head_bits, head_gs)}"
            qm = ulbtorch.quantize_(copy.deepcopy(base), format=fmt, method=method, lm_head_bits=head_bits,
                                    lm_head_group_size=head_gs, **qcfg_kw)
            out = run_variant(vname, qm)
            results[vname]["same_tokens_as_bf16"] = bool(torch.equal(out, ref_out))
            run_compiled(vname, qm)
            del qm
            gc.collect()

    # -- report ---------------------------------------------------------------------------
    notes = []
    print()
    for name in [f"ulb {fmt}{v}" for fmt in formats
                 for v in ["", " +bf16 gemv"] + [head_variant(b, gs) for b, gs in args.lm_head_bits]]:
        if name not in results:
            continue
        r = results[name]
        line = (f"{name[4:]}: {r['tok_s']:.2f} tok/s vs bf16 {results['bf16']['tok_s']:.2f} -> {r['speedup']:.2f}x "
                f"end to end ({r['decode_speedup']:.2f}x decode only); weights {results['bf16']['mib']:.0f} -> "
                f"{r['mib']:.0f} MiB")
        print(line)
        notes.append(line)
    if args.compile:
        for k, r in results.items():
            if k.endswith("+compile") and "error" in r:
                notes.append(f"{k}: failed ({r['error'].splitlines()[0][:200]})")

    if args.profile:
        b = prof["bf16"]
        f_q = b.get("quantizable_s", 0.0) / b["total_s"]
        f_all = (b.get("quantizable_s", 0.0) + b.get("other_linear_s", 0.0)) / b["total_s"]
        print(f"\n## Profile (forward hooks on linear modules; {args.tokens} new tokens)")
        print(f"bf16: {100 * f_all:.1f}% of generate() time in nn.Linear, {100 * f_q:.1f}% in the layers "
              f"quantize_ replaces (f), {100 * (f_all - f_q):.1f}% in the others (lm_head)")
        ptab = common.Table([("variant", "variant", None), ("f", "f (bf16)", ".3f"),
                             ("ulb_share", "ulb share", ".3f"), ("s_lin", "s linear (meas.)", ".2f"),
                             ("s_bytes", "s bytes", ".0f"), ("bound_bytes", "bound@bytes", ".2f"),
                             ("bound_meas", "bound@meas.", ".2f"), ("measured_hooked", "measured x (hooked)", ".2f"),
                             ("measured", "measured x", ".2f")],
                            title="Amdahl: bound = 1/((1-f)+f/s)", min_widths=dict(variant=22))
        for fmt in formats:
            name = f"ulb {fmt}"
            q = prof[name]
            s_bytes = 16 / common.FORMAT_BITS[fmt]
            s_lin = b.get("quantizable_s", 0.0) / q["ulb_s"] if q.get("ulb_s") else float("nan")
            row = dict(variant=name, f=f_q, ulb_share=q.get("ulb_s", 0.0) / q["total_s"], s_lin=s_lin,
                       s_bytes=s_bytes, bound_bytes=amdahl(f_q, s_bytes), bound_meas=amdahl(f_q, s_lin),
                       measured_hooked=b["total_s"] / q["total_s"], measured=results[name]["speedup"], profile=q)
            ptab.add(row)
            results[name]["amdahl"] = row
        ptab.print()
        print("f: share of bf16 decode time in the layers that get quantized; s bytes: 16 / bits per weight; "
              "s linear (meas.): bf16 time in those layers / time in ulb layers (from the hooks); "
              "measured x: end-to-end speed-up of the timed runs (without hooks); (hooked): of the profiled runs")
        results["_profile"] = prof

    if args.quick:
        print("(--quick: tiny model, few tokens; indicative only)")
    meta = dict(env=env, args=vars(args), config=cfg)
    common.write_outputs([table], json_path=args.json, md_path=args.markdown, meta=meta, notes=notes,
                         extra=dict(results=results))


if __name__ == "__main__":
    main()

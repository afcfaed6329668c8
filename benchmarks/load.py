"""Seconds and peak memory to load a GGUF file into packed ulbtorch layers:
ulbtorch.load_gguf against transformers' from_pretrained(gguf_file=...)
followed by ulbtorch.quantize_.

Writes a GGUF of a shapes.json config (Llama architecture, the decoder's
linear layers in --type with random blocks, embeddings and lm_head in F16,
no vocabulary), then loads it in a fresh process per variant, each
reporting its wall time and its peak RSS (the process's high-water mark,
and that mark less the RSS after its imports), so that neither variant
inherits the other's memory.

  python benchmarks/load.py                          # falcon3-1b, TQ2_0, 2 threads
  python benchmarks/load.py --layers 4 --type Q4_0   # quicker; Q4_0 comes back from quantize_ exactly
  python benchmarks/load.py --quick                  # smoke test: 1 layer, a small vocabulary
  python benchmarks/load.py --llama-cpp /path/to/llama-bench   # also save_gguf the loaded model and run it there

transformers cannot read Q1_0 or I2_S: for those only load_gguf runs.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

TYPES = {"TQ2_0": 35, "Q1_0": 41, "Q4_0": 2, "Q8_0": 8, "I2_S": 36}
# what quantize_ makes of the float weights transformers dequantises, per type (None: it cannot read the type)
QUANTIZE = {"TQ2_0": dict(bits="ternary", group_size=256), "Q4_0": dict(bits=4, group_size=32),
            "Q8_0": dict(bits=8, group_size=32), "Q1_0": None, "I2_S": None}


def _status_mib(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


def rss_mib() -> float:
    return _status_mib("VmRSS")


def peak_mib() -> float:
    # VmHWM, this address space's high-water mark: getrusage's ru_maxrss keeps the parent's peak across
    # fork and exec, so a child would report the memory its parent used writing the file.
    return _status_mib("VmHWM")


def random_blocks(rows: int, cols: int, ttype: str, gen: torch.Generator) -> np.ndarray:
    """Valid blocks of random codes and fp16 scales (I2_S: codes, then one fp32 scale)."""
    from ulbtorch.importers.gguf_blocks import ENCODED_AS, encode

    if ttype == "I2_S":
        codes = torch.randint(0, 3, (rows * cols // 4, 4), generator=gen, dtype=torch.uint8)
        packed = (codes << torch.tensor([6, 4, 2, 0], dtype=torch.uint8)).sum(1).to(torch.uint8)
        tail = np.zeros(32, np.uint8)
        tail[:4] = np.array([0.02], np.float32).view(np.uint8)
        return np.concatenate([packed.numpy(), tail])
    fmt, per = next((f, per) for f, (t, per) in ENCODED_AS.items() if t == TYPES[ttype])
    top = {"ternary": 3, "binary": 2, "int4": 16, "int8": 255}[fmt]
    codes = torch.randint(0, top, (rows, cols), generator=gen, dtype=torch.uint8)
    scales = (torch.rand(rows, cols // per, generator=gen) * 0.02 + 0.005).half()
    return encode(codes, scales, fmt)


def write_gguf(path: str, cfg: dict, ttype: str, seed: int) -> None:
    """The config as a llama GGUF, one tensor in memory at a time."""
    import gguf

    from ulbtorch.importers.gguf_blocks import nbytes_of

    gen = torch.Generator().manual_seed(seed)
    h, inter, layers, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim", h // heads)
    tensors = [("token_embd.weight", (vocab, h), "F16"), ("output_norm.weight", (h,), "F32"),
               ("output.weight", (vocab, h), "F16")]
    for b in range(layers):
        tensors += [(f"blk.{b}.attn_norm.weight", (h,), "F32"), (f"blk.{b}.ffn_norm.weight", (h,), "F32")]
        tensors += [(f"blk.{b}.{n}.weight", s, ttype) for n, s in (
            ("attn_q", (heads * head_dim, h)), ("attn_k", (kv * head_dim, h)), ("attn_v", (kv * head_dim, h)),
            ("attn_output", (h, heads * head_dim)), ("ffn_gate", (inter, h)), ("ffn_up", (inter, h)),
            ("ffn_down", (h, inter)))]
    w = gguf.GGUFWriter(path, "llama")
    for key, value in (("context_length", 4096), ("embedding_length", h), ("block_count", layers),
                       ("feed_forward_length", inter), ("attention.head_count", heads),
                       ("attention.head_count_kv", kv), ("rope.dimension_count", head_dim),
                       ("attention.key_length", head_dim), ("attention.value_length", head_dim),
                       ("vocab_size", vocab)):
        w.add_uint32(f"llama.{key}", value)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-6)
    w.add_float32("llama.rope.freq_base", 1e6)
    w.add_tokenizer_model("none")

    def data(shape, t):
        if t == "F32":
            return np.ones(shape, np.float32)
        if t == "F16":
            return (torch.randn(shape, generator=gen) * 0.02).half().numpy()
        return random_blocks(shape[0], shape[1], t, gen)
    for name, shape, t in tensors:
        raw = 0 if t == "F32" else 1 if t == "F16" else TYPES[t]
        w.add_tensor_info(name, shape, np.dtype(np.float32), nbytes_of(raw, shape), raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for _, shape, t in tensors:
        w.write_tensor_data(data(shape, t))
    w.close()


def child(args) -> None:
    """One variant in this process; prints its numbers as one JSON line."""
    # What either load imports, imported before the baseline: the numbers are the loads' own memory.
    import gguf  # noqa: F401
    import transformers.models.llama.modeling_llama  # noqa: F401
    from transformers import AutoModelForCausalLM

    import ulbtorch
    import ulbtorch.importers  # noqa: F401
    from ulbtorch.nn import LowBitLinear

    torch.set_num_threads(args.threads)
    base = rss_mib()
    out = dict(variant=args.child, rss_after_imports_mib=base)
    t0 = time.perf_counter()
    if args.child == "load_gguf":
        model = ulbtorch.load_gguf(args.file, dtype=torch.bfloat16)
        out["load_s"] = time.perf_counter() - t0
    else:
        model = AutoModelForCausalLM.from_pretrained(os.path.dirname(args.file), gguf_file=os.path.basename(args.file),
                                                     dtype=torch.bfloat16)
        out["load_s"] = time.perf_counter() - t0
        ulbtorch.quantize_(model, hugepages=False, **QUANTIZE[args.type])
        out["quantize_s"] = time.perf_counter() - t0 - out["load_s"]
    out["total_s"] = time.perf_counter() - t0
    out["peak_rss_mib"] = peak_mib()
    out["peak_over_imports_mib"] = out["peak_rss_mib"] - base
    out["model_mib"] = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers())) / 2**20
    out["packed_layers"] = sum(isinstance(m, LowBitLinear) for m in model.modules())
    with torch.no_grad():  # it runs
        model(torch.tensor([[1, 2, 3]]))
    if args.save_gguf:
        ulbtorch.save_gguf(model, args.save_gguf)
    print(json.dumps(out))


def run_child(args, variant: str, path: str, save: str | None = None) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", variant, "--file", path, "--type", args.type,
           "--threads", str(args.threads)] + (["--save-gguf", save] if save else [])
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        common.die(f"{variant} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def llama_cpp(binary: str, path: str) -> dict:
    """Run llama.cpp on the GGUF save_gguf wrote: llama-bench (a few tokens) or another tool's -m."""
    cmd = [binary, "-m", path, "-p", "8", "-n", "8"] if "bench" in os.path.basename(binary) else [
        binary, "-m", path, "-n", "8", "-p", "1 2 3", "--no-warmup"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    return dict(command=" ".join(cmd), returncode=done.returncode, output=(done.stdout + done.stderr)[-2000:])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_shapes_arg(p)
    p.add_argument("--config", default="falcon3-1b")
    p.add_argument("--layers", type=int, default=None, help="fewer decoder layers than the config's")
    p.add_argument("--vocab-size", type=int, default=None, help="a smaller vocabulary than the config's")
    p.add_argument("--quick", action="store_true", help="smoke test: 1 layer, a 1024-token vocabulary")
    p.add_argument("--type", default="TQ2_0", choices=sorted(TYPES))
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--llama-cpp", default=None, help="a llama.cpp binary (llama-bench or llama-cli) to run the "
                   "GGUF save_gguf writes of the loaded model")
    p.add_argument("--json", default=None)
    p.add_argument("--markdown", default=None)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--file", default=None, help=argparse.SUPPRESS)
    p.add_argument("--save-gguf", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        return child(args)
    env = common.print_environment()
    cfg = dict(common.load_shapes(args.shapes)["configs"][args.config])
    if args.quick:
        args.layers, args.vocab_size = args.layers or 1, args.vocab_size or 1024
    if args.layers:
        cfg["num_hidden_layers"] = args.layers
    if args.vocab_size:
        cfg["vocab_size"] = args.vocab_size
    title = (f"Load a {args.config} GGUF ({cfg['num_hidden_layers']} layers, {args.type} linears, F16 embeddings "
             f"and lm_head), {args.threads} threads")
    table = common.Table([("variant", "variant", None), ("total_s", "seconds", ".1f"),
                          ("load_s", "read s", ".1f"), ("quantize_s", "quantize_ s", ".1f"),
                          ("peak_rss_mib", "peak RSS MiB", ".0f"),
                          ("peak_over_imports_mib", "peak - imports MiB", ".0f"),
                          ("model_mib", "model MiB", ".0f"), ("file_mib", "file MiB", ".0f")], title=title)
    notes = []
    with tempfile.TemporaryDirectory(prefix="ulb_load_") as tmp:
        path = os.path.join(tmp, "model.gguf")
        t0 = time.perf_counter()
        write_gguf(path, cfg, args.type, args.seed)
        file_mib = os.path.getsize(path) / 2**20
        print(f"# wrote {file_mib:.0f} MiB in {time.perf_counter() - t0:.1f} s: {cfg}")
        saved = os.path.join(tmp, "saved.gguf") if args.llama_cpp else None
        variants = ["load_gguf"] + (["from_pretrained + quantize_"] if QUANTIZE[args.type] else [])
        if not QUANTIZE[args.type]:
            notes.append(f"transformers cannot read {args.type}: only load_gguf ran")
        for variant in variants:
            row = run_child(args, variant, path, saved if variant == "load_gguf" else None)
            row["file_mib"] = file_mib
            table.add(row, echo=True)
        if args.llama_cpp:
            result = llama_cpp(args.llama_cpp, saved)
            notes.append(f"llama.cpp ran the save_gguf output: `{result['command']}` exited {result['returncode']}")
            print(result["output"])
        else:
            notes.append("llama.cpp not run (--llama-cpp not given)")
    for n in notes:
        print(f"- {n}")
    common.write_outputs([table], json_path=args.json, md_path=args.markdown,
                         meta={"env": env, "args": vars(args), "config": cfg}, notes=notes)


if __name__ == "__main__":
    main()

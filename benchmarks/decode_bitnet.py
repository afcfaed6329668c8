"""Decode tokens/s of a BitNet checkpoint loaded through ulbtorch's importer.

Builds the bitnet-b1.58-2b config of shapes.json (Llama architecture) with
random ternary weights, writes it in Hugging Face's BitNet on-disk format
(uint8 [out/4, in] + weight_scale, quant_method "bitnet") to a temporary
directory, loads it with ulbtorch.importers.load_bitnet_checkpoint
(LinearTernary, per-tensor scale), and times greedy decode next to a bf16 model
and a 2-bit (quantize_) model of the same config, in one process.

  python benchmarks/decode_bitnet.py                 # 30 layers, 32 tokens, 2 threads
  python benchmarks/decode_bitnet.py --layers 4      # quicker
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
from decode import build_model, model_bytes, time_decode  # noqa: E402

import ulbtorch  # noqa: E402
from ulbtorch.importers import load_bitnet_checkpoint  # noqa: E402


def write_bitnet_checkpoint(model, directory: str) -> None:
    """Save `model` with every decoder linear ternarised and packed as HF does."""
    from safetensors.torch import save_file
    from transformers.integrations.bitnet import pack_weights

    state = {}
    for name, t in model.state_dict().items():
        if name.endswith(".weight") and (".self_attn." in name or ".mlp." in name):
            inv = 1.0 / t.float().abs().mean().clamp(min=1e-5)
            tern = (t.float() * inv).round().clamp(-1, 1)
            state[name] = pack_weights(tern)
            state[name[: -len("weight")] + "weight_scale"] = inv.reshape(1).to(torch.bfloat16)
        else:
            state[name] = t.contiguous()
    save_file(state, os.path.join(directory, "model.safetensors"))
    cfg = model.config.to_dict()
    cfg["quantization_config"] = {"quant_method": "bitnet", "linear_class": "bitlinear",
                                  "modules_to_not_convert": None}
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(cfg, f)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_shapes_arg(p)
    p.add_argument("--config", default="bitnet-b1.58-2b")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bf16-gemv", action="store_true",
                   help="also time the imported model with ulbtorch.bf16_gemv_ (its bf16 lm_head on the bf16 GEMV)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    common.print_environment()
    cfg = dict(common.load_shapes(args.shapes)["configs"][args.config])
    if args.layers:
        cfg["num_hidden_layers"] = args.layers
    ids = torch.randint(0, cfg["vocab_size"], (1, 16), generator=torch.Generator().manual_seed(args.seed))
    rows = []

    def record(name, model):
        t_full, t_one, _ = time_decode(model, ids, args.tokens, args.reps)
        rows.append(dict(variant=name, mib=model_bytes(model) / 2**20, tps=args.tokens / t_full,
                         dtps=(args.tokens - 1) / (t_full - t_one)))
        print(f"{name:28s} {rows[-1]['mib']:8.0f} MiB {rows[-1]['tps']:8.2f} tok/s "
              f"{rows[-1]['dtps']:8.2f} decode tok/s", flush=True)

    model = build_model(cfg, args.seed)
    print(f"# {args.config}: {cfg}\n# threads {args.threads}, 16-token prompt, {args.tokens} new tokens")
    record("bf16", model)
    tmp = tempfile.mkdtemp(prefix="ulb_bitnet_")
    try:
        write_bitnet_checkpoint(model, tmp)
        ulbtorch.quantize_(model, bits=2, method="absmax", bf16_gemv=False)  # lm_head as the import leaves it
        record("int2_sym (quantize_)", model)
        del model
        gc.collect()
        # lm_head stock bf16 as in the 2-bit row; --bf16-gemv then adds the GEMV.
        tern = load_bitnet_checkpoint(tmp, dtype=torch.bfloat16, bf16_gemv=False)
        record("ternary (HF BitNet import)", tern)
        if args.bf16_gemv:
            ulbtorch.bf16_gemv_(tern)
            record("ternary import +bf16 gemv", tern)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    base = rows[0]["tps"]
    print("\n| variant | weights MiB | tok/s | decode tok/s | x vs bf16 |\n|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['variant']} | {r['mib']:.0f} | {r['tps']:.2f} | {r['dtps']:.2f} | {r['tps'] / base:.2f} |")


if __name__ == "__main__":
    main()

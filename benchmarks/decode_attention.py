"""One decode step of attention (one query token) per layer call, on the
CPU: transformers' sdpa function (torch's scaled_dot_product_attention)
against ulbtorch's "ulb" attention (integrations/hf_attention.py), over
cache lengths, with a config's head layout from shapes.json, in turn.

  python benchmarks/decode_attention.py                      # falcon3-1b heads, lengths 16..4096, 1 thread
  python benchmarks/decode_attention.py --config llama3-8b --threads 2 --json out.json
  python benchmarks/decode_attention.py --quick              # smoke test

Timed with time.thread_time over calls on the same tensors (all in cache):
what a layer's attention costs the thread that runs it, which is what a
decode step adds to its weight stream. Inputs are bf16, as in a bf16 model."""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

from ulbtorch.integrations import hf_attention  # noqa: E402


class _Attention(torch.nn.Module):
    def __init__(self, groups):
        super().__init__()
        self.num_key_value_groups = groups
        self.is_causal = True


def time_call(fn, calls: int, rounds: int) -> float:
    """Median over rounds of thread CPU seconds per call."""
    fn()
    out = []
    for _ in range(rounds):
        t0 = time.thread_time()
        for _ in range(calls):
            fn()
        out.append((time.thread_time() - t0) / calls)
    return statistics.median(out)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_shapes_arg(p)
    p.add_argument("--config", default="falcon3-1b", help="a key of shapes.json 'configs' (its heads)")
    p.add_argument("--lengths", default="16,64,256,1024,4096", help="cache lengths (keys per head)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--calls", type=int, default=200, help="calls per round (default 200)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--quick", action="store_true", help="smoke test: lengths 16,64, 10 calls, 2 rounds")
    p.add_argument("--json", help="write results as JSON here")
    args = p.parse_args(argv)
    if args.quick:
        args.lengths, args.calls, args.rounds = "16,64", 10, 2
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    cfg = common.load_shapes(args.shapes)["configs"][args.config]
    heads, kv_heads = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    dim = cfg.get("head_dim", cfg["hidden_size"] // heads)
    env = common.print_environment()
    module = _Attention(heads // kv_heads).eval()
    table = common.Table([("length", "cache length", "d"), ("us_sdpa", "us sdpa, no mask", ".1f"),
                          ("us_ulb", "us ulb, no mask", ".1f"), ("x", "x no mask", ".2f"),
                          ("us_sdpa_mask", "us sdpa, mask", ".1f"), ("us_ulb_mask", "us ulb, mask", ".1f"),
                          ("x_mask", "x mask", ".2f")],
                         title=f"Decode attention, {args.config} heads ({heads} q, {kv_heads} kv, dim {dim}), "
                               f"{args.threads} thr")
    g = torch.Generator().manual_seed(0)
    with common.num_threads(args.threads), torch.inference_mode():
        for L in common.parse_list(args.lengths, int):
            q = torch.randn(1, heads, 1, dim, generator=g).bfloat16()
            k = torch.randn(1, kv_heads, L, dim, generator=g).bfloat16()
            v = torch.randn(1, kv_heads, L, dim, generator=g).bfloat16()
            # No mask: what a step of transformers' default (dynamic) cache
            # passes when every position is attended; a mask: a static
            # cache's step (its unused positions masked).
            mask = torch.ones(1, 1, 1, L, dtype=torch.bool)
            calls = {"sdpa": lambda: sdpa_attention_forward(module, q, k, v, None),
                     "ulb": lambda: hf_attention.attention_forward(module, q, k, v, None),
                     "sdpa_mask": lambda: sdpa_attention_forward(module, q, k, v, mask),
                     "ulb_mask": lambda: hf_attention.attention_forward(module, q, k, v, mask)}
            t = {name: time_call(fn, args.calls, args.rounds) for name, fn in calls.items()}
            table.add(dict(length=L, **{f"us_{n}": 1e6 * v for n, v in t.items()}, x=t["sdpa"] / t["ulb"],
                           x_mask=t["sdpa_mask"] / t["ulb_mask"]), echo=True)
    print(f"per layer and token; x = sdpa / ulb (in eager mode; compiled, transformers' sdpa function takes "
          f"another path). A decode step runs {cfg['num_hidden_layers']} of these.")
    if args.quick:
        print("(--quick: few calls, the numbers mean nothing)")
    common.write_outputs([table], json_path=args.json, meta=dict(env=env, args=vars(args), config=cfg))


if __name__ == "__main__":
    main()

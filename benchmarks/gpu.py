"""The Triton kernels (ulbtorch/triton/) on a GPU, against the device's own
read of the same bytes and bf16 F.linear (cuBLAS), in one run:

- GEMV (one token) of the shapes of --models: each call timed inside a
  CUDA graph of many calls (a launch costs several us, a small GEMV less),
  rotating over enough distinct weights that they stream from HBM, not L2;
  GB/s of packed bytes, % of a plain read of the same bytes (a reduction
  over them, in its own graph), and the speed-up over bf16 F.linear;
- prefill (--prefill tokens) in TFLOP/s against bf16 F.linear and
  torch._int_mm (int8 x int8 -> int32, the int8 peak the GEMM is held to);
- --decode CONFIG: greedy decode of a model built from shapes.json's
  config (random weights), bf16 against each format, in HF with a static
  cache and torch.compile(mode="reduce-overhead") (CUDA graphs).

    python benchmarks/gpu.py --models falcon3-1b,bitnet-b1.58-2b,llama3-8b --decode falcon3-1b --json out.json

--smoke runs every path once on tiny shapes on the CPU, in Triton's
interpreter, without graphs: the numbers mean nothing; it proves the script
runs where no GPU is (tests/test_benchmarks.py).
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys

if "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import Table, add_shapes_arg, load_shapes, parse_formats, parse_list, write_outputs  # noqa: E402

import ulbtorch  # noqa: E402
from ulbtorch import FORMATS, ops  # noqa: E402
from ulbtorch import triton as accel  # noqa: E402

MiB = 1 << 20
SMOKE_SHAPES = {"tiny": [[64, 128], [96, 64]]}


class Timer:
    """Seconds per call of fn: on a GPU, the replay of a CUDA graph of
    `calls` calls timed with events; on the CPU (smoke), the wall clock."""

    def __init__(self, device: torch.device, reps: int):
        self.device, self.reps = device, reps

    def per_call(self, fns: list, calls: int) -> float:
        if self.device.type != "cuda":
            import time
            t0 = time.perf_counter()
            for i in range(calls):
                fns[i % len(fns)]()
            return (time.perf_counter() - t0) / calls
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for f in fns:  # compile and warm outside the graph
                f()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for i in range(calls):
                fns[i % len(fns)]()
        graph.replay()
        torch.cuda.synchronize()
        times = []
        for _ in range(self.reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3 / calls)
        return sorted(times)[len(times) // 2]


def rotation(nbytes: int, cold_bytes: int) -> int:
    """Distinct copies of an nbytes weight that add up to cold_bytes."""
    return max(2, -(-cold_bytes // max(nbytes, 1)))


def kmajor_blob(fmt: str, M: int, K: int, device) -> torch.Tensor:
    f = FORMATS[fmt]
    codes = torch.randint(0, f.max_code + 1, (M, K), dtype=torch.uint8)
    return ops.retile(ops.pack(codes, torch.rand(M, 1) + 0.5, fmt, 0), "kmajor").to(device)


def gemv_rows(shapes, formats, device, timer, cold_bytes, calls) -> Table:
    t = Table([("shape", "M x K", None), ("format", "format", None), ("us", "us/call", ".2f"),
               ("gbs", "GB/s", ".0f"), ("read_pct", "% of read", ".0f"), ("vs_bf16", "vs bf16", ".2f"),
               ("bf16_us", "bf16 us", ".2f")], title="GEMV, one token (CUDA graph, weights cold)")
    for model, (M, K) in shapes:
        w = torch.randn(M, K, device=device, dtype=torch.bfloat16)
        ws = [w] + [torch.randn_like(w) for _ in range(rotation(w.numel() * 2, cold_bytes) - 1)]
        x = torch.randn(1, K, device=device, dtype=torch.bfloat16)
        t_bf16 = timer.per_call([lambda w=w: torch.nn.functional.linear(x, w) for w in ws], calls)
        del ws, w
        for fmt in formats:
            blob = kmajor_blob(fmt, M, K, device)
            blobs = [blob] + [blob.clone() for _ in range(rotation(blob.numel(), cold_bytes) - 1)]
            fid = FORMATS[fmt].id
            t_ours = timer.per_call([lambda b=b: torch.ops.ulb.triton_linear(x, b, None, fid, M, K, 0)
                                     for b in blobs], calls)
            words = [b[64:-64].view(torch.int32) for b in blobs]
            t_read = timer.per_call([lambda v=v: v.sum(dtype=torch.int32) for v in words], calls)
            t.add(dict(shape=f"{model} {M}x{K}", format=fmt, us=t_ours * 1e6, gbs=blob.numel() / t_ours / 1e9,
                       read_pct=100 * t_read / t_ours, vs_bf16=t_bf16 / t_ours, bf16_us=t_bf16 * 1e6), echo=True)
            del blobs, words
    return t


def prefill_rows(shapes, formats, tokens, device, timer, calls) -> Table:
    t = Table([("shape", "M x K", None), ("N", "N", None), ("format", "format", None), ("tflops", "TFLOP/s", ".1f"),
               ("vs_bf16", "vs bf16", ".2f"), ("vs_int8", "vs _int_mm", ".2f")], title="prefill GEMM")
    for model, (M, K) in shapes:
        for N in tokens:
            flop = 2 * N * M * K
            x = torch.randn(N, K, device=device, dtype=torch.bfloat16)
            w = torch.randn(M, K, device=device, dtype=torch.bfloat16)
            t_bf16 = timer.per_call([lambda: torch.nn.functional.linear(x, w)], calls)
            xi = torch.randint(-127, 128, (N, K), device=device, dtype=torch.int8)
            wi = torch.randint(-127, 128, (K, M), device=device, dtype=torch.int8)
            try:
                t_int8 = timer.per_call([lambda: torch._int_mm(xi, wi)], calls)
            except RuntimeError:  # _int_mm's shape rules (and the CPU's) differ by build
                t_int8 = float("nan")
            for fmt in formats:
                blob, fid = kmajor_blob(fmt, M, K, device), FORMATS[fmt].id
                t_ours = timer.per_call([lambda: torch.ops.ulb.triton_linear(x, blob, None, fid, M, K, 0)], calls)
                t.add(dict(shape=f"{model} {M}x{K}", N=N, format=fmt, tflops=flop / t_ours / 1e12,
                           vs_bf16=t_bf16 / t_ours, vs_int8=t_int8 / t_ours), echo=True)
    return t


def decode_rows(config: dict, formats, device, tokens: int, smoke: bool) -> Table:
    import time
    import transformers
    t = Table([("model", "model", None), ("tok_s", "tok/s", ".1f"), ("vs_bf16", "vs bf16", ".2f")],
              title=f"HF greedy decode, {tokens} tokens" + ("" if smoke else ", static cache + reduce-overhead"))
    cfg = transformers.LlamaConfig(**config)
    ids = torch.randint(3, cfg.vocab_size, (1, 16), device=device)
    base = None
    for fmt in [None, *formats]:
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
        if fmt:
            ulbtorch.quantize_(model, format=fmt)
        model.to(device)
        if not smoke:
            model.generation_config.cache_implementation = "static"
            model.forward = torch.compile(model.forward, mode="reduce-overhead")
        kw = dict(max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, pad_token_id=0)
        with torch.no_grad():
            model.generate(ids, **kw)  # compile, capture
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            model.generate(ids, **kw)
            if device.type == "cuda":
                torch.cuda.synchronize()
        tok_s = tokens / (time.perf_counter() - t0)
        base = base or tok_s
        t.add(dict(model=fmt or "bf16", tok_s=tok_s, vs_bf16=tok_s / base), echo=True)
        del model
    return t


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_shapes_arg(p)
    p.add_argument("--models", default="falcon3-1b,bitnet-b1.58-2b,llama3-8b")
    p.add_argument("--formats", default="int2_sym,ternary,binary,int4,int8")
    p.add_argument("--prefill", default="128,512,2048", help="token counts; '' for none")
    p.add_argument("--decode", help="a config of shapes.json to decode (HF), e.g. falcon3-1b")
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--cold-mib", type=int, default=512, help="bytes each rotation of weights adds up to")
    p.add_argument("--calls", type=int, default=200, help="calls per CUDA graph")
    p.add_argument("--reps", type=int, default=7, help="graph replays timed (the median is kept)")
    p.add_argument("--json")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU in Triton's interpreter")
    a = p.parse_args()
    formats = parse_formats(a.formats)
    if a.smoke:
        device, cold, calls = torch.device("cpu"), 0, 2
        shapes = [(m, tuple(s)) for m, ss in SMOKE_SHAPES.items() for s in ss]
        tokens = [17]
        config = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=256) if a.decode else None
    else:
        if not torch.cuda.is_available():
            raise SystemExit("benchmarks/gpu.py times CUDA graphs and needs a CUDA GPU (or --smoke)")
        if not accel.serves("cuda"):
            raise SystemExit("the Triton kernels need triton installed")
        device, cold, calls = torch.device("cuda"), a.cold_mib * MiB, a.calls
        doc = load_shapes(a.shapes)
        shapes = [(m, tuple(s)) for m in parse_list(a.models) for s in doc["gemv_shapes"][m]]
        tokens = parse_list(a.prefill, int) or []
        config = doc["configs"][a.decode] if a.decode else None
    accel.load()
    timer = Timer(device, 1 if a.smoke else a.reps)
    tables = [gemv_rows(shapes, formats, device, timer, cold, calls)]
    if tokens:
        tables.append(prefill_rows(shapes, formats, tokens, device, timer, calls))
    if config:
        with accel.emulate_on_cpu() if a.smoke else contextlib.nullcontext():
            tables.append(decode_rows(config, formats[:1] if a.smoke else formats, device,
                                      2 if a.smoke else a.decode_tokens, a.smoke))
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu (smoke: Triton interpreter)"
    write_outputs(tables, json_path=a.json, meta={"device": name, "torch": torch.__version__,
                                                  "triton": __import__("triton").__version__})


if __name__ == "__main__":
    main()

"""Head to head with llama.cpp (and torchao where its kernels run): one
shapes.json config with the same random ternary-valued weights in every
engine, greedy decode and prefill tok/s at matching formats and output
heads, each engine's share of the read bandwidth, in one run, in turn.

  python benchmarks/vs_llamacpp.py --build-only                  # build or reuse llama.cpp, print its bin folder
  python benchmarks/vs_llamacpp.py                               # falcon3-1b, 1 and 2 threads, every format and head
  python benchmarks/vs_llamacpp.py --json benchmarks/results/<machine>/<date>_vs_llamacpp.json
  python benchmarks/vs_llamacpp.py --formats ternary --heads q8_0 --threads 2 --rounds 5

What runs (benchmarks/peers/README.md has the details):
- llama.cpp from the llama-cpp-python sdist, built once with native CPU
  flags into --peers-dir (benchmarks/peers/llamacpp.py);
- the config as an HF folder of ternary-valued weights (peers/hf_model.py),
  then GGUF files two ways: ulbtorch.save_gguf of our quantized model (the
  same weights bit for bit: ternary -> TQ2_0, int4 g32 -> Q4_0, int8 g32 ->
  Q8_0) and llama.cpp's own convert_hf_to_gguf.py (bf16) + llama-quantize
  (TQ2_0, TQ1_0, Q4_0, Q8_0) with --output-tensor-type set to our head, and
  llama-quantize's default mix (its own choice of output type);
- per thread count and matching pair, rounds in turn: our HF decode
  (decode.generate: `--tokens` new tokens after a `--context` prompt, and
  the first token of a `--prompt-len` prompt), in eager mode and after
  ulbtorch.compile_decode(frozen=True) (static KV cache, compiled step
  without checks on the modules, ulbtorch's decode attention; its prefill
  is not timed), against llama-bench tg
  (same tokens at depth `--context`) and pp (`--prompt-len`);
- a plain read of a buffer larger than the caches at each thread count,
  before and after (common.measure_read_bandwidth, the best seen), and the
  bytes each engine reads per token (weights but the embedding), giving
  "% of the bound" = tok/s * bytes per token / read bandwidth.
Needs, beyond the repo's own: cmake and a C++ compiler (first run only),
sentencepiece (convert_hf_to_gguf.py imports it for llama models);
optional: torchao.
"""
from __future__ import annotations

import argparse
import copy
import gc
import hashlib
import json
import os
import statistics
import sys
import time
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
import decode  # noqa: E402
from peers import bitnet, hf_model, llamacpp, torchao_peer  # noqa: E402

import ulbtorch  # noqa: E402

# Our format -> (quantize_ keywords, the llama.cpp types holding the same kind of weights)
FORMATS = {
    "ternary": (dict(format="ternary", method="absmax"), ["TQ2_0"]),
    "ternary_base3": (dict(format="ternary_base3", method="absmax"), ["TQ1_0"]),
    "int4": (dict(format="int4", group_size=32, method="absmax"), ["Q4_0"]),
    "int8": (dict(format="int8", group_size=32, method="absmax"), ["Q8_0"]),
}
# Our output head -> (quantize_ keywords, llama-quantize --output-tensor-type)
HEADS = {"bf16": ({}, "bf16"), "q8_0": (dict(lm_head_bits=8, lm_head_group_size=32), "q8_0")}
SOURCES = ("save_gguf", "llama-quantize")
# How ours runs -> its engine name: HF eager generate, and generate after
# ulbtorch.compile_decode(frozen=True) (static KV cache, compiled decode step)
OURS = {"eager": "ulbtorch HF eager", "compiled": "ulbtorch HF compiled"}


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_shapes_arg(p)
    p.add_argument("--model", default="falcon3-1b", help="a key of shapes.json 'configs' (default falcon3-1b)")
    p.add_argument("--layers", type=int, help="override num_hidden_layers")
    p.add_argument("--vocab-size", type=int, help="override vocab_size")
    p.add_argument("--peers-dir", default=llamacpp.default_peers_dir(),
                   help="where the peers are built (default $ULB_PEERS_DIR, else ~/.cache/ulbtorch/peers)")
    p.add_argument("--work-dir", help="where the model files are cached (default PEERS_DIR/models)")
    p.add_argument("--llama-cpp-python-version", help="the sdist to build (default: the newest in --peers-dir, "
                                                      "else the newest on PyPI)")
    p.add_argument("--jobs", type=int, default=2, help="parallel compile jobs of the llama.cpp build (default 2)")
    p.add_argument("--build-only", action="store_true", help="build or reuse llama.cpp, print its bin folder, exit")
    p.add_argument("--prepare-only", action="store_true",
                   help="build the peers and write every model file, time nothing (the timed run reuses them)")
    p.add_argument("--threads", default="1,2", help="comma-separated thread counts (default 1,2)")
    p.add_argument("--formats", default=",".join(FORMATS), help=f"our formats (default {','.join(FORMATS)})")
    p.add_argument("--heads", default=",".join(HEADS), help=f"output heads (default {','.join(HEADS)})")
    p.add_argument("--sources", default=",".join(SOURCES),
                   help="GGUF files from ulbtorch.save_gguf and/or llama.cpp's convert + llama-quantize "
                        f"(default {','.join(SOURCES)})")
    p.add_argument("--ours", default=",".join(OURS), help=f"how ours runs (default {','.join(OURS)})")
    p.add_argument("--no-mix", action="store_true", help="leave out llama-quantize's default mix")
    p.add_argument("--no-torchao", action="store_true", help="leave out torchao (default: in where installed)")
    p.add_argument("--bitnet-dir", help="a bitnet.cpp checkout with its llama.cpp submodule (see peers/README.md)")
    p.add_argument("--tokens", type=int, default=32, help="new tokens per decode sample (default 32)")
    p.add_argument("--context", type=int, default=16, help="prompt before the decode tokens (default 16)")
    p.add_argument("--prompt-len", type=int, default=512, help="prefill prompt (default 512; 0: no prefill)")
    p.add_argument("--rounds", type=int, default=3, help="rounds of samples in turn, median (default 3)")
    p.add_argument("--bw-mib", type=int, default=common.COLD_MIB, help="read-probe buffer, MiB")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write results as JSON here")
    p.add_argument("--markdown", help="write the table as markdown here")
    args = p.parse_args(argv)
    args.threads = common.parse_list(args.threads, int)
    for name, known in (("formats", FORMATS), ("heads", HEADS), ("sources", SOURCES), ("ours", OURS)):
        values = common.parse_list(getattr(args, name))
        bad = [v for v in values if v not in known]
        if bad or not values:
            p.error(f"--{name}: {bad or 'empty'}; choose from {', '.join(known)}")
        setattr(args, name, values)
    if args.tokens < 2:
        p.error("--tokens must be at least 2 (the decode rate leaves the first token out)")
    return args


def model_config(args) -> dict:
    configs = common.load_shapes(args.shapes)["configs"]
    if args.model not in configs:
        common.die(f"unknown --model {args.model!r}; {args.shapes} has {sorted(configs)}")
    cfg = dict(configs[args.model])
    if args.layers:
        cfg["num_hidden_layers"] = args.layers
    if args.vocab_size:
        cfg["vocab_size"] = args.vocab_size
    return cfg


def model_files(args, cfg: dict, log=print) -> tuple[str, dict]:
    """The cached HF folder of cfg (written when missing) and the path maker
    for GGUF files beside it."""
    meta = dict(config=cfg, seed=args.seed, ternary="s_row * {-1,0,1}, s_row = mean |w| of the random row",
                defaults=decode.LLAMA_DEFAULTS)
    key = hashlib.sha1(json.dumps(meta, sort_keys=True).encode()).hexdigest()[:10]
    root = os.path.join(os.path.abspath(args.work_dir or os.path.join(args.peers_dir, "models")),
                        f"{args.model}-{key}")
    hf = os.path.join(root, "hf")
    if not hf_model.folder_matches(hf, meta):
        t0 = time.perf_counter()
        model = hf_model.ternarize_(decode.build_model(cfg, args.seed), args.seed)
        hf_model.write_folder(model, hf, meta)
        del model
        gc.collect()
        log(f"  wrote {hf} ({time.perf_counter() - t0:.0f} s)")
    return hf, root


def cached(path: str, make, what: str, log=print) -> str:
    if not os.path.exists(path):
        t0 = time.perf_counter()
        make(path)
        log(f"  wrote {os.path.basename(path)} ({what}, {time.perf_counter() - t0:.0f} s)")
    return path


def llama_files(lc, args, hf: str, root: str, log=print) -> dict[tuple[str, str], list[dict]]:
    """{(format, head): [peer file, ...]}: llama.cpp's convert + quantize
    files of each pair (and the default mixes, with the head that gets them)."""
    if "llama-quantize" not in args.sources:
        return {}
    bf16 = cached(os.path.join(root, "convert-bf16.gguf"), lambda p: llamacpp.convert(lc, hf, p, "bf16"),
                  "convert_hf_to_gguf.py --outtype bf16", log)
    out: dict[tuple[str, str], list[dict]] = {}
    nthreads = max(args.threads)
    mix_head = "q8_0" if "q8_0" in args.heads else args.heads[0]
    for fmt in args.formats:
        for qtype in FORMATS[fmt][1]:
            for head in args.heads:
                path = cached(os.path.join(root, f"{qtype}-out_{HEADS[head][1]}.gguf"),
                              lambda p, q=qtype, o=HEADS[head][1]: llamacpp.quantize(lc, bf16, p, q, o, nthreads),
                              f"llama-quantize {qtype} --output-tensor-type {HEADS[head][1]}", log)
                out.setdefault((fmt, head), []).append(dict(name=f"llama.cpp {qtype}", source="convert+quantize",
                                                            path=path))
            if not args.no_mix:
                path = cached(os.path.join(root, f"{qtype}-mix.gguf"),
                              lambda p, q=qtype: llamacpp.quantize(lc, bf16, p, q, None, nthreads),
                              f"llama-quantize {qtype}, its default mix", log)
                head_type = llamacpp.tensor_types(path).get("output.weight", "?")
                out.setdefault((fmt, mix_head), []).append(dict(
                    name=f"llama.cpp {qtype} mix", source=f"convert+quantize, default mix, output {head_type}",
                    path=path))
    return out


def ulb_sample(model, ids_ctx, ids_pp, tokens: int) -> dict:
    """One timed sample of HF eager greedy decode (decode.generate): decode
    tok/s over tokens after the first, and prefill tok/s of ids_pp."""
    s = decode.decode_seconds(model, ids_ctx, tokens)
    out = dict(tg=1 / s if s > 0 else float("nan"), pp=None)
    if ids_pp is not None:
        t0 = time.perf_counter()
        decode.generate(model, ids_pp, 1)
        out["pp"] = ids_pp.shape[1] / (time.perf_counter() - t0)
    return out


def time_group(cands, threads: int, args, lc, ids_ctx, ids_pp) -> list:
    """Rounds of one sample of each candidate, in turn, each round starting
    one candidate later (as common.time_interleaved). cands: dicts with a
    GGUF "path" (llama-bench) or a "model" (in-process; "prefill": False
    leaves its prefill untimed). Returns each candidate's samples."""
    with common.num_threads(threads):
        # Warm up the in-process ones (llama-bench warms each run up itself)
        # with as many tokens as timed: a static cache sized for fewer would
        # be made again, and its graph compiled again, in the first round.
        for c in cands:
            if c.get("model") is not None:
                ulb_sample(c["model"], ids_ctx, ids_pp if c.get("prefill", True) else None, args.tokens)
        samples = [[] for _ in cands]
        n = len(cands)
        for r in range(args.rounds):
            for j in range(n):
                i = (r + j) % n
                c = cands[i]
                if c.get("model") is not None:
                    samples[i].append(ulb_sample(c["model"], ids_ctx, ids_pp if c.get("prefill", True) else None,
                                                 args.tokens))
                else:
                    res = llamacpp.bench(lc, c["path"], threads, n_gen=args.tokens, n_prompt=args.prompt_len,
                                         depth=args.context)
                    c["command"] = res["command"]
                    samples[i].append(dict(tg=res["tg"], pp=res["pp"]))
    return samples


def our_variants(qm, fmt: str, which: list[str]) -> list[dict]:
    """Our candidates: qm in HF eager, and a copy of it after compile_decode
    (the copy's weights moved into 2 MiB pages again, as quantize_ placed
    qm's). The compiled one's prefill is not timed: the prompt runs eager
    there too, and a long one would leave the static cache that long for the
    decode samples after it."""
    out = []
    for how in which:
        m = qm
        if how == "compiled":
            m = copy.deepcopy(qm)
            ulbtorch.hugepages.move_to_hugepages(m)
            ulbtorch.compile_decode(m, frozen=True)
        out.append(dict(model=m, name=OURS[how], ours=how, source=f"quantize_ {fmt}", bytes=common.step_bytes(m),
                        prefill=how != "compiled"))
    return out


def median_of(samples, key):
    vals = [s[key] for s in samples if s.get(key) is not None]
    return statistics.median(vals) if vals else None


def ratio(ours, theirs, key):
    """Median over rounds of ours / theirs (samples of one round were taken moments apart)."""
    pairs = [(a[key], b[key]) for a, b in zip(ours, theirs) if a.get(key) and b.get(key)]
    return common.median_ratio([a for a, _ in pairs], [b for _, b in pairs]) if pairs else None


def main(argv=None):
    args = parse_args(argv)
    env = common.print_environment()
    lc = llamacpp.build(args.peers_dir, args.llama_cpp_python_version, jobs=args.jobs)
    if args.build_only:
        print(lc.bin_dir)
        return
    cfg = model_config(args)
    print(f"# config {args.model}: " + ", ".join(f"{k}={v}" for k, v in cfg.items()))
    print(f"# llama.cpp {lc.version} ({lc.bin_dir}); decode: {args.tokens} tokens after {args.context}, prefill "
          f"{args.prompt_len} tokens; {args.rounds} rounds in turn")
    hf, root = model_files(args, cfg)
    peer_files = llama_files(lc, args, hf, root)
    base = hf_model.load_folder(hf)
    # No EOS: generate then runs --tokens steps without decode.generate's
    # min_new_tokens masking, an arange + isin + where over the vocabulary
    # every step (llama-bench's tg samples nothing).
    base.generation_config.eos_token_id = None
    gen = torch.Generator().manual_seed(args.seed)
    ids_ctx = torch.randint(3, cfg["vocab_size"], (1, args.context), generator=gen)
    ids_pp = torch.randint(3, cfg["vocab_size"], (1, args.prompt_len), generator=gen) if args.prompt_len else None

    skipped = []
    ao_models = {}
    if not args.no_torchao and not args.prepare_only:
        version = torchao_peer.available()
        if version is None:
            skipped.append("torchao: not installed (pip install --no-deps torchao)")
        else:
            for name, (m, reason) in torchao_peer.quantized(base, ids_ctx, decode.generate).items():
                if m is None:
                    skipped.append(f"torchao {version} {name}: does not run here ({reason})")
                else:
                    ao_models[name] = m
    bitnet_reason = bitnet.skip_reason(args.bitnet_dir)
    if bitnet_reason:
        skipped.append(f"bitnet.cpp: {bitnet_reason}")
    for s in skipped:
        print(f"  skipped: {s}")

    if not args.prepare_only:
        bw_before = common.measure_read_bandwidth(args.threads, size_bytes=args.bw_mib * common.MiB, verbose=True)
    groups = []  # (threads, fmt, head, cands, samples)
    same_weights = []
    for fmt in args.formats:
        for head in args.heads:
            qm = ulbtorch.quantize_(copy.deepcopy(base), **FORMATS[fmt][0], **HEADS[head][0])
            peers = [dict(f) for f in peer_files.get((fmt, head), [])]
            if "save_gguf" in args.sources:
                path = os.path.join(root, f"save_gguf-{fmt}-out_{HEADS[head][1]}.gguf")
                with warnings.catch_warnings():  # the bf16 head's fp32 scales rounded to the blocks' fp16
                    warnings.simplefilter("ignore")
                    try:
                        cached(path, lambda p, m=qm: ulbtorch.save_gguf(m, p), "ulbtorch.save_gguf of ours")
                    except ValueError as e:  # a format no GGUF type holds
                        skipped.append(f"save_gguf of {fmt} + {head} head: {e}")
                if os.path.exists(path):
                    qtype = llamacpp.tensor_types(path)["blk.0.ffn_up.weight"]
                    peers.insert(0, dict(name=f"llama.cpp {qtype}", source="save_gguf (our weights)", path=path))
                    twin = next((f["path"] for f in peer_files.get((fmt, head), [])
                                 if f["name"] == f"llama.cpp {qtype}"), None)
                    if twin:  # the token embedding differs by design: llama-quantize quantizes it, save_gguf not
                        differ = llamacpp.differing_tensors(path, twin)
                        same_weights.append(f"{os.path.basename(path)} against llama-quantize's "
                                            f"{os.path.basename(twin)}: {len(differ)} tensors differ "
                                            f"({', '.join(differ) or 'none'})")
            if args.prepare_only:
                del qm
                gc.collect()
                continue
            if head == "bf16":
                peers += [dict(name=f"torchao {n}", source="torchao quantize_", model=m)
                          for n, m in ao_models.items() if torchao_peer.MATCHES[n] == fmt]
            for p in peers:
                p["bytes"] = llamacpp.bytes_per_token(p["path"]) if "path" in p else common.step_bytes(p["model"])
            ours = our_variants(qm, fmt, args.ours)
            for t in args.threads:
                print(f"  timing {fmt} + {head} head, {t} thr: {len(ours)} of ours and {len(peers)} peers, "
                      f"{args.rounds} rounds", flush=True)
                cands = [dict(c) for c in ours] + [dict(p) for p in peers]
                groups.append((t, fmt, head, cands, time_group(cands, t, args, lc, ids_ctx, ids_pp)))
            del qm, ours
            gc.collect()
    if args.prepare_only:
        print(f"# model files ready in {root}")
        return
    bw_after = common.measure_read_bandwidth(args.threads, size_bytes=args.bw_mib * common.MiB, verbose=True)
    beta = {t: max(bw_before[t]["gbps"], bw_after[t]["gbps"]) for t in args.threads}

    table = common.Table([("threads", "thr", "d"), ("body", "body", None), ("head", "head", None),
                          ("engine", "engine", None), ("source", "file / source", None),
                          ("mib_tok", "MiB/token", ".1f"), ("tg_tok_s", "decode tok/s", ".2f"),
                          ("pct_bound", "% of bound", ".0f"), ("pp_tok_s", "prefill tok/s", ".1f"),
                          ("x_decode", "eager/peer decode", ".2f"), ("x_decode_compiled", "compiled/peer decode", ".2f"),
                          ("x_prefill", "ours/peer prefill", ".2f")],
                         title=f"vs llama.cpp, {args.model} ({cfg['num_hidden_layers']} layers)")
    notes = []
    for t, fmt, head, cands, samples in groups:
        ours = {c["ours"]: s for c, s in zip(cands, samples) if "ours" in c}
        eager = ours.get("eager", next(iter(ours.values())))
        for c, s in zip(cands, samples):
            tg = median_of(s, "tg")
            row = dict(threads=t, body=fmt, head=head, engine=c["name"], source=c["source"],
                       gguf=os.path.basename(c["path"]) if "path" in c else None, bytes_per_token=c["bytes"],
                       mib_tok=c["bytes"] / common.MiB, tg_tok_s=tg, pp_tok_s=median_of(s, "pp"),
                       pct_bound=100 * tg * c["bytes"] / (beta[t] * 1e9) if tg else None,
                       read_gbps=beta[t], samples=s, command=c.get("command"))
            if "ours" not in c:
                row.update(x_decode=ratio(ours["eager"], s, "tg") if "eager" in ours else None,
                           x_decode_compiled=ratio(ours["compiled"], s, "tg") if "compiled" in ours else None,
                           x_prefill=ratio(eager, s, "pp"))
            table.add(row)
        peer_idx = [i for i, c in enumerate(cands) if "ours" not in c]
        if peer_idx:
            i = max(peer_idx, key=lambda i: median_of(samples[i], "tg") or 0)
            notes.append(f"{t} thr, {fmt} + {head} head: the fastest peer {cands[i]['name']} ({cands[i]['source']}) "
                         f"{median_of(samples[i], 'tg'):.2f} tok/s; " + ", ".join(
                             f"ours {how} {median_of(s, 'tg'):.2f}: {ratio(s, samples[i], 'tg'):.2f}x"
                             for how, s in ours.items()))
    table.print()
    print("% of bound: decode tok/s x bytes read per token (weights but the embedding) / the read bandwidth of a "
          "plain read in this run (" + ", ".join(f"{t} thr {beta[t]:.1f} GB/s" for t in args.threads) + "); "
          "ours/peer: median over rounds of the ratio of samples taken in turn")
    notes += same_weights + [f"skipped: {s}" for s in skipped]
    for n in notes:
        print(n)
    meta = dict(env=env, args=vars(args), config=cfg, llama_cpp=dict(version=lc.version, bin_dir=lc.bin_dir),
                read_gbps=dict(before=bw_before, after=bw_after, used=beta))
    common.write_outputs([table], json_path=args.json, md_path=args.markdown, meta=meta, notes=notes)


if __name__ == "__main__":
    main()

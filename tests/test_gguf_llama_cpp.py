"""save_gguf's files run in llama.cpp itself: a tiny llama quantised by
ulbtorch to each format save_gguf writes (Q1_0, Q2_0, TQ2_0, Q4_0, Q8_0) is
written with its tokenizer, llama.cpp's llama-simple continues prompts
greedily from it, and ulbtorch, running the same file (load_gguf), must pick
the same tokens, or differ first at a tie: two tokens whose logits, with
the activations not rounded, are closer than the activation rounding moves
them (ulbtorch rounds a token's activations to int8 at once, llama.cpp in
blocks of 32 or 256).

Needs a llama.cpp build: the folder of its binaries in ULB_LLAMA_CPP_BIN,
else the build benchmarks/vs_llamacpp.py caches for this CPU (in
$ULB_PEERS_DIR or ~/.cache/ulbtorch/peers: `python benchmarks/vs_llamacpp.py
--build-only` makes it); skips saying where it looked otherwise."""
import importlib.util
import os
import subprocess
import sys
import warnings

import pytest
import torch
from torch import nn

pytest.importorskip("gguf")
pytest.importorskip("transformers")

import _gguf_writer as gw  # noqa: E402
from transformers.convert_slow_tokenizer import bytes_to_unicode  # noqa: E402

import ulbtorch  # noqa: E402
from ulbtorch.nn import LowBitLinear, replace_module  # noqa: E402

# format, group size: what save_gguf writes as each type
CASES = {"Q1_0": ("binary", 128), "Q2_0": ("int2", 64), "TQ2_0": ("ternary", 256), "Q4_0": ("int4", 32),
         "Q8_0": ("int8", 32)}
PROMPTS = ["hello, hell", "The quick brown", "0123", "GGUF blocks", "zzz", "a b c d"]
NEW_TOKENS = 12
# A vocabulary whose printed tokens read back as their ids: BOS, EOS, the 256 bytes (byte-level BPE) and the
# one merge transformers' GGUF tokenizer wants, of bytes 1 and 2. llama-simple prints a piece with printf("%s"),
# so the byte 0 would print as nothing: its lm_head row is zero, a logit of 0 that some other token beats.
BYTE_CHARS = bytes_to_unicode()
TOKENS = ["<s>", "</s>"] + list(BYTE_CHARS.values()) + [BYTE_CHARS[1] + BYTE_CHARS[2]]
MERGES = [f"{BYTE_CHARS[1]} {BYTE_CHARS[2]}"]
BOS, EOS, MERGED = 0, 1, len(TOKENS) - 1
NUL = 2 + list(BYTE_CHARS).index(0)
PIECES = {BOS: b"<s>", MERGED: bytes([1, 2]), **{2 + i: bytes([b]) for i, b in enumerate(BYTE_CHARS) if b}}


def llama_simple() -> str:
    where = os.environ.get("ULB_LLAMA_CPP_BIN")
    if not where:
        path = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "peers", "llamacpp.py")
        spec = importlib.util.spec_from_file_location("ulb_peers_llamacpp", path)
        peers = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # (its dataclass looks itself up)
        spec.loader.exec_module(peers)
        found = peers.find_build(peers.default_peers_dir())
        where = found.bin_dir if found else f"{peers.default_peers_dir()} (no llama.cpp build for this CPU)"
    tool = os.path.join(where, "llama-simple")
    if not os.access(tool, os.X_OK):
        pytest.skip(f"no llama.cpp llama-simple in {where}: set ULB_LLAMA_CPP_BIN to a llama.cpp bin folder, or "
                    "run python benchmarks/vs_llamacpp.py --build-only")
    return tool


def as_ids(printed: bytes) -> list[int]:
    """llama-simple's printed tokens back to ids, the longest piece first."""
    by_piece = sorted(((p, i) for i, p in PIECES.items()), key=lambda pi: -len(pi[0]))
    ids, at = [], 0
    while at < len(printed):
        piece, i = next((p, i) for p, i in by_piece if printed.startswith(p, at))
        ids.append(i)
        at += len(piece)
    return ids


def continue_in_llama_cpp(tool: str, path, prompt: str) -> list[int]:
    cmd = [tool, "-m", str(path), "-n", str(NEW_TOKENS), prompt]
    done = subprocess.run(cmd, capture_output=True, timeout=300)
    assert done.returncode == 0, f"{cmd} exited {done.returncode}:\n{done.stderr.decode(errors='replace')[-3000:]}"
    printed = done.stdout.removesuffix(b"\n")
    assert printed.startswith(prompt.encode()), printed  # llama-simple prints the prompt, then what it generates
    return as_ids(printed[len(prompt):])


def float_twin(model: nn.Module) -> nn.Module:
    """The model with each packed layer an nn.Linear of its dequantize(): the
    file's weights, the activations not rounded."""
    for name, m in [(n, m) for n, m in model.named_modules() if isinstance(m, LowBitLinear)]:
        lin = nn.Linear(m.in_features, m.out_features, bias=m.bias is not None)
        lin.weight.data = m.dequantize()
        if m.bias is not None:
            lin.bias.data = m.bias.detach().float()
        replace_module(model, name, lin)
    return model


@pytest.fixture(scope="module")
def float_gguf(tmp_path_factory):
    """A tiny llama as an F32 GGUF with that vocabulary."""
    path = tmp_path_factory.mktemp("llama_cpp") / "float.gguf"
    model = gw.tiny("llama", vocab_size=len(TOKENS))
    model.lm_head.weight.data[NUL] = 0
    gw.write_gguf(path, model, lambda name, values: int(gw.T.F32), tokens=TOKENS, merges=MERGES)
    return path


@pytest.mark.parametrize("ttype", CASES)
def test_llama_cpp_continues_as_ulbtorch_does(tmp_path, float_gguf, ttype):
    tool = llama_simple()
    fmt, group_size = CASES[ttype]
    model, tokenizer = ulbtorch.load_gguf(float_gguf, dtype=torch.float32, with_tokenizer=True)
    assert tokenizer("hello", add_special_tokens=False)["input_ids"] == as_ids(b"hello")
    ulbtorch.quantize_(model, format=fmt, group_size=group_size, bf16_gemv=False)
    path = tmp_path / f"{ttype}.gguf"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ulbtorch.save_gguf(model, path, tokenizer=tokenizer)
    # quantize_'s scales become fp16; transformers' <|endoftext|>, past the embedding, is not written
    said = " ".join(str(w.message) for w in caught)
    assert "rounded to fp16" in said and "['<|endoftext|>'] (ids 259 on) are beyond" in said, said
    from ulbtorch.importers.gguf_blocks import type_name
    from ulbtorch.importers.gguf_file import GGUFFile
    types = {t.name: type_name(t.type) for t in GGUFFile(path).tensors.values()}
    assert types["blk.0.attn_q.weight"] == types["blk.1.ffn_down.weight"] == ttype

    ours = ulbtorch.load_gguf(path, dtype=torch.float32)  # the file's weights, in ulbtorch's layers
    exact = float_twin(ulbtorch.load_gguf(path, dtype=torch.float32))
    agreed = 0
    for prompt in PROMPTS:
        theirs = continue_in_llama_cpp(tool, path, prompt)
        seq = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        for step in range(NEW_TOKENS):
            with torch.no_grad():
                mine = ours(torch.tensor([seq])).logits[0, -1]
            pick = int(mine.argmax())
            assert pick != NUL, (prompt, step)  # (it would print as nothing)
            # where llama.cpp stopped early it picked the end of text, which it does not print
            want = theirs[step] if step < len(theirs) else EOS
            if pick != want:
                with torch.no_grad():
                    e = exact(torch.tensor([seq])).logits[0, -1]
                noise = (mine - e).abs().max()
                gap = (e[pick] - e[want]).abs()
                assert gap <= noise, (f"{ttype}, {prompt!r}: at step {step} llama.cpp picks {want}, ulbtorch "
                                      f"{pick}: {gap:.4f} apart without activation rounding, which moves logits "
                                      f"by up to {noise:.4f}")
                break
            agreed += 1
            if pick == EOS:
                break
            seq.append(pick)
    assert agreed >= len(PROMPTS) * NEW_TOKENS // 2, agreed

"""A shapes.json config as an HF folder of random ternary-valued weights,
the input every engine of vs_llamacpp.py converts from.

Each linear layer but lm_head holds s_row * t with t in {-1, 0, 1}: ternary
quantisers (ulbtorch's absmax, llama.cpp's TQ1_0/TQ2_0 block absmax) keep
such a weight as it is, so the ternary rows of every engine hold the same
weights. lm_head, the embedding and the norms are random bf16, as
decode.build_model makes them. The folder carries a byte-fallback BPE
tokenizer of vocab_size tokens with no merges, which convert_hf_to_gguf.py
reads as a llama vocabulary (nothing is tokenised: every engine runs from
token ids).
"""
from __future__ import annotations

import json
import os
import shutil

import torch
from torch import nn

DONE = "complete.json"


def ternarize_(model: nn.Module, seed: int) -> nn.Module:
    """Replace, in place, each nn.Linear weight but lm_head's by
    s_row * t, t uniform in {-1, 0, 1}, s_row the row's mean |w|."""
    gen = torch.Generator().manual_seed(seed)
    for name, mod in model.named_modules():
        if isinstance(mod, nn.Linear) and not name.endswith("lm_head"):
            w = mod.weight.data
            s = w.float().abs().mean(1, keepdim=True)
            t = torch.randint(-1, 2, w.shape, generator=gen).float()
            mod.weight.data = (t * s).to(w.dtype)
    return model


def tokenizer(vocab_size: int, bos: int = 1, eos: int = 2, unk: int = 0):
    """A transformers fast tokenizer of exactly vocab_size tokens: the
    specials at unk/bos/eos, the 256 byte tokens, then fillers."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    specials = {unk: "<unk>", bos: "<s>", eos: "</s>"}
    if len(specials) != 3 or vocab_size < 3 + 256:
        raise ValueError(f"tokenizer: vocab_size {vocab_size} with specials at {sorted(specials)}: need 3 distinct "
                         "ids and at least 259 tokens")
    vocab, fill = {}, 0
    bytes_left = [f"<0x{b:02X}>" for b in range(256)]
    for i in range(vocab_size):
        if i in specials:
            vocab[specials[i]] = i
        elif bytes_left:
            vocab[bytes_left.pop(0)] = i
        else:
            vocab[f"\u2581t{fill}"] = i
            fill += 1
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def write_folder(model: nn.Module, folder: str, meta: dict) -> None:
    """save_pretrained (safetensors) and the tokenizer into folder, which is
    complete once DONE (holding meta) is there."""
    if os.path.isdir(folder):
        shutil.rmtree(folder)
    model.save_pretrained(folder, safe_serialization=True)
    cfg = model.config
    tokenizer(cfg.vocab_size, cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id).save_pretrained(folder)
    with open(os.path.join(folder, DONE), "w") as f:
        json.dump(meta, f, indent=1)


def folder_matches(folder: str, meta: dict) -> bool:
    try:
        with open(os.path.join(folder, DONE)) as f:
            return json.load(f) == json.loads(json.dumps(meta))
    except (OSError, ValueError):
        return False


def load_folder(folder: str):
    """The folder's model in bf16, in eval mode, as decode.build_model gives it."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    model.eval()
    model.generation_config.pad_token_id = model.config.pad_token_id
    return model

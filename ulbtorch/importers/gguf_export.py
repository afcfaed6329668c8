"""ulbtorch.save_gguf: a model quantised by ulbtorch as a GGUF file for
llama.cpp, its packed layers written as the GGUF blocks that hold them:

  binary  -> Q1_0 (128 values a block)    ternary -> TQ2_0 (256)
  int4    -> Q4_0 (32)                    int8    -> Q8_0 (32)
  int2    -> Q2_0 (64; the scale negated: gguf_blocks)

A layer's group size must be a multiple of the block's (or 0: one scale per
row, or "tensor"), so that each block gets the scale of its group; the fp32
scales become the blocks' fp16 ones (exact for a model load_gguf read).
Names, metadata and llama's q/k row permutation are the inverse of what
transformers' GGUF loading reads (load_gguf), for the architectures below.
"""
from __future__ import annotations

import os
import tempfile
import warnings
from collections import Counter

import numpy as np
import torch
from torch import nn

from .._atomic import staging
from ..nn import LowBitLinear
from ..nn.normed import input_norm_eps
from .gguf import row_order
from .gguf_blocks import ENCODED_AS, block_shape, encode

# transformers model_type -> the llama.cpp architecture written (mistral is llama to llama.cpp)
ARCHS = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
# llama_ftype of the main weight type, for general.file_type
FILE_TYPES = {"binary": 40, "int2": 41, "ternary": 37, "int4": 2, "int8": 7}
FLOAT_GGUF = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 30}
FLOAT_KEYS = {"rope.freq_base", "attention.layer_norm_rms_epsilon", "attention.layer_norm_epsilon"}


def _metadata(writer, config, arch: str) -> None:
    """The hyperparameters transformers' GGUF loading reads back into the
    config (its GGUF_CONFIG_MAPPING, inverted), and the head sizes llama.cpp
    reads where they differ from hidden_size / heads."""
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    rope = getattr(config, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"save_gguf: the model's rope_type is {rope.get('rope_type')!r}; save_gguf writes models "
                         "with the default rope only (llama.cpp keeps other kinds in tensors it does not write)")
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    values = dict(rope_theta=rope.get("rope_theta", getattr(config, "rope_theta", None)))
    keys = dict(GGUF_CONFIG_MAPPING[arch], **{"attention.key_length": "head_dim",
                                               "attention.value_length": "head_dim"})
    for key, attr in keys.items():
        value = head_dim if key == "rope.dimension_count" or attr == "head_dim" else (
            values[attr] if attr in values else getattr(config, attr, None) if attr else None)
        if value is None:
            continue
        if key in FLOAT_KEYS:
            writer.add_float32(f"{arch}.{key}", float(value))
        else:
            writer.add_uint32(f"{arch}.{key}", int(value))


def _tokenizer(writer, tokenizer, pre: str, n_vocab: int) -> None:
    """A BPE tokenizer (tokenizer.json) as llama.cpp's "gpt2" vocabulary of
    exactly n_vocab tokens, the embedding's rows (llama.cpp refuses a file
    whose token list is longer or shorter): tokens beyond the rows, which
    the model cannot embed (such as the <|endoftext|> transformers adds to a
    GGUF vocabulary it reads), are left out, and missing ones padded as
    llama.cpp's converter pads them ("[PAD<id>]", unused)."""
    import gguf

    if tokenizer is None:
        writer.add_tokenizer_model("none")  # llama.cpp runs such a file from token ids
        return
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer.save_pretrained(tmp)
        try:
            vocab = gguf.vocab.BpeVocab(gguf.vocab.Path(tmp))
        except (FileNotFoundError, ValueError, TypeError) as e:
            raise ValueError(f"save_gguf: the tokenizer is not a BPE tokenizer gguf-py reads ({e}); pass "
                             "tokenizer=None to write the model without one") from None
        tokens, _, types = (list(c) for c in zip(*vocab.all_tokens()))
        beyond = [t.decode() if isinstance(t, bytes) else t for t in tokens[n_vocab:]]
        if beyond:
            warnings.warn(f"save_gguf: the tokenizer's tokens {beyond[:5]} (ids {n_vocab} on) are beyond the "
                          f"model's {n_vocab} embedding rows: the GGUF vocabulary leaves them out", stacklevel=3)
        tokens, types = tokens[:n_vocab], types[:n_vocab]
        for i in range(len(tokens), n_vocab):
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(pre)
        writer.add_token_list(tokens)
        writer.add_token_types([int(t) for t in types])
        gguf.SpecialVocab(gguf.vocab.Path(tmp), load_merges=True, n_vocab=n_vocab).add_to_gguf(writer, quiet=True)


class _Scales:
    """How far the fp32 scales moved when they became fp16 ones."""

    def __init__(self):
        self.rounded = self.total = 0
        self.worst = 0.0

    def to_f16(self, name: str, scales: torch.Tensor) -> torch.Tensor:
        s16 = scales.to(torch.float16)
        if not torch.isfinite(s16).all():
            raise ValueError(f"save_gguf: layer {name!r} has a scale beyond fp16's range (largest "
                             f"{scales.abs().max().item():.4g}), which GGUF blocks cannot hold")
        moved = s16.float() != scales
        self.rounded += int(moved.sum())
        self.total += scales.numel()
        if moved.any():
            self.worst = max(self.worst, float(((s16.float() - scales).abs() / scales.abs())[moved].max()))
        return s16


def _check_layer(name: str, layer: LowBitLinear) -> None:
    if input_norm_eps(layer) is not None:
        raise ValueError(f"save_gguf: layer {name!r} holds its own input RMSNorm (BitNet's use_rms_norm, as "
                         "Falcon-E has it), for which the layouts save_gguf writes have no tensor; save the model with "
                         "save_pretrained or ulbtorch.save_quantized, which keep the norms")
    if layer.format not in ENCODED_AS:
        raise ValueError(f"save_gguf: layer {name!r} is {layer.format}, which no GGUF type holds; GGUF types are "
                         f"written for {', '.join(ENCODED_AS)}")
    _, per = ENCODED_AS[layer.format]
    K, gs = layer.in_features, layer.group_size
    if K % per or (gs and gs % per):
        raise ValueError(f"save_gguf: layer {name!r} ({layer.format}, {K} inputs, group size {gs or 'none'}) does "
                         f"not fit {per}-value GGUF blocks: the inputs and the group size must be multiples of {per}")


def _blocks(name: str, layer: LowBitLinear, order, scales_log: _Scales) -> np.ndarray:
    """One packed layer as rows of GGUF blocks, in the file's row order."""
    _, per = ENCODED_AS[layer.format]
    K, gs = layer.in_features, layer.group_size
    codes, scales = layer.unpack()
    block_group = torch.arange(K // per) * per // gs if gs else torch.zeros(K // per, dtype=torch.long)
    scales = scales[:, block_group]
    if order is not None:
        codes, scales = codes[order], scales[order]
    return encode(codes, scales_log.to_f16(name, scales), layer.format)


def _float_tensor(t: torch.Tensor, order) -> tuple[int, np.ndarray]:
    t = t.detach().cpu()
    t = t if order is None else t[order]
    if t.dim() == 1 or t.dtype not in FLOAT_GGUF:
        return 0, t.float().numpy()
    return FLOAT_GGUF[t.dtype], t.contiguous().view(torch.uint8 if t.dtype == torch.bfloat16 else t.dtype).numpy()


def _file_order(processor, gname: str, hf_name: str, shape: tuple[int, ...]) -> torch.Tensor | None:
    """The inverse of the row (or, for a 1-D tensor, element) order in which
    transformers reads the GGUF tensor back: the order to write it in."""
    where = f"save_gguf: {hf_name}"
    if len(shape) == 1:
        probe = np.arange(shape[0])
        out = processor.process(weights=probe, name=gname).weights
        if out is probe:
            return None
        order = torch.from_numpy(np.asarray(out).astype(np.int64))
        if tuple(order.shape) != shape or not torch.equal(order.sort().values, torch.arange(shape[0])):
            raise ValueError(f"{where}: transformers' {type(processor).__name__} changes it other than by reordering")
    else:
        order = row_order(processor, gname, shape, hf_name, shape, where)
        if order is None:
            return None
    return torch.argsort(order)


def _plan(model: nn.Module, arch: str, processor) -> list[tuple]:
    """(gguf name, ggml type, shape, bytes, how to make the data) of every
    tensor, in model order; every layer checked before a byte is written."""
    import gguf

    cfg = model.config
    arch_id = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    name_map = gguf.get_tensor_name_map(arch_id, cfg.num_hidden_layers)
    tied = bool(getattr(cfg, "tie_word_embeddings", False))
    out_emb = model.get_output_embeddings()
    plan, seen = [], set()
    for mname, module in model.named_modules():
        own = list(module.named_parameters(recurse=False))
        if isinstance(module, LowBitLinear):
            _check_layer(mname, module)
            own = [("weight", module)] + [(k, v) for k, v in own if k == "bias"]
        if not own or id(module) in seen:
            continue
        seen.add(id(module))
        if tied and module is out_emb:
            continue  # llama.cpp reads the input embedding where output.weight is missing
        base = name_map.get_name(mname)
        if base is None:
            raise ValueError(f"save_gguf: the model's {mname!r} has no GGUF name in llama.cpp's {arch!r} layout")
        for leaf, t in own:
            gname, hf_name = f"{base}.{leaf}", f"{mname}.{leaf}"
            if t is module:
                shape = (module.out_features, module.in_features)
                ttype, per = ENCODED_AS[module.format]
                nbytes = shape[0] * shape[1] // per * block_shape(ttype)[1]
            else:
                shape = tuple(t.shape)
                ttype = 0 if t.dim() == 1 or t.dtype not in FLOAT_GGUF else FLOAT_GGUF[t.dtype]
                nbytes = t.numel() * (4 if ttype == 0 else 2)
            plan.append((gname, ttype, shape, nbytes, (mname, module, t, _file_order(processor, gname, hf_name,
                                                                                       shape))))
    return plan


def _vocab_rows(model: nn.Module) -> int:
    embedding = model.get_input_embeddings()
    return embedding.weight.shape[0]


def save_gguf(model: nn.Module, path, *, tokenizer=None, tokenizer_pre: str = "default") -> None:
    """Write a transformers model of a llama, mistral, qwen2 or qwen3 config
    whose linear layers ulbtorch quantised (the others float) as a GGUF
    file: binary -> Q1_0, int2 -> Q2_0, ternary -> TQ2_0, int4 -> Q4_0, int8 -> Q8_0, float
    2-D tensors in their dtype (F32, F16, BF16), 1-D ones in F32. Another
    format, or a group size that is not a multiple of the GGUF block, is an
    error naming the layer. tokenizer: a transformers BPE tokenizer to write
    as llama.cpp's "gpt2" vocabulary, with tokenizer_pre the pre-tokenizer
    name llama.cpp knows the model's by ("llama-bpe", "qwen2", "falcon3";
    "default" makes llama.cpp warn); None writes no vocabulary. The file
    appears whole or not at all."""
    import gguf
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    config = getattr(model, "config", None)
    arch = ARCHS.get(getattr(config, "model_type", None))
    if arch is None:
        raise ValueError(f"save_gguf writes models of types {sorted(ARCHS)}, got "
                         f"{getattr(config, 'model_type', type(model).__name__)!r}")
    processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=config.to_dict())
    path = os.fspath(path)
    directory, name = os.path.split(os.path.abspath(path))
    plan = _plan(model, arch, processor)
    formats = Counter(m.format for m in model.modules() if isinstance(m, LowBitLinear))
    scales_log = _Scales()
    with staging(directory) as stage:
        writer = gguf.GGUFWriter(stage.path(name), arch)
        writer.add_string("general.name", str(getattr(config, "name_or_path", "") or arch))
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
        if formats:
            writer.add_file_type(FILE_TYPES.get(formats.most_common(1)[0][0], 0))
        _metadata(writer, config, arch)
        _tokenizer(writer, tokenizer, tokenizer_pre, _vocab_rows(model))
        for gname, ttype, shape, nbytes, _ in plan:
            # (a dtype other than uint8 keeps gguf-py from reading the shape as a byte shape)
            writer.add_tensor_info(gname, shape, np.dtype(np.float32), nbytes,
                                   raw_dtype=ttype)  # a number: gguf-py 0.19 has no Q2_0
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for _, ttype, _, _, (mname, module, t, order) in plan:  # one tensor's blocks in memory at a time
            data = _blocks(mname, module, order, scales_log) if t is module else _float_tensor(t, order)[1]
            writer.write_tensor_data(data)
        writer.close()
        stage.publish(name)
    if scales_log.rounded:
        warnings.warn(f"save_gguf: {scales_log.rounded} of {scales_log.total} block scales were rounded to fp16 "
                      f"(GGUF blocks hold fp16 scales), by up to {scales_log.worst:.2g} of their value", stacklevel=2)

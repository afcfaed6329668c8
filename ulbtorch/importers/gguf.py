"""ulbtorch.load_gguf: a GGUF file as a transformers model whose linear
layers are ulbtorch layers built from the file's blocks, never through a
float copy of the model.

transformers decides everything that is not about the blocks, as its own
GGUF loading does (transformers.modeling_gguf_pytorch_utils): the config
and tokenizer from the metadata, the tensor names (get_gguf_hf_weights_map)
and each architecture's TensorProcessor, whose q/k row permutation (llama)
or qkv reshuffle (bloom) is applied to a packed weight's rows by running the
processor on the row numbers. The model is built on the meta device and
filled one tensor at a time; tensors that stay float (embeddings, norms)
are dequantised with gguf-py and cast to `dtype` as transformers does.
"""
from __future__ import annotations

import os
import tempfile
import warnings

import numpy as np
import torch
from torch import nn

from .. import ops
from ..finish import finish_conversion
from ..integrations.hf_experts import fused_weight_names, is_fused_experts, router_names
from ..nn import MODULE_FOR_FORMAT, LowBitLinear
from ..nn.replace import is_plain_linear, module_names, replace_everywhere
from ..quantize import LM_HEAD, QuantConfig, linear_layers, run_conversion_hooks
from .gguf_blocks import DECODED_AS, FLOAT_TYPES, I2_S, decode, type_name
from .gguf_file import GGUFFile, TensorInfo
from .hf_bitnet import _params_on_meta

OTHER_TYPES = ("error", "float")
CHUNK_BYTES = 64 << 20  # float32 values of a float tensor dequantised at a time


def _transformers_view(f: GGUFFile, with_tokenizer: bool):
    """(config, the config dict transformers' tensor processors read,
    tokenizer or None), from a copy of the file's metadata (gguf_file.py)."""
    from transformers import AutoConfig, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        name = "metadata.gguf"
        f.metadata_copy(os.path.join(tmp, name))
        try:
            parsed = load_gguf_checkpoint(os.path.join(tmp, name), return_tensors=False)
            config = AutoConfig.from_pretrained(tmp, gguf_file=name)
        except (ValueError, KeyError, NotImplementedError) as e:
            raise ValueError(f"{f.path}: transformers' GGUF loading does not map this file's architecture "
                             f"{f.architecture!r} to a model ({type(e).__name__}: {e})") from None
        tokenizer = None
        if with_tokenizer:
            if "tokenizer.ggml.model" not in f.metadata:
                raise ValueError(f"{f.path}: the file holds no tokenizer (no tokenizer.ggml.model in its metadata); "
                                 "load it with with_tokenizer=False")
            tokenizer = AutoTokenizer.from_pretrained(tmp, gguf_file=name)
    return config, parsed["config"], tokenizer


def _where(f: GGUFFile, info: TensorInfo) -> str:
    return f"{f.path}: tensor {info.name!r} ({info.type_name}, shape {list(info.shape)})"


def _float_values(f: GGUFFile, info: TensorInfo, start: int = 0, stop: int | None = None) -> np.ndarray:
    """Rows start..stop of the tensor in float32 ([rows, K]; the whole
    tensor in its own shape by default): gguf-py's dequantisation, or ours
    (ggml's rule) for the types gguf-py cannot dequantise (Q1_0, I2_S)."""
    import gguf

    raw = f.raw(info, start, stop)
    rows = int(np.prod(info.shape[:-1])) if stop is None else stop - start
    if info.type in FLOAT_TYPES:
        values = torch.from_numpy(raw).view(FLOAT_TYPES[info.type]).float().numpy()
    else:
        try:
            values = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(info.type))
        except (NotImplementedError, ValueError):
            if info.type not in DECODED_AS:
                raise ValueError(f"{_where(f, info)}: neither ulbtorch nor gguf-py reads this type") from None
            try:
                d = decode(info.type, raw, rows, info.shape[-1])
            except ValueError as e:
                raise ValueError(f"{_where(f, info)}: {e}") from None
            values = ops.dequantize(d.codes, d.scales, d.format, d.group_size).numpy()
    return values.reshape(info.shape if stop is None else (rows, info.shape[-1]))


def _decoded(f: GGUFFile, info: TensorInfo):
    try:
        return decode(info.type, f.raw(info), int(np.prod(info.shape[:-1])), info.shape[-1])
    except ValueError as e:
        raise ValueError(f"{_where(f, info)}: {e}") from None


def row_order(processor, name: str, shape: tuple[int, ...], hf_name: str, hf_shape: tuple[int, int],
              where: str, key_map: dict | None = None) -> torch.Tensor | None:
    """The order in which the rows of the GGUF tensor `name` (of `shape`, in
    torch order) become the rows of the model's `hf_name`: None where they
    stay as stored. It is what transformers' processor does to a tensor of
    each row's number."""
    rows, K = int(np.prod(shape[:-1])), shape[-1]
    probe = np.broadcast_to(np.arange(rows).reshape(rows, 1), (rows, K)).reshape(shape)
    scratch = {"tensors": {}}
    result = processor.process(weights=probe, name=name, tensor_key_mapping=key_map or {hf_name: hf_name},
                               parsed_parameters=scratch)
    out = result.weights
    if result.name is None:  # the processor stored it under a name of its own
        stored = scratch["tensors"]
        if list(stored) != [hf_name]:
            raise ValueError(f"{where}: transformers' {type(processor).__name__} stores it as {sorted(stored)}, "
                             f"not as the linear weight {hf_name!r}")
        out = stored[hf_name].numpy()
    if out is probe:
        return None
    out = np.asarray(out)
    if out.shape != tuple(hf_shape) or not (out == out[:, :1]).all() or not np.array_equal(
            np.sort(out[:, 0]), np.arange(rows)):
        raise ValueError(f"{where}: transformers' {type(processor).__name__} changes this weight in a way other than "
                         "reordering its rows, which a packed weight cannot follow")
    order = torch.from_numpy(out[:, 0].astype(np.int64))
    return None if torch.equal(order, torch.arange(rows)) else order


class _Loader:
    """The state of one load_gguf: the file, the meta model and the tensors
    converted so far."""

    def __init__(self, f: GGUFFile, model: nn.Module, processor, dtype: torch.dtype, other_types: str):
        from transformers.modeling_gguf_pytorch_utils import get_gguf_hf_weights_map

        self.f, self.model, self.processor, self.dtype, self.other_types = f, model, processor, dtype, other_types
        self.key_map = get_gguf_hf_weights_map(model, processor)
        self.shapes = {k: tuple(v.shape) for k, v in model.state_dict(keep_vars=True).items()}
        self.modules = dict(model.named_modules())
        self.names = module_names(model)
        routers = set(router_names(model))
        out = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        self.tied = bool(getattr(model.config, "tie_word_embeddings", False)) and out is not None
        # Linear layers by their weight's name; routers stay float as quantize_ keeps them, and a tied
        # output embedding is the input embedding's tensor.
        self.linears = {f"{n}.weight": m for n, m in self.modules.items()
                        if is_plain_linear(m) and n not in routers and not (self.tied and m is out)}
        self.tied_out = {f"{n}.weight" for n, m in self.modules.items() if self.tied and m is out}
        self.dense: dict[str, torch.Tensor] = {}
        self.scratch = {"tensors": {}}  # what processors store under names of their own (MoE experts)
        self.as_float: list[str] = []

    def target(self, info: TensorInfo) -> str | None:
        return self.key_map.get(info.name)

    def check_shape(self, info: TensorInfo, hf_name: str, shape) -> None:
        if hf_name not in self.shapes:
            raise ValueError(f"{_where(self.f, info)}: maps to {hf_name!r}, which the model built from the "
                             "file's metadata does not have")
        if tuple(shape) != self.shapes[hf_name]:
            raise ValueError(f"{_where(self.f, info)}: gives {hf_name} the shape {list(shape)}, but the model "
                             f"built from the file's metadata has {list(self.shapes[hf_name])}")

    def untouched(self, info: TensorInfo) -> bool:
        """Whether transformers' processor leaves the tensor as it is (asked of
        a tensor of zeros that takes no memory): then it can be converted a
        few rows at a time, never whole in float32."""
        if len(info.shape) > 2 or info.type == I2_S:  # MoE processors copy 3-D tensors whole; I2_S is one block
            return False
        probe = np.broadcast_to(np.float32(0), info.shape)
        scratch = {"tensors": {}}
        result = self.processor.process(weights=probe, name=info.name, tensor_key_mapping=self.key_map,
                                        parsed_parameters=scratch)
        return result.weights is probe and result.name == info.name and not scratch["tensors"]

    def load_float(self, info: TensorInfo) -> None:
        if self.untouched(info):
            hf_name = self.key_map.get(info.name)
            if hf_name is None or hf_name in self.tied_out:
                return  # as transformers: a tensor it does not map is not loaded
            self.check_shape(info, hf_name, info.shape)
            rows, K = int(np.prod(info.shape[:-1])), info.shape[-1]
            out = torch.empty(rows, K, dtype=self.dtype)
            step = max(1, CHUNK_BYTES // (4 * K))
            for r in range(0, rows, step):
                out[r:r + step] = torch.from_numpy(_float_values(self.f, info, r, min(rows, r + step)))
            self.dense[hf_name] = out.reshape(info.shape)
            return
        values = _float_values(self.f, info)
        result = self.processor.process(weights=values, name=info.name, tensor_key_mapping=self.key_map,
                                        parsed_parameters=self.scratch)
        stored = self.scratch["tensors"]
        for k, t in stored.items():  # in the model's dtype at once: no float32 copy of the experts piles up
            stored[k] = t.to(self.dtype)
        if result.name is None:
            return
        hf_name = self.key_map.get(result.name)
        if hf_name is None or hf_name in self.tied_out:
            return
        weights = np.ascontiguousarray(result.weights)
        self.check_shape(info, hf_name, weights.shape)
        self.dense[hf_name] = torch.from_numpy(weights).to(self.dtype)

    def load_linear(self, info: TensorInfo, hf_name: str) -> None:
        lin = self.linears[hf_name]
        shape = (lin.out_features, lin.in_features)
        if info.nbytes is None:
            raise ValueError(f"{_where(self.f, info)}: a type neither ulbtorch nor gguf-py reads")
        if info.type in FLOAT_TYPES or (info.type not in DECODED_AS and self.other_types == "float"):
            if info.type not in FLOAT_TYPES:
                self.as_float.append(f"{info.name} ({info.type_name})")
            self.load_float(info)
            return
        if info.type not in DECODED_AS:
            held = sorted({type_name(t) for t in DECODED_AS})
            raise ValueError(f"{_where(self.f, info)}: no ulbtorch format holds this type exactly (loaded packed: "
                             f"{', '.join(held)}; float: F32, F16, BF16); load_gguf(..., other_types='float') "
                             "dequantises such layers into float ones instead")
        d = _decoded(self.f, info)
        order = row_order(self.processor, info.name, info.shape, hf_name, shape, _where(self.f, info), self.key_map)
        codes, scales = (d.codes, d.scales) if order is None else (d.codes[order], d.scales[order])
        self.check_shape(info, hf_name, codes.shape)
        module = hf_name.removesuffix(".weight")
        bias = None
        if lin.bias is not None:
            bias = self.dense.pop(f"{module}.bias", None)
            if bias is None:
                raise ValueError(f"{self.f.path}: tensor {info.name!r} has no bias tensor, but the model's "
                                 f"{module} has a bias")
        try:
            layer = MODULE_FOR_FORMAT[d.format].from_codes(codes, scales, format=d.format, group_size=d.group_size,
                                                           bias=bias, granularity=d.granularity)
        except ValueError as e:
            raise ValueError(f"{_where(self.f, info)}: {e}") from None
        replace_everywhere(self.model, self.names, lin, layer)

    def run(self) -> None:
        weights = []
        for info in self.f.tensors.values():
            hf_name = self.target(info)
            if hf_name in self.linears:
                weights.append((info, hf_name))
            else:
                self.load_float(info)  # biases first: a packed layer is built with its bias
        for info, hf_name in weights:
            self.load_linear(info, hf_name)
        for k, t in self.scratch["tensors"].items():
            if k not in self.shapes or tuple(t.shape) != self.shapes[k]:
                raise ValueError(f"{self.f.path}: transformers' {type(self.processor).__name__} built {k} of shape "
                                 f"{list(t.shape)}, which the model ({self.shapes.get(k)}) does not take")
            self.dense[k] = t
        self.model.load_state_dict(self.dense, strict=False, assign=True)
        if self.tied:
            self.model.tie_weights()
        missing = [n for n, t in (*self.model.named_parameters(), *self.model.named_buffers()) if t.is_meta]
        if missing:
            raise ValueError(f"{self.f.path}: the file has no tensor for {len(missing)} of the model's tensors, "
                             f"e.g. {missing[:4]} (the model is built from the file's metadata: "
                             f"{self.f.architecture}.block_count and the others)")


def _record_config(model: nn.Module, bf16_gemv: bool) -> None:
    """ulbtorch's config, as quantize_ records it, where one describes the
    layers (one format and group size, an int8 or int4 lm_head apart), so
    that save_pretrained writes a checkpoint from_pretrained loads packed."""
    low = [(n, m) for n, m in model.named_modules() if isinstance(m, LowBitLinear)]
    if not low:
        return
    out = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    main = {(m.format, m.group_size, m.granularity) for _, m in low if m is not out}
    head = [(n, m) for n, m in low if m is out]
    head_kw = {}
    if head:
        h = head[0][1]
        if h.format not in ("int8", "int4"):
            main.add((h.format, h.group_size, h.granularity))
        else:
            head_kw = dict(lm_head_bits=8 if h.format == "int8" else 4, lm_head_group_size=h.group_size)
    if len(main) != 1:
        warnings.warn(f"load_gguf: the file's layers are in {len(main)} formats or group sizes "
                      f"({', '.join(sorted(f'{f} {g or gran}' for f, g, gran in main))}), which no UlbConfig "
                      "describes, so "
                      "save_pretrained would not reload them packed; ulbtorch.save_quantized saves them",
                      stacklevel=3)
        return
    fmt, gs, gran = main.pop()
    exclude = [n for n, _ in linear_layers(model, lambda n: True)] + [n for n, _ in head] + [
        f"{n}.{p}" for n, m in model.named_modules() if is_fused_experts(m) for p in fused_weight_names(m)]
    run_conversion_hooks(model, QuantConfig(format=fmt, group_size=gs, granularity=gran,
                                            exclude=exclude or list(LM_HEAD), bf16_gemv=bf16_gemv, **head_kw))


def load_gguf(path, *, dtype: torch.dtype = torch.bfloat16, device="cpu", with_tokenizer: bool = False,
              other_types: str = "error", bf16_gemv: bool = True):
    """Load a GGUF file as a transformers model (AutoModelForCausalLM of the
    config transformers reads from its metadata) whose linear layers are
    ulbtorch layers built from the file's blocks: Q1_0 (binary), TQ1_0, TQ2_0
    and I2_S (ternary), Q4_0 and Q3_K (int4), Q5_0, Q8_0, Q6_K, IQ4_NL and
    IQ4_XS (int8); each layer's dequantize() is the file's own dequantisation
    bit for bit. F32 / F16 / BF16 linear weights, embeddings and norms load
    as float in `dtype`. A linear weight of another type (Q4_K, IQ2_XS, ...)
    is an error naming it, or with other_types="float" a float layer of its
    dequantised values. bf16_gemv: as quantize_'s. Returns the model, or
    (model, tokenizer) with with_tokenizer=True (transformers' GGUF tokenizer)."""
    if other_types not in OTHER_TYPES:
        raise ValueError(f"other_types must be one of {OTHER_TYPES}, got {other_types!r}")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating-point torch.dtype, got {dtype!r}")
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    f = GGUFFile(path)
    config, config_dict, tokenizer = _transformers_view(f, with_tokenizer)
    processor = TENSOR_PROCESSORS.get(f.architecture, TensorProcessor)(config=config_dict)
    with _params_on_meta():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    loader = _Loader(f, model, processor, dtype, other_types)
    loader.run()
    if loader.as_float:
        warnings.warn(f"load_gguf: {len(loader.as_float)} linear weights of types no ulbtorch format holds were "
                      f"dequantised into float layers ({dtype}): {', '.join(loader.as_float[:4])}"
                      f"{', ...' if len(loader.as_float) > 4 else ''}", stacklevel=2)
    if torch.device(device).type != "cpu":
        model.to(device)
    finish_conversion(model, bf16_gemv=bf16_gemv, hugepages=False)
    _record_config(model, bf16_gemv)
    model.eval()
    return (model, tokenizer) if with_tokenizer else model

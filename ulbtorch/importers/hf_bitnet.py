"""Hugging Face's BitNet checkpoint format (quant_method "bitnet"), as
microsoft/bitnet-b1.58-2B-4T and tiiuae/Falcon3-*-1.58bit publish it:

* `<layer>.weight`: uint8 [out/4, in]; byte r of column k holds, in bits
  2i..2i+1, the ternary value of output row i*out/4 + r as code t+1. An
  "autobitlinear" checkpoint may instead hold the ternary values unpacked
  ([out, in] floats -1, 0, 1), which transformers accepts too.
* `<layer>.weight_scale`: shape (1,). linear_class "bitlinear": W = T / scale;
  "autobitlinear": W = T * scale, and its bias is scaled with the product.
* use_rms_norm (Falcon-E): `<layer>.rms_norm.weight`, an RMSNorm of the
  layer's input before its activations are quantised (NormedLinearTernary,
  which ulbtorch's save paths store with the norm: see ulbtorch/nn/normed.py).
* activations: per-token absmax int8, which is exactly what our kernels do, so
  LinearTernary with one per-tensor scale runs these layers losslessly.
"""
from __future__ import annotations

import contextlib
import json
import os
import threading
from collections.abc import Mapping

import torch
from torch import nn

from ..finish import finish_conversion
from ..nn import LinearTernary, replace_module
from ..quantize import QuantConfig, linear_layers, run_conversion_hooks
from ..nn.normed import NormedLinearTernary, check_eps, input_norm_eps

VALUES_PER_BYTE = 4
LINEAR_CLASSES = ("bitlinear", "autobitlinear")


def unpack_hf_bitnet(packed: torch.Tensor, out_features: int, name: str = "weight") -> torch.Tensor:
    """[out/4, in] uint8 -> our ternary codes [out, in] (code = t + 1)."""
    if packed.dtype != torch.uint8 or packed.dim() != 2:
        raise ValueError(f"{name}: expected a 2-D uint8 packed BitNet weight, got {packed.dtype} "
                         f"of shape {tuple(packed.shape)}")
    rows = packed.shape[0]
    if rows != -(-out_features // VALUES_PER_BYTE):
        raise ValueError(f"{name}: packed shape {tuple(packed.shape)} does not hold {out_features} "
                         f"output rows ({VALUES_PER_BYTE} per byte)")
    codes = torch.cat([(packed >> (2 * i)) & 3 for i in range(VALUES_PER_BYTE)], dim=0)[:out_features]
    bad = (codes == 3).nonzero()
    if len(bad):
        r, k = bad[0].tolist()
        raise ValueError(f"{name}: code 3 at row {r}, column {k} is not a ternary value")
    return codes.contiguous()


@contextlib.contextmanager
def _params_on_meta():
    """Build modules with parameters on the meta device (no memory) while
    buffers such as rotary inv_freq are computed for real on the CPU. The
    patch is process-wide, so it acts only on this thread's modules."""
    original = nn.Module.register_parameter
    owner = threading.get_ident()

    def register(module, name, param):
        original(module, name, param)
        if param is not None and threading.get_ident() == owner:
            kwargs = dict(param.__dict__, requires_grad=param.requires_grad)
            module._parameters[name] = type(param)(param.to("meta"), **kwargs)

    nn.Module.register_parameter = register
    try:
        yield
    finally:
        nn.Module.register_parameter = original


def _checkpoint_files(directory: str) -> list[str]:
    index = os.path.join(directory, "model.safetensors.index.json")
    if os.path.exists(index):
        try:
            with open(index) as f:
                weight_map = json.load(f).get("weight_map")
        except (ValueError, AttributeError) as e:
            raise ValueError(f"{index}: expected a JSON object with key 'weight_map' ({e})") from None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise ValueError(f"{index}: key 'weight_map': expected an object of tensor name -> file name, got "
                             f"{weight_map!r:.80}")
        files = sorted(set(weight_map.values()))
        return [os.path.join(directory, f) for f in files]
    single = os.path.join(directory, "model.safetensors")
    if not os.path.exists(single):
        raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {directory}")
    return [single]


class _CheckpointTensors(Mapping):
    """Every tensor of a checkpoint by name, whichever shard holds it: a
    layer's weight, weight_scale and bias may sit in different shards. Names
    come from each file's own header (not just the index), and safe_open only
    maps the files, so a tensor is read when it is looked up, not before."""

    def __init__(self, directory: str, stack: contextlib.ExitStack):
        from safetensors import safe_open

        self._files = {}
        self.path_of: dict[str, str] = {}
        for path in _checkpoint_files(directory):
            self._files[path] = stack.enter_context(safe_open(path, framework="pt"))
            self.path_of.update(dict.fromkeys(self._files[path].keys(), path))

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._files[self.path_of[name]].get_tensor(name)

    def __contains__(self, name) -> bool:
        # Mapping's default would read the tensor just to test membership.
        return name in self.path_of

    def __iter__(self):
        return iter(self.path_of)

    def __len__(self) -> int:
        return len(self.path_of)


def _selected(name: str, skip: list[str]) -> bool:
    return not any(name == s or name.endswith("." + s) or name.startswith(s + ".") for s in skip)


def _follow_dtype(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Float tensors take the dtype the caller asked for; integer ones keep theirs."""
    return t.to(dtype) if t.is_floating_point() else t


def _ternary_codes(t: torch.Tensor, name: str) -> torch.Tensor:
    """Unpacked ternary values (floats -1, 0, 1) -> our codes t + 1."""
    bad = ~((t == -1) | (t == 0) | (t == 1))
    if bad.any():
        r, k = bad.nonzero()[0].tolist()
        raise ValueError(f"{name}: {t[r, k].item()} at row {r}, column {k} is not a ternary value -1, 0 or 1")
    return (t + 1).to(torch.uint8)


def _layer_codes(weight: torch.Tensor, lin: nn.Linear, linear_class: str, wkey: str, path: str) -> torch.Tensor:
    """The codes of a checkpoint weight: packed uint8 [out/4, in], or for
    "autobitlinear" the ternary values unpacked [out, in]."""
    if weight.is_floating_point():
        if linear_class != "autobitlinear":
            raise ValueError(f"{path}: {wkey} is {weight.dtype}: a {linear_class!r} checkpoint holds packed uint8 "
                             "weights (only 'autobitlinear' ones may hold the ternary values unpacked)")
        if weight.dim() != 2 or tuple(weight.shape) != (lin.out_features, lin.in_features):
            raise ValueError(f"{path}: {wkey}: unpacked ternary weight of shape {tuple(weight.shape)}, the model "
                             f"expects ({lin.out_features}, {lin.in_features})")
        return _ternary_codes(weight.float(), wkey)
    codes = unpack_hf_bitnet(weight, lin.out_features, wkey)
    if codes.shape[1] != lin.in_features:
        raise ValueError(f"{wkey}: {codes.shape[1]} input features, the model expects {lin.in_features}")
    return codes


def _check_format(format: str) -> str:
    """A format of LinearTernary's ("ternary", or "ternary_base3": 1.6 bits a weight, the same values)."""
    if format not in LinearTernary.FORMATS:
        raise ValueError(f"format must be one of LinearTernary's formats {LinearTernary.FORMATS}, got {format!r}")
    return format


def _ternary_layer(tensors: _CheckpointTensors, name: str, lin: nn.Linear, linear_class: str,
                   dtype: torch.dtype, norm_eps: float | None, format: str) -> LinearTernary:
    wkey, skey, nkey = name + ".weight", name + ".weight_scale", name + ".rms_norm.weight"
    if skey not in tensors:
        raise ValueError(f"{tensors.path_of[wkey]}: {wkey} has no {skey}")
    if norm_eps is not None and nkey not in tensors:
        raise ValueError(f"{tensors.path_of[wkey]}: {wkey} has no {nkey}, and the config says use_rms_norm")
    codes = _layer_codes(tensors[wkey], lin, linear_class, wkey, tensors.path_of[wkey])
    ws = tensors[skey].float()
    if ws.numel() != 1 or not torch.isfinite(ws).all() or ws.item() == 0:
        raise ValueError(f"{skey}: expected one finite non-zero scale, got shape {tuple(ws.shape)}")
    scale = 1.0 / ws if linear_class == "bitlinear" else ws
    bias = tensors.get(name + ".bias")
    if bias is not None:
        # AutoBitLinear scales its output after adding the bias: the bias is scaled too.
        bias = _follow_dtype(bias.float() * ws.reshape(()) if linear_class == "autobitlinear" else bias, dtype)
    layer = LinearTernary.from_codes(codes, scale.reshape(1, 1).expand(lin.out_features, 1), format=format,
                                     bias=bias, granularity="tensor")
    if norm_eps is None:
        return layer
    try:
        return NormedLinearTernary.from_layer(layer, _follow_dtype(tensors[nkey], dtype), norm_eps)
    except ValueError as e:
        raise ValueError(f"{tensors.path_of[nkey]}: {nkey}: {e}") from None


def load_bitnet_checkpoint(directory: str, *, dtype: torch.dtype = torch.bfloat16,
                           bf16_gemv: bool = True, format: str = "ternary") -> nn.Module:
    """Load an HF BitNet checkpoint directory into a transformers model whose
    quantised linears are LinearTernary (per-tensor scale), with no download
    and no re-quantisation. Float tensors, biases included, are cast to dtype.
    format: "ternary" (2 bits a weight) or "ternary_base3" (1.6 bits, the same
    weights and outputs; docs/formats.md)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    format = _check_format(format)
    directory = str(directory)
    config_path = os.path.join(directory, "config.json")
    if not os.path.isfile(config_path):
        # (transformers would read a missing directory as a Hub repo id, and say that its form is wrong)
        raise FileNotFoundError(f"{config_path} not found: load_bitnet_checkpoint reads a local checkpoint directory "
                                "(config.json and model.safetensors); download one first, e.g. with "
                                "huggingface_hub.snapshot_download")
    config = AutoConfig.from_pretrained(directory, local_files_only=True)
    qc = getattr(config, "quantization_config", None)
    qc = qc.to_dict() if hasattr(qc, "to_dict") else qc
    if not isinstance(qc, dict):
        raise ValueError(f"{config_path}: key 'quantization_config': expected an object with quant_method 'bitnet', "
                         f"got {qc!r:.80}")
    if qc.get("quant_method") != "bitnet":
        raise ValueError(f"{config_path}: key 'quantization_config.quant_method': expected 'bitnet', got "
                         f"{qc.get('quant_method')!r}")
    linear_class = qc.get("linear_class", "bitlinear")
    if linear_class not in LINEAR_CLASSES:
        raise ValueError(f"{config_path}: key 'quantization_config.linear_class': expected one of {LINEAR_CLASSES}, "
                         f"got {linear_class!r}")
    norm_eps = _norm_eps(qc, config_path)
    skip = qc.get("modules_to_not_convert") or ["lm_head"]
    if not isinstance(skip, list) or not all(isinstance(n, str) for n in skip):
        raise ValueError(f"{config_path}: key 'quantization_config.modules_to_not_convert': expected a list of "
                         f"module names, got {skip!r:.80}")
    del config.quantization_config

    with _params_on_meta():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    targets = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear) and _selected(n, skip)}

    with contextlib.ExitStack() as stack:
        tensors = _CheckpointTensors(directory, stack)
        missing_layers = sorted(n for n in targets if n + ".weight" not in tensors)
        if missing_layers:
            raise ValueError(f"{directory}: no packed weight for layers {missing_layers[:5]}")
        for name, lin in targets.items():
            replace_module(model, name, _ternary_layer(tensors, name, lin, linear_class, dtype, norm_eps, format))
        owned = {f"{n}.{k}" for n in targets for k in ("weight", "weight_scale", "bias", "rms_norm.weight")}
        dense = {k: _follow_dtype(tensors[k], dtype) for k in tensors if k not in owned}
    model.load_state_dict(dense, strict=False, assign=True)
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
    still_meta = [n for n, p in model.named_parameters() if p.is_meta]
    if still_meta:
        raise ValueError(f"{directory}: checkpoint lacks tensors {still_meta[:5]}")
    # as quantize_: the bf16 layers left (lm_head) on the one-token bf16 GEMV
    finish_conversion(model, bf16_gemv=bf16_gemv, hugepages=False)
    _record_config(model, bf16_gemv, format)
    return model.eval()


def _norm_eps(qc: dict, where: str) -> float | None:
    """The eps of the layers' RMSNorms where the config has use_rms_norm, else None."""
    if not qc.get("use_rms_norm"):
        return None
    eps = qc.get("rms_norm_eps")
    eps = 1e-6 if eps is None else eps  # transformers' BitNetQuantConfig default
    return check_eps(eps, f"{where}: key 'quantization_config.rms_norm_eps'")


def _record_config(model: nn.Module, bf16_gemv: bool, format: str) -> None:
    """ulbtorch's own config, so that save_pretrained writes a checkpoint
    from_pretrained loads packed (with the layers' input norms, as
    UlbConfig's input_norm_eps, where they have them)."""
    run_conversion_hooks(model, QuantConfig(format=format, granularity="tensor",
                                            exclude=[n for n, _ in linear_layers(model, lambda n: True)],
                                            bf16_gemv=bf16_gemv))


def convert_bitnet_model(model: nn.Module, *, bf16_gemv: bool = True, format: str = "ternary") -> nn.Module:
    """After transformers' own `from_pretrained` of a BitNet checkpoint: swap
    its BitLinear / AutoBitLinear layers for LinearTernary (NormedLinearTernary
    where they hold an RMSNorm, use_rms_norm), in place. The model's
    quantization config becomes ulbtorch's (with input_norm_eps where the
    layers hold norms), so save_pretrained and from_pretrained keep working.
    bf16_gemv as in quantize_ (and recorded in that config, so a reload gets
    the same layers); format as in load_bitnet_checkpoint."""
    from transformers.integrations.bitnet import AutoBitLinear, BitLinear

    format = _check_format(format)
    built = []
    for name, m in [(n, m) for n, m in model.named_modules() if isinstance(m, (BitLinear, AutoBitLinear))]:
        ws = m.weight_scale.detach().float().reshape(-1)
        bias = m.bias
        if isinstance(m, BitLinear):
            codes = unpack_hf_bitnet(m.weight.detach(), m.out_features, name + ".weight")
            scale = 1.0 / ws
        else:
            if getattr(m, "online_quant", False):
                raise ValueError(f"{name}: AutoBitLinear in online mode holds float weights; "
                                 "use ulbtorch.quantize_(model, bits='ternary', granularity='tensor')")
            codes = _ternary_codes(m.weight.detach().float(), f"{name}.weight (after loading)")
            scale = ws
            if bias is not None:  # its forward scales the output after adding the bias
                bias = (bias.detach().float() * ws.reshape(())).to(bias.dtype)
        out_features = codes.shape[0]
        layer = LinearTernary.from_codes(codes, scale.reshape(1, 1).expand(out_features, 1), format=format,
                                         bias=bias, granularity="tensor")
        norm = getattr(m, "rms_norm", None)
        if norm is not None:
            layer = NormedLinearTernary.from_layer(layer, norm.weight, norm.variance_epsilon)
        built.append((name, layer))
    if not built:
        raise ValueError("model has no BitLinear/AutoBitLinear layers to convert")
    eps = sorted({e for _, layer in built if (e := input_norm_eps(layer)) is not None})
    if len(eps) > 1 or (eps and any(input_norm_eps(layer) is None for _, layer in built)):
        # (transformers' BitNet layers all take the config's one rms_norm_eps)
        raise ValueError(f"the BitNet layers' input norms disagree (eps {eps}, some layers without): no one "
                         "config describes them")
    for name, layer in built:  # every layer built first: a failure leaves the model as it was
        replace_module(model, name, layer)
    config = getattr(model, "config", None)
    if config is not None and getattr(config, "quantization_config", None) is not None:
        from ..integrations.transformers import UlbConfig, UlbHfQuantizer

        skip = getattr(config.quantization_config, "modules_to_not_convert", None) or ["lm_head"]
        ulb = UlbConfig(format=format, granularity="tensor", modules_to_not_convert=list(skip),
                        bf16_gemv=bf16_gemv, input_norm_eps=eps[0] if eps else None)
        config.quantization_config = ulb
        model.hf_quantizer = UlbHfQuantizer(ulb, pre_quantized=True)
        if hasattr(model, "_weight_conversions"):
            # transformers would replay BitNet's load-time conversion backwards
            # on save; our layers are saved as they are.
            model._weight_conversions = []
    finish_conversion(model, bf16_gemv=bf16_gemv, hugepages=False)
    return model

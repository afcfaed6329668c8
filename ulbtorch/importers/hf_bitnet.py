"""Hugging Face's BitNet checkpoint format (quant_method "bitnet"), as
microsoft/bitnet-b1.58-2B-4T and tiiuae/Falcon3-*-1.58bit publish it:

* `<layer>.weight`: uint8 [out/4, in]; byte r of column k holds, in bits
  2i..2i+1, the ternary value of output row i*out/4 + r as code t+1.
* `<layer>.weight_scale`: shape (1,). linear_class "bitlinear": W = T / scale;
  "autobitlinear": W = T * scale.
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


def _ternary_layer(tensors: _CheckpointTensors, name: str, lin: nn.Linear, linear_class: str,
                   dtype: torch.dtype) -> LinearTernary:
    wkey, skey = name + ".weight", name + ".weight_scale"
    if skey not in tensors:
        raise ValueError(f"{tensors.path_of[wkey]}: {wkey} has no {skey}")
    codes = unpack_hf_bitnet(tensors[wkey], lin.out_features, wkey)
    if codes.shape[1] != lin.in_features:
        raise ValueError(f"{wkey}: {codes.shape[1]} input features, the model expects {lin.in_features}")
    ws = tensors[skey].float()
    if ws.numel() != 1 or not torch.isfinite(ws).all() or ws.item() == 0:
        raise ValueError(f"{skey}: expected one finite non-zero scale, got shape {tuple(ws.shape)}")
    scale = 1.0 / ws if linear_class == "bitlinear" else ws
    bias = tensors.get(name + ".bias")
    return LinearTernary.from_codes(codes, scale.reshape(1, 1).expand(lin.out_features, 1), format="ternary",
                                    bias=None if bias is None else _follow_dtype(bias, dtype),
                                    granularity="tensor")


def load_bitnet_checkpoint(directory: str, *, dtype: torch.dtype = torch.bfloat16,
                           bf16_gemv: bool = True) -> nn.Module:
    """Load an HF BitNet checkpoint directory into a transformers model whose
    quantised linears are LinearTernary (per-tensor scale), with no download
    and no re-quantisation. Float tensors, biases included, are cast to dtype."""
    from transformers import AutoConfig, AutoModelForCausalLM

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
    if qc.get("use_rms_norm"):
        raise NotImplementedError(f"{config_path}: BitNet layers with quantization_config.use_rms_norm=True are not "
                                  "supported yet")
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
            replace_module(model, name, _ternary_layer(tensors, name, lin, linear_class, dtype))
        dense = {k: _follow_dtype(tensors[k], dtype) for k in tensors if k.rsplit(".", 1)[0] not in targets}
    model.load_state_dict(dense, strict=False, assign=True)
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
    still_meta = [n for n, p in model.named_parameters() if p.is_meta]
    if still_meta:
        raise ValueError(f"{directory}: checkpoint lacks tensors {still_meta[:5]}")
    # as quantize_: the bf16 layers left (lm_head) on the one-token bf16 GEMV
    finish_conversion(model, bf16_gemv=bf16_gemv, hugepages=False)
    # ulbtorch's own config, so that save_pretrained writes a checkpoint from_pretrained loads packed
    run_conversion_hooks(model, QuantConfig(format="ternary", granularity="tensor",
                                            exclude=[n for n, _ in linear_layers(model, lambda n: True)],
                                            bf16_gemv=bf16_gemv))
    return model.eval()


def convert_bitnet_model(model: nn.Module, *, bf16_gemv: bool = True) -> nn.Module:
    """After transformers' own `from_pretrained` of a BitNet checkpoint: swap
    its BitLinear / AutoBitLinear layers for LinearTernary, in place. The
    model's quantization config becomes ulbtorch's, so save_pretrained and
    from_pretrained keep working. bf16_gemv as in quantize_ (and recorded in
    that config, so a reload gets the same layers)."""
    from transformers.integrations.bitnet import AutoBitLinear, BitLinear

    converted = 0
    for name, m in [(n, m) for n, m in model.named_modules() if isinstance(m, (BitLinear, AutoBitLinear))]:
        if getattr(m, "rms_norm", None) is not None:
            raise NotImplementedError(f"{name}: BitNet layers with use_rms_norm=True are not supported yet")
        ws = m.weight_scale.detach().float().reshape(-1)
        if isinstance(m, BitLinear):
            codes = unpack_hf_bitnet(m.weight.detach(), m.out_features, name + ".weight")
            scale = 1.0 / ws
        else:
            if getattr(m, "online_quant", False):
                raise ValueError(f"{name}: AutoBitLinear in online mode holds float weights; "
                                 "use ulbtorch.quantize_(model, bits='ternary', granularity='tensor')")
            t = m.weight.detach().float()
            if not bool(((t == -1) | (t == 0) | (t == 1)).all()):
                raise ValueError(f"{name}.weight: not ternary after loading")
            codes = (t + 1).to(torch.uint8)
            scale = ws
        out_features = codes.shape[0]
        layer = LinearTernary.from_codes(codes, scale.reshape(1, 1).expand(out_features, 1), format="ternary",
                                         bias=m.bias, granularity="tensor")
        replace_module(model, name, layer)
        converted += 1
    if not converted:
        raise ValueError("model has no BitLinear/AutoBitLinear layers to convert")
    config = getattr(model, "config", None)
    if config is not None and getattr(config, "quantization_config", None) is not None:
        from ..integrations.transformers import UlbConfig, UlbHfQuantizer

        qc = config.quantization_config
        skip = getattr(qc, "modules_to_not_convert", None) or ["lm_head"]
        ulb = UlbConfig(format="ternary", granularity="tensor", modules_to_not_convert=list(skip),
                        bf16_gemv=bf16_gemv)
        config.quantization_config = ulb
        model.hf_quantizer = UlbHfQuantizer(ulb, pre_quantized=True)
        if hasattr(model, "_weight_conversions"):
            # transformers would replay BitNet's load-time conversion backwards
            # on save; our layers are saved as they are.
            model._weight_conversions = []
    finish_conversion(model, bf16_gemv=bf16_gemv, hugepages=False)
    return model

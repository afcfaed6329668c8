"""Our checkpoint format: model.safetensors (packed blobs as uint8 tensors,
everything else as is) plus ulbtorch.json listing each low-bit layer (and
the bf16 layers on the bf16 GEMV), so a model built from its config loads
back bit-exactly without re-quantising."""
from __future__ import annotations

import json
import os
import warnings

from safetensors import safe_open
from safetensors.torch import load_model, save_model
from torch import nn

from .finish import finish_conversion
from .nn import MODULE_FOR_FORMAT, LinearBF16, LowBitLinear
from .integrations.hf_experts import (expert_shape, fused_weight_names, is_fused_experts, pack_experts,
                                      parse_expert_layer_name)
from .nn.replace import is_plain_linear, module_names, replace_everywhere

MANIFEST = "ulbtorch.json"
WEIGHTS = "model.safetensors"
FORMAT_VERSION = 1


def quantized_layers(model: nn.Module) -> dict[str, dict]:
    return {name: dict(format=m.format, in_features=m.in_features, out_features=m.out_features,
                       bias=m.bias is not None, group_size=m.group_size, granularity=m.granularity)
            for name, m in model.named_modules() if isinstance(m, LowBitLinear)}


def save_quantized(model: nn.Module, directory: str) -> None:
    """Write the model's weights and the list of its low-bit layers."""
    layers = quantized_layers(model)
    if not layers:
        raise ValueError("model has no ulbtorch low-bit layers; run ulbtorch.quantize_ first")
    os.makedirs(directory, exist_ok=True)
    save_model(model, os.path.join(directory, WEIGHTS), metadata={"format": "pt", "ulbtorch": str(FORMAT_VERSION)})
    gemv = [name for name, m in model.named_modules() if isinstance(m, LinearBF16)]
    with open(os.path.join(directory, MANIFEST), "w") as f:
        json.dump({"version": FORMAT_VERSION, "layers": layers, "bf16_gemv": gemv}, f, indent=1)


def _layer_for(path: str, name: str, spec) -> LowBitLinear:
    """The empty low-bit layer a manifest entry describes, its fields checked."""
    want = dict(format=str, in_features=int, out_features=int, bias=bool, group_size=int, granularity=str)
    if not isinstance(spec, dict):
        raise ValueError(f"{path}: layer {name!r}: expected an object with {sorted(want)}, got {spec!r}")
    for key, typ in want.items():
        v = spec.get(key)
        if not isinstance(v, typ) or (typ is int and isinstance(v, bool)):
            raise ValueError(f"{path}: layer {name!r}: {key} must be a {typ.__name__}, got {v!r}")
    if spec["format"] not in MODULE_FOR_FORMAT:
        raise ValueError(f"{path}: layer {name!r} has unknown format {spec['format']!r}")
    try:
        return MODULE_FOR_FORMAT[spec["format"]](spec["in_features"], spec["out_features"], spec["bias"],
                                                 format=spec["format"], group_size=spec["group_size"],
                                                 granularity=spec["granularity"])
    except (ValueError, TypeError) as e:
        raise ValueError(f"{path}: layer {name!r}: {e}") from None


def _expert_groups(path: str, here: dict, layers: dict) -> list[tuple[nn.Module, str, list[str]]]:
    """The manifest's layers that are experts of a transformers MoE module
    (named "<experts module>.packed_<weight>.<expert>") whose weight the model holds
    as a 3-D parameter: (module, weight name, layer names in expert order)."""
    found = {}
    for name in layers:
        parsed = None if name in here else parse_expert_layer_name(name)
        if parsed is None:
            continue
        module_name, weight, index = parsed
        m = here.get(module_name)
        if m is not None and is_fused_experts(m) and weight in fused_weight_names(m):
            found.setdefault((module_name, weight), {})[index] = name
    out = []
    for (module_name, weight), per in found.items():
        m = here[module_name]
        n_experts = expert_shape(m, weight)[0]
        if sorted(per) != list(range(n_experts)):
            raise ValueError(f"{path}: {module_name}.{weight} holds {n_experts} experts in the model, but the "
                             f"checkpoint lists experts {sorted(per)}")
        out.append((m, weight, [per[e] for e in range(n_experts)]))
    return out


def _check_saved(path: str, weights: str, f, saved: set, name: str, aliases: list[str], new: LowBitLinear) -> None:
    """That the weights file (open as f) holds the tensors of the layer the
    manifest describes (under one of its names): a packed blob that fits the
    layer, a bias of its shape, and a bias only where it says so."""
    for key, t in new.state_dict(keep_vars=True).items():
        stored = next((f"{a}.{key}" for a in aliases if f"{a}.{key}" in saved), None)
        if stored is None:
            raise ValueError(f"{path}: layer {name!r}: {weights} has no {name}.{key}")
        if key == "packed":
            why = new.packed_mismatch(f.get_tensor(stored))
            if why:
                raise ValueError(f"{path}: layer {name!r}: {weights}'s {stored}: {why}")
        elif (shape := list(f.get_slice(stored).get_shape())) != list(t.shape):
            raise ValueError(f"{path}: layer {name!r}: {weights}'s {stored} has shape {shape}, the layer's {key} "
                             f"{list(t.shape)}")
    if new.bias is None and any(f"{a}.bias" in saved for a in aliases):
        raise ValueError(f"{path}: layer {name!r} has no bias in the manifest but {weights} holds {name}.bias")


def load_quantized(model: nn.Module, directory: str, *, hugepages: bool = True) -> nn.Module:
    """Swap the layers named in the manifest for empty low-bit layers, then
    load all weights. `model` is the float architecture (e.g. from_config).
    1-bit weights are put in the tile order this CPU's kernels read fastest
    (ops.retile), so their bytes may differ from the saved ones; the weights
    are the same. hugepages: as quantize_'s (ulbtorch.hugepages)."""
    path = os.path.join(directory, MANIFEST)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} not found: not a directory written by ulbtorch.save_quantized")
    with open(path) as f:
        manifest = json.load(f)
    if manifest.get("version") != FORMAT_VERSION:
        raise ValueError(f"{path}: unsupported ulbtorch checkpoint version {manifest.get('version')}")
    weights = os.path.join(directory, WEIGHTS)
    if not os.path.exists(weights):
        raise FileNotFoundError(f"{weights} not found: the directory has {MANIFEST} but not the weights it lists")
    on_meta = [n for n, t in (*model.named_parameters(), *model.named_buffers()) if t.is_meta]
    if on_meta:
        raise ValueError(f"load_quantized copies into the model's tensors, but {on_meta[:3]} are on the meta "
                         "device; build the model on the CPU (e.g. AutoModelForCausalLM.from_config(config))")
    # Every layer is checked before any is swapped: a failed load leaves the model as it was.
    here = dict(model.named_modules(remove_duplicate=False))
    layers = manifest.get("layers")
    if not isinstance(layers, dict):
        raise ValueError(f"{path}: 'layers' must be an object of layer name -> layer, got {type(layers).__name__}")
    # experts: (module, weight name, [(layer name, empty layer)] in expert order)
    experts = [(m, p, [(n, _layer_for(path, n, layers[n])) for n in per])
               for m, p, per in _expert_groups(path, here, layers)]
    in_experts = {n for _, _, per in experts for n, _ in per}
    swaps = [(name, here.get(name), _layer_for(path, name, spec)) for name, spec in layers.items()
             if name not in in_experts]
    for name, old, _ in swaps:
        if old is None:
            raise ValueError(f"{path}: layer {name!r} does not exist in the model")
        if not isinstance(old, (nn.Linear, LowBitLinear)):
            raise ValueError(f"{path}: layer {name!r} is a {type(old).__name__} in the model, not a linear layer")
    names = module_names(model)
    # (name, its names in the model, in->out there, the layer the manifest describes)
    listed = [(name, names[id(old)], (old.in_features, old.out_features), new) for name, old, new in swaps] + [
        (name, [name], expert_shape(m, p)[1:3], new) for m, p, per in experts for name, new in per]
    with safe_open(weights, framework="pt") as f:
        saved = set(f.keys())
        for name, aliases, (in_f, out_f), new in listed:
            if (in_f, out_f) != (new.in_features, new.out_features):
                raise ValueError(f"{path}: layer {name!r} is {in_f}->{out_f} in the model "
                                 f"but {new.in_features}->{new.out_features} in the checkpoint")
            _check_saved(path, weights, f, saved, name, aliases, new)
        for name, m in here.items():  # layers packed already, which the manifest does not list
            if isinstance(m, LowBitLinear) and name not in layers:
                _check_saved(path, weights, f, saved, name, names[id(m)], m)
    for name, old, new in swaps:
        replace_everywhere(model, names, old, new)  # a layer used at two places, at both
    for m, p, per in experts:
        pack_experts(m, {p: [new for _, new in per]})
    missing, unexpected = load_model(model, weights, strict=False)
    missing, unexpected = sorted(missing), sorted(unexpected)
    if getattr(getattr(model, "config", None), "tie_word_embeddings", False):
        missing = [k for k in missing if not k.endswith("lm_head.weight")]  # saved once, as the embedding
    if missing or unexpected:
        raise ValueError(f"checkpoint in {directory} does not match the model: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}")
    gemv = manifest.get("bf16_gemv", [])  # the layers that ran as LinearBF16 when saved
    finish_conversion(model, bf16_gemv=gemv, hugepages=hugepages)
    if gemv:
        here = dict(model.named_modules(remove_duplicate=False))
        # bf16_gemv_ takes only bf16 layers: a model built in another dtype keeps these on F.linear.
        skipped = [f"{n} ({str(here[n].weight.dtype).removeprefix('torch.')})"
                   for n in gemv if is_plain_linear(here.get(n))]
        if skipped:
            warnings.warn(f"load_quantized: {', '.join(skipped)} left on F.linear: the saved model ran these "
                          "layers in bf16 on ulbtorch's bf16 GEMV (nn.LinearBF16), but their weights here are not "
                          "bfloat16, so the outputs differ from the saved model's; build the model with "
                          "dtype=torch.bfloat16 to reproduce it", stacklevel=2)
    return model

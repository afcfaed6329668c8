"""Our checkpoint format: model.safetensors (packed blobs as uint8 tensors,
everything else as is) whose metadata carries the manifest listing each
low-bit layer (and the bf16 layers on the bf16 GEMV), with a copy in
ulbtorch.json (ulbtorch._manifest), so a model built from its config loads
back bit-exactly without re-quantising.

A save publishes its files by renames (ulbtorch._atomic): a crash leaves the
previous checkpoint or the new one. A load checks every stored tensor's
dtype and shape, and every packed blob, before it changes any layer."""
from __future__ import annotations

import os
import warnings

from safetensors import SafetensorError, safe_open
from safetensors.torch import load_model, save_model
from torch import nn

from . import ops
from ._atomic import staging
from ._manifest import (MANIFEST, METADATA_KEY, NORM_FIELD, VERSION, WEIGHTS, Manifest, manifest_text,
                        read_manifest)
from ._stored import check_every_tensor, state_after
from .finish import finish_conversion
from .integrations.hf_experts import (PACKED, expert_shape, fused_weight_names, is_fused_experts, pack_experts,
                                      parse_expert_layer_name)
from .nn import MODULE_FOR_FORMAT, LinearBF16, LowBitLinear
from .nn.replace import is_plain_linear, module_names, replace_everywhere

def quantized_layers(model: nn.Module) -> dict[str, dict]:
    """The manifest's entry of each low-bit layer."""
    out = {}
    for name, m in model.named_modules():
        if isinstance(m, LowBitLinear):
            try:
                tiles = ops.packed_info(m.packed)["tiles"]
            except (TypeError, RuntimeError) as e:
                raise ValueError(f"save_quantized: layer {name!r} holds no valid packed weight ({e}); build it with "
                                 "from_linear/from_codes or load its weights first") from None
            out[name] = dict(format=m.format, in_features=m.in_features, out_features=m.out_features,
                             bias=m.bias is not None, group_size=m.group_size, granularity=m.granularity, tiles=tiles)
            eps = getattr(m, NORM_FIELD, None)  # importers.NormedLinearTernary's
            if eps is not None:
                out[name][NORM_FIELD] = eps
    return out


def save_quantized(model: nn.Module, directory: str) -> None:
    """Write the model's weights and the list of its low-bit layers into
    `directory` (created if need be; other files there are left alone). The
    weights and their manifest become visible together: a save that fails
    or is killed leaves the checkpoint the directory held before."""
    layers = quantized_layers(model)
    if not layers:
        raise ValueError("model has no ulbtorch low-bit layers; run ulbtorch.quantize_ first")
    gemv = [name for name, m in model.named_modules() if isinstance(m, LinearBF16)]
    text = manifest_text(layers, gemv)
    with staging(str(directory)) as stage:
        try:
            save_model(model, stage.path(WEIGHTS),
                       metadata={"format": "pt", "ulbtorch": str(VERSION), METADATA_KEY: text})
            stage.write_text(MANIFEST, text)
        except (OSError, SafetensorError) as e:
            raise OSError(f"save_quantized: writing the checkpoint into {directory} failed ({e}); the files there "
                          "are as they were") from e
        # The weights first: they carry the manifest, and a copy of ulbtorch.json
        # from an earlier save is not read beside them (ulbtorch._manifest).
        stage.publish(WEIGHTS)
        stage.publish(MANIFEST)


def _layer_for(m: Manifest, name: str) -> LowBitLinear:
    """The empty low-bit layer a manifest entry describes."""
    spec = m.layers[name]
    if spec["format"] not in MODULE_FOR_FORMAT:
        raise ValueError(f"{m.source}: layer {name!r}: key 'format': expected one of {sorted(MODULE_FOR_FORMAT)}, "
                         f"got {spec['format']!r}")
    cls, extra = MODULE_FOR_FORMAT[spec["format"]], {}
    if NORM_FIELD in spec:
        from .nn.normed import NormedLinearTernary

        if not issubclass(NormedLinearTernary, cls):
            raise ValueError(f"{m.source}: layer {name!r}: key {NORM_FIELD!r} is for ternary layers, but its format "
                             f"is {spec['format']!r}")
        cls, extra = NormedLinearTernary, dict(eps=spec[NORM_FIELD])
    try:
        return cls(spec["in_features"], spec["out_features"], spec["bias"], format=spec["format"],
                   group_size=spec["group_size"], granularity=spec["granularity"], **extra)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{m.source}: layer {name!r}: {e}") from None


def _expert_groups(m: Manifest, here: dict) -> list[tuple[str, nn.Module, str, list[str]]]:
    """The manifest's layers that are experts of a transformers MoE module
    (named "<experts module>.packed_<weight>.<expert>") whose weight the model holds
    as a 3-D parameter: (module name, module, weight name, layer names in expert order)."""
    found = {}
    for name in m.layers:
        parsed = None if name in here else parse_expert_layer_name(name)
        if parsed is None:
            continue
        module_name, weight, index = parsed
        mod = here.get(module_name)
        if mod is not None and is_fused_experts(mod) and weight in fused_weight_names(mod):
            found.setdefault((module_name, weight), {})[index] = name
    out = []
    for (module_name, weight), per in found.items():
        n_experts = expert_shape(here[module_name], weight)[0]
        if sorted(per) != list(range(n_experts)):
            raise ValueError(f"{m.source}: {module_name}.{weight} holds {n_experts} experts in the model, but the "
                             f"checkpoint lists experts {sorted(per)}")
        out.append((module_name, here[module_name], weight, [per[e] for e in range(n_experts)]))
    return out


def _check_saved(m: Manifest, weights: str, f, saved: set, name: str, aliases: list[str], new: LowBitLinear) -> bool:
    """That the weights file (open as f) holds the tensors of the layer the
    manifest describes (under one of its names): a packed blob that fits the
    layer, in the manifest's tile order, whose bytes pass ops.packed_info's
    verify, a bias of its shape, and a bias only where it says so. Returns
    whether a checksum vouched for the blob (not for blob version 2)."""
    spec = m.layers.get(name)
    checked = False
    for key, t in new.state_dict(keep_vars=True).items():
        stored = next((f"{a}.{key}" for a in aliases if f"{a}.{key}" in saved), None)
        if stored is None:
            raise ValueError(f"{m.source}: layer {name!r}: {weights} has no {name}.{key}")
        if key == "packed":
            blob = f.get_tensor(stored)
            why = new.packed_mismatch(blob)
            if why:
                raise ValueError(f"{m.source}: layer {name!r}: {weights}'s {stored}: {why}")
            try:
                info = ops.packed_info(blob, verify=True)
            except ValueError as e:
                raise ValueError(f"{m.source}: layer {name!r}: {weights}'s {stored}: {e}") from None
            if spec is not None and "tiles" in spec and info["tiles"] != spec["tiles"]:
                raise ValueError(f"{m.source}: layer {name!r}: {weights}'s {stored} is in the {info['tiles']} tile "
                                 f"order, but the manifest says {spec['tiles']}: the blob's header is damaged")
            checked = info["checked"]
        elif (shape := list(f.get_slice(stored).get_shape())) != list(t.shape):
            raise ValueError(f"{m.source}: layer {name!r}: {weights}'s {stored} has shape {shape}, the layer's {key} "
                             f"{list(t.shape)}")
    if new.bias is None and any(f"{a}.bias" in saved for a in aliases):
        raise ValueError(f"{m.source}: layer {name!r} has no bias in the manifest but {weights} holds {name}.bias")
    return checked


def _add_checksums(layers: list[LowBitLinear]) -> None:
    """The blobs of version 2 loaded into `layers` rewritten as current ones
    (ops.retile into their own tile order), so that from here on, and in the
    next save, a checksum vouches for them."""
    for layer in layers:
        blob = layer.packed
        layer.packed = ops.retile(blob, ops.packed_info(blob)["tiles"]).to(blob.device)


def load_quantized(model: nn.Module, directory: str, *, hugepages: bool = True) -> nn.Module:
    """Swap the layers named in the manifest for empty low-bit layers, then
    load all weights. `model` is the float architecture (e.g. from_config).
    Every stored tensor is checked first: a load that fails leaves the model
    as it was. 1-bit weights are put in the tile order this CPU's kernels
    read fastest (ops.retile), so their bytes may differ from the saved
    ones; the weights are the same. hugepages: as quantize_'s
    (ulbtorch.hugepages)."""
    directory = str(directory)
    manifest = read_manifest(directory)
    weights = os.path.join(directory, WEIGHTS)
    on_meta = [n for n, t in (*model.named_parameters(), *model.named_buffers()) if t.is_meta]
    if on_meta:
        raise ValueError(f"load_quantized copies into the model's tensors, but {on_meta[:3]} are on the meta "
                         "device; build the model on the CPU (e.g. AutoModelForCausalLM.from_config(config))")
    here = dict(model.named_modules(remove_duplicate=False))
    layers = manifest.layers
    # experts: (module name, module, weight name, [(layer name, empty layer)] in expert order)
    experts = [(mn, mod, p, [(n, _layer_for(manifest, n)) for n in per])
               for mn, mod, p, per in _expert_groups(manifest, here)]
    in_experts = {n for _, _, _, per in experts for n, _ in per}
    swaps = [(name, here.get(name), _layer_for(manifest, name)) for name in layers if name not in in_experts]
    for name, old, _ in swaps:
        if old is None:
            raise ValueError(f"{manifest.source}: layer {name!r} does not exist in the model")
        if not isinstance(old, (nn.Linear, LowBitLinear)):
            raise ValueError(f"{manifest.source}: layer {name!r} is a {type(old).__name__} in the model, not a "
                             "linear layer")
    names = module_names(model)
    # (name, its names in the model, in->out there, the layer the manifest describes)
    listed = [(name, names[id(old)], (old.in_features, old.out_features), new) for name, old, new in swaps] + [
        (name, [name], expert_shape(mod, p)[1:3], new) for _, mod, p, per in experts for name, new in per]
    unchecked = []  # (name, layer) of the blobs of version 2, which carry no checksum
    with safe_open(weights, framework="pt") as f:
        saved = set(f.keys())
        for name, aliases, (in_f, out_f), new in listed:
            if (in_f, out_f) != (new.in_features, new.out_features):
                raise ValueError(f"{manifest.source}: layer {name!r} is {in_f}->{out_f} in the model "
                                 f"but {new.in_features}->{new.out_features} in the checkpoint")
            if not _check_saved(manifest, weights, f, saved, name, aliases, new):
                unchecked.append((name, new))
        for name, mod in here.items():  # layers packed already, which the manifest does not list
            if isinstance(mod, LowBitLinear) and name not in layers:
                if not _check_saved(manifest, weights, f, saved, name, names[id(mod)], mod):
                    unchecked.append((name, mod))
        check_every_tensor(weights, f, state_after(model, names, [(old, new) for _, old, new in swaps],
                                                   [(mod, p, PACKED, [new for _, new in per])
                                                    for _, mod, p, per in experts]))
    for name, old, new in swaps:
        replace_everywhere(model, names, old, new)  # a layer used at two places, at both
    for _, mod, p, per in experts:
        pack_experts(mod, {p: [new for _, new in per]})
    load_model(model, weights, strict=False)  # what is missing or unexpected was refused above
    if unchecked:
        warnings.warn(f"load_quantized: {len(unchecked)} packed weights in {weights} (e.g. "
                      f"{', '.join(n for n, _ in unchecked[:3])}) are of blob version 2, which has no checksum: "
                      "damage to their bytes could not be detected. They carry one now; save_quantized writes "
                      "the checkpoint again with it", stacklevel=2)
        _add_checksums(list({id(layer): layer for _, layer in unchecked}.values()))
    gemv = manifest.bf16_gemv  # the layers that ran as LinearBF16 when saved
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

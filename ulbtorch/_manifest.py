"""The manifest of a save_quantized checkpoint: its low-bit layers (format,
shape, group size, scale granularity, bias, tile order) and the layers that
ran on the bf16 GEMV.

Version 2 carries it in the metadata of model.safetensors, so that one rename
publishes the weights and their manifest together, and writes the same text
to ulbtorch.json beside it for people to read and edit. Both hold the save's
id: ulbtorch.json is read when its id is the weights' (the file of the same
save, perhaps edited), and otherwise (a file an earlier save left, when a
save stopped between its two renames) the copy in the weights is. Version 1
had the manifest in ulbtorch.json alone."""
from __future__ import annotations

import json
import os
import secrets
from dataclasses import dataclass

from safetensors import SafetensorError, safe_open

MANIFEST = "ulbtorch.json"
WEIGHTS = "model.safetensors"
METADATA_KEY = "ulbtorch_manifest"
VERSION = 2
READABLE = (1, 2)
# Each layer's fields and their types; tiles from version 2 on.
LAYER_FIELDS = dict(format=str, in_features=int, out_features=int, bias=bool, group_size=int, granularity=str)
V2_LAYER_FIELDS = dict(LAYER_FIELDS, tiles=str)
# Optional: a layer whose input goes through its own RMSNorm first (BitNet's
# use_rms_norm, importers.NormedLinearTernary) has its eps here and the norm's
# weight beside its packed blob; an older ulbtorch refuses that tensor.
NORM_FIELD = "input_norm_eps"


@dataclass
class Manifest:
    source: str  # where it was read, for messages: a file, or the weights file's metadata key
    version: int
    layers: dict[str, dict]
    bf16_gemv: list[str]


def manifest_text(layers: dict[str, dict], bf16_gemv: list[str]) -> str:
    return json.dumps({"version": VERSION, "save_id": secrets.token_hex(16), "layers": layers,
                       "bf16_gemv": bf16_gemv}, indent=1)


def _type_name(value) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", int: "an int",
            float: "a number", type(None): "null"}.get(type(value), type(value).__name__)


def _parse(text: str, source: str):
    try:
        return json.loads(text)
    except ValueError as e:
        raise ValueError(f"{source}: not valid JSON ({e}): the checkpoint's manifest is damaged; save the model "
                         "again") from None


def _json_file(path: str):
    try:
        with open(path, encoding="utf-8") as f:
            return _parse(f.read(), path)
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text ({e}): the checkpoint's manifest is damaged") from None


def _beside(path: str) -> dict | None:
    """ulbtorch.json as an object, or None where it is unreadable."""
    try:
        value = _json_file(path)
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def read_manifest(directory: str) -> Manifest:
    """The manifest of the checkpoint in `directory`, its keys checked (each
    layer's fields: check_layer)."""
    weights, beside = os.path.join(directory, WEIGHTS), os.path.join(directory, MANIFEST)
    if not os.path.exists(weights):
        if os.path.exists(beside):
            raise FileNotFoundError(f"{weights} not found: the directory has {MANIFEST} but not the weights it lists")
        raise FileNotFoundError(f"{weights} not found: not a directory written by ulbtorch.save_quantized")
    try:
        with safe_open(weights, framework="pt") as f:
            metadata = f.metadata() or {}
    except SafetensorError as e:
        raise ValueError(f"{weights}: not a readable safetensors file ({e})") from None
    embedded = metadata.get(METADATA_KEY)
    if embedded is None:  # version 1, or weights rewritten by another tool: the manifest file is all there is
        if not os.path.exists(beside):
            raise FileNotFoundError(f"{beside} not found, nor a manifest in {weights}'s metadata (key "
                                    f"{METADATA_KEY!r}): not a directory written by ulbtorch.save_quantized")
        return _checked(_json_file(beside), beside)
    source = f"{weights} (metadata key {METADATA_KEY!r})"
    manifest = _parse(embedded, source)
    other = _beside(beside)
    if isinstance(manifest, dict) and other is not None and other.get("save_id") == manifest.get("save_id"):
        return _checked(other, beside)
    return _checked(manifest, source)


def _checked(m, source: str) -> Manifest:
    if not isinstance(m, dict):
        raise ValueError(f"{source}: expected a JSON object with keys 'version', 'layers' and 'bf16_gemv', got "
                         f"{_type_name(m)}")
    version = m.get("version")
    if isinstance(version, bool) or version not in READABLE:
        raise ValueError(f"{source}: key 'version': expected one of {list(READABLE)} (the checkpoint versions this "
                         f"ulbtorch reads), got {version!r}")
    layers = m.get("layers")
    if not isinstance(layers, dict):
        raise ValueError(f"{source}: key 'layers': expected an object of layer name -> layer, got "
                         f"{_type_name(layers)}")
    gemv = m.get("bf16_gemv", [])
    if not isinstance(gemv, list) or not all(isinstance(n, str) for n in gemv):
        raise ValueError(f"{source}: key 'bf16_gemv': expected a list of layer names (strings), got {gemv!r}")
    if version >= 2 and not isinstance(m.get("save_id"), str):
        raise ValueError(f"{source}: key 'save_id': expected a string, got {m.get('save_id')!r}")
    for name, spec in layers.items():
        check_layer(source, version, name, spec)
    return Manifest(source, version, layers, gemv)


def check_layer(source: str, version: int, name: str, spec) -> None:
    want = V2_LAYER_FIELDS if version >= 2 else LAYER_FIELDS
    if not isinstance(spec, dict):
        raise ValueError(f"{source}: layer {name!r}: expected an object with keys {sorted(want)}, got "
                         f"{_type_name(spec)}")
    for key, typ in want.items():
        v = spec.get(key)
        if not isinstance(v, typ) or (typ is int and isinstance(v, bool)):
            raise ValueError(f"{source}: layer {name!r}: key {key!r}: expected {_type_name(typ())}, got {v!r}")
    eps = spec.get(NORM_FIELD)
    if NORM_FIELD in spec and (isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps >= 0):
        raise ValueError(f"{source}: layer {name!r}: key {NORM_FIELD!r}: expected a number >= 0 (the eps of the "
                         f"layer's input RMSNorm), got {eps!r}")

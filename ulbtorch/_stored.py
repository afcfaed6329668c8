"""The tensors a checkpoint must hold for a model, and the check that a
safetensors file holds exactly those, each of the dtype and shape the model
expects, before anything is loaded into it."""
from __future__ import annotations

import torch
from torch import nn

# safetensors' dtype names (its file header) of the torch dtypes.
_NAMES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
          torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
          torch.bool: "BOOL", torch.uint16: "U16", torch.uint32: "U32", torch.uint64: "U64",
          torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}
_FLOAT_NAMES = {n for d, n in _NAMES.items() if d.is_floating_point}


def state_after(model: nn.Module, names: dict[int, list[str]], swaps: list[tuple[nn.Module, nn.Module]],
                experts: list[tuple[nn.Module, str, str, list[nn.Module]]]) -> dict[str, torch.Tensor]:
    """model.state_dict(keep_vars=True) as it will be once each (old, new) of
    swaps is replaced at every name of old (names: nn.replace.module_names),
    and each (module, weight, prefix, layers) of experts holds its layers as
    `prefix + weight` in place of its 3-D weight and bias (hf_experts.pack_experts)."""
    state = model.state_dict(keep_vars=True)
    for old, new in swaps:
        for alias in names[id(old)]:
            for key in old.state_dict(keep_vars=True):
                state.pop(f"{alias}.{key}", None)
            state.update({f"{alias}.{key}": t for key, t in new.state_dict(keep_vars=True).items()})
    for module, weight, prefix, layers in experts:
        for alias in names[id(module)]:
            state.pop(f"{alias}.{weight}", None)
            state.pop(f"{alias}.{weight}_bias", None)
            for e, layer in enumerate(layers):
                state.update({f"{alias}.{prefix}{weight}.{e}.{key}": t
                              for key, t in layer.state_dict(keep_vars=True).items()})
    return state


def _identity(t: torch.Tensor):
    """The same for two names of one tensor (tied weights, a layer used
    twice), which a safetensors file holds once."""
    if t.numel() == 0:
        return id(t)
    return t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.stride()), tuple(t.shape), t.dtype


def fits(stored_dtype: str, want: torch.dtype) -> bool:
    """Whether a tensor stored as `stored_dtype` (a safetensors dtype name)
    loads into one of dtype `want`: a float into any float (the model's
    dtype is the caller's choice), anything else only into its own dtype."""
    if want.is_floating_point:
        return stored_dtype in _FLOAT_NAMES
    return stored_dtype == _NAMES.get(want)


def check_every_tensor(weights: str, f, expected: dict[str, torch.Tensor]) -> None:
    """That the safetensors file `weights` (open as f) holds a tensor of the
    right dtype and shape for every name of `expected` (once for names of one
    tensor) and nothing else."""
    keys = set(f.keys())
    unexpected = sorted(keys - expected.keys())
    groups = {}
    for key, t in expected.items():
        groups.setdefault(_identity(t), []).append(key)
    missing = sorted(ks[0] for ks in groups.values() if not any(k in keys for k in ks))
    if missing or unexpected:
        raise ValueError(f"{weights} does not match the model: {len(missing)} tensors missing {missing[:5]}, "
                         f"{len(unexpected)} unexpected {unexpected[:5]}")
    for key in sorted(keys):
        stored = f.get_slice(key)
        dtype, shape, want = stored.get_dtype(), list(stored.get_shape()), expected[key]
        if not fits(dtype, want.dtype) or shape != list(want.shape):
            raise ValueError(f"{weights}: {key} is stored as {dtype} of shape {shape}, but the model's {key} is "
                             f"{str(want.dtype).removeprefix('torch.')} of shape {list(want.shape)} (a float "
                             "tensor loads into any float dtype; other dtypes must match)")

"""What torch.compile, torch.func and torch.autocast need of the ulb ops,
registered on import (ulbtorch imports this module): fake (meta)
implementations that give output shapes and refuse what the kernels refuse,
ulb.linear's vmap rule and its autocast rule."""
from __future__ import annotations

import torch

from .formats import FORMATS_BY_ID
from .ops import _ACT_DTYPES, _check_packed, _dtype_names, dequantize_packed, packed_nbytes


def _check_same_device(op: str, x: torch.Tensor, **others) -> None:
    # A meta tensor among CPU ones sends the call here rather than to the
    # kernel: without this check it would return uninitialised memory.
    for name, t in others.items():
        if t is not None and t.device != x.device:
            raise ValueError(f"ulb.{op}: input is on {x.device} but the {name.replace('_', ' ')} is on {t.device}")


def _check_fake_input(op: str, x: torch.Tensor, dtypes: tuple) -> None:
    # What the real op refuses, refused while tracing too.
    if x.dtype not in dtypes:
        raise RuntimeError(f"ulb.{op}: input must be {_dtype_names(dtypes)}, got {x.dtype}")
    if x.dim() < 1:
        raise RuntimeError(f"ulb.{op}: input must have at least 1 dim")


@torch.library.register_fake("ulb::linear")
def _linear_fake(x, packed, bias, out_features):
    _check_same_device("linear", x, packed_weight=packed, bias=bias)
    _check_fake_input("linear", x, _ACT_DTYPES)
    _check_packed(packed)
    return x.new_empty((*x.shape[:-1], out_features))


@torch.library.register_fake("ulb::linear_many")
def _linear_many_fake(x, packed, bias, out_features):
    if not packed or len(x) != len(packed) or len(bias) not in (0, len(packed)):
        raise RuntimeError(f"ulb.linear_many: {len(x)} inputs, {len(packed)} packed weights and {len(bias)} "
                           "biases (give one input and weight a layer, and no bias or one a layer)")
    for i, (xi, pi) in enumerate(zip(x, packed)):
        _check_same_device(f"linear_many, layer {i}", xi, packed_weight=pi, bias=bias[i] if bias else None)
        _check_fake_input(f"linear_many, layer {i}", xi, _ACT_DTYPES)
        _check_packed(pi)
    if len({xi.dtype for xi in x}) > 1:
        raise RuntimeError("ulb.linear_many: the inputs differ in dtype")
    rows = sum(xi.numel() // xi.shape[-1] if xi.shape[-1] else 0 for xi in x)
    return x[0].new_empty((rows, out_features))


@torch.library.register_fake("ulb::linear_bf16")
def _linear_bf16_fake(x, weight, bias):
    _check_same_device("linear_bf16", x, weight=weight, bias=bias)
    _check_fake_input("linear_bf16", x, (torch.bfloat16,))
    if weight.dtype != torch.bfloat16 or weight.dim() != 2 or weight.shape[1] != x.shape[-1]:
        raise RuntimeError(f"ulb.linear_bf16: weight must be a 2-D bfloat16 tensor with {x.shape[-1]} columns, "
                           f"got {weight.dtype} of shape {tuple(weight.shape)}")
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


# The utility ops: shapes that live in the blob's header are data-dependent sizes.

@torch.library.register_fake("ulb::pack")
def _pack_fake(codes, scales, format, group_size, tiles=-1):
    _check_same_device("pack", codes, scales=scales)
    M, K = (int(d) for d in codes.shape)  # the blob's size is a function of them: specialise
    return codes.new_empty((packed_nbytes(FORMATS_BY_ID[format], M, K, group_size),),
                           dtype=torch.uint8)


@torch.library.register_fake("ulb::retile")
def _retile_fake(packed, tiles=-1):
    return torch.empty_like(packed)


@torch.library.register_fake("ulb::unpack")
def _unpack_fake(packed):
    ctx = torch.library.get_ctx()
    M, K, G = ctx.new_dynamic_size(), ctx.new_dynamic_size(), ctx.new_dynamic_size()
    return packed.new_empty((M, K), dtype=torch.uint8), packed.new_empty((M, G), dtype=torch.float32)


@torch.library.register_fake("ulb::packed_info")
def _packed_info_fake(packed):
    return packed.new_empty((8,), dtype=torch.int64)


@torch.library.register_fake("ulb::verify_packed")
def _verify_packed_fake(packed):
    return packed.new_empty((1,), dtype=torch.int64)


@torch.library.register_fake("ulb::quantize_act")
def _quantize_act_fake(x, packed):
    ctx = torch.library.get_ctx()
    N, K_pad, G = x.shape[0], ctx.new_dynamic_size(), ctx.new_dynamic_size()
    return (x.new_empty((N, K_pad), dtype=torch.int8), x.new_empty((N,), dtype=torch.float32),
            x.new_empty((N, G), dtype=torch.int32))


@torch.library.register_fake("ulb::int_dots")
def _int_dots_fake(packed, xq, xsum):
    M = torch.library.get_ctx().new_dynamic_size()
    return xq.new_empty((xq.shape[0], M, xsum.shape[1]), dtype=torch.int32)


@dequantize_packed.register_fake
def _dequantize_packed_fake(packed, out_features, in_features):
    return packed.new_empty((out_features, in_features), dtype=torch.float32)


@torch.library.register_vmap("ulb::linear")
def _linear_vmap(info, in_dims, x, packed, bias, out_features):
    # The op takes any leading dims: a batched input is one call. A batched
    # weight or bias (rare) is one call per member.
    x_dim, packed_dim, bias_dim, _ = in_dims
    if x.dim() - (x_dim is not None) < 1:  # as the op refuses a 0-dim input outside vmap
        raise RuntimeError("ulb.linear: input must have at least 1 dim (the in_features), got a 0-dim input "
                           "per vmap sample")
    if packed_dim is None and bias_dim is None:
        x = x if x_dim is not None else x.expand(info.batch_size, *x.shape)
        return torch.ops.ulb.linear(x.movedim(x_dim or 0, 0), packed, bias, out_features), 0

    def member(t, dim, i):
        return t if dim is None else t.select(dim, i)

    return torch.stack([torch.ops.ulb.linear(member(x, x_dim, i), member(packed, packed_dim, i),
                                             member(bias, bias_dim, i), out_features)
                        for i in range(info.batch_size)]), 0


# Under torch.autocast on CPU nn.Linear computes in the autocast dtype and
# returns it; so does ulb.linear. torch.library.register_autocast casts to
# one dtype fixed at registration, so the rule is registered as it does (a
# kernel for the dispatcher, the same function for tracing), reading the
# dtype per call: bf16 inputs go to the kernel as they are; fp16, which the
# kernels do not take, is rounded to fp16 and runs through fp32, as an fp16
# input to the modules does.
_AUTOCAST_CPU = torch._C.DispatchKey.AutocastCPU
_linear_default = torch.ops.ulb.linear.default


def _linear_autocast(x, packed, bias, out_features):
    dt = torch.get_autocast_dtype("cpu")
    run = torch.float32 if dt == torch.float16 else dt

    def cast(t):  # as autocast casts: floating point but float64 (others meet the op's checks)
        eligible = isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64
        return t.to(dt).to(run) if eligible else t

    with torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(_AUTOCAST_CPU)):
        y = _linear_default(cast(x), packed, cast(bias), out_features)
    return y.to(dt) if run != dt else y


_linear_default.py_impl(_AUTOCAST_CPU)(_linear_autocast)
_autocast_lib = torch.library.Library("ulb", "FRAGMENT")
_autocast_lib.impl("linear", lambda _keys, *args: _linear_autocast(*args), "AutocastCPU", with_keyset=True)

"""Python face of torch.ops.ulb: argument checks with clear errors, fake
(meta) implementations for torch.compile, and the pure-PyTorch reference
that defines what every kernel computes."""
from __future__ import annotations

import ctypes
import functools

import torch

from . import _C  # noqa: F401  (registers torch.ops.ulb.*)
from .formats import FORMATS_BY_ID, Format, get_format, int_arg, n_groups, normalize_group_size

_ACT_DTYPES = (torch.float32, torch.bfloat16)


def _check_same_device(op: str, x: torch.Tensor, **others) -> None:
    # A meta tensor among CPU ones sends the call here rather than to the
    # kernel: without this check it would return uninitialised memory.
    for name, t in others.items():
        if t is not None and t.device != x.device:
            raise ValueError(f"ulb.{op}: input is on {x.device} but the {name.replace('_', ' ')} is on {t.device}")


def _dtype_names(dtypes: tuple) -> str:
    return " or ".join(str(d)[6:] for d in dtypes)


def _check_cpu_input(op: str, x: torch.Tensor, dtypes: tuple, which: str = "input", hint: str = "",
                     like: str = "") -> None:
    # Before the dispatcher: an input elsewhere than on the CPU would find no
    # kernel there, and its message would not say why.
    if x.device.type != "cpu":
        raise ValueError(f"ulbtorch.ops.{op} runs on CPU; {which} is on {x.device}{hint}")
    if x.dtype not in dtypes:
        raise TypeError(f"{which} must be {_dtype_names(dtypes)}{like}, got {x.dtype}")


def _out_features(op: str, out_features) -> int:
    # Checked before the dispatcher, whose own refusals read as a C++ cast
    # failure; numpy's and torch's ints pass as Python ints.
    m = int_arg(out_features, f"ulbtorch.ops.{op}: out_features")
    if not 0 < m < 2**62:
        raise ValueError(f"ulbtorch.ops.{op}: out_features must be from 1 to 2**62, got {m}")
    return m


def _check_no_grad(op: str, **tensors) -> None:
    # The ops have no derivative: autograd would only warn, and a gradient
    # through them would come out None (wrong in a larger graph).
    if torch.is_grad_enabled():
        for which, t in tensors.items():
            if isinstance(t, torch.Tensor) and t.requires_grad:
                raise RuntimeError(f"ulbtorch.ops.{op} has no backward (inference only), but {which} requires grad: "
                                   "call it under torch.no_grad(), or use the nn modules (Linear2Bit, ...), "
                                   "which have one")


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


@torch.library.register_fake("ulb::linear_bf16")
def _linear_bf16_fake(x, weight, bias):
    _check_same_device("linear_bf16", x, weight=weight, bias=bias)
    _check_fake_input("linear_bf16", x, (torch.bfloat16,))
    if weight.dtype != torch.bfloat16 or weight.dim() != 2 or weight.shape[1] != x.shape[-1]:
        raise RuntimeError(f"ulb.linear_bf16: weight must be a 2-D bfloat16 tensor with {x.shape[-1]} columns, "
                           f"got {weight.dtype} of shape {tuple(weight.shape)}")
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def _check_packed(packed: torch.Tensor) -> None:
    if not isinstance(packed, torch.Tensor) or packed.dtype != torch.uint8 or packed.dim() != 1:
        raise TypeError(
            "packed weight must be the 1-D uint8 tensor returned by ulbtorch.ops.pack, got "
            f"{getattr(packed, 'dtype', type(packed))} of shape {tuple(getattr(packed, 'shape', ()))}"
        )


# How the codes of a tile are arranged (ulb_tiles in kernels/include/ulb/ulb.h):
# "vnni" for every format; "lanes" for 1-bit formats, which the AVX2 lookup
# kernel reads 1.3-1.8x faster. Every ISA runs blobs of either order.
TILE_ORDERS = ("vnni", "lanes")


def _tiles_arg(tiles: str | None, fmt: Format, what: str) -> int:
    """The ops' tile-order argument for `tiles` on format fmt (-1: preferred)."""
    if tiles is not None and tiles not in TILE_ORDERS:
        raise ValueError(f"tiles must be one of {TILE_ORDERS} or None, got {tiles!r}")
    if tiles == "lanes" and fmt.bits != 1:
        raise ValueError(f"the lanes tile order is for 1-bit formats; {what}")
    return -1 if tiles is None else TILE_ORDERS.index(tiles)


def pack(codes: torch.Tensor, scales: torch.Tensor, format: str | Format, group_size: int | None = None,
         tiles: str | None = None) -> torch.Tensor:
    """Pack codes [M, K] (uint8) and scales [M, n_groups] into one blob.

    tiles: "vnni", "lanes" (1-bit formats only), or None for the order whose
    kernels run fastest under the active ISA (lanes for 1-bit under AVX2)."""
    fmt = get_format(format)
    tiles_arg = _tiles_arg(tiles, fmt, f"{fmt.name!r} has {fmt.bits}-bit codes")
    for which, t in (("codes", codes), ("scales", scales)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{which} must be a tensor, got {type(t).__name__}")
        if t.is_meta:  # the codes' range and the scales' values are checked on their values
            raise ValueError(f"{which} is on the meta device: pack needs values")
    if scales.is_complex() or scales.dtype == torch.bool:
        raise TypeError(f"scales must be real numbers, got {scales.dtype}")
    if codes.dim() != 2:
        raise ValueError(f"codes must be 2-D [out_features, in_features], got shape {tuple(codes.shape)}")
    M, K = codes.shape
    check_shape(M, K)
    gs = normalize_group_size(group_size, K, fmt)
    scales = scales.detach().to(torch.float32)
    if scales.dim() == 1:
        scales = scales.reshape(-1, 1)
    if scales.numel() == 1:
        scales = scales.reshape(1, 1).expand(M, 1)
    G = n_groups(gs, K)
    if tuple(scales.shape) != (M, G):
        raise ValueError(f"scales must have shape ({M}, {G}) for group_size={group_size}, got {tuple(scales.shape)}")
    if codes.dtype != torch.uint8:
        raise TypeError(f"codes must be uint8, got {codes.dtype}")
    if codes.numel() and int(codes.max()) > fmt.max_code:
        raise ValueError(f"codes exceed {fmt.max_code}, the largest code of format {fmt.name!r}")
    return torch.ops.ulb.pack(codes.detach().cpu(), scales.cpu(), fmt.id, gs, tiles_arg)


def retile(packed: torch.Tensor, tiles: str | None = None) -> torch.Tensor:
    """The same weight with its tiles in order `tiles` ("vnni", "lanes" for
    1-bit formats, or None: the active ISA's preferred order), as a new blob
    (a byte permutation of each tile). For blobs packed on a CPU that
    preferred the other order; load_quantized applies it."""
    fmt = get_format(packed_info(packed)["format"])
    return torch.ops.ulb.retile(packed.cpu(), _tiles_arg(tiles, fmt, f"this blob is {fmt.name!r}"))


def preferred_tiles(format: str | Format) -> str:
    """The tile order ops.pack picks for `format` under the active ISA."""
    from .runtime import _lib

    return TILE_ORDERS[_lib.ulb_tiles_preferred(get_format(format).id)]


@functools.cache  # constants of the kernel library
def shape_limits() -> tuple[int, int]:
    """(largest out_features, largest in_features) a packed weight holds:
    2^26 and 2^16; up to 2^16 inputs every kernel's int32 sums stay exact."""
    from .runtime import _lib

    m, k = ctypes.c_int64(), ctypes.c_int64()
    _lib.ulb_shape_limits(ctypes.byref(m), ctypes.byref(k))
    return m.value, k.value


def check_shape(out_features, in_features) -> None:
    """A clear error for a weight shape no packed format holds."""
    max_m, max_k = shape_limits()
    for name, v, top in (("out_features", out_features, max_m), ("in_features", in_features, max_k)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"{name} must be an int, got {v!r}")
        if not 1 <= v <= top:
            raise ValueError(f"{name}={v}: packed weights hold 1 to {top} " +
                             ("inputs (the kernels' int32 sums stay exact up to there)" if name == "in_features"
                              else "outputs"))


def packed_nbytes(format: str | Format, out_features: int, in_features: int, group_size: int = 0) -> int:
    """Size of the blob ulb.pack makes for these parameters."""
    from .runtime import _lib

    fmt = get_format(format)
    check_shape(out_features, in_features)
    n = _lib.ulb_packed_nbytes(fmt.id, out_features, in_features,
                               normalize_group_size(group_size, in_features, fmt))
    if n < 0:
        raise ValueError(f"invalid packed weight geometry: format={fmt.name}, out_features={out_features}, "
                         f"in_features={in_features}, group_size={group_size}")
    return n


def packed_info(packed: torch.Tensor) -> dict:
    _check_packed(packed)
    f, M, K, gs, G, M_pad, K_pad, tiles = torch.ops.ulb.packed_info(packed.cpu()).tolist()
    return dict(format=FORMATS_BY_ID[f].name, out_features=M, in_features=K,
                group_size=0 if gs >= K_pad else gs, n_groups=G, M_pad=M_pad, K_pad=K_pad,
                tiles=TILE_ORDERS[tiles])


def unpack(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of pack: (codes [M, K] uint8, scales [M, n_groups] float32)."""
    _check_packed(packed)
    return torch.ops.ulb.unpack(packed.cpu())


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    """y = x W^T + b with W the packed weight, activations int8 per token."""
    _check_cpu_input("linear", x, _ACT_DTYPES, hint=" (the nn modules fall back to pure PyTorch there)")
    _check_no_grad("linear", input=x, bias=bias)
    return torch.ops.ulb.linear(x, packed, bias, _out_features("linear", out_features))


def linear_many(xs: list[torch.Tensor], packed: list[torch.Tensor], biases: list[torch.Tensor] | None,
                out_features: int) -> torch.Tensor:
    """torch.cat([linear(x, p, b, out_features) for x, p, b in zip(xs, packed,
    biases)]) over the rows of each x, bit for bit, in one parallel region:
    the threads fork and join once, and stream from one weight into the next
    (the experts a token visits are too small to stream well one call each).
    biases: None, or one a layer."""
    if not packed:  # the dispatcher finds no tensor to dispatch on, and says so at length
        raise ValueError("ulbtorch.ops.linear_many takes at least one layer, got none")
    out_features = _out_features("linear_many", out_features)
    for i, x in enumerate(xs):
        _check_cpu_input("linear_many", x, _ACT_DTYPES, which=f"input {i}")
        _check_no_grad("linear_many", **{f"input {i}": x, f"bias {i}": biases[i] if biases else None})
    return torch.ops.ulb.linear_many(xs, packed, [] if biases is None else biases, out_features)


def linear_bf16(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x W^T + b for bf16 x and a plain bf16 weight W, by ulbtorch's GEMV:
    fp32 accumulation, bf16 output, one pass over W per row of x (made for
    one-token decode; see nn.LinearBF16)."""
    _check_cpu_input("linear_bf16", x, (torch.bfloat16,), like=" like the weight")
    _check_no_grad("linear_bf16", input=x, weight=weight, bias=bias)
    return torch.ops.ulb.linear_bf16(x, weight, bias)


# ---- pure-PyTorch reference -------------------------------------------------

def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token absmax int8 (BitNet's rule, fp32): returns (q as float, scale)
    with x ~= q * scale; bit-identical to the kernels' quantiser."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True).clamp(min=1e-5)
    # A real division: `127.0 / tensor` would round twice (reciprocal, then
    # multiply) and differ from the kernels' 127.0f / amax in the last bit.
    inv = torch.full_like(amax, 127.0) / amax
    q = (xf * inv).round().clamp(-128, 127)
    return q, 1.0 / inv


def fake_quantize_activations(x: torch.Tensor) -> torch.Tensor:
    q, s = quantize_activations(x)
    return q * s


def dequantize(codes: torch.Tensor, scales: torch.Tensor, format: str | Format, group_size: int = 0
               ) -> torch.Tensor:
    """Float32 weight [M, K] that the kernels multiply by."""
    fmt = get_format(format)
    if codes.dim() != 2 or scales.dim() != 2:
        raise ValueError(f"codes must be [out_features, in_features] and scales [out_features, groups], got "
                         f"shapes {tuple(codes.shape)} and {tuple(scales.shape)}")
    M, K = codes.shape
    gs = normalize_group_size(group_size, K, fmt)
    if tuple(scales.shape) != (M, n_groups(gs, K)):
        raise ValueError(f"scales must have shape ({M}, {n_groups(gs, K)}) for codes of shape ({M}, {K}) and "
                         f"group_size={group_size}, got {tuple(scales.shape)}")
    gs = gs or K
    levels = fmt.codes_to_levels(codes).to(torch.float32)
    # Each column's group by index, not repeat_interleave(gs)[:, :K]: inductor
    # compiled that cut wrongly where the last group is partial (its columns
    # read past the scales; torch 2.13).
    s = scales.to(torch.float32)[:, torch.arange(K, device=scales.device) // gs]
    return levels * s


@torch.library.custom_op("ulb::dequantize_packed", mutates_args=())
def dequantize_packed(packed: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
    """dequantize() of a packed weight whose shape the caller knows: one op
    of static output size for compiled graphs and exported programs, where
    unpack's sizes (read from the blob) are data-dependent and an exported
    program that pins them does not load back (torch.export.load)."""
    info = packed_info(packed)
    if (info["out_features"], info["in_features"]) != (out_features, in_features):
        raise ValueError(f"ulb.dequantize_packed: the packed weight is {info['out_features']}x{info['in_features']}, "
                         f"not {out_features}x{in_features}")
    codes, scales = unpack(packed)
    return dequantize(codes, scales, info["format"], info["group_size"]).to(packed.device)


@dequantize_packed.register_fake
def _dequantize_packed_fake(packed, out_features, in_features):
    return packed.new_empty((out_features, in_features), dtype=torch.float32)


def reference_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """What the kernels compute, in plain PyTorch: int8-quantised activations
    times the dequantised weight, output in the input's dtype."""
    y = torch.nn.functional.linear(fake_quantize_activations(x), weight.float(),
                                   None if bias is None else bias.float())
    return y.to(x.dtype)


# ---- fake impls of the utility ops (torch.compile / opcheck) -------------------
# Shapes that live in the blob's header are data-dependent sizes.

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

"""Python face of torch.ops.ulb: the wrappers users call (pack, linear,
...), which check their arguments with clear errors before the dispatcher,
and ulb.dequantize_packed. The pure-PyTorch reference (dequantize,
reference_linear, ...) lives in ulbtorch.reference and is exported here;
the ops' fake, vmap and autocast rules in ulbtorch._registrations."""
from __future__ import annotations

import torch

from . import _C  # noqa: F401  (registers torch.ops.ulb.*)
from ._lib import CONSTANTS, TILE_ORDERS, lib as _lib
from .formats import FORMATS_BY_ID, Format, get_format, int_arg, n_groups, normalize_group_size
from .reference import dequantize, fake_quantize_activations, quantize_activations, reference_linear

__all__ = ["pack", "unpack", "retile", "preferred_tiles", "packed_info", "packed_nbytes", "shape_limits",
           "check_shape", "linear", "linear_many", "linear_bf16", "dequantize_packed", "TILE_ORDERS",
           "dequantize", "fake_quantize_activations", "quantize_activations", "reference_linear"]

_ACT_DTYPES = (torch.float32, torch.bfloat16)


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


def _check_packed(packed: torch.Tensor) -> None:
    if not isinstance(packed, torch.Tensor) or packed.dtype != torch.uint8 or packed.dim() != 1:
        raise TypeError(
            "packed weight must be the 1-D uint8 tensor returned by ulbtorch.ops.pack, got "
            f"{getattr(packed, 'dtype', type(packed))} of shape {tuple(getattr(packed, 'shape', ()))}"
        )


def _tiles_arg(tiles: str | None, fmt: Format, what: str) -> int:
    """The ops' tile-order argument for `tiles` on format fmt (None: the
    active ISA's preferred order)."""
    if tiles is not None and tiles not in TILE_ORDERS:
        raise ValueError(f"tiles must be one of {TILE_ORDERS} or None, got {tiles!r}")
    if tiles is not None and tiles not in fmt.tiles:
        widths = "/".join(sorted({f"{f.bits}-bit" for f in FORMATS_BY_ID.values() if tiles in f.tiles}))
        raise ValueError(f"the {tiles} tile order is for {widths} formats; {what}")
    return CONSTANTS.tiles_preferred if tiles is None else TILE_ORDERS.index(tiles)


def pack(codes: torch.Tensor, scales: torch.Tensor, format: str | Format, group_size: int | None = None,
         tiles: str | None = None) -> torch.Tensor:
    """Pack codes [M, K] (uint8) and scales [M, n_groups] into one blob.

    tiles: "vnni", "lanes" (1-bit formats only), or None for the order whose
    kernels run fastest under the active ISA (lanes for 1-bit under AVX2);
    "kmajor" is the accelerator layout the Triton kernels read (ulb.h),
    which the CPU kernels refuse."""
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
    try:
        return torch.ops.ulb.pack(codes.detach().cpu(), scales.cpu(), fmt.id, gs, tiles_arg)
    except RuntimeError as e:
        # The kernels hold the rules on values (kernels/src/format.c); codes
        # out of range are a bad argument here, as they have always been.
        if "codes exceed" in str(e):
            raise ValueError(str(e).removeprefix("ulb.pack: ")) from None
        raise


def retile(packed: torch.Tensor, tiles: str | None = None) -> torch.Tensor:
    """The same weight with its tiles in order `tiles` ("vnni", "lanes" for
    1-bit formats, "kmajor" for accelerators, or None: the active ISA's
    preferred order), as a new CPU blob: a byte permutation of each tile, or
    the body rearranged to or from kmajor. For blobs packed on a CPU that
    preferred the other order (load_quantized applies it) and for layers
    moved to or from an accelerator (LowBitLinear.to applies it)."""
    fmt = get_format(packed_info(packed)["format"])
    return torch.ops.ulb.retile(packed.cpu(), _tiles_arg(tiles, fmt, f"this blob is {fmt.name!r}"))


def preferred_tiles(format: str | Format) -> str:
    """The tile order ops.pack picks for `format` under the active ISA."""
    return TILE_ORDERS[_lib.ulb_tiles_preferred(get_format(format).id)]


def shape_limits() -> tuple[int, int]:
    """(largest out_features, largest in_features) a packed weight holds:
    2^26 and 2^16; up to 2^16 inputs every kernel's int32 sums stay exact."""
    return CONSTANTS.max_m, CONSTANTS.max_k


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
    fmt = get_format(format)
    check_shape(out_features, in_features)
    n = _lib.ulb_packed_nbytes(fmt.id, out_features, in_features,
                               normalize_group_size(group_size, in_features, fmt))
    if n < 0:
        raise ValueError(f"invalid packed weight geometry: format={fmt.name}, out_features={out_features}, "
                         f"in_features={in_features}, group_size={group_size}")
    return n


def packed_info(packed: torch.Tensor, verify: bool = False) -> dict:
    """The blob's header as a dict. verify=True reads the whole blob first, as
    a loader should (a pass at memory speed): a ValueError unless its bytes
    match its checksum, every code is one of the format's and every scale is
    finite; the dict then says under "checked" whether a checksum vouched for
    the bytes (False for blobs of version 2, from before checksums)."""
    _check_packed(packed)
    blob = packed.cpu()
    f, M, K, gs, G, M_pad, K_pad, tiles = torch.ops.ulb.packed_info(blob).tolist()
    info = dict(format=FORMATS_BY_ID[f].name, out_features=M, in_features=K,
                group_size=0 if gs >= K_pad else gs, n_groups=G, M_pad=M_pad, K_pad=K_pad,
                tiles=TILE_ORDERS[tiles])
    if verify:
        try:
            checked = torch.ops.ulb.verify_packed(blob)
        except RuntimeError as e:  # the header passed above: these are damaged bytes
            raise ValueError(f"ulbtorch.ops.packed_info: {str(e).removeprefix('ulb.verify_packed: ')}") from None
        info["checked"] = bool(checked.item())
    return info


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

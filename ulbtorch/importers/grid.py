"""Float checkpoints whose weights already lie on a 1-bit, ternary or 2-bit
grid per output row (how the ParetoQ MobileLLM checkpoints are published):

  1-bit    {-a, +a}             -> binary,   scale a
  ternary  {-s, 0, +s}          -> ternary,  scale s
  2-bit    {+-a/4, +-3a/4}      -> int2_sym, levels {-3,-1,1,3} x scale

In bf16, 3 * bf16(a/4) need not equal bf16(3a/4), so the 2-bit scale is not
simply the inner magnitude: we pick the fp32 scale s in the intersection of
the rounding intervals of both magnitudes (it contains the true a/4, so it is
never empty for a genuine grid), then verify that bf16(s) and bf16(3s) give
back both magnitudes bit for bit. Rows that fail are refused by name.
"""
from __future__ import annotations

import torch
from torch import nn

from ..formats import FORMAT_FOR_BITS, FORMATS, describe_bits
from ..nn import MODULE_FOR_FORMAT
from ..nn.replace import is_plain_linear, module_names, name_selected, patterns, replace_everywhere
from ..quantize import LM_HEAD, QuantConfig, run_conversion_hooks

# The `bits` of the formats whose levels a grid weight can land on: up to 2-bit codes.
GRID_FORMATS = {bits: name for bits, name in FORMAT_FOR_BITS.items() if FORMATS[name].bits <= 2}


def _rounding_interval(v: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Ends, in fp64, of the reals that round to each positive finite `dtype`
    value in v: halfway to its neighbours. At a power of two the neighbour
    below is half as far as the one above, so the interval is lopsided."""
    v = v.to(dtype)
    down = torch.nextafter(v, torch.zeros_like(v)).double()
    up = torch.nextafter(v, torch.full_like(v, float("inf"))).double()
    v = v.double()
    up = torch.where(torch.isinf(up), 2 * v - down, up)  # the largest finite value: overflow starts half a step up
    return (down + v) / 2, (v + up) / 2


def _grid_format(bits) -> str:
    """The format of `bits` (as quantize_ reads it: True is not 1)."""
    if isinstance(bits, bool) or bits not in GRID_FORMATS:
        raise ValueError(f"bits must be {describe_bits(GRID_FORMATS)}, got {bits!r}")
    return GRID_FORMATS[bits]


def _fail(name: str, row: int, why: str):
    raise ValueError(f"{name}: row {row} is not on a {why}")


def pack_grid_weight(weight: torch.Tensor, bits, name: str = "weight"):
    """(codes, scales [M,1], format) reproducing `weight` bit for bit after
    rounding the dequantised weight back to weight.dtype."""
    fmt = _grid_format(bits)
    if weight.dim() != 2 or 0 in weight.shape:
        raise ValueError(f"{name}: a linear weight is 2-D [out_features, in_features] and not empty, got shape "
                         f"{tuple(weight.shape)}")
    if weight.is_meta:
        raise ValueError(f"{name} is on the meta device (no values to check against the grid): load the float "
                         "weights first")
    if not weight.is_floating_point():
        raise TypeError(f"{name}: a grid weight is a real floating-point tensor, got {weight.dtype}")
    w = weight.detach().float()
    finite = torch.isfinite(w).all(dim=1)
    if not finite.all():
        raise ValueError(f"{name}: row {int((~finite).nonzero()[0])} holds NaN or infinite values")
    a = w.abs()
    M = w.shape[0]
    big = torch.full_like(a, float("inf"))
    lo = torch.where(a > 0, a, big).amin(dim=1)          # smallest non-zero magnitude
    hi = a.amax(dim=1)
    has_zero = (a == 0).any(dim=1)
    if fmt in ("binary", "ternary"):
        if fmt == "binary" and has_zero.any():
            _fail(name, int(has_zero.nonzero()[0]), "1-bit grid {-a, +a}: it holds a zero")
        off = (lo != hi) & torch.isfinite(lo)
        if off.any():
            _fail(name, int(off.nonzero()[0]), f"{fmt} grid: it holds more than one magnitude")
        scale = torch.where(torch.isfinite(lo), lo, torch.ones_like(lo))  # an all-zero row: any scale
        sign_code = (w > 0).to(torch.uint8)
        codes = sign_code if fmt == "binary" else (torch.sign(w) + 1).to(torch.uint8)
        return codes, scale.reshape(M, 1), fmt
    # 2-bit
    if has_zero.any():
        _fail(name, int(has_zero.nonzero()[0]), "2-bit grid {+-a/4, +-3a/4}: it holds a zero")
    mid = (a > lo[:, None]) & (a < hi[:, None])
    if mid.any():
        _fail(name, int(mid.any(dim=1).nonzero()[0]), "2-bit grid: it holds more than two magnitudes")
    two = hi > lo
    # The middle of the intersection rather than an end: whether an end itself
    # rounds in (ties go to even) cannot matter, and for bf16 or fp16 the
    # intersection is wide enough that rounding s and 3s to fp32 keeps them
    # inside it. The check below refuses a row whose intersection is empty.
    lo_down, lo_up = _rounding_interval(lo, weight.dtype)
    hi_down, hi_up = _rounding_interval(hi, weight.dtype)
    centre = (torch.maximum(lo_down, hi_down / 3) + torch.minimum(lo_up, hi_up / 3)) / 2
    s = torch.where(two, centre.float(), lo)
    inner = (s.to(weight.dtype).float() == lo)
    outer = ((3 * s).to(weight.dtype).float() == hi) | ~two
    bad = ~(inner & outer)
    if bad.any():
        r = int(bad.nonzero()[0])
        _fail(name, r, f"2-bit grid: magnitudes {lo[r].item()} and {hi[r].item()} are not in ratio 1:3")
    level = torch.where(a == lo[:, None], 1, 3) * torch.sign(w)   # {-3,-1,1,3}
    codes = ((level + 3) // 2).to(torch.uint8)
    return codes, s.reshape(M, 1), fmt


def convert_grid_linears(model: nn.Module, bits, *, include=("*",), exclude=tuple(LM_HEAD)) -> nn.Module:
    """Replace every nn.Linear whose weight is on the grid by the matching
    low-bit layer, in place, without re-quantising. include / exclude:
    fnmatch patterns on module names, as in quantize_; exclude wins."""
    fmt = _grid_format(bits)
    include, exclude = patterns(include, "include"), patterns(exclude, "exclude")
    chosen = [(n, m) for n, m in model.named_modules() if is_plain_linear(m) and name_selected(n, include, exclude)]
    on_meta = [n for n, m in chosen if m.weight.is_meta]
    if on_meta:
        raise ValueError(f"convert_grid_linears: {len(on_meta)} of the {len(chosen)} selected layers have their "
                         f"weight on the meta device (no values), e.g. {on_meta[0]!r}: load the float weights first")
    names = module_names(model)
    # Every layer built before any is swapped: a weight off the grid leaves
    # the model as it was.
    built = []
    for name, lin in chosen:
        codes, scales, fmt = pack_grid_weight(lin.weight, bits, name + ".weight")
        built.append((lin, MODULE_FOR_FORMAT[fmt].from_codes(codes, scales, format=fmt, bias=lin.bias,
                                                              granularity="channel")))
    for lin, layer in built:
        replace_everywhere(model, names, lin, layer)  # a layer used at two places, at both
    if chosen:  # so that save_pretrained writes a checkpoint from_pretrained loads packed
        run_conversion_hooks(model, QuantConfig(format=fmt, include=list(include),
                                                exclude=list(exclude), bf16_gemv=False))
    return model

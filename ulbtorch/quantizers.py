"""Round-to-nearest weight quantisation: float weight -> (codes, scales).

Scale choice per row / group / tensor:
  "absmax"  : the largest |w| on the outermost level: on a symmetric level
              set s = max|w| / max|level| (nothing clipped); on an asymmetric
              one (int4 -8..7, int2 -2..1) the longer side takes the largest
              |w| whatever its sign, through a negative scale when that w is
              positive (llama.cpp's Q4_0 rule, d = max / -8; weights of the
              other sign past the short side's last level clip to it, by at
              most one step), so a tensor dequantised from Q4_0 blocks
              quantises back to the same codes and scales (but for blocks
              whose fp16 scale is 0: they dequantise to zeros)
  "absmean" : s = mean|w|               (BitNet b1.58's ternarisation; also the
                                          MSE-optimal scale for binary weights)
  "mse"     : s minimising the squared error over a grid of clipping ratios
              (default for 2-bit and per-channel/group ternary)
int8 and int4 default to absmax, as llama.cpp's Q8_0 and Q4_0 do: the mse
search clips outliers, which costs int4 weights more perplexity than the
rounding error it saves (examples/walkthrough.py measures it).
"""
from __future__ import annotations

import torch

from .formats import Format, get_format, normalize_group_size

GRANULARITIES = ("channel", "group", "tensor")
METHODS = ("absmax", "absmean", "mse")
_MSE_RATIOS = torch.linspace(0.3, 1.0, 15)
_MSE_CHUNK_ELEMENTS = 1 << 22


def default_method(fmt: Format, granularity: str) -> str:
    if fmt.name == "binary" or (fmt.name == "ternary" and granularity == "tensor"):
        return "absmean"
    if fmt.bits >= 4:
        return "absmax"
    return "mse"


def _codes_for(w: torch.Tensor, s: torch.Tensor, fmt: Format) -> torch.Tensor:
    # Multiply by the reciprocal, as BitNet does (W * (1/mean|W|)), so that
    # absmean ternarisation picks exactly BitNet's codes.
    t = w * (1.0 / torch.where(s.abs() < 1e-12, 1e-12, s))
    return ((t - fmt.level_b) / fmt.level_a).round().clamp(0, fmt.max_code)


def _absmax_parts(wg: torch.Tensor, fmt: Format) -> tuple[torch.Tensor, float, torch.Tensor | float]:
    """(max|w| [..., 1], |outer level|, sign): the "absmax" scale of the module
    docstring is sign * max|w| / |outer level|; the sign is -1 only where an
    asymmetric level set puts a positive largest |w| on its negative side."""
    lo, hi = int(fmt.levels.min()), int(fmt.levels.max())
    outer = lo if -lo > hi else hi
    amax, where = wg.abs().max(dim=-1, keepdim=True)
    amax = amax.clamp(min=1e-8)
    if -lo == hi:
        return amax, float(abs(outer)), 1.0
    extreme = wg.gather(-1, where)
    return amax, float(abs(outer)), torch.where(extreme * outer < 0, -1.0, 1.0)


def _scale(wg: torch.Tensor, fmt: Format, method: str) -> torch.Tensor:
    """wg: [..., n] values sharing one scale -> scale [..., 1]."""
    if method == "absmean":
        # BitNet b1.58: inv = 1 / max(mean|W|, 1e-5), W ~ round(W * inv) / inv.
        # s = 1/inv (one rounding) makes s * level equal BitNet's q / inv, and
        # 1/s gives back inv exactly for the codes above in all but ties, which
        # the lossless test checks.
        mean = wg.abs().mean(dim=-1, keepdim=True)
        if torch.isinf(mean).any():  # a sum of finite weights past the fp32 range
            mean = torch.where(torch.isinf(mean), wg.abs().mean(dim=-1, keepdim=True, dtype=torch.float64).float(),
                               mean)
        inv = 1.0 / mean.clamp(min=1e-5)
        return 1.0 / inv
    amax, outer, sign = _absmax_parts(wg, fmt)
    base = sign * (amax / outer)
    if method == "absmax":
        return base
    # amax * (r / outer), rounded as it always was, then the sign (exact).
    candidates = torch.cat([sign * (amax * (r / outer)) for r in _MSE_RATIOS.tolist()], dim=-1)
    # Rows a chunk at a time: the search holds float64 and int64 copies of them.
    n = wg.shape[-1]
    rows, amax_rows = wg.reshape(-1, n), amax.reshape(-1, 1)
    sign_rows = torch.as_tensor(sign, dtype=amax.dtype).expand_as(amax).reshape(-1, 1)
    step = max(1, _MSE_CHUNK_ELEMENTS // n)
    # On the CPU whatever the weight's device: its constants live there, and
    # another device's order of float64 summation could pick another ratio
    # on a near tie, so that a layer packed on a GPU would differ from the
    # same layer packed on the CPU.
    best = torch.cat([_mse_ratio_index(rows[i:i + step].cpu(), amax_rows[i:i + step].cpu(),
                                       sign_rows[i:i + step].cpu(), outer, fmt)
                      for i in range(0, rows.shape[0], step)])
    return candidates.gather(-1, best.to(candidates.device).reshape(*wg.shape[:-1], 1))


def _mse_ratio_index(wg: torch.Tensor, amax: torch.Tensor, sign: torch.Tensor, outer: float,
                     fmt: Format) -> torch.Tensor:
    """Index [rows, 1] of the first ratio r of _MSE_RATIOS whose scale
    s = sign * amax * c, c = r / outer, minimises sum (s * level(w / s) - w)^2
    over each row of wg [rows, n] (amax and sign: [rows, 1]).

    In units of the row's amax, u = sign * w / amax, the error is
    amax^2 * sum_j sum_{u in bin j} (c l_j - u)^2, where bin j holds the u that
    round to level l_j: between c times the midpoints of neighbouring levels.
    Those edges are the same for every row, so one pass puts each u in its
    slot among all ratios' edges, and the count n_j and sum S_j of every bin
    of every ratio follow from per-row histograms: sum_j (n_j c^2 l_j^2 -
    2 c l_j S_j) ranks the ratios (sum u^2 is common), where the search over
    the weight itself took ~11 passes per ratio."""
    levels = fmt.levels.to(torch.float64)
    c = _MSE_RATIOS.to(torch.float64) / outer                           # [R]
    edges = (c[:, None] * (levels[:-1] + levels[1:]) / 2).reshape(-1)   # [R * (J - 1)]
    order = edges.argsort()
    u = (wg.to(torch.float64) * sign) / amax.to(torch.float64)
    slot = torch.bucketize(u, edges[order], right=True)                 # sorted edges[slot - 1] <= u < edges[slot]
    rows, m = u.shape[0], edges.numel()
    count = torch.zeros(rows, m + 1, dtype=torch.float64).scatter_add_(1, slot, u.new_ones(()).expand_as(u))
    total = torch.zeros(rows, m + 1, dtype=torch.float64).scatter_add_(1, slot, u)
    unsort = order.argsort()
    R = c.numel()

    def per_bin(hist):  # [rows, m + 1] per slot -> [rows, R, J] per ratio and level
        cum = hist.cumsum(1)  # cum[:, k]: under sorted edge k; the last column: the whole row
        below = cum[:, :m][:, unsort].reshape(rows, R, -1)
        zeros = torch.zeros(rows, R, 1, dtype=torch.float64)
        return torch.diff(torch.cat([zeros, below, cum[:, m:].expand(rows, R)[..., None]], dim=-1), dim=-1)

    counts, sums = per_bin(count), per_bin(total)
    cl = c[:, None] * levels                                             # [R, J]
    err = (counts * cl * cl - 2 * cl * sums).sum(dim=-1)                 # [rows, R]
    return err.argmin(dim=-1, keepdim=True)


def quantize_weight(weight: torch.Tensor, format: str | Format, group_size: int | None = 0,
                    granularity: str | None = None, method: str | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns codes [M, K] uint8 and scales [M, n_groups] float32 such that
    weight ~= scale * (level_a * code + level_b)."""
    fmt = get_format(format)
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"weight must be a tensor, got {type(weight).__name__}")
    if weight.is_complex() or weight.dtype == torch.bool:
        # .to(float32) would drop the imaginary part (with only a warning)
        raise TypeError(f"weight must hold real numbers, got {weight.dtype}")
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D, got shape {tuple(weight.shape)}")
    if weight.is_meta:
        raise ValueError("weight is on the meta device: there are no values to quantize; load the weights first")
    M, K = weight.shape
    gs = normalize_group_size(group_size, K, fmt)
    granularity = granularity or ("group" if gs else "channel")
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")
    if granularity == "group" and not gs:
        raise ValueError("granularity='group' needs a group_size smaller than in_features")
    if granularity != "group":
        gs = 0
    method = method or default_method(fmt, granularity)
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")

    w = weight.detach().to(torch.float32).contiguous()  # a transposed view (MoE experts) too
    if not torch.isfinite(w).all():
        raise ValueError("weight has NaN or infinite values")
    if granularity == "tensor":
        s = _scale(w.reshape(1, -1), fmt, method).reshape(1, 1).expand(M, 1).contiguous()
        return _codes_for(w, s, fmt).to(torch.uint8), s
    if granularity == "channel":
        s = _scale(w, fmt, method)
        return _codes_for(w, s, fmt).to(torch.uint8), s
    G = -(-K // gs)
    wp = torch.nn.functional.pad(w, (0, G * gs - K)).reshape(M, G, gs)
    if K % gs:
        # The short last group must not count its zero padding in mean/max.
        s_full = _scale(wp[:, :-1], fmt, method) if G > 1 else None
        s_last = _scale(w[:, (G - 1) * gs:].reshape(M, 1, -1), fmt, method)
        s = s_last if s_full is None else torch.cat([s_full, s_last], dim=1)
    else:
        s = _scale(wp, fmt, method)
    codes = _codes_for(wp, s, fmt).reshape(M, G * gs)[:, :K]
    return codes.to(torch.uint8).contiguous(), s.reshape(M, G)

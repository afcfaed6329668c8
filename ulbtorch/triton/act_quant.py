"""Per-token absmax int8 quantisation of activations, as ulb_quantize_act
(kernels/src/act_quant.c) computes it, to the bit:
    inv = 127 / max(max|x|, 1e-5);  q = clamp(rint(x * inv), -128, 127)
with xscale = 1 / inv, and a row holding NaN or infinity quantised to zeros
with a NaN scale (its output row is NaN, as F.linear's would be)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .kernel_parts import LAUNCH_OPTIONS

BLOCK_K = 1024


@triton.jit
def _rint(v):
    """Round half to even, exactly for any float32 (floor and an exact
    subtraction; no libdevice, which differs by vendor)."""
    r = tl.floor(v)
    d = v - r
    odd = (r - 2.0 * tl.floor(r * 0.5)) != 0.0
    return tl.where((d > 0.5) | ((d == 0.5) & odd), r + 1.0, r)


@triton.jit
def _quantize_rows(x_ptr, ldx, incx, xq_ptr, xscale_ptr, K, K_pad, BLOCK: tl.constexpr):
    n = tl.program_id(0)
    row = x_ptr + n.to(tl.int64) * ldx
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    bad = tl.zeros([BLOCK], dtype=tl.int32)
    for k0 in range(0, K, BLOCK):
        k = k0 + tl.arange(0, BLOCK)
        v = tl.load(row + k.to(tl.int64) * incx, mask=k < K, other=0.0).to(tl.float32)
        bad += ((v != v) | (tl.abs(v) == float("inf"))).to(tl.int32)
        amax = tl.maximum(amax, tl.abs(v))
    finite = tl.sum(bad, axis=0) == 0
    inv = tl.math.div_rn(127.0, tl.maximum(tl.max(amax, axis=0), 1e-5))
    out = xq_ptr + n.to(tl.int64) * K_pad
    for k0 in range(0, K_pad, BLOCK):
        k = k0 + tl.arange(0, BLOCK)
        v = tl.load(row + k.to(tl.int64) * incx, mask=k < K, other=0.0).to(tl.float32)
        q = tl.minimum(tl.maximum(_rint(v * inv), -128.0), 127.0)
        q = tl.where(finite & (k < K), q, 0.0)
        tl.store(out + k, q.to(tl.int8), mask=k < K_pad)
    tl.store(xscale_ptr + n, tl.where(finite, tl.math.div_rn(1.0, inv), float("nan")))


def quantize_activations(x: torch.Tensor, K_pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, K] (any float dtype, any strides) -> xq [N, K_pad] int8 (zero
    past K) and xscale [N] float32."""
    N, K = x.shape
    xq = torch.empty(N, K_pad, dtype=torch.int8, device=x.device)
    xscale = torch.empty(N, dtype=torch.float32, device=x.device)
    if N:
        _quantize_rows[(N,)](x, x.stride(0), x.stride(1), xq, xscale, K, K_pad,
                             BLOCK=min(BLOCK_K, triton.next_power_of_2(K_pad)), **LAUNCH_OPTIONS)
    return xq, xscale

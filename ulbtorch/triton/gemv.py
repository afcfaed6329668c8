"""Fused GEMV for a few tokens (decode): one program per token and block of
output rows streams the rows' code words over K, group by group, and keeps
int32 sums of level x activation; each group's sum times its scale is added
to an fp32 accumulator in group order, as the CPU's scalar reference adds
them (kernels/ref/panel_ref.c)."""
from __future__ import annotations

import triton
import triton.language as tl

from .kernel_parts import levels, store_rows

# Tokens up to which the GEMV is used; more go to the GEMM (gemm.py).
GEMV_MAX_TOKENS = 8


@triton.jit
def gemv_kernel(xq_ptr, xscale_ptr, words_ptr, scales_ptr, bias_ptr, y_ptr, sums_ptr,
                M, M_pad, K_pad, G, GS, ldy,
                BITS: tl.constexpr, LEVEL_A: tl.constexpr, LEVEL_B: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_W: tl.constexpr, HAS_BIAS: tl.constexpr, Y_KIND: tl.constexpr, SUMS: tl.constexpr):
    TK: tl.constexpr = 32 // BITS
    n = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < M
    x_row = xq_ptr + n.to(tl.int64) * K_pad
    words_per_group = GS // TK
    words_total = K_pad // TK
    f = tl.zeros([BLOCK_M], dtype=tl.float32)
    s_ptr = scales_ptr + rows  # group g's scales follow M_pad after g - 1's
    for g in range(0, G):
        w0 = g * words_per_group
        w1 = tl.minimum(w0 + words_per_group, words_total)
        acc = tl.zeros([BLOCK_M], dtype=tl.int32)
        for wb in range(w0, w1, BLOCK_W):
            kw = wb + tl.arange(0, BLOCK_W)
            lev = levels(words_ptr, M_pad, kw, w1, rows, rmask, BITS, LEVEL_A, LEVEL_B, BLOCK_W, BLOCK_M)
            k = wb * TK + tl.arange(0, BLOCK_W * TK)
            x = tl.load(x_row + k, mask=k < w1 * TK, other=0).to(tl.int32)
            acc += tl.sum(x[:, None] * lev, axis=0)
        if SUMS:
            tl.store(sums_ptr + (n.to(tl.int64) * M + rows) * G + g, acc, mask=rmask)
        s = tl.load(s_ptr, mask=rmask, other=0.0)
        s_ptr += M_pad
        f = f + s * acc.to(tl.float32)
    store_rows(y_ptr + n.to(tl.int64) * ldy + rows, f, tl.load(xscale_ptr + n), bias_ptr, rows, rmask,
               HAS_BIAS, Y_KIND)


def gemv_grid(N: int, M: int, block_m: int) -> tuple[int, int]:
    return (N, triton.cdiv(M, block_m))

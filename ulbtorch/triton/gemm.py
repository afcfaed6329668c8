"""GEMM for prefill: a block of tokens times a block of output rows per
program, the int8 activations and the levels (int8 in registers) multiplied
by tl.dot into int32 sums per group, then scaled and added in group order as
in the GEMV (gemv.py), so both give the CPU's values bit for bit."""
from __future__ import annotations

import triton
import triton.language as tl

from .kernel_parts import levels, store_rows


@triton.jit
def gemm_kernel(xq_ptr, xscale_ptr, words_ptr, scales_ptr, bias_ptr, y_ptr, sums_ptr,
                N, M, M_pad, K_pad, G, GS, ldy,
                BITS: tl.constexpr, LEVEL_A: tl.constexpr, LEVEL_B: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_W: tl.constexpr, HAS_BIAS: tl.constexpr, Y_KIND: tl.constexpr,
                SUMS: tl.constexpr):
    TK: tl.constexpr = 32 // BITS
    BK: tl.constexpr = BLOCK_W * TK
    toks = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    tmask, rmask = toks < N, rows < M
    words_per_group = GS // TK
    words_total = K_pad // TK
    f = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    s_ptr = scales_ptr + rows  # group g's scales follow M_pad after g - 1's
    for g in range(0, G):
        w0 = g * words_per_group
        w1 = tl.minimum(w0 + words_per_group, words_total)
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.int32)
        for wb in range(w0, w1, BLOCK_W):
            kw = wb + tl.arange(0, BLOCK_W)
            lev = levels(words_ptr, M_pad, kw, w1, rows, rmask, BITS, LEVEL_A, LEVEL_B, BLOCK_W, BLOCK_M)
            k = wb * TK + tl.arange(0, BK)
            x = tl.load(xq_ptr + toks[:, None].to(tl.int64) * K_pad + k[None, :],
                        mask=tmask[:, None] & (k < w1 * TK)[None, :], other=0)
            acc += tl.dot(x, lev.to(tl.int8), out_dtype=tl.int32)
        if SUMS:
            tl.store(sums_ptr + (toks[:, None].to(tl.int64) * M + rows[None, :]) * G + g, acc,
                     mask=tmask[:, None] & rmask[None, :])
        s = tl.load(s_ptr, mask=rmask, other=0.0)
        s_ptr += M_pad
        f = f + s[None, :] * acc.to(tl.float32)
    xs = tl.load(xscale_ptr + toks, mask=tmask, other=0.0)
    store_rows(y_ptr + toks[:, None].to(tl.int64) * ldy + rows[None, :], f, xs[:, None], bias_ptr, rows[None, :],
               tmask[:, None] & rmask[None, :], HAS_BIAS, Y_KIND)


def gemm_grid(N: int, M: int, block_n: int, block_m: int) -> tuple[int, int]:
    return (triton.cdiv(N, block_n), triton.cdiv(M, block_m))

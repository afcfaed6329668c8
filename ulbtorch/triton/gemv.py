"""Fused GEMV for a few tokens (decode), in two launches so that a weight of
few rows still spreads over every multiprocessor:

1. gemv_sums_kernel: one program per token, block of rows and run of K
   segments streams the rows' code words and writes the int32 sum of
   level x activation of each segment. A segment lies inside one scale
   group: with groups it is a group; with one group per row it is a slice
   of K (split-K), whose sums add exactly, being integers.
2. gemv_store_kernel: per token and block of rows, adds each group's
   segment sums, then scale x sum in group order into an fp32 accumulator,
   as the CPU's scalar reference does (kernels/ref/panel_ref.c), and stores.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .kernel_parts import levels, store_rows

# Tokens up to which the GEMV is used; more go to the GEMM (gemm.py).
GEMV_MAX_TOKENS = 8
# Codes of K one program of gemv_sums_kernel reads per row, about.
CODES_PER_PROGRAM = 2048


@triton.jit
def gemv_sums_kernel(xq_ptr, words_ptr, part_ptr, N, M, M_pad, K_pad, SEG_WORDS, SEGS, SEGS_PER_PROGRAM,
                     BITS: tl.constexpr, LEVEL_A: tl.constexpr, LEVEL_B: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_W: tl.constexpr):
    TK: tl.constexpr = 32 // BITS
    n = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < M
    x_row = xq_ptr + n.to(tl.int64) * K_pad
    words_total = K_pad // TK
    s0 = tl.program_id(2) * SEGS_PER_PROGRAM
    s1 = tl.minimum(s0 + SEGS_PER_PROGRAM, SEGS)
    for s in range(s0, s1):
        w0 = s * SEG_WORDS
        w1 = tl.minimum(w0 + SEG_WORDS, words_total)
        acc = tl.zeros([BLOCK_M], dtype=tl.int32)
        for wb in range(w0, w1, BLOCK_W):
            kw = wb + tl.arange(0, BLOCK_W)
            lev = levels(words_ptr, M_pad, kw, w1, rows, rmask, BITS, LEVEL_A, LEVEL_B, BLOCK_W, BLOCK_M)
            k = wb * TK + tl.arange(0, BLOCK_W * TK)
            x = tl.load(x_row + k, mask=k < w1 * TK, other=0).to(tl.int32)
            acc += tl.sum(x[:, None] * lev, axis=0)
        tl.store(part_ptr + (s * N + n).to(tl.int64) * M_pad + rows, acc, mask=rmask)


@triton.jit
def gemv_store_kernel(part_ptr, xscale_ptr, scales_ptr, bias_ptr, y_ptr, sums_ptr, N, M, M_pad, G, SEGS,
                      SEGS_PER_GROUP, ldy, BLOCK_M: tl.constexpr, HAS_BIAS: tl.constexpr, Y_KIND: tl.constexpr,
                      SUMS: tl.constexpr):
    n = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < M
    f = tl.zeros([BLOCK_M], dtype=tl.float32)
    s_ptr = scales_ptr + rows  # group g's scales follow M_pad after g - 1's
    for g in range(0, G):
        s0 = g * SEGS_PER_GROUP
        acc = tl.zeros([BLOCK_M], dtype=tl.int32)
        for s in range(s0, tl.minimum(s0 + SEGS_PER_GROUP, SEGS)):
            acc += tl.load(part_ptr + (s * N + n).to(tl.int64) * M_pad + rows, mask=rmask, other=0)
        if SUMS:
            tl.store(sums_ptr + (n.to(tl.int64) * M + rows) * G + g, acc, mask=rmask)
        f = f + tl.load(s_ptr, mask=rmask, other=0.0) * acc.to(tl.float32)
        s_ptr += M_pad
    store_rows(y_ptr + n.to(tl.int64) * ldy + rows, f, tl.load(xscale_ptr + n), bias_ptr, rows, rmask,
               HAS_BIAS, Y_KIND)


def segments(tile_k: int, K_pad: int, group_size: int, n_groups: int) -> dict:
    """How gemv_sums_kernel splits K: segment words, segment count, segments
    per group and per program (about CODES_PER_PROGRAM codes a program)."""
    words, per_program = K_pad // tile_k, max(1, CODES_PER_PROGRAM // tile_k)
    if n_groups > 1:  # a segment is a group (the last may be shorter)
        seg = group_size // tile_k
        return dict(seg_words=seg, segs=n_groups, segs_per_group=1, segs_per_program=max(1, per_program // seg))
    segs = -(-words // per_program)
    return dict(seg_words=per_program, segs=segs, segs_per_group=segs, segs_per_program=1)

"""Fused GEMV for a few tokens (decode), in two launches so that a weight of
few rows still spreads over every multiprocessor:

1. gemv_sums_kernel: one program per token, block of rows and run of K
   segments streams the rows' code words and writes the int32 sum of
   level x activation of each segment. A segment lies inside one scale
   group: with groups it is a group; with one group per row it is a slice
   of K (split-K), whose sums add exactly, being integers. A code word is
   not unpacked into its codes: masking field j of every byte at once gives
   four codes, one per byte, which one 4-way byte dot product (dp4a on
   NVIDIA GPUs) multiplies with four activations packed the same way
   (pack_activations); the levels' offset is added once per segment,
   level_a * sum(q x) + level_b * sum(x), as the CPU kernels do.
2. gemv_store_kernel: per token and block of rows, adds each group's
   segment sums, then scale x sum in group order into an fp32 accumulator,
   as the CPU's scalar reference does (kernels/ref/panel_ref.c), and stores.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .kernel_parts import store_rows

# Tokens up to which the GEMV is used; more go to the GEMM (gemm.py).
GEMV_MAX_TOKENS = 8
# Per code width: rows per program, codes of K per block (a program reads
# one block of its rows per segment without groups), warps. Chosen by the
# instructions per weight of the compiled inner loop (sm_90 SASS,
# benchmarks/triton_sass.py), not yet by timings on a GPU.
CONFIGS = {1: (128, 512, 4), 2: (128, 512, 4), 4: (64, 512, 4), 8: (32, 512, 4)}


@triton.jit
def dot4(a, b, c, PTX: tl.constexpr):
    """c + sum over the bytes i of uint8(a_i) x int8(b_i): one dp4a where
    PTX, else the same sum spelled out (the interpreter, AMD, Intel)."""
    if PTX:
        return tl.inline_asm_elementwise("dp4a.u32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c],
                                         dtype=tl.int32, is_pure=True, pack=1)
    else:
        for i in tl.static_range(4):
            c += ((a >> (8 * i)) & 0xFF) * ((b << (24 - 8 * i)) >> 24)
        return c


@triton.jit
def gemv_sums_kernel(xpack_ptr, words_ptr, part_ptr, N, M, M_pad, K_pad, SEG_WORDS, SEGS, SEGS_PER_PROGRAM,
                     BITS: tl.constexpr, LEVEL_A: tl.constexpr, LEVEL_B: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_W: tl.constexpr, PTX: tl.constexpr):
    TK: tl.constexpr = 32 // BITS
    J: tl.constexpr = 8 // BITS  # fields per byte
    n = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < M_pad  # the blob holds M_pad rows (zero codes past M): a mask whole in 16s
    words_total = K_pad // TK
    x_row = xpack_ptr + n.to(tl.int64) * (words_total * J)
    fields = tl.arange(0, J)
    s0 = tl.program_id(2) * SEGS_PER_PROGRAM
    s1 = tl.minimum(s0 + SEGS_PER_PROGRAM, SEGS)
    for s in range(s0, s1):
        w0 = s * SEG_WORDS
        w1 = tl.minimum(w0 + SEG_WORDS, words_total)
        qx = tl.zeros([BLOCK_W, J, BLOCK_M], dtype=tl.int32)
        xs = tl.zeros([BLOCK_W, J], dtype=tl.int32)
        for wb in range(w0, w1, BLOCK_W):
            kw = wb + tl.arange(0, BLOCK_W)
            wmask = kw < w1
            w = tl.load(words_ptr + kw[:, None].to(tl.int64) * M_pad + rows[None, :],
                        mask=wmask[:, None] & rmask[None, :], other=0)
            x = tl.load(x_row + kw[:, None] * J + fields[None, :], mask=wmask[:, None], other=0)  # [BLOCK_W, J]
            q = w[:, None, :] >> (fields[None, :, None] * BITS)
            if BITS < 8:  # field j of each byte (an 8-bit code is its byte)
                q = q & (((1 << BITS) - 1) * 0x01010101)
            qx = dot4(q, x[:, :, None], qx, PTX)
            xs = dot4(0x01010101, x, xs, PTX)
        seg = LEVEL_A * tl.sum(tl.sum(qx, axis=1), axis=0) + LEVEL_B * tl.sum(tl.sum(xs, axis=1), axis=0)
        tl.store(part_ptr + (s * N + n).to(tl.int64) * M_pad + rows, seg, mask=rmask)


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


def pack_activations(xq, tile_k: int):
    """xq [N, K_pad] int8 as gemv_sums_kernel reads it: for code word s (of
    tile_k columns, 32 / tile_k bits each) and field j of its bytes, one
    int32 whose byte i is the activation of column s * tile_k + i * J + j
    (J = tile_k / 4 fields a byte): the column of field j of byte i."""
    N, K_pad = xq.shape
    J = tile_k // 4
    return xq.view(N, K_pad // tile_k, 4, J).transpose(2, 3).reshape(N, K_pad).view(torch.int32)


def segments(bits: int, K_pad: int, group_size: int, n_groups: int) -> dict:
    """How gemv_sums_kernel splits K for codes of `bits`: segment words,
    segment count, segments per group and per program, and the block of
    words a loop step reads (a power of two, at most a group)."""
    tile_k = 32 // bits
    block_words = CONFIGS[bits][1] // tile_k
    words = K_pad // tile_k
    if n_groups > 1:  # a segment is a group (the last may be shorter)
        seg = group_size // tile_k
        step = 1 << (min(seg, block_words).bit_length() - 1)
        return dict(seg_words=seg, segs=n_groups, segs_per_group=1, segs_per_program=max(1, block_words // seg),
                    block_words=step)
    return dict(seg_words=block_words, segs=-(-words // block_words), segs_per_group=-(-words // block_words),
                segs_per_program=1, block_words=block_words)

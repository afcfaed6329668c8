"""The pieces the GEMV and the GEMM share: codes to levels in registers,
and the output step of the CPU's scalar reference (kernels/ref/store_ref.c)."""
from __future__ import annotations

import triton
import triton.language as tl

# Output dtypes the kernels store (Y_KIND).
Y_F32, Y_BF16, Y_F16 = 0, 1, 2
# Every launch's compile options: no multiply-add fused into one rounding,
# so that each float step rounds where the CPU's scalar reference rounds.
LAUNCH_OPTIONS = dict(enable_fp_fusion=False)


@triton.jit
def levels(words_ptr, M_pad, kw, kw_end, rows, rmask, BITS: tl.constexpr, LEVEL_A: tl.constexpr,
           LEVEL_B: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_M: tl.constexpr):
    """Levels [BLOCK_W * (32 // BITS), BLOCK_M] (int32) of code words kw of
    rows `rows`: word (s, m) of the kmajor layout holds in field j the code
    of column s * (32 // BITS) + j, and a level is LEVEL_A * q + LEVEL_B.
    Words at or past kw_end read as code 0 (their activations are zero)."""
    TK: tl.constexpr = 32 // BITS
    w = tl.load(words_ptr + kw[:, None].to(tl.int64) * M_pad + rows[None, :],
                mask=(kw < kw_end)[:, None] & rmask[None, :], other=0)
    fields = tl.arange(0, TK) * BITS
    codes = (w[:, None, :] >> fields[None, :, None]) & ((1 << BITS) - 1)
    return tl.reshape(codes * LEVEL_A + LEVEL_B, [BLOCK_W * TK, BLOCK_M])


@triton.jit
def to_bf16_bits(v):
    """float32 -> bfloat16 bits, rounded to nearest even with NaN kept (as
    kernels/src/dtype.h and torch round; the interpreter's cast truncates)."""
    u = v.to(tl.uint32, bitcast=True)
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    r = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return tl.where(nan, (u >> 16) | 0x40, r).to(tl.uint16).to(tl.int16, bitcast=True)


@triton.jit
def store_rows(y_ptr, f, xscale, bias_ptr, cols, cmask, HAS_BIAS: tl.constexpr, Y_KIND: tl.constexpr):
    """y = f * xscale (+ bias), stored as Y_KIND: the order of operations of
    the CPU's output step, so the stored values are the CPU's bit for bit."""
    v = f * xscale
    if HAS_BIAS:
        v = v + tl.load(bias_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    if Y_KIND == 1:
        tl.store(y_ptr, to_bf16_bits(v), mask=cmask)
    elif Y_KIND == 2:
        tl.store(y_ptr, v.to(tl.float16), mask=cmask)
    else:
        tl.store(y_ptr, v, mask=cmask)

"""GGUF (ggml) weight blocks as ulbtorch codes and scales, and back.

Each ggml type below whose values are an integer level times a block scale
is held exactly by one of our formats: decode() gives the codes and fp32
scales whose ops.dequantize() equals gguf-py's dequantisation (ggml's rule
for Q1_0, Q2_0 and I2_S, which gguf-py cannot dequantise) bit for bit. The fp16
block scales are exact in fp32, and where a K-quant multiplies an fp16
super-block scale by a small integer sub-scale, that product is exact in
fp32 too, so the product with the level is rounded once, as ggml rounds it.

  Q1_0     128  {-d, +d}                   binary, groups of 128
  TQ1_0    256  {-1, 0, 1} d, base-3        ternary, groups of 256
  TQ2_0    256  {-1, 0, 1} d, 2 bits        ternary, groups of 256
  Q2_0      64  (q - 1) d, q in 0..3        int2 (levels -2..1) times -d, groups of 64
  I2_S     all  {-1, 0, 1} s, one fp32 s    ternary, one scale per tensor (bitnet.cpp)
  Q4_0      32  (q - 8) d                   int4, groups of 32
  Q3_K     256  q d sc, q in -4..3          int4, groups of 16
  Q5_0      32  (q - 16) d                  int8, groups of 32
  Q8_0      32  q d, q in -127..127         int8, groups of 32 (-128 is refused)
  Q6_K     256  (q - 32) d sc               int8, groups of 16
  IQ4_NL    32  kvalue(q) d                 int8, groups of 32 (the table's levels are integers)
  IQ4_XS   256  kvalue(q) d (ls - 32)       int8, groups of 32

Types with a block minimum (Q4_1, Q5_1, Q2_K, Q4_K, Q5_K) or non-integer
grids (the other IQ types) are not: no format of ours holds them exactly.

I2_S is bitnet.cpp's type 36: 128-value blocks of 32 bytes, value 32*j + i
of a block in bits 7-6, 5-4, 3-2, 1-0 (j = 0..3) of the block's byte i,
codes 0, 1, 2 for -1, 0, +1 (3 reads as 0, as its dequantize_row_i2_s has
it), then one fp32 scale for the whole tensor, padded to 32 bytes. That is
the layout its x86 converter writes (QK_I2_S = 128); nothing in a file says
which layout it holds.

Q2_0 is ggml's type 42 (gguf-py 0.19 has no such type): 64-value blocks,
an fp16 d, then value j in bits 2(j%4)..2(j%4)+1 of byte j/4. Its levels
-1..2 are int2's -2..1 negated, so code 3 - q with the scale -d gives each
value exactly (a zero level as -0.0 where ggml's is +0.0: equal values).
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

# ggml's type numbers (ggml.h; I2_S is bitnet.cpp's), written out so that an older gguf-py without Q1_0 reads
# the same table.
F32, F16, Q4_0, Q5_0, Q8_0, Q3_K, Q6_K, IQ4_NL, IQ4_XS, BF16, TQ1_0, TQ2_0, I2_S, Q1_0, Q2_0 = (
    0, 1, 2, 6, 8, 11, 14, 20, 23, 30, 34, 35, 36, 41, 42)
NAMES = {F32: "F32", F16: "F16", Q4_0: "Q4_0", Q5_0: "Q5_0", Q8_0: "Q8_0", Q3_K: "Q3_K", Q6_K: "Q6_K",
         IQ4_NL: "IQ4_NL", IQ4_XS: "IQ4_XS", BF16: "BF16", TQ1_0: "TQ1_0", TQ2_0: "TQ2_0", I2_S: "I2_S", Q1_0: "Q1_0",
         Q2_0: "Q2_0"}
# (values, bytes) of a block of the types decoded here; gguf-py's table gives the others'
BLOCKS = {F32: (1, 4), F16: (1, 2), BF16: (1, 2), Q4_0: (32, 18), Q5_0: (32, 22), Q8_0: (32, 34), Q3_K: (256, 110),
          Q6_K: (256, 210), IQ4_NL: (32, 18), IQ4_XS: (256, 136), TQ1_0: (256, 54), TQ2_0: (256, 66),
          Q1_0: (128, 18), Q2_0: (64, 18)}
FLOAT_TYPES = {F32: torch.float32, F16: torch.float16, BF16: torch.bfloat16}
IQ4_LEVELS = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)

# Each block of these types as (format, values per scale); I2_S has one scale per tensor.
DECODED_AS = {Q1_0: ("binary", 128), Q2_0: ("int2", 64), TQ1_0: ("ternary", 256), TQ2_0: ("ternary", 256), I2_S: ("ternary", None),
              Q4_0: ("int4", 32), Q3_K: ("int4", 16), Q5_0: ("int8", 32), Q8_0: ("int8", 32), Q6_K: ("int8", 16),
              IQ4_NL: ("int8", 32), IQ4_XS: ("int8", 32)}
# What save_gguf writes for each format: the type and its values per scale.
ENCODED_AS = {"binary": (Q1_0, 128), "int2": (Q2_0, 64), "ternary": (TQ2_0, 256), "int4": (Q4_0, 32),
              "int8": (Q8_0, 32)}


def type_name(ttype: int) -> str:
    if ttype in NAMES:
        return NAMES[ttype]
    from gguf.constants import GGMLQuantizationType

    try:
        return GGMLQuantizationType(ttype).name
    except ValueError:
        return f"ggml type {ttype}"


def block_shape(ttype: int) -> tuple[int, int] | None:
    """(values, bytes) of one block, or None (I2_S, types gguf-py does not know)."""
    if ttype in BLOCKS:
        return BLOCKS[ttype]
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        return GGML_QUANT_SIZES[GGMLQuantizationType(ttype)]
    except (ValueError, KeyError):
        return None


def nbytes_of(ttype: int, shape: tuple[int, ...]) -> int | None:
    n = int(np.prod(shape))
    if ttype == I2_S:
        return n // 4 + 32
    block = block_shape(ttype)
    return None if block is None else n // block[0] * block[1]


class Decoded(NamedTuple):
    codes: torch.Tensor   # uint8 [rows, K]
    scales: torch.Tensor  # float32 [rows, groups]
    format: str
    group_size: int       # 0: one scale per row
    granularity: str      # "group", "channel" or "tensor"


def _f16(b: torch.Tensor) -> torch.Tensor:
    """[..., 2] little-endian fp16 bytes -> float32 [...] (exact)."""
    return b.contiguous().view(torch.float16).squeeze(-1).float()


def _blocks(raw: np.ndarray, ttype: int) -> torch.Tensor:
    """[rows, row_bytes] -> [rows, blocks, block_bytes]."""
    _, size = block_shape(ttype)
    t = torch.from_numpy(raw)
    return t.reshape(t.shape[0], -1, size)


def _first_bad(mask: torch.Tensor, K: int) -> tuple[int, int]:
    i = int(mask.reshape(-1).nonzero()[0])
    return i // K, i % K


def _bits(byte_values: torch.Tensor, shifts, width: int) -> torch.Tensor:
    """byte_values [..., n] -> [..., len(shifts), n] fields of `width` bits."""
    s = torch.tensor(shifts, dtype=torch.uint8).reshape(-1, 1)
    return (byte_values.unsqueeze(-2) >> s) & ((1 << width) - 1)


def _q1_0(b):
    d, qs = _f16(b[..., :2]), b[..., 2:]
    return _bits(qs, range(8), 1).transpose(-1, -2).reshape(*b.shape[:2], 128), d


def _q2_0(b):
    d, qs = _f16(b[..., :2]), b[..., 2:]
    q = _bits(qs, (0, 2, 4, 6), 2).transpose(-1, -2).reshape(*b.shape[:2], 64)
    return 3 - q, -d  # int2's code and scale of the level q - 1


def _tq1_0(b):
    qs, qh, d = b[..., :48], b[..., 48:52], _f16(b[..., 52:54])
    powers = torch.tensor([1, 3, 9, 27, 81], dtype=torch.uint8).reshape(-1, 1)

    def digits(x, p):  # ggml's rule: the p-th base-3 digit of a byte is ((x * 3^p mod 256) * 3) >> 8
        return ((x.unsqueeze(-2) * p).to(torch.int32) * 3 >> 8).to(torch.uint8)
    parts = [digits(qs[..., :32], powers), digits(qs[..., 32:48], powers), digits(qh, powers[:4])]
    return torch.cat([p.reshape(*b.shape[:2], -1) for p in parts], dim=-1), d


def _tq2_0(b):
    qs, d = b[..., :64].reshape(*b.shape[:2], 2, 32), _f16(b[..., 64:66])
    return _bits(qs, (0, 2, 4, 6), 2).reshape(*b.shape[:2], 256), d


def _q4_0(b):
    d, qs = _f16(b[..., :2]), b[..., 2:]
    return _bits(qs, (0, 4), 4).reshape(*b.shape[:2], 32), d


def _q5_0(b):
    d, qh, qs = _f16(b[..., :2]), b[..., 2:6], b[..., 6:]
    low = _bits(qs, (0, 4), 4).reshape(*b.shape[:2], 32)
    high = _bits(qh, range(8), 1).transpose(-1, -2).reshape(*b.shape[:2], 32)
    return (low | (high << 4)) + (127 - 16), d  # int8 codes of the levels q - 16


def _q8_0(b):
    d, q = _f16(b[..., :2]), b[..., 2:].contiguous().view(torch.int8)
    return q, d  # checked for -128 and offset by the caller


def _q3_k(b):
    hmask, qs, sc, d = b[..., :32], b[..., 32:96], b[..., 96:108], _f16(b[..., 108:110])
    low = _bits(qs.reshape(*b.shape[:2], 2, 32), (0, 2, 4, 6), 2).reshape(*b.shape[:2], 256)
    high = _bits(hmask, range(8), 1).reshape(*b.shape[:2], 256)
    levels = low.to(torch.int8) - ((1 - high.to(torch.int8)) << 2)  # -4..3
    lsc = _bits(sc[..., :8], (0, 4), 4).reshape(*b.shape[:2], 16)
    hsc = _bits(sc[..., 8:12], (0, 2, 4, 6), 2).reshape(*b.shape[:2], 16)
    sub = (lsc | (hsc << 4)).to(torch.int8) - 32
    return (levels + 8).to(torch.uint8), d.unsqueeze(-1) * sub.float()


def _q6_k(b):
    ql, qh, sc, d = b[..., :128], b[..., 128:192], b[..., 192:208], _f16(b[..., 208:210])
    low = _bits(ql.reshape(*b.shape[:2], 2, 64), (0, 4), 4).reshape(*b.shape[:2], 256)
    high = _bits(qh.reshape(*b.shape[:2], 2, 32), (0, 2, 4, 6), 2).reshape(*b.shape[:2], 256)
    sub = sc.contiguous().view(torch.int8).float()
    return (low | (high << 4)) + (127 - 32), d.unsqueeze(-1) * sub


_IQ4 = torch.tensor(IQ4_LEVELS, dtype=torch.int16) + 127


def _iq4_nl(b):
    d, qs = _f16(b[..., :2]), b[..., 2:]
    return _IQ4[_bits(qs, (0, 4), 4).reshape(*b.shape[:2], 32).long()].to(torch.uint8), d


def _iq4_xs(b):
    d, sh, sl, qs = _f16(b[..., :2]), b[..., 2:4], b[..., 4:8], b[..., 8:]
    high = sh.contiguous().view(torch.int16).to(torch.int32).squeeze(-1)
    high = (high.unsqueeze(-1) >> torch.arange(0, 16, 2)) & 3
    low = _bits(sl, (0, 4), 4).transpose(-1, -2).reshape(*b.shape[:2], 8)
    sub = (low.to(torch.int32) | (high << 4)) - 32
    q = _bits(qs.reshape(*b.shape[:2], 8, 16), (0, 4), 4).reshape(*b.shape[:2], 256)
    return _IQ4[q.long()].to(torch.uint8), d.unsqueeze(-1) * sub.float()


_DECODERS = {Q1_0: _q1_0, Q2_0: _q2_0, TQ1_0: _tq1_0, TQ2_0: _tq2_0, Q4_0: _q4_0, Q5_0: _q5_0, Q8_0: _q8_0, Q3_K: _q3_k,
             Q6_K: _q6_k, IQ4_NL: _iq4_nl, IQ4_XS: _iq4_xs}


def _i2_s(raw: np.ndarray, rows: int, K: int) -> tuple[torch.Tensor, torch.Tensor]:
    n = rows * K
    codes = _bits(torch.from_numpy(raw[:n // 4]).reshape(-1, 32), (6, 4, 2, 0), 2).reshape(rows, K)
    codes[codes == 3] = 1
    scale = float(raw[n // 4:n // 4 + 4].view(np.float32)[0])
    return codes, torch.full((rows, 1), scale, dtype=torch.float32)


def decode(ttype: int, raw: np.ndarray, rows: int, K: int) -> Decoded:
    """Codes and scales of a tensor of `rows` rows of K values stored as
    ttype (raw: GGUFFile.raw). A ValueError says what the blocks hold that
    the format cannot (an int8 -128, a TQ2_0 code 3, a non-finite scale)."""
    fmt, per = DECODED_AS[ttype]
    if ttype == I2_S:
        codes, scales = _i2_s(raw, rows, K)
        gs, gran = 0, "tensor"
    else:
        codes, scales = _DECODERS[ttype](_blocks(raw, ttype))
        sub = per if scales.dim() == 3 else block_shape(ttype)[0]  # sub-block scales of K-quants
        codes, scales = codes.reshape(rows, K), scales.reshape(rows, K // sub)
        gs = per if per < K else 0
        gran = "group" if gs else "channel"
        if ttype == Q8_0:
            low = codes == -128
            if low.any():
                r, k = _first_bad(low, K)
                raise ValueError(f"row {r}, column {k} holds -128, below int8's levels -127..127")
            codes = codes.view(torch.uint8) + 127  # x + 127 for x in -127..127, mod 256 in uint8
        if ttype == TQ2_0:
            three = codes == 3
            if three.any():
                r, k = _first_bad(three, K)
                raise ValueError(f"row {r}, column {k} holds code 3 (level 2), not a ternary value")
    bad = ~torch.isfinite(scales)
    if bad.any():
        r, g = _first_bad(bad, scales.shape[1])
        raise ValueError(f"row {r}: the scale of values {g * (per or K)}.. is {scales[r, g].item()}")
    return Decoded(codes.contiguous(), scales.contiguous(), fmt, gs, gran)


def encode(codes: torch.Tensor, scales16: torch.Tensor, fmt: str) -> np.ndarray:
    """Rows of blocks of ENCODED_AS[fmt] from codes [M, K] and fp16 scales
    [M, K / block]: the inverse of decode for those types."""
    M, K = codes.shape
    ttype, per = ENCODED_AS[fmt]
    c = codes.reshape(M, K // per, per)
    d = scales16.reshape(M, K // per, 1).contiguous().view(torch.uint8)
    weights = lambda n, w: torch.tensor([1 << (w * i) for i in range(n)], dtype=torch.int32)  # noqa: E731
    if fmt == "binary":
        qs = (c.reshape(M, -1, 16, 8).to(torch.int32) * weights(8, 1)).sum(-1)
        body = [d, qs.to(torch.uint8)]
    elif fmt == "int2":  # level c - 2 times s is (q - 1) times -s for q = 3 - c
        qs = ((3 - c.reshape(M, -1, 16, 4).to(torch.int32)) * weights(4, 2)).sum(-1)
        body = [(-scales16).reshape(M, K // per, 1).contiguous().view(torch.uint8), qs.to(torch.uint8)]
    elif fmt == "ternary":
        qs = (c.reshape(M, -1, 2, 4, 32).to(torch.int32) * weights(4, 2).reshape(4, 1)).sum(-2)
        body = [qs.reshape(M, -1, 64).to(torch.uint8), d]
    elif fmt == "int4":
        qs = c.reshape(M, -1, 2, 16).to(torch.int32) * weights(2, 4).reshape(2, 1)
        body = [d, qs.sum(-2).to(torch.uint8)]
    else:
        body = [d, (c.to(torch.int16) - 127).to(torch.int8).view(torch.uint8)]
    return torch.cat(body, dim=-1).reshape(M, -1).numpy()

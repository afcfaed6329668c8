"""What the blob fuzzers share: valid packed blobs of every format, tile
order and a few shapes, mutations of them, and exercise(), which runs a
blob through every entry point that reads one and checks what each did.

A blob is refused by raising TypeError, ValueError or RuntimeError; any
other exception, or a crash, is a bug. Beyond that:
  - no entry point accepts a blob whose header packed_info refuses;
  - a blob a layer accepts on load (load_state_dict) carries a checksum and
    is byte for byte the blob that was packed: a damaged checkpoint cannot
    load as another model."""
from __future__ import annotations

import random
import struct

import torch

from ulbtorch import ops
from ulbtorch.formats import FORMATS
from ulbtorch.nn import MODULE_FOR_FORMAT

REFUSALS = (TypeError, ValueError, RuntimeError)
SHAPES = ((1, 32, 0), (17, 100, 0), (64, 256, 64))  # (out_features, in_features, group size)
HEADER = 64


class Case:
    """One valid blob and an empty layer of its geometry."""

    def __init__(self, fmt: str, tiles: str, M: int, K: int, gs: int, rng: random.Random):
        f = FORMATS[fmt]
        g = torch.Generator().manual_seed(rng.randrange(2**31))
        codes = torch.randint(0, f.max_code + 1, (M, K), generator=g, dtype=torch.uint8)
        groups = -(-K // gs) if gs else 1
        scales = torch.rand(M, groups, generator=g) + 0.5
        self.name = f"{fmt}/{tiles}/{M}x{K}/g{gs}"
        self.M, self.K = M, K
        self.blob = bytes(ops.pack(codes, scales, fmt, gs, tiles=tiles).numpy())
        self.layer = MODULE_FOR_FORMAT[fmt](K, M, bias=False, format=fmt, group_size=gs)


def cases(seed: int = 0) -> list[Case]:
    rng = random.Random(seed)
    return [Case(fmt, tiles, M, K, gs, rng) for fmt, f in FORMATS.items() for tiles in f.tiles
            for M, K, gs in SHAPES if gs % f.tile_k == 0]


def mutate(blob: bytes, rng: random.Random) -> tuple[bytes, str]:
    """A damaged copy of blob and what was done to it."""
    b = bytearray(blob)
    kind = rng.randrange(7)
    if kind == 0:
        i = rng.randrange(HEADER * 8)
        b[i // 8] ^= 1 << (i % 8)
        what = f"header bit {i}"
    elif kind == 1:
        bits = [rng.randrange(len(b) * 8) for _ in range(rng.randint(1, 4))]
        for i in bits:
            b[i // 8] ^= 1 << (i % 8)
        what = f"bits {bits}"
    elif kind == 2:
        i, v = rng.randrange(HEADER), rng.randrange(256)
        b[i] = v
        what = f"header byte {i} = {v}"
    elif kind == 3:
        off = rng.randrange(1, HEADER // 8) * 8
        v = rng.choice([0, 1, -1, 2**16, 2**16 + 1, 2**26 + 1, 2**31 - 1, 2**31, -2**63, 2**63 - 1])
        b[off:off + 8] = struct.pack("<q", v)
        what = f"int64 at {off} = {v}"
    elif kind == 4:
        n = rng.randint(1, 64)
        b = b[:-n] if rng.random() < 0.5 else b + bytes(n)
        what = f"size {len(blob)} -> {len(b)}"
    elif kind == 5:
        i = rng.randrange(HEADER, len(b))
        b[i] = 0xFF  # code 255 in int8, code 3 in ternary
        what = f"body byte {i} = 255"
    else:
        i, v = rng.randrange(HEADER, len(b)), rng.randrange(256)
        b[i] = v
        what = f"body byte {i} = {v}"
    return bytes(b), what


def _refused(fn) -> bool:
    """Whether fn() refused (raised one of REFUSALS); other exceptions propagate."""
    try:
        fn()
    except REFUSALS:
        return True
    return False


def exercise(data: bytes, case: Case | None = None) -> str:
    """Run the blob `data` through every entry point (and, given its Case,
    through the layer and the ops at the Case's shape); returns "refused",
    "read" (packed_info accepts it, the layer does not) or "loaded". Raises
    AssertionError where a property above does not hold."""
    blob = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
    info = None
    try:
        info = ops.packed_info(blob)
    except REFUSALS:
        pass
    M = case.M if case else (info or {}).get("out_features", 1)
    K = case.K if case else (info or {}).get("in_features", 1)
    x = torch.randn(3, K)
    calls = {
        "unpack": lambda: ops.unpack(blob),
        "linear N=1": lambda: ops.linear(x[:1], blob, None, M),
        "linear N=3": lambda: ops.linear(x, blob, None, M),
        "retile": lambda: ops.retile(blob),
        "dequantize_packed": lambda: ops.dequantize_packed(blob, M, K),
    }
    refused = {name: _refused(fn) for name, fn in calls.items()}
    if info is None:
        read = [name for name, r in refused.items() if not r]
        assert not read, f"packed_info refuses the blob but {read} read it"
        return "refused"
    if case is None:
        return "read"
    try:
        case.layer.load_state_dict({"packed": blob})
    except REFUSALS:
        return "read"
    assert ops.packed_info(blob, verify=True)["checked"], f"{case.name}: a blob without a checksum"
    assert data == case.blob, f"a damaged blob loaded into {case.name}"
    return "loaded"

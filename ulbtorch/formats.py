"""Weight formats: the format table of the kernel library, read at import.

A code q (unsigned, `bits` wide) stands for the integer level a*q + b; the
weight is scale * level. The table lives in kernels/src/format.c (the
kernels need it); every Python view of it (FORMATS, the `bits` spellings
quantize_ takes, the nn classes' formats) is built here from its rows.
docs/formats.md describes the fields and how to add a format.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

import torch

from ._lib import CONSTANTS, FORMAT_ROWS, TILE_ORDERS

# The `bits` of a format whose codes are five to a byte in base 3 (kernels/src/base3.h), not bit fields.
BASE3_BITS = CONSTANTS.base3_bits


@dataclass(frozen=True)
class Format:
    name: str
    id: int
    bits: int
    level_a: int
    level_b: int
    max_code: int
    tile_k: int  # input columns per packed tile: K pads to a multiple, group sizes are multiples
    tiles: tuple[str, ...]  # the tile orders (ops.TILE_ORDERS) it may be packed in
    aliases: tuple[str, ...]  # the spellings of quantize_'s `bits` that choose it
    bits_name: str  # the `bits` a config of this format reports
    module: str  # the ulbtorch.nn class that holds it
    module_default: bool  # whether that class builds it when no format is named

    @property
    def base3(self) -> bool:
        """Five codes a byte, as a base-3 number (ternary_base3)."""
        return self.bits == BASE3_BITS

    @property
    def bits_per_code(self) -> float:
        """Storage per weight, scales and padding aside: 1.6 for base 3, else bits."""
        return 8 / 5 if self.base3 else self.bits

    @property
    def prefetch_bits(self) -> int:
        """The width whose prefetch setting (runtime.prefetch_distance) its kernels use: base 3 takes 2's."""
        return 2 if self.base3 else self.bits

    @property
    def levels(self) -> torch.Tensor:
        q = torch.arange(self.max_code + 1)
        return self.level_a * q + self.level_b

    def codes_to_levels(self, codes: torch.Tensor) -> torch.Tensor:
        return self.level_a * codes.to(torch.int32) + self.level_b


def _split(names: bytes) -> tuple[str, ...]:
    return tuple(n for n in names.decode().split(",") if n)


FORMATS = {
    row.name.decode(): Format(row.name.decode(), row.id, row.bits, row.level_a, row.level_b, row.max_code,
                              row.tile_k, tuple(t for i, t in enumerate(TILE_ORDERS) if row.tiles >> i & 1),
                              _split(row.aliases), row.bits_name.decode(), row.module.decode(),
                              bool(row.module_default))
    for row in FORMAT_ROWS
}
FORMATS_BY_ID = {f.id: f for f in FORMATS.values()}


def bits_value(spelling: str) -> int | float | str:
    """A `bits` spelling of the table as quantize_ takes it: "2" -> 2,
    "1.58" -> 1.58, "ternary" -> "ternary"."""
    for kind in (int, float):
        try:
            return kind(spelling)
        except ValueError:
            pass
    return spelling


# quantize_'s `bits` values and the format each chooses: 2 -> "int2_sym", ...
FORMAT_FOR_BITS = {bits_value(a): f.name for f in FORMATS.values() for a in f.aliases}


def describe_bits(choices) -> str:
    """The `bits` values among `choices` (keys of FORMAT_FOR_BITS), for an
    error message: "1, 'ternary'/1.58, 2, 4 or 8", narrowest first, the
    spellings of one format joined by a slash."""
    by_format: dict[str, list] = {}
    for bits in (b for b in FORMAT_FOR_BITS if b in choices):  # the table's order
        by_format.setdefault(FORMAT_FOR_BITS[bits], []).append(bits)

    def width(values):
        return min(v for v in values if not isinstance(v, str))

    words = ["/".join(repr(v) if isinstance(v, str) else str(v) for v in values)
             for values in sorted(by_format.values(), key=width)]
    return ", ".join(words[:-1]) + " or " + words[-1] if len(words) > 1 else words[0]


def module_formats(module: str) -> tuple[str, ...]:
    """The formats the nn class named `module` holds, the one it builds by
    default first."""
    rows = [f for f in FORMATS.values() if f.module == module]
    return tuple(f.name for f in sorted(rows, key=lambda f: not f.module_default))


def get_format(name: str | Format) -> Format:
    if isinstance(name, Format):
        return name
    try:
        return FORMATS[name]
    except KeyError:
        raise ValueError(f"unknown weight format {name!r}; known: {sorted(FORMATS)}") from None


def int_arg(value, what: str, accepted: str = "an int") -> int:
    """value as a Python int (numpy's and torch's ints too, bools not), or a
    TypeError that says `what` must be `accepted`."""
    if not isinstance(value, bool):
        try:
            return operator.index(value)
        except TypeError:
            pass
    raise TypeError(f"{what} must be {accepted}, got {value!r}")


def normalize_group_size(group_size: int | None, in_features: int, format: str | Format) -> int:
    """0 (or None) means one group per row; otherwise a multiple of the
    format's tile_k (32 / bits; 20 for base 3); a group as wide as the row or wider is one
    group per row."""
    if group_size is None:
        return 0
    group_size = int_arg(group_size, "group_size", "an int or None")
    if group_size < 0:
        raise ValueError(f"group_size must be 0 (one scale per output channel) or positive, got {group_size}")
    if group_size == 0 or group_size >= in_features:
        return 0
    block = get_format(format).tile_k
    if group_size % block:
        raise ValueError(f"group_size must be a positive multiple of {block} for format "
                         f"{get_format(format).name!r}, got {group_size}")
    return int(group_size)


def n_groups(group_size: int, in_features: int) -> int:
    return 1 if group_size == 0 else -(-in_features // group_size)

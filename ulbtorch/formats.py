"""Weight formats: names, bit widths and the affine map from code to level.

A code q (unsigned, `bits` wide) stands for the integer level a*q + b; the
weight is scale * level. This table mirrors kernels/src/format.c; the C side
is the authority and the tests check the two agree.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Format:
    name: str
    id: int
    bits: int
    level_a: int
    level_b: int
    max_code: int

    @property
    def k_block(self) -> int:
        """Input columns per packed tile: group sizes are multiples of it."""
        return 32 // self.bits

    @property
    def levels(self) -> torch.Tensor:
        q = torch.arange(self.max_code + 1)
        return self.level_a * q + self.level_b

    def codes_to_levels(self, codes: torch.Tensor) -> torch.Tensor:
        return self.level_a * codes.to(torch.int32) + self.level_b


FORMATS = {
    f.name: f
    for f in (
        Format("int2", 1, 2, 1, -2, 3),       # {-2, -1, 0, 1}
        Format("int2_sym", 2, 2, 2, -3, 3),   # {-3, -1, 1, 3} = 2 x {-1.5, -0.5, 0.5, 1.5}
        Format("ternary", 3, 2, 1, -1, 2),    # {-1, 0, 1}
        Format("binary", 4, 1, 2, -1, 1),     # {-1, 1}
        Format("int8", 5, 8, 1, -127, 254),   # -127..127: for layers kept near full precision (lm_head)
        Format("int4", 6, 4, 1, -8, 15),      # -8..7, as llama.cpp's Q4_0
    )
}
FORMATS_BY_ID = {f.id: f for f in FORMATS.values()}


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
    format's tile width (16 for 2-bit and ternary, 32 for 1-bit, 8 for int4, 4
    for int8); a group as wide as the row or wider is one group per row."""
    if group_size is None:
        return 0
    group_size = int_arg(group_size, "group_size", "an int or None")
    if group_size < 0:
        raise ValueError(f"group_size must be 0 (one scale per output channel) or positive, got {group_size}")
    if group_size == 0 or group_size >= in_features:
        return 0
    block = get_format(format).k_block
    if group_size % block:
        raise ValueError(f"group_size must be a positive multiple of {block} for format "
                         f"{get_format(format).name!r}, got {group_size}")
    return int(group_size)


def n_groups(group_size: int, in_features: int) -> int:
    return 1 if group_size == 0 else -(-in_features // group_size)

"""The ULB_* environment variables, read here and nowhere else in Python.

The kernels read ULB_ISA, ULB_LUT1, ULB_SPIN_US and ULB_PREFETCH_<n>BIT
themselves when the library loads, and fall back to a default on a value
they do not take; the check_* functions compare the variable with the
setting the kernels ended up with and warn where they differ, so that a
typo does not pass silently. ULB_EAGER is Python's own (eager_requested).
"""
from __future__ import annotations

import os
import warnings


def _warn(message: str) -> None:
    warnings.warn(message, RuntimeWarning, stacklevel=3)


def eager_requested() -> bool:
    """ULB_EAGER: the modules' eager fast path, off on "0" alone."""
    value = os.environ.get("ULB_EAGER")
    if value is not None and value not in ("0", "1"):
        _warn(f"ULB_EAGER={value!r} is not '0' or '1'; taken as '1' (on)")
    return value != "0"


def check_isa(active: str, isas: tuple[str, ...]) -> None:
    want = os.environ.get("ULB_ISA")
    if want is not None and want != active:
        why = "not supported by this CPU" if want in isas else f"not one of {isas}"
        _warn(f"ULB_ISA={want!r} is {why}; the kernels use {active!r}")


def lut1_on_without_kernel(lut1_available: bool) -> bool:
    """ULB_LUT1 takes 0, 1 or auto and anything else as auto: say so of other
    values. True where it is 1 but no lookup kernel runs here: the caller
    sets auto then, so that the setting always names one set_lut1 accepts."""
    value = os.environ.get("ULB_LUT1")
    if value is not None and value not in ("0", "1", "auto"):
        _warn(f"ULB_LUT1={value!r} is not '0', '1' or 'auto'; taken as 'auto'")
    if value == "1" and not lut1_available:
        _warn("ULB_LUT1=1, but no 1-bit lookup-table kernel runs on this CPU (they need AVX2, or NEON on AArch64 "
              "Linux); taken as 'auto'")
        return True
    return False


def check_spin(accepted: bool, spin_us: float) -> None:
    """ULB_SPIN_US, read by the kernels' pool: `accepted` is whether it took the value."""
    if not accepted:
        _warn(f"ULB_SPIN_US={os.environ.get('ULB_SPIN_US')!r} is not a number of microseconds from 0 to 1e6; "
              f"the ulb pool's workers spin the default {spin_us:g}")


def check_prefetch(bits: int, in_use, max_bytes: int) -> None:
    """ULB_PREFETCH_<bits>BIT against the distance the kernels use (`in_use`)."""
    want = os.environ.get(f"ULB_PREFETCH_{bits}BIT")
    if not want:
        return
    try:
        parsed = "auto" if want == "auto" else int(want, 10)
    except ValueError:
        parsed = None
    if parsed != in_use:
        _warn(f"ULB_PREFETCH_{bits}BIT={want!r} ignored: not 'auto' or a multiple of 64 bytes from 0 to "
              f"{max_bytes}; the {bits}-bit kernels use {in_use!r}")

"""The kernel library's plain C functions, bound with ctypes: the one place
that loads ulbtorch._C as a shared library and declares the C signatures
and structs Python calls (kernels/include/ulb/ulb.h). These functions move
no tensors; the ops that do are torch.ops.ulb.*."""
from __future__ import annotations

import ctypes
from ctypes import POINTER, c_char_p, c_double, c_int, c_int64, c_size_t, c_uint, c_uint64, c_void_p

from . import _C

lib = ctypes.CDLL(_C.__file__)


class FormatInfo(ctypes.Structure):
    """ulb_format_info: one row of the format table (kernels/src/format.c)."""
    _fields_ = [
        ("id", c_int),
        ("name", c_char_p),
        ("bits", c_int),
        ("level_a", c_int),
        ("level_b", c_int),
        ("max_code", c_int),
        ("tile_k", c_int),
        ("tiles", c_uint),
        ("aliases", c_char_p),
        ("bits_name", c_char_p),
        ("module", c_char_p),
        ("module_default", c_int),
    ]


class Constants(ctypes.Structure):
    """ulb_constants: the header's macros as values."""
    _fields_ = [
        ("max_m", c_int64),
        ("max_k", c_int64),
        ("max_threads", c_int),
        ("panel_rows", c_int),
        ("isa_count", c_int),
        ("tiles_count", c_int),
        ("tiles_preferred", c_int),
        ("lut1_off", c_int),
        ("lut1_on", c_int),
        ("lut1_auto", c_int),
        ("prefetch_auto", c_int64),
        ("prefetch_max", c_int64),
        ("probe_max_streams", c_int),
        ("slowdown_max", c_double),
        ("base3_bits", c_int),
    ]


def _declare(name: str, restype, *argtypes) -> None:
    fn = getattr(lib, name)
    fn.restype = restype
    fn.argtypes = list(argtypes)


_declare("ulb_format_count", c_int)
_declare("ulb_format_at", POINTER(FormatInfo), c_int)
_declare("ulb_format_info_size", c_size_t)
_declare("ulb_constants_get", None, POINTER(Constants))
_declare("ulb_constants_size", c_size_t)
_declare("ulb_isa_name", c_char_p, c_int)
_declare("ulb_tiles_name", c_char_p, c_int)
for _struct, _size in ((FormatInfo, lib.ulb_format_info_size()), (Constants, lib.ulb_constants_size())):
    if ctypes.sizeof(_struct) != _size:
        raise ImportError(f"ulbtorch._lib.{_struct.__name__} is {ctypes.sizeof(_struct)} bytes but the kernel "
                          f"library's struct is {_size}: kernels/include/ulb/ulb.h changed without ulbtorch/_lib.py "
                          "(or ulbtorch._C is stale: rebuild with pip install -e .)")

CONSTANTS = Constants()
lib.ulb_constants_get(ctypes.byref(CONSTANTS))
FORMAT_ROWS = tuple(lib.ulb_format_at(i).contents for i in range(lib.ulb_format_count()))
ISAS = tuple(lib.ulb_isa_name(i).decode() for i in range(CONSTANTS.isa_count))  # ulb_isa, by value
# How the codes of a tile are arranged (ulb_tiles, by value): "vnni" for
# every format; "lanes" for 1-bit formats, the order the AVX2 lookup kernel
# reads best. Every ISA runs blobs of either order.
TILE_ORDERS = tuple(lib.ulb_tiles_name(t).decode() for t in range(CONSTANTS.tiles_count))


class SchedStats(ctypes.Structure):
    """ulb_sched_stats: one kernel family's work-split table."""
    _fields_ = [
        ("nthreads", c_int),
        ("calls", c_int64),
        ("ratio", c_double * CONSTANTS.max_threads),
        ("last_us", c_double * CONSTANTS.max_threads),
        ("last_panels", c_int64 * CONSTANTS.max_threads),
    ]


_declare("ulb_packed_nbytes", c_int64, c_int, c_int64, c_int64, c_int64)
_declare("ulb_tiles_preferred", c_int, c_int)
_declare("ulb_linear", c_int, c_void_p, c_int64, c_int64, c_void_p, c_int, c_int64, c_int64, c_void_p, c_int,
         c_void_p, c_int, c_int64, c_int)
_declare("ulb_isa_active", c_int)
_declare("ulb_isa_supported", c_int, c_int)
_declare("ulb_isa_set", c_int, c_int)
_declare("ulb_lut1_get", c_int)
_declare("ulb_gemv_bf16_native", c_int, c_int)
_declare("ulb_lut1_set", c_int, c_int)
_declare("ulb_lut1_available", c_int, c_int)
_declare("ulb_lut1_serves", c_int, c_int, c_int64, c_int, c_int)
_declare("ulb_prefetch_get", c_int, c_int, POINTER(c_int64))
_declare("ulb_prefetch_set", c_int, c_int, c_int64)
_declare("ulb_prefetch_resolve", c_int64, c_int, c_int, c_int64)
_declare("ulb_spin_us", c_double, POINTER(c_int))
_declare("ulbtorch_use_torch_threads", None, c_int)
_declare("ulb_read_probe_streams", c_int, c_void_p, c_int64, c_int, c_int, POINTER(c_uint64))
_declare("ulb_sched_stats_get", c_int, c_int, c_int, POINTER(SchedStats))
_declare("ulb_sched_reset", None)
_declare("ulb_sched_set_static", None, c_int)
_declare("ulb_sched_set_slowdown", c_int, c_int, c_double)
_declare("ulb_xxh64", c_uint64, c_void_p, c_int64, c_uint64)

"""The format table: Python's view of it equals the kernel library's rows
field by field, and every layer that names formats derives from it."""
import ctypes

import pytest

import ulbtorch
from ulbtorch import _lib, nn, ops, runtime
from ulbtorch.formats import FORMAT_FOR_BITS, FORMATS, FORMATS_BY_ID, describe_bits, module_formats
from ulbtorch.importers.grid import GRID_FORMATS
from ulbtorch.quantize import _BITS_TO_FORMAT, _FORMAT_TO_BITS


def _c_rows():
    lib = _lib.lib
    return [lib.ulb_format_at(i).contents for i in range(lib.ulb_format_count())]


def test_python_formats_equal_the_c_table_field_by_field():
    rows = _c_rows()
    assert [f.name for f in FORMATS.values()] == [r.name.decode() for r in rows]
    for r in rows:
        f = FORMATS[r.name.decode()]
        assert (f.id, f.bits, f.level_a, f.level_b, f.max_code, f.tile_k) == (
            r.id, r.bits, r.level_a, r.level_b, r.max_code, r.tile_k)
        assert sum(1 << ops.TILE_ORDERS.index(t) for t in f.tiles) == r.tiles
        assert ",".join(f.aliases) == r.aliases.decode()
        assert (f.bits_name, f.module, int(f.module_default)) == (
            r.bits_name.decode(), r.module.decode(), r.module_default)
        assert FORMATS_BY_ID[r.id] is f
    assert not _lib.lib.ulb_format_at(len(rows)) and not _lib.lib.ulb_format_at(-1)


def test_table_rows_are_consistent():
    for f in FORMATS.values():
        assert f.tile_k == 32 // f.bits
        assert f.max_code < 1 << f.bits
        assert "vnni" in f.tiles
    assert len(FORMATS_BY_ID) == len(FORMATS)


def test_structs_match_the_library():
    assert ctypes.sizeof(_lib.FormatInfo) == _lib.lib.ulb_format_info_size()
    assert ctypes.sizeof(_lib.Constants) == _lib.lib.ulb_constants_size()


def test_every_row_names_an_nn_class_that_lists_it():
    for f in FORMATS.values():
        cls = getattr(nn, f.module)
        assert issubclass(cls, nn.LowBitLinear) and getattr(ulbtorch, f.module) is cls
        assert f.name in cls.FORMATS
        assert nn.MODULE_FOR_FORMAT[f.name] is cls
        assert (cls.FORMATS[0] == f.name) == f.module_default
    assert set(nn.MODULE_FOR_FORMAT) == set(FORMATS)
    for cls in set(nn.MODULE_FOR_FORMAT.values()):
        assert cls.FORMATS == module_formats(cls.__name__)
        assert sum(FORMATS[name].module_default for name in cls.FORMATS) == 1


def test_bits_spellings_follow_the_aliases():
    for f in FORMATS.values():
        for alias in f.aliases:
            assert _BITS_TO_FORMAT[alias] == f.name
        # the `bits` a config of f reports chooses a format of the same bits_name (2: int2_sym for int2)
        assert FORMATS[FORMAT_FOR_BITS[_FORMAT_TO_BITS[f.name]]].bits_name == f.bits_name
    assert _BITS_TO_FORMAT == {1: "binary", "1": "binary", 1.58: "ternary", "1.58": "ternary",
                               "ternary": "ternary", 2: "int2_sym", "2": "int2_sym", 4: "int4", "4": "int4",
                               8: "int8", "8": "int8"}
    assert _FORMAT_TO_BITS == {"binary": 1, "ternary": "ternary", "int2_sym": 2, "int2": 2, "int4": 4, "int8": 8}
    assert GRID_FORMATS == {1: "binary", "ternary": "ternary", 1.58: "ternary", 2: "int2_sym"}
    assert describe_bits(FORMAT_FOR_BITS) == "1, 'ternary'/1.58, 2, 4 or 8"


def test_constants_come_from_the_library():
    c = _lib.CONSTANTS
    assert ops.shape_limits() == (c.max_m, c.max_k) == (1 << 26, 1 << 16)
    assert runtime.ISAS == tuple(_lib.lib.ulb_isa_name(i).decode() for i in range(c.isa_count))
    assert ops.TILE_ORDERS == ("vnni", "lanes")
    assert runtime.PREFETCH_WIDTHS == (1, 2, 4, 8)
    assert runtime.PROBE_MAX_STREAMS == c.probe_max_streams
    assert _lib.lib.ulb_tiles_name(c.tiles_count) is None


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_group_size_message_names_the_tile_width(fmt):
    f = FORMATS[fmt]
    with pytest.raises(ValueError, match=f"multiple of {f.tile_k} for format '{fmt}'"):
        ulbtorch.formats.normalize_group_size(f.tile_k + 1, 4096, fmt)

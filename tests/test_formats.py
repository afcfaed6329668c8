"""ulbtorch.formats: the format table (Python's view of it equals the kernel
library's rows field by field, and every layer that names formats derives
from it), format names and the group-size rule, the same at every entry
point (ops.pack, torch.ops.ulb.pack, the layers, QuantConfig)."""
import ctypes

import pytest
import torch

import ulbtorch
from ulbtorch import _lib, nn, ops, runtime
from ulbtorch.formats import FORMAT_FOR_BITS, FORMATS, FORMATS_BY_ID, describe_bits, module_formats
from ulbtorch.importers.grid import GRID_FORMATS
from ulbtorch.nn import Linear1Bit, Linear2Bit, Linear4Bit, LinearTernary
from ulbtorch.quantize import _BITS_TO_FORMAT, _FORMAT_TO_BITS

M, K = 8, 64


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
        assert f.tile_k == (20 if f.base3 else 32 // f.bits)
        assert f.max_code < (3 if f.base3 else 1 << f.bits)
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
    assert _FORMAT_TO_BITS == {"binary": 1, "ternary": "ternary", "int2_sym": 2, "int2": 2, "int4": 4, "int8": 8,
                               "ternary_base3": "ternary"}
    assert GRID_FORMATS == {1: "binary", "ternary": "ternary", 1.58: "ternary", 2: "int2_sym"}
    assert describe_bits(FORMAT_FOR_BITS) == "1, 'ternary'/1.58, 2, 4 or 8"


def test_constants_come_from_the_library():
    c = _lib.CONSTANTS
    assert ops.shape_limits() == (c.max_m, c.max_k) == (1 << 26, 1 << 16)
    assert runtime.ISAS == tuple(_lib.lib.ulb_isa_name(i).decode() for i in range(c.isa_count))
    assert ops.TILE_ORDERS == ("vnni", "lanes", "kmajor")
    assert runtime.PREFETCH_WIDTHS == (1, 2, 4, 8)
    assert runtime.PROBE_MAX_STREAMS == c.probe_max_streams
    assert _lib.lib.ulb_tiles_name(c.tiles_count) is None


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_group_size_message_names_the_tile_width(fmt):
    f = FORMATS[fmt]
    with pytest.raises(ValueError, match=f"multiple of {f.tile_k} for format '{fmt}'"):
        ulbtorch.formats.normalize_group_size(f.tile_k + 1, 4096, fmt)


# ---- bad input ------------------------------------------------------------------------------------

def test_unknown_format():
    codes = torch.zeros(M, K, dtype=torch.uint8)
    with pytest.raises(ValueError, match="unknown weight format 'int3'"):
        ops.pack(codes, torch.ones(M, 1), "int3")
    with pytest.raises(RuntimeError, match="unknown format id 9"):
        torch.ops.ulb.pack(codes, torch.ones(M, 1), 9, 0)
    with pytest.raises(ValueError, match="unknown weight format"):
        ops.dequantize(codes, torch.ones(M, 1), "int6")
    with pytest.raises(ValueError, match="unknown format 'int6'"):
        ulbtorch.QuantConfig(format="int6")
    with pytest.raises(ValueError, match="bits must be 1, 'ternary'/1.58, 2, 4 or 8, got 3"):
        ulbtorch.quantize_(torch.nn.Sequential(torch.nn.Linear(K, M)), bits=3)
    with pytest.raises(ValueError, match="Linear2Bit takes formats"):
        Linear2Bit(K, M, format="ternary")
    with pytest.raises(ValueError, match="LinearTernary takes formats"):
        LinearTernary.from_linear(torch.nn.Linear(K, M), format="binary")
    with pytest.raises(ValueError, match="granularity must be one of"):
        Linear2Bit.from_linear(torch.nn.Linear(K, M), granularity="row")
    with pytest.raises(ValueError, match="method must be one of"):
        Linear2Bit.from_linear(torch.nn.Linear(K, M), method="gptq")


def test_bad_group_size():
    codes = torch.zeros(M, K, dtype=torch.uint8)
    with pytest.raises(ValueError, match="group_size must be a positive multiple of 16"):
        ops.pack(codes, torch.ones(M, 3), "int2", 24)
    with pytest.raises(ValueError, match="group_size must be a positive multiple of 32 for format 'binary'"):
        ops.pack(codes, torch.ones(M, 4), "binary", 16)
    with pytest.raises(RuntimeError, match="group size must be a positive multiple of 16"):
        torch.ops.ulb.pack(codes, torch.ones(M, 3), ulbtorch.get_format("int2").id, 24)
    with pytest.raises(ValueError, match="multiple of 16"):
        Linear2Bit(K, M, group_size=24)
    with pytest.raises(ValueError, match="multiple of 32"):
        Linear1Bit(K, M, group_size=48)
    with pytest.raises(ValueError, match="multiple of 16"):
        ulbtorch.QuantConfig(bits=2, group_size=40)
    lin = torch.nn.Linear(K, M)
    with pytest.raises(ValueError, match="multiple of 16"):
        LinearTernary.from_linear(lin, group_size=8)
    with pytest.raises(ValueError, match="granularity='group' needs a group_size"):
        Linear2Bit.from_linear(lin, granularity="group", group_size=0)


def test_group_size_checked_everywhere():
    """int4 groups must be multiples of its 8-column tile, at every entry point."""
    codes = torch.zeros(M, K, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match=r"multiple of 16 \(32 for 1-bit, 8 for 4-bit"):
        torch.ops.ulb.pack(codes, torch.ones(M, 6), ulbtorch.get_format("int4").id, 12)
    with pytest.raises(ValueError, match="group_size must be a positive multiple of 8 for format 'int4'"):
        ops.pack(codes, torch.ones(M, 6), "int4", 12)
    with pytest.raises(ValueError, match="group_size must be a positive multiple of 8 for format 'int4'"):
        Linear4Bit(K, M, group_size=12)
    with pytest.raises(ValueError, match="multiple of 8 for 'int4'"):
        ulbtorch.QuantConfig(bits=4, group_size=12)
    with pytest.raises(ValueError, match="group_size must be 0 .* or positive, got -8"):
        ulbtorch.QuantConfig(bits=4, group_size=-8)
    with pytest.raises(ValueError, match="lm_head_group_size must be 0 .* or positive, got -8"):
        ulbtorch.QuantConfig(lm_head_bits=4, lm_head_group_size=-8)
    with pytest.raises(TypeError, match="lm_head_group_size must be an int, got '32'"):
        ulbtorch.QuantConfig(lm_head_bits=4, lm_head_group_size="32")


@pytest.mark.parametrize("group_size, error", [(-16, ValueError), ("16", TypeError), (True, TypeError),
                                                (16.0, TypeError)])
def test_pack_and_layers_refuse_a_bad_group_size(group_size, error):
    codes = torch.zeros(M, K, dtype=torch.uint8)
    with pytest.raises(error, match="group_size"):
        ops.pack(codes, torch.ones(M, 1), "int2_sym", group_size)
    with pytest.raises(error, match="group_size"):
        Linear2Bit(K, M, group_size=group_size)


def test_pack_takes_numpy_and_torch_ints_as_group_size():
    np = pytest.importorskip("numpy")
    codes = torch.zeros(M, K, dtype=torch.uint8)
    for gs in (np.int64(16), torch.tensor(16)):
        assert ops.packed_info(ops.pack(codes, torch.ones(M, K // 16), "int2_sym", gs))["group_size"] == 16

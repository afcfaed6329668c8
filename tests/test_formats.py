"""ulbtorch.formats: format names and the group-size rule, the same at every
entry point (ops.pack, torch.ops.ulb.pack, the layers, QuantConfig)."""
import pytest
import torch

import ulbtorch
from ulbtorch import ops
from ulbtorch.nn import Linear1Bit, Linear2Bit, Linear4Bit, LinearTernary

M, K = 8, 64


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

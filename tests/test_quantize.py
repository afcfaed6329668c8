"""ulbtorch.quantize: QuantConfig's checks and quantize_'s choice of layers."""
import pytest
import torch
from torch import nn

import ulbtorch
from ulbtorch.nn import Linear2Bit

M, K = 8, 64


def test_group_wider_than_a_layer_gives_that_layer_per_channel_scales():
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 32))
    ulbtorch.quantize_(model, bits=2, group_size=128, exclude=[])
    assert (model[0].group_size, model[0].granularity) == (0, "channel")
    assert (model[2].group_size, model[2].granularity) == (128, "group")
    assert model(torch.randn(3, 64)).shape == (3, 32)


# ---- bad input ------------------------------------------------------------------------------------

def test_quantize_of_a_bare_linear_says_how():
    """The model itself cannot be swapped in place (it used to gain a child
    named "" and stay float)."""
    with pytest.raises(ValueError, match=r"cannot swap the model itself .*nn.Sequential"):
        ulbtorch.quantize_(torch.nn.Linear(K, M), bits=2)
    with pytest.raises(ValueError, match="cannot swap the model itself"):
        ulbtorch.bf16_gemv_(torch.nn.Linear(K, M).to(torch.bfloat16))
    seq = ulbtorch.quantize_(torch.nn.Sequential(torch.nn.Linear(K, M)), bits=2)
    assert type(seq[0]) is Linear2Bit


def test_quantize_that_selects_nothing_changes_nothing():
    model = torch.nn.Sequential(torch.nn.Linear(K, K), torch.nn.Linear(K, M)).bfloat16()
    with pytest.warns(UserWarning, match="no layer converted"):
        ulbtorch.quantize_(model, include=["nomatch"])
    assert [type(m) for m in model] == [torch.nn.Linear, torch.nn.Linear]


def test_quant_config_checks_its_options_up_front():
    with pytest.raises(ValueError, match="granularity must be one of"):
        ulbtorch.QuantConfig(bits=2, granularity="row")
    with pytest.raises(ValueError, match="method must be one of"):
        ulbtorch.QuantConfig(bits=2, method="foo")
    with pytest.raises(ValueError, match="group_size=32 needs granularity='group'"):
        ulbtorch.QuantConfig(bits=2, granularity="channel", group_size=32)


@pytest.mark.parametrize("kwargs,match", [(dict(bf16_gemv="no"), "bf16_gemv takes True or False"),
                                          (dict(format=["int4"]), "format must be a format name")])
def test_quant_config_option_types(kwargs, match):
    with pytest.raises(TypeError, match=match):
        ulbtorch.QuantConfig(**kwargs)


def test_quant_config_bits_and_format_must_agree():
    with pytest.raises(ValueError, match="bits must be 1, 'ternary'/1.58, 2, 4 or 8, got 3"):
        ulbtorch.QuantConfig(bits=3, format="int4")
    with pytest.raises(ValueError, match="bits=1 and format='ternary' disagree"):
        ulbtorch.QuantConfig(bits=1, format="ternary")
    assert ulbtorch.QuantConfig(bits=4, format="int4").format == "int4"
    assert ulbtorch.QuantConfig(format="int2").format == "int2"
    assert ulbtorch.QuantConfig(bits="ternary", format="ternary").format == "ternary"


@pytest.mark.parametrize("fmt", ["binary", "ternary", "int4", "int8"])
def test_quant_config_explicit_bits_2_must_agree_with_format(fmt):
    """bits=2 said "2-bit" only when format was unset: bits=2 with
    format='binary' quantized to 1 bit silently."""
    with pytest.raises(ValueError, match=f"bits=2 and format='{fmt}' disagree"):
        ulbtorch.QuantConfig(bits=2, format=fmt)


@pytest.mark.parametrize("kwargs,bits,fmt", [(dict(), 2, "int2_sym"), (dict(bits=2, format="int2"), 2, "int2"),
                                             (dict(format="int2"), 2, "int2"), (dict(format="binary"), 1, "binary"),
                                             (dict(format="ternary"), "ternary", "ternary")])
def test_quant_config_bits_follow_format(kwargs, bits, fmt):
    """bits is filled from format, so a saved UlbConfig names both consistently."""
    q = ulbtorch.QuantConfig(**kwargs)
    assert (q.bits, q.format) == (bits, fmt)
    assert ulbtorch.QuantConfig(bits=q.bits, format=q.format) == q

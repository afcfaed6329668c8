"""ulbtorch.quantize: QuantConfig's checks and quantize_'s choice of layers."""
import warnings

import pytest
import torch
from torch import nn

import ulbtorch
from ulbtorch.nn import Linear2Bit, Linear4Bit, Linear8Bit, LinearBF16, LinearTernary

from _layers import _float_linear
from _tiny_llama import CONFIG, PROJ, check_kernels_equal_reference, linear_names, lowbit_names, prompt, tiny_llama

M, K = 8, 64


def test_group_wider_than_a_layer_gives_that_layer_per_channel_scales():
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 32))
    ulbtorch.quantize_(model, bits=2, group_size=128, exclude=[])
    assert (model[0].group_size, model[0].granularity) == (0, "channel")
    assert (model[2].group_size, model[2].granularity) == (128, "group")
    assert model(torch.randn(3, 64)).shape == (3, 32)


def test_quantize_converts_a_layer_used_twice_everywhere(gen):
    lin = _float_linear(gen, K=64, M=64)
    seq = torch.nn.Sequential(lin, torch.nn.ReLU(), lin)
    ulbtorch.quantize_(seq, bits=2)
    assert isinstance(seq[0], Linear2Bit) and seq[2] is seq[0]
    head = torch.nn.Linear(64, 64).bfloat16()
    seq = torch.nn.Sequential(head, torch.nn.ReLU(), head)
    ulbtorch.bf16_gemv_(seq)
    assert isinstance(seq[0], LinearBF16) and seq[2] is seq[0]


def test_include_exclude_patterns():
    model = ulbtorch.quantize_(tiny_llama(), bits=2, include=["*.mlp.*"])
    assert lowbit_names(model) == {f"model.layers.{i}.mlp.{p}" for i in range(2)
                                   for p in ("gate_proj", "up_proj", "down_proj")}
    assert {f"model.layers.{i}.self_attn.{p}" for i in range(2)
            for p in ("q_proj", "k_proj", "v_proj", "o_proj")} | {"lm_head"} == linear_names(model)

    model = ulbtorch.quantize_(tiny_llama(), bits=1, exclude=["*.q_proj", "*.layers.1.*", "lm_head"])
    assert lowbit_names(model) == {f"model.layers.0.{p}" for p in
                                   ("self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                                    "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}
    assert "model.layers.0.self_attn.q_proj" in linear_names(model) and "lm_head" in linear_names(model)

    # lm_head is excluded by default, but can be asked for.
    model = ulbtorch.quantize_(tiny_llama(), bits="ternary", include=["lm_head"], exclude=[])
    assert lowbit_names(model) == {"lm_head"} and type(model.lm_head) is LinearTernary
    with torch.no_grad():
        assert model(prompt()).logits.shape == (2, 8, CONFIG["vocab_size"])

    cfg = ulbtorch.QuantConfig(bits="ternary", group_size=64, exclude=["lm_head", "*.down_proj"])
    model = ulbtorch.quantize_(tiny_llama(), cfg)
    assert len(lowbit_names(model)) == 2 * 6 and "model.layers.1.mlp.down_proj" in linear_names(model)
    assert all(model.get_submodule(n).group_size == 64 for n in lowbit_names(model))
    with pytest.raises(TypeError, match="either a QuantConfig or keyword arguments"):
        ulbtorch.quantize_(tiny_llama(), cfg, bits=2)
    # One string is one pattern (not a list of its characters, '*' among them).
    model = ulbtorch.quantize_(tiny_llama(), bits=2, include="*.mlp.*")
    assert len(lowbit_names(model)) == 2 * 3 and "lm_head" in linear_names(model)
    with pytest.raises(TypeError, match="include must be a list of fnmatch patterns"):
        ulbtorch.QuantConfig(include=3)
    with pytest.raises(ValueError, match="bits must be"):
        ulbtorch.QuantConfig(bits=True)


def _close(a, b, rel):
    err = (a - b).abs().max()
    assert err <= rel * b.abs().max(), f"max diff {err.item():.3g} vs scale {b.abs().max().item():.3g}"


# int8 weights and activations: logits within ~1% of the float lm_head's on the same hidden
# states; int4 (16 levels, Q4_0 scales per group of 32): within ~10%.
@pytest.mark.parametrize("head_bits,head_gs,cls,rel", [(8, 0, Linear8Bit, 3e-2), (4, 32, Linear4Bit, 0.1)])
def test_lm_head_bits(tmp_path, head_bits, head_gs, cls, rel):
    model = tiny_llama()
    float_head = model.lm_head
    ulbtorch.quantize_(model, bits=2, lm_head_bits=head_bits, lm_head_group_size=head_gs)
    assert type(model.lm_head) is cls and model.lm_head.format == f"int{head_bits}"
    assert model.lm_head.group_size == head_gs and model.lm_head.granularity == ("group" if head_gs else "channel")
    assert len(lowbit_names(model)) == CONFIG["num_hidden_layers"] * len(PROJ) + 1
    assert all(type(model.get_submodule(n)) is Linear2Bit for n in lowbit_names(model) - {"lm_head"})
    with torch.no_grad():
        h = model.model(prompt()).last_hidden_state
        _close(model.lm_head(h), float_head(h), rel)
    check_kernels_equal_reference(model)
    # Round trip through save_quantized / load_quantized.
    ulbtorch.save_quantized(model, str(tmp_path))
    loaded = ulbtorch.load_quantized(tiny_llama(seed=5), str(tmp_path))
    assert type(loaded.lm_head) is cls and torch.equal(loaded.lm_head.packed, model.lm_head.packed)
    with torch.no_grad():
        assert torch.equal(loaded(prompt()).logits, model(prompt()).logits)


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


def test_quantize_warns_when_nothing_is_converted():
    model = torch.nn.Sequential(torch.nn.Linear(64, 64))
    with pytest.warns(UserWarning, match="no layer converted.*1 plain nn.Linear"):
        ulbtorch.quantize_(model, bits=2, include=["nothing.*"])
    assert type(model[0]) is torch.nn.Linear


def test_quantize_twice_says_the_model_is_quantized_already():
    model = ulbtorch.quantize_(torch.nn.Sequential(torch.nn.Linear(64, 64)), bits=2)
    with pytest.warns(UserWarning, match=r"quantized already \(1 low-bit layers: int2_sym \(group size 0\)\); "
                                         "quantize_ converts float layers only"):
        ulbtorch.quantize_(model, bits=4)
    assert isinstance(model[0], Linear2Bit)


def test_quantize_that_fails_at_one_layer_changes_no_layer():
    """A layer that cannot be packed (too wide) left the layers before it
    converted and the rest float."""
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64), torch.nn.Linear(65600, 4))
    with pytest.raises(ValueError, match="layer '2': in_features=65600"):
        ulbtorch.quantize_(model, bits=2)
    assert [type(m) for m in model] == [torch.nn.Linear] * 3


def test_quantize_of_a_model_on_meta_says_so():
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
    with pytest.raises(ValueError, match=r"2 of the 2 selected weights are on the meta device .*'0': load the float "
                                         "weights first") as e:
        ulbtorch.quantize_(model, bits=2)
    assert "exclude" not in str(e.value) and type(model[0]) is torch.nn.Linear


def test_quantize_names_the_linear_subclasses_it_leaves_in_float():
    """Subclasses of nn.Linear are never converted (MultiheadAttention reads
    its out_proj's weight without calling it); they were skipped silently."""
    class LoRALinear(torch.nn.Linear):
        pass

    model = torch.nn.Sequential(torch.nn.Linear(64, 64), LoRALinear(64, 64), torch.nn.MultiheadAttention(64, 2))
    with pytest.warns(UserWarning, match=r"nn.Linear subclasses stay in float.*: .*LoRALinear: 1 \(1\); "
                                         r"NonDynamicallyQuantizableLinear: 2.out_proj \(1\)"):
        ulbtorch.quantize_(model, bits=2)
    assert isinstance(model[0], Linear2Bit) and type(model[1]) is LoRALinear
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ulbtorch.quantize_(torch.nn.Sequential(torch.nn.Linear(64, 64), LoRALinear(64, 64)), bits=2, exclude=["1"])


def test_lm_head_bits_errors():
    # lm_head_bits is for layers include/exclude leave out, and takes the values bits takes.
    with pytest.raises(ValueError, match="is for an lm_head that include/exclude leave out"):
        ulbtorch.quantize_(tiny_llama(), bits=2, exclude=[], lm_head_bits=8)
    # An output layer by another name (get_output_embeddings) is the head too; the
    # default exclude does not cover it, so the clash is named.
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.body, self.output = nn.Linear(16, 16), nn.Linear(16, 32)

        def get_output_embeddings(self):
            return self.output

    with pytest.raises(ValueError, match=r"already select \['output'\]"):
        ulbtorch.quantize_(Net(), bits=2, lm_head_bits=8)
    net = ulbtorch.quantize_(Net(), bits=2, exclude=["output", "lm_head"], lm_head_bits=8)
    assert type(net.output) is Linear8Bit and type(net.body) is Linear2Bit
    seq = nn.Sequential()
    seq.add_module("body", nn.Linear(16, 16))
    seq.add_module("output", nn.Linear(16, 16))
    with pytest.raises(ValueError, match="no plain linear layer named lm_head"):
        ulbtorch.quantize_(seq, bits=2, lm_head_bits=8)
    with pytest.raises(ValueError, match="bits must be"):
        ulbtorch.QuantConfig(lm_head_bits=3)
    with pytest.raises(ValueError, match="lm_head_group_size=32 needs lm_head_bits"):
        ulbtorch.QuantConfig(lm_head_group_size=32)
    with pytest.raises(ValueError, match="lm_head_group_size=12: group_size must be 0 or a multiple of 8"):
        ulbtorch.QuantConfig(lm_head_bits=4, lm_head_group_size=12)

"""Inputs that gave an error naming something else (a Hub repo id, .item()
on meta) or none at all (1-bit from bits=True, a complex weight cut to its
real part) now give one that names the problem."""
import json

import pytest
import torch
from torch import nn

import ulbtorch
from ulbtorch.importers import convert_grid_linears, load_bitnet_checkpoint, pack_grid_weight
from ulbtorch.quantizers import quantize_weight


def test_a_complex_weight_is_refused_not_cut_to_its_real_part():
    lin = nn.Linear(64, 8)
    lin.weight = nn.Parameter(torch.randn(8, 64, dtype=torch.complex64), requires_grad=False)
    with pytest.raises(TypeError, match="weight must hold real numbers, got torch.complex64"):
        ulbtorch.nn.Linear2Bit.from_linear(lin)
    with pytest.raises(ValueError, match="weight is on the meta device"):
        quantize_weight(torch.empty(8, 64, device="meta"), "int2_sym")


def test_convert_grid_linears_refuses_bits_true_and_meta_weights():
    """bits=True was taken as 1-bit (True == 1) while quantize_ refuses it;
    meta weights failed inside .item()."""
    model = nn.Sequential(nn.Linear(8, 4, bias=False))
    with torch.no_grad():
        model[0].weight.copy_(torch.tensor([1.0, -1.0]).repeat(16).reshape(4, 8))
    with pytest.raises(ValueError, match="bits must be 1, 'ternary'/1.58 or 2, got True"):
        convert_grid_linears(model, True)
    with pytest.raises(ValueError, match="bits must be .* got True"):
        pack_grid_weight(model[0].weight, True)
    assert type(model[0]) is nn.Linear
    with pytest.raises(ValueError, match=r"1 of the 1 selected layers have their weight on the meta device .* '0'"):
        convert_grid_linears(nn.Sequential(nn.Linear(8, 4, device="meta")), 1)
    with pytest.raises(ValueError, match="w is on the meta device"):
        pack_grid_weight(torch.empty(4, 8, device="meta"), 1, "w")
    assert type(convert_grid_linears(model, 1)[0]) is ulbtorch.nn.Linear1Bit


def test_load_bitnet_checkpoint_of_a_missing_directory_names_it(tmp_path):
    """It gave transformers' "Repo id must be in the form 'repo_name'"."""
    pytest.importorskip("transformers")
    with pytest.raises(FileNotFoundError, match=r"/nonexistent/config.json not found: load_bitnet_checkpoint reads a "
                                                "local checkpoint directory"):
        load_bitnet_checkpoint("/nonexistent")


@pytest.mark.parametrize("qc,match", [
    (None, r"config.json: key 'quantization_config': expected an object with quant_method 'bitnet', got None"),
    ({"quant_method": "gptq"}, r"config.json: key 'quantization_config.quant_method': expected 'bitnet', got 'gptq'"),
    ({"quant_method": "bitnet", "linear_class": "x"},
     r"config.json: key 'quantization_config.linear_class': expected one of \('bitlinear', 'autobitlinear'\), "
     "got 'x'"),
    ({"quant_method": "bitnet", "modules_to_not_convert": "lm_head"},
     r"config.json: key 'quantization_config.modules_to_not_convert': expected a list of module names, got 'lm_head'"),
])
def test_a_bad_bitnet_config_names_the_file_and_the_key(tmp_path, qc, match):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
                                   num_key_value_heads=1, vocab_size=100).to_dict()
    if qc is not None:
        cfg["quantization_config"] = qc
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=match):
        load_bitnet_checkpoint(str(tmp_path))


@pytest.mark.parametrize("index,match", [
    ("[]", r"model.safetensors.index.json: expected a JSON object with key 'weight_map'"),
    ('{"weight_map": ["a"]}', r"model.safetensors.index.json: key 'weight_map': expected an object of tensor name "
                              r"-> file name, got \['a'\]"),
])
def test_a_bad_shard_index_names_the_file_and_the_key(tmp_path, index, match):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
                                   num_key_value_heads=1, vocab_size=100).to_dict()
    cfg["quantization_config"] = {"quant_method": "bitnet"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "model.safetensors.index.json").write_text(index)
    with pytest.raises(ValueError, match=match):
        load_bitnet_checkpoint(str(tmp_path))

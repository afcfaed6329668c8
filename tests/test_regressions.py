"""Regressions found in review."""
import pytest
import torch
from torch import nn

import ulbtorch
from ulbtorch.nn import Linear2Bit


def test_group_wider_than_a_layer_gives_that_layer_per_channel_scales():
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 32))
    ulbtorch.quantize_(model, bits=2, group_size=128, exclude=[])
    assert (model[0].group_size, model[0].granularity) == (0, "channel")
    assert (model[2].group_size, model[2].granularity) == (128, "group")
    assert model(torch.randn(3, 64)).shape == (3, 32)


def test_reference_path_sees_repacked_weights():
    layer = Linear2Bit.from_linear(nn.Linear(64, 16))
    layer.force_reference = True
    x = torch.randn(2, 64)
    before = layer(x)
    other = Linear2Bit.from_linear(nn.Linear(64, 16))
    layer.packed.copy_(other.packed)  # in place: same tensor, new version
    expect = ulbtorch.ops.reference_linear(x, other.dequantize(), layer.bias)
    torch.testing.assert_close(layer(x), expect, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(layer(x), before)


def test_load_quantized_requires_an_untied_lm_head(tmp_path):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, vocab_size=100,
                                   tie_word_embeddings=False)
    model = ulbtorch.quantize_(transformers.AutoModelForCausalLM.from_config(cfg), bits=2)
    ulbtorch.save_quantized(model, tmp_path)
    from safetensors.torch import load_file, save_file
    state = load_file(tmp_path / "model.safetensors")
    del state["lm_head.weight"]
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="lm_head.weight"):
        ulbtorch.load_quantized(transformers.AutoModelForCausalLM.from_config(cfg), tmp_path)

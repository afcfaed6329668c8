"""ulbtorch.save_quantized / load_quantized: a bad checkpoint is a clear error
and leaves the model as it was."""
import warnings

import pytest
import torch

import ulbtorch

M, K = 8, 64


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


# ---- bad input ------------------------------------------------------------------------------------

def test_load_quantized_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a directory written by ulbtorch.save_quantized"):
        ulbtorch.load_quantized(torch.nn.Sequential(torch.nn.Linear(K, M)), str(tmp_path))
    with pytest.raises(ValueError, match="no ulbtorch low-bit layers"):
        ulbtorch.save_quantized(torch.nn.Sequential(torch.nn.Linear(K, M)), str(tmp_path))
    model = ulbtorch.quantize_(torch.nn.Sequential(torch.nn.Linear(K, M)), bits=2)
    ulbtorch.save_quantized(model, str(tmp_path))
    with pytest.raises(ValueError, match=r"is 32->8 in the model but 64->8 in the checkpoint"):
        ulbtorch.load_quantized(torch.nn.Sequential(torch.nn.Linear(32, M)), str(tmp_path))


def _saved_mlp(tmp_path):
    def mk():
        return torch.nn.Sequential(torch.nn.Linear(K, K), torch.nn.ReLU(), torch.nn.Linear(K, M))
    ulbtorch.save_quantized(ulbtorch.quantize_(mk(), bits=2, hugepages=False), str(tmp_path))
    return mk


@pytest.mark.parametrize("damage", ["header", "bias"])
def test_load_quantized_with_a_bad_tensor_leaves_the_model_as_it_was(tmp_path, damage):
    from safetensors.torch import load_file, save_file
    mk = _saved_mlp(tmp_path)
    path = str(tmp_path / "model.safetensors")
    sd = load_file(path)
    if damage == "header":
        blob = sd["2.packed"].clone()
        blob[8] ^= 0xFF
        sd["2.packed"] = blob
    else:
        sd["2.bias"] = torch.zeros(M - 1)
    save_file(sd, path)
    model = mk()
    with pytest.raises(ValueError, match="layer '2'"):
        ulbtorch.load_quantized(model, str(tmp_path), hugepages=False)
    assert [type(m) for m in model] == [torch.nn.Linear, torch.nn.ReLU, torch.nn.Linear]


def test_load_quantized_into_a_float32_model_warns_of_the_bf16_gemv(tmp_path):
    """The manifest's bf16_gemv layers need bf16 weights: a float32 model kept
    lm_head on F.linear, with other logits, and said nothing."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=512)
    model = ulbtorch.quantize_(transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16), bits=2)
    ulbtorch.save_quantized(model, str(tmp_path))
    with pytest.warns(UserWarning, match=r"load_quantized: lm_head \(float32\) left on F.linear: .*"
                                         r"build the model with dtype=torch.bfloat16"):
        # (from_config(cfg) with no dtype would be bf16 too: the first call set cfg.dtype)
        loaded = ulbtorch.load_quantized(transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32),
                                         str(tmp_path))
    assert type(loaded.lm_head) is torch.nn.Linear  # behaviour unchanged: only the warning is new
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="load_quantized")  # a bf16 model: no warning
        loaded = ulbtorch.load_quantized(transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16),
                                         str(tmp_path))
    assert type(loaded.lm_head) is ulbtorch.LinearBF16

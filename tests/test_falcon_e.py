"""BitNet checkpoints with a norm in each layer (Falcon-E: linear_class
"autobitlinear", use_rms_norm) and with the ternary values stored unpacked:
ulbtorch's layers against transformers' own AutoBitLinear layers."""
import json

import pytest
import torch
from safetensors.torch import save_file

transformers = pytest.importorskip("transformers")
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM  # noqa: E402
from transformers.integrations.bitnet import AutoBitLinear, pack_weights  # noqa: E402

from ulbtorch.importers import convert_bitnet_model, load_bitnet_checkpoint  # noqa: E402
from ulbtorch.importers.bitnet_norm import NormedLinearTernary  # noqa: E402
from ulbtorch.nn import LowBitLinear  # noqa: E402

CFG = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2, vocab_size=300, tie_word_embeddings=False)
EPS = 1e-5


@pytest.fixture(autouse=True)
def eager_bitnet(monkeypatch):
    # transformers' BitNet layers torch.compile their activation rounding: eager here, in seconds
    monkeypatch.setattr(torch._dynamo.config, "disable", True)


def falcon_e_checkpoint(path, packed=True, norm=True, bias=False, seed=0):
    """A Falcon-E-style checkpoint: AutoBitLinear offline weights (packed
    uint8, or the ternary values in bf16) with a weight_scale and, with
    norm, an RMSNorm weight per layer; with bias, biases too (which
    AutoBitLinear scales with its output)."""
    torch.manual_seed(seed)
    cfg = dict(CFG, attention_bias=bias, mlp_bias=bias)
    model = LlamaForCausalLM(LlamaConfig(**cfg))
    state = {}
    for name, t in model.state_dict().items():
        module = name.rsplit(".", 1)[0]
        if name.endswith(".weight") and ("self_attn" in name or "mlp" in name):
            tern = torch.randint(-1, 2, t.shape).float()
            state[name] = pack_weights(tern.clone()) if packed else tern.to(torch.bfloat16)
            state[module + ".weight_scale"] = (torch.rand(1) + 0.5).to(torch.bfloat16)
            if norm:
                state[module + ".rms_norm.weight"] = (1 + 0.2 * torch.randn(t.shape[1])).to(torch.bfloat16)
        else:
            state[name] = (t if t.dim() > 1 else 1 + 0.1 * torch.randn_like(t)).to(torch.bfloat16).contiguous()
    path.mkdir(exist_ok=True)
    save_file(state, str(path / "model.safetensors"))
    cfg = LlamaConfig(**cfg).to_dict()
    cfg["quantization_config"] = {"quant_method": "bitnet", "linear_class": "autobitlinear",
                                  "quantization_mode": "offline", "use_rms_norm": norm, "rms_norm_eps": EPS}
    (path / "config.json").write_text(json.dumps(cfg))
    return state


def transformers_bitnet(path):
    # (asked for float32, transformers 5.24 leaves the norms in the checkpoint's bf16, and its own forward then
    # multiplies bf16 by float32 activations: the model is made float32 throughout)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return torch.nn.Module.float(model).eval()  # (transformers refuses .float() on a quantized model)


def ids():
    return torch.randint(0, CFG["vocab_size"], (2, 6), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "unpacked with biases"])
def test_falcon_e_layers_match_transformers(tmp_path, packed):
    falcon_e_checkpoint(tmp_path, packed=packed, bias=not packed)
    with pytest.warns(UserWarning, match="hold an RMSNorm each"):
        ours = load_bitnet_checkpoint(str(tmp_path), dtype=torch.float32)
    theirs = transformers_bitnet(tmp_path)
    mine = {n: m for n, m in ours.named_modules() if isinstance(m, LowBitLinear)}
    reference = {n: m for n, m in theirs.named_modules() if isinstance(m, AutoBitLinear)}
    assert set(mine) == set(reference) and len(mine) == 14
    for name, layer in mine.items():
        assert isinstance(layer, NormedLinearTernary) and layer.rms_norm.variance_epsilon == EPS
        ref = reference[name]
        assert torch.equal(layer.rms_norm.weight, ref.rms_norm.weight)
        assert torch.equal(layer.dequantize(), ref.weight * ref.weight_scale)
        xi = torch.randn(3, 5, layer.in_features)
        want = ref(xi)
        torch.testing.assert_close(layer(xi), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    with torch.no_grad():
        got, want = ours(ids()).logits, theirs(ids()).logits
    # Each layer agrees to rounding, but activations are rounded to int8 at every layer, so a last-bit difference
    # can move one input by a quantisation step downstream (the bound of _tiny_llama.check_kernels_equal_reference).
    diff, scale = (got - want).abs(), want.abs().max()
    assert diff.max() <= 2e-2 * scale and diff.mean() <= 2e-3 * scale, (diff.max(), diff.mean(), scale)


def test_convert_bitnet_model_with_norms_is_load_bitnet_checkpoint(tmp_path):
    falcon_e_checkpoint(tmp_path)
    with pytest.warns(UserWarning, match="hold an RMSNorm each"):
        loaded = load_bitnet_checkpoint(str(tmp_path), dtype=torch.float32)
    with pytest.warns(UserWarning, match="hold an RMSNorm each"):
        converted = convert_bitnet_model(transformers_bitnet(tmp_path))
    # BitNet's config is gone: from_pretrained would build its layers around our buffers
    assert getattr(converted.config, "quantization_config", None) is None
    a = dict(loaded.named_modules())
    for name, m in converted.named_modules():
        if isinstance(m, LowBitLinear):
            assert type(m) is NormedLinearTernary
            assert torch.equal(m.dequantize(), a[name].dequantize()), name
            assert torch.equal(m.rms_norm.weight, a[name].rms_norm.weight), name
    with torch.no_grad():
        assert torch.equal(converted(ids()).logits, loaded(ids()).logits)


def test_unpacked_weights_without_norms_save_through_transformers(tmp_path):
    falcon_e_checkpoint(tmp_path / "src", packed=False, norm=False)
    model = load_bitnet_checkpoint(str(tmp_path / "src"), dtype=torch.bfloat16)
    assert all(type(m).__name__ == "LinearTernary" for m in model.modules() if isinstance(m, LowBitLinear))
    with torch.no_grad():
        logits = model(ids()).logits
    model.save_pretrained(tmp_path / "saved")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "saved", dtype=torch.bfloat16).eval()
    with torch.no_grad():
        assert torch.equal(again(ids()).logits, logits)


def test_bad_norm_checkpoints_are_named(tmp_path):
    state = falcon_e_checkpoint(tmp_path)
    del state["model.layers.1.mlp.up_proj.rms_norm.weight"]
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"up_proj\.weight has no model\.layers\.1\.mlp\.up_proj\.rms_norm\.weight, "
                                         "and the config says use_rms_norm"):
        load_bitnet_checkpoint(str(tmp_path))
    state["model.layers.1.mlp.up_proj.rms_norm.weight"] = torch.ones(7)
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"up_proj\.rms_norm\.weight: the RMSNorm weight must be a float tensor of "
                                         r"shape \(128,\)"):
        load_bitnet_checkpoint(str(tmp_path))
    state["model.layers.1.mlp.up_proj.rms_norm.weight"] = torch.ones(128)
    state["model.layers.0.self_attn.q_proj.weight"] = torch.full((128, 128), 2.0, dtype=torch.bfloat16)
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"q_proj\.weight: 2\.0 at row 0, column 0 is not a ternary value"):
        load_bitnet_checkpoint(str(tmp_path))

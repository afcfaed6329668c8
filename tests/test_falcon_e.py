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
from ulbtorch.nn.normed import NormedLinearTernary  # noqa: E402
from ulbtorch.nn import LinearTernary, LowBitLinear  # noqa: E402

CFG = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2, vocab_size=300, tie_word_embeddings=False)
EPS = 1e-5


@pytest.fixture(autouse=True)
def eager_bitnet():
    # transformers' BitNet layers torch.compile their activation rounding: eager here, in seconds.
    # (torch's config.patch, not monkeypatch: pytest 9.2's undo deletes the setting, which hides it.)
    with torch._dynamo.config.patch(disable=True):
        yield


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
    loaded = load_bitnet_checkpoint(str(tmp_path), dtype=torch.float32)
    converted = convert_bitnet_model(transformers_bitnet(tmp_path))
    # BitNet's config is ulbtorch's now, norms included: from_pretrained builds our layers again
    for model in (loaded, converted):
        qc = model.config.quantization_config
        assert (qc.quant_method, qc.format, qc.granularity, qc.input_norm_eps) == ("ulb", "ternary", "tensor", EPS)
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


def _normed_layers(model):
    layers = {n: m for n, m in model.named_modules() if isinstance(m, LowBitLinear)}
    assert len(layers) == 14 and all(type(m) is NormedLinearTernary for m in layers.values())
    return layers


def _same_layers(a, b):
    la, lb = _normed_layers(a), _normed_layers(b)
    assert set(la) == set(lb)
    for name, m in la.items():
        assert torch.equal(m.dequantize(), lb[name].dequantize()), name
        assert torch.equal(m.rms_norm.weight, lb[name].rms_norm.weight), name
        assert m.rms_norm.variance_epsilon == lb[name].rms_norm.variance_epsilon == EPS, name
        assert (m.bias is None) == (lb[name].bias is None) and (m.bias is None or torch.equal(m.bias, lb[name].bias))


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "unpacked with biases"])
@pytest.mark.parametrize("convert", [False, True], ids=["load_bitnet_checkpoint", "convert_bitnet_model"])
def test_norms_survive_save_pretrained_and_from_pretrained(tmp_path, packed, convert):
    """Both importers record UlbConfig(input_norm_eps=...): save_pretrained
    writes each layer's rms_norm.weight beside its packed blob and
    from_pretrained builds NormedLinearTernary layers around them again."""
    falcon_e_checkpoint(tmp_path / "src", packed=packed, bias=not packed)
    if convert:
        model = convert_bitnet_model(transformers_bitnet(tmp_path / "src"))
    else:
        model = load_bitnet_checkpoint(str(tmp_path / "src"), dtype=torch.float32)
    with torch.no_grad():
        logits = model(ids()).logits
    model.save_pretrained(tmp_path / "saved")
    saved = json.loads((tmp_path / "saved" / "config.json").read_text())["quantization_config"]
    assert saved["quant_method"] == "ulb" and saved["input_norm_eps"] == EPS
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "saved", dtype=torch.float32).eval()
    _same_layers(again, model)
    with torch.no_grad():
        assert torch.equal(again(ids()).logits, logits)


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "unpacked with biases"])
def test_norms_survive_save_quantized_and_load_quantized(tmp_path, packed):
    import ulbtorch

    falcon_e_checkpoint(tmp_path / "src", packed=packed, bias=not packed)
    model = load_bitnet_checkpoint(str(tmp_path / "src"), dtype=torch.float32)
    with torch.no_grad():
        logits = model(ids()).logits
    ulbtorch.save_quantized(model, tmp_path / "q")
    manifest = json.loads((tmp_path / "q" / "ulbtorch.json").read_text())["layers"]
    assert {spec["input_norm_eps"] for spec in manifest.values()} == {EPS} and len(manifest) == 14
    float_model = LlamaForCausalLM(LlamaConfig(**dict(CFG, attention_bias=not packed, mlp_bias=not packed)))
    again = ulbtorch.load_quantized(float_model, tmp_path / "q").eval()
    _same_layers(again, model)
    with torch.no_grad():
        assert torch.equal(again(ids()).logits, logits)


def test_a_manifest_norm_that_does_not_fit_is_refused(tmp_path):
    import ulbtorch
    from safetensors import safe_open

    falcon_e_checkpoint(tmp_path / "src")
    ulbtorch.save_quantized(load_bitnet_checkpoint(str(tmp_path / "src")), tmp_path / "q")
    path = tmp_path / "q" / "ulbtorch.json"
    text = path.read_text()
    with safe_open(str(tmp_path / "q" / "model.safetensors"), "pt") as f:
        weights = {k: f.get_tensor(k) for k in f.keys()}
    path.write_text(text.replace(f'"input_norm_eps": {EPS}', '"input_norm_eps": "small"', 1))
    with pytest.raises(ValueError, match=r"ulbtorch\.json: layer '[^']+': key 'input_norm_eps': expected a number "
                                         r">= 0 \(the eps of the layer's input RMSNorm\), got 'small'"):
        ulbtorch.load_quantized(LlamaForCausalLM(LlamaConfig(**CFG)), tmp_path / "q")
    path.write_text(text)
    del weights["model.layers.0.mlp.up_proj.rms_norm.weight"]
    save_file(weights, str(tmp_path / "q" / "model.safetensors"))
    # (the weights file's own copy of the manifest is read now: its save_id no longer matches)
    with pytest.raises(ValueError, match=r"layer 'model\.layers\.0\.mlp\.up_proj': .*model\.safetensors has no "
                                         r"model\.layers\.0\.mlp\.up_proj\.rms_norm\.weight"):
        ulbtorch.load_quantized(LlamaForCausalLM(LlamaConfig(**CFG)), tmp_path / "q")


def test_input_norm_eps_describes_packed_ternary_checkpoints_only(tmp_path):
    from ulbtorch.integrations.transformers import UlbConfig

    with pytest.raises(ValueError, match="input_norm_eps is for ternary layers .* the format is 'int4'"):
        UlbConfig(bits=4, input_norm_eps=1e-5)
    with pytest.raises(ValueError, match="input_norm_eps: the input RMSNorm's eps must be a number >= 0, got -1"):
        UlbConfig(format="ternary", input_norm_eps=-1)
    assert "input_norm_eps" not in UlbConfig(format="ternary").to_dict()  # as before: older readers read it
    LlamaForCausalLM(LlamaConfig(**CFG)).save_pretrained(tmp_path / "float")
    with pytest.raises(ValueError, match="input_norm_eps=1e-05 describes a packed checkpoint .* a float checkpoint "
                                         "has none to load"):
        AutoModelForCausalLM.from_pretrained(tmp_path / "float", quantization_config=UlbConfig(
            format="ternary", granularity="tensor", input_norm_eps=1e-5))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_rounds_as_transformers_does(dtype):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from ulbtorch.nn.normed import rms_norm

    norm = LlamaRMSNorm(96, eps=EPS).to(dtype)
    norm.weight.data = (1 + 0.3 * torch.randn(96)).to(dtype)
    x = (3 * torch.randn(4, 7, 96)).to(dtype)
    with torch.no_grad():
        assert torch.equal(rms_norm(x, norm.weight, EPS), norm(x))


def test_vllm_runs_each_shards_norm(monkeypatch):
    """vLLM merges q/k/v (and gate/up) into one layer, but each has its own
    norm: the method keeps a blob per shard and runs it on its own norm's
    output, which must give the three NormedLinearTernary layers' outputs."""
    pytest.importorskip("vllm")
    from ulbtorch.integrations import vllm as plugin
    from ulbtorch.integrations import vllm_linear
    from ulbtorch.integrations.vllm_norm import UlbNormedLinearMethod

    monkeypatch.setattr(vllm_linear, "get_tensor_model_parallel_rank", lambda: 0)
    monkeypatch.setattr(vllm_linear, "get_tensor_model_parallel_world_size", lambda: 1)
    cfg = plugin.UlbVllmConfig.from_config({"format": "ternary", "granularity": "tensor", "input_norm_eps": EPS})
    cfg.packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}
    method = cfg.get_quant_method(plugin.LinearBase.__new__(plugin.LinearBase), "model.layers.0.self_attn.qkv_proj")
    assert type(method) is UlbNormedLinearMethod and method.eps == EPS
    g = torch.Generator().manual_seed(0)
    K, sizes = 64, (64, 32, 32)
    refs = []
    for rows in sizes:
        plain = LinearTernary.from_codes(torch.randint(0, 3, (rows, K), generator=g, dtype=torch.uint8),
                                         (torch.rand(1, 1, generator=g) + 0.5).expand(rows, 1), format="ternary",
                                         granularity="tensor", bias=torch.randn(rows, generator=g))
        refs.append(NormedLinearTernary.from_layer(plain, 1 + 0.3 * torch.randn(K, generator=g), EPS))
    for one in (False, True):
        served = torch.nn.Module()
        served.prefix = "model.layers.0.self_attn." + ("o_proj" if one else "qkv_proj")
        shards = refs[:1] if one else refs
        method.create_weights(served, K, [r.out_features for r in shards], K, sum(sizes), torch.float32)
        for shard_id, ref in zip("qkv", shards):
            served.packed.weight_loader(served.packed, ref.packed, None if one else shard_id)
            norm = ref.rms_norm.weight.detach().clone()
            if not one:
                norm.shard_id = shard_id  # as vLLM's WeightsMapper hands it over
            served.rms_norm.weight.weight_loader(served.rms_norm.weight, norm)
        method.process_weights_after_loading(served)
        x = 3 * torch.randn(5, K, generator=g)
        bias = torch.cat([r.bias for r in shards])
        with torch.no_grad():
            assert torch.equal(method.apply(served, x, bias), torch.cat([r(x) for r in shards], dim=-1))
    with pytest.raises(ValueError, match="splits its input over tensor-parallel ranks, but its layers' input "
                                         "RMSNorms .* tensor_parallel_size=1"):
        method.create_weights(torch.nn.Module(), K // 2, [64], K, 64, torch.float32)


def test_save_gguf_refuses_the_norms_by_name(tmp_path):
    import ulbtorch

    falcon_e_checkpoint(tmp_path / "src")
    with pytest.raises(ValueError, match=r"save_gguf: layer 'model\.layers\.0\.self_attn\.q_proj' holds its own input "
                                         "RMSNorm .* save_pretrained or ulbtorch.save_quantized"):
        ulbtorch.save_gguf(load_bitnet_checkpoint(str(tmp_path / "src")), tmp_path / "x.gguf")
    assert not (tmp_path / "x.gguf").exists()

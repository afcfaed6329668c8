"""The experts of transformers' mixture-of-experts layers, packed
(ulbtorch.integrations.hf_experts): quantize_, the forward against the model's own,
one linear_many call per projection where it serves, saving and loading both ways."""
import copy
import io
import warnings

import pytest
import torch

pytest.importorskip("transformers")
import transformers  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

import ulbtorch  # noqa: E402
from ulbtorch import UlbConfig  # noqa: E402
from ulbtorch.nn import Linear2Bit, LowBitLinear  # noqa: E402
from ulbtorch.integrations.hf_experts import expert_linears, fused_weight_names, is_fused_experts, pack_experts  # noqa: E402

SMALL = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=300)
CONFIGS = {
    # experts x out x in, [gate; up] concatenated
    "mixtral": lambda: transformers.MixtralConfig(intermediate_size=128, num_local_experts=4, num_experts_per_tok=2,
                                                  **SMALL),
    # experts x in x out (transposed), biases, gate and up interleaved, its own clamped gate
    "gpt_oss": lambda: transformers.GptOssConfig(intermediate_size=128, head_dim=16, num_local_experts=4,
                                                 num_experts_per_tok=2, **SMALL),
    # a shared expert with a one-output nn.Linear gate beside the routed ones
    "qwen2_moe": lambda: transformers.Qwen2MoeConfig(intermediate_size=128, moe_intermediate_size=64,
                                                     shared_expert_intermediate_size=64, num_experts=4,
                                                     num_experts_per_tok=2, **SMALL),
    # shared experts (nn.Linear) beside the routed ones, a dense first layer
    "deepseek_v3": lambda: transformers.DeepseekV3Config(
        intermediate_size=128, moe_intermediate_size=64, n_routed_experts=4, num_experts_per_tok=2, n_group=1,
        topk_group=1, first_k_dense_replace=1, q_lora_rank=None, kv_lora_rank=32, qk_rope_head_dim=8,
        qk_nope_head_dim=8, v_head_dim=16, **SMALL),
}
DTYPES = [torch.float32, torch.bfloat16]
IDS = torch.randint(0, 300, (2, 7), generator=torch.Generator().manual_seed(0))


def _model(kind, dtype=torch.float32):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(CONFIGS[kind](), dtype=dtype).eval()


def _experts(model):
    return [m for m in model.modules() if hasattr(m, "packed_down_proj") or is_fused_experts(m)]


def _logits(model, ids=IDS):
    with torch.no_grad():
        return model(ids).logits


def _same_as_models_own(got, want):
    """Bit for bit in bf16. In fp32 the model's own experts and our per-expert
    F.linear calls reach different CPU matmul kernels, which round alike on a
    Xeon (torch 2.13) but not on Zen 5 or under torch 2.11: up to 1.5e-7
    apart on logits of 0.6. So fp32 passes within 4 ulps of the largest
    logit; a routing or weighting fault moves logits by ~0.1."""
    if got.dtype != torch.float32:
        return torch.equal(got, want)
    return bool((got - want).abs().max() <= 4 * torch.finfo(torch.float32).eps * want.abs().max())


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind", CONFIGS)
def test_forward_over_per_expert_layers_is_the_models_own(kind, dtype):
    """The packed forward, run over float nn.Linear copies of each expert's
    weights, gives the model's own experts forward bit for bit: routing,
    gating, the weighting and the sum are transformers'."""
    model = _model(kind, dtype)
    want, want_one = _logits(model), _logits(model, IDS[:1, :1])
    for m in _experts(model):
        pack_experts(m, {p: [copy.deepcopy(lin) for lin in expert_linears(m, p)] for p in fused_weight_names(m)})
    assert _same_as_models_own(_logits(model), want)
    assert _same_as_models_own(_logits(model, IDS[:1, :1]), want_one)  # one token, as in decode


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind", CONFIGS)
def test_quantize_packs_every_expert(kind, dtype):
    model = _model(kind, dtype)
    float_experts = [{p: [lin.weight.detach().clone() for lin in expert_linears(m, p)] for p in fused_weight_names(m)}
                     for m in _experts(model)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ulbtorch.quantize_(model, bits=2, group_size=32)
    assert not [n for n, p in model.named_parameters() if p.dim() == 3]
    for m, weights in zip(_experts(model), float_experts):
        for p, per_expert in weights.items():
            layers = getattr(m, f"packed_{p}")
            assert len(layers) == len(per_expert)
            for layer, w in zip(layers, per_expert):  # expert e's layer holds expert e's weight
                lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
                lin.weight.data = w
                assert torch.equal(layer.packed, Linear2Bit.from_linear(lin, group_size=32).packed)
    # the kernels against the pure-PyTorch reference of the same layers
    y = _logits(model)
    for layer in model.modules():
        if isinstance(layer, LowBitLinear):
            layer.force_reference = True
    torch.testing.assert_close(_logits(model).float(), y.float(), atol=1e-5 if dtype == torch.float32 else 1e-2,
                               rtol=0)


def test_quantized_experts_stay_close_to_float():
    model = _model("mixtral")
    want = _logits(model)
    got = _logits(ulbtorch.quantize_(model, bits=8))
    assert (got - want).abs().max() < 0.02 * want.abs().max()


def test_an_expert_weight_left_out_runs_in_float():
    """exclude may name one expert weight: it stays a 3-D float parameter
    and the forward reads it as the model's own would."""
    model = _model("gpt_oss")
    ulbtorch.quantize_(model, bits=2, exclude=["lm_head", "*.experts.down_proj"])
    m = _experts(model)[0]
    assert hasattr(m, "packed_gate_up_proj") and m.down_proj.dim() == 3 and m.down_proj_bias.dim() == 2
    want = copy.deepcopy(model)
    for e in _experts(want):
        pack_experts(e, {"down_proj": [copy.deepcopy(lin) for lin in expert_linears(e, "down_proj")]})
    assert torch.equal(_logits(model), _logits(want))


def test_expert_ids_past_the_experts_contribute_nothing():
    """Expert parallelism marks tokens routed elsewhere with id num_experts."""
    m = _experts(ulbtorch.quantize_(_model("mixtral"), bits=2))[0]
    x = torch.randn(3, 64)
    idx, w = torch.tensor([[0, 1], [2, 4], [4, 4]]), torch.rand(3, 2)
    y = m(x, idx, w)
    only = m(x, torch.tensor([[0, 1], [2, 0], [0, 0]]), w * torch.tensor([[1.0, 1.0], [1.0, 0.0], [0.0, 0.0]]))
    assert torch.equal(y, only) and torch.equal(y[2], torch.zeros(64))
    assert torch.equal(m(x[1:2], idx[1:2], w[1:2]), y[1:2])  # one token


@pytest.mark.parametrize("kind", ["mixtral", "gpt_oss"])
def test_save_quantized_and_save_pretrained_reload_bit_exact(kind, tmp_path):
    model = ulbtorch.quantize_(_model(kind, torch.bfloat16), bits=2, group_size=32)
    want = _logits(model)
    ulbtorch.save_quantized(model, tmp_path / "ulb")
    again = ulbtorch.load_quantized(_model(kind, torch.bfloat16), tmp_path / "ulb")
    assert torch.equal(_logits(again), want)
    # transformers' checkpoint conversions (per-expert w1/w2/w3 on disk for
    # Mixtral) leave the packed layers' names alone
    model.save_pretrained(tmp_path / "hf")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.bfloat16)
    assert hasattr(_experts(again)[0], "packed_gate_up_proj")
    assert torch.equal(_logits(again), want)


def test_quantize_on_load_through_ulbconfig_equals_quantize(tmp_path):
    _model("mixtral", torch.bfloat16).save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16,
                                                  quantization_config=UlbConfig(bits=2, group_size=32))
    assert hasattr(_experts(loaded)[0], "packed_down_proj")
    assert torch.equal(_logits(loaded), _logits(ulbtorch.quantize_(_model("mixtral", torch.bfloat16), bits=2,
                                                                   group_size=32)))


def test_load_quantized_refuses_a_checkpoint_missing_an_expert(tmp_path):
    import json
    ulbtorch.save_quantized(ulbtorch.quantize_(_model("mixtral"), bits=2), tmp_path)
    manifest = json.loads((tmp_path / "ulbtorch.json").read_text())
    del manifest["layers"]["model.layers.1.mlp.experts.packed_down_proj.2"]
    (tmp_path / "ulbtorch.json").write_text(json.dumps(manifest))
    model = _model("mixtral")
    with pytest.raises(ValueError, match=r"experts.down_proj holds 4 experts in the model, but the checkpoint "
                                         r"lists experts \[0, 1, 3\]"):
        ulbtorch.load_quantized(model, tmp_path)
    assert all(is_fused_experts(m) for m in _experts(model))  # unchanged


def test_packed_experts_deepcopy_pickle_and_compile():
    model = ulbtorch.quantize_(_model("mixtral"), bits=2)
    want = _logits(model)
    copied = copy.deepcopy(model)
    assert torch.equal(_logits(copied), want)
    assert _experts(copied)[0].forward.args[0] is _experts(copied)[0]  # bound to the copy, not the original
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    assert torch.equal(_logits(torch.load(buf, weights_only=False)), want)
    torch._dynamo.reset()
    torch.testing.assert_close(_logits(torch.compile(model)), want, atol=1e-5, rtol=0)


def test_experts_ulbtorch_cannot_run_are_named():
    """A MoE module with 3-D expert weights that is not one of transformers'
    experts modules stays float, and quantize_ says how much of the model
    that is."""
    class RoutedExperts(torch.nn.Module):  # LongCat's count is num_routed_experts
        def __init__(self):
            super().__init__()
            self.num_routed_experts = 4
            self.w = torch.nn.Parameter(torch.randn(4, 64, 64))

    model = torch.nn.Sequential(torch.nn.Linear(64, 64), RoutedExperts())
    with pytest.warns(UserWarning, match=r"1 3-D expert weights of mixture-of-experts layers stay in float \(80% "
                                         r"of the model's parameter bytes\), e.g. 1.w"):
        ulbtorch.quantize_(model, bits=2)


def test_routers_stay_float_and_save_pretrained_keeps_them():
    """Routers that are nn.Linear (HunYuan's gate.wg, reading its own
    .weight in forward: it crashed once 2-bit; Qwen2-MoE's one-output
    shared_expert_gate) stay float, also when reloaded."""
    model = _model("qwen2_moe", torch.bfloat16)
    ulbtorch.quantize_(model, bits=2, group_size=32)
    mlp = model.model.layers[0].mlp
    assert type(mlp.shared_expert_gate) is not Linear2Bit and isinstance(mlp.shared_expert.up_proj, Linear2Bit)
    assert "model.layers.0.mlp.shared_expert_gate" in model.config.quantization_config.modules_to_not_convert
    torch.manual_seed(0)
    hunyuan = AutoModelForCausalLM.from_config(transformers.HunYuanMoEV1Config(
        intermediate_size=128, moe_intermediate_size=64, num_experts=4, moe_topk=2, head_dim=16, **SMALL)).eval()
    ulbtorch.quantize_(hunyuan, bits=2)
    assert type(hunyuan.model.layers[0].mlp.gate.wg) is torch.nn.Linear
    _logits(hunyuan)


def test_router_rule_in_isolation():
    from ulbtorch.integrations.hf_experts import router_names
    model = _model("qwen2_moe")
    assert router_names(model) == [f"model.layers.{i}.mlp.shared_expert_gate" for i in range(2)]


def test_include_patterns_that_leave_the_experts_float_save_through_transformers(tmp_path):
    """The experts an include pattern leaves out are recorded in
    modules_to_not_convert: no UlbConfig described the model before, and
    save_pretrained reloaded it float."""
    model = ulbtorch.quantize_(_model("mixtral", torch.bfloat16), bits=2, group_size=32, include=["*.self_attn.*"])
    assert is_fused_experts(_experts(model)[0])
    want = _logits(model)
    model.save_pretrained(tmp_path)
    again = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert isinstance(again.model.layers[0].self_attn.q_proj, Linear2Bit) and is_fused_experts(_experts(again)[0])
    assert torch.equal(_logits(again), want)


def test_no_tokens():
    m = _experts(ulbtorch.quantize_(_model("mixtral"), bits=2))[0]
    y = m(torch.empty(0, 64), torch.empty(0, 2, dtype=torch.long), torch.empty(0, 2))
    assert y.shape == (0, 64)


def test_router_rule_skips_a_shared_expert_as_wide_as_the_experts_are_many():
    """Qwen3-Next-80B's shared expert is 512 wide with 512 experts: its
    gate_proj and up_proj were taken for routers and left float."""
    from ulbtorch.integrations.hf_experts import router_names
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(transformers.Qwen2MoeConfig(
        intermediate_size=128, moe_intermediate_size=64, shared_expert_intermediate_size=4, num_experts=4,
        num_experts_per_tok=2, **SMALL))
    assert router_names(model) == [f"model.layers.{i}.mlp.shared_expert_gate" for i in range(2)]
    ulbtorch.quantize_(model, bits=2)
    assert isinstance(model.model.layers[0].mlp.shared_expert.up_proj, Linear2Bit)


def test_quantize_of_an_experts_module_alone_records_nothing_in_the_models_config():
    """transformers' experts modules hold the model's config: quantize_ of
    one of them recorded a UlbConfig for the whole model, whose checkpoint
    then failed to load."""
    model = _model("mixtral")
    ulbtorch.quantize_(model.model.layers[0].mlp.experts, bits=2)
    assert hasattr(model.model.layers[0].mlp.experts, "packed_down_proj")
    assert getattr(model.config, "quantization_config", None) is None


def test_load_quantized_checks_the_weights_file_before_changing_the_model(tmp_path):
    """A manifest whose bias flag disagrees with the weights file, or a model
    with layers packed that the file holds in float, failed after the swaps,
    leaving the model half changed."""
    import json
    ulbtorch.save_quantized(ulbtorch.quantize_(_model("gpt_oss"), bits=2), tmp_path)
    manifest = json.loads((tmp_path / "ulbtorch.json").read_text())
    manifest["layers"]["model.layers.0.mlp.experts.packed_down_proj.1"]["bias"] = False
    (tmp_path / "ulbtorch.json").write_text(json.dumps(manifest))
    model = _model("gpt_oss")
    with pytest.raises(ValueError, match=r"layer 'model.layers.0.mlp.experts.packed_down_proj.1' has no bias in "
                                         "the manifest but .* holds"):
        ulbtorch.load_quantized(model, tmp_path)
    assert all(is_fused_experts(m) for m in _experts(model))
    ulbtorch.save_quantized(ulbtorch.quantize_(_model("mixtral"), bits=2, exclude=["lm_head", "*.down_proj"]),
                            tmp_path / "half")
    model = ulbtorch.quantize_(_model("mixtral"), bits=2)  # every expert packed, down_proj too
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"has no model.layers.0.mlp.experts.packed_down_proj.0.packed"):
        ulbtorch.load_quantized(model, tmp_path / "half")
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


# ---- one linear_many call per projection -------------------------------------------------------

def _moe(dtype, biases):
    torch.manual_seed(0)
    small = dict(hidden_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, vocab_size=300,
                 intermediate_size=128, num_local_experts=8, num_experts_per_tok=4)
    cfg = transformers.GptOssConfig(head_dim=16, **small) if biases else transformers.MixtralConfig(**small)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
    return ulbtorch.quantize_(model, bits=2, group_size=32)


def _count_calls(monkeypatch):
    calls = []
    real = torch.ops.ulb.linear_many

    class Counting:
        def __call__(self, *args):
            calls.append(len(args[1]))
            return real(*args)

    monkeypatch.setattr(torch.ops.ulb, "linear_many", Counting())
    return calls


@pytest.mark.parametrize("biases", [False, True], ids=["mixtral", "gpt_oss"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_experts_run_in_two_calls_with_the_per_layer_bits(monkeypatch, dtype, biases):
    """Each experts forward makes one call for the up (and gate) projections
    and one for the down ones, and gives the bits of calling each expert's
    layers (their own forward, the reference of this test)."""
    model = _moe(dtype, biases)
    ids = torch.randint(0, 300, (2, 6), generator=torch.Generator().manual_seed(1))
    calls = _count_calls(monkeypatch)
    with torch.no_grad():
        got, got_one = model(ids).logits, model(ids[:1, :1]).logits
    assert calls and all(n >= 1 for n in calls) and len(calls) == 4  # two calls a forward, two forwards
    assert calls[2:] == [4, 4]  # one token: its four experts in one call each way
    monkeypatch.setattr("ulbtorch.integrations.hf_experts._one_call_serves", lambda layers, xs: False)
    with torch.no_grad():
        want, want_one = model(ids).logits, model(ids[:1, :1]).logits
    assert len(calls) == 4
    assert torch.equal(got, want) and torch.equal(got_one, want_one)


def test_experts_take_each_layers_call_where_one_call_would_not_serve(monkeypatch):
    """With autograd recording, under autocast, or with a layer on its
    pure-PyTorch reference, the experts call each layer as before."""
    model = _moe(torch.float32, False)
    ids = torch.randint(0, 300, (1, 3), generator=torch.Generator().manual_seed(2))
    calls = _count_calls(monkeypatch)
    model(ids).logits.sum().backward()  # the embedding's grad flows through the experts
    assert model.model.embed_tokens.weight.grad is not None
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        model(ids)
    assert calls == []
    experts = next(m for m in model.modules() if hasattr(m, "packed_down_proj"))
    for layer in experts.packed_down_proj:
        layer.force_reference = True
    with torch.no_grad():
        model(ids)
    assert len(calls) == 1  # the up projections only


def test_experts_keep_each_layers_call_where_it_does_more_than_forward(monkeypatch):
    """Hooks on a layer or global ones (accelerate's offload puts weights back
    in one), a forward replaced on the instance, a layer wrapped in another
    module, forward-mode AD and torch.func transforms: each layer's own call
    runs, with what it carries, and gives the per-layer bits."""
    import torch.autograd.forward_ad as fwAD

    model = _moe(torch.float32, False)
    experts = next(m for m in model.modules() if hasattr(m, "packed_down_proj"))
    g = torch.Generator().manual_seed(3)
    h, t = torch.randn(3, 64, generator=g), torch.randn(3, 64, generator=g)
    idx, w = torch.tensor([[0, 1, 2, 3], [1, 4, 5, 6], [7, 0, 2, 5]]), torch.rand(3, 4, generator=g)
    with torch.no_grad():
        want = experts(h, idx, w)
    calls = _count_calls(monkeypatch)
    seen = []

    def per_layer():
        with torch.no_grad():
            assert torch.equal(experts(h, idx, w), want)

    layer = experts.packed_down_proj[1]
    for register in (layer.register_forward_hook, layer.register_forward_pre_hook):
        handle = register(lambda *a: seen.append(1))
        per_layer()
        handle.remove()
    handle = torch.nn.modules.module.register_module_forward_hook(lambda m, *a: seen.append(1) if m is layer else None)
    per_layer()
    handle.remove()
    layer.forward = lambda x: (seen.append(1), type(layer).forward(layer, x))[1]
    per_layer()
    del layer.forward

    class Wrap(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            seen.append(1)
            return self.inner(x)

    experts.packed_down_proj[1] = Wrap(layer)
    per_layer()
    experts.packed_down_proj[1] = layer
    # the up projections in one call each time, but under the global hook, which every layer has
    assert len(seen) == 5 and len(calls) == 4
    with torch.no_grad(), fwAD.dual_level():
        primal, tangent = fwAD.unpack_dual(experts(fwAD.make_dual(h, t), idx, w))
    jvp_primal, jvp_tangent = torch.func.jvp(lambda x: experts(x, idx, w), (h,), (t,))
    assert len(calls) == 4
    monkeypatch.setattr("ulbtorch.integrations.hf_experts._one_call_serves", lambda layers, xs: False)
    with torch.no_grad(), fwAD.dual_level():
        want_tangent = fwAD.unpack_dual(experts(fwAD.make_dual(h, t), idx, w)).tangent
    assert torch.equal(primal, want) and torch.equal(jvp_primal, want)
    assert tangent is not None and torch.equal(tangent, want_tangent)
    torch.testing.assert_close(jvp_tangent, want_tangent)  # torch.func orders some sums its own way

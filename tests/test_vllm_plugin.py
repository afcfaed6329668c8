"""The vLLM plugin's choice of method per layer; needs vLLM (not installed in
CI: benchmarks/vllm_smoke.sh installs it in a venv and serves checkpoints)."""
import pytest

pytest.importorskip("vllm")
from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod  # noqa: E402

from ulbtorch.integrations.vllm import UlbLinearMethod, UlbVllmConfig  # noqa: E402

MERGED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}


def _method(skip, prefix):
    cfg = UlbVllmConfig.from_config({"bits": 2, "modules_to_not_convert": skip})
    cfg.packed_modules_mapping = dict(MERGED)  # what vLLM sets from the model class
    layer = LinearBase.__new__(LinearBase)  # the method depends on the type and prefix alone
    return type(cfg.get_quant_method(layer, prefix))


def test_merged_layers_follow_their_shards():
    attn = "model.layers.0.self_attn.qkv_proj"
    assert _method(["*.q_proj", "*.k_proj", "*.v_proj"], attn) is UnquantizedLinearMethod
    assert _method(["*.self_attn.*"], attn) is UnquantizedLinearMethod
    assert _method(["*.qkv_proj"], attn) is UnquantizedLinearMethod  # the merged name itself
    assert _method(["*.q_proj", "*.k_proj", "*.v_proj"], "model.layers.0.mlp.gate_up_proj") is UlbLinearMethod
    assert _method(["*.down_proj"], "model.layers.0.mlp.down_proj") is UnquantizedLinearMethod
    assert _method(None, attn) is UlbLinearMethod
    assert _method([], "model.layers.0.mlp.down_proj") is UlbLinearMethod


def test_merged_layer_with_shards_of_two_formats_is_an_error():
    with pytest.raises(ValueError, match=r"qkv_proj merges .* keeps only \['model.layers.0.self_attn.q_proj'\]"):
        _method(["*.q_proj"], "model.layers.0.self_attn.qkv_proj")


def test_names_follow_vllms_renames():
    """vLLM hands the config its model's renames of checkpoint names (LFM2's
    .conv. is .short_conv.): a layer named exactly in modules_to_not_convert
    stays bf16 under its vLLM name (it got the low-bit method and failed to
    load)."""
    from vllm.model_executor.models.utils import WeightsMapper

    cfg = UlbVllmConfig.from_config({"bits": 2, "modules_to_not_convert": ["lm_head", "model.layers.0.conv.in_proj"]})
    cfg.packed_modules_mapping = {}
    cfg.apply_vllm_mapper(WeightsMapper(orig_to_new_substr={".conv.": ".short_conv."}))
    layer = LinearBase.__new__(LinearBase)
    assert type(cfg.get_quant_method(layer, "model.layers.0.short_conv.in_proj")) is UnquantizedLinearMethod
    assert type(cfg.get_quant_method(layer, "model.layers.1.short_conv.in_proj")) is UlbLinearMethod


def test_apply_computes_the_layer():
    """The numbers of the methods' apply (vllm_smoke.sh checks them end to
    end): the low-bit layer against F.linear on the dequantized weight of
    the fake-quantized input, fp32, bf16 and fp16; the bf16 lm_head's GEMV
    against F.linear for one token and a batch."""
    import torch
    import torch.nn.functional as F

    from ulbtorch import ops
    from ulbtorch.integrations.vllm import UlbBF16HeadMethod
    from ulbtorch.quantize import QuantConfig

    g = torch.Generator().manual_seed(0)
    M, K = 70, 100
    codes = torch.randint(0, 4, (M, K), generator=g, dtype=torch.uint8)
    scales = torch.rand(M, 1, generator=g) + 0.1
    layer = torch.nn.Module()
    layer.packed = torch.nn.Parameter(ops.pack(codes, scales, "int2_sym"), requires_grad=False)
    layer.ulb_out_features = M
    W = ops.dequantize(codes, scales, "int2_sym")
    bias = torch.randn(M, generator=g)
    method = UlbLinearMethod(QuantConfig(bits=2))
    for dtype, rel in ((torch.float32, 1e-5), (torch.bfloat16, 1e-2), (torch.float16, 2e-3)):
        x = torch.randn(3, K, generator=g).to(dtype)
        y = method.apply(layer, x, bias.to(dtype))
        assert y.dtype == dtype and y.shape == (3, M)
        want = F.linear(ops.fake_quantize_activations(x), W, bias.to(dtype).float())
        assert (y.float() - want).abs().max() <= rel * want.abs().max()
    head = torch.nn.Module()
    head.weight = torch.nn.Parameter(torch.randn(M, K, generator=g).bfloat16(), requires_grad=False)
    head_method = UlbBF16HeadMethod()
    head_method.process_weights_after_loading(head)  # vLLM's CPU setup for its own batches
    for shape in ((K,), (1, K), (4, K)):
        x = torch.randn(shape, generator=g).bfloat16()
        y = head_method.apply(head, x)
        want = F.linear(x.float(), head.weight.float())
        assert y.shape == want.shape and (y.float() - want).abs().max() <= 1e-2 * want.abs().max()


def test_accelerator_layers_run_the_triton_op():
    """On a device Triton serves (the CPU standing in, in Triton's
    interpreter) process_weights_after_loading moves the assembled blob
    there in the kmajor layout and apply runs ulb.triton_linear: the CPU
    kernel's outputs bit for bit."""
    import types

    import torch

    from ulbtorch import ops
    from ulbtorch import triton as accel
    from ulbtorch.quantize import QuantConfig

    pytest.importorskip("triton")
    if not accel.interpreting():
        pytest.skip("needs TRITON_INTERPRET=1 (tests/conftest.py sets it without an accelerator)")
    g = torch.Generator().manual_seed(0)
    M, K = 70, 100
    blob = ops.pack(torch.randint(0, 4, (M, K), generator=g, dtype=torch.uint8),
                    torch.rand(M, 2, generator=g) + 0.1, "int2_sym", 64)
    layer = torch.nn.Module()
    layer.packed = torch.nn.Parameter(torch.empty(0, dtype=torch.uint8), requires_grad=False)
    layer.ulb_out_features = M
    layer.ulb_assembler = types.SimpleNamespace(pack=lambda: blob.clone())
    method = UlbLinearMethod(QuantConfig(bits=2, group_size=64))
    with accel.emulate_on_cpu():
        method.process_weights_after_loading(layer)
    assert ops.packed_info(layer.packed)["tiles"] == "kmajor"
    bias = torch.randn(M, generator=g)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(3, K, generator=g).to(dtype)
        assert torch.equal(method.apply(layer, x, bias.to(dtype)), ops.linear(x, blob, bias.to(dtype), M))


def _experts_layer_stub(is_act_and_mul=True):
    """A RoutedExperts as get_quant_method sees it: built up to its moe_config."""
    import types

    from vllm.model_executor.layers.fused_moe import RoutedExperts
    layer = RoutedExperts.__new__(RoutedExperts)
    object.__setattr__(layer, "moe_config", types.SimpleNamespace(is_act_and_mul=is_act_and_mul))
    return layer


def test_mixture_of_experts_layers_get_the_packed_experts_method():
    """Packed experts get UlbMoEMethod (vLLM gave its fused MoE layer the
    float method, found none of the checkpoint's experts.packed_* tensors
    and served uninitialised experts); experts kept float get vLLM's own;
    a router stays float."""
    from vllm.model_executor.layers.fused_moe import GateLinear

    from ulbtorch.integrations.vllm_moe import UlbMoEMethod
    experts = "model.layers.0.mlp.experts"
    cfg = UlbVllmConfig.from_config({"bits": 2})
    assert type(cfg.get_quant_method(_experts_layer_stub(), experts)) is UlbMoEMethod
    router = GateLinear.__new__(GateLinear)
    assert type(cfg.get_quant_method(router, "model.layers.0.mlp.gate")) is UnquantizedLinearMethod
    cfg = UlbVllmConfig.from_config({"bits": 2, "modules_to_not_convert": ["lm_head", "*.experts.*"]})
    assert cfg.get_quant_method(_experts_layer_stub(), experts) is None
    assert cfg.get_quant_method(_experts_layer_stub(is_act_and_mul=False), experts) is None
    cfg = UlbVllmConfig.from_config({"bits": 2, "modules_to_not_convert": ["lm_head", "*.experts.down_proj"]})
    with pytest.raises(ValueError, match=r"ulb: model.layers.0.mlp.experts: modules_to_not_convert keeps "
                                         r"\['model.layers.0.mlp.experts.down_proj'\] float but not "
                                         r"\['model.layers.0.mlp.experts.gate_up_proj'\]"):
        cfg.get_quant_method(_experts_layer_stub(), experts)


E, H, INTER, TOP_K, GROUP = 4, 64, 64, 2, 32


def _expert_blobs():
    """Per expert: the packed merged gate/up (2*INTER x H, gate rows first)
    and down (H x INTER) weights as save_pretrained writes them, and their
    dequantized float weights."""
    import torch

    from ulbtorch import ops
    g = torch.Generator().manual_seed(0)
    blobs, floats = {}, []
    for e in range(E):
        ws = []
        for name, (m, k) in (("packed_gate_up_proj", (2 * INTER, H)), ("packed_down_proj", (H, INTER))):
            codes = torch.randint(0, 4, (m, k), generator=g, dtype=torch.uint8)
            scales = torch.rand(m, k // GROUP, generator=g) + 0.1
            blobs[f"{name}.{e}.packed"] = ops.pack(codes, scales, "int2_sym", GROUP)
            ws.append(ops.dequantize(codes, scales, "int2_sym", GROUP))
        floats.append(ws)
    return blobs, floats


def _loaded_experts(blobs, tp_rank=0, tp_size=1, local=None):
    """UlbMoEMethod's weights on a stand-in for vLLM's RoutedExperts of one
    rank, loaded from `blobs`: tp_size splits the intermediate dimension;
    local (expert parallelism) lists the global experts this rank holds."""
    import types

    import torch
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation

    from ulbtorch.integrations.vllm_moe import UlbMoEMethod
    from ulbtorch.quantize import QuantConfig
    local = list(range(E)) if local is None else local
    expert_map = None if len(local) == E else torch.tensor([local.index(e) if e in local else -1 for e in range(E)])
    moe = types.SimpleNamespace(tp_rank=tp_rank, tp_size=tp_size, is_act_and_mul=True, has_bias=False,
                                hidden_dim_unpadded=H, intermediate_size_per_partition_unpadded=INTER // tp_size)
    layer = torch.nn.Module()
    layer.layer_name, layer.global_num_experts = "model.layers.0.mlp.experts", E
    layer.activation, layer.apply_router_weight_on_input, layer.expert_map = MoEActivation.SILU, False, expert_map
    layer._map_global_expert_id_to_local_expert_id = lambda e: -1 if e not in local else local.index(e)
    method = UlbMoEMethod(QuantConfig(bits=2, group_size=GROUP), moe)
    method.create_weights(layer, len(local), H, INTER // tp_size, torch.bfloat16)
    loaded = list(layer.load_weights(iter(blobs.items())))
    assert set(loaded) == {"w13_packed", "w2_packed"}  # what vLLM checks against the layer's parameters
    method.process_weights_after_loading(layer)
    return method, layer


def test_experts_it_cannot_serve_are_refused():
    """Biases, a clamped activation and router weights on the inputs would
    be dropped silently by the packed experts' forward."""
    import types

    import torch
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation

    from ulbtorch.integrations.vllm_moe import UlbMoEMethod
    from ulbtorch.quantize import QuantConfig
    for change, why in ((dict(has_bias=True), "its experts have biases"),
                        (dict(activation=MoEActivation.SWIGLUOAI), "its activation is swigluoai"),
                        (dict(apply_router_weight_on_input=True), "apply_router_weight_on_input"),
                        (dict(swiglu_limit=7.0), r"clamped \(swiglu_limit")):
        moe = types.SimpleNamespace(tp_rank=0, tp_size=1, is_act_and_mul=True, has_bias=change.get("has_bias", False),
                                    hidden_dim_unpadded=H, intermediate_size_per_partition_unpadded=INTER)
        layer = torch.nn.Module()
        layer.layer_name, layer.activation = "model.layers.0.mlp.experts", change.get("activation", MoEActivation.SILU)
        layer.apply_router_weight_on_input = change.get("apply_router_weight_on_input", False)
        layer.swiglu_limit = change.get("swiglu_limit")
        with pytest.raises(ValueError, match=r"ulb: model.layers.0.mlp.experts: .*" + why):
            UlbMoEMethod(QuantConfig(bits=2), moe).create_weights(layer, E, H, INTER, torch.bfloat16)


def _routing(tokens):
    import torch
    g = torch.Generator().manual_seed(tokens)
    ids = torch.stack([torch.randperm(E, generator=g)[:TOP_K] for _ in range(tokens)]).to(torch.int32)
    return torch.rand(tokens, TOP_K, generator=g), ids


def test_packed_experts_compute_the_routed_mixture():
    """apply against the mixture computed from the dequantized weights (the
    kernel fake-quantizes its inputs), a batch and one token."""
    import torch
    import torch.nn.functional as F

    from ulbtorch import ops
    blobs, floats = _expert_blobs()
    method, layer = _loaded_experts(blobs)
    for tokens in (5, 1):
        weights, ids = _routing(tokens)
        x = torch.randn(tokens, H, generator=torch.Generator().manual_seed(1))
        want = torch.zeros(tokens, H)
        for t in range(tokens):
            for j in range(TOP_K):
                w13, w2 = floats[int(ids[t, j])]
                gate, up = F.linear(ops.fake_quantize_activations(x[t:t + 1]), w13).chunk(2, dim=-1)
                want[t] += weights[t, j] * F.linear(ops.fake_quantize_activations(F.silu(gate) * up), w2)[0]
        got = method.apply(layer, x, weights, ids, None, None)
        assert got.shape == (tokens, H) and got.dtype == x.dtype
        assert (got - want).abs().max() <= 1e-4 * want.abs().max()
        got16 = method.apply(layer, x.bfloat16(), weights, ids, None, None)
        assert got16.dtype == torch.bfloat16 and (got16.float() - want).abs().max() <= 3e-2 * want.abs().max()


def test_experts_split_over_ranks_as_vllm_splits_them():
    """Tensor parallel: each of 2 ranks holds every expert's half of the
    intermediate dimension (w13's gate and up rows, w2's columns) and the sum
    of their outputs (vLLM's all-reduce) is the whole layer's, up to the
    activations' rounding per half. Expert parallel: each rank holds whole
    experts and a token's other experts contribute nothing there, so the sum
    is the whole layer's bit for bit."""
    import torch
    blobs, _ = _expert_blobs()
    whole = _loaded_experts(blobs)
    weights, ids = _routing(6)
    x = torch.randn(6, H, generator=torch.Generator().manual_seed(2))
    want = whole[0].apply(whole[1], x, weights, ids, None, None)
    tp = [_loaded_experts(blobs, r, 2) for r in range(2)]
    assert all(len(layer.ulb_w13) == E for _, layer in tp)
    got = sum(m.apply(layer, x, weights, ids, None, None) for m, layer in tp)
    assert (got - want).abs().max() <= 2e-2 * want.abs().max()
    assert (tp[0][0].apply(tp[0][1], x, weights, ids, None, None) - want).abs().max() > 0.1 * want.abs().max()
    ep = [_loaded_experts(blobs, local=[0, 2]), _loaded_experts(blobs, local=[1, 3])]
    assert torch.equal(sum(m.apply(layer, x, weights, ids, None, None) for m, layer in ep), want)


def test_missing_or_unknown_expert_tensors_are_errors():
    blobs, _ = _expert_blobs()
    partial = {k: v for k, v in blobs.items() if k != "packed_down_proj.2.packed"}
    with pytest.raises(ValueError, match=r"ulb: model.layers.0.mlp.experts: the checkpoint holds no packed weights, "
                                         r"or only part of them, for local experts \[2\] \(expert 2: "
                                         r"model.layers.0.mlp.experts.packed_down_proj.2 shards \[0\]\)"):
        _loaded_experts(partial)
    with pytest.raises(ValueError, match=r"unexpected checkpoint tensor model.layers.0.mlp.experts.gate_up_proj"):
        _loaded_experts({**blobs, "gate_up_proj": blobs["packed_down_proj.0.packed"]})
    with pytest.raises(ValueError, match=r"packed_gate_up_proj.7.packed: expert 7 of 4"):
        _loaded_experts({**blobs, "packed_gate_up_proj.7.packed": blobs["packed_gate_up_proj.0.packed"]})
    bad = {**blobs, "packed_down_proj.1.packed": blobs["packed_gate_up_proj.1.packed"]}
    with pytest.raises(ValueError, match=r"packed_down_proj.1: checkpoint weight is \(128, 64\); tensor parallel "
                                         r"size 1 needs 64 x 1 rows of 64"):
        _loaded_experts(bad)


def test_a_quantized_lm_head_tied_in_the_checkpoint_is_refused():
    """save_pretrained writes a quantized lm_head untied (the packed copy
    beside the float embedding); a config that still ties it cannot be
    served: the packed layer has no weight to share."""
    import torch

    from ulbtorch.quantize import QuantConfig
    layer = torch.nn.Module()
    layer.prefix = "lm_head"
    with pytest.raises(ValueError, match=r"ulb: lm_head is quantized \(lm_head_bits\) but the checkpoint's config "
                                         r"ties it to the input embedding"):
        UlbLinearMethod(QuantConfig(bits=2)).tie_weights(layer, None)


_SERVE_MOE = r'''
import json, sys
import torch
from transformers import AutoModelForCausalLM, Qwen3MoeConfig
import ulbtorch

work = sys.argv[1]
cfg = Qwen3MoeConfig(hidden_size=128, intermediate_size=256, moe_intermediate_size=128, num_experts=8,
                     num_experts_per_tok=2, norm_topk_prob=True, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=32, vocab_size=500, max_position_embeddings=256,
                     tie_word_embeddings=False, initializer_range=0.1)
torch.manual_seed(0)
AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).save_pretrained(f"{work}/float")
model = AutoModelForCausalLM.from_pretrained(f"{work}/float", dtype=torch.bfloat16,
                                             quantization_config=ulbtorch.UlbConfig(bits=2, group_size=64))
model.save_pretrained(f"{work}/ulb")
prompt = [1, 5, 7, 9]
hf = model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)[0, len(prompt):].tolist()

from vllm import LLM, SamplingParams
llm = LLM(model=f"{work}/ulb", skip_tokenizer_init=True, dtype="bfloat16", enforce_eager=True, max_model_len=128,
          max_num_seqs=1, gpu_memory_utilization=0.1)
out = llm.generate([{"prompt_token_ids": prompt}],
                   SamplingParams(max_tokens=8, temperature=0, logprobs=5, detokenize=False))[0].outputs[0]
logprobs = [{t: lp.logprob for t, lp in step.items()} for step in out.logprobs]
print("RESULT " + json.dumps({"hf": hf, "vllm": list(out.token_ids), "logprobs": logprobs}), flush=True)
'''


def test_a_saved_mixture_of_experts_checkpoint_serves_transformers_tokens(tmp_path):
    """A tiny Qwen3-MoE quantized and saved by save_pretrained, served by
    vLLM (its own process, as a server runs it): the greedy tokens are
    transformers', or differ first where vLLM's log-probabilities of the two
    tokens are a bf16 rounding step apart (a tie). benchmarks/vllm_smoke.sh
    serves it at tensor_parallel_size 2 too."""
    import json
    import os
    import subprocess
    import sys

    script = tmp_path / "serve.py"
    script.write_text(_SERVE_MOE)
    import ulbtorch
    # this ulbtorch, whichever way the test found it; the engine in the script's own process
    path = os.pathsep.join(p for p in (os.path.dirname(os.path.dirname(ulbtorch.__file__)),
                                       os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", PYTHONPATH=path)
    done = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, env=env,
                          timeout=1200)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    got = json.loads(lines[-1].removeprefix("RESULT "))
    hf, served = got["hf"], got["vllm"]
    if hf != served:
        i = next(j for j, (a, b) in enumerate(zip(hf, served)) if a != b)
        step = got["logprobs"][i]
        gap = step[str(served[i])] - step[str(hf[i])] if str(hf[i]) in step else float("inf")
        assert gap < 0.02, f"transformers {hf}, vLLM {served}: step {i}'s log-probability gap {gap:.4f}"

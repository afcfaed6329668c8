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


def test_a_mixture_of_experts_layer_is_refused():
    """vLLM gave its fused MoE layer the float method, found none of the
    checkpoint's experts.packed_* tensors and served uninitialised experts
    (greedy tokens all 0)."""
    from vllm.model_executor.layers.fused_moe import RoutedExperts
    cfg = UlbVllmConfig.from_config({"bits": 2})
    with pytest.raises(ValueError, match=r"ulb: model.layers.0.mlp.experts is a mixture-of-experts layer; "
                                         "ulbtorch's vLLM plugin serves dense models only"):
        cfg.get_quant_method(RoutedExperts.__new__(RoutedExperts), "model.layers.0.mlp.experts")

"""The layers on an accelerator (CUDA, XPU). The C kernels serve the CPU only;
where Triton is installed a layer moved to the device keeps its blob there in
the accelerator layout and runs the Triton kernels (ulbtorch/triton/),
which give the CPU kernel's outputs bit for bit; elsewhere it runs its
pure-PyTorch path from a dequantised copy, which must give them to within
rounding. A model moved there must generate as on the CPU, moved back its
blobs must be the CPU's bit for bit, and the C ops must refuse accelerator
tensors with a clear error. Skipped where torch sees no accelerator (CI;
tests/test_triton.py runs the kernels there in Triton's interpreter)."""
import pytest
import torch

import ulbtorch
from ulbtorch import ops
from ulbtorch import triton as accel
from ulbtorch.nn import Linear2Bit, LowBitLinear

from _layers import CLASS_FORMATS, K_IN, M_OUT  # noqa: E402
from _layers import _float_linear as _linear  # noqa: E402

ACC = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
pytestmark = pytest.mark.skipif(ACC is None, reason="no accelerator (CUDA, XPU) visible to torch")
TRITON = ACC is not None and accel.serves(ACC)
BACKEND = "triton" if TRITON else "torch"


def _close(y, ref, rel):
    scale = ref.float().abs().max().clamp(min=1e-12)
    err = (y.float().cpu() - ref.float().cpu()).abs().max()
    assert err <= rel * scale, f"max error {err.item():.3g} > {rel:g} x {scale.item():.3g}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("gs", [0, 32])
@pytest.mark.parametrize("cls,fmt", CLASS_FORMATS, ids=[f for _, f in CLASS_FORMATS])
def test_layer_on_accelerator_matches_cpu_kernel(gen, cls, fmt, gs, dtype):
    cpu = cls.from_linear(_linear(gen), format=fmt, group_size=gs)
    acc = cls.from_linear(_linear(gen.manual_seed(1234)), format=fmt, group_size=gs).to(ACC)
    assert acc.packed.device.type == ACC.type and acc.backend == BACKEND
    assert ops.packed_info(acc.packed)["tiles"] == ("kmajor" if TRITON else ops.packed_info(cpu.packed)["tiles"])
    x = torch.randn(3, 4, K_IN, generator=gen).to(dtype)
    with torch.no_grad():
        y_cpu, y_acc = cpu(x), acc(x.to(ACC))
    assert y_acc.device.type == ACC.type and y_acc.dtype == dtype and y_acc.shape == (3, 4, M_OUT)
    if TRITON:  # the CPU's integer sums and order of float operations
        assert torch.equal(y_acc.cpu(), y_cpu)
        assert acc._dequant_cache is None
    else:  # same integers times the same scales, summed in another order (bf16: one rounding of the output)
        _close(y_acc, y_cpu, 1e-5 if dtype == torch.float32 else 1e-2)
    assert torch.equal(acc.cpu().packed, cpu.packed)


def test_layer_built_on_accelerator_packs_like_cpu(gen):
    lin = _linear(gen)
    cpu = Linear2Bit.from_linear(lin, group_size=32)
    acc = Linear2Bit.from_linear(lin.to(ACC), group_size=32)
    assert acc.packed.device.type == ACC.type and acc.backend == BACKEND
    assert torch.equal(ops.retile(acc.packed.cpu(), ops.packed_info(cpu.packed)["tiles"]), cpu.packed)
    assert acc.bias.device.type == ACC.type


def test_ops_refuse_accelerator_tensors(gen):
    layer = Linear2Bit.from_linear(_linear(gen), group_size=32)
    x = torch.randn(2, K_IN, generator=gen).to(ACC)
    with pytest.raises(ValueError, match=f"runs on CPU; input is on {ACC.type}"):
        ops.linear(x, layer.packed, layer.bias, M_OUT)
    with pytest.raises((RuntimeError, ValueError), match="(?i)device|cpu"):
        torch.ops.ulb.linear(x, layer.packed, layer.bias, M_OUT)
    with pytest.raises((RuntimeError, ValueError), match="(?i)device|cpu"):
        torch.ops.ulb.linear(x.cpu(), layer.packed.to(ACC), None, M_OUT)
    w = torch.randn(M_OUT, K_IN, generator=gen).to(torch.bfloat16)
    with pytest.raises(ValueError, match=f"runs on CPU; input is on {ACC.type}"):
        ops.linear_bf16(x.to(torch.bfloat16), w.to(ACC))
    with pytest.raises((RuntimeError, ValueError), match="(?i)device|cpu"):
        torch.ops.ulb.linear_bf16(x.cpu().to(torch.bfloat16), w.to(ACC), None)


def test_unpack_and_dequantize_from_accelerator(gen):
    layer = Linear2Bit.from_linear(_linear(gen), group_size=32)
    w = layer.dequantize()
    layer.to(ACC)
    assert torch.equal(layer.dequantize().cpu(), w)


CONFIG = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=500)


def _tiny_llama(dtype):
    transformers = pytest.importorskip("transformers")
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**CONFIG))
    return model.to(dtype).eval()


def _generate(model, ids):
    with torch.no_grad():
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12,
                              min_new_tokens=12, do_sample=False, pad_token_id=0)


@pytest.mark.parametrize("bits", [2, "ternary", 1, 4])
def test_model_quantized_on_cpu_runs_on_accelerator(bits):
    model = ulbtorch.quantize_(_tiny_llama(torch.float32), bits=bits)
    ids = torch.randint(3, CONFIG["vocab_size"], (2, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits_cpu = model(ids).logits
    tokens_cpu = _generate(model, ids)
    model.to(ACC)
    assert all(m.packed.device.type == ACC.type for m in model.modules() if isinstance(m, LowBitLinear))
    with torch.no_grad():
        logits_acc = model(ids.to(ACC)).logits
    _close(logits_acc, logits_cpu, 1e-4)
    assert torch.equal(_generate(model, ids.to(ACC)).cpu(), tokens_cpu)


@pytest.mark.skipif(not TRITON, reason="triton not installed")
def test_model_compiled_on_accelerator():
    """torch.compile of a quantized model on the device, CUDA graphs
    ("reduce-overhead") included, runs ulb.triton_linear and gives its
    eager logits."""
    model = ulbtorch.quantize_(_tiny_llama(torch.bfloat16), bits=2).to(ACC)
    ids = torch.randint(3, CONFIG["vocab_size"], (1, 8), generator=torch.Generator().manual_seed(3)).to(ACC)
    with torch.no_grad():
        eager = model(ids).logits
        for mode in (None, "reduce-overhead"):
            compiled = torch.compile(model, mode=mode)
            for _ in range(3):
                got = compiled(ids).logits
            torch.testing.assert_close(got, eager, atol=0.05, rtol=0.05)


def test_bf16_model_quantized_on_accelerator(tmp_path):
    """quantize_ on a model already on the device (bf16, lm_head left to
    LinearBF16), then saved and loaded on the CPU, where the kernels run."""
    model = ulbtorch.quantize_(_tiny_llama(torch.bfloat16).to(ACC), bits=2, group_size=64)
    layers = [m for m in model.modules() if isinstance(m, LowBitLinear)]
    assert layers and all(m.packed.device.type == ACC.type for m in layers)
    ids = torch.randint(3, CONFIG["vocab_size"], (2, 8), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        logits_acc = model(ids.to(ACC)).logits
    ulbtorch.save_quantized(model, tmp_path)
    cpu = ulbtorch.load_quantized(_tiny_llama(torch.bfloat16), tmp_path)
    with torch.no_grad():
        logits_cpu = cpu(ids).logits
    # bf16 activations between layers: each side rounds its own sums.
    _close(logits_acc, logits_cpu, 0.05)

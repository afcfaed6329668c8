"""The Triton kernels (ulbtorch/triton/) in Triton's interpreter, on CPU
tensors, against the C kernels on the same weights: the int8 activations
and their scales bit for bit, the integer sums of every (token, row,
group) bit for bit, and the outputs bit for bit (the kernels follow the
scalar reference's order of float operations); odd shapes, every format and
scale granularity, 1 to 128 tokens, strided, bf16 and fp16 inputs. Then
the layers on the accelerator path (ulbtorch.triton.emulate_on_cpu):
moved, loaded, compiled, differentiated, and moved back bit for bit.

TRITON_INTERPRET must be set before triton is imported (conftest.py sets
it); the module skips where triton is not installed or was imported
without it."""
import pytest
import torch

pytest.importorskip("triton")
from ulbtorch import triton as accel  # noqa: E402

if not accel.interpreting():
    pytest.skip("triton was imported before TRITON_INTERPRET=1 was set", allow_module_level=True)

import ulbtorch  # noqa: E402
from ulbtorch import FORMATS, ops  # noqa: E402

# The formats with an accelerator layout (not base 3, which runs there dequantised).
KMAJOR_FORMATS = [f for f in FORMATS if "kmajor" in FORMATS[f].tiles]
from ulbtorch.formats import n_groups  # noqa: E402
from ulbtorch.triton import linear as tlin  # noqa: E402
from ulbtorch.triton.act_quant import quantize_activations  # noqa: E402

GRANULARITIES = ("channel", "group", "tensor")


def _weight(fmt, M, K, granularity, seed=0):
    f = FORMATS[fmt]
    g = torch.Generator().manual_seed(seed)
    gs = 2 * f.tile_k if granularity == "group" else 0
    codes = torch.randint(0, f.max_code + 1, (M, K), dtype=torch.uint8, generator=g)
    G = n_groups(gs, K)
    scales = torch.rand(M, G, generator=g) + 0.25
    if granularity == "tensor":
        scales = scales[:1, :1].expand(M, 1).contiguous()
    return ops.pack(codes, scales, fmt, gs, tiles="vnni"), gs


def _x(N, K, dtype=torch.float32, seed=1):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(N, K, generator=g) * (torch.rand(N, 1, generator=g) * 4 + 0.01)).to(dtype)


def test_activation_quantisation_matches_c():
    """Every rounding case of the C quantiser: halves (to even), the clamp,
    an all-zero row, NaN and infinite rows, strided and bf16/fp16 input."""
    blob, _ = _weight("int8", 16, 300, "channel")
    halves = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5, -127.0, 3.4999998])
    rows = [torch.nn.functional.pad(halves, (0, 290)), torch.zeros(300), torch.full((300,), float("nan")),
            torch.tensor([float("inf")] + [1.0] * 299), *_x(4, 300)]
    x = torch.stack(rows)
    for xi in (x, x.bfloat16(), torch.cat([x, x], 1)[:, ::2]):
        xq_c, xs_c, _ = torch.ops.ulb.quantize_act(xi, blob)
        xq, xs = quantize_activations(xi, 300)
        assert torch.equal(xq, xq_c)
        assert torch.equal(xs.view(torch.int32), xs_c.view(torch.int32))  # NaN bits too
    xh = x.half()
    xq_c, xs_c, _ = torch.ops.ulb.quantize_act(xh.float(), blob)
    xq, xs = quantize_activations(xh, 300)
    assert torch.equal(xq, xq_c) and torch.equal(xs.view(torch.int32), xs_c.view(torch.int32))


@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("fmt", KMAJOR_FORMATS)
def test_linear_matches_c_kernels(fmt, granularity):
    """Outputs of the GEMV (N <= 8) and the GEMM (N > 8) equal the C
    kernels' bit for bit; the integer sums equal ulb.int_dots's."""
    f = FORMATS[fmt]
    M, K = 70, 5 * f.tile_k + f.tile_k // 2  # neither a multiple of its block
    blob, gs = _weight(fmt, M, K, granularity)
    kmajor = ops.retile(blob, "kmajor")
    bias = torch.randn(M)
    for N in (1, 3, 17, 128):
        x = _x(N, K, seed=N)
        y, sums = tlin.run(x, kmajor, bias, f.id, M, K, gs, sums=True)
        assert torch.equal(y, ops.linear(x, blob, bias, M)), N
        xq, _, xsum = torch.ops.ulb.quantize_act(x, blob)
        assert torch.equal(sums, torch.ops.ulb.int_dots(blob, xq, xsum)), N
    for dtype in (torch.bfloat16, torch.float16):
        for N in (1, 17):
            x = _x(N, K, dtype, seed=N)
            want = ops.linear(x.float(), blob, bias, M).to(dtype)
            if dtype == torch.bfloat16:  # the C kernel stores bf16 itself
                want = ops.linear(x, blob, bias.bfloat16(), M)
                assert torch.equal(tlin.run(x, kmajor, bias.bfloat16(), f.id, M, K, gs), want)
            else:
                assert torch.equal(tlin.run(x, kmajor, bias, f.id, M, K, gs), want)


@pytest.mark.parametrize("fmt", KMAJOR_FORMATS)
def test_gemv_split_over_k(fmt, monkeypatch):
    """The GEMV's K split into segments (split-K within one group, several
    groups to a program) adds up to the C kernels' sums and outputs."""
    from ulbtorch.triton import gemv
    f = FORMATS[fmt]
    # 16 rows and 4 words of codes a program: 3 row blocks, several segments, groups of 2 words.
    monkeypatch.setitem(gemv.CONFIGS, f.bits, (16, 4 * f.tile_k, 4))
    M, K = 40, 11 * f.tile_k + 1
    for granularity in ("channel", "group"):
        blob, gs = _weight(fmt, M, K, granularity, seed=3)
        x = _x(2, K, seed=4)
        y, sums = tlin.run(x, ops.retile(blob, "kmajor"), None, f.id, M, K, gs, sums=True)
        assert torch.equal(y, ops.linear(x, blob, None, M)), granularity
        xq, _, xsum = torch.ops.ulb.quantize_act(x, blob)
        assert torch.equal(sums, torch.ops.ulb.int_dots(blob, xq, xsum)), granularity


def test_linear_shapes_and_strides():
    """N = 0, a 3-D input, a strided input, no bias, one row, K of one tile."""
    blob, gs = _weight("int2_sym", 1, 16, "channel")
    kmajor, fid = ops.retile(blob, "kmajor"), FORMATS["int2_sym"].id
    x = _x(5, 16)
    assert torch.equal(tlin.run(x, kmajor, None, fid, 1, 16, 0), ops.linear(x, blob, None, 1))
    blob, gs = _weight("ternary", 33, 100, "group")
    kmajor, fid = ops.retile(blob, "kmajor"), FORMATS["ternary"].id
    assert tlin.run(torch.empty(0, 100), kmajor, None, fid, 33, 100, gs).shape == (0, 33)
    x3 = _x(6, 100).reshape(2, 3, 100)
    assert torch.equal(tlin.run(x3, kmajor, None, fid, 33, 100, gs), ops.linear(x3, blob, None, 33))
    wide = _x(4, 300)
    xs = wide[:, 50:250:2]
    assert not xs.is_contiguous()
    assert torch.equal(tlin.run(xs, kmajor, None, fid, 33, 100, gs), ops.linear(xs.contiguous(), blob, None, 33))


def test_op_refuses_bad_arguments():
    blob, gs = _weight("binary", 20, 64, "channel")
    kmajor, fid = ops.retile(blob, "kmajor"), FORMATS["binary"].id
    with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
        tlin.run(torch.ones(1, 64, dtype=torch.int32), kmajor, None, fid, 20, 64, 0)
    with pytest.raises(ValueError, match="64 features"):
        tlin.run(torch.ones(1, 65), kmajor, None, fid, 20, 64, 0)
    with pytest.raises(ValueError, match="blob of .* bytes"):
        tlin.run(torch.ones(1, 64), kmajor[:-1], None, fid, 20, 64, 0)
    with pytest.raises(ValueError, match="bias must be"):
        tlin.run(torch.ones(1, 64), kmajor, torch.ones(21), fid, 20, 64, 0)
    with pytest.raises(ValueError, match="unknown format id"):
        tlin.run(torch.ones(1, 64), kmajor, None, 99, 20, 64, 0)


def _layer(fmt="ternary", M=70, K=200, bias=True):
    torch.manual_seed(0)
    lin = torch.nn.Linear(K, M, bias=bias)
    return lin, ulbtorch.nn.MODULE_FOR_FORMAT[fmt].from_linear(lin, format=fmt)


@pytest.mark.parametrize("fmt", ["ternary", "binary", "int4"])
def test_layer_on_the_accelerator_path(fmt):
    """A layer moved to a Triton device holds the kmajor blob, no float copy,
    and gives the CPU kernels' outputs; moved back its blob is the CPU's
    bit for bit."""
    _, layer = _layer(fmt)
    blob = layer.packed.clone()
    x = _x(3, 200)
    want = {dt: layer(x.to(dt)) for dt in (torch.float32, torch.bfloat16, torch.float16)}
    assert layer.backend == "cpu"
    with accel.emulate_on_cpu():
        layer.to("cpu")
        assert layer.backend == "triton" and ops.packed_info(layer.packed)["tiles"] == "kmajor"
        assert layer.packed.numel() == blob.numel()
        for dt, w in want.items():
            assert torch.equal(layer(x.to(dt)), w), dt
        assert layer._dequant_cache is None  # no float copy of the weight
        assert torch.equal(layer(x[:, None].double()), want[torch.float32][:, None].double())
        layer.force_reference = True
        assert layer.backend == "torch"
        torch.testing.assert_close(layer(x), want[torch.float32], atol=1e-4, rtol=1e-4)
        layer.force_reference = False
    layer.to("cpu")
    assert layer.backend == "cpu" and torch.equal(layer.packed, blob)
    assert torch.equal(layer(x), want[torch.float32])


def test_layer_takes_blobs_in_either_layout():
    """load_state_dict, assignment and finish_conversion put a blob in the
    layout of the layer's device, whichever layout it arrives in."""
    lin, ref = _layer()
    x = _x(2, 200)
    want = ref(x)
    cpu_blob = ref.packed.clone()
    with accel.emulate_on_cpu():
        kmajor_blob = ops.retile(cpu_blob, "kmajor")
        for blob in (cpu_blob, kmajor_blob):
            layer = ulbtorch.LinearTernary(200, 70).to("cpu")
            layer.load_state_dict({"packed": blob, "bias": lin.bias.detach()})
            assert layer.backend == "triton" and torch.equal(layer(x), want)
            layer.packed = blob.clone()
            assert layer.backend == "triton" and torch.equal(layer(x), want)
    layer = ulbtorch.LinearTernary(200, 70)
    layer.load_state_dict({"packed": kmajor_blob, "bias": lin.bias.detach()})  # saved from an accelerator
    assert layer.backend == "cpu" and torch.equal(layer.packed, cpu_blob)


def test_model_compiled_and_differentiated_on_the_accelerator_path():
    """torch.compile (fullgraph) of a quantized model runs the op; the
    gradient flows through it as on the CPU."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 48), torch.nn.ReLU(), torch.nn.Linear(48, 40))
    ulbtorch.quantize_(model, bits=2)
    x = _x(4, 64)
    want = model(x)
    xg = x.clone().requires_grad_()
    model(xg).square().sum().backward()
    with accel.emulate_on_cpu():
        model.to("cpu")
        assert {m.backend for m in model.modules() if isinstance(m, ulbtorch.nn.LowBitLinear)} == {"triton"}
        assert torch.equal(model(x), want)
        compiled = torch.compile(model, fullgraph=True)
        assert torch.equal(compiled(x), want)
        xt = x.clone().requires_grad_()
        model(xt).square().sum().backward()
        assert torch.equal(xt.grad, xg.grad)


def _backends(model):
    return {m.backend for m in model.modules() if isinstance(m, ulbtorch.nn.LowBitLinear)}


def test_checkpoints_load_onto_the_accelerator_path(tmp_path):
    """load_quantized, transformers' from_pretrained of a packed checkpoint
    and from_pretrained quantizing on load (UlbConfig) give layers on the
    accelerator path, whose logits are the CPU kernels' exactly; and a model saved from there loads back on the CPU."""
    transformers = pytest.importorskip("transformers")
    from _tiny_llama import prompt, tiny_llama

    model = ulbtorch.quantize_(tiny_llama(), bits=2, group_size=64)
    ids = prompt()
    with torch.no_grad():
        want = model(ids).logits
    ulbtorch.save_quantized(model, tmp_path / "q")
    model.save_pretrained(tmp_path / "hf")
    tiny_llama().save_pretrained(tmp_path / "float")
    with accel.emulate_on_cpu():
        loaded = ulbtorch.load_quantized(tiny_llama(), tmp_path / "q")
        hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", device_map="cpu")
        on_load = transformers.AutoModelForCausalLM.from_pretrained(
            tmp_path / "float", quantization_config=ulbtorch.UlbConfig(bits=2, group_size=64), device_map="cpu")
        for m in (loaded, hf, on_load):
            assert _backends(m) == {"triton"}
            with torch.no_grad():
                assert torch.equal(m(ids).logits, want)
        ulbtorch.save_quantized(loaded, tmp_path / "from_accel")
    back = ulbtorch.load_quantized(tiny_llama(), tmp_path / "from_accel")
    assert _backends(back) == {"cpu"}
    with torch.no_grad():
        assert torch.equal(back(ids).logits, want)


def test_packed_experts_on_the_accelerator_path():
    """A mixture-of-experts model's packed experts run one layer call each
    there (the C kernels' batched call reads the CPU layout only)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.MixtralConfig(intermediate_size=128, num_local_experts=4, num_experts_per_tok=2,
                                        hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                                        num_key_value_heads=2, vocab_size=300)
    torch.manual_seed(0)
    model = ulbtorch.quantize_(transformers.AutoModelForCausalLM.from_config(config).eval(), bits="ternary")
    ids = torch.randint(0, 300, (1, 5), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(ids).logits
        with accel.emulate_on_cpu():
            model.to("cpu")
            assert _backends(model) == {"triton"}
            assert torch.equal(model(ids).logits, want)

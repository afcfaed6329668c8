"""Linear1Bit / LinearTernary / Linear2Bit as nn.Modules: numerics against the
pure-PyTorch reference, serialisation, dtypes and shapes."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from safetensors.torch import load_file, save_file

import ulbtorch
from ulbtorch import ops
from ulbtorch.formats import get_format, n_groups
from ulbtorch.nn import Linear1Bit, Linear2Bit, Linear4Bit, Linear8Bit, LinearBF16, LinearTernary, LowBitLinear

from _layers import CF_IDS, CLASS_FORMATS, K_IN, M_OUT, METHODS, _float_linear, _layer, fit_group

SCALINGS = [("channel", 0), ("group", 32), ("group", 64), ("tensor", 0)]
SC_IDS = [f"{g}{gs or ''}" for g, gs in SCALINGS]

# Relative output error ||y - y_float|| / ||y_float|| for Gaussian weights,
# int8 activations included (measured in brackets). Sign quantisation loses
# sqrt(1 - 2/pi) = 0.6 at best; absmax for binary (scale = max|w|) has no
# useful bound on the error, only on the direction (cosine below).
QUANT_ERR = {
    "int2_sym": {"absmax": 0.9, "absmean": 0.6, "mse": 0.45},  # [0.79, 0.47, 0.35]
    "int2": {"absmax": 0.9, "absmean": 0.6, "mse": 0.5},       # [~0.4 for all]
    "ternary": {"absmax": 1.0, "absmean": 0.6, "mse": 0.5},    # [0.92, 0.52, 0.44]
    "binary": {"absmax": None, "absmean": 0.7, "mse": 0.75},   # [2-3, 0.61, 0.64]
    "int4": {"absmax": 0.3, "absmean": 0.4, "mse": 0.2},       # [<= 0.19, 0.26, 0.13 over 20 seeds]
    "int8": {"absmax": 0.03, "absmean": 0.35, "mse": 0.03},    # [0.011, 0.26, 0.012]
}
QUANT_ERR["ternary_base3"] = QUANT_ERR["ternary"]  # the same levels, in groups of 40 and 80 for 32 and 64
# cos(y, y_float): absmax with Gaussian tails rounds most ternary weights to
# 0 (measured 0.52 per tensor); garbage or a sign flip gives <= 0.
MIN_COSINE = {"int2_sym": 0.85, "int2": 0.85, "ternary": 0.8, "ternary_base3": 0.8, "binary": 0.7, "int4": 0.95,
              "int8": 0.95}
MIN_COSINE_ABSMAX = {"int4": 0.97, "int8": 0.999}  # others 0.45; int4 measured >= 0.98


def _close(y, ref, rel=1e-4):
    """|y - ref| <= rel * max|ref|, elementwise."""
    scale = ref.abs().max().clamp(min=1e-12)
    err = (y.float() - ref.float()).abs().max()
    assert err <= rel * scale, f"max error {err.item():.3g} > {rel:g} x {scale.item():.3g}"


def _rel_err(y, ref):
    return ((y - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("granularity,gs", SCALINGS, ids=SC_IDS)
@pytest.mark.parametrize("cls,fmt", CLASS_FORMATS, ids=CF_IDS)
def test_from_linear_matches_reference(gen, cls, fmt, granularity, gs, method, bias):
    gs = fit_group(fmt, gs)
    lin = _float_linear(gen, bias=bias)
    layer = cls.from_linear(lin, format=fmt, group_size=gs, granularity=granularity, method=method)
    assert isinstance(layer, cls) and layer.format == fmt
    assert layer.group_size == (gs if granularity == "group" else 0)
    assert (layer.bias is None) == (not bias)
    x = torch.randn(2, 5, K_IN, generator=gen)
    y = layer(x)
    assert y.shape == (2, 5, M_OUT) and y.dtype == torch.float32
    w = layer.dequantize()
    _close(y, ops.reference_linear(x, w, layer.bias))
    layer.force_reference = True
    _close(layer(x), y)
    # Quantisation error against the float layer stays bounded.
    y_float = F.linear(x, lin.weight, lin.bias).detach()
    bound = QUANT_ERR[fmt][method]
    if bound is not None:
        assert _rel_err(y, y_float) < bound
    min_cos = MIN_COSINE_ABSMAX.get(fmt, 0.45) if method == "absmax" else MIN_COSINE[fmt]
    assert F.cosine_similarity(y.flatten(), y_float.flatten(), dim=0) > min_cos
    # The scales have the granularity asked for.
    _, scales = layer.unpack()
    G = n_groups(layer.group_size, K_IN)
    assert scales.shape == (M_OUT, G)
    if granularity == "tensor":
        assert (scales == scales[0, 0]).all()


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "op"])
@pytest.mark.parametrize("cls,fmt", CLASS_FORMATS, ids=CF_IDS)
def test_every_token_count_matches_reference(gen, cls, fmt, eager):
    """One token (decode: the modules' eager C call, the one-token kernels
    and 1-bit lookup tables), 2-4 tokens, and 16 or more (the AMX GEMM where
    it runs), as a vector, a row and a batch, fp32 and bf16: each against
    F.linear on the dequantized weight of the fake-quantized input. M = 90
    ends in a panel of two 16-row tiles."""
    lin, layer = _layer(gen, cls, fmt, gs=32, M=90)
    w = layer.dequantize()
    with torch.no_grad(), ulbtorch.runtime.use_eager_fast_path(eager):
        for shape in [(K_IN,), (1, K_IN), (1, 1, K_IN), (2, K_IN), (3, K_IN), (4, K_IN), (16, K_IN), (17, K_IN)]:
            for dtype in (torch.float32, torch.bfloat16):
                x = torch.randn(shape, generator=gen).to(dtype)
                y = layer(x)
                assert y.shape == (*shape[:-1], 90) and y.dtype == dtype
                ref = F.linear(ops.fake_quantize_activations(x), w, layer.bias.float()).to(dtype)
                _close(y, ref, rel=1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("gs", [0, 32])
@pytest.mark.parametrize("cls,fmt", CLASS_FORMATS, ids=CF_IDS)
def test_from_codes_and_dequantize(gen, cls, fmt, gs):
    gs = fit_group(fmt, gs)
    f = get_format(fmt)
    codes = torch.randint(0, f.max_code + 1, (M_OUT, K_IN), generator=gen, dtype=torch.uint8)
    G = n_groups(gs, K_IN)
    scales = torch.rand(M_OUT, G, generator=gen) + 0.1
    bias = torch.randn(M_OUT, generator=gen)
    layer = cls.from_codes(codes, scales, format=fmt, group_size=gs, bias=bias)
    # Independent dequantisation: level(code) * scale of the column's group.
    levels = torch.tensor([f.level_a * q + f.level_b for q in range(f.max_code + 1)], dtype=torch.float32)
    group_of_col = torch.arange(K_IN) // (gs or K_IN)
    want = levels[codes.long()] * scales[:, group_of_col]
    assert torch.equal(layer.dequantize(), want)
    c2, s2 = ops.unpack(layer.packed)
    assert torch.equal(c2, codes) and torch.equal(s2, scales)
    assert torch.equal(layer.dequantize(), ops.dequantize(c2, s2, fmt, gs))
    assert torch.equal(layer.bias, bias)
    x = torch.randn(4, K_IN, generator=gen)
    _close(layer(x), ops.reference_linear(x, want, bias))


@pytest.mark.parametrize("cls,fmt", CLASS_FORMATS, ids=CF_IDS)
def test_extra_repr(gen, cls, fmt):
    _, layer = _layer(gen, cls, fmt, gs=64)
    r = repr(layer)
    assert f"format={fmt}" in r and f"group_size={fit_group(fmt, 64)}" in r
    assert f"in_features={K_IN}" in r and f"out_features={M_OUT}" in r
    _, layer = _layer(gen, cls, fmt, gs=0)
    r = repr(layer)
    assert f"format={fmt}" in r and "group_size=" not in r and "channel" in r


@pytest.mark.parametrize("granularity,gs", SCALINGS, ids=SC_IDS)
@pytest.mark.parametrize("cls,fmt", CLASS_FORMATS, ids=CF_IDS)
def test_state_dict_safetensors_round_trip(gen, tmp_path, cls, fmt, granularity, gs):
    gs = fit_group(fmt, gs)
    lin = _float_linear(gen)
    layer = cls.from_linear(lin, format=fmt, group_size=gs, granularity=granularity)
    path = str(tmp_path / "layer.safetensors")
    save_file(layer.state_dict(), path)
    fresh = cls(K_IN, M_OUT, True, format=fmt, group_size=layer.group_size)
    with pytest.raises(RuntimeError, match="no packed weights"):
        fresh.dequantize()
    fresh.load_state_dict(load_file(path))
    assert torch.equal(fresh.packed, layer.packed)
    x = torch.randn(6, K_IN, generator=gen)
    assert torch.equal(fresh(x), layer(x))
    assert torch.equal(fresh.dequantize(), layer.dequantize())


def test_dequantized_cache_is_not_saved_or_copied(gen):
    """The reference path caches the fp32 weight (16x the packed bytes); a
    pickled, saved or copied layer leaves it behind (its untyped storage did
    not even pickle)."""
    import copy
    import io
    import pickle
    _, layer = _layer(gen)
    fresh = io.BytesIO()
    torch.save(layer, fresh)
    layer.force_reference = True
    y = layer(torch.randn(2, K_IN, generator=gen))
    assert layer._dequant_cache is not None
    again = pickle.loads(pickle.dumps(layer))
    assert again._dequant_cache is None and torch.equal(again.packed, layer.packed)
    assert torch.equal(again(torch.zeros(2, K_IN)), layer(torch.zeros(2, K_IN)))
    saved = io.BytesIO()
    torch.save(layer, saved)
    assert saved.tell() < fresh.tell() + 1024, (saved.tell(), fresh.tell())
    assert copy.deepcopy(layer)._dequant_cache is None and layer._dequant_cache is not None
    assert y.shape == (2, M_OUT)


def test_load_state_dict_rejects_other_format_or_shape(gen):
    _, layer = _layer(gen, Linear2Bit, "int2_sym", gs=32)
    sd = layer.state_dict()
    for other in (Linear2Bit(K_IN, M_OUT, True, format="int2", group_size=32),  # format
                  Linear2Bit(K_IN, M_OUT, True, format="int2_sym", group_size=64),  # group size
                  Linear2Bit(K_IN + 16, M_OUT, True, format="int2_sym", group_size=32)):  # shape
        before = other.packed.clone()
        with pytest.raises(RuntimeError, match="packed weight is"):
            other.load_state_dict(sd)
        assert torch.equal(other.packed, before)
    # A different out_features fails on the blob (or on the bias shape).
    with pytest.raises(RuntimeError, match="packed|size mismatch"):
        Linear2Bit(K_IN, M_OUT + 1, True, format="int2_sym", group_size=32).load_state_dict(sd)


@pytest.mark.parametrize("cls,fmt", CLASS_FORMATS, ids=CF_IDS)
def test_empty_batch(gen, cls, fmt):
    _, layer = _layer(gen, cls, fmt)
    for shape in ((0, K_IN), (3, 0, K_IN)):
        x = torch.randn(shape)
        y = layer(x)
        assert y.shape == (*shape[:-1], M_OUT) and y.dtype == torch.float32
        layer.force_reference = True
        assert layer(x).shape == y.shape
        layer.force_reference = False


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("cls,fmt", CLASS_FORMATS, ids=CF_IDS)
def test_half_precision_inputs(gen, cls, fmt, dtype):
    _, layer = _layer(gen, cls, fmt)
    x = torch.randn(7, K_IN, generator=gen).to(dtype)
    y = layer(x)
    assert y.dtype == dtype and y.shape == (7, M_OUT)
    ref = ops.reference_linear(x, layer.dequantize(), layer.bias)
    assert ref.dtype == dtype
    # Both sides compute in fp32 and round once to the half type: at most a
    # couple of its ulps apart at the largest output (fp16 2^-10, bf16 2^-7).
    rel = 2e-3 if dtype == torch.float16 else 1e-2
    _close(y, ref, rel=rel)
    layer.force_reference = True
    assert layer(x).dtype == dtype
    _close(layer(x), y, rel=rel)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("cls,fmt", CLASS_FORMATS, ids=CF_IDS)
def test_backward_goes_straight_through_the_activation_rounding(gen, cls, fmt, dtype):
    """With autograd recording, kernel and reference paths give dx = dy W and
    db = sum(dy) (W dequantised; the int8 rounding passed straight through),
    and the forward values are those of inference."""
    _, layer = _layer(gen, cls, fmt)
    layer.bias.requires_grad_(True)
    x0 = torch.randn(2, 3, K_IN, generator=gen).to(dtype)
    gy = torch.randn(2, 3, M_OUT, generator=gen)
    W = layer.dequantize()
    with torch.no_grad():
        y_inference = layer(x0)
    for reference in (False, True):
        layer.force_reference = reference
        x = x0.clone().requires_grad_(True)
        y = layer(x)
        if not reference:
            assert torch.equal(y, y_inference)
        y.backward(gy.to(dtype))
        want = (gy.to(dtype).float() @ W).to(dtype)
        _close(x.grad, want, rel=1e-2 if dtype != torch.float32 else 1e-6)
        _close(layer.bias.grad, gy.to(dtype).float().sum((0, 1)), rel=1e-2 if dtype != torch.float32 else 1e-6)
        layer.bias.grad = None
    layer.force_reference = False


@pytest.mark.parametrize("reference", [False, True], ids=["kernel", "reference"])
@pytest.mark.parametrize("cls,fmt", [(Linear2Bit, "int2_sym"), (Linear1Bit, "binary"), (Linear8Bit, "int8")],
                         ids=["int2_sym", "binary", "int8"])
def test_forward_mode_and_vmap_transforms(gen, cls, fmt, reference):
    """Forward-mode AD (dual tensors, torch.func.jvp / jacfwd), vmap and
    per-sample gradients through a layer: tangents go straight through the
    activation rounding like gradients, dy = dx W^T + db. The kernel call
    once dropped the tangent (jacfwd all zeros) and vmap of grad raised."""
    import torch.autograd.forward_ad as fwAD
    from torch import func

    _, layer = _layer(gen, cls, fmt)
    layer.force_reference = reference
    W = layer.dequantize()
    x, t = torch.randn(3, K_IN, generator=gen), torch.randn(3, K_IN, generator=gen)
    with fwAD.dual_level():
        tangent = fwAD.unpack_dual(layer(fwAD.make_dual(x, t))).tangent
    assert tangent is not None
    _close(tangent, t @ W.t(), rel=1e-5)
    y, jt = func.jvp(layer, (x,), (t,))
    _close(jt, t @ W.t(), rel=1e-5)
    assert torch.equal(y, layer(x))
    _close(func.jacfwd(layer)(x[0]), W, rel=1e-5)
    _close(func.jacrev(layer)(x[0]), W, rel=1e-5)
    assert torch.equal(func.vmap(layer)(x), layer(x))
    per_sample = func.vmap(func.grad(lambda xi: layer(xi).sum()))(x)
    _close(per_sample, W.sum(0).expand(3, -1), rel=1e-5)


def test_backward_uses_the_weight_of_the_forward_pass(gen):
    """As autograd saves nn.Linear's weight: the packed weight of the forward
    pass, whatever blob the layer holds by backward; one changed in place
    (load_state_dict) is an error. Backward once read whatever it held then."""
    _, layer = _layer(gen)
    _, other = _layer(gen)
    W = layer.dequantize()
    x = torch.randn(3, K_IN, generator=gen, requires_grad=True)
    y = layer(x)
    layer.packed = other.packed.clone()  # a new blob in its place
    y.sum().backward()
    _close(x.grad, W.sum(0).expand(3, -1), rel=1e-6)
    y = layer(x)
    layer.load_state_dict(other.state_dict())  # in place
    with pytest.raises(RuntimeError, match="modified by an inplace operation: the packed weight of a Linear2Bit"):
        y.sum().backward()


@pytest.mark.parametrize("cls,fmt", CLASS_FORMATS, ids=CF_IDS)
def test_torch_func_grad_matches_autograd(gen, cls, fmt):
    """torch.func.grad (functorch) through a layer: the kernel and reference
    paths give the gradient that backward() does (an autograd.Function
    without setup_context was refused by the transform)."""
    _, layer = _layer(gen, cls, fmt)
    x0 = torch.randn(3, K_IN, generator=gen)
    for reference in (False, True):
        layer.force_reference = reference
        x = x0.clone().requires_grad_(True)
        layer(x).pow(2).sum().backward()
        assert torch.equal(torch.func.grad(lambda t: layer(t).pow(2).sum())(x0), x.grad)
    layer.force_reference = False


def test_bf16_module(gen):
    """model.to(bfloat16): the bias turns bf16, the packed bytes must not change."""
    _, layer = _layer(gen, LinearTernary, "ternary")
    packed = layer.packed.clone()
    x = torch.randn(3, K_IN, generator=gen)
    y32 = layer(x)
    layer.to(torch.bfloat16)
    assert layer.packed.dtype == torch.uint8 and torch.equal(layer.packed, packed)
    assert layer.bias.dtype == torch.bfloat16
    y = layer(x.to(torch.bfloat16))
    assert y.dtype == torch.bfloat16
    _close(y, y32, rel=2e-2)


def test_module_without_weights_raises_clearly():
    layer = Linear1Bit(64, 8, False)
    with pytest.raises(RuntimeError, match="no packed weights"):
        layer.dequantize()
    for x in (torch.randn(2, 64), torch.randn(2, 64).to(torch.bfloat16), torch.randn(2, 64).half()):
        with pytest.raises(RuntimeError, match="no packed weights"):  # the kernel path
            layer(x)
    with torch.enable_grad(), pytest.raises(RuntimeError, match="no packed weights"):
        layer(torch.randn(2, 64, requires_grad=True))
    layer.force_reference = True
    with pytest.raises(RuntimeError, match="no packed weights"):
        layer(torch.randn(2, 64))


def test_module_argument_errors(gen):
    codes = torch.randint(0, 4, (8, 64), generator=gen, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"bias must be a floating-point tensor of shape \(8,\)"):
        Linear2Bit.from_codes(codes, torch.ones(8, 1), bias=torch.zeros(11))
    with pytest.raises(ValueError, match="bias must be a floating-point tensor"):
        Linear2Bit.from_codes(codes, torch.ones(8, 1), bias=torch.zeros(8, dtype=torch.int64))
    with pytest.raises(ValueError, match="codes must be 2-D"):
        Linear2Bit.from_codes(codes.flatten(), torch.ones(8, 1))
    with pytest.raises(ValueError, match="granularity must be one of"):
        Linear2Bit(64, 8, granularity="bogus")
    with pytest.raises(ValueError, match="granularity 'channel' does not fit group_size=32"):
        Linear2Bit(64, 8, group_size=32, granularity="channel")
    layer = Linear2Bit.from_codes(codes, torch.ones(8, 1))
    with pytest.raises(ValueError, match="expects 64 input features"):
        layer(torch.tensor(1.0))


@pytest.mark.parametrize("cls", [Linear2Bit, LinearTernary, Linear1Bit, Linear4Bit, Linear8Bit])
def test_class_default_format(gen, cls):
    layer = cls.from_linear(_float_linear(gen))
    assert layer.format == cls.FORMATS[0] and isinstance(layer, LowBitLinear)
    assert layer.granularity == "channel" and layer.group_size == 0


def test_reference_path_sees_new_weights(gen):
    """The pure-PyTorch path caches the dequantised weight; replacing or
    editing the packed blob must never leave it stale."""
    def want(src):
        return F.linear(ops.fake_quantize_activations(x), src.dequantize(), src.bias)

    layer, b, c, d = (_layer(gen, gs=0)[1] for _ in range(4))
    layer.force_reference = True
    x = torch.randn(3, K_IN, generator=gen)
    assert torch.equal(layer(x), want(layer)) and torch.equal(layer(x), want(layer))  # the second from the cache
    layer.load_state_dict(b.state_dict())  # another blob, loaded into this layer
    assert torch.equal(layer(x), want(b))
    layer.packed, layer.bias = c.packed.clone(), c.bias  # a new tensor
    assert torch.equal(layer(x), want(c))
    with torch.no_grad():
        layer.packed.copy_(d.packed)  # edited in place
    layer.bias = d.bias
    assert torch.equal(layer(x), want(d))
    for src in (b, c):  # storage swapped under the same tensor object (no _version bump)
        layer.packed.data = src.packed.clone()
        layer.bias = src.bias
        assert torch.equal(layer(x), want(src))


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


@pytest.mark.parametrize("cls,fmt", CLASS_FORMATS, ids=CF_IDS)
def test_meta_layer_gives_meta_output(gen, cls, fmt):
    """A layer moved to meta computes shapes, as nn.Linear does there."""
    _, layer = _layer(gen, cls, fmt, gs=0)
    layer = layer.to("meta")
    for x in (torch.randn(3, K_IN, device="meta"), torch.randn(2, 3, K_IN, device="meta", dtype=torch.bfloat16)):
        y = layer(x)
        assert y.device.type == "meta" and y.shape == (*x.shape[:-1], M_OUT) and y.dtype == x.dtype
    with pytest.raises(ValueError, match="input features"):
        layer(torch.randn(3, K_IN + 1, device="meta"))


def test_from_linear_refuses_meta_weights():
    with pytest.raises(ValueError, match="meta device.*nothing to quantize"):
        Linear2Bit.from_linear(torch.nn.Linear(K_IN, M_OUT, device="meta"))


def test_blob_of_another_format_copied_in_place_is_refused(gen):
    """A same-size ternary blob written into a Linear2Bit's packed bytes:
    dequantize() (and so the reference path and backward) refuses it rather
    than reading ternary codes as int2_sym levels."""
    _, layer = _layer(gen, Linear2Bit, "int2_sym")
    other = LinearTernary.from_linear(_float_linear(gen), group_size=32).packed
    assert other.shape == layer.packed.shape
    layer.packed.copy_(other)
    with pytest.raises(RuntimeError, match="overwritten in place.*'ternary'.*'int2_sym'"):
        layer.dequantize()


@pytest.mark.parametrize("shape", [(K_IN, 0), (0, M_OUT)])
def test_from_linear_refuses_empty_layers(shape):
    with pytest.raises(ValueError, match="in_features=.*out_features=.*at least 1"):
        Linear2Bit.from_linear(torch.nn.Linear(*shape))


@pytest.mark.parametrize("granularity", ["channel", "tensor"])
def test_from_linear_group_size_needs_group_granularity(gen, granularity):
    """As the constructor and QuantConfig: a group size with another
    granularity is an error, not silently dropped."""
    lin = _float_linear(gen)
    with pytest.raises(ValueError, match="group_size=32 needs granularity='group'"):
        Linear2Bit.from_linear(lin, group_size=32, granularity=granularity)
    with pytest.raises(ValueError, match="granularity"):
        Linear2Bit(K_IN, M_OUT, group_size=32, granularity=granularity)
    assert Linear2Bit.from_linear(lin, group_size=32, granularity="group").group_size == 32


@pytest.mark.parametrize("cls,fmt", CLASS_FORMATS, ids=CF_IDS)
def test_forward_takes_input_keyword(gen, cls, fmt):
    """nn.Linear's forward names its argument `input`; so do ours."""
    _, layer = _layer(gen, cls, fmt)
    x = torch.randn(2, K_IN, generator=gen)
    assert torch.equal(layer(input=x), layer(x))
    lin = torch.nn.Linear(K_IN, M_OUT).bfloat16()
    bf16 = LinearBF16.from_linear(lin)
    xb = x[:1].bfloat16()
    assert torch.equal(bf16(input=xb), bf16(xb))


def test_reading_weight_of_a_packed_layer_says_what_to_do():
    """Models that read a linear layer's .weight (Jamba's dt_proj, for a
    matmul) failed with "no attribute 'weight'"."""
    layer = Linear2Bit.from_linear(torch.nn.Linear(64, 32))
    with pytest.raises(AttributeError, match=r"Linear2Bit holds packed weights, not a float `weight`: .*"
                                             r"exclude=\[\.\.\., '<its name>'\]\).*layer.dequantize\(\)"):
        layer.weight
    assert not hasattr(layer, "weight") and getattr(layer, "weight", None) is None
    with pytest.raises(AttributeError, match="'Linear2Bit' object has no attribute 'other'"):
        layer.other


@pytest.mark.parametrize("cls,fmt", CLASS_FORMATS, ids=CF_IDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast_runs_in_its_dtype_like_nn_linear(gen, cls, fmt, dtype):
    """Under CPU autocast nn.Linear casts input and bias to the autocast
    dtype and returns it; the low-bit layers do the same (the module call,
    the op, and a compiled layer), fp16 through fp32 as fp16 inputs run
    (it returned bf16 under an fp16 autocast)."""
    _, layer = _layer(gen, cls, fmt)
    x = torch.randn(3, K_IN, generator=gen)
    if dtype == torch.float16:
        want = torch.ops.ulb.linear(x.half().float(), layer.packed, layer.bias.half().float(), M_OUT).half()
    else:
        want = torch.ops.ulb.linear(x.bfloat16(), layer.packed, layer.bias.bfloat16(), M_OUT)
    with torch.autocast("cpu", dtype=dtype):
        assert torch.nn.Linear(K_IN, M_OUT)(x).dtype == dtype
        y = layer(x)
        y_op = torch.ops.ulb.linear(x, layer.packed, layer.bias, M_OUT)
    assert y.dtype == dtype and torch.equal(y, want) and torch.equal(y_op, want)
    with torch.autocast("cpu", dtype=dtype), pytest.raises((TypeError, RuntimeError), match="float32 or bfloat16"):
        torch.ops.ulb.linear(x.to(torch.int32), layer.packed, layer.bias, M_OUT)  # not cast: refused


def test_autocast_fp16_compiled(gen):
    """The autocast rule traces: a compiled layer under an fp16 autocast
    returns fp16, equal to eager but for the rounding of x to fp16, which
    inductor does not emulate inside its fused casts (so a few activations
    round to the next int8 step)."""
    _, layer = _layer(gen)
    x = torch.randn(3, K_IN, generator=gen)
    with torch.autocast("cpu", dtype=torch.float16):
        y = layer(x)
        torch._dynamo.reset()
        y_comp = torch.compile(layer, fullgraph=True)(x)
    assert y_comp.dtype == torch.float16
    torch.testing.assert_close(y_comp, y, rtol=0, atol=1e-2 * y.abs().max().item())


def test_load_state_dict_takes_a_strided_blob(gen):
    """Copied in like any tensor (nn.Linear takes strided weights); it was
    refused as 'not contiguous'."""
    _, layer = _layer(gen)
    _, other = _layer(gen)
    blob = other.packed
    strided = torch.stack([blob, torch.zeros_like(blob)], 1)[:, 0]
    assert not strided.is_contiguous()
    layer.load_state_dict({"packed": strided, "bias": other.bias})
    assert layer.packed.is_contiguous() and torch.equal(layer.packed, blob)
    x = torch.randn(2, K_IN, generator=gen)
    assert torch.equal(layer(x), other(x))


# ---- bad input ------------------------------------------------------------------------------------

M, K = 8, 64  # the layer the bad-input tests build: 8 outputs, 64 inputs


def test_module_wrong_in_features():
    layer = Linear2Bit.from_linear(torch.nn.Linear(K, M))
    with pytest.raises(ValueError, match="Linear2Bit expects 64 input features, got input of shape"):
        layer(torch.randn(2, 60))
    layer.force_reference = True
    with pytest.raises(ValueError, match="expects 64 input features"):
        layer(torch.randn(2, 60))


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool])
def test_module_integer_input_rejected(dtype):
    """nn.Linear refuses integer input; a quantised layer must not silently
    cast it to float and truncate the output back to integers."""
    layer = Linear2Bit.from_linear(torch.nn.Linear(K, M))
    with pytest.raises((TypeError, RuntimeError), match="(?i)dtype|float"):
        layer(torch.ones(2, K, dtype=dtype))


@pytest.mark.parametrize("args", [(128.0, 64), (128, 64.0), (True, 64), ("128", 64)])
def test_layer_features_must_be_ints(args):
    with pytest.raises(TypeError, match="features must be an int"):
        ulbtorch.nn.Linear2Bit(*args)


def test_the_base_layer_names_the_real_ones():
    from ulbtorch.nn.linear import LowBitLinear
    with pytest.raises(TypeError, match="Linear2Bit"):
        LowBitLinear(K, M)


def test_meta_input_to_a_module_gives_the_output_shape():
    """Shape inference on meta inputs runs the reference path; its bias
    followed the module's device and the call failed with a device clash."""
    layer = Linear2Bit.from_linear(torch.nn.Linear(K, M))
    y = layer(torch.randn(3, K, device="meta"))
    assert y.is_meta and y.shape == (3, M)


def test_load_state_dict_of_another_format():
    src = LinearTernary.from_linear(torch.nn.Linear(K, M))
    dst = Linear2Bit(K, M, True, format="int2")
    before = dst.packed.clone()
    with pytest.raises(RuntimeError, match="packed weight is .*'format': 'ternary'.* but the layer is .*'int2'"):
        dst.load_state_dict(src.state_dict())
    assert torch.equal(dst.packed, before)
    with pytest.raises(RuntimeError, match="no packed weights"):
        dst.dequantize()


def test_load_state_dict_of_garbage():
    dst = Linear2Bit(K, M, True)
    sd = Linear2Bit.from_linear(torch.nn.Linear(K, M)).state_dict()
    sd["packed"] = torch.randint(0, 256, (sd["packed"].numel(),), dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="not a valid ulbtorch packed weight"):
        dst.load_state_dict(sd)
    sd["packed"] = torch.zeros(10)
    with pytest.raises(RuntimeError, match="packed weight must be the 1-D uint8 tensor"):
        dst.load_state_dict(sd)


def test_assigning_a_blob_of_another_format_or_group_size():
    """layer.packed = blob is checked like load_state_dict: the kernel follows
    the blob's header, dequantize() and the reference path the layer's."""
    lin = torch.nn.Linear(K, M)
    dst = Linear2Bit(K, M, True)
    for src in (Linear2Bit.from_linear(lin, group_size=32), Linear1Bit.from_linear(lin),
                Linear2Bit.from_linear(torch.nn.Linear(K + 32, M))):
        with pytest.raises(ValueError, match=r"Linear2Bit.packed: packed weight is .* but the layer is"):
            dst.packed = src.packed.clone()
    with pytest.raises(ValueError, match="not a valid ulbtorch packed weight"):
        dst.packed = torch.randint(0, 256, dst.packed.shape, dtype=torch.uint8)
    same = Linear2Bit.from_linear(lin)
    dst.packed = same.packed.clone()  # same geometry: taken
    assert torch.equal(dst.dequantize(), same.dequantize())


def test_from_codes_refuses_a_meta_bias():
    with pytest.raises(ValueError, match="meta"):
        Linear2Bit.from_codes(torch.zeros(M, K, dtype=torch.uint8), torch.ones(M, 1), bias=torch.zeros(M, device="meta"))


def test_reference_path_of_a_layer_made_in_inference_mode():
    with torch.inference_mode():
        layer = Linear2Bit.from_linear(torch.nn.Linear(K, M))
        x = torch.randn(3, K)
        kernel = layer(x)
        layer.force_reference = True
        ref = layer(x)
    torch.testing.assert_close(ref, kernel, rtol=1e-4, atol=1e-4)
    # No gradient through a weight made in inference mode, as nn.Linear's:
    # the kernel's autograd function says so, the reference path's F.linear too.
    for reference in (False, True):
        layer.force_reference = reference
        with pytest.raises(RuntimeError, match="made in inference mode|Inference tensors"):
            layer(torch.randn(3, K, requires_grad=True))


def test_binary_absmean_of_huge_finite_weights():
    """mean|W| of finite weights can overflow fp32; the scale stays finite."""
    lin = torch.nn.Linear(64, 70)
    with torch.no_grad():
        lin.weight.fill_(3e38)
        lin.weight[1::2] *= -1
    w = Linear1Bit.from_linear(lin).dequantize()
    assert torch.isfinite(w).all()
    assert torch.allclose(w, lin.weight, rtol=1e-6)

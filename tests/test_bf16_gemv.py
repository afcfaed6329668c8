"""torch.ops.ulb.linear_bf16: the one-token GEMV over a plain bf16 weight.
Every ISA equals the scalar reference bit for bit; all agree with a float64
F.linear within the fp32 summation bound; bad input is a clear error."""
import copy

import pytest
import torch
import torch.nn.functional as F

import ulbtorch
from ulbtorch import ops, runtime
from ulbtorch.nn import LinearBF16

ISAS = runtime.supported_isas()
MS = (1, 7, 33, 100, 1000)
KS = (1, 16, 33, 257, 4097)


def _case(gen, M, K, N=1, bias_dtype=None):
    w = torch.randn(M, K, generator=gen).to(torch.bfloat16)
    x = torch.randn(N, K, generator=gen).to(torch.bfloat16)
    b = None if bias_dtype is None else torch.randn(M, generator=gen).to(bias_dtype)
    return x, w, b


def _check_close(y, x, w, b):
    """|y - exact| within the fp32 summation bound (K + 2 roundings of the
    sum of |products|), plus the output rounding when y is bf16."""
    xd, wd = x.double(), w.double()
    exact = F.linear(xd, wd, None if b is None else b.double())
    mag = F.linear(xd.abs(), wd.abs(), None if b is None else b.double().abs())
    bound = (w.shape[1] + 2) * 2.0 ** -24 * mag + 1e-30
    if y.dtype == torch.bfloat16:
        bound = bound + 2.0 ** -8 * exact.abs()
    err = (y.double() - exact).abs()
    assert (err <= bound).all(), f"max error {err.max().item():.3g} exceeds the bound"


@pytest.mark.parametrize("M", MS)
@pytest.mark.parametrize("K", KS)
def test_every_isa_matches_scalar(gen, M, K):
    x, w, b = _case(gen, M, K, N=2)
    with runtime.use_isa("scalar"):
        want = torch.ops.ulb.linear_bf16(x, w, b)
    _check_close(want, x, w, b)
    for isa in ISAS:
        with runtime.use_isa(isa):
            got = torch.ops.ulb.linear_bf16(x, w, b)
        # Bits, not values: torch.equal takes -0.0 for +0.0.
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)), \
            f"{isa} differs from the scalar reference at M={M} K={K}"


@pytest.mark.parametrize("bias_dtype", [None, torch.float32, torch.bfloat16])
def test_bias(gen, bias_dtype):
    x, w, b = _case(gen, 130, 300, N=3, bias_dtype=bias_dtype)
    y = ops.linear_bf16(x, w, b)
    assert y.dtype == torch.bfloat16 and y.shape == (3, 130)
    _check_close(y, x, w, b)
    with runtime.use_isa("scalar"):
        assert torch.equal(y, ops.linear_bf16(x, w, b))


def test_signed_zero_and_special_values():
    w = torch.zeros(4, 40, dtype=torch.bfloat16)
    w[1, 3] = float("inf")
    w[2, 39] = float("nan")
    x = -torch.zeros(1, 40, dtype=torch.bfloat16)
    x[0, 3] = 2.0
    for isa in ISAS:
        with runtime.use_isa(isa):
            y = ops.linear_bf16(x, w)
        with runtime.use_isa("scalar"):
            want = ops.linear_bf16(x, w)
        nan = want.isnan()
        assert torch.equal(y.isnan(), nan)
        # Bits, not values: == and torch.equal take -0.0 for +0.0.
        assert torch.equal(y.view(torch.int16)[~nan], want.view(torch.int16)[~nan])
        assert y[0, 1] == float("inf") and y[0, 2].isnan() and y[0, 0] == 0


def test_leading_dims_strided_input_and_weight_view(gen):
    w_big = torch.randn(50, 80, generator=gen).to(torch.bfloat16)
    w = w_big[:, 10:74]  # rows with a stride longer than K
    x = torch.randn(2, 3, 128, generator=gen).to(torch.bfloat16)[..., ::2]
    y = ops.linear_bf16(x, w)
    assert y.shape == (2, 3, 50)
    assert torch.equal(y, ops.linear_bf16(x.contiguous(), w.contiguous()))
    _check_close(y.reshape(6, 50), x.reshape(6, 64), w, None)


def test_threads_do_not_change_the_result(gen):
    x, w, b = _case(gen, 3000, 520, bias_dtype=torch.float32)
    prev = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = ops.linear_bf16(x, w, b)
        torch.set_num_threads(2)
        assert torch.equal(ops.linear_bf16(x, w, b), one)
        stats = runtime.scheduler_stats(16)  # the bf16 GEMV's own split table
        assert stats["calls"] >= 1 and stats["nthreads"] == 2 and abs(sum(stats["ratio"]) - 1) < 1e-9
    finally:
        torch.set_num_threads(prev)


def test_empty_batch():
    w = torch.ones(5, 8, dtype=torch.bfloat16)
    assert ops.linear_bf16(torch.empty(0, 8, dtype=torch.bfloat16), w).shape == (0, 5)


def test_bad_input():
    w = torch.ones(5, 8, dtype=torch.bfloat16)
    x = torch.ones(1, 8, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="weight must be a 2-D bfloat16 tensor, got float32"):
        torch.ops.ulb.linear_bf16(x, w.float(), None)
    with pytest.raises(RuntimeError, match="weight rows must be contiguous"):
        torch.ops.ulb.linear_bf16(x[:, :5], w.t(), None)
    with pytest.raises(RuntimeError, match="with 1 dims"):
        torch.ops.ulb.linear_bf16(x, w[0], None)
    with pytest.raises(RuntimeError, match="input has 7 features but the weight expects 8"):
        torch.ops.ulb.linear_bf16(x[:, :7], w, None)
    with pytest.raises(RuntimeError, match="input must be bfloat16 like the weight, got float32"):
        torch.ops.ulb.linear_bf16(x.float(), w, None)
    with pytest.raises(RuntimeError, match=r"bias must have shape \[5\]"):
        torch.ops.ulb.linear_bf16(x, w, torch.ones(4))
    with pytest.raises(RuntimeError, match="no input features"):
        torch.ops.ulb.linear_bf16(x[:, :0], torch.ones(5, 0, dtype=torch.bfloat16), None)
    with pytest.raises(ValueError, match="runs on CPU; input is on meta"):
        ops.linear_bf16(x.to("meta"), w)
    with pytest.raises(TypeError, match="input must be bfloat16 like the weight"):
        ops.linear_bf16(x.float(), w)


def test_linear_bf16_ignores_strides_of_size_one_dims():
    """Contiguous by PyTorch's rules, refused before: a [1, K] weight whose
    row stride is 1, and a [M, 1] weight whose column stride is M."""
    for w in (torch.randn(100, 1).bfloat16().t(), torch.randn(1, 70).bfloat16().t()):
        assert w.is_contiguous()
        x = torch.randn(w.shape[1]).bfloat16()
        assert torch.equal(torch.ops.ulb.linear_bf16(x, w, None), torch.ops.ulb.linear_bf16(x, w.clone(), None))
    w = torch.randn(70, 100).bfloat16()[:1].expand(70, 100)  # rows overlap: stride 0
    with pytest.raises(RuntimeError, match=r"rows must be contiguous and not overlap \(strides 0, 1"):
        torch.ops.ulb.linear_bf16(torch.randn(100).bfloat16(), w, None)


def test_fake_impl_traces(gen):
    x, w, b = _case(gen, 20, 48, bias_dtype=torch.bfloat16)
    fn = torch.compile(lambda x: torch.ops.ulb.linear_bf16(x, w, b), fullgraph=True, backend="eager")
    assert torch.equal(fn(x), torch.ops.ulb.linear_bf16(x, w, b))


# ---- nn.LinearBF16 and bf16_gemv_ ---------------------------------------------------------------

def _bf16_linear(gen, K=96, M=40, bias=True):
    lin = torch.nn.Linear(K, M, bias=bias).to(torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(M, K, generator=gen))
    return lin


def test_module_routes_one_token_to_the_gemv(gen):
    lin = _bf16_linear(gen)
    layer = LinearBF16.from_linear(lin)
    assert layer.weight is lin.weight and layer.bias is lin.bias
    assert layer.state_dict().keys() == lin.state_dict().keys()
    x1 = torch.randn(1, 1, 96, generator=gen).to(torch.bfloat16)
    xn = torch.randn(2, 5, 96, generator=gen).to(torch.bfloat16)
    with torch.no_grad():  # inference: the GEMV
        if runtime.bf16_gemv_native:
            assert torch.equal(layer(x1), torch.ops.ulb.linear_bf16(x1, lin.weight, lin.bias))
        _check_close(layer(x1).reshape(1, 40), x1.reshape(1, 96), lin.weight.detach(), lin.bias.detach())
        assert torch.equal(layer(xn), lin(xn))  # prefill: F.linear itself
    with pytest.raises(RuntimeError):  # dtype mismatch, exactly as nn.Linear
        layer(x1.float())


def _ops_run(fn):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return {e.name for e in prof.events()}


@pytest.mark.skipif(not runtime.bf16_gemv_native, reason="no vector ISA: the module runs F.linear")
def test_module_calls_the_gemv_only_where_it_serves(gen):
    """The outputs above cannot tell the GEMV from F.linear (bit-identical at
    this size), so which one ran is read from the profiler."""
    layer = LinearBF16.from_linear(_bf16_linear(gen))
    x1 = torch.randn(1, 96, generator=gen).to(torch.bfloat16)
    with torch.no_grad():
        assert "ulb::linear_bf16" in _ops_run(lambda: layer(x1))
        assert "ulb::linear_bf16" not in _ops_run(lambda: layer(torch.cat([x1, x1])))  # two tokens
    assert "ulb::linear_bf16" not in _ops_run(lambda: layer(x1.requires_grad_()))  # autograd


def test_module_with_overlapping_weight_rows_is_f_linear(gen):
    """An expanded weight (row stride 0) is a valid F.linear operand that the
    GEMV does not take (rows must not overlap): F.linear serves it."""
    layer = LinearBF16.from_linear(_bf16_linear(gen, bias=False))
    layer.weight = torch.nn.Parameter(torch.randn(1, 96, generator=gen).to(torch.bfloat16).expand(40, 96),
                                      requires_grad=False)
    x1 = torch.randn(1, 96, generator=gen).to(torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(layer(x1), F.linear(x1, layer.weight))


def test_module_keeps_autograd_working(gen):
    lin = _bf16_linear(gen)
    layer = LinearBF16.from_linear(lin)
    x1 = torch.randn(1, 96, generator=gen).to(torch.bfloat16)
    y = layer(x1)  # grad enabled, weight requires grad: F.linear, differentiable
    assert y.grad_fn is not None and torch.equal(y, lin(x1))
    y.float().sum().backward()
    assert lin.weight.grad is not None and torch.equal(lin.weight.grad, x1.expand(40, 96).to(lin.weight.grad.dtype))
    with torch.no_grad():
        z = layer(x1)
    if runtime.bf16_gemv_native:
        assert torch.equal(z, torch.ops.ulb.linear_bf16(x1, lin.weight.detach(), lin.bias.detach()))


def test_module_without_a_vector_kernel_is_f_linear(gen):
    lin = _bf16_linear(gen, bias=False)
    layer = LinearBF16.from_linear(lin)
    x1 = torch.randn(1, 96, generator=gen).to(torch.bfloat16)
    with runtime.use_isa("scalar"):
        assert not runtime.bf16_gemv_native
        assert torch.equal(layer(x1), lin(x1))
    native = ("avx2", "avx512", "avxvnni", "amx", "neon", "dotprod", "i8mm")
    assert runtime.bf16_gemv_native == (runtime.get_isa() in native)
    with runtime.use_isa("portable"):  # its bf16 rows are the reference's: F.linear is faster
        assert not runtime.bf16_gemv_native and torch.equal(layer(x1), lin(x1))


def test_module_compiles(gen):
    layer = LinearBF16.from_linear(_bf16_linear(gen))
    x1 = torch.randn(1, 96, generator=gen).to(torch.bfloat16)
    fn = torch.compile(layer, fullgraph=True, backend="eager")
    with torch.no_grad():  # the op path, traced through its fake impl
        assert torch.equal(fn(x1), layer(x1))
    assert torch.equal(fn(x1), layer(x1))  # and the autograd (F.linear) path


def test_quantize_with_bf16_gemv_on_a_hf_model():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=500,
                                   tie_word_embeddings=True)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16).eval()
    stock_lm_head = model.lm_head
    plain = ulbtorch.quantize_(copy.deepcopy(model), bits=2, bf16_gemv=False)
    assert type(plain.lm_head) is torch.nn.Linear
    ulbtorch.quantize_(model, bits=2)  # bf16_gemv is on by default
    assert type(model.lm_head) is LinearBF16
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied
    assert not any(type(m) is torch.nn.Linear for m in model.modules())
    ids = torch.randint(3, 500, (1, 6), generator=torch.Generator().manual_seed(1))
    out = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert out.shape == (1, 10)
    with torch.no_grad():  # the last token's logits, through the GEMV and through F.linear
        h = model.model(out[:, :-1]).last_hidden_state[:, -1:]
        _check_close(model.lm_head(h).reshape(1, -1), h.reshape(1, -1), stock_lm_head.weight, None)
    assert ulbtorch.bf16_gemv_(torch.nn.Sequential(torch.nn.Linear(4, 4)))[0].__class__ is torch.nn.Linear


def test_save_load_quantized_keeps_the_gemv(tmp_path):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=300)
    model = transformers.AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16).eval()
    ulbtorch.quantize_(model, bits=2)
    assert type(model.lm_head) is LinearBF16
    ulbtorch.save_quantized(model, str(tmp_path))
    loaded = ulbtorch.load_quantized(transformers.AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16),
                                     str(tmp_path))
    assert type(loaded.lm_head) is LinearBF16 and torch.equal(loaded.lm_head.weight, model.lm_head.weight)
    plain = ulbtorch.quantize_(transformers.AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16),
                               bits=2, bf16_gemv=False)
    ulbtorch.save_quantized(plain, str(tmp_path / "plain"))
    loaded = ulbtorch.load_quantized(transformers.AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16),
                                     str(tmp_path / "plain"))
    assert type(loaded.lm_head) is torch.nn.Linear


def test_bf16_gemv_include_exclude():
    def model():
        return torch.nn.ModuleDict({"a": torch.nn.Linear(8, 8).to(torch.bfloat16),
                                    "b": torch.nn.Linear(8, 8).to(torch.bfloat16),
                                    "f": torch.nn.Linear(8, 8)})
    m = ulbtorch.bf16_gemv_(model())
    assert [type(m[k]) for k in "abf"] == [LinearBF16, LinearBF16, torch.nn.Linear]  # fp32 stays
    m = ulbtorch.bf16_gemv_(model(), include=["a", "f"])
    assert [type(m[k]) for k in "abf"] == [LinearBF16, torch.nn.Linear, torch.nn.Linear]
    m = ulbtorch.bf16_gemv_(model(), exclude=["a"])
    assert [type(m[k]) for k in "abf"] == [torch.nn.Linear, LinearBF16, torch.nn.Linear]
    m = ulbtorch.bf16_gemv_(model(), exclude="a")  # one string is one pattern, not its characters
    assert [type(m[k]) for k in "abf"] == [torch.nn.Linear, LinearBF16, torch.nn.Linear]
    with pytest.raises(TypeError, match="exclude must be a list of fnmatch patterns"):
        ulbtorch.bf16_gemv_(model(), exclude=[1])


M, K = 8, 64  # the layer the bad-input tests build: 8 outputs, 64 inputs


def test_linear_bf16_module_with_no_inputs_is_f_linear():
    lin = torch.nn.Linear(0, 4, bias=True).bfloat16()
    torch.nn.init.uniform_(lin.bias)
    layer = ulbtorch.nn.LinearBF16.from_linear(lin)
    with torch.no_grad():
        for shape in [(0,), (3, 0)]:
            x = torch.empty(shape, dtype=torch.bfloat16)
            assert torch.equal(layer(x), lin(x))


def test_bf16_layer_refuses_what_nn_linear_refuses():
    from ulbtorch.nn import LinearBF16
    lin = torch.nn.Linear(K, M).to(torch.bfloat16)
    lin.bias = torch.nn.Parameter(torch.randn(M))  # fp32 bias on a bf16 weight
    layer = LinearBF16.from_linear(lin)
    with torch.no_grad():
        for inp in (torch.randn(1, K, dtype=torch.bfloat16), torch.randn(2, K, dtype=torch.bfloat16),
                    torch.tensor(1.0, dtype=torch.bfloat16)):
            with pytest.raises(RuntimeError) as want:
                lin(inp)
            with pytest.raises(RuntimeError) as got:
                layer(inp)
            assert str(got.value) == str(want.value)

"""torch.ops.ulb.linear_many: several layers in one parallel region, each to
the bit as ulb.linear computes it, and the packed experts' use of it."""
import pytest
import torch

import ulbtorch
from ulbtorch import ops, runtime
from ulbtorch.formats import get_format, n_groups, normalize_group_size

ISAS = runtime.supported_isas()
FORMS = ["int2", "int2_sym", "ternary", "binary", "binary:lanes", "int8", "int4"]


def _blob(gen, form, M, K, gs):
    fmt, _, tiles = form.partition(":")
    f = get_format(fmt)
    codes = torch.randint(0, f.max_code + 1, (M, K), generator=gen, dtype=torch.uint8)
    G = n_groups(normalize_group_size(gs, K, fmt), K)
    return ops.pack(codes, torch.rand(M, G, generator=gen) + 0.05, fmt, gs, tiles=tiles or "vnni")


def _layers(gen, form, M, dtype, bias_dtype):
    """Layers of one width and different K, groups and token counts (none,
    one, a GEMM's worth), inputs 2-D, 3-D, strided or a transposed view."""
    specs = [(33, 0, (1, 33)), (257, 32, (0, 257)), (1100, 128, (2, 3, 1100)), (96, 32, (1, 96)),
             (2048, 0, (19, 2048)), (520, 0, (5, 520))]
    xs, blobs, biases = [], [], []
    for i, (K, gs, shape) in enumerate(specs):
        blobs.append(_blob(gen, form, M, K, gs))
        x = torch.randn(*shape, generator=gen).to(dtype)
        if i == 3:
            x = torch.randn(K, 4, generator=gen).to(dtype).t()[1:2]  # one row of a transposed view
        if i == 5:
            x = torch.randn(5, 2 * K, generator=gen).to(dtype)[:, ::2]  # strided columns
        xs.append(x)
        biases.append(None if bias_dtype is None else torch.randn(M, generator=gen).to(bias_dtype))
    return xs, blobs, biases


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("form", FORMS)
def test_equals_linear_on_each_layer(gen, isa, form):
    M = 70
    for dtype, bias_dtype in ((torch.float32, None), (torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16)):
        xs, blobs, biases = _layers(gen, form, M, dtype, bias_dtype)
        with runtime.use_isa(isa):
            want = torch.cat([torch.ops.ulb.linear(x, b, bias, M).reshape(-1, M)
                              for x, b, bias in zip(xs, blobs, biases)])
            for threads in (1, 2):
                torch.set_num_threads(threads)
                got = ops.linear_many(xs, blobs, None if bias_dtype is None else biases, M)
                assert got.dtype == dtype and got.shape == want.shape
                assert torch.equal(got, want), (dtype, bias_dtype, threads)


def test_one_token_through_many_experts(gen):
    """The decode case: one token through eight layers of one shape, the same
    input tensor eight times, on both threads."""
    M, K = 1536, 2048
    blobs = [_blob(gen, "int2", M, K, 128) for _ in range(8)]
    x = torch.randn(1, K, generator=gen).to(torch.bfloat16)
    torch.set_num_threads(2)
    want = torch.cat([torch.ops.ulb.linear(x, b, None, M) for b in blobs])
    assert torch.equal(ops.linear_many([x] * 8, blobs, None, M), want)


def test_fake_and_schema(gen):
    xs, blobs, biases = _layers(gen, "int2", 40, torch.float32, torch.float32)
    torch.library.opcheck(torch.ops.ulb.linear_many, (xs, blobs, biases, 40))
    torch.library.opcheck(torch.ops.ulb.linear_many, (xs, blobs, [], 40))

    @torch.compile(fullgraph=True)
    def f(a, b):
        return torch.ops.ulb.linear_many([a, b], blobs[:2], [], 40) * 2

    assert torch.equal(f(xs[0], xs[1]), 2 * ops.linear_many(xs[:2], blobs[:2], None, 40))


def test_bad_input_is_refused_with_the_layer_named(gen):
    M = 40
    a, b = _blob(gen, "int2", M, 64, 32), _blob(gen, "int2", M, 96, 32)
    x64, x96 = torch.randn(2, 64, generator=gen), torch.randn(1, 96, generator=gen)
    many = torch.ops.ulb.linear_many
    with pytest.raises(RuntimeError, match="layer 1: input has 64 features but the packed weight expects 96"):
        many([x64, x64], [a, b], [], M)
    with pytest.raises(RuntimeError, match="2 inputs for 1 packed weights"):
        many([x64, x96], [a], [], M)
    with pytest.raises(RuntimeError, match="1 biases for 2 packed weights"):
        many([x64, x96], [a, b], [torch.zeros(M)], M)
    with pytest.raises(ValueError, match="at least one layer"):
        ops.linear_many([], [], None, M)
    with pytest.raises(RuntimeError, match="layer 1: input is bfloat16 but layer 0's is float32"):
        many([x64, x96.bfloat16()], [a, b], [], M)
    with pytest.raises(RuntimeError, match="layer 0: out_features=41"):
        many([x64, x96], [a, b], [], M + 1)
    with pytest.raises(RuntimeError, match="layer 1: bias must have shape"):
        many([x64, x96], [a, b], [torch.zeros(M), torch.zeros(M + 1)], M)
    with pytest.raises(RuntimeError, match="layer 1: bias dtype differs"):
        many([x64, x96], [a, b], [torch.zeros(M), torch.zeros(M, dtype=torch.bfloat16)], M)
    with pytest.raises(RuntimeError, match="layer 1: packed weight must be"):
        many([x64, x96], [a, b.view(torch.int8)], [], M)
    bad = b.clone()
    bad[0] ^= 0xFF
    with pytest.raises(RuntimeError, match="layer 1"):
        many([x64, x96], [a, bad], [], M)
    with pytest.raises(RuntimeError, match="layer 1: input must be float32 or bfloat16"):
        many([x64, x96.half()], [a, b], [], M)
    with pytest.raises(TypeError, match="float32 or bfloat16"):
        ops.linear_many([x64, x96.double()], [a, b], None, M)
    with pytest.raises(ValueError, match="runs on CPU"):
        ops.linear_many([x64, x96.to("meta")], [a, b], None, M)


# ---- the packed experts ---------------------------------------------------------

transformers = pytest.importorskip("transformers")


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

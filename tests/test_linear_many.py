"""torch.ops.ulb.linear_many: several layers in one parallel region, each to
the bit as ulb.linear computes it."""
import pytest
import torch

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

"""torch.ops.ulb.* and the wrappers in ulbtorch.ops: vmap over each argument,
and bad input gives a clear Python exception, never garbage or a crash."""
import subprocess
import sys
import textwrap

import pytest
import torch

import ulbtorch
from ulbtorch import ops
from ulbtorch.formats import n_groups
from ulbtorch.nn import Linear1Bit, Linear2Bit, LinearTernary

from _layers import K_IN, _layer

M, K = 8, 64


@pytest.fixture
def blob():
    codes = torch.randint(0, 4, (M, K), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
    return ops.pack(codes, torch.rand(M, 1) + 0.1, "int2_sym")


@pytest.fixture
def x():
    return torch.randn(3, K)


# ---- linear ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype,name", [(torch.float64, "float64"), (torch.float16, "float16"),
                                        (torch.int64, "int64"), (torch.int32, "int32"),
                                        (torch.uint8, "uint8")])
def test_linear_wrong_input_dtype(blob, x, dtype, name):
    with pytest.raises(RuntimeError, match=f"input must be float32 or bfloat16, got {name}"):
        torch.ops.ulb.linear(x.to(dtype), blob, None, M)
    with pytest.raises(TypeError, match="input must be float32 or bfloat16"):
        ops.linear(x.to(dtype), blob, None, M)


def test_linear_wrong_bias(blob, x):
    with pytest.raises(RuntimeError, match=r"bias must have shape \[8\]"):
        torch.ops.ulb.linear(x, blob, torch.zeros(M - 1), M)
    with pytest.raises(RuntimeError, match="bias must be float32 or bfloat16, got float64"):
        torch.ops.ulb.linear(x, blob, torch.zeros(M, dtype=torch.float64), M)


def test_linear_wrong_in_features(blob):
    with pytest.raises(RuntimeError, match="input has 60 features but the packed weight expects 64"):
        torch.ops.ulb.linear(torch.randn(3, 60), blob, None, M)
    with pytest.raises(RuntimeError, match="at least 1 dim"):
        torch.ops.ulb.linear(torch.tensor(1.0), blob, None, M)


def test_linear_wrong_out_features(blob, x):
    with pytest.raises(RuntimeError, match="out_features=9 but the packed weight has 8 rows"):
        torch.ops.ulb.linear(x, blob, None, 9)


@pytest.mark.parametrize("out_features, error", [(True, TypeError), (float(M), TypeError), (0, ValueError),
                                                  (2**63, ValueError)])
def test_linear_refuses_a_bad_out_features(blob, x, out_features, error):
    with pytest.raises(error, match="out_features"):
        ops.linear(x, blob, None, out_features)
    with pytest.raises(error, match="out_features"):
        ops.linear_many([x], [blob], None, out_features)


@pytest.mark.parametrize("call", [
    lambda b, x: ops.linear(x, None, None, M),
    lambda b, x: torch.ops.ulb.linear(None, b, None, M),
    lambda b, x: torch.ops.ulb.pack(None, torch.rand(M, 1), 2, 0),
    lambda b, x: torch.ops.ulb.pack(torch.zeros(M, K, dtype=torch.uint8), None, 2, 0),
    lambda b, x: torch.ops.ulb.quantize_act(x, None),
    lambda b, x: torch.ops.ulb.quantize_act(None, b),
    lambda b, x: torch.ops.ulb.int_dots(b, None, None),
    lambda b, x: ops.linear_bf16(x.bfloat16(), None),
])
def test_none_for_a_tensor_is_named(blob, x, call):
    with pytest.raises(RuntimeError, match=r"must be a tensor, got None"):
        call(blob, x)


@pytest.mark.parametrize("op", ["linear", "linear_many", "linear_bf16"])
def test_public_ops_refuse_inputs_that_need_a_gradient(blob, op):
    x = torch.randn(2, K, requires_grad=True)
    calls = {"linear": lambda: ops.linear(x, blob, None, M),
             "linear_many": lambda: ops.linear_many([x], [blob], None, M),
             "linear_bf16": lambda: ops.linear_bf16(x.bfloat16(), torch.randn(M, K, dtype=torch.bfloat16))}
    with pytest.raises(RuntimeError, match="has no backward"):
        calls[op]()
    with torch.no_grad():
        assert calls[op]().shape == (2, M)


def test_meta_input_to_op_raises(blob, x):
    """A meta input with a real CPU blob cannot be computed: an error, not a
    silently shaped meta result and not a crash."""
    with pytest.raises((RuntimeError, ValueError), match="(?i)device|meta"):
        torch.ops.ulb.linear(x.to("meta"), blob, None, M)
    with pytest.raises(ValueError, match="runs on CPU; input is on meta"):
        ops.linear(x.to("meta"), blob, None, M)
    # A meta bias beside CPU tensors: an error too, not uninitialised memory.
    with pytest.raises(ValueError, match="bias is on meta"):
        torch.ops.ulb.linear(x, blob, torch.zeros(M, device="meta"), M)
    w = torch.randn(M, x.shape[-1]).to(torch.bfloat16)
    with pytest.raises(ValueError, match="bias is on meta"):
        torch.ops.ulb.linear_bf16(x.to(torch.bfloat16), w, torch.zeros(M, device="meta"))
    with pytest.raises(ValueError, match="weight is on meta"):
        torch.ops.ulb.linear_bf16(x.to(torch.bfloat16), w.to("meta"), None)


def test_vmap_of_a_0dim_sample_is_refused(blob):
    with pytest.raises(RuntimeError, match="at least 1 dim"):
        torch.vmap(lambda t: ops.linear(t, blob, None, M))(torch.randn(K))
    assert torch.vmap(lambda t: ops.linear(t, blob, None, M))(torch.randn(5, K)).shape == (5, M)


def test_fakes_refuse_what_the_ops_refuse():
    blob = ops.pack(torch.randint(0, 4, (8, 64), dtype=torch.uint8), torch.rand(8, 1) + 0.1, "int2_sym")
    fake = torch._subclasses.fake_tensor.FakeTensorMode()
    with fake:
        fb = fake.from_tensor(blob)
        for x, what in [(torch.empty((), dtype=torch.float32), "at least 1 dim"),
                        (torch.empty(64, dtype=torch.float16), "float32 or bfloat16, got torch.float16")]:
            with pytest.raises(RuntimeError, match=what):
                torch.ops.ulb.linear(x, fb, None, 8)
        with pytest.raises(RuntimeError, match="2-D bfloat16"):
            torch.ops.ulb.linear_bf16(torch.empty(64, dtype=torch.bfloat16),
                                      torch.empty(64, dtype=torch.bfloat16), None)
        with pytest.raises(RuntimeError, match="bfloat16"):
            torch.ops.ulb.linear_bf16(torch.empty(64), torch.empty(8, 64, dtype=torch.bfloat16), None)


def test_autocast_leaves_float64_to_the_ops_check(blob):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with pytest.raises(RuntimeError, match="float64"):
            torch.ops.ulb.linear(torch.randn(2, K, dtype=torch.float64), blob, None, M)
        assert torch.ops.ulb.linear(torch.randn(2, K), blob, None, M).dtype == torch.bfloat16


def test_vmap_of_the_op_over_each_argument(gen):
    _, layer = _layer(gen)
    blob, M = layer.packed, layer.out_features
    x, biases = torch.randn(4, 2, K_IN, generator=gen), torch.randn(4, M, generator=gen)
    op = torch.ops.ulb.linear
    assert torch.equal(torch.func.vmap(lambda xi: op(xi, blob, None, M), in_dims=1)(x),
                       op(x.movedim(1, 0), blob, None, M))
    got = torch.func.vmap(lambda b: op(x[0], blob, b, M))(biases)
    assert torch.equal(got, torch.stack([op(x[0], blob, b, M) for b in biases]))


# ---- the packed blob ------------------------------------------------------------------------------

def test_packed_not_a_blob(blob, x):
    g = torch.Generator().manual_seed(1)
    random_bytes = torch.randint(0, 256, (blob.numel(),), generator=g, dtype=torch.uint8)
    for bad in (random_bytes, blob[:-4].clone(), blob[:-4], torch.cat([blob, blob[:1]]),
                torch.empty(0, dtype=torch.uint8), blob[:63].clone()):
        with pytest.raises(RuntimeError, match="not a valid ulbtorch packed weight"):
            torch.ops.ulb.linear(x, bad, None, M)
        with pytest.raises(RuntimeError, match="not a valid ulbtorch packed weight"):
            ops.unpack(bad)
    for bad in (blob.float(), blob.view(1, -1), blob.to(torch.int8)):
        with pytest.raises(RuntimeError, match="packed weight must be a 1-D contiguous uint8 tensor"):
            torch.ops.ulb.linear(x, bad, None, M)
    with pytest.raises(RuntimeError, match="1-D contiguous uint8 tensor .* 1 dims, not contiguous"):
        torch.ops.ulb.linear(x, torch.stack([blob, blob], 1)[:, 0], None, M)
    with pytest.raises(TypeError, match="packed weight must be the 1-D uint8 tensor"):
        ops.packed_info(blob.float())
    with pytest.raises(TypeError, match="packed weight must be the 1-D uint8 tensor"):
        ops.unpack(blob.view(1, -1))


@pytest.mark.parametrize("offset,value,what", [(0, 0x00, "magic"), (4, 0x04, "version"),
                                               (6, 0x09, "format id"), (6, 0x04, "format of another size"),
                                               (8, 0x20, "M"), (16, 0x50, "K"), (24, 0x20, "group size"),
                                               (32, 0x02, "n_groups"), (40, 0x20, "M_pad"),
                                               (48, 0x50, "K_pad"), (56, 0x00, "panels bytes")])
def test_corrupt_header(blob, x, offset, value, what):
    bad = blob.clone()
    assert bad[offset] != value
    bad[offset] = value
    with pytest.raises(RuntimeError, match="not a valid ulbtorch packed weight"):
        torch.ops.ulb.linear(x, bad, None, M)
    with pytest.raises(RuntimeError, match="not a valid ulbtorch packed weight"):
        ops.packed_info(bad)


def test_blob_of_older_layout_version(blob, x):
    """A version-1 blob (scales after all codes) is named as such, not
    misread and not called corrupt."""
    old = blob.clone()
    old[4] = 1
    for call in (lambda: torch.ops.ulb.linear(x, old, None, M), lambda: ops.packed_info(old),
                 lambda: ops.unpack(old)):
        with pytest.raises(RuntimeError, match="older ulbtorch .blob layout version 1.; pack it again"):
            call()


FUZZ = textwrap.dedent("""
    import torch, ulbtorch
    from ulbtorch import ops
    g = torch.Generator().manual_seed(0)
    for fmt, gs in (("int2", 0), ("ternary", 32), ("binary", 64)):
        f = ulbtorch.get_format(fmt)
        codes = torch.randint(0, f.max_code + 1, (40, 200), generator=g, dtype=torch.uint8)
        blob = ops.pack(codes, torch.rand(40, -(-200 // gs) if gs else 1) + 0.1, fmt, gs)
        x = torch.randn(5, 200, generator=g)
        accepted = 0
        for i in range(64):
            for v in (0, 1, 0x7F, 0x80, 0xFF, int(blob[i]) ^ 1, int(blob[i]) ^ 0x10):
                bad = blob.clone()
                bad[i] = v
                try:
                    info = ops.packed_info(bad)
                    y = torch.ops.ulb.linear(torch.randn(5, info["in_features"]), bad, None,
                                             info["out_features"])
                    assert y.shape == (5, info["out_features"])
                    accepted += 1
                except RuntimeError as e:
                    assert "ulb." in str(e), e
        # Any bytes in the panel area are some codes and scales (perhaps NaN):
        # never an error or a crash.
        bad = blob.clone()
        panels_bytes = int(blob[56:64].view(torch.int64))
        bad[64:64 + panels_bytes] = torch.randint(0, 256, (panels_bytes,), generator=g, dtype=torch.uint8)
        torch.ops.ulb.linear(x, bad, None, 40)
        torch.ops.ulb.int_dots(bad, *torch.ops.ulb.quantize_act(x, bad)[::2])
        assert accepted > 0
    print("FUZZ-OK")
""")


def test_header_fuzz_never_crashes():
    """Every single-byte change of a header is rejected or consistent; run in a
    child process so that a crash is reported as a failure, not a dead run."""
    r = subprocess.run([sys.executable, "-c", FUZZ], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "FUZZ-OK" in r.stdout, (r.returncode, r.stdout[-2000:], r.stderr[-2000:])


# ---- int_dots and quantize_act --------------------------------------------------------------------

def test_int_dots_and_quantize_act_shapes(blob):
    with pytest.raises(RuntimeError, match=r"input must be \[N, 64\]"):
        torch.ops.ulb.quantize_act(torch.randn(3, 60), blob)
    with pytest.raises(RuntimeError, match=r"xq must be int8 \[N, 64\]"):
        torch.ops.ulb.int_dots(blob, torch.zeros(3, 60, dtype=torch.int8), torch.zeros(3, 1, dtype=torch.int32))
    with pytest.raises(RuntimeError, match=r"xq must be int8"):
        torch.ops.ulb.int_dots(blob, torch.zeros(3, 64), torch.zeros(3, 1, dtype=torch.int32))
    with pytest.raises(RuntimeError, match=r"xsum must be int32 \[N, 1\]"):
        torch.ops.ulb.int_dots(blob, torch.zeros(3, 64, dtype=torch.int8), torch.zeros(2, 1, dtype=torch.int32))


@pytest.mark.parametrize("group_size", [0, 32])
def test_int_dots_takes_only_quantize_act_output(group_size):
    """The AMX GEMM reads xq's padding and ignores xsum, the other kernels the
    reverse: anything but quantize_act's output would make the dots depend on
    the ISA, so it is refused (from 16 tokens AMX differed from scalar)."""
    codes = torch.randint(0, 4, (16, 100), dtype=torch.uint8)
    blob = ops.pack(codes, torch.ones(16, n_groups(group_size, 100)), "int2", group_size)
    xq, _, xsum = torch.ops.ulb.quantize_act(torch.randn(16, 100), blob)
    torch.ops.ulb.int_dots(blob, xq, xsum)
    padded, off = xq.clone(), xsum.clone()
    padded[:, -1] = 1
    off[5, -1] += 1
    for args in ((blob, padded, xsum), (blob, xq, off)):
        with pytest.raises(RuntimeError, match="xq must be zero past in_features and xsum the sums of xq"):
            torch.ops.ulb.int_dots(*args)


# ---- pack, dequantize and the shape limits --------------------------------------------------------

@pytest.mark.parametrize("fmt", [2 ** 32 + 2, -(2 ** 32) + 4, max(ulbtorch.formats.FORMATS_BY_ID) + 1])
def test_pack_format_id_checked_before_narrowing(fmt):
    """An int64 format id was cast to int first: 2**32 + 2 packed as format 2."""
    with pytest.raises(RuntimeError, match=f"unknown format id {fmt}"):
        torch.ops.ulb.pack(torch.zeros(16, 32, dtype=torch.uint8), torch.ones(16, 1), fmt, 0)


@pytest.mark.parametrize("fmt,code", [("int2", 4), ("int2_sym", 255), ("ternary", 3), ("binary", 2)])
def test_codes_out_of_range(fmt, code):
    codes = torch.zeros(M, K, dtype=torch.uint8)
    codes[M - 1, K - 1] = code
    with pytest.raises(ValueError, match="codes exceed"):
        ops.pack(codes, torch.ones(M, 1), fmt)
    with pytest.raises(RuntimeError, match="weight code out of range for the format"):
        torch.ops.ulb.pack(codes, torch.ones(M, 1), ulbtorch.get_format(fmt).id, 0)
    cls = {"int2": Linear2Bit, "int2_sym": Linear2Bit, "ternary": LinearTernary, "binary": Linear1Bit}[fmt]
    with pytest.raises(ValueError, match="codes exceed"):
        cls.from_codes(codes, torch.ones(M, 1), format=fmt)


def test_codes_wrong_dtype_or_shape():
    with pytest.raises(TypeError, match="codes must be uint8, got torch.int64"):
        ops.pack(torch.zeros(M, K, dtype=torch.int64), torch.ones(M, 1), "int2")
    with pytest.raises(ValueError, match="codes must be 2-D"):
        ops.pack(torch.zeros(K, dtype=torch.uint8), torch.ones(1, 1), "int2")
    with pytest.raises(ValueError, match=r"scales must have shape \(8, 1\)"):
        ops.pack(torch.zeros(M, K, dtype=torch.uint8), torch.ones(M - 1, 1), "int2")
    with pytest.raises(ValueError, match="out_features=0: packed weights hold 1 to"):
        ops.pack(torch.zeros(0, K, dtype=torch.uint8), torch.ones(0, 1), "int2")
    with pytest.raises(ValueError, match="in_features=0: packed weights hold 1 to"):
        ops.pack(torch.zeros(M, 0, dtype=torch.uint8), torch.ones(M, 1), "int2")
    with pytest.raises(RuntimeError, match=r"codes of shape \[0, 64\]: packed weights hold 1 to"):
        torch.ops.ulb.pack(torch.zeros(0, K, dtype=torch.uint8), torch.ones(0, 1), ulbtorch.formats.get_format("int2").id, 0)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_scales(bad):
    scales = torch.ones(M, 2)
    scales[3, 1] = bad
    with pytest.raises(RuntimeError, match="scale is NaN or infinite"):
        ops.pack(torch.zeros(M, K, dtype=torch.uint8), scales, "ternary", 32)
    w = torch.randn(M, K)
    w[0, 0] = bad
    lin = torch.nn.Linear(K, M)
    with torch.no_grad():
        lin.weight.copy_(w)
    with pytest.raises(ValueError, match="NaN or infinite"):
        Linear2Bit.from_linear(lin)


def test_pack_with_scales_on_meta_is_refused():
    """The meta key sent this call to the fake, which returned uninitialised
    CPU bytes."""
    codes = torch.randint(0, 4, (70, 100), dtype=torch.uint8)
    with pytest.raises(ValueError, match="scales is on meta"):
        torch.ops.ulb.pack(codes, torch.rand(70, 1, device="meta"), 1, 0, -1)


@pytest.mark.parametrize("scales, error, match", [
    ([1.0] * M, TypeError, "scales must be a tensor"),
    (torch.ones(M, 1, dtype=torch.complex64), TypeError, "real numbers"),
    (torch.ones(M, 1, dtype=torch.bool), TypeError, "real numbers"),
    (torch.ones(M, 1, device="meta"), ValueError, "meta"),
])
def test_pack_refuses_scales_it_cannot_read(scales, error, match):
    with pytest.raises(error, match=match):
        ops.pack(torch.zeros(M, K, dtype=torch.uint8), scales, "int2_sym")


def test_shape_limits_are_named_and_checked_before_ctypes():
    max_m, max_k = ops.shape_limits()
    assert (max_m, max_k) == (1 << 26, 1 << 16)
    # ctypes would have wrapped these to another geometry's size
    for m, k in [(2**64 + 64, 128), (64, 2**64 + 128), (-(2**64) + 64, 128)]:
        with pytest.raises(ValueError, match="packed weights hold 1 to"):
            ops.packed_nbytes("int2", m, k)
    with pytest.raises(ValueError, match="in_features=65537: packed weights hold 1 to 65536 inputs"):
        ops.packed_nbytes("int2", 16, max_k + 1)
    assert ops.packed_nbytes("int2", 16, max_k) > 0
    with pytest.raises(ValueError, match="in_features=70000"):
        Linear2Bit.from_linear(torch.nn.Linear(70000, 16))
    with pytest.raises(RuntimeError, match=r"codes of shape \[1, 70000\]: packed weights hold"):
        torch.ops.ulb.pack(torch.zeros(1, 70000, dtype=torch.uint8), torch.zeros(1, 1), 1, 0, -1)
    with pytest.raises(ValueError, match=r"quantize_: layer '1': in_features=70000.*exclude"):
        ulbtorch.quantize_(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(70000, 16)), bits=2)


@pytest.mark.parametrize("codes_shape, scales_shape", [((K,), (M, 1)), ((M, K), (M,)), ((M, K), (M - 1, 1)),
                                                       ((M, K), (M, 3))])
def test_dequantize_names_mismatched_shapes(codes_shape, scales_shape):
    with pytest.raises(ValueError, match="codes must be|scales must have shape"):
        ops.dequantize(torch.zeros(codes_shape, dtype=torch.uint8), torch.ones(scales_shape), "int2_sym", 16)

"""The C kernels through torch.ops.ulb: every ISA path against the scalar
oracle (bit for bit) and against plain integer arithmetic in PyTorch."""
import contextlib
import functools
import os
import subprocess
import sys
import textwrap
import zlib

import pytest
import torch

from ulbtorch import ops, runtime
from ulbtorch.formats import FORMATS, get_format, n_groups, normalize_group_size

from _layers import fit_group

ISAS = runtime.supported_isas()
# Kernel sets under test: every ISA (with a 1-bit lookup-table kernel where
# one runs, the default), and each ISA that has one with it switched off.
KERNELS = ISAS + [f"{isa}+nolut1" for isa in ISAS if runtime.lut1_available(isa)]
FMTS = list(FORMATS)
# A format in "vnni" tiles, or "binary:lanes": 1-bit codes in "lanes" tiles.
FORMS = FMTS + ["binary:lanes"]


def _form(form):
    """(format, tile order) of a FORMS entry."""
    fmt, _, tiles = form.partition(":")
    return fmt, tiles or "vnni"


MS = (1, 7, 33, 90, 1000)  # last panels of 1, 1, 3, 2 and 3 tiles of 16 rows
KS = (1, 16, 33, 257, 4097)
# 1: the one-token kernels (for 1-bit codes the lookup tables where the ISA
# has them for the tile order; with "+nolut1", masking); 5 = 4 + 1: a one-token tail after four
# tokens, never with tables; 2, 7: two and three tokens; 19, 64: the AMX GEMM
# (from 16 tokens), with a partial block of 3 and in full blocks.
NS = (1, 2, 5, 7, 19, 64)
GROUP_SIZES = (0, 32, 128)
# Base-3 tiles are 20 columns wide: groups of a multiple of 20 (one tile, and six).
BASE3_GROUP_SIZES = (0, 20, 120)


def _group_sizes(form):
    return BASE3_GROUP_SIZES if get_format(_form(form)[0]).tile_k == 20 else GROUP_SIZES


def _ns(M, K):
    # The scalar oracle at 1000 x 4097 x 64 tokens costs seconds per case.
    return (1, 2, 5, 7) if M * K > 1_000_000 else NS


def _gen(*key):
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


# Items ordered with the ISA innermost, so the cached scalar results of one
# shape serve every ISA before the next shape is built.
GRID = [pytest.param(fmt, M, K, gs, isa, id=f"{fmt}-M{M}-K{K}-gs{gs}-{isa}")
        for fmt in FORMS for M in MS for K in KS for gs in _group_sizes(fmt) for isa in KERNELS
        if fmt.startswith("binary") or "+nolut1" not in isa]
# int8 and int4 tiles are 4 and 8 columns wide, so their groups can be far
# narrower than any other format's, and not multiples of 16.
GRID += [pytest.param(fmt, M, K, gs, isa, id=f"{fmt}-M{M}-K{K}-gs{gs}-{isa}")
         for fmt, sizes in (("int8", (4, 12, 20)), ("int4", (8, 24, 40)))
         for M in (7, 100) for K in (33, 257) for gs in sizes for isa in ISAS]


@contextlib.contextmanager
def use_kernels(name):
    isa, _, variant = name.partition("+")
    with runtime.use_isa(isa), runtime.use_lut1(variant != "nolut1" and runtime.lut1_available()):
        # Else every "ISA against scalar" comparison could be one ISA twice.
        assert runtime.get_isa() == isa and runtime.lut1_enabled() == (variant != "nolut1"
                                                                         and runtime.lut1_available())
        yield


@functools.lru_cache(maxsize=4)
def _weight(form, M, K, gs):
    g = _gen("w", form, M, K, gs)
    fmt, tiles = _form(form)
    f = get_format(fmt)
    codes = torch.randint(0, f.max_code + 1, (M, K), generator=g, dtype=torch.uint8)
    G = n_groups(normalize_group_size(gs, K, fmt), K)
    scales = torch.rand(M, G, generator=g) * 0.9 + 0.1
    blob = ops.pack(codes, scales, fmt, gs, tiles=tiles)
    assert ops.packed_info(blob)["tiles"] == tiles
    return codes, scales, blob


def _group_view(t, K, gs):
    """[R, >=K] -> [R, G, gs] over the first K columns, zero padded; gs is
    a normalised group size (0: one group)."""
    gs = gs or K
    G = -(-K // gs)
    t = t[:, :K]
    t = torch.nn.functional.pad(t, (0, G * gs - K))
    return t.reshape(t.shape[0], G, gs)


def torch_int_dots(blob, xq):
    """sum over each group of level * xq, int64, from the unpacked codes."""
    info = ops.packed_info(blob)
    codes, _ = ops.unpack(blob)
    K, gs = info["in_features"], info["group_size"]
    levels = get_format(info["format"]).codes_to_levels(codes).to(torch.int64)
    lv = _group_view(levels, K, gs).permute(1, 2, 0)             # [G, gs, M]
    xv = _group_view(xq.to(torch.int64), K, gs).permute(1, 0, 2)  # [G, N, gs]
    return torch.bmm(xv, lv).permute(1, 2, 0)                      # [N, M, G]


def _acts_int8(fmt, M, K, gs, N, blob):
    """Random int8 activations over the whole range (extremes included),
    zero padded to K_pad, with their group sums."""
    info = ops.packed_info(blob)
    g = _gen("xq", fmt, M, K, gs, N)
    xq = torch.zeros(N, info["K_pad"], dtype=torch.int8)
    xq[:, :K] = torch.randint(-128, 128, (N, K), generator=g, dtype=torch.int8)
    xq[0, 0] = -128
    xq[-1, K - 1] = 127
    xsum = _group_view(xq.to(torch.int32), info["K_pad"], info["group_size"]).sum(-1, dtype=torch.int32)
    return xq, xsum


def _acts_float(fmt, M, K, gs, N):
    g = _gen("x", fmt, M, K, gs, N)
    return torch.randn(N, K, generator=g) * (torch.rand(N, 1, generator=g) * 4 + 0.01)


def epilogue(blob, x):
    """The documented fp32 epilogue, in PyTorch: per-group scale times the
    integer dot, groups added in order, times the activation scale."""
    _, scales = ops.unpack(blob)
    xq, xscale, _ = torch.ops.ulb.quantize_act(x, blob)
    # int8 dots exceed 2^24, but float32() rounds them as the kernels' int->float conversion does.
    dots = torch_int_dots(blob, xq).to(torch.float32)
    f = torch.zeros(dots.shape[:2])
    for g in range(dots.shape[2]):
        f = f + scales[:, g] * dots[:, :, g]
    return f * xscale[:, None]


@functools.lru_cache(maxsize=2)
def _dots_expected(fmt, M, K, gs):
    """Per N: (xq, xsum, scalar-ISA int_dots, pure-torch int64 dots)."""
    _, _, blob = _weight(fmt, M, K, gs)
    out = {}
    for N in _ns(M, K):
        xq, xsum = _acts_int8(fmt, M, K, gs, N, blob)
        with runtime.use_isa("scalar"):
            scalar = torch.ops.ulb.int_dots(blob, xq, xsum)
        out[N] = (xq, xsum, scalar, torch_int_dots(blob, xq))
    return out


@functools.lru_cache(maxsize=2)
def _linear_expected(fmt, M, K, gs):
    """Per N: (x, scalar-ISA output, PyTorch epilogue)."""
    _, _, blob = _weight(fmt, M, K, gs)
    out = {}
    for N in _ns(M, K):
        x = _acts_float(fmt, M, K, gs, N)
        with runtime.use_isa("scalar"):
            scalar = torch.ops.ulb.linear(x, blob, None, M)
        out[N] = (x, scalar, epilogue(blob, x))
    return out


@pytest.mark.parametrize("fmt,M,K,gs,isa", GRID)
def test_int_dots(fmt, M, K, gs, isa):
    _, _, blob = _weight(fmt, M, K, gs)
    G = n_groups(normalize_group_size(gs, K, _form(fmt)[0]), K)
    for N, (xq, xsum, scalar, exact) in _dots_expected(fmt, M, K, gs).items():
        with use_kernels(isa):
            dots = torch.ops.ulb.int_dots(blob, xq, xsum)
        assert dots.dtype == torch.int32 and dots.shape == (N, M, G)
        assert torch.equal(dots, scalar), f"N={N}: {isa} int_dots differ from scalar"
        assert torch.equal(dots, exact), f"N={N}: {isa} int_dots differ from the integer sum"


@pytest.mark.parametrize("fmt,M,K,gs,isa", GRID)
def test_linear_fp32_bit_identical(fmt, M, K, gs, isa):
    _, _, blob = _weight(fmt, M, K, gs)
    for N, (x, scalar, exact) in _linear_expected(fmt, M, K, gs).items():
        with use_kernels(isa):
            y = torch.ops.ulb.linear(x, blob, None, M)
        assert y.dtype == torch.float32 and y.shape == (N, M)
        # Bits, not values: torch.equal takes -0.0 for +0.0.
        assert torch.equal(y.view(torch.int32), scalar.view(torch.int32)), f"N={N}: {isa} output differs from scalar"
        assert torch.equal(y, exact), f"N={N}: {isa} output is not the documented epilogue"


@pytest.mark.parametrize("form", FORMS)
def test_int_dots_extremes_at_max_k(form):
    """Largest codes times -128 and times 127 over K = 65536 in one group:
    the widest integer accumulation any kernel may do (the one-token AVX-512
    path keeps 64 x the sum; the AVX2 1-bit lookups sum 16 k-steps in
    unsigned 16 bits, which -128 leaves at 0 and 127 fills)."""
    fmt, tiles = _form(form)
    f = get_format(fmt)
    M, K = 64, 65536
    for code in (f.max_code, 0):
        blob = ops.pack(torch.full((M, K), code, dtype=torch.uint8), torch.ones(M, 1), fmt, tiles=tiles)
        K_pad = ops.packed_info(blob)["K_pad"]  # base 3 pads K to 20 columns
        for N, x in ((1, -128), (2, -128), (1, 127), (2, 127)):
            xq = torch.zeros(N, K_pad, dtype=torch.int8)
            xq[:, :K] = x
            xsum = xq.to(torch.int32).sum(1, keepdim=True, dtype=torch.int32)
            want = torch.full((N, M, 1), (f.level_a * code + f.level_b) * x * K, dtype=torch.int32)
            for isa in KERNELS:
                with use_kernels(isa):
                    assert torch.equal(torch.ops.ulb.int_dots(blob, xq, xsum), want), (isa, code, N)


@pytest.mark.skipif("amx" not in ISAS, reason="the AMX GEMM serves int_dots only where AMX runs")
def test_int_dots_scratch_is_sized_by_the_tokens_given():
    """int_dots sized its per-panel sums for the GEMM kernel's 128 tokens
    whatever N was: 512 MiB of address space for 16 tokens of int8 with
    groups of 4 at K = 65536, where 64 MiB serve. Run under an address-space
    limit 384 MiB above what the process holds."""
    code = textwrap.dedent("""
        import resource, torch, ulbtorch
        from ulbtorch import ops, runtime
        K, gs = 65536, 4
        blob = ops.pack(torch.randint(0, 255, (1, K), dtype=torch.uint8), torch.ones(1, K // gs), "int8", gs)
        xq, _, xsum = torch.ops.ulb.quantize_act(torch.randn(16, K), blob)
        with runtime.use_isa("scalar"):
            want = torch.ops.ulb.int_dots(blob, xq, xsum)
        held = int(open("/proc/self/statm").read().split()[0]) * resource.getpagesize()
        resource.setrlimit(resource.RLIMIT_AS, (held + (384 << 20), resource.RLIM_INFINITY))
        with runtime.use_isa("amx"):
            assert torch.equal(torch.ops.ulb.int_dots(blob, xq, xsum), want)
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert out.returncode == 0 and out.stdout.split()[-1:] == ["ok"], out.stderr[-2000:]


# ---- activations, dtypes and layouts ------------------------------------------------------------

def _blob(gen, form="int2_sym", M=70, K=200, gs=32):
    fmt, tiles = _form(form)
    f = get_format(fmt)
    gs = fit_group(fmt, gs)
    codes = torch.randint(0, f.max_code + 1, (M, K), generator=gen, dtype=torch.uint8)
    G = n_groups(normalize_group_size(gs, K, fmt), K)
    return ops.pack(codes, torch.rand(M, G, generator=gen) + 0.05, fmt, gs, tiles=tiles)


@pytest.mark.parametrize("isa", KERNELS)
@pytest.mark.parametrize("fmt", FORMS)
def test_linear_bf16(gen, isa, fmt):
    M, K = 70, 200
    blob = _blob(gen, fmt, M, K)
    for N in (9, 20):  # 20: the AMX GEMM's output too
        x = torch.randn(N, K, generator=gen).to(torch.bfloat16)
        with use_kernels(isa):
            y = torch.ops.ulb.linear(x, blob, None, M)
        with runtime.use_isa("scalar"):
            y_scalar = torch.ops.ulb.linear(x, blob, None, M)
            y32 = torch.ops.ulb.linear(x.float(), blob, None, M)
        assert y.dtype == torch.bfloat16 and y.shape == (N, M)
        assert torch.equal(y, y_scalar)
        # bf16 values are exact in fp32, so only the final rounding differs.
        assert torch.equal(y, y32.to(torch.bfloat16))


@pytest.mark.parametrize("isa", KERNELS)
@pytest.mark.parametrize("bias_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_linear_bias(gen, isa, x_dtype, bias_dtype):
    M, K = 70, 200
    blob = _blob(gen, "ternary", M, K)
    bias = (torch.randn(M, generator=gen) * 3).to(bias_dtype)
    for N in (5, 17):
        x = torch.randn(N, K, generator=gen).to(x_dtype)
        with use_kernels(isa):
            y = torch.ops.ulb.linear(x, blob, bias, M)
        with runtime.use_isa("scalar"):
            y0 = torch.ops.ulb.linear(x.float(), blob, None, M)
        assert y.dtype == x_dtype
        assert torch.equal(y, (y0 + bias.float()).to(x_dtype))


@pytest.mark.parametrize("isa", KERNELS)
def test_linear_bf16_output_rounding_ties_and_nan(gen, isa):
    """The bf16 output step on the values where rounding rules differ: exact
    ties (half to even) and NaNs whose payload would carry into the bf16 bits.
    A bias of T - y makes the pre-rounding sum exactly T (Sterbenz)."""
    M, K = 70, 200
    blob = _blob(gen, "int2", M, K)
    x = torch.randn(3, K, generator=gen).to(torch.bfloat16)
    y = torch.ops.ulb.linear(x.float(), blob, None, M)  # the fp32 sum before the bias
    bits = y.view(torch.int32)
    ties = ((bits & ~0xFFFF) | 0x8000).view(torch.float32)  # halfway between two bf16 values
    bias = (ties - y)[0]
    assert torch.equal(y[0] + bias, ties[0])
    nan = torch.tensor([0x7FC0FFFF], dtype=torch.int32).view(torch.float32)
    bias[::5] = nan
    with use_kernels(isa):
        out = torch.ops.ulb.linear(x, blob, bias, M)
    with runtime.use_isa("scalar"):
        ref = torch.ops.ulb.linear(x, blob, bias, M)
    assert torch.equal(out.view(torch.int16), ref.view(torch.int16))
    finite = torch.ones(M, dtype=torch.bool)
    finite[::5] = False
    assert torch.equal(out[0, finite], ties[0, finite].to(torch.bfloat16))
    assert torch.isnan(out[:, ~finite]).all()


@pytest.mark.parametrize("form,K,N", [("int2", 257, 7), ("binary:lanes", 257, 7), ("int2", 4097, 1),
                                      ("binary:lanes", 4097, 1), ("binary:lanes", 4097, 3)])
def test_linear_multithread_identical(gen, form, K, N):
    """One thread or two, the same bits. One token at K = 4097 takes the
    two-panel kernels (33 KiB 1-bit panels, 15 full ones and a partial one),
    and for 1-bit codes the lookup tables one thread builds for both (three
    tokens: a table set each); with them switched off, the masking kernel
    gives the same bits too."""
    M = 1000
    blob = _blob(gen, form, M, K, 128)
    x = torch.randn(N, K, generator=gen)
    ys = []
    for lut in ([True, False] if runtime.lut1_available(runtime.get_isa()) else [False]):
        with runtime.use_lut1(lut):
            for threads in (1, 2):
                torch.set_num_threads(threads)
                ys.append(torch.ops.ulb.linear(x, blob, None, M))
    assert all(torch.equal(y, ys[0]) for y in ys)
    assert torch.equal(ys[0], epilogue(blob, x))


@pytest.mark.parametrize("isa,form", [(isa, form) for form in ("binary:lanes", "binary", "int2_sym")
                                      for isa in KERNELS if form.startswith("binary") or "+nolut1" not in isa])
def test_linear_non_contiguous(gen, isa, form):
    """Strided, transposed and broadcast inputs, fp32 and bf16, one token to
    prefill sizes: the same bits as the scalar kernel on a contiguous copy."""
    M, K = 70, 200
    blob = _blob(gen, form, M, K)
    big = torch.randn(12, 2 * K, generator=gen)
    views = {
        "transposed": torch.randn(K, 6, generator=gen).t(),      # strides (1, 6)
        "column_stride": big[:, ::2],                             # inner stride 2
        "row_slice": big[::3, 5:5 + K],                           # row stride 3 * 2K
        "broadcast": torch.randn(1, K, generator=gen).expand(4, K),  # row stride 0
        "bf16_transposed": torch.randn(K, 3, generator=gen).to(torch.bfloat16).t(),
        # prefill sizes (the AMX GEMM where it runs)
        "transposed_prefill": torch.randn(K, 18, generator=gen).t(),
        "column_stride_prefill": torch.randn(20, 2 * K, generator=gen)[:, ::2],
        "bf16_broadcast_prefill": torch.randn(1, K, generator=gen).to(torch.bfloat16).expand(17, K),
    }
    with runtime.use_isa("scalar"):
        want = {name: torch.ops.ulb.linear(x.contiguous(), blob, None, M) for name, x in views.items()}
    with use_kernels(isa):
        for name, x in views.items():
            assert not x.is_contiguous(), name
            y = torch.ops.ulb.linear(x, blob, None, M)
            assert torch.equal(y, want[name]), name
        y = torch.ops.ulb.linear(views["broadcast"], blob, None, M)
        assert torch.equal(y, y[:1].expand_as(y))


@pytest.mark.skipif("amx" not in ISAS, reason="no AMX on this CPU")
def test_amx_gemm_beside_torch_matmul_on_the_same_threads(gen):
    """The AMX GEMM and torch's bf16 matmul (oneDNN, on AMX's tiles where the
    CPU has them) each configure the tiles of the threads they run on, and
    the GEMM releases them after every call: alternating the two on the same
    threads must leave both right (a kernel that trusted a stale tile
    configuration would fault or compute garbage)."""
    M, K, N = 256, 512, 64
    blob = _blob(gen, "int2_sym", M, K)
    x = torch.randn(N, K, generator=gen).to(torch.bfloat16)
    w = torch.randn(M, K, generator=gen).to(torch.bfloat16)
    with runtime.use_isa("scalar"):
        want = torch.ops.ulb.linear(x, blob, None, M)
    want_torch = torch.nn.functional.linear(x, w)
    torch.set_num_threads(2)  # conftest restores it
    runtime.set_isa("amx")
    for _ in range(4):
        assert torch.equal(torch.ops.ulb.linear(x, blob, None, M), want)
        assert torch.equal(torch.nn.functional.linear(x, w), want_torch)


@pytest.mark.parametrize("isa", KERNELS)
def test_linear_leading_dims(gen, isa):
    M, K = 33, 48
    blob = _blob(gen, "int2", M, K, 16)
    x = torch.randn(2, 3, 4, K, generator=gen)
    bias = torch.randn(M, generator=gen)
    with use_kernels(isa):
        y = torch.ops.ulb.linear(x, blob, bias, M)
        assert y.shape == (2, 3, 4, M)
        assert torch.equal(y, torch.ops.ulb.linear(x.reshape(-1, K), blob, bias, M).reshape(2, 3, 4, M))
        # A permuted batch cannot be viewed as 2-D: the op must copy correctly.
        xp = x.permute(1, 0, 2, 3)
        yp = torch.ops.ulb.linear(xp, blob, bias, M)
        assert torch.equal(yp, y.permute(1, 0, 2, 3))
        # 1-D input: one token.
        y1 = torch.ops.ulb.linear(x[1, 2, 3], blob, bias, M)
        assert y1.shape == (M,) and torch.equal(y1, y[1, 2, 3])


def test_quantize_act_matches_reference_bitwise(gen):
    """quantize_act is documented as bit-identical to ops.quantize_activations."""
    for K in (1, 33, 257):
        blob = _blob(gen, "int2", 7, K, 0)
        x = torch.randn(64, K, generator=gen) * torch.logspace(-3, 3, 64)[:, None]
        for xin in (x, x.to(torch.bfloat16)):
            xq, xscale, _ = torch.ops.ulb.quantize_act(xin, blob)
            q, s = ops.quantize_activations(xin)
            assert torch.equal(xq[:, :K].to(torch.float32), q), f"K={K} {xin.dtype}: xq"
            assert torch.equal(xscale, s.squeeze(-1)), f"K={K} {xin.dtype}: xscale"


@pytest.mark.parametrize("isa", KERNELS)
def test_quantize_act_isa_matches_scalar(gen, isa):
    """xq, xscale and the group sums of every ISA equal the scalar path's bit
    for bit: odd K and groups, fp32 and bf16, strided rows, and rows that
    are zero, tiny, huge, or hold NaN or an infinity (which zero the row)."""
    for K, gs in ((1, 0), (15, 32), (17, 32), (33, 64), (257, 128), (1000, 0), (2053, 256)):
        blob = _blob(gen, "int2_sym", 5, K, gs)
        x = torch.randn(10, K, generator=gen) * torch.logspace(-6, 6, 10)[:, None]
        x[1] = 0
        x[2] *= 1e-38  # subnormal products
        x[3, K // 2] = float("nan")
        x[4, K - 1] = float("inf")
        x[5, 0] = -float("inf")
        x[6] = x[6].round()  # exact halves after scaling are likelier
        for xin in (x, x.to(torch.bfloat16), x.t().contiguous().t()):
            with runtime.use_isa("scalar"):
                want = torch.ops.ulb.quantize_act(xin, blob)
            with use_kernels(isa):
                got = torch.ops.ulb.quantize_act(xin, blob)
            for name, a, b in zip(("xq", "xscale", "xsum"), got, want):
                assert torch.equal(a, b) or (name == "xscale" and torch.equal(a.isnan(), b.isnan())
                                             and torch.equal(a.nan_to_num(), b.nan_to_num())), \
                    f"{isa} K={K} gs={gs} {xin.dtype} stride={xin.stride()}: {name}"
            assert got[1][3:6].isnan().all() and not got[0][3:6].any() and not got[2][3:6].any()


def test_quantize_act_documented_rule(gen):
    """The rule of ulb.h in exact fp32 arithmetic (true division), padding
    zero, xsum the group sums of xq."""
    for K, gs in ((1, 0), (33, 16), (257, 32), (257, 128), (1000, 0)):
        blob = _blob(gen, "int2_sym", 5, K, gs)
        info = ops.packed_info(blob)
        x = torch.randn(9, K, generator=gen) * torch.logspace(-7, 4, 9)[:, None]
        x[0, 0] = 50.0  # an exact +-127 at the max, -128 unreachable by design
        xq, xscale, xsum = torch.ops.ulb.quantize_act(x, blob)
        amax = x.abs().amax(-1, keepdim=True).clamp(min=1e-5)
        inv = torch.full_like(amax, 127.0) / amax
        q = torch.round(x * inv).clamp(-128, 127)
        assert xq.dtype == torch.int8 and xq.shape == (9, info["K_pad"])
        assert torch.equal(xq[:, :K].float(), q)
        assert not xq[:, K:].any(), "padding must be zero"
        assert torch.equal(xscale, (torch.ones_like(inv) / inv).squeeze(-1))
        want = _group_view(xq.to(torch.int32), info["K_pad"], info["group_size"]).sum(-1, dtype=torch.int32)
        assert xsum.dtype == torch.int32 and torch.equal(xsum, want)
        assert xsum.shape == (9, info["n_groups"])


@pytest.mark.parametrize("isa", KERNELS)
def test_all_zero_rows(gen, isa):
    M, K = 70, 200
    blob = _blob(gen, "int2", M, K)
    x = torch.randn(6, K, generator=gen)
    x[1] = 0
    x[4] = 0
    xq, xscale, xsum = torch.ops.ulb.quantize_act(x, blob)
    assert not xq[1].any() and not xsum[1].any() and torch.isfinite(xscale).all()
    bias = torch.randn(M, generator=gen)
    with use_kernels(isa):
        y = torch.ops.ulb.linear(x, blob, bias, M)
        y0 = torch.ops.ulb.linear(x, blob, None, M)
    assert torch.equal(y[1], bias) and torch.equal(y[4], bias)
    assert not y0[1].any() and not y0[4].any()
    assert torch.isfinite(y).all()


@pytest.mark.parametrize("isa", KERNELS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_row_gives_nan_row(gen, isa, bad):
    M, K = 70, 200
    blob = _blob(gen, "ternary", M, K)
    x = torch.randn(5, K, generator=gen)
    x[2, 17] = bad
    with use_kernels(isa):
        y = torch.ops.ulb.linear(x, blob, None, M)
        clean = torch.ops.ulb.linear(x[[0, 1, 3, 4]], blob, None, M)
    assert torch.isnan(y[2]).all()
    assert torch.equal(y[[0, 1, 3, 4]], clean)


# ---- packing ------------------------------------------------------------------------------------

@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("M,K,gs", [(1, 1, 0), (7, 33, 32), (33, 257, 32), (100, 4097, 128), (17, 100, 64),
                                    (5, 100, "block"), (9, 200, "3block")])
def test_pack_unpack_round_trip(gen, form, M, K, gs):
    fmt, tiles = _form(form)
    f = get_format(fmt)
    if gs == "block":  # the smallest group the format takes
        gs = f.tile_k
    elif gs == "3block":
        gs = 3 * f.tile_k
    gs = fit_group(fmt, gs)
    codes = torch.randint(0, f.max_code + 1, (M, K), generator=gen, dtype=torch.uint8)
    G = n_groups(normalize_group_size(gs, K, fmt), K)
    scales = torch.randn(M, G, generator=gen) * torch.logspace(-20, 20, G)
    blob = ops.pack(codes, scales, fmt, gs, tiles=tiles)
    assert blob.dtype == torch.uint8 and blob.dim() == 1
    c2, s2 = ops.unpack(blob)
    assert c2.dtype == torch.uint8 and torch.equal(c2, codes)
    assert s2.dtype == torch.float32 and torch.equal(s2.view(torch.int32), scales.view(torch.int32))
    info = ops.packed_info(blob)
    assert info["format"] == fmt and info["out_features"] == M and info["in_features"] == K
    assert info["tiles"] == tiles
    assert info["group_size"] == normalize_group_size(gs, K, fmt) and info["n_groups"] == G
    assert info["M_pad"] % 16 == 0 and M <= info["M_pad"] < M + 16
    assert info["K_pad"] % f.tile_k == 0 and K <= info["K_pad"] < K + f.tile_k
    # A strided (non-contiguous) code matrix packs the same.
    wide = torch.zeros(M, 2 * K, dtype=torch.uint8)
    wide[:, ::2] = codes
    assert torch.equal(ops.pack(wide[:, ::2], scales, fmt, gs, tiles=tiles), blob)
    # The blob size grows with the storage bits.
    assert blob.numel() >= 64 + int(M * K * f.bits_per_code) // 8 + M * G * 4


def test_tile_orders():
    """The default order is the active ISA's preferred one; lanes is only for
    1-bit formats; a name outside TILE_ORDERS is refused, in Python and by
    the op itself."""
    codes, scales = torch.ones(16, 64, dtype=torch.uint8), torch.ones(16, 1)
    for isa in ISAS:
        with runtime.use_isa(isa):
            want = "lanes" if isa in ("avx2", "avxvnni") else "vnni"
            assert ops.packed_info(ops.pack(codes, scales, "binary"))["tiles"] == want, isa
            assert ops.packed_info(ops.pack(codes, scales, "ternary"))["tiles"] == "vnni", isa
    with pytest.raises(ValueError, match="lanes tile order is for 1-bit formats"):
        ops.pack(codes, scales, "int2", tiles="lanes")
    with pytest.raises(ValueError, match="tiles must be one of"):
        ops.pack(codes, scales, "binary", tiles="rows")
    with pytest.raises(RuntimeError, match="tile order 1 is not offered for format ternary"):
        torch.ops.ulb.pack(codes, scales, get_format("ternary").id, 0, 1)
    with pytest.raises(RuntimeError, match="tile order 7 is not offered"):
        torch.ops.ulb.pack(codes, scales, get_format("binary").id, 0, 7)
    # retile: both ways, preferred by default, lanes only for 1-bit blobs.
    for fmt in ("binary", "ternary"):
        blob = ops.pack(codes, scales, fmt, tiles="vnni")
        assert ops.packed_info(ops.retile(blob))["tiles"] == ops.preferred_tiles(fmt)
    lanes = ops.retile(ops.pack(codes, scales, "binary", tiles="vnni"), "lanes")
    assert torch.equal(lanes, ops.pack(codes, scales, "binary", tiles="lanes"))
    assert torch.equal(ops.retile(lanes, "vnni"), ops.pack(codes, scales, "binary", tiles="vnni"))
    with pytest.raises(ValueError, match="lanes tile order is for 1-bit formats; this blob is 'int2'"):
        ops.retile(ops.pack(codes, scales, "int2"), "lanes")
    with pytest.raises(ValueError, match="tiles must be one of"):
        ops.retile(lanes, "rows")


@pytest.mark.parametrize("fmt", [f for f in FORMATS if "kmajor" in FORMATS[f].tiles])
def test_kmajor_layout(fmt):
    """The accelerator layout: scales [G][M_pad] then code words [K_pad/tile_k][M_pad]
    (ulb.h), retile to and from it giving what pack gives, unpack reading it,
    and the CPU kernels refusing it by name."""
    f = FORMATS[fmt]
    M, K, gs = 21, 3 * f.tile_k + f.tile_k // 2, f.tile_k
    codes = torch.randint(0, f.max_code + 1, (M, K), dtype=torch.uint8)
    scales = torch.rand(M, n_groups(gs, K)) + 0.5
    blob = ops.pack(codes, scales, fmt, gs, tiles="vnni")
    kmajor = ops.pack(codes, scales, fmt, gs, tiles="kmajor")
    assert ops.packed_info(kmajor)["tiles"] == "kmajor" and kmajor.numel() == blob.numel()
    assert torch.equal(ops.retile(blob, "kmajor"), kmajor) and torch.equal(ops.retile(kmajor, "vnni"), blob)
    info = ops.packed_info(kmajor)
    G, M_pad, K_pad = info["n_groups"], info["M_pad"], info["K_pad"]
    body = kmajor[64:64 + G * M_pad * 4 + K_pad // f.tile_k * M_pad * 4]
    assert torch.equal(body[:G * M_pad * 4].view(torch.float32).view(G, M_pad)[:, :M], scales.t())
    words = body[G * M_pad * 4:].view(torch.int32).view(-1, M_pad)[:, :M].t().long() & 0xFFFFFFFF
    fields = torch.arange(f.tile_k) * f.bits
    got = ((words[:, :, None] >> fields) & ((1 << f.bits) - 1)).reshape(M, -1)[:, :K]
    assert torch.equal(got.to(torch.uint8), codes)
    back_codes, back_scales = ops.unpack(kmajor)
    assert torch.equal(back_codes, codes) and torch.equal(back_scales, scales)
    with pytest.raises(RuntimeError, match="accelerator layout"):
        ops.linear(torch.rand(2, K), kmajor, None, M)


def test_ternary_code_3_rejected():
    codes = torch.ones(16, 32, dtype=torch.uint8)
    ops.pack(codes * 2, torch.ones(16, 1), "ternary")  # 2 is the largest valid code
    codes[5, 7] = 3
    with pytest.raises(ValueError, match="codes exceed 2"):
        ops.pack(codes, torch.ones(16, 1), "ternary")
    with pytest.raises(RuntimeError, match="code out of range"):
        torch.ops.ulb.pack(codes, torch.ones(16, 1), get_format("ternary").id, 0)

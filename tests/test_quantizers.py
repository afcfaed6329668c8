"""ulbtorch.quantizers: the codes and scales quantize_weight picks for each
format, method and grouping."""
import pytest
import torch

from ulbtorch import ops, quantizers
from ulbtorch.formats import get_format
from ulbtorch.nn import Linear4Bit
from ulbtorch.quantizers import _MSE_RATIOS, quantize_weight

from _layers import CF_IDS, CLASS_FORMATS, K_IN, M_OUT, METHODS, _float_linear, fit_group


@pytest.mark.parametrize("cls,fmt", CLASS_FORMATS, ids=CF_IDS)
def test_mse_scale_never_worse_than_absmax(gen, cls, fmt):
    """The MSE search includes the absmax scale, so its weight error is <=."""
    w = torch.randn(M_OUT, K_IN, generator=gen)
    err, gs = {}, fit_group(fmt, 32)
    for method in ("absmax", "mse"):
        codes, scales = quantize_weight(w, fmt, gs, "group", method)
        err[method] = (ops.dequantize(codes, scales, fmt, gs) - w).pow(2).sum().item()
    assert err["mse"] <= err["absmax"] * (1 + 1e-6)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("cls,fmt", CLASS_FORMATS, ids=CF_IDS)
def test_group_scales_are_those_of_each_group_alone(gen, cls, fmt, method):
    """Each group's scale is the one its own columns give as a matrix of
    their own, the short last group (K_IN = 100 = 3 x 32 + 4) included: its
    zero padding must not count in a mean or a max."""
    w = torch.randn(M_OUT, K_IN, generator=gen)
    gs = fit_group(fmt, 32)  # base 3: 40, and a last group of 20
    _, scales = quantize_weight(w, fmt, gs, "group", method)
    for g, k0 in enumerate(range(0, K_IN, gs)):
        _, alone = quantize_weight(w[:, k0:k0 + gs], fmt, 0, "channel", method)
        assert torch.equal(scales[:, g], alone[:, 0]), g


def test_int8_absmax_codes(gen):
    """Symmetric int8: each row's largest |w| lands exactly on level +-127,
    every code is in 0..254 (255 is invalid), and rounding errs by at most
    half a step."""
    w = torch.randn(M_OUT, K_IN, generator=gen)
    codes, scales = quantize_weight(w, "int8", 0, "channel", "absmax")
    assert codes.dtype == torch.uint8 and int(codes.max()) <= 254
    levels = codes.to(torch.int32) - 127
    top = w.abs().argmax(dim=1, keepdim=True)
    assert torch.equal(levels.gather(1, top).abs(), torch.full((M_OUT, 1), 127, dtype=torch.int32))
    assert ((levels * scales - w).abs() <= scales / 2 * (1 + 1e-6)).all()


@pytest.mark.parametrize("fmt,outer", [("int4", -8), ("int2", -2)])
def test_asymmetric_absmax_codes(gen, fmt, outer):
    """int4 (-8..7) and int2 (-2..1): each row's largest |w|, of either sign,
    lands exactly on the long side's outer level (a negative scale when that
    w is positive); every weight is within half a step, except those of the
    other sign clipped to the short side's last level, within one step."""
    w = torch.randn(M_OUT, K_IN, generator=gen)
    codes, scales = quantize_weight(w, fmt, 0, "channel", "absmax")
    f = get_format(fmt)
    levels = f.codes_to_levels(codes)
    top = w.abs().argmax(dim=1, keepdim=True)
    assert torch.equal(levels.gather(1, top), torch.full((M_OUT, 1), outer, dtype=torch.int32))
    signs = torch.sign(scales).flatten()
    assert torch.equal(signs, -torch.sign(w.gather(1, top)).flatten())  # both signs occur over 37 rows
    assert (signs > 0).any() and (signs < 0).any()
    err = (levels * scales - w).abs()
    clipped = levels == -outer - 1
    assert (err[~clipped] <= (scales.abs() / 2 * (1 + 1e-6)).expand_as(err)[~clipped]).all()
    assert (err <= scales.abs() * (1 + 1e-6)).all()


def test_q4_0_of_llama_cpp_reference_quantises_back_exactly():
    """The same against llama.cpp's own Python codec (gguf-py): weights
    quantised to Q4_0 and dequantised by it give back its nibbles and fp16
    scales from int4 absmax in groups of 32."""
    gguf = pytest.importorskip("gguf")
    np = pytest.importorskip("numpy")
    x = np.random.default_rng(0).standard_normal((37, 256)).astype(np.float32)
    x[0, :32] = 0.0
    x[1, :32] *= 1e-8  # its fp16 scale rounds to 0: the block dequantises to zeros, its codes are lost
    qtype = gguf.GGMLQuantizationType.Q4_0
    raw = gguf.quants.quantize(x, qtype).reshape(37, 8, 18)  # per block: fp16 d, 16 bytes of nibbles
    w = torch.from_numpy(gguf.quants.dequantize(raw.reshape(37, -1), qtype))
    d = torch.from_numpy(raw[..., :2].copy().view(np.float16).astype(np.float32)).squeeze(-1)
    nibbles = raw[..., 2:]  # weight j < 16 of a block in the low nibble of byte j, weight 16 + j in the high one
    q = torch.from_numpy(np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1).reshape(37, 256))
    codes, scales = quantize_weight(w, "int4", 32, "group", "absmax")
    kept = (d != 0).repeat_interleave(32, dim=1)
    assert (d == 0).sum() == 2 and (q[~kept] != 8).any()
    assert torch.equal(codes[kept], q[kept]) and (codes[~kept] == 8).all()
    assert torch.equal(scales[d != 0], d[d != 0])
    assert torch.equal(ops.dequantize(codes, scales, "int4", 32), w)


def test_llama_cpp_q4_0_weights_quantise_back_exactly(gen):
    """A weight dequantised from llama.cpp Q4_0 blocks (32 weights, d = signed
    max / -8 stored as fp16, codes min(15, (int)(x/d + 8.5)) with the fp32 d,
    w = fp16(d) (q - 8)), as transformers' GGUF loader produces it, gives back
    the same codes and scales from int4 absmax in groups of 32."""
    x = torch.randn(M_OUT, 8 * 32, generator=gen)
    x[0, :32] = 0.0  # an all-zero block: d = 0
    blocks = x.reshape(M_OUT, 8, 32)
    top = blocks.abs().argmax(dim=-1, keepdim=True)
    d32 = blocks.gather(-1, top) / -8
    d = d32.to(torch.float16).float()
    inv = torch.where(d32 == 0, 0.0, 1.0 / d32)
    q = torch.clamp((blocks * inv + 8.5).trunc(), max=15)
    assert (q == 15).any()  # llama.cpp's clamp of the short side occurs
    w = (d * (q - 8)).reshape(M_OUT, -1)
    codes, scales = quantize_weight(w, "int4", 32, "group", "absmax")
    assert torch.equal(codes, q.reshape(M_OUT, -1).to(torch.uint8))
    nonzero = d.squeeze(-1) != 0
    assert torch.equal(scales[nonzero], d.squeeze(-1)[nonzero])
    assert torch.equal(ops.dequantize(codes, scales, "int4", 32), w)


@pytest.mark.parametrize("fmt", ["int2_sym", "ternary", "binary", "int8"])
def test_symmetric_scales_keep_their_formula(gen, fmt):
    """Symmetric level sets: absmax is exactly max|w| / max|level| and every
    mse scale exactly max|w| * (r / max|level|) for a ratio r of the search,
    rounded as before the asymmetric rule existed (so codes do not move)."""
    w = torch.randn(M_OUT, 320, generator=gen)
    top = float(get_format(fmt).levels.abs().max())
    amax = w.abs().amax(dim=1, keepdim=True)
    assert torch.equal(quantize_weight(w, fmt, 0, "channel", "absmax")[1], amax / top)
    _, s = quantize_weight(w, fmt, 0, "channel", "mse")
    candidates = torch.cat([amax * (r / top) for r in _MSE_RATIOS.tolist()], dim=1)
    assert (s == candidates).any(dim=1).all()


@pytest.mark.parametrize("fmt", ["int2_sym", "int2", "ternary"])
@pytest.mark.parametrize("gs", [0, 32])
def test_mse_search_picks_the_least_error(gen, fmt, gs, monkeypatch):
    """The sorted prefix-sum search of the mse scale picks, per row or group,
    the ratio whose quantised values have the least squared error, as
    computed here the long way (every ratio, every element), the first one
    on a tie (the all-zero row); also when the rows come a chunk at a time."""
    f = get_format(fmt)
    w = torch.randn(M_OUT, 320, generator=gen) * torch.rand(M_OUT, 1, generator=gen)  # rows of different spread
    w[1::3, :3] *= 3  # outliers in some rows, so that clipping pays more there
    w[0] = 0
    monkeypatch.setattr(quantizers, "_MSE_CHUNK_ELEMENTS", 3 * 320)  # chunks of 3 rows, the last one short
    _, s = quantize_weight(w, fmt, gs, "group" if gs else "channel", "mse")
    wg = w.reshape(M_OUT, -1, gs or 320)
    amax, outer, sign = quantizers._absmax_parts(wg, f)
    cands = torch.cat([sign * (amax * (r / outer)) for r in _MSE_RATIOS.tolist()], dim=-1)
    levels = [quantizers._codes_for(wg, cands[..., i:i + 1], f) * f.level_a + f.level_b for i in range(cands.shape[-1])]
    err = torch.stack([((lv * cands[..., i:i + 1] - wg) ** 2).sum(-1) for i, lv in enumerate(levels)], dim=-1)
    picked = (cands == s.reshape(*wg.shape[:-1], 1)).float().argmax(-1, keepdim=True)
    assert (cands.gather(-1, picked) == s.reshape(*wg.shape[:-1], 1)).all()
    best = err.min(-1, keepdim=True).values
    assert (err.gather(-1, picked) <= best * (1 + 1e-5)).all()
    assert picked[0].eq(0).all(), "all-zero row: the first ratio"
    assert len(set(picked.flatten().tolist())) > 2, "the data should exercise several ratios"


@pytest.mark.parametrize("gs", [0, 32])
def test_int4_default_method(gen, gs):
    """int4 defaults to absmax (quantizers.py says why), which mse would not match."""
    lin = _float_linear(gen, K=256, M=8)
    scales = {m: Linear4Bit.from_linear(lin, group_size=gs, method=m).unpack()[1] for m in (None, "absmax", "mse")}
    assert scales[None].equal(scales["absmax"]) and not scales[None].equal(scales["mse"])

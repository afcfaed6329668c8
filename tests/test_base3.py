"""ternary_base3: five ternary codes a byte (kernels/src/base3.h). The byte
rule against a decoder written here from docs/formats.md, its kernels against
the 2-bit ternary format holding the same codes and scales (integer sums and
outputs bit for bit, every ISA), and bad input. The grid of tests/test_kernels.py
checks every kernel against the scalar reference on odd shapes as for every
format."""
import importlib.util

import pytest
import torch

import ulbtorch
from ulbtorch import ops, runtime
from ulbtorch.formats import FORMATS, get_format
from ulbtorch.nn import LinearTernary

from test_checkpoint_integrity import _reseal

ISAS = runtime.supported_isas()
F = get_format("ternary_base3")


def byte_of(codes):
    """The documented byte of five codes (most significant first)."""
    V = 0
    for c in codes:
        V = 3 * V + c
    neg = V < 121
    v = 242 - V if neg else V
    q = -(-v * 256 // 243)
    return neg << 7 | (q & 0x7F)


def codes_of(byte):
    """The documented decode: digits of q = byte | 0x80 by the multiply, then 2 - c if the sign is set."""
    q, out = byte | 0x80, []
    for _ in range(5):
        t = q * 3
        out.append(t >> 8)
        q = t & 0xFF
    return [2 - c for c in out] if byte >> 7 else out


def _patterns():
    return [[V // 3 ** (4 - j) % 3 for j in range(5)] for V in range(243)]


def test_byte_rule_round_trips_and_has_243_canonical_bytes():
    bytes_ = {byte_of(c) for c in _patterns()}
    assert len(bytes_) == 243 and byte_of([1] * 5) == 0
    for c in _patterns():
        assert codes_of(byte_of(c)) == c


def _tile_bytes(blob, M):
    """Code bytes of a one-group, one-step blob of M <= 16 rows: the tile after the scales."""
    return blob[64 + 16 * 4: 64 + 16 * 4 + 64].reshape(16, 4)[:M]


def test_pack_writes_the_documented_bytes():
    # Rows of 20 columns: byte (l, b) holds the codes of columns b, 4 + b, ..., 16 + b of row l.
    pats = torch.tensor(_patterns(), dtype=torch.uint8)  # 243 x 5
    for start in range(0, 243, 64):
        chunk = pats[start:start + 64]
        n = chunk.shape[0]
        M = -(-n // 4)
        codes = torch.ones(M * 4, 5, dtype=torch.uint8)
        codes[:n] = chunk
        # codes[l*4 + b, j] -> column 4j + b of row l
        mat = codes.view(M, 4, 5).permute(0, 2, 1).reshape(M, 20).contiguous()
        blob = ops.pack(mat, torch.ones(M, 1), "ternary_base3")
        got = _tile_bytes(blob, M).reshape(-1)[:n]
        want = torch.tensor([byte_of(c.tolist()) for c in chunk], dtype=torch.uint8)
        assert torch.equal(got, want)
        assert torch.equal(ops.unpack(blob)[0], mat)


def _pair(gen, M, K, gs):
    codes = torch.randint(0, 3, (M, K), generator=gen, dtype=torch.uint8)
    G = 1 if not gs or gs >= K else -(-K // gs)
    scales = torch.rand(M, G, generator=gen) + 0.1
    return (ops.pack(codes, scales, "ternary", gs), ops.pack(codes, scales, "ternary_base3", gs), codes, scales)


@pytest.mark.parametrize("isa", ISAS)
# Group sizes both formats take: multiples of 80 (16 and 20 columns a tile).
@pytest.mark.parametrize("M,K,gs", [(1, 1, 0), (17, 21, 0), (70, 200, 80), (33, 1003, 160), (130, 2048, 0),
                                    (64, 4100, 240)])
def test_same_sums_and_outputs_as_2bit_ternary(gen, isa, M, K, gs):
    two, three, _, _ = _pair(gen, M, K, gs)
    assert three.numel() <= two.numel() and (three.numel() < two.numel() or K < 100)
    for N in (1, 2, 5, 17):
        x = torch.randn(N, K, generator=gen) * 3
        with runtime.use_isa("scalar"):
            xq2, _, xsum2 = torch.ops.ulb.quantize_act(x, two)
        xq3, _, xsum3 = torch.ops.ulb.quantize_act(x, three)
        with runtime.use_isa(isa):
            d2 = torch.ops.ulb.int_dots(two, xq2, xsum2)
            d3 = torch.ops.ulb.int_dots(three, xq3, xsum3)
            assert torch.equal(d2, d3), (isa, N)
            for xx in (x, x.to(torch.bfloat16), torch.randn(N, 2 * K, generator=gen)[:, ::2]):
                y2, y3 = torch.ops.ulb.linear(xx, two, None, M), torch.ops.ulb.linear(xx, three, None, M)
                assert torch.equal(y2, y3), (isa, N, xx.dtype)


def test_layer_matches_ternary_layer_and_is_smaller(gen):
    lin = torch.nn.Linear(2048, 300)
    a = LinearTernary.from_linear(lin, format="ternary")
    b = LinearTernary.from_linear(lin, format="ternary_base3")
    assert b.format == "ternary_base3" and b.backend == "cpu"
    assert b.packed.numel() < 0.82 * a.packed.numel()
    assert torch.equal(a.dequantize(), b.dequantize())
    for N in (1, 4, 33):
        x = torch.randn(N, 2048, generator=gen, dtype=torch.bfloat16)
        assert torch.equal(a(x), b(x))


def test_quantize_and_save_round_trip(gen, tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(120, 64), torch.nn.ReLU(), torch.nn.Linear(64, 40))
    ulbtorch.quantize_(model, format="ternary_base3", group_size=40)
    assert all(m.format == "ternary_base3" for m in model if isinstance(m, LinearTernary))
    x = torch.randn(3, 120, generator=gen)
    y = model(x)
    ulbtorch.save_quantized(model, str(tmp_path / "q"))
    back = torch.nn.Sequential(torch.nn.Linear(120, 64), torch.nn.ReLU(), torch.nn.Linear(64, 40))
    ulbtorch.load_quantized(back, str(tmp_path / "q"))
    assert back[0].format == "ternary_base3" and torch.equal(back(x), y)
    fresh = torch.nn.Sequential(torch.nn.Linear(120, 64), torch.nn.ReLU(), torch.nn.Linear(64, 40))
    ulbtorch.quantize_(fresh, format="ternary_base3", group_size=40)
    fresh.load_state_dict(model.state_dict())
    assert torch.equal(fresh(x), y)


def test_bits_ternary_still_means_2bit():
    assert ulbtorch.QuantConfig(bits="ternary").format == "ternary"
    assert ulbtorch.QuantConfig(format="ternary_base3").bits == "ternary"
    assert "ternary_base3" in FORMATS and not F.aliases and F.bits_per_code == 1.6


def test_group_size_must_be_a_multiple_of_20():
    with pytest.raises(ValueError, match="multiple of 20 for format 'ternary_base3'"):
        ulbtorch.formats.normalize_group_size(128, 4096, "ternary_base3")
    with pytest.raises(ValueError, match="multiple of 20"):
        ulbtorch.QuantConfig(format="ternary_base3", group_size=64)
    with pytest.raises(RuntimeError, match="20 for base 3"):
        torch.ops.ulb.pack(torch.zeros(4, 256, dtype=torch.uint8), torch.ones(4, 2), F.id, 128, 0)


def test_codes_out_of_range_and_no_accelerator_layout():
    with pytest.raises((ValueError, RuntimeError), match="out of range"):
        ops.pack(torch.full((4, 40), 3, dtype=torch.uint8), torch.ones(4, 1), "ternary_base3")
    with pytest.raises(ValueError, match="kmajor"):
        ops.pack(torch.zeros(4, 40, dtype=torch.uint8), torch.ones(4, 1), "ternary_base3", tiles="kmajor")


@pytest.mark.parametrize("bad", [0x80, 0x7F, 0xFF])
def test_non_canonical_byte_is_refused(gen, bad):
    """A byte pack never writes (0x80: "minus" five zeros; 0x7f/0xff: q = 255
    is ceil(242 * 256 / 243), so these are canonical or not as the rule says),
    resealed so that the checksum passes: refused by unpack and verify."""
    canonical = {byte_of(c) for c in _patterns()}
    _, blob, _, _ = _pair(gen, 16, 40, 0)
    b = blob.clone()
    b[64 + 16 * 4] = bad
    b = _reseal(b)
    if bad in canonical:
        ops.unpack(b)
        assert ops.packed_info(b, verify=True)["checked"]
    else:
        with pytest.raises((ValueError, RuntimeError), match="out of range"):
            ops.unpack(b)
        with pytest.raises((ValueError, RuntimeError), match="out of range"):
            ops.packed_info(b, verify=True)


def test_every_non_canonical_byte_is_refused(gen):
    canonical = {byte_of(c) for c in _patterns()}
    _, blob, _, _ = _pair(gen, 16, 40, 0)
    refused = 0
    for bad in sorted(set(range(256)) - canonical):
        b = blob.clone()
        b[64 + 16 * 4 + 5] = bad
        with pytest.raises((ValueError, RuntimeError), match="out of range"):
            ops.unpack(_reseal(b))
        refused += 1
    assert refused == 13


def test_blob_of_another_format_is_refused_by_the_layer(gen):
    two, three, _, _ = _pair(gen, 16, 40, 0)
    layer = LinearTernary(40, 16, bias=False, format="ternary_base3")
    with pytest.raises((ValueError, RuntimeError), match="ternary"):
        layer.packed = two
    layer.packed = three
    assert layer(torch.randn(2, 40)).shape == (2, 16)


def test_from_pretrained_save_pretrained_round_trip(tmp_path):
    transformers = pytest.importorskip("transformers")
    from ulbtorch import UlbConfig

    cfg = transformers.LlamaConfig(hidden_size=120, intermediate_size=240, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=300)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / "float")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "float", quantization_config=UlbConfig(format="ternary_base3", group_size=40))
    layer = model.model.layers[0].mlp.down_proj
    assert isinstance(layer, LinearTernary) and layer.format == "ternary_base3" and layer.group_size == 40
    ids = torch.randint(0, 300, (1, 7))
    logits = model(ids).logits
    model.save_pretrained(tmp_path / "q")
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "q")
    assert again.model.layers[0].mlp.down_proj.format == "ternary_base3"
    assert torch.equal(again.model.layers[1].self_attn.q_proj.packed, model.model.layers[1].self_attn.q_proj.packed)
    assert torch.equal(again(ids).logits, logits)


@pytest.mark.parametrize("linear_class", ["bitlinear", "autobitlinear"])
def test_bitnet_checkpoint_loads_as_base3_with_the_same_logits(tmp_path, linear_class):
    pytest.importorskip("transformers")
    from test_importers import make_checkpoint
    from ulbtorch.importers import load_bitnet_checkpoint

    make_checkpoint(tmp_path, linear_class)
    two = load_bitnet_checkpoint(str(tmp_path), dtype=torch.float32)
    three = load_bitnet_checkpoint(str(tmp_path), dtype=torch.float32, format="ternary_base3")
    layers = [m for m in three.modules() if isinstance(m, LinearTernary)]
    assert layers and all(m.format == "ternary_base3" and m.granularity == "tensor" for m in layers)
    assert three.config.quantization_config.format == "ternary_base3"
    ids = torch.randint(0, 300, (1, 6))
    assert torch.equal(two(ids).logits, three(ids).logits)
    with pytest.raises(ValueError, match="LinearTernary's formats"):
        load_bitnet_checkpoint(str(tmp_path), format="int2")


def test_bitnet_from_pretrained_then_convert_to_base3_and_save_pretrained(tmp_path):
    transformers = pytest.importorskip("transformers")
    from test_importers import make_checkpoint
    from ulbtorch.importers import convert_bitnet_model

    make_checkpoint(tmp_path, "autobitlinear")
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    convert_bitnet_model(model, format="ternary_base3")
    convert_bitnet_model(ref)
    layers = [m for m in model.modules() if isinstance(m, LinearTernary)]
    assert len(layers) == 14 and all(m.format == "ternary_base3" for m in layers)
    ids = torch.randint(0, 300, (1, 6))
    assert torch.equal(model(ids).logits, ref(ids).logits)
    model.save_pretrained(tmp_path / "converted")
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "converted", dtype=torch.float32)
    assert again.model.layers[0].mlp.gate_proj.format == "ternary_base3"
    before, after = model.state_dict(), again.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


def test_vllm_serves_base3_on_the_cpu_and_refuses_an_accelerator():
    """The vLLM method on a base-3 blob: apply computes what ulb.linear does
    on the CPU; on a device Triton serves (the CPU standing in) the load is
    refused by name, as base 3 has no accelerator layout."""
    import types

    pytest.importorskip("vllm")
    from ulbtorch import triton as accel
    from ulbtorch.integrations.vllm import UlbLinearMethod
    from ulbtorch.quantize import QuantConfig

    g = torch.Generator().manual_seed(0)
    M, K = 70, 100
    blob = ops.pack(torch.randint(0, 3, (M, K), generator=g, dtype=torch.uint8), torch.rand(M, 1, generator=g) + 0.1,
                    "ternary_base3")

    def layer():
        m = torch.nn.Module()
        m.packed = torch.nn.Parameter(torch.empty(0, dtype=torch.uint8), requires_grad=False)
        m.ulb_out_features = M
        m.ulb_assembler = types.SimpleNamespace(pack=lambda: blob.clone())
        return m

    method = UlbLinearMethod(QuantConfig(format="ternary_base3"))
    cpu = layer()
    method.process_weights_after_loading(cpu)
    x = torch.randn(3, K, generator=g).to(torch.bfloat16)
    assert torch.equal(method.apply(cpu, x), ops.linear(x, blob, None, M))
    if importlib.util.find_spec("triton") and accel.interpreting():
        with accel.emulate_on_cpu(), pytest.raises(ValueError, match="ternary_base3, which has no accelerator"):
            method.process_weights_after_loading(layer())

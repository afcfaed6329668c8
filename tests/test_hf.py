"""A tiny Hugging Face Llama quantised with quantize_: C kernels against the
pure-PyTorch path of the same layers, selection patterns, save/load, compile."""
import os

import pytest
import torch
from torch import nn

import ulbtorch
from ulbtorch import ops, runtime
from ulbtorch.nn import Linear1Bit, Linear2Bit, Linear4Bit, Linear8Bit, LinearTernary, LowBitLinear

transformers = pytest.importorskip("transformers")

CONFIG = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=500)
PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
CLS = {2: Linear2Bit, 1: Linear1Bit, "ternary": LinearTernary, 4: Linear4Bit, 8: Linear8Bit}


def tiny_llama(seed=0):
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**CONFIG))
    return model.eval()


def prompt(n=8, seed=1):
    return torch.randint(3, CONFIG["vocab_size"], (2, n), generator=torch.Generator().manual_seed(seed))


def set_reference(model, on):
    n = 0
    for m in model.modules():
        if isinstance(m, LowBitLinear):
            m.force_reference = on
            n += 1
    return n


def lowbit_names(model):
    return {n for n, m in model.named_modules() if isinstance(m, LowBitLinear)}


def linear_names(model):
    return {n for n, m in model.named_modules() if type(m) is nn.Linear}


def _close(a, b, rel):
    err = (a - b).abs().max()
    assert err <= rel * b.abs().max(), f"max diff {err.item():.3g} vs scale {b.abs().max().item():.3g}"


def generate(model, ids):
    with torch.no_grad():
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12,
                              min_new_tokens=12, do_sample=False, pad_token_id=0)


@pytest.mark.parametrize("group_size", [0, 64])
@pytest.mark.parametrize("bits", [2, 1, "ternary", 4, 8])
def test_generate_kernels_equal_reference(bits, group_size):
    model = ulbtorch.quantize_(tiny_llama(), bits=bits, group_size=group_size)
    n_layers = CONFIG["num_hidden_layers"] * len(PROJ)
    assert len(lowbit_names(model)) == n_layers
    for name in lowbit_names(model):
        m = model.get_submodule(name)
        assert type(m) is CLS[bits] and m.group_size == group_size
    assert type(model.lm_head) is nn.Linear

    assert set_reference(model, False) == n_layers
    check_kernels_equal_reference(model)


def check_kernels_equal_reference(model):
    ids = prompt()
    out_kernel = generate(model, ids)
    set_reference(model, True)
    out_ref = generate(model, ids)
    assert out_kernel.shape == (2, ids.shape[1] + 12)
    assert torch.equal(out_kernel[:, :ids.shape[1]], ids)

    with torch.no_grad():
        logits_ref = model(out_kernel).logits
        set_reference(model, False)
        logits_kernel = model(out_kernel).logits
    # Per layer the two paths agree to ~1e-6 (test_modules), but activations
    # are rounded to int8 at every layer, so a last-bit difference can move
    # one input by a quantisation step: logits then differ by up to ~0.5%
    # (measured <= 5e-3 max, <= 4e-4 mean, scale ~1), usually by ~1e-7.
    scale = logits_ref.abs().max()
    diff = (logits_kernel - logits_ref).abs()
    assert diff.max() <= 2e-2 * scale and diff.mean() <= 2e-3 * scale, (diff.max(), diff.mean(), scale)
    if not torch.equal(out_kernel, out_ref):
        # Greedy decoding may only part ways at a near tie of the top logits.
        b, p = (out_kernel != out_ref).nonzero()[0].tolist()
        step = logits_ref[b, p - 1]
        gap = (step[out_ref[b, p]] - step[out_kernel[b, p]]).abs()
        assert gap <= 2e-2 * scale, f"tokens differ at {p} with a logit gap of {gap.item():.3g}"


def test_include_exclude_patterns():
    model = ulbtorch.quantize_(tiny_llama(), bits=2, include=["*.mlp.*"])
    assert lowbit_names(model) == {f"model.layers.{i}.mlp.{p}" for i in range(2)
                                   for p in ("gate_proj", "up_proj", "down_proj")}
    assert {f"model.layers.{i}.self_attn.{p}" for i in range(2)
            for p in ("q_proj", "k_proj", "v_proj", "o_proj")} | {"lm_head"} == linear_names(model)

    model = ulbtorch.quantize_(tiny_llama(), bits=1, exclude=["*.q_proj", "*.layers.1.*", "lm_head"])
    assert lowbit_names(model) == {f"model.layers.0.{p}" for p in
                                   ("self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                                    "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}
    assert "model.layers.0.self_attn.q_proj" in linear_names(model) and "lm_head" in linear_names(model)

    # lm_head is excluded by default, but can be asked for.
    model = ulbtorch.quantize_(tiny_llama(), bits="ternary", include=["lm_head"], exclude=[])
    assert lowbit_names(model) == {"lm_head"} and type(model.lm_head) is LinearTernary
    with torch.no_grad():
        assert model(prompt()).logits.shape == (2, 8, CONFIG["vocab_size"])

    cfg = ulbtorch.QuantConfig(bits="ternary", group_size=64, exclude=["lm_head", "*.down_proj"])
    model = ulbtorch.quantize_(tiny_llama(), cfg)
    assert len(lowbit_names(model)) == 2 * 6 and "model.layers.1.mlp.down_proj" in linear_names(model)
    assert all(model.get_submodule(n).group_size == 64 for n in lowbit_names(model))
    with pytest.raises(TypeError, match="either a QuantConfig or keyword arguments"):
        ulbtorch.quantize_(tiny_llama(), cfg, bits=2)
    # One string is one pattern (not a list of its characters, '*' among them).
    model = ulbtorch.quantize_(tiny_llama(), bits=2, include="*.mlp.*")
    assert len(lowbit_names(model)) == 2 * 3 and "lm_head" in linear_names(model)
    with pytest.raises(TypeError, match="include must be a list of fnmatch patterns"):
        ulbtorch.QuantConfig(include=3)
    with pytest.raises(ValueError, match="bits must be"):
        ulbtorch.QuantConfig(bits=True)


# int8 weights and activations: logits within ~1% of the float lm_head's on the same hidden
# states; int4 (16 levels, Q4_0 scales per group of 32): within ~10%.
@pytest.mark.parametrize("head_bits,head_gs,cls,rel", [(8, 0, Linear8Bit, 3e-2), (4, 32, Linear4Bit, 0.1)])
def test_lm_head_bits(tmp_path, head_bits, head_gs, cls, rel):
    model = tiny_llama()
    float_head = model.lm_head
    ulbtorch.quantize_(model, bits=2, lm_head_bits=head_bits, lm_head_group_size=head_gs)
    assert type(model.lm_head) is cls and model.lm_head.format == f"int{head_bits}"
    assert model.lm_head.group_size == head_gs and model.lm_head.granularity == ("group" if head_gs else "channel")
    assert len(lowbit_names(model)) == CONFIG["num_hidden_layers"] * len(PROJ) + 1
    assert all(type(model.get_submodule(n)) is Linear2Bit for n in lowbit_names(model) - {"lm_head"})
    with torch.no_grad():
        h = model.model(prompt()).last_hidden_state
        _close(model.lm_head(h), float_head(h), rel)
    check_kernels_equal_reference(model)
    # Round trip through save_quantized / load_quantized.
    ulbtorch.save_quantized(model, str(tmp_path))
    loaded = ulbtorch.load_quantized(tiny_llama(seed=5), str(tmp_path))
    assert type(loaded.lm_head) is cls and torch.equal(loaded.lm_head.packed, model.lm_head.packed)
    with torch.no_grad():
        assert torch.equal(loaded(prompt()).logits, model(prompt()).logits)


def test_lm_head_bits_errors():
    # lm_head_bits is for layers include/exclude leave out, and takes the values bits takes.
    with pytest.raises(ValueError, match="is for an lm_head that include/exclude leave out"):
        ulbtorch.quantize_(tiny_llama(), bits=2, exclude=[], lm_head_bits=8)
    # An output layer by another name (get_output_embeddings) is the head too; the
    # default exclude does not cover it, so the clash is named.
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.body, self.output = nn.Linear(16, 16), nn.Linear(16, 32)

        def get_output_embeddings(self):
            return self.output

    with pytest.raises(ValueError, match=r"already select \['output'\]"):
        ulbtorch.quantize_(Net(), bits=2, lm_head_bits=8)
    net = ulbtorch.quantize_(Net(), bits=2, exclude=["output", "lm_head"], lm_head_bits=8)
    assert type(net.output) is Linear8Bit and type(net.body) is Linear2Bit
    seq = nn.Sequential()
    seq.add_module("body", nn.Linear(16, 16))
    seq.add_module("output", nn.Linear(16, 16))
    with pytest.raises(ValueError, match="no plain linear layer named lm_head"):
        ulbtorch.quantize_(seq, bits=2, lm_head_bits=8)
    with pytest.raises(ValueError, match="bits must be"):
        ulbtorch.QuantConfig(lm_head_bits=3)
    with pytest.raises(ValueError, match="lm_head_group_size=32 needs lm_head_bits"):
        ulbtorch.QuantConfig(lm_head_group_size=32)
    with pytest.raises(ValueError, match="lm_head_group_size=12: group_size must be 0 or a multiple of 8"):
        ulbtorch.QuantConfig(lm_head_bits=4, lm_head_group_size=12)


@pytest.mark.parametrize("bits,group_size", [(2, 64), ("ternary", 0), (1, 32)])
def test_save_load_reproduces_logits(tmp_path, bits, group_size):
    model = ulbtorch.quantize_(tiny_llama(seed=0), bits=bits, group_size=group_size)
    ulbtorch.save_quantized(model, str(tmp_path))
    assert os.path.exists(tmp_path / "ulbtorch.json") and os.path.exists(tmp_path / "model.safetensors")
    fresh = tiny_llama(seed=123)  # different float weights everywhere
    ids = prompt()
    with torch.no_grad():
        want = model(ids).logits
        assert not torch.allclose(fresh(ids).logits, want)
        loaded = ulbtorch.load_quantized(fresh, str(tmp_path))
        got = loaded(ids).logits
    assert torch.equal(got, want)
    assert lowbit_names(loaded) == lowbit_names(model)
    for name in lowbit_names(model):
        a, b = model.get_submodule(name), loaded.get_submodule(name)
        assert type(a) is type(b) and a.format == b.format and a.group_size == b.group_size
        assert torch.equal(a.packed, b.packed)
    assert type(loaded.lm_head) is nn.Linear and torch.equal(loaded.lm_head.weight, model.lm_head.weight)


def isa_preferring(tiles):
    """A supported ISA under which 1-bit codes pack in `tiles` order, or None."""
    for isa in runtime.supported_isas():
        with runtime.use_isa(isa):
            if ops.preferred_tiles("binary") == tiles:
                return isa
    return None


@pytest.mark.parametrize("saved,loaded_as", [("vnni", "lanes"), ("lanes", "vnni")])
def test_load_quantized_puts_1bit_tiles_in_this_cpus_order(tmp_path, saved, loaded_as):
    """A 1-bit checkpoint packed where the other tile order was preferred
    loads into this CPU's order, with the same codes and the same logits."""
    pack_isa, load_isa = isa_preferring(saved), isa_preferring(loaded_as)
    if pack_isa is None or load_isa is None:
        pytest.skip(f"no ISA here packs 1-bit codes in {saved if pack_isa is None else loaded_as} tiles")
    with runtime.use_isa(pack_isa):
        model = ulbtorch.quantize_(tiny_llama(seed=0), bits=1, group_size=32)
    names = lowbit_names(model)
    assert {ops.packed_info(model.get_submodule(n).packed)["tiles"] for n in names} == {saved}
    ulbtorch.save_quantized(model, str(tmp_path))
    with runtime.use_isa(load_isa):
        loaded = ulbtorch.load_quantized(tiny_llama(seed=123), str(tmp_path))
    ids = prompt()
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)
    for n in names:
        a, b = model.get_submodule(n), loaded.get_submodule(n)
        assert ops.packed_info(b.packed)["tiles"] == loaded_as
        assert all(torch.equal(u, v) for u, v in zip(ops.unpack(a.packed), ops.unpack(b.packed)))


def test_torch_compile_fullgraph():
    torch._dynamo.reset()
    try:
        g = torch.Generator().manual_seed(0)
        lin = nn.Linear(96, 40)
        seq = nn.Sequential(Linear2Bit.from_linear(lin, group_size=32)).eval()
        compiled = torch.compile(seq, fullgraph=True)
        for n in (3, 5):
            x = torch.randn(n, 96, generator=g)
            assert torch.equal(compiled(x), seq(x))
    finally:
        torch._dynamo.reset()


class _SharedLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = self.b = nn.Linear(64, 64)

    def forward(self, x):
        return self.b(self.a(x))


def test_save_and_load_a_layer_used_twice(tmp_path):
    """Saved under its first name, loaded at both: it once failed to load
    ("missing b.weight")."""
    torch.manual_seed(0)
    model = ulbtorch.quantize_(_SharedLayer(), bits=2)
    ulbtorch.save_quantized(model, str(tmp_path))
    loaded = ulbtorch.load_quantized(_SharedLayer(), str(tmp_path))
    assert loaded.a is loaded.b and type(loaded.a) is Linear2Bit
    x = torch.randn(3, 64)
    assert torch.equal(loaded(x), model(x))


def test_load_quantized_checks_everything_before_changing_the_model(tmp_path):
    """A failed load once left the model half converted; a model on meta
    once 'loaded' and stayed on meta; a hand-edited manifest gave a
    self-contradictory message."""
    import json
    import os

    model = ulbtorch.quantize_(tiny_llama(seed=0), bits=2)
    ulbtorch.save_quantized(model, str(tmp_path))
    manifest = tmp_path / "ulbtorch.json"
    good = json.loads(manifest.read_text())

    def types_after(fail_with, match):
        fresh = tiny_llama(seed=1)
        before = [type(m) for m in fresh.modules()]
        with pytest.raises(fail_with, match=match):
            ulbtorch.load_quantized(fresh, str(tmp_path))
        assert [type(m) for m in fresh.modules()] == before

    bad = json.loads(json.dumps(good))
    bad["layers"]["model.layers.0.mlp.up_proj"]["in_features"] = "64"
    manifest.write_text(json.dumps(bad))
    types_after(ValueError, r"'model.layers.0.mlp.up_proj': in_features must be a int, got '64'")
    bad = json.loads(json.dumps(good))
    bad["layers"]["model.norm"] = bad["layers"]["model.layers.0.mlp.up_proj"]
    manifest.write_text(json.dumps(bad))
    types_after(ValueError, r"'model.norm' is a LlamaRMSNorm in the model, not a linear layer")
    manifest.write_text(json.dumps(good))
    os.rename(tmp_path / "model.safetensors", tmp_path / "elsewhere")
    types_after(FileNotFoundError, "model.safetensors not found")
    os.rename(tmp_path / "elsewhere", tmp_path / "model.safetensors")
    with torch.device("meta"):
        on_meta = tiny_llama(seed=0)
    with pytest.raises(ValueError, match="on the meta device"):
        ulbtorch.load_quantized(on_meta, str(tmp_path))
    again = ulbtorch.load_quantized(ulbtorch.load_quantized(tiny_llama(seed=1), str(tmp_path)), str(tmp_path))
    ids = prompt()
    with torch.no_grad():
        assert torch.equal(again(ids).logits, model(ids).logits)

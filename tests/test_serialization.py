"""ulbtorch.save_quantized / load_quantized: a round trip gives the same layers
and logits (1-bit tiles in this CPU's order, a layer used twice included); a bad
checkpoint is a clear error and leaves the model as it was."""
import os
import warnings

import pytest
import torch
from torch import nn

import ulbtorch
from ulbtorch import ops, runtime
from ulbtorch.nn import Linear2Bit

from _layers import isa_preferring
from _tiny_llama import lowbit_names, prompt, tiny_llama

M, K = 8, 64


def test_load_quantized_requires_an_untied_lm_head(tmp_path):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, vocab_size=100,
                                   tie_word_embeddings=False)
    model = ulbtorch.quantize_(transformers.AutoModelForCausalLM.from_config(cfg), bits=2)
    ulbtorch.save_quantized(model, tmp_path)
    from safetensors.torch import load_file, save_file
    state = load_file(tmp_path / "model.safetensors")
    del state["lm_head.weight"]
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="lm_head.weight"):
        ulbtorch.load_quantized(transformers.AutoModelForCausalLM.from_config(cfg), tmp_path)


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


# ---- bad input ------------------------------------------------------------------------------------

def test_load_quantized_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a directory written by ulbtorch.save_quantized"):
        ulbtorch.load_quantized(torch.nn.Sequential(torch.nn.Linear(K, M)), str(tmp_path))
    with pytest.raises(ValueError, match="no ulbtorch low-bit layers"):
        ulbtorch.save_quantized(torch.nn.Sequential(torch.nn.Linear(K, M)), str(tmp_path))
    model = ulbtorch.quantize_(torch.nn.Sequential(torch.nn.Linear(K, M)), bits=2)
    ulbtorch.save_quantized(model, str(tmp_path))
    with pytest.raises(ValueError, match=r"is 32->8 in the model but 64->8 in the checkpoint"):
        ulbtorch.load_quantized(torch.nn.Sequential(torch.nn.Linear(32, M)), str(tmp_path))


def _saved_mlp(tmp_path):
    def mk():
        return torch.nn.Sequential(torch.nn.Linear(K, K), torch.nn.ReLU(), torch.nn.Linear(K, M))
    ulbtorch.save_quantized(ulbtorch.quantize_(mk(), bits=2, hugepages=False), str(tmp_path))
    return mk


@pytest.mark.parametrize("damage", ["header", "bias"])
def test_load_quantized_with_a_bad_tensor_leaves_the_model_as_it_was(tmp_path, damage):
    from safetensors.torch import load_file, save_file
    mk = _saved_mlp(tmp_path)
    path = str(tmp_path / "model.safetensors")
    sd = load_file(path)
    if damage == "header":
        blob = sd["2.packed"].clone()
        blob[8] ^= 0xFF
        sd["2.packed"] = blob
    else:
        sd["2.bias"] = torch.zeros(M - 1)
    save_file(sd, path)
    model = mk()
    with pytest.raises(ValueError, match="layer '2'"):
        ulbtorch.load_quantized(model, str(tmp_path), hugepages=False)
    assert [type(m) for m in model] == [torch.nn.Linear, torch.nn.ReLU, torch.nn.Linear]


def test_load_quantized_into_a_float32_model_warns_of_the_bf16_gemv(tmp_path):
    """The manifest's bf16_gemv layers need bf16 weights: a float32 model kept
    lm_head on F.linear, with other logits, and said nothing."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=512)
    model = ulbtorch.quantize_(transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16), bits=2)
    ulbtorch.save_quantized(model, str(tmp_path))
    with pytest.warns(UserWarning, match=r"load_quantized: lm_head \(float32\) left on F.linear: .*"
                                         r"build the model with dtype=torch.bfloat16"):
        # (from_config(cfg) with no dtype would be bf16 too: the first call set cfg.dtype)
        loaded = ulbtorch.load_quantized(transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32),
                                         str(tmp_path))
    assert type(loaded.lm_head) is torch.nn.Linear  # behaviour unchanged: only the warning is new
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="load_quantized")  # a bf16 model: no warning
        loaded = ulbtorch.load_quantized(transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16),
                                         str(tmp_path))
    assert type(loaded.lm_head) is ulbtorch.LinearBF16


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
    types_after(ValueError, r"ulbtorch.json: layer 'model.layers.0.mlp.up_proj': key 'in_features': expected an int, "
                            r"got '64'")
    bad = json.loads(json.dumps(good))
    bad["layers"]["model.norm"] = bad["layers"]["model.layers.0.mlp.up_proj"]
    manifest.write_text(json.dumps(bad))
    types_after(ValueError, r"'model.norm' is a LlamaRMSNorm in the model, not a linear layer")
    manifest.write_text(json.dumps(good))
    os.rename(tmp_path / "model.safetensors", tmp_path / "elsewhere")
    types_after(FileNotFoundError, "model.safetensors not found: the directory has ulbtorch.json but not the weights")
    os.rename(tmp_path / "elsewhere", tmp_path / "model.safetensors")
    with torch.device("meta"):
        on_meta = tiny_llama(seed=0)
    with pytest.raises(ValueError, match="on the meta device"):
        ulbtorch.load_quantized(on_meta, str(tmp_path))
    again = ulbtorch.load_quantized(ulbtorch.load_quantized(tiny_llama(seed=1), str(tmp_path)), str(tmp_path))
    ids = prompt()
    with torch.no_grad():
        assert torch.equal(again(ids).logits, model(ids).logits)


def _v1_checkpoint(tmp_path, manifest_text):
    """A directory as ulbtorch wrote it before the manifest moved into the
    weights' metadata, with manifest_text as its ulbtorch.json."""
    from safetensors.torch import load_file, save_file
    _saved_mlp(tmp_path)
    weights = tmp_path / "model.safetensors"
    save_file(load_file(weights), weights, metadata={"format": "pt", "ulbtorch": "1"})
    (tmp_path / "ulbtorch.json").write_text(manifest_text)


@pytest.mark.parametrize("text,match", [
    ("[1, 2]", r"ulbtorch.json: expected a JSON object with keys 'version', 'layers' and 'bf16_gemv', got a list"),
    ('{"version": 1, "layers": {', r"ulbtorch.json: not valid JSON \(Expecting"),
    ('{"version": 1, "layers": {}, "bf16_gemv": 5}', r"ulbtorch.json: key 'bf16_gemv': expected a list of layer "
                                                     r"names \(strings\), got 5"),
    ('{"version": 7, "layers": {}}', r"ulbtorch.json: key 'version': expected one of \[1, 2\] .* got 7"),
    ('{"version": 1, "layers": []}', r"ulbtorch.json: key 'layers': expected an object of layer name -> layer, "
                                     r"got a list"),
    ('{"version": 1, "layers": {"2": 3}}', r"ulbtorch.json: layer '2': expected an object with keys \['bias', "),
    ('{"version": 2, "layers": {}}', r"ulbtorch.json: key 'save_id': expected a string, got None"),
])
def test_a_bad_manifest_file_names_the_file_the_key_and_what_was_expected(tmp_path, text, match):
    """They gave AttributeError: 'list' object has no attribute 'get', a bare
    JSONDecodeError, or "'int' object is not iterable"."""
    _v1_checkpoint(tmp_path, text)
    model = torch.nn.Sequential(torch.nn.Linear(K, K), torch.nn.ReLU(), torch.nn.Linear(K, M))
    with pytest.raises(ValueError, match=match):
        ulbtorch.load_quantized(model, str(tmp_path))
    assert [type(m) for m in model] == [torch.nn.Linear, torch.nn.ReLU, torch.nn.Linear]


def test_a_bad_manifest_in_the_weights_metadata_names_the_key(tmp_path):
    from safetensors.torch import load_file, save_file
    _saved_mlp(tmp_path)
    os.remove(tmp_path / "ulbtorch.json")
    weights = tmp_path / "model.safetensors"
    save_file(load_file(weights), weights, metadata={"ulbtorch_manifest": '{"version": 2, "layers": 5}'})
    with pytest.raises(ValueError, match=r"model.safetensors \(metadata key 'ulbtorch_manifest'\): key 'layers': "
                                         r"expected an object of layer name -> layer, got an int"):
        ulbtorch.load_quantized(torch.nn.Sequential(torch.nn.Linear(K, M)), str(tmp_path))
    save_file(load_file(weights), weights, metadata={"format": "pt"})
    with pytest.raises(FileNotFoundError, match=r"ulbtorch.json not found, nor a manifest in .*model.safetensors's "
                                                r"metadata"):
        ulbtorch.load_quantized(torch.nn.Sequential(torch.nn.Linear(K, M)), str(tmp_path))
    weights.write_bytes(b"not safetensors")
    with pytest.raises(ValueError, match=r"model.safetensors: not a readable safetensors file"):
        ulbtorch.load_quantized(torch.nn.Sequential(torch.nn.Linear(K, M)), str(tmp_path))

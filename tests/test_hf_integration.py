"""transformers quantization method "ulb" and the BitNet conversion after
transformers' own from_pretrained."""
import json
import warnings

import pytest
import torch

pytest.importorskip("transformers")
from transformers import AutoModelForCausalLM, LlamaConfig  # noqa: E402

import ulbtorch  # noqa: E402
from ulbtorch import UlbConfig  # noqa: E402
from ulbtorch.importers import convert_bitnet_model  # noqa: E402
from ulbtorch.nn import Linear1Bit, Linear2Bit, Linear4Bit, Linear8Bit, LinearBF16, LinearTernary  # noqa: E402

from test_importers import make_checkpoint  # noqa: E402

CFG = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2, vocab_size=300)


@pytest.fixture(scope="module")
def float_dir(tmp_path_factory):
    torch.manual_seed(0)
    d = tmp_path_factory.mktemp("float")
    AutoModelForCausalLM.from_config(LlamaConfig(**CFG)).save_pretrained(d)
    return d


@pytest.mark.parametrize("bits,cls,gs", [(2, Linear2Bit, 64), (1, Linear1Bit, 0), ("ternary", LinearTernary, 32),
                                       (4, Linear4Bit, 32)])
def test_quantize_on_load_then_save_and_reload_bit_exact(float_dir, tmp_path, bits, cls, gs):
    model = AutoModelForCausalLM.from_pretrained(float_dir, quantization_config=UlbConfig(bits=bits, group_size=gs))
    assert isinstance(model.model.layers[0].self_attn.q_proj, cls)
    assert isinstance(model.lm_head, torch.nn.Linear)
    ids = torch.randint(0, 300, (1, 7))
    logits = model(ids).logits
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert saved["quant_method"] == "ulb" and saved["group_size"] == gs
    again = AutoModelForCausalLM.from_pretrained(tmp_path)
    layer = again.model.layers[1].mlp.down_proj
    assert isinstance(layer, cls)
    assert torch.equal(layer.packed, model.model.layers[1].mlp.down_proj.packed)
    assert torch.equal(again(ids).logits, logits)


@pytest.mark.parametrize("kwargs", [dict(bits=2, group_size=32), dict(bits=1, exclude=["*.q_proj", "lm_head"]),
                                    dict(bits=2, lm_head_bits=8)])
def test_quantize_then_save_pretrained_reloads_packed(float_dir, tmp_path, kwargs):
    """quantize_ records its UlbConfig in model.config, so transformers'
    save_pretrained writes a checkpoint from_pretrained loads packed (without
    it, from_pretrained built nn.Linear layers with random weights)."""
    model = ulbtorch.quantize_(AutoModelForCausalLM.from_pretrained(float_dir), **kwargs)
    assert model.config.quantization_config.to_quant_config().to_dict() == ulbtorch.QuantConfig(**kwargs).to_dict()
    _reloads_bit_exact(model, tmp_path)


def _reloads_bit_exact(model, tmp_path):
    ids = torch.randint(0, 300, (1, 7))
    logits = model(ids).logits
    model.save_pretrained(tmp_path)
    again = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert [type(m) for m in again.modules()] == [type(m) for m in model.modules()]
    assert torch.equal(again(ids).logits, logits)


@pytest.mark.parametrize("kwargs", [dict(include=["*.mlp.*"]), dict(include=["*.mlp.*"], lm_head_bits=8)])
def test_quantize_with_include_patterns_saves_through_transformers(float_dir, tmp_path, kwargs):
    """Include patterns are recorded as the names of the layers they leave
    out (UlbConfig has modules_to_not_convert only): save_pretrained then
    writes a checkpoint from_pretrained loads packed, bit for bit (before,
    it loaded those layers with random weights)."""
    model = ulbtorch.quantize_(AutoModelForCausalLM.from_pretrained(float_dir), bits=2, **kwargs)
    skipped = model.config.quantization_config.modules_to_not_convert
    assert "model.layers.0.self_attn.q_proj" in skipped and "model.layers.0.mlp.up_proj" not in skipped
    assert len(skipped) == len(set(skipped))  # lm_head once: its pattern, not its name again
    _reloads_bit_exact(model, tmp_path)


@pytest.mark.parametrize("kwargs", [dict(include=["*.mlp.*"]), dict(include=["layers.1.*"]), dict(exclude=[]),
                                    dict(exclude=["layers.0.self_attn.q_proj"])])
def test_quantize_of_the_base_model_saves_through_the_head_model(float_dir, tmp_path, kwargs):
    """quantize_(model.model, ...) records its config in the config the head
    model shares; the head model saves its layers as "model.layers...", so
    names relative to model.model must match there too (they once named
    layers that do not exist, and the checkpoint failed to load)."""
    model = AutoModelForCausalLM.from_pretrained(float_dir)
    ulbtorch.quantize_(model.model, bits=2, **kwargs)
    assert isinstance(model.model.layers[1].mlp.up_proj, Linear2Bit)
    _reloads_bit_exact(model, tmp_path)


def test_quantize_converting_nothing_records_nothing(float_dir):
    model = AutoModelForCausalLM.from_pretrained(float_dir)
    with pytest.warns(UserWarning, match="no layer converted"):
        ulbtorch.quantize_(model, bits=2, include=["*.no_such_layer"])
    assert getattr(model.config, "quantization_config", None) is None


def test_second_quantize_converting_nothing_keeps_the_config(float_dir, tmp_path):
    """A second quantize_ that selects no layer leaves the first one's
    config (it once recorded its own, so the checkpoint failed to load)."""
    model = ulbtorch.quantize_(AutoModelForCausalLM.from_pretrained(float_dir), bits=2)
    with pytest.warns(UserWarning, match="no layer converted"):
        ulbtorch.quantize_(model, bits=1)
    assert model.config.quantization_config.format == "int2_sym"
    _reloads_bit_exact(model, tmp_path)


def test_mixed_formats_record_no_config(float_dir):
    """Layers of two formats: no UlbConfig says that, so the first config is
    dropped with a warning that names save_quantized."""
    model = ulbtorch.quantize_(AutoModelForCausalLM.from_pretrained(float_dir), bits=2, exclude=["*.mlp.*", "lm_head"])
    assert model.config.quantization_config.format == "int2_sym"
    with pytest.warns(UserWarning, match="save_quantized"):
        ulbtorch.quantize_(model, bits=1, include=["*.mlp.*"])
    assert getattr(model.config, "quantization_config", None) is None


def test_tied_quantized_lm_head_saves_untied(tmp_path):
    """exclude=[] quantizes an lm_head tied to the input embedding: the
    packed lm_head is a weight of its own beside the float embedding, so the
    model is untied (it recorded no config and save_pretrained wrote a
    checkpoint that loaded unquantized); save_pretrained writes the one
    packed copy and the embedding, from_pretrained loads them back bit for bit."""
    from safetensors import safe_open
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**CFG, tie_word_embeddings=True))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ulbtorch.quantize_(model, bits=2, exclude=[])
    assert isinstance(model.lm_head, Linear2Bit) and model.config.quantization_config.modules_to_not_convert == []
    assert model.config.tie_word_embeddings is False and model.all_tied_weights_keys == {}
    model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["tie_word_embeddings"] is False
    with safe_open(tmp_path / "model.safetensors", framework="pt") as f:
        assert {k for k in f.keys() if "lm_head" in k or "embed" in k} == {"lm_head.packed",
                                                                             "model.embed_tokens.weight"}
    again = AutoModelForCausalLM.from_pretrained(tmp_path)
    ids = torch.randint(0, 300, (1, 5))
    assert isinstance(again.lm_head, Linear2Bit) and torch.equal(again(ids).logits, model(ids).logits)


def test_bf16_gemv_option_survives_save_and_reload(float_dir, tmp_path):
    cfg = UlbConfig(bits=2)  # bf16_gemv on by default
    assert cfg.bf16_gemv is True
    model = AutoModelForCausalLM.from_pretrained(float_dir, dtype=torch.bfloat16, quantization_config=cfg)
    assert type(model.lm_head) is LinearBF16
    model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["quantization_config"]["bf16_gemv"] is True
    again = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert type(again.lm_head) is LinearBF16
    ids = torch.randint(0, 300, (1, 5))
    assert torch.equal(again.generate(ids, max_new_tokens=3, do_sample=False),
                       model.generate(ids, max_new_tokens=3, do_sample=False))
    plain = AutoModelForCausalLM.from_pretrained(float_dir, quantization_config=UlbConfig(bits=2))
    assert type(plain.lm_head) is torch.nn.Linear  # fp32: only bf16 layers take the GEMV
    plain = AutoModelForCausalLM.from_pretrained(float_dir, dtype=torch.bfloat16,
                                                 quantization_config=UlbConfig(bits=2, bf16_gemv=False))
    assert type(plain.lm_head) is torch.nn.Linear
    plain.save_pretrained(tmp_path / "plain")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "plain", dtype=torch.bfloat16)
    assert type(again.lm_head) is torch.nn.Linear  # the opt-out survives the round trip too


def test_bad_config_is_rejected():
    with pytest.raises(ValueError, match="bits"):
        UlbConfig(bits=3)
    with pytest.raises(ValueError, match="group_size"):
        UlbConfig(bits=2, group_size=40)
    # Before any weight is read, not at the first layer after all of them.
    with pytest.raises(ValueError, match="granularity must be one of"):
        UlbConfig(bits=2, granularity="row")
    with pytest.raises(ValueError, match="method must be one of"):
        UlbConfig(bits=2, method="foo")


def test_empty_modules_to_not_convert_converts_lm_head(float_dir):
    """[] means every layer (as in transformers' other quantizers); only None
    means the default, which keeps lm_head."""
    assert UlbConfig(bits=2).modules_to_not_convert == ["lm_head", "*.lm_head"]
    model = AutoModelForCausalLM.from_pretrained(float_dir, quantization_config=UlbConfig(
        bits=2, modules_to_not_convert=[]))
    assert type(model.lm_head) is Linear2Bit


def test_packed_checkpoint_disagreeing_with_config_fails(float_dir, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(float_dir, quantization_config=UlbConfig(bits=2))
    model.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["quantization_config"]["format"] = "int2"  # same size, other level map
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    # transformers 5.2x assigns the buffer, which the layer checks; older
    # versions copy into it and our check after loading names the layer; 4.56
    # loads through load_state_dict, where the layer's check reports it.
    with pytest.raises((RuntimeError, ValueError), match="q_proj: the checkpoint disagrees|packed weight is .*'format': 'int2_sym'"
                                         ".* but the layer is .*'format': 'int2'"):
        AutoModelForCausalLM.from_pretrained(tmp_path)
    cfg["quantization_config"].update(format="binary", bits=1)  # other size
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    # transformers >= 5.2x refuses the buffer's size while loading; 5.17
    # loads the blob and our check after loading refuses it.
    with pytest.raises((RuntimeError, ValueError), match="mismatch|q_proj: the checkpoint disagrees|"
                                                         "packed weight is .* but the layer is .*'format': 'binary'"):
        AutoModelForCausalLM.from_pretrained(tmp_path)


@pytest.mark.parametrize("linear_class", ["bitlinear", "autobitlinear"])
def test_bitnet_from_pretrained_then_convert(tmp_path, linear_class):
    make_checkpoint(tmp_path, linear_class)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    convert_bitnet_model(model)
    layers = [m for m in model.modules() if isinstance(m, LinearTernary)]
    assert len(layers) == 14 and all(m.granularity == "tensor" for m in layers)
    out = tmp_path / "converted"
    model.save_pretrained(out)
    again = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert isinstance(again.model.layers[0].mlp.gate_proj, LinearTernary)
    # (Whole-model logits are not compared: transformers' own BitNet loading
    # path computes the rotary embedding at another precision.)
    before, after = model.state_dict(), again.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)
    x = torch.randn(2, 128)
    assert torch.equal(again.model.layers[1].self_attn.q_proj(x), model.model.layers[1].self_attn.q_proj(x))


def test_unknown_quant_method_or_option_is_rejected():
    # (transformers itself loads a config.json naming an unregistered method as a
    # float model and only reports the unexpected tensors.)
    with pytest.raises(ValueError, match="quant_method 'ulb', got 'ulb_nonexistent'"):
        UlbConfig.from_dict({"quant_method": "ulb_nonexistent", "bits": 2})
    with pytest.raises(ValueError, match="unknown options \\['bitz'\\]"):
        UlbConfig.from_dict({"quant_method": "ulb", "bitz": 2})
    assert UlbConfig.from_dict({"quant_method": "ulb", "bits": 1}).format == "binary"


def _run(code):
    import subprocess
    import sys
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()


def test_import_is_lazy_and_registration_follows_transformers():
    # import ulbtorch leaves transformers' quantizer registry alone (seconds to import) ...
    assert _run("import sys, ulbtorch; print('transformers.quantizers' in sys.modules)") == ["False"]
    # ... and "ulb" is registered as soon as anything loads it, before or after ulbtorch.
    check = ("from transformers.quantizers.auto import AUTO_QUANTIZER_MAPPING as Q, "
             "AUTO_QUANTIZATION_CONFIG_MAPPING as C; print('ulb' in Q, 'ulb' in C)")
    assert _run("import ulbtorch\n" + check) == ["True", "True"]
    assert _run("import transformers.quantizers, ulbtorch\n" + check) == ["True", "True"]
    assert _run("import ulbtorch; print(ulbtorch.UlbConfig.__name__)") == ["UlbConfig"]


@pytest.mark.parametrize("head_bits,head_gs,cls", [(8, 0, Linear8Bit), (4, 32, Linear4Bit)])
def test_quantized_lm_head_through_transformers(float_dir, tmp_path, head_bits, head_gs, cls):
    cfg = UlbConfig(bits=2, lm_head_bits=head_bits, lm_head_group_size=head_gs)
    model = AutoModelForCausalLM.from_pretrained(float_dir, dtype=torch.bfloat16, quantization_config=cfg)
    assert type(model.lm_head) is cls and type(model.model.layers[0].mlp.up_proj) is Linear2Bit
    assert model.lm_head.group_size == head_gs
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    # lm_head_group_size 0 is left out, so an older ulbtorch still reads the config.
    assert (saved["lm_head_bits"], saved.get("lm_head_group_size", 0)) == (head_bits, head_gs)
    assert ("lm_head_group_size" in saved) == bool(head_gs)
    again = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert type(again.lm_head) is cls and torch.equal(again.lm_head.packed, model.lm_head.packed)
    ids = torch.randint(0, 300, (1, 5))
    assert torch.equal(again(ids).logits, model(ids).logits)


def test_tied_lm_head_packed_while_loading_is_untied(tmp_path):
    """Quantizing a tied lm_head while loading (lm_head_bits, or
    modules_to_not_convert that leaves it in) is quantize_ on the loaded
    model, which unties it; a bf16 lm_head stays tied. A packed checkpoint
    whose config says tied is refused: it has no lm_head weight to share."""
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(LlamaConfig(**CFG, tie_word_embeddings=True)).save_pretrained(tmp_path / "f")
    ids = torch.randint(0, 300, (1, 5))
    for cfg, cls in ((UlbConfig(bits=2, lm_head_bits=8), Linear8Bit),
                     (UlbConfig(bits=2, modules_to_not_convert=["nothing"]), Linear2Bit)):
        model = AutoModelForCausalLM.from_pretrained(tmp_path / "f", quantization_config=cfg)
        assert type(model.lm_head) is cls and model.config.tie_word_embeddings is False
        want = ulbtorch.quantize_(AutoModelForCausalLM.from_pretrained(tmp_path / "f"), cfg.to_quant_config())
        assert torch.equal(model(ids).logits, want(ids).logits)
    model.save_pretrained(tmp_path / "q")
    config = json.loads((tmp_path / "q" / "config.json").read_text())
    (tmp_path / "q" / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    with pytest.raises(ValueError, match=r"ulb: the checkpoint's 'lm_head' is packed but its config ties it to the "
                                         r"input embedding \(tie_word_embeddings\)"):
        AutoModelForCausalLM.from_pretrained(tmp_path / "q")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "f", dtype=torch.bfloat16,
                                                 quantization_config=UlbConfig(bits=2))
    assert type(model.lm_head) is LinearBF16 and model.lm_head.weight is model.model.embed_tokens.weight


@pytest.mark.parametrize("saved,loaded_as", [("vnni", "lanes"), ("lanes", "vnni")])
def test_prequantized_1bit_checkpoint_loads_in_this_cpus_tile_order(float_dir, tmp_path, saved, loaded_as):
    """A 1-bit checkpoint packed where the other tile order was preferred
    loads in this CPU's order (from_pretrained's post-load step retiles it),
    with the same codes and logits."""
    from ulbtorch import ops, runtime

    from _layers import isa_preferring

    pack_isa, load_isa = isa_preferring(saved), isa_preferring(loaded_as)
    if pack_isa is None or load_isa is None:
        pytest.skip(f"no ISA here packs 1-bit codes in {saved if pack_isa is None else loaded_as} tiles")
    with runtime.use_isa(pack_isa):
        model = AutoModelForCausalLM.from_pretrained(float_dir, quantization_config=UlbConfig(bits=1))
    old = model.model.layers[1].mlp.down_proj.packed
    assert ops.packed_info(old)["tiles"] == saved
    ids = torch.randint(0, 300, (1, 7))
    logits = model(ids).logits
    model.save_pretrained(tmp_path)
    with runtime.use_isa(load_isa):
        again = AutoModelForCausalLM.from_pretrained(tmp_path)
    new = again.model.layers[1].mlp.down_proj.packed
    assert ops.packed_info(new)["tiles"] == loaded_as
    assert all(torch.equal(a, b) for a, b in zip(ops.unpack(old), ops.unpack(new)))
    assert torch.equal(again(ids).logits, logits)


def _falcon(dtype=torch.float32):
    from transformers import FalconConfig
    torch.manual_seed(0)
    cfg = FalconConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=300,
                       new_decoder_architecture=True, num_kv_heads=2)
    return AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()  # not .to(dtype): that casts the rotary buffers


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_falcon_linear_layers_convert_and_save_pretrained_reloads(tmp_path, dtype):
    """Falcon's layers are FalconLinear, an nn.Linear subclass computing
    input @ W.T + b; they stayed float (silently, once lm_head_bits converted
    the head), so a "2-bit" Falcon was a float one."""
    model = _falcon(dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ulbtorch.quantize_(model, bits=2, group_size=32)
    attn = model.transformer.h[0].self_attention
    assert isinstance(attn.query_key_value, Linear2Bit) and isinstance(attn.dense, Linear2Bit)
    assert isinstance(model.transformer.h[0].mlp.dense_4h_to_h, Linear2Bit)
    ids = torch.randint(0, 300, (1, 6))
    with torch.no_grad():
        logits = model(ids).logits
        for m in model.modules():
            if isinstance(m, Linear2Bit):
                m.force_reference = True
        ref = model(ids).logits
        for m in model.modules():
            if isinstance(m, Linear2Bit):
                m.force_reference = False
    torch.testing.assert_close(logits.float(), ref.float(), atol=1e-4 if dtype == torch.float32 else 5e-2, rtol=0)
    _reloads_bit_exact(model, tmp_path)


def test_falcon_quantized_on_load_through_ulbconfig(tmp_path):
    _falcon(torch.bfloat16).save_pretrained(tmp_path / "float")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "float", quantization_config=UlbConfig(bits=2))
    assert isinstance(model.transformer.h[1].self_attention.query_key_value, Linear2Bit)
    _reloads_bit_exact(model, tmp_path / "packed")


# ---- UlbConfig: bad input -------------------------------------------------------------------------

@pytest.mark.parametrize("bad", ["no", 1, 0, None])
def test_ulb_config_bf16_gemv_is_a_bool(bad):
    """bool("no") is True: the option took any truthy value as on."""
    pytest.importorskip("transformers")
    with pytest.raises(TypeError, match=f"UlbConfig's bf16_gemv takes True or False, got {bad!r}"):
        ulbtorch.UlbConfig(bf16_gemv=bad)


def test_ulb_config_from_dict_and_update_check_their_options():
    """transformers' mixin set from_dict's kwargs and update's as attributes,
    past __init__'s checks (from_dict(d, bf16_gemv="no") kept "no")."""
    pytest.importorskip("transformers")
    d = ulbtorch.UlbConfig(format="binary").to_dict()
    with pytest.raises(TypeError, match="UlbConfig's bf16_gemv takes True or False, got 'no'"):
        ulbtorch.UlbConfig.from_dict(d, bf16_gemv="no")
    config, unused = ulbtorch.UlbConfig.from_dict(d, group_size=64, other=1, return_unused_kwargs=True)
    assert (config.format, config.group_size, config.granularity, unused) == ("binary", 64, "group", {"other": 1})
    with pytest.raises(ValueError, match="group_size must be 0 or a multiple of 32 for 'binary', got 48"):
        config.update(group_size=48)
    assert config.group_size == 64  # a refused update leaves the config as it was
    assert config.update(group_size=0, other=2) == {"other": 2}
    assert (config.group_size, config.granularity) == (0, "channel")
    tensor = ulbtorch.UlbConfig(granularity="tensor")
    with pytest.raises(ValueError, match="group_size=32 needs granularity='group'"):
        tensor.update(group_size=32)


def test_ulb_config_checks_options_as_quantize_does():
    pytest.importorskip("transformers")
    for kwargs, error, match in [(dict(bits=True), ValueError, "bits must be 1, 'ternary'/1.58, 2, 4 or 8"),
                                 (dict(group_size=32.0), TypeError, "group_size must be an int"),
                                 (dict(lm_head_bits=True), ValueError, "lm_head_bits=True"),
                                 (dict(lm_head_group_size="32"), TypeError, "lm_head_group_size must be an int")]:
        with pytest.raises(error, match=match):
            ulbtorch.UlbConfig(**kwargs)
        with pytest.raises(error, match=match):
            ulbtorch.QuantConfig(**kwargs)
    cfg = ulbtorch.UlbConfig(bits=4, group_size=32, bf16_gemv=False, lm_head_bits=8)
    back = ulbtorch.UlbConfig.from_dict(json.loads(cfg.to_json_string()))
    assert back.to_dict() == cfg.to_dict() and back.bf16_gemv is False

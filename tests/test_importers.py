"""Importers of already-low-bit checkpoints: HF BitNet format and on-grid
float weights (ParetoQ style)."""
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

transformers = pytest.importorskip("transformers")
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM  # noqa: E402
from transformers.integrations.bitnet import pack_weights, unpack_weights  # noqa: E402

from ulbtorch.importers import (convert_grid_linears, load_bitnet_checkpoint, pack_grid_weight,  # noqa: E402
                                unpack_hf_bitnet)
from ulbtorch.nn import Linear1Bit, Linear2Bit, LinearTernary  # noqa: E402

CFG = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2, vocab_size=300, tie_word_embeddings=False)


def bitnet_forward(x, t, ws, linear_class):
    """BitNet's own forward (transformers BitLinear / AutoBitLinear) in fp32."""
    scale = 127.0 / x.abs().amax(dim=-1, keepdim=True).clamp(min=1e-5)
    xq = (x * scale).round().clamp(-128, 127)
    y = torch.nn.functional.linear(xq, t.float())
    return y / (scale * ws) if linear_class == "bitlinear" else y / scale * ws


def make_checkpoint(tmp_path, linear_class, seed=0, **cfg_overrides):
    torch.manual_seed(seed)
    model_cfg = dict(CFG, **cfg_overrides)
    model = LlamaForCausalLM(LlamaConfig(**model_cfg)).eval()
    state, ternary = {}, {}
    for name, t in model.state_dict().items():
        module = name.rsplit(".", 1)[0]
        if name.endswith(".weight") and ("self_attn" in name or "mlp" in name):
            tern = torch.randint(-1, 2, t.shape).float()
            ws = torch.rand(1) * 2 + 0.5
            ternary[module] = (tern, ws)
            state[name] = pack_weights(tern.clone())
            state[module + ".weight_scale"] = ws.to(torch.bfloat16)
        elif name.endswith(".bias"):  # transformers initialises biases to zero, which would hide a lost one
            state[name] = torch.randn(t.shape).to(torch.bfloat16)
        else:
            state[name] = t.to(torch.bfloat16).contiguous()
    save_file(state, str(tmp_path / "model.safetensors"))
    cfg = LlamaConfig(**model_cfg).to_dict()
    cfg["quantization_config"] = {"quant_method": "bitnet", "linear_class": linear_class,
                                  "modules_to_not_convert": None}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return ternary


def shard_checkpoint(src, dst, in_second_shard):
    """Copy the single-file checkpoint in src to dst as two shards plus an
    index; tensors whose name in_second_shard accepts go to shard 2."""
    dst.mkdir()
    shutil.copy(src / "config.json", dst / "config.json")
    state = load_file(str(src / "model.safetensors"))
    files = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
    weight_map = {k: files[in_second_shard(k)] for k in state}
    for file in files:
        save_file({k: v for k, v in state.items() if weight_map[k] == file}, str(dst / file))
    index = {"metadata": {}, "weight_map": weight_map}
    (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    return state


def test_unpack_matches_transformers():
    torch.manual_seed(1)
    tern = torch.randint(-1, 2, (64, 40)).float()
    packed = pack_weights(tern.clone())
    codes = unpack_hf_bitnet(packed, 64)
    assert torch.equal(codes.float() - 1, unpack_weights(packed, torch.float32))
    assert torch.equal(codes.float() - 1, tern)


@pytest.mark.parametrize("linear_class", ["bitlinear", "autobitlinear"])
def test_load_bitnet_checkpoint_is_lossless(tmp_path, linear_class):
    ternary = make_checkpoint(tmp_path, linear_class)
    model = load_bitnet_checkpoint(str(tmp_path), dtype=torch.float32)
    layers = {n: m for n, m in model.named_modules() if isinstance(m, LinearTernary)}
    assert set(layers) == set(ternary)
    assert isinstance(model.lm_head, torch.nn.Linear)
    for name, layer in layers.items():
        tern, ws = ternary[name]
        ws = ws.to(torch.bfloat16).float()
        assert layer.granularity == "tensor" and layer.format == "ternary"
        xi = torch.randn(3, layer.in_features)
        expect = bitnet_forward(xi, tern, ws, linear_class)
        got = layer(xi)
        torch.testing.assert_close(got, expect, rtol=1e-5, atol=1e-5 * expect.abs().max().item())
    ids = torch.randint(0, 300, (1, 6))
    out = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert out.shape == (1, 10)


BIASED = dict(attention_bias=True, mlp_bias=True)


@pytest.mark.parametrize("apart", [(".bias",), (".bias", ".weight_scale")])
def test_sharded_checkpoint_tensors_apart_from_weights(tmp_path, apart):
    single = tmp_path / "single"
    single.mkdir()
    make_checkpoint(single, "bitlinear", **BIASED)
    state = shard_checkpoint(single, tmp_path / "sharded", lambda k: k.endswith(apart))
    sharded = load_bitnet_checkpoint(str(tmp_path / "sharded"), dtype=torch.float32)
    layers = {n: m for n, m in sharded.named_modules() if isinstance(m, LinearTernary)}
    assert len(layers) == 14
    for name, layer in layers.items():
        assert layer.bias is not None, name
        torch.testing.assert_close(layer.bias, state[name + ".bias"].float(), rtol=0, atol=0)
    reference = load_bitnet_checkpoint(str(single), dtype=torch.float32)
    ids = torch.randint(0, 300, (2, 7))
    with torch.no_grad():
        torch.testing.assert_close(sharded(ids).logits, reference(ids).logits)


def test_sharded_checkpoint_missing_scale_is_an_error(tmp_path):
    make_checkpoint(tmp_path, "bitlinear")
    state = shard_checkpoint(tmp_path, tmp_path / "sharded", lambda k: k.endswith(".weight_scale"))
    del state["model.layers.0.mlp.up_proj.weight_scale"]
    save_file({k: v for k, v in state.items() if k.endswith(".weight_scale")},
              str(tmp_path / "sharded" / "model-00002-of-00002.safetensors"))
    with pytest.raises(ValueError, match="up_proj.weight has no .*up_proj.weight_scale"):
        load_bitnet_checkpoint(str(tmp_path / "sharded"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bitnet_bias_follows_requested_dtype(tmp_path, dtype):
    make_checkpoint(tmp_path, "autobitlinear", **BIASED)
    model = load_bitnet_checkpoint(str(tmp_path), dtype=dtype)
    biases = [m.bias for m in model.modules() if isinstance(m, LinearTernary)]
    assert biases and all(b is not None and b.dtype == dtype for b in biases)


def test_bitnet_checkpoint_errors(tmp_path):
    make_checkpoint(tmp_path, "bitlinear")
    state = load_file(str(tmp_path / "model.safetensors"))
    del state["model.layers.0.mlp.up_proj.weight_scale"]
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="up_proj.weight_scale"):
        load_bitnet_checkpoint(str(tmp_path))
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["quantization_config"]["linear_class"] = "weird"
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="linear_class"):
        load_bitnet_checkpoint(str(tmp_path))


def test_unpack_rejects_bad_packed():
    with pytest.raises(ValueError, match="uint8"):
        unpack_hf_bitnet(torch.zeros(4, 8), 16, "layer.weight")
    with pytest.raises(ValueError, match="code 3"):
        unpack_hf_bitnet(torch.full((4, 8), 255, dtype=torch.uint8), 16, "layer.weight")
    with pytest.raises(ValueError, match="does not hold"):
        unpack_hf_bitnet(torch.zeros(3, 8, dtype=torch.uint8), 16, "layer.weight")


@pytest.mark.parametrize("bits,cls", [(1, Linear1Bit), ("ternary", LinearTernary), (2, Linear2Bit)])
def test_grid_weights_round_trip_bit_exact(bits, cls):
    torch.manual_seed(2)
    M, K = 96, 130
    alpha = torch.rand(M, 1) * 0.2 + 1e-3
    if bits == 1:
        w = (torch.randint(0, 2, (M, K)) * 2 - 1) * alpha
    elif bits == "ternary":
        w = torch.randint(-1, 2, (M, K)) * alpha
    else:
        w = torch.tensor([-3.0, -1, 1, 3])[torch.randint(0, 4, (M, K))] * alpha / 4
    w = w.to(torch.bfloat16)
    codes, scales, fmt = pack_grid_weight(w, bits, "w")
    layer = cls.from_codes(codes, scales, format=fmt)
    assert torch.equal(layer.dequantize().to(torch.bfloat16), w)
    if bits == 2:
        # The case that needs care: some rows have 3*bf16(a/4) != bf16(3a/4).
        wf = w.float().abs()
        assert (wf.amax(1) != 3 * wf.amin(1)).any()


def test_grid_refuses_off_grid_rows():
    w = torch.tensor([[0.25, -0.75, 0.25], [0.25, 0.5, -0.75]], dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="q_proj.weight: row 1"):
        pack_grid_weight(w, 2, "q_proj.weight")
    with pytest.raises(ValueError, match="row 0 .*1-bit"):
        pack_grid_weight(torch.tensor([[0.0, 1.0]]), 1, "w")
    with pytest.raises(ValueError, match="ternary grid"):
        pack_grid_weight(torch.tensor([[0.0, 1.0, -2.0]]), "ternary", "w")
    for bits in (1, "ternary", 2):
        for bad in (float("nan"), float("inf"), -float("inf")):
            with pytest.raises(ValueError, match="w: row 1 holds NaN or infinite"):
                pack_grid_weight(torch.tensor([[0.25, -0.25, 0.25], [bad, 0.25, -0.25]]), bits, "w")


GRID_LAYER = {1: Linear1Bit, "ternary": LinearTernary, 2: Linear2Bit}


def assert_grid_bit_exact(w, bits):
    codes, scales, fmt = pack_grid_weight(w, bits, "w")
    layer = GRID_LAYER[bits].from_codes(codes, scales, format=fmt)
    assert torch.equal(layer.dequantize().to(w.dtype), w)


def test_grid_2bit_outer_magnitude_a_power_of_two():
    """bf16(3 * 0.0208) = 0.0625 = 2^-4, whose rounding interval reaches only
    a quarter step below it: a scale picked from a symmetric half-step
    interval gave back 0.0623 and the row was refused."""
    row = (torch.tensor(0.0208) * torch.tensor([-3.0, -1, 1, 3] * 8)).bfloat16()[None]
    assert row.float().abs().amax().item() == 2.0 ** -4
    assert_grid_bit_exact(row, 2)
    model = torch.nn.Sequential(torch.nn.Linear(32, 4, bias=False, dtype=torch.bfloat16))
    with torch.no_grad():
        model[0].weight.copy_(row.expand(4, 32))
    convert_grid_linears(model, 2)
    assert type(model[0]) is Linear2Bit
    assert torch.equal(model[0].dequantize().to(torch.bfloat16), row.expand(4, 32))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bits", [1, "ternary", 2])
def test_grid_random_genuine_rows_bit_exact(bits, dtype):
    """Rows computed as fp32 scale x level and rounded to dtype, as a
    checkpoint trained on the grid stores them; two thirds of the scales sit
    near a power of two (for 2 bits, a or 3a near one), where rounding
    intervals are lopsided."""
    g = torch.Generator().manual_seed(3)
    M, K = 20000, 32
    pow2 = torch.exp2(torch.randint(-12, 4, (M, 1), generator=g).float())
    jitter = 1 + (torch.rand(M, 1, generator=g) * 2 - 1) * 2.0 ** -7
    kind = torch.randint(0, 3, (M, 1), generator=g)
    scale = torch.where(kind == 0, torch.exp2(torch.rand(M, 1, generator=g) * 16 - 12),
                        torch.where(kind == 1, pow2, pow2 / 3) * jitter)
    if bits == 1:
        levels = torch.tensor([-1.0, 1])[torch.randint(0, 2, (M, K), generator=g)]
    elif bits == "ternary":
        levels = torch.tensor([-1.0, 0, 1])[torch.randint(0, 3, (M, K), generator=g)]
    else:
        levels = torch.tensor([-3.0, -1, 1, 3])[torch.randint(0, 4, (M, K), generator=g)]
    w = (levels * scale).to(dtype)
    if bits == 2:  # rows that meet the lopsided interval: 3x the inner magnitude rounds up to a power of two
        outer = w.float().abs().amax(1)
        assert ((outer == torch.exp2(torch.log2(outer).round())) & (outer > 3 * w.float().abs().amin(1))).sum() > 100
    assert_grid_bit_exact(w, bits)


def test_grid_2bit_refuses_outer_magnitude_one_step_off():
    """Inner magnitude 1.0 (bf16(a) = 1 for a in [1 - 2^-9, 1 + 2^-8]): 3a
    rounds to 3.0 or 3.015625, never to the bf16 neighbours beyond them."""
    for hi in (3.0, 3.015625):
        assert_grid_bit_exact(torch.tensor([[1.0, -hi, hi, -1.0]], dtype=torch.bfloat16), 2)
    for hi in (2.984375, 3.03125):
        with pytest.raises(ValueError, match=f"w: row 0 is not on a 2-bit grid: magnitudes 1.0 and {hi} "):
            pack_grid_weight(torch.tensor([[1.0, -hi, hi, -1.0]], dtype=torch.bfloat16), 2, "w")


def grid_model():
    model = torch.nn.Module()
    model.model = torch.nn.Module()
    model.model.layers = torch.nn.ModuleList()
    for _ in range(2):
        block = torch.nn.Module()
        block.q_proj, block.up_proj = torch.nn.Linear(32, 8), torch.nn.Linear(32, 8)
        model.model.layers.append(block)
    model.model.lm_head = torch.nn.Linear(32, 8)  # nested: the default exclude still keeps it
    model.lm_head = torch.nn.Linear(32, 8)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.Linear):
                m.weight.copy_(torch.sign(torch.randn(8, 32)) * 0.125)
    return model


def converted(model):
    return sorted(n for n, m in model.named_modules() if type(m) is Linear1Bit)


def test_convert_grid_linears_include_exclude_are_fnmatch_patterns():
    torch.manual_seed(4)
    blocks = ["model.layers.0.q_proj", "model.layers.0.up_proj", "model.layers.1.q_proj", "model.layers.1.up_proj"]
    assert converted(convert_grid_linears(grid_model(), 1)) == blocks
    assert converted(convert_grid_linears(grid_model(), 1, exclude=["*"])) == []
    assert converted(convert_grid_linears(grid_model(), 1, include=["*.q_proj"])) == blocks[::2]
    assert converted(convert_grid_linears(grid_model(), 1, include="model.layers.1.*", exclude=["*up_proj"])) == \
        ["model.layers.1.q_proj"]
    assert converted(convert_grid_linears(grid_model(), 1, exclude=[])) == sorted(blocks + ["lm_head", "model.lm_head"])


def test_meta_construction_touches_only_its_own_thread():
    """load_bitnet_checkpoint builds the model with parameters on meta by
    patching nn.Module.register_parameter, which is process-wide: a module
    built meanwhile in another thread keeps real weights, and a frozen
    parameter stays frozen."""
    import threading

    from ulbtorch.importers.hf_bitnet import _params_on_meta
    built, inside = {}, threading.Event()
    worker = threading.Thread(target=lambda: (inside.wait(), built.setdefault("w", torch.nn.Linear(4, 4).weight)))
    worker.start()
    with _params_on_meta():
        inside.set()
        worker.join()
        ours = torch.nn.Linear(4, 4)
        frozen = torch.nn.Module()
        frozen.register_parameter("p", torch.nn.Parameter(torch.zeros(2), requires_grad=False))
    assert built["w"].device.type == "cpu"
    assert ours.weight.is_meta and frozen.p.is_meta and not frozen.p.requires_grad


def test_convert_grid_linears_converts_a_shared_layer_at_every_name():
    torch.manual_seed(5)
    model = grid_model()
    model.model.layers[1].up_proj = model.model.layers[0].up_proj
    convert_grid_linears(model, 1)
    assert type(model.model.layers[1].up_proj) is Linear1Bit
    assert model.model.layers[1].up_proj is model.model.layers[0].up_proj


def _grid_llama(bits):
    torch.manual_seed(6)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**CFG), dtype=torch.bfloat16).eval()
    with torch.no_grad():
        for name, m in model.named_modules():
            if type(m) is torch.nn.Linear and name != "lm_head":
                # Drawn here, not from the layer: on transformers 5.17 with torch 2.11 a weight held exact
                # zeros, and a grid weight has none.
                w = torch.randn(m.weight.shape)
                s = w.abs().mean(1, keepdim=True)
                m.weight.copy_(torch.where(w >= 0, s, -s).to(torch.bfloat16))
    return convert_grid_linears(model, bits)


def test_imported_models_save_through_transformers(tmp_path):
    """load_bitnet_checkpoint and convert_grid_linears record ulbtorch's
    config as quantize_ does: save_pretrained then writes a checkpoint that
    from_pretrained loads packed, bit for bit (it loaded random nn.Linear
    weights before)."""
    (tmp_path / "bitnet").mkdir()
    make_checkpoint(tmp_path / "bitnet", "bitlinear")
    ids = torch.randint(0, 300, (1, 6))
    for name, model in [("bitnet", load_bitnet_checkpoint(str(tmp_path / "bitnet"))), ("grid", _grid_llama(1))]:
        with torch.no_grad():
            logits = model(ids).logits
        model.save_pretrained(tmp_path / f"{name}_saved")
        again = AutoModelForCausalLM.from_pretrained(tmp_path / f"{name}_saved", dtype=torch.bfloat16).eval()
        assert [type(m) for m in again.modules()] == [type(m) for m in model.modules()], name
        with torch.no_grad():
            assert torch.equal(again(ids).logits, logits), name


# ---- grid importer: bad input ---------------------------------------------------------------------

M, K = 8, 64  # the layer the bad-input tests build: 8 outputs, 64 inputs


def test_grid_exclude_is_a_pattern_list_or_one_name():
    from ulbtorch.importers.grid import convert_grid_linears
    model = torch.nn.Sequential()
    model.add_module("body", torch.nn.Linear(K, M))
    model.add_module("lm_head", torch.nn.Linear(M, M))  # not on a grid: must be left alone
    with torch.no_grad():
        model.body.weight.copy_(torch.sign(torch.randn(M, K)) * 0.1)
    convert_grid_linears(model, 1, exclude="lm_head")  # one string is one name, not its characters
    assert type(model.body) is Linear1Bit and type(model.lm_head) is torch.nn.Linear


def test_convert_grid_linears_with_a_layer_off_the_grid_leaves_the_model_as_it_was():
    from ulbtorch.importers import convert_grid_linears
    on_grid = torch.nn.Linear(32, 8)
    with torch.no_grad():
        on_grid.weight.copy_(torch.where(torch.rand(8, 32) > 0.5, 0.1, -0.1))
    model = torch.nn.Sequential(on_grid, torch.nn.Linear(32, 8))
    with pytest.raises(ValueError, match="not on a binary grid"):
        convert_grid_linears(model, 1)
    assert [type(m) for m in model] == [torch.nn.Linear, torch.nn.Linear]


@pytest.mark.parametrize("shape", [(K,), (M, 0), (2, M, K)])
def test_grid_import_names_a_weight_that_is_not_a_matrix(shape):
    from ulbtorch.importers.grid import pack_grid_weight
    with pytest.raises(ValueError, match="2-D"):
        pack_grid_weight(torch.ones(shape), 1)

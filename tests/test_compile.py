"""torch.compile support: opcheck for every op, and a patched HF model
compiled with fullgraph=True matches eager."""
import copy

import pytest
import torch
from torch import nn
from torch.library import opcheck

import ulbtorch
from ulbtorch.nn import Linear2Bit


@pytest.fixture(scope="module")
def blob_and_inputs():
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 4, (40, 70), dtype=torch.uint8, generator=g)
    scales = torch.rand(40, 1, generator=g)
    packed = ulbtorch.ops.pack(codes, scales, "int2")
    x = torch.randn(3, 70, generator=g)
    return codes, scales, packed, x


def op_cases(codes, scales, packed, x):
    xq, _, xsum = torch.ops.ulb.quantize_act(x, packed)
    return {
        "pack": (torch.ops.ulb.pack.default, (codes, scales, 1, 0)),
        "unpack": (torch.ops.ulb.unpack.default, (packed,)),
        "retile": (torch.ops.ulb.retile.default, (ulbtorch.ops.pack(codes % 2, scales, "binary", tiles="vnni"), 1)),
        "packed_info": (torch.ops.ulb.packed_info.default, (packed,)),
        "verify_packed": (torch.ops.ulb.verify_packed.default, (packed,)),
        "linear_fp32": (torch.ops.ulb.linear.default, (x, packed, None, 40)),
        "linear_bf16_x_bias": (torch.ops.ulb.linear.default, (x.bfloat16().unsqueeze(0), packed, torch.randn(40), 40)),
        "linear_bf16_gemv": (torch.ops.ulb.linear_bf16.default,
                             (x[:1].bfloat16(), torch.randn(40, 70).bfloat16(), torch.randn(40).bfloat16())),
        "quantize_act": (torch.ops.ulb.quantize_act.default, (x, packed)),
        "int_dots": (torch.ops.ulb.int_dots.default, (packed, xq, xsum)),
        "dequantize_packed": (torch.ops.ulb.dequantize_packed.default, (packed, 40, 70)),
    }


@pytest.mark.parametrize("name", ["pack", "unpack", "retile", "packed_info", "verify_packed", "linear_fp32",
                                  "linear_bf16_x_bias", "linear_bf16_gemv", "quantize_act", "int_dots",
                                  "dequantize_packed"])
def test_opcheck(blob_and_inputs, name):
    op, args = op_cases(*blob_and_inputs)[name]
    result = opcheck(op, args)
    assert all(v == "SUCCESS" for v in result.values()), result


def test_compiled_hf_model_matches_eager():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=300)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    ulbtorch.quantize_(model, bits=2, group_size=32)
    ids = torch.randint(0, 300, (2, 9))
    with torch.no_grad():
        eager = model(ids, use_cache=False).logits
        compiled = torch.compile(model, fullgraph=True)(ids, use_cache=False).logits
    torch.testing.assert_close(compiled, eager, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("K", [128, 100])
@pytest.mark.parametrize("force_reference", [False, True])
def test_compiled_layer_fullgraph_with_grad(force_reference, K):
    """fullgraph compiles a layer whose input requires grad (the backward
    dequantises the blob: its sizes come from the header) and the reference
    path (its dequantised-weight cache keys on data pointers); values and
    gradients match eager, also where the last group is partial (K = 100,
    groups of 32: inductor once read past the scales there)."""
    torch.manual_seed(0)
    layer = ulbtorch.nn.Linear2Bit.from_linear(torch.nn.Linear(K, 96), group_size=32)
    layer.force_reference = force_reference
    x = torch.randn(3, K)
    x_eager, x_comp = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_eager = layer(x_eager)
    y_comp = torch.compile(layer, fullgraph=True)(x_comp)
    torch.testing.assert_close(y_comp, y_eager, rtol=1e-5, atol=1e-5)
    g = torch.randn_like(y_eager)
    y_eager.backward(g)
    y_comp.backward(g)
    torch.testing.assert_close(x_comp.grad, x_eager.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x_eager.grad, g @ layer.dequantize(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fmt", ["int2_sym", "ternary", "binary", "int4", "int8"])
@pytest.mark.parametrize("K,group_size", [(100, 32), (70, 64), (33, 0)])
def test_compiled_dequantize_matches_eager(fmt, K, group_size):
    """ops.dequantize compiled equals eager bit for bit, partial last group
    included (inductor miscompiled a repeat_interleave of the scales cut to
    K: the last group's columns read memory past the scales)."""
    g = torch.Generator().manual_seed(1)
    levels = ulbtorch.formats.get_format(fmt).levels
    codes = torch.randint(0, len(levels), (37, K), dtype=torch.uint8, generator=g)
    G = 1 if group_size == 0 else -(-K // group_size)
    scales = torch.rand(37, G, generator=g) + 0.5
    eager = ulbtorch.ops.dequantize(codes, scales, fmt, group_size)
    torch._dynamo.reset()
    compiled = torch.compile(ulbtorch.ops.dequantize, fullgraph=True)(codes, scales, fmt, group_size)
    assert torch.equal(compiled, eager)


@pytest.mark.parametrize("cls,gs", [("Linear8Bit", 0), ("Linear1Bit", 0), ("Linear2Bit", 32)])
def test_exported_reference_path_saves_and_loads(tmp_path, cls, gs):
    """An ExportedProgram of a layer on the reference path (force_reference,
    or any device but the CPU) loads back and runs: with per-channel scales
    it failed in torch.export.load ("expected no unbacked symbols"), from
    unpack's data-dependent group count pinned to 1."""
    layer = getattr(ulbtorch.nn, cls).from_linear(torch.nn.Linear(128, 96), group_size=gs)
    layer.force_reference = True
    x = torch.randn(3, 128)
    path = tmp_path / "layer.pt2"
    torch.export.save(torch.export.export(layer, (x,)), path)
    loaded = torch.export.load(path).module()
    with torch.no_grad():
        assert torch.equal(loaded(x), layer(x))
    with pytest.raises(ValueError, match="the packed weight is 96x128, not 96x64"):
        torch.ops.ulb.dequantize_packed(layer.packed, 96, 64)


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


def test_compile_decode_tokens_match_the_static_cache_in_eager():
    """compile_decode: generate runs one compiled graph for every decode step
    (no recompile for a shorter call after a longer one), and its greedy
    tokens equal the same static-cache decode in eager mode (float32, so
    inductor's fusions cannot flip a bf16 tie)."""
    from _tiny_llama import prompt, tiny_llama
    from torch._dynamo.utils import counters

    model = tiny_llama()
    model.generation_config.eos_token_id = None
    ulbtorch.quantize_(model, format="ternary", lm_head_bits=8)
    ids = prompt(8)[:1]
    with torch.inference_mode():
        expected = model.generate(ids, max_new_tokens=12, do_sample=False, cache_implementation="static",
                                  disable_compile=True)
        assert ulbtorch.compile_decode(model) is model
        torch._dynamo.reset()
        counters.clear()
        got = model.generate(ids, max_new_tokens=12, do_sample=False)
        shorter = model.generate(ids, max_new_tokens=5, do_sample=False)
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    assert torch.equal(got, expected), (got, expected)
    assert torch.equal(shorter, expected[:, :13])


def test_compile_decode_frozen_keeps_the_input_checks():
    """frozen=True drops the per-step checks on the model's modules, not those
    on the step's inputs: a call longer than the first (a larger static
    cache) compiles a second graph instead of running the first on it, and
    both give the eager static-cache tokens; a changed module attribute
    compiles nothing new."""
    from _tiny_llama import prompt, tiny_llama
    from torch._dynamo.utils import counters

    model = tiny_llama()
    model.generation_config.eos_token_id = None
    ulbtorch.quantize_(model, format="ternary", lm_head_bits=8)
    ids = prompt(8)[:1]
    ref = copy.deepcopy(model)  # its static cache keeps the longest length it saw: not this model's
    with torch.inference_mode():
        expected = ref.generate(ids, max_new_tokens=12, do_sample=False, cache_implementation="static",
                                disable_compile=True)
        short_expected = expected[:, :13]
        ulbtorch.compile_decode(model, frozen=True)
        assert model.generation_config.compile_config.options["guard_filter_fn"] is not None
        torch._dynamo.reset()
        counters.clear()
        short = model.generate(ids, max_new_tokens=5, do_sample=False)
        longer = model.generate(ids, max_new_tokens=12, do_sample=False)
        assert counters["stats"]["unique_graphs"] == 2, dict(counters["stats"])
        # What frozen gives up, as documented: a changed module goes unnoticed.
        model.model.norm.variance_epsilon *= 10
        model.generate(ids, max_new_tokens=12, do_sample=False)
    assert counters["stats"]["unique_graphs"] == 2, dict(counters["stats"])
    assert torch.equal(short, short_expected), (short, short_expected)
    assert torch.equal(longer, expected), (longer, expected)


def test_compile_decode_frozen_models_keep_their_own_steps():
    """Two frozen models of one class but not one structure (an int8 and a
    bf16 lm_head): without the checks on modules each would take the step
    compiled for the other (torch.compile keeps steps per code object), and
    fail or compute the other's model; each has its own and its own tokens."""
    from _tiny_llama import prompt, tiny_llama
    from torch._dynamo.utils import counters

    a = tiny_llama()
    a.generation_config.eos_token_id = None
    b = copy.deepcopy(a)
    ulbtorch.quantize_(a, format="ternary", lm_head_bits=8)
    ulbtorch.quantize_(b, format="ternary")
    ids = prompt(8)[:1]
    with torch.inference_mode():
        expected = [copy.deepcopy(m).generate(ids, max_new_tokens=6, do_sample=False,
                                              cache_implementation="static", disable_compile=True) for m in (a, b)]
        torch._dynamo.reset()
        counters.clear()
        got = []
        for m in (a, b):
            ulbtorch.compile_decode(m, frozen=True)
            got.append(m.generate(ids, max_new_tokens=6, do_sample=False))
    assert counters["stats"]["unique_graphs"] == 2, dict(counters["stats"])
    for g, e in zip(got, expected):
        assert torch.equal(g, e), (g, e)


def test_compile_decode_frozen_takes_options_not_a_mode():
    from _tiny_llama import tiny_llama

    with pytest.raises(ValueError, match="frozen=True passes options to torch.compile"):
        ulbtorch.compile_decode(tiny_llama(), frozen=True, mode="max-autotune-no-cudagraphs")


def test_compile_decode_refuses_what_has_no_generate():
    with pytest.raises(TypeError, match="compile_decode takes a transformers model with generate"):
        ulbtorch.compile_decode(nn.Linear(4, 4))

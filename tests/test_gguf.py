"""ulbtorch.load_gguf and save_gguf: GGUF blocks kept packed, bit for bit
against gguf-py's dequantisation (ggml's rule for Q1_0 and I2_S) and
transformers' own float loading of the same file; damaged files named."""
import struct
from contextlib import nullcontext

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

import _gguf_writer as gw  # noqa: E402
from transformers.convert_slow_tokenizer import bytes_to_unicode  # noqa: E402

import ulbtorch  # noqa: E402
from ulbtorch import ops  # noqa: E402
from ulbtorch.importers.gguf_blocks import DECODED_AS, block_shape, decode  # noqa: E402
from ulbtorch.nn import LowBitLinear  # noqa: E402

T = gw.T
GGUF_PY_TYPES = [T.Q4_0, T.Q5_0, T.Q8_0, T.Q3_K, T.Q6_K, T.IQ4_NL, T.IQ4_XS, T.TQ1_0, T.TQ2_0]
SCALE_AT = {T.TQ1_0: 52, T.TQ2_0: 64, T.Q3_K: 108, T.Q6_K: 208}  # where each block's fp16 d sits (else 0)
# GGUF tokens: the 256 byte-level characters, two specials and two merges, so that transformers builds a tokenizer
TOKENS = list(bytes_to_unicode().values()) + ["<s>", "</s>", "he", "ll"]
TOKENS += [f"t{i}" for i in range(320 - len(TOKENS))]
MERGES = ["h e", "l l"]


def random_blocks(ttype, rows, K, seed=0):
    """Random bytes for every field, finite fp16 scales; no Q8_0 -128 and no TQ2_0 code 3."""
    rng = np.random.default_rng(seed)
    values, size = block_shape(int(ttype))
    raw = rng.integers(0, 256, (rows, K // values * size), dtype=np.uint8)
    blocks = raw.reshape(rows, -1, size)
    at = SCALE_AT.get(ttype, 0)
    blocks[:, :, at:at + 2] = rng.standard_normal(blocks.shape[:2]).astype(np.float16).view(np.uint8).reshape(
        rows, -1, 2)
    if ttype == T.Q8_0:
        q = blocks[:, :, 2:].view(np.int8)
        q[q == -128] = 127
    if ttype == T.TQ2_0:
        fields = rng.integers(0, 3, (rows, blocks.shape[1], 64, 4)).astype(np.uint8)
        blocks[:, :, :64] = (fields << np.array([0, 2, 4, 6], dtype=np.uint8)).sum(-1).astype(np.uint8)
    return raw


def bits(a):
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


@pytest.mark.parametrize("ttype", GGUF_PY_TYPES, ids=lambda t: t.name)
def test_blocks_dequantize_as_gguf_py_does(ttype):
    rows, K = 6, 512
    raw = random_blocks(ttype, rows, K)
    d = decode(int(ttype), raw, rows, K)
    assert d.format == DECODED_AS[int(ttype)][0]
    layer = ulbtorch.nn.MODULE_FOR_FORMAT[d.format].from_codes(d.codes, d.scales, format=d.format,
                                                               group_size=d.group_size, granularity=d.granularity)
    assert np.array_equal(bits(layer.dequantize()), bits(gguf.quants.dequantize(raw, ttype)))


def test_q2_0_blocks_follow_ggml():
    """gguf-py 0.19 has no Q2_0 (ggml type 42): int2 with the scale negated
    holds its values, the same numbers (ggml's zeros are +0.0, ours -0.0
    where d > 0), and encode writes the same bytes back."""
    from ulbtorch.importers.gguf_blocks import Q2_0, encode

    rows, K = 5, 192
    raw = random_blocks(Q2_0, rows, K)
    d = decode(Q2_0, raw, rows, K)
    assert (d.format, d.group_size) == ("int2", 64)
    ours, ggml = ops.dequantize(d.codes, d.scales, "int2", 64), torch.from_numpy(gw.q2_0_dequantize(raw))
    assert torch.equal(ours, ggml)
    nonzero = ggml != 0
    assert np.array_equal(bits(ours[nonzero]), bits(ggml[nonzero])) and (~nonzero).any()
    assert np.array_equal(encode(d.codes, d.scales.half(), "int2"), raw)


def test_q1_0_and_i2_s_blocks_follow_ggml():
    rows, K = 4, 384
    raw = random_blocks(T.Q1_0, rows, K)
    d = decode(int(T.Q1_0), raw, rows, K)
    assert (d.format, d.group_size) == ("binary", 128)
    assert np.array_equal(bits(ops.dequantize(d.codes, d.scales, "binary", 128)), bits(gw.q1_0_dequantize(raw)))
    rng = np.random.default_rng(1)
    data = np.concatenate([rng.integers(0, 256, rows * K // 4, dtype=np.uint8), np.zeros(32, np.uint8)])
    data[rows * K // 4:rows * K // 4 + 4] = np.array([0.37], np.float32).view(np.uint8)  # codes 3 included
    d = decode(gw.I2_S, data, rows, K)
    assert (d.format, d.granularity) == ("ternary", "tensor")
    assert np.array_equal(bits(ops.dequantize(d.codes, d.scales, "ternary")),
                          bits(gw.i2_s_dequantize(data, rows * K).reshape(rows, K)))


def test_blocks_ternary_cannot_hold_are_refused():
    raw = random_blocks(T.TQ2_0, 2, 256)
    raw[1, 5] = 0b11000000  # code 3 at value 3 * 32 + 5 of row 1
    with pytest.raises(ValueError, match="row 1, column 101 holds code 3"):
        decode(int(T.TQ2_0), raw, 2, 256)
    raw = random_blocks(T.Q8_0, 2, 64)
    raw[0, 34 + 2 + 7] = 0x80  # -128 in the second block of row 0
    with pytest.raises(ValueError, match="row 0, column 39 holds -128"):
        decode(int(T.Q8_0), raw, 2, 64)
    raw = random_blocks(T.Q4_0, 2, 64)
    raw[1, 18:20] = np.array([np.inf], np.float16).view(np.uint8)
    with pytest.raises(ValueError, match="row 1: the scale of values 32.. is inf"):
        decode(int(T.Q4_0), raw, 2, 64)


# ---- whole files ----------------------------------------------------------------------------------

# (the K-quants and IQ4 types, which gguf-py cannot quantise, are checked block by block above)
LLAMA_TYPES = {"attn_q": T.TQ2_0, "attn_k": T.Q4_0, "attn_v": T.Q5_0, "attn_output": T.TQ1_0,
               "ffn_gate": T.Q8_0, "ffn_up": T.Q4_0, "ffn_down": T.Q8_0, "output": T.Q8_0}
ONE_BIT_TYPES = {"attn_q": T.Q1_0, "attn_k": T.Q1_0, "attn_v": gw.I2_S, "attn_output": T.Q1_0,
                 "ffn_gate": gw.I2_S, "ffn_up": T.Q1_0, "ffn_down": gw.I2_S, "output": T.TQ2_0}


def by_name(table, default=T.F16):
    def types(name, values):
        for key, t in table.items():
            if f"{key}.weight" in name and not (key == "output" and "attn_output" in name):
                return int(t)
        return int(default)
    return types


def fake_quantized(model):
    """transformers' float model, each linear layer computing as ulbtorch's
    reference path does (activations rounded to int8 per token)."""
    for m in model.modules():
        if type(m) is nn.Linear:
            m.forward = (lambda mod: lambda x: F.linear(ops.fake_quantize_activations(x), mod.weight, mod.bias))(m)
    return model


def expected_weights(model, expected, arch):
    """{model weight name: the file's dequantised values in the model's row
    order}, through transformers' own name map and processor."""
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor, get_gguf_hf_weights_map

    processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=model.config.to_dict())
    names = get_gguf_hf_weights_map(model, processor)
    return {names[g]: torch.from_numpy(np.ascontiguousarray(processor.process(v, g).weights))
            for g, v in expected.items()}


def check_layers(loaded, want):
    layers = {n: m for n, m in loaded.named_modules() if isinstance(m, LowBitLinear)}
    assert layers
    for name, layer in layers.items():
        assert np.array_equal(bits(layer.dequantize()), bits(want[f"{name}.weight"])), name
    return layers


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_load_is_bit_for_bit_and_logits_match_transformers(tmp_path, kind):
    extra = dict(attention_bias=True) if kind == "llama" else {}
    source = gw.tiny(kind, **extra) if kind != "qwen3" else gw.tiny(kind, head_dim=128)
    expected = gw.write_gguf(tmp_path / "m.gguf", source, by_name(LLAMA_TYPES), arch=kind, tokens=TOKENS,
                             merges=MERGES)
    model = ulbtorch.load_gguf(tmp_path / "m.gguf", dtype=torch.float32)
    layers = check_layers(model, expected_weights(source, expected, kind))
    assert len(layers) == 15 and isinstance(model.lm_head, ulbtorch.nn.Linear8Bit)
    assert {type(m).__name__ for m in layers.values()} == {"LinearTernary", "Linear4Bit", "Linear8Bit"}
    reference = fake_quantized(transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file="m.gguf", dtype=torch.float32)).eval()
    ref_state = reference.state_dict()
    for name, t in model.state_dict().items():
        if not name.endswith(".packed"):
            assert torch.equal(t, ref_state[name]), name  # norms, embeddings, biases: as transformers loads them
    ids = torch.randint(0, 320, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for layer in layers.values():
            layer.force_reference = True
        assert torch.equal(model(ids).logits, reference(ids).logits)
        for layer in layers.values():
            layer.force_reference = False
        kernels, ref = model(ids).logits, reference(ids).logits
    assert (kernels - ref).abs().max() <= 2e-2 * ref.abs().max()  # int8 activations: a step may move (_tiny_llama)


def test_mixture_of_experts_experts_stay_float(tmp_path):
    """Qwen3-MoE: the attention layers packed, the experts (3-D, not nn.Linear) and the router dequantised
    into float as transformers loads them; the logits are transformers' own."""
    source = gw.tiny("qwen3_moe")
    gw.write_gguf(tmp_path / "m.gguf", source, by_name(LLAMA_TYPES, default=T.Q8_0), arch="qwen3moe",
                  extra={"qwen3moe.expert_count": 4, "qwen3moe.expert_used_count": 2})
    model = ulbtorch.load_gguf(tmp_path / "m.gguf", dtype=torch.float32)
    reference = fake_quantized(transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file="m.gguf", dtype=torch.float32)).eval()
    theirs = dict(reference.named_modules())
    layers = {n: m for n, m in model.named_modules() if isinstance(m, LowBitLinear)}
    assert len(layers) == 9  # 4 attention projections a layer and lm_head
    for name, layer in layers.items():
        assert torch.equal(layer.dequantize(), theirs[name].weight), name
        layer.force_reference = True
    ref_state = reference.state_dict()
    for name, t in model.state_dict().items():
        if not name.endswith(".packed"):
            assert torch.equal(t, ref_state[name]), name
    with torch.no_grad():
        ids = torch.randint(0, 320, (1, 5), generator=torch.Generator().manual_seed(0))
        assert torch.equal(model(ids).logits, reference(ids).logits)


def test_q1_0_and_i2_s_model_loads_and_runs(tmp_path):
    source = gw.tiny("llama")
    expected = gw.write_gguf(tmp_path / "m.gguf", source, by_name(ONE_BIT_TYPES))
    with pytest.raises(ValueError, match=r"m\.gguf: the file holds no tokenizer"):
        ulbtorch.load_gguf(tmp_path / "m.gguf", with_tokenizer=True)
    model = ulbtorch.load_gguf(tmp_path / "m.gguf")
    layers = check_layers(model, expected_weights(source, expected, "llama"))
    kinds = {n.rsplit(".", 1)[-1]: (m.format, m.granularity) for n, m in layers.items()}
    assert kinds["q_proj"] == ("binary", "group") and kinds["v_proj"] == ("ternary", "tensor")
    assert next(model.parameters()).dtype == torch.bfloat16
    out = model.generate(torch.tensor([[3, 4, 5]]), max_new_tokens=3, do_sample=False)
    assert out.shape == (1, 6)


def test_tied_embedding_and_tokenizer(tmp_path):
    source = gw.tiny("llama", tie_word_embeddings=True)
    gw.write_gguf(tmp_path / "m.gguf", source, by_name(LLAMA_TYPES, default=T.Q8_0), tokens=TOKENS, merges=MERGES)
    model, tokenizer = ulbtorch.load_gguf(tmp_path / "m.gguf", dtype=torch.float32, with_tokenizer=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    # the Q8_0 embedding, dequantised as transformers dequantises it
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="m.gguf", dtype=torch.float32)
    assert torch.equal(model.model.embed_tokens.weight, reference.model.embed_tokens.weight)
    assert tokenizer("hello")["input_ids"] == [TOKENS.index(t) for t in ("he", "ll", "o")]


def test_other_types_are_refused_or_dequantised(tmp_path):
    source = gw.tiny("llama")
    types = by_name(dict(LLAMA_TYPES, ffn_down=T.Q4_1))  # a block minimum: no format of ours
    expected = gw.write_gguf(tmp_path / "m.gguf", source, types)
    with pytest.raises(ValueError, match=r"m\.gguf: tensor 'blk\.0\.ffn_down\.weight' \(Q4_1, shape \[256, 512\]\): "
                                         "no ulbtorch format holds this type exactly"):
        ulbtorch.load_gguf(tmp_path / "m.gguf")
    with pytest.warns(UserWarning, match=r"2 linear weights .* dequantised into float layers .*ffn_down\.weight "
                                         r"\(Q4_1"):
        model = ulbtorch.load_gguf(tmp_path / "m.gguf", dtype=torch.float32, other_types="float")
    down = model.model.layers[1].mlp.down_proj
    assert type(down) is nn.Linear
    assert torch.equal(down.weight, torch.from_numpy(expected["blk.1.ffn_down.weight"]))
    with pytest.raises(ValueError, match="other_types must be one of"):
        ulbtorch.load_gguf(tmp_path / "m.gguf", other_types="requantize")


# ---- damaged files ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def good_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "good.gguf"
    gw.write_gguf(path, gw.tiny("llama"), by_name(LLAMA_TYPES))
    return path


def patched(tmp_path, good_file, edit):
    data = bytearray(good_file.read_bytes())
    edit(data)
    path = tmp_path / "bad.gguf"
    path.write_bytes(bytes(data))
    return path


def tensor_entry(data: bytearray, name: str) -> int:
    """Where the tensor table entry of `name` starts (its name's length field)."""
    encoded = name.encode()
    return data.index(struct.pack("<Q", len(encoded)) + encoded)


def test_truncated_file_names_the_tensor(tmp_path, good_file):
    path = patched(tmp_path, good_file, lambda d: d.__delitem__(slice(len(d) - 100, None)))
    with pytest.raises(ValueError, match=r"bad\.gguf: tensor 'output\.weight' \(Q8_0, shape \[320, 256\]\) needs "
                                         r"bytes .* the file is truncated"):
        ulbtorch.load_gguf(path)
    path = patched(tmp_path, good_file, lambda d: d.__delitem__(slice(200, None)))
    with pytest.raises(ValueError, match=r"bad\.gguf: the file ends inside .*truncated or damaged"):
        ulbtorch.load_gguf(path)


def test_wrong_type_for_a_shape(tmp_path, good_file):
    def entry_field(data, name, at, value):  # at: bytes past the name (n_dims, then its dims, then the type)
        where = tensor_entry(data, name) + 8 + len(name) + at
        data[where:where + len(value)] = value
    grown = lambda d: entry_field(d, "blk.0.attn_k.weight", 4 + 16, struct.pack("<I", int(T.Q6_K)))  # noqa: E731
    with pytest.raises(ValueError, match=r"tensor 'blk\.0\.attn_k\.weight' as Q6_K of shape \[128, 256\] takes "
                                         r"26880 bytes, but tensor .* starts 18432 bytes after it: its type does not "
                                         "fit its shape"):
        ulbtorch.load_gguf(patched(tmp_path, good_file, grown))
    narrow = lambda d: entry_field(d, "blk.0.attn_k.weight", 4, struct.pack("<Q", 272))  # noqa: E731
    with pytest.raises(ValueError, match=r"tensor 'blk\.0\.attn_k\.weight' is Q4_0 with rows of 272 values, not a "
                                         "multiple of its block of 32"):
        ulbtorch.load_gguf(patched(tmp_path, good_file, narrow))
    shrunk = lambda d: entry_field(d, "blk.0.attn_q.weight", 4 + 16, struct.pack("<I", int(T.IQ2_XXS)))  # noqa: E731
    with pytest.raises(ValueError, match=r"'blk\.0\.attn_q\.weight' \(IQ2_XXS, shape \[256, 256\]\): no ulbtorch "
                                         "format holds this type exactly"):
        ulbtorch.load_gguf(patched(tmp_path, good_file, shrunk))
    unknown = lambda d: entry_field(d, "blk.0.attn_q.weight", 4 + 16, struct.pack("<I", 99))  # noqa: E731
    with pytest.raises(ValueError, match=r"'blk\.0\.attn_q\.weight' \(ggml type 99, shape \[256, 256\]\): a type "
                                         "neither ulbtorch nor gguf-py reads"):
        ulbtorch.load_gguf(patched(tmp_path, good_file, unknown))


def test_missing_tensor_and_metadata_that_lies(tmp_path, good_file):
    def rename(data):  # the file loses blk.1.ffn_down.weight under another name
        at = tensor_entry(data, "blk.1.ffn_down.weight")
        data[at + 8:at + 8 + 3] = b"xyz"
    with pytest.raises(ValueError, match=r"bad\.gguf: the file has no tensor for 1 of the model's tensors, e\.g\. "
                                         r"\['model\.layers\.1\.mlp\.down_proj\.weight'\]"):
        ulbtorch.load_gguf(patched(tmp_path, good_file, rename))

    def layers(data, n):
        key = b"llama.block_count"
        at = data.index(key) + len(key) + 4
        data[at:at + 4] = struct.pack("<I", n)
    with pytest.raises(ValueError, match=r"has no tensor for 9 of the model's tensors, e\.g\. \['model\.layers\.2\..*"
                                         r"llama\.block_count"):
        ulbtorch.load_gguf(patched(tmp_path, good_file, lambda d: layers(d, 3)))

    def width(data):
        key = b"llama.feed_forward_length"
        at = data.index(key) + len(key) + 4
        data[at:at + 4] = struct.pack("<I", 768)
    with pytest.raises(ValueError, match=r"tensor 'blk\.0\.ffn_gate\.weight' \(Q8_0, shape \[512, 256\]\): gives "
                                         r"model\.layers\.0\.mlp\.gate_proj\.weight the shape \[512, 256\], but the "
                                         r"model built from the file's metadata has \[768, 256\]"):
        ulbtorch.load_gguf(patched(tmp_path, good_file, width))


def test_not_a_gguf_file(tmp_path, good_file):
    with pytest.raises(ValueError, match="not a GGUF file"):
        ulbtorch.load_gguf(patched(tmp_path, good_file, lambda d: d.__setitem__(slice(0, 4), b"GGML")))
    with pytest.raises(ValueError, match="GGUF version 7"):
        ulbtorch.load_gguf(patched(tmp_path, good_file, lambda d: d.__setitem__(slice(4, 8), struct.pack("<I", 7))))
    def rename_arch(data):
        at = data.index(b"general.architecture") + len("general.architecture") + 4 + 8
        data[at:at + 5] = b"xlama"
    with pytest.raises(ValueError, match=r"bad\.gguf: transformers' GGUF loading does not map this file's architecture "
                                         "'xlama' to a model"):
        ulbtorch.load_gguf(patched(tmp_path, good_file, rename_arch))
    with pytest.raises(FileNotFoundError, match="no such GGUF file"):
        ulbtorch.load_gguf(tmp_path / "absent.gguf")


# ---- save_gguf --------------------------------------------------------------------------------------------

def test_save_gguf_round_trip_is_exact_and_gguf_py_reads_it(tmp_path):
    source = gw.tiny("llama")
    gw.write_gguf(tmp_path / "in.gguf", source, by_name(dict(LLAMA_TYPES, ffn_up=T.Q1_0, ffn_down=T.Q4_0)))
    model = ulbtorch.load_gguf(tmp_path / "in.gguf", dtype=torch.float32)
    ulbtorch.save_gguf(model, tmp_path / "out.gguf")
    reader = gguf.GGUFReader(tmp_path / "out.gguf")
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    assert types["blk.0.attn_q.weight"] == "TQ2_0" and types["blk.0.ffn_up.weight"] == "Q1_0"
    assert types["blk.0.attn_v.weight"] == "Q8_0" and types["blk.0.attn_norm.weight"] == "F32"
    assert reader.fields["llama.block_count"].contents() == 2
    # gguf-py's own dequantisation of what we wrote, in the model's row order, is each layer's weight
    written = {t.name: gguf.quants.dequantize(t.data, t.tensor_type).reshape(tuple(reversed(t.shape.tolist())))
               for t in reader.tensors if t.tensor_type != T.Q1_0}
    want = expected_weights(source, written, "llama")
    for name, m in model.named_modules():
        if isinstance(m, LowBitLinear) and m.format != "binary":
            assert torch.equal(m.dequantize(), want[f"{name}.weight"]), name
    again = ulbtorch.load_gguf(tmp_path / "out.gguf", dtype=torch.float32)
    mine, theirs = model.state_dict(), again.state_dict()
    assert mine.keys() == theirs.keys()
    for name, t in mine.items():  # the packed blobs too: the same codes and scales, packed the same way
        assert torch.equal(t, theirs[name]), name


def test_save_gguf_writes_the_tokenizer_and_a_tied_embedding(tmp_path):
    source = gw.tiny("llama", tie_word_embeddings=True)
    gw.write_gguf(tmp_path / "in.gguf", source, by_name(LLAMA_TYPES), tokens=TOKENS, merges=MERGES)
    model, tokenizer = ulbtorch.load_gguf(tmp_path / "in.gguf", with_tokenizer=True)  # bf16: embedding, norms
    ulbtorch.save_gguf(model, tmp_path / "out.gguf", tokenizer=tokenizer, tokenizer_pre="llama-bpe")
    reader = gguf.GGUFReader(tmp_path / "out.gguf")
    names = {t.name: t.tensor_type.name for t in reader.tensors}
    assert "output.weight" not in names and names["token_embd.weight"] == "BF16"
    assert reader.fields["tokenizer.ggml.pre"].contents() == "llama-bpe"
    assert reader.fields["tokenizer.ggml.merges"].contents() == MERGES
    again, tokenizer_again = ulbtorch.load_gguf(tmp_path / "out.gguf", with_tokenizer=True)
    text = "hello, hell"
    assert tokenizer_again(text)["input_ids"] == tokenizer(text)["input_ids"]
    assert again.lm_head.weight is again.model.embed_tokens.weight
    assert torch.equal(again.model.embed_tokens.weight, model.model.embed_tokens.weight)


def test_save_gguf_of_quantize_rounds_scales_to_fp16(tmp_path):
    model = gw.tiny("llama")
    ulbtorch.quantize_(model, bits="ternary", group_size=256, bf16_gemv=False)
    with pytest.warns(UserWarning, match="block scales were rounded to fp16"):
        ulbtorch.save_gguf(model, tmp_path / "t.gguf")
    again = ulbtorch.load_gguf(tmp_path / "t.gguf", dtype=torch.float32)
    theirs = dict(again.named_modules())
    for name, m in model.named_modules():
        if isinstance(m, LowBitLinear):
            codes, scales = m.unpack()
            want = ops.dequantize(codes, scales.half().float(), m.format, m.group_size)
            assert torch.equal(theirs[name].dequantize(), want), name


def test_save_gguf_refuses_what_gguf_cannot_hold(tmp_path):
    model = gw.tiny("llama")
    ulbtorch.quantize_(model, bits=2, group_size=128)
    with pytest.raises(ValueError, match=r"layer 'model\.layers\.0\.self_attn\.q_proj' is int2_sym, which no GGUF "
                                         "type holds"):
        ulbtorch.save_gguf(model, tmp_path / "x.gguf")
    model = gw.tiny("llama")
    ulbtorch.quantize_(model, bits=1, group_size=64)
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.self_attn\.q_proj' \(binary, 256 inputs, group size 64\) "
                                         "does not fit 128-value GGUF blocks"):
        ulbtorch.save_gguf(model, tmp_path / "x.gguf")
    assert not (tmp_path / "x.gguf").exists()
    with pytest.raises(ValueError, match="save_gguf writes models of types"):
        ulbtorch.save_gguf(nn.Sequential(nn.Linear(4, 4)), tmp_path / "x.gguf")


def test_save_gguf_writes_as_many_tokens_as_embedding_rows(tmp_path):
    """llama.cpp refuses a file whose token list is not the embedding's
    rows: transformers' <|endoftext|>, past the rows, is left out, and a
    vocabulary shorter than the rows padded as llama.cpp's converter pads it."""
    for rows in (len(TOKENS), len(TOKENS) + 3):
        gw.write_gguf(tmp_path / "in.gguf", gw.tiny("llama", vocab_size=rows), by_name(LLAMA_TYPES), tokens=TOKENS,
                      merges=MERGES)
        model, tokenizer = ulbtorch.load_gguf(tmp_path / "in.gguf", with_tokenizer=True)
        assert len(tokenizer) == len(TOKENS) + 1  # transformers adds <|endoftext|>
        with pytest.warns(UserWarning, match=r"tokens \['<\|endoftext\|>'\] \(ids 320 on\) are beyond the model's "
                                             "320 embedding rows") if rows == len(TOKENS) else nullcontext():
            ulbtorch.save_gguf(model, tmp_path / "out.gguf", tokenizer=tokenizer)
        fields = gguf.GGUFReader(tmp_path / "out.gguf").fields
        written = fields["tokenizer.ggml.tokens"].contents()
        assert len(written) == len(fields["tokenizer.ggml.token_type"].contents()) == rows
        assert written[:len(TOKENS)] == TOKENS
        if rows > len(TOKENS):  # the tokenizer's added token is a row of the model here, then padding
            assert written[len(TOKENS):] == ["<|endoftext|>", "[PAD321]", "[PAD322]"]

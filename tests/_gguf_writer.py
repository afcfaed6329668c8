"""GGUF files for the tests, written with gguf-py as llama.cpp's converter
writes them (tensor names from gguf's TensorNameMap, llama's q/k rows
permuted, 1-D tensors in F32) and quantised with gguf.quants.quantize, or
by hand from ggml's rule for the types gguf-py cannot quantise (Q1_0, I2_S).
Independent of ulbtorch's own GGUF code, which the tests check against it."""
import gguf
import numpy as np
import torch

T = gguf.GGMLQuantizationType
I2_S = 36  # bitnet.cpp's number; gguf-py has no such type

# config attribute -> GGUF key (after "<arch>."), what llama.cpp's converter writes
KEYS = {"max_position_embeddings": "context_length", "hidden_size": "embedding_length",
        "num_hidden_layers": "block_count", "intermediate_size": "feed_forward_length",
        "num_attention_heads": "attention.head_count", "num_key_value_heads": "attention.head_count_kv",
        "rms_norm_eps": "attention.layer_norm_rms_epsilon", "vocab_size": "vocab_size"}


def llama_permute(w: np.ndarray, n_head: int, n_head_kv: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def q1_0_blocks(w: np.ndarray) -> np.ndarray:
    """ggml's quantize_row_q1_0: per 128 values d = mean |w|, bit 1 for w >= 0."""
    rows = w.reshape(-1, 128).astype(np.float32)
    d = np.abs(rows).mean(axis=1).astype(np.float16)
    bits = (rows >= 0).astype(np.uint8).reshape(-1, 16, 8)
    qs = (bits << np.arange(8, dtype=np.uint8)).sum(axis=2).astype(np.uint8)
    return np.concatenate([d.reshape(-1, 1).view(np.uint8), qs], axis=1).reshape(w.shape[0], -1)


def q1_0_dequantize(blocks: np.ndarray) -> np.ndarray:
    """ggml's dequantize_row_q1_0, element by element: bit j of qs[j/8] picks +d or -d."""
    b = blocks.reshape(-1, 18)
    d = b[:, :2].copy().view(np.float16).astype(np.float32).reshape(-1)
    out = np.empty((b.shape[0], 128), np.float32)
    for j in range(128):
        bit = (b[:, 2 + j // 8] >> (j % 8)) & 1
        out[:, j] = np.where(bit == 1, d, -d)
    return out.reshape(blocks.shape[0], -1)


def q2_0_dequantize(blocks: np.ndarray) -> np.ndarray:
    """ggml's dequantize_row_q2_0, element by element: q from bits 2(j%4) of qs[j/4], value (q - 1) d."""
    b = blocks.reshape(-1, 18)
    d = b[:, :2].copy().view(np.float16).astype(np.float32).reshape(-1)
    out = np.empty((b.shape[0], 64), np.float32)
    for j in range(64):
        q = (b[:, 2 + j // 4] >> (2 * (j % 4))) & 3
        out[:, j] = (q.astype(np.int32) - 1).astype(np.float32) * d
    return out.reshape(blocks.shape[0], -1)


def i2_s_bytes(t: np.ndarray, scale: float) -> np.ndarray:
    """bitnet.cpp's I2_S of ternary values t (x86 layout): 128-value blocks
    of 32 bytes, value 32*j + i in byte i at bits 6-2j, code t+1; then the
    fp32 scale, padded to 32 bytes."""
    codes = (t.reshape(-1, 4, 32) + 1).astype(np.uint8)
    packed = (codes << np.array([6, 4, 2, 0], dtype=np.uint8).reshape(1, 4, 1)).sum(axis=1).astype(np.uint8)
    tail = np.zeros(32, np.uint8)
    tail[:4] = np.array([scale], np.float32).view(np.uint8)
    return np.concatenate([packed.reshape(-1), tail])


def i2_s_dequantize(data: np.ndarray, n: int) -> np.ndarray:
    """bitnet.cpp's dequantize_row_i2_s over the whole tensor, element by element."""
    scale = data[n // 4:n // 4 + 4].view(np.float32)[0]
    level = np.array([-1.0, 0.0, 1.0, 0.0], np.float32)
    out = np.empty(n, np.float32)
    for blk in range(n // 128):
        for gp in range(32):
            byte = data[blk * 32 + gp]
            for j, shift in enumerate((6, 4, 2, 0)):
                out[blk * 128 + j * 32 + gp] = scale * level[(byte >> shift) & 3]
    return out


def ternarize(w: np.ndarray) -> np.ndarray:
    """Values on a ternary grid per tensor (what a BitNet checkpoint holds)."""
    s = np.abs(w).mean()
    return (np.clip(np.round(w / s), -1, 1) * s).astype(np.float32)


def write_gguf(path, model, types, arch="llama", tokens=None, merges=(), extra=None, permute=None):
    """Write `model` (a float transformers model) as a GGUF of `arch`.
    types(gguf_name, values) -> a GGML type number for each 2-D tensor (1-D
    ones are F32). Returns {gguf name: the float values gguf-py's (or
    ggml's) dequantisation gives back, in the file's row order}."""
    cfg = model.config
    w = gguf.GGUFWriter(str(path), arch)
    for attr, key in KEYS.items():
        value = getattr(cfg, attr)
        (w.add_float32 if isinstance(value, float) else w.add_uint32)(f"{arch}.{key}", value)
    w.add_float32(f"{arch}.rope.freq_base", float(cfg.rope_parameters["rope_theta"]))
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w.add_uint32(f"{arch}.rope.dimension_count", head_dim)
    w.add_uint32(f"{arch}.attention.key_length", head_dim)
    w.add_uint32(f"{arch}.attention.value_length", head_dim)
    w.add_string("general.name", "tiny test model")
    w.add_quantization_version(2)
    if tokens is not None:
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("default")
        w.add_token_list(tokens)
        w.add_token_types([1] * len(tokens))
        w.add_token_merges(list(merges))
        w.add_bos_token_id(0)
        w.add_eos_token_id(1)
    for key, value in (extra or {}).items():
        w.add_uint32(key, value)
    name_map = gguf.get_tensor_name_map(next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch),
                                        cfg.num_hidden_layers)
    permute = arch == "llama" if permute is None else permute
    expected = {}
    for hf_name, t in model.state_dict().items():
        module, _, suffix = hf_name.rpartition(".")
        if getattr(cfg, "tie_word_embeddings", False) and module == "lm_head":
            continue
        values = t.detach().float().numpy()
        if suffix in ("gate_up_proj", "down_proj") and module.endswith(".experts"):
            # transformers fuses the experts' gate and up projections; llama.cpp keeps ffn_{gate,up,down}_exps
            block = hf_name.split(".")[2]
            half = values.shape[1] // 2
            parts = {"gate": values[:, :half], "up": values[:, half:]} if suffix == "gate_up_proj" else {
                "down": values}
            for part, v in parts.items():
                name = f"blk.{block}.ffn_{part}_exps.weight"
                _add(w, name, np.ascontiguousarray(v), types(name, v), expected)
            continue
        name = f"{name_map.get_name(module)}.{suffix}"
        if permute and name.endswith(("attn_q.weight", "attn_k.weight")):
            kv = cfg.num_attention_heads if "attn_q" in name else cfg.num_key_value_heads
            values = llama_permute(values, cfg.num_attention_heads, kv)
        _add(w, name, values, int(T.F32) if values.ndim == 1 else types(name, values), expected)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expected


def _add(w, name, values, ttype, expected):
    """One tensor of `ttype`, and into expected what dequantising it gives back."""
    if ttype == int(T.F32):
        w.add_tensor(name, values.astype(np.float32))
        expected[name] = values.astype(np.float32)
    elif ttype == int(T.F16):
        w.add_tensor(name, values.astype(np.float16))
        expected[name] = values.astype(np.float16).astype(np.float32)
    elif ttype == int(T.Q1_0):
        blocks = q1_0_blocks(values)
        w.add_tensor(name, blocks, raw_dtype=T.Q1_0)
        expected[name] = q1_0_dequantize(blocks).reshape(values.shape)
    elif ttype == I2_S:
        tern = ternarize(values)
        scale = float(np.abs(tern).max())
        data = i2_s_bytes(np.sign(tern).astype(np.int8), scale)
        # int8 so that gguf-py's writer takes the shape as given and writes the type number as it is
        w.add_tensor(name, data.view(np.int8), raw_shape=values.shape, raw_dtype=I2_S)
        expected[name] = i2_s_dequantize(data, values.size).reshape(values.shape)
    else:
        if ttype in (int(T.TQ1_0), int(T.TQ2_0)):
            values = ternarize(values)
        blocks = gguf.quants.quantize(values, T(ttype))
        w.add_tensor(name, blocks, raw_dtype=T(ttype))
        expected[name] = gguf.quants.dequantize(blocks, T(ttype)).reshape(values.shape)


def tiny(kind="llama", seed=0, **overrides):
    import transformers
    cfg = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, vocab_size=320, max_position_embeddings=64, tie_word_embeddings=False)
    cfg.update(overrides)
    if kind == "qwen3_moe":  # transformers' GGUF mapping reads no moe_intermediate_size: its default it is
        cfg.update(num_experts=4, num_experts_per_tok=2, head_dim=128)
    config = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
              "qwen3": transformers.Qwen3Config, "qwen3_moe": transformers.Qwen3MoeConfig}[kind](**cfg)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(config)
        for p in model.parameters():  # norms and biases away from their init, so that a lost one shows
            if p.dim() == 1:
                p.data = 1 + 0.1 * torch.randn_like(p)
    return model.eval()

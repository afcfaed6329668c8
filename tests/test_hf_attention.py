"""The "ulb" attention implementation (integrations/hf_attention.py): its
one-token path (torch's kernel on packed heads for short caches, two
matmuls for long ones) against the math of transformers' eager attention (repeat_kv,
matmul, float32 softmax, matmul), with every mask form transformers passes;
everything else handed to transformers' sdpa function unchanged; and a model
switched to it decoding the same tokens."""
import pytest
import torch

pytest.importorskip("transformers")
from transformers.integrations import sdpa_attention  # noqa: E402

import ulbtorch  # noqa: E402
from ulbtorch.integrations import hf_attention  # noqa: E402


class _Attn(torch.nn.Module):
    def __init__(self, groups):
        super().__init__()
        self.num_key_value_groups = groups
        self.is_causal = True


def reference(q, k, v, mask, scaling):
    """transformers' eager attention, in float64."""
    group = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(group, 1)
    v = v.double().repeat_interleave(group, 1)
    s = q.double() @ k.transpose(-1, -2) * scaling
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask.double()
    return (torch.softmax(s, -1) @ v).transpose(1, 2)


def masks(B, H, L, g):
    keep = torch.rand(B, 1, 1, L, generator=g) > 0.3
    keep[..., 0] = True
    add = torch.zeros(B, 1, 1, L).masked_fill(~keep, torch.finfo(torch.float32).min)
    per_head = torch.rand(B, H, 1, L, generator=g) > 0.3
    per_head[..., 0] = True
    longer = torch.ones(B, 1, 1, L + 5, dtype=torch.bool)  # a static cache's mask may run past the keys given
    return {"none": None, "bool": keep, "float": add, "per-head bool": per_head, "longer": longer}


@pytest.mark.parametrize("heads,kv_heads", [(8, 4), (8, 8), (6, 1)])
@pytest.mark.parametrize("L", [1, 7, 130, hf_attention.SDPA_MAX_KEYS - 1, hf_attention.SDPA_MAX_KEYS, 300])
@pytest.mark.parametrize("mask_kind", ["none", "bool", "float", "per-head bool", "longer"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_token_matches_eager_attention_math(heads, kv_heads, L, mask_kind, dtype):
    g = torch.Generator().manual_seed(L * 100 + heads + kv_heads)
    B, D = 2, 32
    q = torch.randn(B, heads, 1, D, generator=g).to(dtype)
    k = torch.randn(B, kv_heads, L, D, generator=g).to(dtype)
    v = torch.randn(B, kv_heads, L, D, generator=g).to(dtype)
    mask = masks(B, heads, L, g)[mask_kind]
    scaling = 0.125 if mask_kind == "float" else None
    out, weights = hf_attention.attention_forward(_Attn(heads // kv_heads), q, k, v, mask, scaling=scaling)
    assert weights is None and out.shape == (B, 1, heads, D) and out.dtype == dtype
    ref_mask = None if mask is None else mask[..., :L]
    expected = reference(q, k, v, ref_mask, D ** -0.5 if scaling is None else scaling)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(out.double(), expected, **tol)


@pytest.mark.parametrize("case", ["prompt", "dropout in training", "softcap"])
def test_everything_else_goes_to_transformers_sdpa(case, monkeypatch):
    seen = []

    def sdpa(module, query, key, value, attention_mask, **kwargs):
        seen.append(kwargs)
        return "sdpa", None

    monkeypatch.setattr(sdpa_attention, "sdpa_attention_forward", sdpa)
    module = _Attn(2)
    q_len, kwargs = 1, {}
    if case == "prompt":
        q_len = 5
    elif case == "dropout in training":
        module.train()
        kwargs["dropout"] = 0.1
    else:
        kwargs["softcap"] = 30.0
    q, k = torch.randn(1, 4, q_len, 8), torch.randn(1, 2, 5, 8)
    assert hf_attention.attention_forward(module, q, k, k, None, **kwargs) == ("sdpa", None)
    assert len(seen) == 1


def test_a_model_decodes_the_same_tokens_and_only_its_prompt_goes_to_sdpa(monkeypatch):
    from _tiny_llama import CONFIG, prompt, tiny_llama

    model = tiny_llama()
    model.generation_config.eos_token_id = None
    ulbtorch.quantize_(model, format="ternary")
    ids = prompt(8)
    with torch.inference_mode():
        expected = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=10, do_sample=False)
        assert ulbtorch.decode_attention_(model) is model
        assert model.config._attn_implementation == hf_attention.NAME
        calls = []
        original = sdpa_attention.sdpa_attention_forward
        monkeypatch.setattr(sdpa_attention, "sdpa_attention_forward",
                            lambda *a, **kw: calls.append(a[1].shape[2]) or original(*a, **kw))
        got = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=10, do_sample=False)
    assert torch.equal(got, expected)
    assert calls == [8] * CONFIG["num_hidden_layers"]  # the prompt, once a layer; no decode step


def test_decode_attention_refuses_what_is_not_a_transformers_model():
    with pytest.raises(TypeError, match="decode_attention_ takes a transformers model"):
        ulbtorch.decode_attention_(torch.nn.Linear(2, 2))

"""Attention for one-token decode on the CPU, as a transformers attention
implementation ("ulb"):

    ulbtorch.decode_attention_(model)      # model.set_attn_implementation("ulb")

Why: at one query token, transformers' sdpa function on the CPU calls
torch's flash kernel on every query head (enable_gqa or repeat_kv: its
default path, and every compiled one), whose cost grows far faster than the
cache, once per layer per token. Here the query heads of each key/value
head are the rows of one attention on it: torch's kernel on those packed
heads for short caches, and above SDPA_MAX_KEYS two batched matmuls and a
float32 softmax (the arithmetic of transformers' "eager" attention).
Anything else (prompts, training with dropout, soft-capping, attention
sinks, other devices) goes to transformers' own sdpa function unchanged."""
from __future__ import annotations

import torch
from torch import nn

NAME = "ulb"
# Below this many keys torch's kernel on the packed heads (the query heads
# of a kv head as rows, no repeat_kv) costs less than the two matmuls; above,
# its cost grows faster than theirs (benchmarks/decode_attention.py).
SDPA_MAX_KEYS = 256
# Keyword arguments of features the decode path does not implement.
_FALL_BACK_ON = ("softcap", "s_aux", "sinks", "position_bias")


def attention_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                      **kwargs):
    """transformers' attention contract: query [B, H, q, D], key and value
    [B, KVH, L, D] (H a multiple of KVH), attention_mask broadcastable to
    [B, 1, q, L] (bool: attend where True; float: added) or None; returns
    ([B, q, H, D], None)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    B, H, q_len, D = query.shape
    kvh = key.shape[1]
    if (q_len != 1 or not query.is_cpu or (dropout and module.training) or H % kvh or value.shape[-1] != D
            or any(kwargs.get(k) is not None for k in _FALL_BACK_ON)):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    group = H // kvh
    scaling = D ** -0.5 if scaling is None else scaling
    # Query head h reads key/value head h // group (transformers' repeat_kv):
    # a group's query heads are the rows of one attention on its kv head.
    q = query.reshape(B, kvh, group, D)
    mask = None
    if attention_mask is not None:
        mask = attention_mask[..., : key.shape[-2]]
        if mask.dim() == 4 and mask.shape[1] == H:  # a mask per query head
            mask = mask.reshape(mask.shape[0], kvh, group, -1)
    if key.shape[-2] < SDPA_MAX_KEYS:
        out = torch.nn.functional.scaled_dot_product_attention(q, key, value, attn_mask=mask, scale=scaling)
    else:
        scores = torch.matmul(q, key.transpose(-1, -2)).float() * scaling
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
        out = torch.matmul(torch.softmax(scores, dim=-1).to(value.dtype), value)
    return out.reshape(B, H, 1, D).transpose(1, 2), None


def register() -> None:
    """Register NAME with transformers' attention and mask interfaces (the
    masks as for sdpa). Idempotent."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, attention_forward)
    AttentionMaskInterface.register(NAME, sdpa_mask)


def decode_attention_(model: nn.Module) -> nn.Module:
    """Switch a transformers model's attention to NAME (registered on first
    use); returns the model. Undo with model.set_attn_implementation("sdpa")."""
    if not hasattr(model, "set_attn_implementation"):
        raise TypeError(f"decode_attention_ takes a transformers model, got {type(model).__name__}")
    register()
    model.set_attn_implementation(NAME)
    return model

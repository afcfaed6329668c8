"""vLLM's fused mixture-of-experts layer (RoutedExperts) over ulbtorch's packed experts.

A checkpoint saved by transformers with UlbConfig holds each expert's merged
gate/up projection and its down projection as packed blobs,
`<layer>.experts.packed_gate_up_proj.<e>.packed` and
`<layer>.experts.packed_down_proj.<e>.packed` (integrations.hf_experts).
vLLM's expert loader knows neither name, so the method gives the layer its
own load_weights: each blob goes to the ShardAssembler of its expert, split
as vLLM splits experts (w13, gate and up, by rows over the tensor-parallel
ranks, w2, down, by columns; under expert parallelism a rank keeps only its
own experts, whole), and an expert is packed again as soon as its shards
are in, so unpacked codes of one expert at a time are held. apply runs the
routed experts' w13 in one ulb.linear_many call, vLLM's activation, their
w2 in a second call, and weighs and sums each token's top-k outputs; vLLM's
runner adds the shared experts and reduces over the ranks.
"""
from __future__ import annotations

import functools

import torch
from torch import nn
from vllm.model_executor.layers.fused_moe.activation import (MoEActivation, apply_moe_activation,
                                                             apply_moe_activation_supported)
from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase

from .hf_experts import PACKED
from ..quantize import QuantConfig
from .sharding import ShardAssembler

# the checkpoint's names of an expert's weights (transformers' experts module): vLLM's w13 and w2
W13, W2 = "gate_up_proj", "down_proj"
UP_ONLY = "up_proj"  # a non-gated MoE's first layer (has_gate False)


class UlbMoEMethod(FusedMoEMethodBase):
    def __init__(self, quant: QuantConfig, moe):
        super().__init__(moe)
        self.quant = quant

    def create_weights(self, layer, num_experts: int, hidden_size: int, intermediate_size_per_partition: int,
                       params_dtype: torch.dtype, **extra_weight_attrs):
        name, moe = layer.layer_name, self.moe
        why = _unsupported(layer, moe, hidden_size, intermediate_size_per_partition)
        if why:
            raise ValueError(f"ulb: {name}: {why}; ulbtorch's vLLM plugin serves gated or plain experts without "
                             "biases, router weights applied to the outputs")
        tp_rank, tp_size = moe.tp_rank, moe.tp_size
        inter, hidden = intermediate_size_per_partition, hidden_size
        gated = moe.is_act_and_mul
        g13 = self.quant.layer_args(hidden)["group_size"]
        g2 = self.quant.layer_args(inter * tp_size)["group_size"]
        fmt = self.quant.format

        def assemblers(e: int) -> tuple[ShardAssembler, ShardAssembler]:
            w13 = ShardAssembler(f"{name}.{PACKED}{W13 if gated else UP_ONLY}.{e}", [inter] * (2 if gated else 1),
                                 hidden, hidden, fmt, g13, tp_rank, tp_size)
            w2 = ShardAssembler(f"{name}.{PACKED}{W2}.{e}", [hidden], inter, inter * tp_size, fmt, g2,
                                tp_rank, tp_size)
            return w13, w2

        layer.ulb_new_assemblers = assemblers
        layer.ulb_pending = {}  # local expert -> its (w13, w2) assemblers, until both are packed
        layer.ulb_w13 = [None] * num_experts  # local expert -> packed w13 of this rank
        layer.ulb_w2 = [None] * num_experts
        layer.ulb_out = (inter * (2 if gated else 1), hidden)  # w13's and w2's out_features on this rank
        # vLLM checks that every parameter was loaded: these two stand for all experts' blobs.
        for p in ("w13_packed", "w2_packed"):
            layer.register_parameter(p, nn.Parameter(torch.empty(0, dtype=torch.uint8), requires_grad=False))
        layer.load_weights = functools.partial(_load_weights, layer, gated)

    def get_fused_moe_quant_config(self, layer):
        return None  # no vLLM kernel runs these experts

    def process_weights_after_loading(self, layer) -> None:
        if layer.w13_packed.device.type != "cpu":
            raise ValueError(f"ulb: {layer.layer_name} is on {layer.w13_packed.device}; ulbtorch's vLLM plugin "
                             "serves mixture-of-experts layers on the CPU only")
        missing = [e for e, (a, b) in enumerate(zip(layer.ulb_w13, layer.ulb_w2)) if a is None or b is None]
        if missing:
            detail = "; ".join(f"expert {e}: " + ", ".join(f"{s.name} shards {_missing_shards(s)}"
                                                            for s in layer.ulb_pending[e] if not s.complete)
                               for e in missing if e in layer.ulb_pending)
            raise ValueError(f"ulb: {layer.layer_name}: the checkpoint holds no packed weights, or only part of "
                             f"them, for local experts {missing}" + (f" ({detail})" if detail else ""))
        del layer.ulb_pending, layer.ulb_new_assemblers

    def apply(self, layer, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
              shared_experts, shared_experts_input) -> torch.Tensor:
        return experts_forward(layer.ulb_w13, layer.ulb_w2, layer.ulb_out, layer.activation, x, topk_weights,
                               topk_ids, layer.expert_map)


def _missing_shards(assembler: ShardAssembler) -> list[int]:
    return [i for i, ok in enumerate(assembler.loaded) if not ok]


def _unsupported(layer, moe, hidden_size: int, inter: int) -> str | None:
    """Why the method cannot serve this layer, or None."""
    if moe.has_bias:
        return "its experts have biases"
    if layer.apply_router_weight_on_input:
        return "it weighs the experts' inputs by the router (apply_router_weight_on_input)"
    if not apply_moe_activation_supported(layer.activation) or layer.activation in (
            MoEActivation.SWIGLUOAI, MoEActivation.SWIGLUSTEP, MoEActivation.SITU):
        return f"its activation is {layer.activation.value}"
    if any(getattr(layer, a, None) is not None for a in ("swiglu_limit", "swiglu_alpha", "swiglu_beta")):
        return "its activation is clamped (swiglu_limit/alpha/beta)"
    if hidden_size != moe.hidden_dim_unpadded or inter != moe.intermediate_size_per_partition_unpadded:
        return (f"vLLM pads its sizes (hidden {moe.hidden_dim_unpadded} -> {hidden_size}, intermediate "
                f"{moe.intermediate_size_per_partition_unpadded} -> {inter})")
    return None


def _load_weights(layer, gated: bool, weights):
    """RoutedExperts.load_weights for packed experts: names relative to the
    experts module ("packed_gate_up_proj.3.packed"), each expert's blob
    into its assembler, yields the parameter names vLLM checks."""
    for name, blob in weights:
        parsed = _parse(name, gated)
        if parsed is None:
            raise ValueError(f"ulb: {layer.layer_name}: unexpected checkpoint tensor {layer.layer_name}.{name}; "
                             f"packed experts are {PACKED}{W13 if gated else UP_ONLY}.<e>.packed and "
                             f"{PACKED}{W2}.<e>.packed")
        which, expert = parsed
        if not 0 <= expert < layer.global_num_experts:
            raise ValueError(f"ulb: {layer.layer_name}.{name}: expert {expert} of {layer.global_num_experts}")
        local = layer._map_global_expert_id_to_local_expert_id(expert)
        if local >= 0:  # else another expert-parallel rank's
            _take(layer, local, which, blob.cpu(), gated)
        yield "w13_packed" if which == 0 else "w2_packed"


def _parse(name: str, gated: bool) -> tuple[int, int] | None:
    """(0 for w13 or 1 for w2, expert) of a packed expert's tensor name."""
    parts = name.split(".")
    if len(parts) != 3 or parts[2] != "packed" or not parts[1].isdigit():
        return None
    which = {f"{PACKED}{W13 if gated else UP_ONLY}": 0, f"{PACKED}{W2}": 1}.get(parts[0])
    return None if which is None else (which, int(parts[1]))


def _take(layer, local: int, which: int, blob: torch.Tensor, gated: bool) -> None:
    pending = layer.ulb_pending.get(local)
    if pending is None:
        pending = layer.ulb_pending[local] = layer.ulb_new_assemblers(local)
    target = pending[which]
    if which == 1 or not gated:
        target.load(blob, 0)
    else:  # the gate's rows, then the up projection's: w1 and w3, each split over the ranks
        codes, scales = target.unpack_checked(blob)
        half = codes.shape[0] // 2
        if codes.shape[0] != 2 * half:
            raise ValueError(f"{target.name}: checkpoint weight is {tuple(codes.shape)}, an odd number of rows "
                             "for gate and up")
        target.load_codes(codes[:half], scales[:half], 0)
        target.load_codes(codes[half:], scales[half:], 1)
    if all(s.complete for s in pending):
        layer.ulb_w13[local], layer.ulb_w2[local] = pending[0].pack(), pending[1].pack()
        del layer.ulb_pending[local]


def experts_forward(w13: list[torch.Tensor], w2: list[torch.Tensor], out: tuple[int, int], activation: MoEActivation,
                    x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                    expert_map: torch.Tensor | None = None) -> torch.Tensor:
    """sum_j topk_weights[t, j] * expert(topk_ids[t, j])(x[t]) for every token
    t, each expert w2(act(w13 x)) over packed blobs (one list entry a local
    expert; out: the out_features of w13 and of w2). expert_map (expert parallelism) maps global ids to local ones,
    -1 for another rank's: those contribute nothing."""
    num_tokens, top_k = topk_ids.shape
    ids = topk_ids if expert_map is None else expert_map[topk_ids.long()]
    listed = ids.reshape(-1).tolist()
    xk = x if x.dtype in (torch.float32, torch.bfloat16) else x.float()
    if num_tokens == 1:  # decode: pair j is the token through expert listed[j]
        rows = [j for j, e in enumerate(listed) if e >= 0]
        experts, xs = [listed[j] for j in rows], [xk] * len(rows)
        rows = torch.tensor(rows, dtype=torch.long)
    else:
        flat = ids.reshape(-1)
        experts = sorted({e for e in listed if e >= 0})
        pairs = [(flat == e).nonzero().squeeze(1) for e in experts]
        xs = [xk[p // top_k] for p in pairs]
        rows = torch.cat(pairs) if pairs else None
    pair_out = torch.zeros(num_tokens * top_k, x.shape[-1], dtype=torch.float32)
    if experts:
        h = torch.ops.ulb.linear_many(xs, [w13[e] for e in experts], [], out[0])
        a = h.new_empty(h.shape[0], h.shape[1] // 2 if activation.is_gated else h.shape[1])
        apply_moe_activation(activation, a, h)
        y = torch.ops.ulb.linear_many(list(a.split([t.shape[0] for t in xs])), [w2[e] for e in experts], [],
                                      out[1])
        pair_out[rows] = y.float()
    weighted = pair_out * topk_weights.reshape(-1, 1).float()
    return weighted.view(num_tokens, top_k, -1).sum(dim=1).to(x.dtype)

"""The experts of transformers' mixture-of-experts layers, packed.

transformers 5 keeps the experts of a MoE layer in one module (a class
decorated with `use_experts_implementation`) as 3-D parameters: `gate_up_proj`
(or `up_proj` where `has_gate` is False) and `down_proj`, experts x out x in,
or experts x in x out where `is_transposed`, with `*_bias` of experts x out
where `has_bias`. pack_experts puts in place of each an nn.ModuleList of
low-bit layers, one per expert (`experts.packed_gate_up_proj.3` is expert 3's
gate_up_proj: a name that transformers' checkpoint conversions, which match
".experts.gate_up_proj", leave alone), and gives the module a forward that
runs, for each expert that tokens were routed to, its two layers on those
tokens with the module's own gate in between (`_apply_gate`, or `act_fn`),
then weighs and sums the top-k outputs of each token as transformers'
`batched_mm` does. The experts' first layers run in one call of
ulb.linear_many, their second layers in another.
"""
from __future__ import annotations

import functools

import torch
from torch import nn
from torch.nn.modules.module import _global_forward_hooks, _global_forward_pre_hooks

from ..nn.fast_path import kernel_serves, records_grad, tangents_possible
from ..nn.linear import plain_call

EXPERT_WEIGHTS = ("gate_up_proj", "up_proj", "down_proj")
PACKED = "packed_"  # packed_gate_up_proj: the layers in place of gate_up_proj
# Set by use_experts_implementation on the experts modules it serves.
_LAYOUT_FLAGS = ("has_gate", "has_bias", "is_transposed")


def is_experts_module(m: nn.Module) -> bool:
    """One of transformers' experts modules, packed or not."""
    return isinstance(getattr(m, "num_experts", None), int) and all(hasattr(m, f) for f in _LAYOUT_FLAGS)


def is_fused_experts(m: nn.Module) -> bool:
    """A transformers experts module with float 3-D expert weights."""
    return is_experts_module(m) and any(_fused_weight(m, p) is not None for p in EXPERT_WEIGHTS)


def router_names(model: nn.Module) -> list[str]:
    """The linear layers that route tokens to experts (quantize_ keeps them
    in float: a rounded router picks other experts): under the module that
    holds an experts module, outside it, with one output per expert or one
    output (a shared expert's gate), and either directly there or the only
    linear layer of the module around it (HunYuan's gate.wg; a shared
    expert's MLP, whose width may equal the number of experts, is not)."""
    found = []
    for name, block in model.named_modules():
        for child_name, experts in block.named_children():
            if not is_experts_module(experts):
                continue
            for sub, m in block.named_modules():
                if (not isinstance(m, nn.Linear) or sub.startswith(f"{child_name}.")
                        or m.out_features not in (experts.num_experts, 1)):
                    continue
                holder = sub.rpartition(".")[0]
                if holder and sum(isinstance(x, nn.Linear) for x in block.get_submodule(holder).modules()) > 1:
                    continue
                found.append(f"{name}.{sub}" if name else sub)
    return list(dict.fromkeys(found))


def _fused_weight(m: nn.Module, name: str) -> torch.Tensor | None:
    w = m._parameters.get(name)
    return w if w is not None and w.dim() == 3 and w.is_floating_point() else None


def fused_weight_names(m: nn.Module) -> list[str]:
    """The 3-D expert weights of an experts module, by attribute name."""
    return [p for p in EXPERT_WEIGHTS if _fused_weight(m, p) is not None]


def expert_linears(m: nn.Module, name: str) -> list[nn.Linear]:
    """Expert weight `name` of m as one nn.Linear per expert (weight out x in,
    sharing m's storage), for the quantizers."""
    w = m._parameters[name]
    b = m._parameters.get(f"{name}_bias") if m.has_bias else None
    out = []
    for e in range(w.shape[0]):
        we = w[e].t() if m.is_transposed else w[e]
        lin = nn.Linear(we.shape[1], we.shape[0], bias=b is not None, device="meta")
        lin.weight = nn.Parameter(we, requires_grad=False)
        if b is not None:
            lin.bias = nn.Parameter(b[e], requires_grad=False)
        out.append(lin)
    return out


def expert_shape(m: nn.Module, name: str) -> tuple[int, int, int, bool]:
    """(experts, in_features, out_features, bias) of expert weight `name`."""
    w = m._parameters[name]
    out_f, in_f = (w.shape[2], w.shape[1]) if m.is_transposed else (w.shape[1], w.shape[2])
    return w.shape[0], in_f, out_f, bool(m.has_bias and m._parameters.get(f"{name}_bias") is not None)


def parse_expert_layer_name(name: str) -> tuple[str, str, int] | None:
    """"<module>.packed_<weight>.<expert>" as (module, weight, expert), else None."""
    owner, _, index = name.rpartition(".")
    module_name, _, attr = owner.rpartition(".")
    weight = attr.removeprefix(PACKED)
    if not index.isdigit() or attr == weight or weight not in EXPERT_WEIGHTS:
        return None
    return module_name, weight, int(index)


def pack_experts(m: nn.Module, layers: dict[str, list[nn.Module]]) -> None:
    """Put `layers` (expert weight name -> one low-bit layer per expert) in
    place of m's 3-D weights and their biases, and run m through them."""
    for name, per_expert in layers.items():
        for p in (name, f"{name}_bias"):
            if p in m._parameters:
                delattr(m, p)
        setattr(m, PACKED + name, nn.ModuleList(per_expert))
    m.forward = functools.partial(packed_experts_forward, m)
    # transformers' weight init (from_pretrained of packed weights) would
    # write the 3-D weights the module no longer has.
    m._is_hf_initialized = True


def _float_expert(m: nn.Module, name: str, e: int, x: torch.Tensor) -> torch.Tensor:
    """Expert e's layer `name` on x, from the 3-D float weight quantize_ was
    told to leave in float."""
    w = m._parameters[name]
    b = m._parameters[f"{name}_bias"][e] if m.has_bias else None
    return nn.functional.linear(x, w[e].t() if m.is_transposed else w[e], b)


def _one_call_serves(layers: list[nn.Module], xs: list[torch.Tensor]) -> bool:
    """Whether ulb.linear_many gives what calling each layer would: every
    call one that the kernel serves as it is (nn.fast_path.kernel_serves)
    with nothing for autograd to record (the op has no derivative; the
    layers' calls do), every layer a plain call (nn.linear.plain_call) and no
    global hooks (accelerate's offload puts the weights back in one), no
    autocast, and inputs and biases alike: plain CPU tensors of one dtype,
    biases all or none."""
    if (torch.is_autocast_enabled("cpu") or tangents_possible() or _global_forward_hooks
            or _global_forward_pre_hooks or not all(plain_call(layer) for layer in layers)):
        return False
    dtype, first_bias = xs[0].dtype, layers[0]._parameters["bias"]
    for layer, x in zip(layers, xs):
        bias = layer._parameters["bias"]
        if (type(x) is not torch.Tensor or x.dtype != dtype or not kernel_serves(layer, x, bias)
                or records_grad(x, bias) or not layer._buffers["packed"].is_cpu
                or (bias is None) != (first_bias is None)
                or (bias is not None and (bias.dtype != first_bias.dtype or not bias.is_cpu))):
            return False
    return True


def _experts_layer(m: nn.Module, name: str, experts: list[int], xs: list[torch.Tensor]) -> torch.Tensor:
    """Expert experts[j]'s layer `name` on the tokens xs[j], for every j, the
    outputs' rows stacked: packed layers in one call where it serves (the
    per-call cost of the threads' fork and join and of the weight stream's
    start is most of a small expert's time), else one call each."""
    packed = m._modules.get(PACKED + name)
    if packed is None:
        return torch.cat([_float_expert(m, name, e, x) for e, x in zip(experts, xs)])
    layers = [packed._modules[str(e)] for e in experts]  # ModuleList's __getitem__ is slow for a per-token loop
    if _one_call_serves(layers, xs):
        biases = [layer._parameters["bias"] for layer in layers]
        return torch.ops.ulb.linear_many(xs, [layer._buffers["packed"] for layer in layers],
                                         [] if biases[0] is None else biases, layers[0].out_features)
    return torch.cat([layer(x) for layer, x in zip(layers, xs)])


def _run_experts(m: nn.Module, experts: list[int], xs: list[torch.Tensor]) -> torch.Tensor:
    """Expert experts[j] on the tokens xs[j], for every j, their outputs
    stacked: up (and gate) per expert, the module's gate once over all of
    them (it is elementwise), down per expert."""
    h = _experts_layer(m, "gate_up_proj" if m.has_gate else "up_proj", experts, xs)
    h = m._apply_gate(h) if m.has_gate else m.act_fn(h)
    y = _experts_layer(m, "down_proj", experts, list(h.split([x.shape[0] for x in xs])))
    if getattr(m, "has_post_expert_norm", False):
        y = m.post_expert_norm(y)
    return y.to(xs[0].dtype)


# Which experts run depends on the routing (a data-dependent loop): a compiled
# model runs this part eagerly rather than recompile for every expert.
@torch.compiler.disable
def packed_experts_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                           top_k_weights: torch.Tensor) -> torch.Tensor:
    """transformers' experts forward (hidden_states: tokens x hidden,
    top_k_index / top_k_weights: tokens x k) over packed experts. Expert ids
    past num_experts (expert parallelism's sentinels) contribute nothing."""
    num_tokens, top_k = top_k_index.shape
    ids = top_k_index.reshape(-1)
    listed = ids.tolist()
    if num_tokens == 1:  # decode: pair j is the token through expert ids[j], without masks or gathers
        experts = [e for e in listed if 0 <= e < self.num_experts]
        xs, rows = [hidden_states] * len(experts), [j for j, e in enumerate(listed) if 0 <= e < self.num_experts]
    else:
        experts = [e for e in sorted(set(listed)) if 0 <= e < self.num_experts]
        pairs = [(ids == e).nonzero().squeeze(1) for e in experts]
        xs, rows = [hidden_states[p // top_k] for p in pairs], torch.cat(pairs) if pairs else None
    if len(experts) == len(listed) and num_tokens == 1:
        pair_out = _run_experts(self, experts, xs)  # every pair, in order
    else:
        pair_out = hidden_states.new_zeros(num_tokens * top_k, hidden_states.shape[-1])
        if experts:
            pair_out[rows] = _run_experts(self, experts, xs)
    weighted = pair_out * top_k_weights.reshape(-1, 1)
    return weighted.view(num_tokens, top_k, hidden_states.shape[-1]).sum(dim=1).to(hidden_states.dtype)

"""The ternary layer of BitNet checkpoints with a norm in each layer
(quantization_config.use_rms_norm, as Falcon-E publishes them): the input
goes through an RMSNorm over the layer's input features before the
activations are quantised, as transformers' BitLinear and AutoBitLinear do.

Every path that stores such a layer keeps the norm beside the packed weight
as `<layer>.rms_norm.weight`, and its eps in the layer's description:
UlbConfig's input_norm_eps (save_pretrained / from_pretrained, vLLM) and the
manifest's per-layer input_norm_eps (save_quantized / load_quantized)."""
from __future__ import annotations

import torch

from .linear import LinearTernary


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm.forward, step for step, for the servers
    (vLLM) that hold the weight outside such a module: the same roundings,
    so the same activations reach the quantiser."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def check_eps(eps, where: str) -> float:
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps >= 0:
        raise ValueError(f"{where}: the input RMSNorm's eps must be a number >= 0, got {eps!r}")
    return float(eps)


class NormedLinearTernary(LinearTernary):
    """LinearTernary whose input first goes through `rms_norm`, transformers'
    LlamaRMSNorm (the module BitLinear / AutoBitLinear hold), so that the norm
    rounds as theirs does. Its state_dict adds `rms_norm.weight`."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, eps: float = 1e-6,
                 device=None, dtype=None, **kwargs):
        from transformers.models.llama.modeling_llama import LlamaRMSNorm

        super().__init__(in_features, out_features, bias, device=device, dtype=dtype, **kwargs)
        self.rms_norm = LlamaRMSNorm(in_features, eps=check_eps(eps, type(self).__name__)).to(device=device,
                                                                                               dtype=dtype)

    @property
    def input_norm_eps(self) -> float:
        return self.rms_norm.variance_epsilon

    @classmethod
    def from_layer(cls, layer: LinearTernary, norm_weight: torch.Tensor, eps: float) -> "NormedLinearTernary":
        """`layer`'s packed weights and bias behind an RMSNorm of this weight."""
        if tuple(norm_weight.shape) != (layer.in_features,) or not norm_weight.is_floating_point():
            raise ValueError(f"the RMSNorm weight must be a float tensor of shape ({layer.in_features},), got "
                             f"{norm_weight.dtype} of shape {tuple(norm_weight.shape)}")
        new = cls(layer.in_features, layer.out_features, layer.bias is not None, eps=eps, format=layer.format,
                  group_size=layer.group_size, granularity=layer.granularity)
        new.packed = layer.packed
        if layer.bias is not None:
            new.bias.data = layer.bias.detach().clone()
        new.rms_norm.weight.data = norm_weight.detach().clone()
        return new

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return super().forward(self.rms_norm(input))


def input_norm_eps(module) -> float | None:
    """The eps of a layer's input RMSNorm, None for a layer without one."""
    return module.input_norm_eps if isinstance(module, NormedLinearTernary) else None

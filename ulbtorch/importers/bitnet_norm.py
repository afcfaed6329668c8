"""The ternary layer of BitNet checkpoints with a norm in each layer
(quantization_config.use_rms_norm, as Falcon-E publishes them): the input
goes through an RMSNorm over the layer's input features before the
activations are quantised, as transformers' BitLinear and AutoBitLinear do."""
from __future__ import annotations

import torch

from ..nn import LinearTernary


class NormedLinearTernary(LinearTernary):
    """LinearTernary whose input first goes through `rms_norm`, transformers'
    LlamaRMSNorm (the module BitLinear / AutoBitLinear hold), so that the norm
    rounds as theirs does. Its state_dict adds `rms_norm.weight`."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, eps: float = 1e-6, **kwargs):
        from transformers.models.llama.modeling_llama import LlamaRMSNorm

        super().__init__(in_features, out_features, bias, **kwargs)
        self.rms_norm = LlamaRMSNorm(in_features, eps=eps)

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

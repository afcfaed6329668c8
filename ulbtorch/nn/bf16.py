"""nn.Linear with a bf16 weight whose one-token CPU forward runs ulbtorch's
bf16 GEMV (torch.ops.ulb.linear_bf16): for the layers left unquantized, such
as lm_head, which PyTorch's bf16 F.linear reads at well below DRAM speed when
there is one token (decode) on CPUs without AMX."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .fast_path import gemv_serves
from .replace import is_plain_linear, module_names, name_selected, patterns, replace_everywhere

_linear_bf16 = torch.ops.ulb.linear_bf16.default


class LinearBF16(nn.Linear):
    """Same parameters, state_dict and results as the nn.Linear it wraps,
    to fp32 summation order. One-token bf16 input on a CPU with AVX2 or
    AVX-512 goes through the GEMV when no gradient is recorded (inference:
    torch.no_grad, generate); everything else (prefill, training, other
    dtypes or devices) is F.linear."""

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "LinearBF16":
        """A LinearBF16 sharing `linear`'s weight and bias (tied weights stay tied)."""
        layer = cls(linear.in_features, linear.out_features, bias=False, device="meta")
        layer.weight = linear.weight
        layer.bias = linear.bias
        return layer

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        w, b = self._parameters["weight"], self._parameters["bias"]
        if gemv_serves(input, w, b):
            return _linear_bf16(input, w, b)
        return F.linear(input, w, b)


def bf16_gemv_(model: nn.Module, *, include: list[str] | None = None, exclude: list[str] | None = None
               ) -> nn.Module:
    """Swap, in place, every nn.Linear of `model` with a bf16 weight (names
    matching `include`, default all, and not `exclude`, fnmatch patterns) for
    a LinearBF16 sharing its parameters; returns the model."""
    include = patterns(["*"] if include is None else include, "include")
    exclude = patterns([] if exclude is None else exclude, "exclude")
    targets = [(n, m) for n, m in model.named_modules()
               if is_plain_linear(m) and m.weight.dtype == torch.bfloat16 and name_selected(n, include, exclude)]
    names = module_names(model)
    for name, lin in targets:
        replace_everywhere(model, names, lin, LinearBF16.from_linear(lin))
    return model

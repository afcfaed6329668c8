"""The pure-PyTorch reference: what every kernel computes, in plain
PyTorch (per-token int8 activations times the dequantised weight). The
modules run it where the kernels do not (autograd, other devices); the
tests compare the kernels with it. ulbtorch.ops exports these functions."""
from __future__ import annotations

import torch

from .formats import Format, get_format, n_groups, normalize_group_size


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token absmax int8 (BitNet's rule, fp32): returns (q as float, scale)
    with x ~= q * scale; bit-identical to the kernels' quantiser."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True).clamp(min=1e-5)
    # A real division: `127.0 / tensor` would round twice (reciprocal, then
    # multiply) and differ from the kernels' 127.0f / amax in the last bit.
    inv = torch.full_like(amax, 127.0) / amax
    q = (xf * inv).round().clamp(-128, 127)
    return q, 1.0 / inv


def fake_quantize_activations(x: torch.Tensor) -> torch.Tensor:
    q, s = quantize_activations(x)
    return q * s


def dequantize(codes: torch.Tensor, scales: torch.Tensor, format: str | Format, group_size: int = 0
               ) -> torch.Tensor:
    """Float32 weight [M, K] that the kernels multiply by."""
    fmt = get_format(format)
    if codes.dim() != 2 or scales.dim() != 2:
        raise ValueError(f"codes must be [out_features, in_features] and scales [out_features, groups], got "
                         f"shapes {tuple(codes.shape)} and {tuple(scales.shape)}")
    M, K = codes.shape
    gs = normalize_group_size(group_size, K, fmt)
    if tuple(scales.shape) != (M, n_groups(gs, K)):
        raise ValueError(f"scales must have shape ({M}, {n_groups(gs, K)}) for codes of shape ({M}, {K}) and "
                         f"group_size={group_size}, got {tuple(scales.shape)}")
    gs = gs or K
    levels = fmt.codes_to_levels(codes).to(torch.float32)
    # Each column's group by index, not repeat_interleave(gs)[:, :K]: inductor
    # compiled that cut wrongly where the last group is partial (its columns
    # read past the scales; torch 2.13).
    s = scales.to(torch.float32)[:, torch.arange(K, device=scales.device) // gs]
    return levels * s


def reference_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """What the kernels compute, in plain PyTorch: int8-quantised activations
    times the dequantised weight, output in the input's dtype."""
    y = torch.nn.functional.linear(fake_quantize_activations(x), weight.float(),
                                   None if bias is None else bias.float())
    return y.to(x.dtype)

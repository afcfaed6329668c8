"""When a call may go straight to ulbtorch's kernels: the rules the layers
(LowBitLinear, LinearBF16), the packed experts' batched call
(integrations.hf_experts) and vLLM's bf16 lm_head apply, kept in one place
so that each path takes the same calls. (csrc/eager.cpp serves the common
case in C before these run.)"""
from __future__ import annotations

import torch

from .. import runtime

KERNEL_DTYPES = (torch.float32, torch.bfloat16)  # the input and bias dtypes ulb.linear takes as they are
_is_dynamo_compiling = torch.compiler.is_dynamo_compiling
_forward_ad = torch.autograd.forward_ad
_functorch_level = torch._C._functorch.maybe_current_level


def tangents_possible() -> bool:
    """A forward-mode AD level is open or a torch.func transform runs, so a
    kernel call alone would drop tangents (not while Dynamo traces: a
    compiled graph has neither)."""
    return not _is_dynamo_compiling() and (_forward_ad._current_level >= 0 or _functorch_level() is not None)


def records_grad(*tensors: torch.Tensor | None) -> bool:
    """Whether autograd would record an op on these tensors (None: no tensor)."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def kernel_serves(layer, x: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether ulb.linear computes the low-bit `layer`'s forward of x as
    given: float32 or bf16 input on the CPU whose last dimension is the
    layer's in_features, a bias of those dtypes or none, and the layer not
    set to run the pure-PyTorch reference (force_reference) nor holding its
    blob in the accelerator layout. Autograd is the
    caller's to handle: the op has no derivative."""
    return (x.dtype in KERNEL_DTYPES and x.is_cpu and x.dim() > 0 and x.shape[-1] == layer.in_features
            and not layer.force_reference and (bias is None or bias.dtype in KERNEL_DTYPES)
            and not layer.__dict__.get("_kmajor", False))


ACCEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what ulb.triton_linear takes as it is


def accel_serves(layer, x: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether ulb.triton_linear computes the forward of x for a `layer`
    holding its blob in the accelerator layout: input of those dtypes on the
    blob's device, last dimension in_features, the layer not set to
    force_reference. (Its bias may be any float dtype; autograd is the
    caller's, as for kernel_serves.)"""
    return (x.dtype in ACCEL_DTYPES and x.device == layer._buffers["packed"].device and x.dim() > 0
            and x.shape[-1] == layer.in_features and not layer.force_reference
            and (bias is None or bias.device == x.device))


def gemv_serves(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> bool:
    """Whether F.linear(x, w, b) can run as ulbtorch's bf16 GEMV: one bf16
    token of at least one feature, bf16 weight with contiguous, non-overlapping
    rows, both on the CPU, a vector ISA, a bf16 bias or none (F.linear refuses
    any other, and the layer must give what it gives), and no gradient to
    record (the op has no backward)."""
    return (runtime.bf16_gemv_native and x.dtype == torch.bfloat16 and w.dtype == torch.bfloat16
            and x.is_cpu and w.is_cpu and x.dim() and w.dim() == 2 and x.numel() == w.shape[1] == x.shape[-1] > 0
            and w.stride(1) == 1 and w.stride(0) >= w.shape[1] and (b is None or b.dtype == torch.bfloat16)
            and not records_grad(x, w, b))

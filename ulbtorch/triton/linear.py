"""ulb::triton_linear: y = x W^T + b for a kmajor blob on an accelerator
(or on CPU tensors under TRITON_INTERPRET=1), with its fake beside it.

A custom op rather than torch.library.triton_op: the op is opaque to
torch.compile either way, its fake gives the shapes, and unlike triton_op's
traced form it runs under Triton's interpreter, so CI checks the compiled
path too. The blob's header is checked where a layer takes the blob
(LowBitLinear), not here: reading device memory at every call would sync
the device and break CUDA graph capture; here the blob's size must match
the geometry the caller names.
"""
from __future__ import annotations

import torch
import triton

from ..formats import FORMATS_BY_ID
from ..ops import packed_nbytes
from .act_quant import quantize_activations
from .gemm import gemm_grid, gemm_kernel
from .gemv import CONFIGS as GEMV_CONFIGS
from .gemv import GEMV_MAX_TOKENS, gemv_store_kernel, gemv_sums_kernel, pack_activations, segments
from .kernel_parts import LAUNCH_OPTIONS, Y_BF16, Y_F16, Y_F32

Y_KINDS = {torch.float32: Y_F32, torch.bfloat16: Y_BF16, torch.float16: Y_F16}
# The GEMM's blocks: tokens, rows, codes of K (the GEMV's: gemv.CONFIGS).
GEMM_BLOCK_N, GEMM_BLOCK_M, GEMM_BLOCK_K = 32, 64, 64
STORE_BLOCK_M = 128


def dp4a_serves(device: torch.device) -> bool:
    """Whether the GEMV may use PTX's dp4a: compiled for an NVIDIA GPU (a
    ROCm build of torch calls its GPU "cuda" too)."""
    return device.type == "cuda" and torch.version.hip is None


def geometry(format_id: int, M: int, K: int, group_size: int) -> dict:
    """Sizes of the kmajor blob of this weight (kernels/include/ulb/ulb.h)."""
    fmt = FORMATS_BY_ID[format_id]
    K_pad = -(-K // fmt.tile_k) * fmt.tile_k
    gs = group_size if 0 < group_size < K else K_pad
    return dict(fmt=fmt, M_pad=-(-M // 16) * 16, K_pad=K_pad, group_size=gs, n_groups=-(-K_pad // gs))


def blob_views(packed: torch.Tensor, g: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The scales [G, M_pad] (float32) and code words [K_pad / tile_k, M_pad]
    (int32) of a kmajor blob, as views of its bytes."""
    s_bytes = g["n_groups"] * g["M_pad"] * 4
    w_bytes = g["K_pad"] // g["fmt"].tile_k * g["M_pad"] * 4
    scales = packed[64:64 + s_bytes].view(torch.float32).view(g["n_groups"], g["M_pad"])
    words = packed[64 + s_bytes:64 + s_bytes + w_bytes].view(torch.int32).view(-1, g["M_pad"])
    return scales, words


def check_args(x, packed, bias, format_id: int, M: int, K: int, group_size: int) -> None:
    if format_id not in FORMATS_BY_ID:
        raise ValueError(f"ulb.triton_linear: unknown format id {format_id}")
    if not isinstance(x, torch.Tensor) or x.dtype not in Y_KINDS:
        raise TypeError(f"ulb.triton_linear: x must be float32, bfloat16 or float16, got "
                        f"{getattr(x, 'dtype', type(x))}")
    if x.dim() < 1 or x.shape[-1] != K:
        raise ValueError(f"ulb.triton_linear: x must have {K} features in its last dimension, got shape "
                         f"{tuple(x.shape)}")
    want = packed_nbytes(FORMATS_BY_ID[format_id], M, K, group_size)
    if packed.dtype != torch.uint8 or packed.dim() != 1 or packed.numel() != want:
        raise ValueError(f"ulb.triton_linear: packed must be a 1-D uint8 blob of {want} bytes for this weight, "
                         f"got {packed.dtype} of shape {tuple(packed.shape)}")
    for name, t in (("packed", packed), ("bias", bias)):
        if t is not None and t.device != x.device:
            raise ValueError(f"ulb.triton_linear: {name} is on {t.device}, x on {x.device}")
    if bias is not None and (bias.shape != (M,) or not bias.is_floating_point()):
        raise ValueError(f"ulb.triton_linear: bias must be a float tensor of shape ({M},), got {bias.dtype} "
                         f"of shape {tuple(bias.shape)}")


def run(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, format_id: int, M: int, K: int,
        group_size: int, sums: bool = False):
    """The op's computation; with sums=True also the int32 sums of level x
    activation of each (token, row, group), [N, M, G], for the tests."""
    check_args(x, packed, bias, format_id, M, K, group_size)
    g = geometry(format_id, M, K, group_size)
    fmt = g["fmt"]
    x2 = x.reshape(-1, K)
    N = x2.shape[0]
    xq, xscale = quantize_activations(x2, g["K_pad"])
    scales, words = blob_views(packed, g)
    y = torch.empty(N, M, dtype=x.dtype, device=x.device)
    s = torch.zeros((N, M, g["n_groups"]) if sums else (1,), dtype=torch.int32, device=x.device)
    y_arg = y.view(torch.int16) if x.dtype == torch.bfloat16 else y
    levels = dict(BITS=fmt.bits, LEVEL_A=fmt.level_a, LEVEL_B=fmt.level_b)
    out = dict(HAS_BIAS=bias is not None, Y_KIND=Y_KINDS[x.dtype], SUMS=sums, **LAUNCH_OPTIONS)
    bias_arg = scales if bias is None else bias  # any pointer: HAS_BIAS keeps it unread
    if N == 0:
        pass
    elif N <= GEMV_MAX_TOKENS:
        seg = segments(fmt.bits, g["K_pad"], g["group_size"], g["n_groups"])
        block_m, _, warps = GEMV_CONFIGS[fmt.bits]
        part = torch.empty(seg["segs"], N, g["M_pad"], dtype=torch.int32, device=x.device)
        grid = (N, triton.cdiv(M, block_m), triton.cdiv(seg["segs"], seg["segs_per_program"]))
        gemv_sums_kernel[grid](pack_activations(xq, fmt.tile_k), words, part, N, M, g["M_pad"], g["K_pad"],
                               seg["seg_words"], seg["segs"], seg["segs_per_program"], BLOCK_M=block_m,
                               BLOCK_W=seg["block_words"], PTX=dp4a_serves(x.device), num_warps=warps, **levels,
                               **LAUNCH_OPTIONS)
        gemv_store_kernel[(N, triton.cdiv(M, STORE_BLOCK_M))](
            part, xscale, scales, bias_arg, y_arg, s, N, M, g["M_pad"], g["n_groups"], seg["segs"],
            seg["segs_per_group"], M, BLOCK_M=STORE_BLOCK_M, **out)
    else:
        gemm_kernel[gemm_grid(N, M, GEMM_BLOCK_N, GEMM_BLOCK_M)](
            xq, xscale, words, scales, bias_arg, y_arg, s, N, M, g["M_pad"], g["K_pad"], g["n_groups"],
            g["group_size"], M, BLOCK_N=GEMM_BLOCK_N, BLOCK_M=GEMM_BLOCK_M, BLOCK_W=GEMM_BLOCK_K // fmt.tile_k,
            **levels, **out)
    y = y.reshape(*x.shape[:-1], M)
    return (y, s) if sums else y


@torch.library.custom_op("ulb::triton_linear", mutates_args=())
def triton_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, format: int,
                  out_features: int, in_features: int, group_size: int) -> torch.Tensor:
    return run(x, packed, bias, format, out_features, in_features, group_size)


@triton_linear.register_fake
def _(x, packed, bias, format, out_features, in_features, group_size):
    check_args(x, packed, bias, format, out_features, in_features, group_size)
    return x.new_empty(*x.shape[:-1], out_features)

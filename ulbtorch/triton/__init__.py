"""Triton kernels for packed weights on accelerators (CUDA, ROCm, Intel XPU).

On such a device a layer's blob is kept in the accelerator layout
("kmajor", kernels/include/ulb/ulb.h), repacked once when the layer moves
there, and run by the kernels of this package: activations quantised per
token to int8 as the CPU kernels do (act_quant.py), then one fused GEMV
(gemv.py, up to GEMV_MAX_TOKENS tokens) or GEMM (gemm.py) whose integer
sums and fp32 epilogue follow the CPU's scalar reference operation for
operation, so outputs agree with the CPU bit for bit. linear.py registers
them as the custom op ulb::triton_linear.

With TRITON_INTERPRET=1 Triton runs the same kernels on CPU tensors; the
tests use that (tests/test_triton.py) to check them against the C kernels.
"""
from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os

import torch

# Device types Triton compiles for ("cuda" covers ROCm builds of PyTorch).
DEVICE_TYPES = ("cuda", "xpu")


def available() -> bool:
    """Whether the triton package can be imported (without importing it)."""
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    """Whether Triton runs kernels in its interpreter, on CPU tensors."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


_cpu_stands_in = False  # see emulate_on_cpu


def serves(device: torch.device | str) -> bool:
    """Whether packed layers on `device` run these kernels: an accelerator
    Triton compiles for, with triton installed (or the CPU, inside
    emulate_on_cpu)."""
    kind = torch.device(device).type
    return (kind in DEVICE_TYPES or (kind == "cpu" and _cpu_stands_in)) and available()


def load() -> None:
    """Register torch.ops.ulb.triton_linear (importing triton), once; layers
    call it as their blob takes the accelerator layout, so that a forward,
    traced or not, finds the op."""
    importlib.import_module(f"{__name__}.linear")


@contextlib.contextmanager
def emulate_on_cpu():
    """Within it the CPU counts as a device these kernels serve: a layer
    moved or loaded there takes the accelerator layout and runs the Triton
    kernels in Triton's interpreter, so that the tests can follow the
    accelerator paths of the layers and loaders without an accelerator.
    Needs TRITON_INTERPRET=1 set before triton is imported."""
    global _cpu_stands_in
    if not interpreting():
        raise RuntimeError("ulbtorch.triton.emulate_on_cpu needs TRITON_INTERPRET=1 (set before triton is imported)")
    was, _cpu_stands_in = _cpu_stands_in, True
    try:
        yield
    finally:
        _cpu_stands_in = was

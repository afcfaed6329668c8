"""torchao as the PyTorch peer: its quantize_ on a copy of the same bf16
model, lm_head left in bf16 (as our bf16-head rows), each config tried
and, where torchao has no kernel for this CPU, reported with its reason.

  int4 weight-only g32: PrototypeInt4WeightOnlyConfig (the CPU one: aten's
      _weight_int4pack_mm_for_cpu); the stable Int4WeightOnlyConfig has no
      CPU packing format in torchao 0.18 (plain needs mslk, tile_packed_to_4d
      CUDA).
  Int8DynamicActivationIntxWeightConfig int4 g32, packed: its kernels are
      torchao's C++ library or KleidiAI (ARM); the unpacked_to_int8 format
      it falls back to dequantises in PyTorch each call, no kernel, and is
      not timed.
  Int8DynamicActivationInt4WeightConfig g32 (da8w4_linear_cpu, x86): where
      the wheel ships that kernel.
"""
from __future__ import annotations

import copy
import warnings

import torch
from torch import nn

HEAD = "lm_head"


def available() -> str | None:
    """torchao's version, or None when it is not installed."""
    try:
        import torchao
    except ImportError:
        return None
    return torchao.__version__


def _configs() -> dict:
    from torchao.prototype.quantization.int4 import (
        Int8DynamicActivationInt4WeightConfig,
        PrototypeInt4WeightOnlyConfig,
    )
    from torchao.quantization import Int8DynamicActivationIntxWeightConfig
    from torchao.quantization.granularity import PerGroup

    return {
        "int4 weight-only g32": lambda: PrototypeInt4WeightOnlyConfig(group_size=32),
        "int8 dyn act + int4 g32 (IntxWeight, packed)": lambda: Int8DynamicActivationIntxWeightConfig(
            weight_dtype=torch.int4, weight_granularity=PerGroup(32), intx_packing_format="opaque_torchao_auto"),
        "int8 dyn act + int4 g32 (da8w4 cpu)": lambda: Int8DynamicActivationInt4WeightConfig(group_size=32),
    }


# Each torchao config's weights in the ulbtorch format they match (body
# format, group size): what its row is compared against.
MATCHES = {"int4 weight-only g32": "int4", "int8 dyn act + int4 g32 (IntxWeight, packed)": "int4",
           "int8 dyn act + int4 g32 (da8w4 cpu)": "int4"}


def quantized(base: nn.Module, ids: torch.Tensor, generate) -> dict[str, tuple[nn.Module | None, str | None]]:
    """{config name: (model, None) or (None, the reason it does not run
    here)}: each config applied by torchao.quantization.quantize_ to a deep
    copy of base, lm_head excluded, and run once through generate."""
    from torchao.quantization import quantize_

    out = {}
    for name, make in _configs().items():
        model = copy.deepcopy(base)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                quantize_(model, make(), filter_fn=lambda m, fqn: isinstance(m, nn.Linear) and
                          not fqn.endswith(HEAD))
                generate(model, ids, 2)
            out[name] = (model, None)
        except Exception as e:  # noqa: BLE001 - any failure is the reason this config does not run here
            out[name] = (None, f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")
    return out

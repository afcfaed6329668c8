"""What every path that makes low-bit layers does last: quantize_,
load_quantized, transformers' from_pretrained ("ulb") and the BitNet
importers each end with finish_conversion."""
from __future__ import annotations

import glob

from torch import nn

from . import ops
from .formats import get_format
from .hugepages import HugePageReport, move_to_hugepages
from .nn import LowBitLinear, bf16_gemv_


def retile_for_this_cpu(layer: LowBitLinear) -> None:
    """A 1-bit layer's tiles in the order this CPU's kernels read fastest."""
    if layer.backend == "cpu" and get_format(layer.format).bits == 1:
        want = ops.preferred_tiles(layer.format)
        if ops.packed_info(layer.packed)["tiles"] != want:
            layer.packed = ops.retile(layer.packed, want)


def finish_conversion(model: nn.Module, *, bf16_gemv: bool | list[str], hugepages: bool
                      ) -> HugePageReport | None:
    """Ready a model whose layers are converted or loaded, in place: each
    blob in the layout of its device (LowBitLinear.settle_layout), 1-bit
    tiles in this CPU's order (whatever CPU packed them); the
    bf16 nn.Linear layers on the bf16 GEMV (nn.LinearBF16): all of them for
    True, those of these exact names for a list, none for False; then,
    with hugepages, the streamed weights moved into 2 MiB pages
    (ulbtorch.hugepages), whose report it returns (else None)."""
    for layer in model.modules():
        if isinstance(layer, LowBitLinear):
            layer.settle_layout()  # loaders may have written the blob on an accelerator directly
            retile_for_this_cpu(layer)
    if bf16_gemv is True:
        bf16_gemv_(model)
    elif bf16_gemv:
        bf16_gemv_(model, include=[glob.escape(n) for n in bf16_gemv])  # names, not patterns
    return move_to_hugepages(model) if hugepages else None

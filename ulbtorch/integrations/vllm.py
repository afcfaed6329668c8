"""vLLM quantization method "ulb", registered from outside vLLM's tree.

Loaded by vLLM through the `vllm.general_plugins` entry point (see
pyproject.toml). Serves checkpoints written by transformers' save_pretrained
with UlbConfig: each linear's packed blob arrives whole, a ShardAssembler
keeps this rank's slice (column- or row-parallel, merged QKV and gate/up),
and the merged matrix is packed once after loading. A checkpoint saved with
lm_head_bits serves its lm_head (vLLM's ParallelLMHead) the same way, its
vocabulary split over ranks as vLLM splits it (VocabShardAssembler). A bf16
lm_head keeps vLLM's weights and, with the config's bf16_gemv (default), the
logits of one token run ulbtorch's bf16 GEMV, as nn.LinearBF16 does. On an
accelerator Triton serves (CUDA, ROCm, XPU) the packed blob is moved there
in the accelerator layout and run by ulb.triton_linear (ulbtorch/triton/),
which neither syncs nor reads the blob on the host, so CUDA graphs capture it.
A mixture-of-experts layer's packed experts run UlbMoEMethod (vllm_moe.py), on
the CPU; its router stays float. Other layers left in bf16 stay vLLM's own: on
CPU it repacks their weights for oneDNN and frees the originals, which the
GEMV would need.
"""
from __future__ import annotations

import fnmatch
from typing import Any

import torch
from torch import nn
from vllm.model_executor.layers.fused_moe import GateLinear, RoutedExperts
from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod
from vllm.model_executor.layers.quantization import register_quantization_config
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, UnquantizedEmbeddingMethod

from ..nn.fast_path import gemv_serves
from ..quantize import LM_HEAD, SAVED_OPTIONS, QuantConfig
from .vllm_linear import UlbLinearMethod
from .vllm_moe import UlbMoEMethod
from .vllm_norm import UlbNormedLinearMethod

QUANT_METHOD = "ulb"


@register_quantization_config(QUANT_METHOD)
class UlbVllmConfig(QuantizationConfig):
    def __init__(self, quant: QuantConfig, modules_to_not_convert: list[str], input_norm_eps: float | None = None):
        super().__init__()
        self.quant = quant
        self.input_norm_eps = input_norm_eps  # the layers' own input RMSNorms (Falcon-E): vllm_norm
        self.head = quant.head_config()  # the lm_head's QuantConfig (lm_head_bits), or None
        self.modules_to_not_convert = modules_to_not_convert

    def get_name(self) -> str:
        return QUANT_METHOD

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        return [torch.float32, torch.bfloat16, torch.float16]

    @classmethod
    def get_min_capability(cls) -> int:
        return -1  # the CPU kernels need none; the Triton kernels run wherever Triton does

    @staticmethod
    def get_config_filenames() -> list[str]:
        return []  # the config lives in config.json's quantization_config

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "UlbVllmConfig":
        skip = config.get("modules_to_not_convert")
        skip = list(LM_HEAD) if skip is None else list(skip)
        quant = QuantConfig(**{name: config.get(name, default) for name, default in SAVED_OPTIONS.items()},
                            exclude=skip)
        return cls(quant, skip, config.get("input_norm_eps"))

    def get_quant_method(self, layer: nn.Module, prefix: str):
        if isinstance(layer, ParallelLMHead):
            if self.head is not None:
                return UlbLinearMethod(self.head)
            return UlbBF16HeadMethod() if self.quant.bf16_gemv else None
        if isinstance(layer, RoutedExperts):
            return self._experts_method(layer, prefix)
        if isinstance(layer, GateLinear):
            return UnquantizedLinearMethod()  # a router: quantize_ keeps routers float (hf_experts.router_names)
        if not isinstance(layer, LinearBase):
            return None
        if self._skipped(prefix):
            return UnquantizedLinearMethod()
        if self.input_norm_eps is not None:
            return UlbNormedLinearMethod(self.quant, self.input_norm_eps)
        return UlbLinearMethod(self.quant)

    def _experts_method(self, layer, prefix: str):
        """UlbMoEMethod for packed experts; None (vLLM's float method) where
        modules_to_not_convert keeps the experts' weights float, as
        transformers' 3-D expert weights <prefix>.gate_up_proj and
        <prefix>.down_proj (quantize_ selects them by these names)."""
        first = "gate_up_proj" if layer.moe_config.is_act_and_mul else "up_proj"
        names = [f"{prefix}.{first}", f"{prefix}.down_proj"]
        kept = [n for n in names if self._matches(n)]
        if kept and len(kept) != len(names):
            raise ValueError(f"ulb: {prefix}: modules_to_not_convert keeps {kept} float but not "
                             f"{sorted(set(names) - set(kept))}: vLLM's fused mixture-of-experts layer holds both "
                             "in one format")
        return None if kept else UlbMoEMethod(self.quant, layer.moe_config)

    def apply_vllm_mapper(self, hf_to_vllm_mapper) -> None:
        """modules_to_not_convert names the checkpoint's layers; vLLM calls
        this with the model's renames of them (LFM2's .conv. is .short_conv.,
        a multimodal model's language layers move under a prefix), as for
        its own AWQ config."""
        self.modules_to_not_convert = hf_to_vllm_mapper.apply_list(self.modules_to_not_convert)

    def _matches(self, name: str) -> bool:
        return any(fnmatch.fnmatchcase(name, p) for p in self.modules_to_not_convert)

    def _skipped(self, prefix: str) -> bool:
        """Whether modules_to_not_convert keeps this layer in bf16. vLLM
        merges q/k/v and gate/up into one layer (qkv_proj, gate_up_proj, as
        the model's packed_modules_mapping says) while the patterns name the
        checkpoint's layers, so a merged layer is matched by its own name or by
        its shards' names, which must then agree: one merged weight has one
        format."""
        if self._matches(prefix):
            return True
        head, _, proj = prefix.rpartition(".")
        shards = [f"{head}.{s}" if head else s for s in self.packed_modules_mapping.get(proj, ())]
        kept = [s for s in shards if self._matches(s)]
        if kept and len(kept) != len(shards):
            raise ValueError(f"{prefix} merges {shards}, of which modules_to_not_convert keeps only {kept} in "
                             "bf16: the layers of one merged matrix must share one format")
        return bool(shards) and len(kept) == len(shards)


class UlbBF16HeadMethod(UnquantizedEmbeddingMethod):
    """vLLM's bf16 lm_head (whose weight it keeps); the logits of one token
    run ulbtorch's bf16 GEMV, batches vLLM's own matmul."""

    def apply(self, layer, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if gemv_serves(x, layer.weight, bias):
            return torch.ops.ulb.linear_bf16(x, layer.weight, bias)
        return super().apply(layer, x, bias)


def register() -> None:
    """Entry point for vllm.general_plugins: importing this module registers
    the method; vLLM may call this more than once."""

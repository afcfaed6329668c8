"""vLLM's method for layers with their own input RMSNorm (UlbConfig's
input_norm_eps: Falcon-E's use_rms_norm, importers.NormedLinearTernary).

vLLM merges q/k/v and gate/up into one layer, but each checkpoint layer has
its own norm weight, so each shard's input is normed differently: such a
merged layer keeps one blob per shard and runs each on its own norm's output
(the norms round as transformers' LlamaRMSNorm: nn.normed.rms_norm).
The norm is over the whole input, which a row-parallel layer split over
ranks does not see: those run at tensor_parallel_size 1 only.
"""
from __future__ import annotations

import types

import torch
from torch import nn

from .. import ops
from ..nn.normed import rms_norm
from .vllm_linear import _SHARD_INDEX, UlbLinearMethod


class UlbNormedLinearMethod(UlbLinearMethod):
    def __init__(self, quant, eps: float):
        super().__init__(quant)
        self.eps = eps

    def create_weights(self, layer, input_size_per_partition, output_partition_sizes, input_size,
                       output_size, params_dtype, **extra_weight_attrs):
        name = getattr(layer, "prefix", type(layer).__name__)
        if input_size_per_partition != input_size:
            raise ValueError(f"ulb: {name} splits its input over tensor-parallel ranks, but its layers' input "
                             "RMSNorms (input_norm_eps) need the whole input: serve this checkpoint with "
                             "tensor_parallel_size=1")
        super().create_weights(layer, input_size_per_partition, output_partition_sizes, input_size, output_size,
                               params_dtype, **extra_weight_attrs)
        norm = nn.Module()  # named rms_norm, so the checkpoint's <layer>.rms_norm.weight finds it
        norm.weight = nn.Parameter(torch.ones(len(output_partition_sizes), input_size, dtype=params_dtype),
                                   requires_grad=False)
        norm.weight.weight_loader = self._norm_loader(layer, name)
        layer.rms_norm = norm
        layer.ulb_norms_loaded = [False] * len(output_partition_sizes)
        layer.ulb_out_sizes = list(output_partition_sizes)

    @staticmethod
    def _norm_loader(layer, name: str):
        def load(param, loaded_weight, shard_id=None):
            shard_id = getattr(loaded_weight, "shard_id", shard_id)
            shard = _SHARD_INDEX.get(shard_id, shard_id or 0)
            if tuple(loaded_weight.shape) != tuple(param.shape[1:]):
                raise ValueError(f"ulb: {name}: checkpoint RMSNorm weight of shard {shard_id!r} has shape "
                                 f"{tuple(loaded_weight.shape)}, the layer's input is {param.shape[1]} wide")
            param.data[shard].copy_(loaded_weight)
            layer.ulb_norms_loaded[shard] = True
        return load

    def process_weights_after_loading(self, layer) -> None:
        name = getattr(layer, "prefix", type(layer).__name__)
        missing = [i for i, ok in enumerate(layer.ulb_norms_loaded) if not ok]
        if missing:
            raise ValueError(f"ulb: {name}: no checkpoint rms_norm.weight for shard(s) {missing}, but the config "
                             "has input_norm_eps")
        sizes = layer.ulb_out_sizes
        if len(sizes) == 1:
            super().process_weights_after_loading(layer)
            return
        assembler = layer.ulb_assembler
        unloaded = [i for i, ok in enumerate(assembler.loaded) if not ok]
        if unloaded:
            raise ValueError(f"{assembler.name}: no checkpoint weight for shard(s) {unloaded}")
        shards = nn.ModuleList()
        for i, rows in enumerate(sizes):
            m0 = sum(sizes[:i])
            shard = nn.Module()
            shard.packed = nn.Parameter(torch.empty(0, dtype=torch.uint8, device=layer.packed.device),
                                        requires_grad=False)
            shard.ulb_out_features = rows
            blob = ops.pack(assembler.codes[m0:m0 + rows], assembler.scales[m0:m0 + rows], assembler.fmt,
                            assembler.group_size)
            shard.ulb_assembler = types.SimpleNamespace(pack=lambda blob=blob: blob)
            super().process_weights_after_loading(shard)  # the CPU blob, or the accelerator's layout
            shards.append(shard)
        layer.ulb_shards = shards
        layer.packed = nn.Parameter(torch.empty(0, dtype=torch.uint8, device=layer.packed.device),
                                    requires_grad=False)
        del layer.ulb_assembler

    def apply(self, layer, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        weights = layer.rms_norm.weight
        if len(weights) == 1:
            return super().apply(layer, rms_norm(x, weights[0], self.eps), bias)
        biases = [None] * len(weights) if bias is None else bias.split(layer.ulb_out_sizes)
        return torch.cat([super(UlbNormedLinearMethod, self).apply(shard, rms_norm(x, w, self.eps), b)
                          for shard, w, b in zip(layer.ulb_shards, weights, biases)], dim=-1)

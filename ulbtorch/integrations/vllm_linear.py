"""vLLM's linear method for ulbtorch's packed layers: the blob assembled from
the checkpoint's shards as vLLM loads them (sharding.py), then the CPU
kernels, or the Triton op on a device Triton serves (kmajor layout). Apart
from vllm.py so that the methods built on it (vllm_norm.py) need not import
the config that chooses them."""
from __future__ import annotations

import torch
from torch import nn
from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
from vllm.model_executor.layers.linear import LinearMethodBase
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

from .. import ops
from .. import triton as accel
from ..formats import get_format
from ..nn.fast_path import ACCEL_DTYPES, KERNEL_DTYPES
from ..quantize import QuantConfig
from .sharding import ShardAssembler, VocabShardAssembler

_SHARD_INDEX = {"q": 0, "k": 1, "v": 2}


class UlbLinearMethod(LinearMethodBase):
    def __init__(self, quant: QuantConfig):
        self.quant = quant

    def create_weights(self, layer, input_size_per_partition, output_partition_sizes, input_size,
                       output_size, params_dtype, **extra_weight_attrs):
        group_size = self.quant.layer_args(input_size)["group_size"]
        name = getattr(layer, "prefix", type(layer).__name__)
        if isinstance(layer, ParallelLMHead):
            if layer.num_added_embeddings:
                raise ValueError(f"ulb: {name} has {layer.num_added_embeddings} added (LoRA) vocabulary rows, "
                                 "which a quantized lm_head checkpoint does not hold")
            shard = layer.shard_indices
            layer.ulb_assembler = VocabShardAssembler(
                name, layer.num_embeddings_per_partition, input_size, self.quant.format, group_size,
                layer.org_vocab_size, shard.org_vocab_start_index, shard.org_vocab_end_index)
        else:
            layer.ulb_assembler = ShardAssembler(
                name, output_partition_sizes, input_size_per_partition, input_size, self.quant.format,
                group_size, get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size())
        layer.ulb_out_features = sum(output_partition_sizes)
        packed = nn.Parameter(torch.empty(0, dtype=torch.uint8), requires_grad=False)
        packed.weight_loader = self._weight_loader(layer)
        layer.register_parameter("packed", packed)

    @staticmethod
    def _weight_loader(layer):
        def load(param, loaded_weight, shard_id=None):
            shard_id = getattr(loaded_weight, "shard_id", shard_id)
            layer.ulb_assembler.load(loaded_weight.cpu(), _SHARD_INDEX.get(shard_id, shard_id or 0))
        return load

    def process_weights_after_loading(self, layer) -> None:
        blob = layer.ulb_assembler.pack()
        device = layer.packed.device  # where vLLM built the layer
        fmt = get_format(ops.packed_info(blob)["format"])
        if accel.serves(device) and "kmajor" not in fmt.tiles:
            raise ValueError(f"ulb: {getattr(layer, 'prefix', type(layer).__name__)} is {fmt.name}, which has no "
                             f"accelerator kernels (no kmajor layout) for {device}: serve it on the CPU, or save "
                             "the model as 'ternary' (the same weights at 2 bits)")
        layer.ulb_kmajor = accel.serves(device)
        if layer.ulb_kmajor:
            accel.load()
            info = ops.packed_info(blob)
            layer.ulb_geometry = (get_format(info["format"]).id, info["out_features"], info["in_features"],
                                  info["group_size"] if info["n_groups"] > 1 else 0)
            blob = ops.retile(blob, "kmajor").to(device)
        elif device.type != "cpu":
            raise ValueError(f"ulb: {getattr(layer, 'prefix', type(layer).__name__)} is on {device}, where "
                             "ulbtorch has neither its CPU kernels nor Triton (pip install triton)")
        layer.packed = nn.Parameter(blob, requires_grad=False)
        del layer.ulb_assembler

    def tie_weights(self, layer, embed_tokens):
        raise ValueError(f"ulb: {getattr(layer, 'prefix', 'lm_head')} is quantized (lm_head_bits) but the "
                         "checkpoint's config ties it to the input embedding (tie_word_embeddings), and a packed "
                         "layer has no weight to share; ulbtorch saves a quantized lm_head untied, with the float "
                         "embedding beside it: set tie_word_embeddings to false in config.json if the checkpoint "
                         "holds both")

    def apply(self, layer, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if layer.__dict__.get("ulb_kmajor"):  # set by process_weights_after_loading
            y = torch.ops.ulb.triton_linear(x if x.dtype in ACCEL_DTYPES else x.float(), layer.packed, bias,
                                            *layer.ulb_geometry)
            return y.to(x.dtype)
        if x.dtype in KERNEL_DTYPES:
            return torch.ops.ulb.linear(x, layer.packed, bias, layer.ulb_out_features)
        b = None if bias is None else bias.float()
        return torch.ops.ulb.linear(x.float(), layer.packed, b, layer.ulb_out_features).to(x.dtype)

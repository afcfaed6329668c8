"""Loading checkpoints that are already ultra-low-bit, without re-quantising."""
from ..nn.normed import NormedLinearTernary
from .gguf import load_gguf
from .gguf_export import save_gguf
from .grid import convert_grid_linears, pack_grid_weight
from .hf_bitnet import convert_bitnet_model, load_bitnet_checkpoint, unpack_hf_bitnet

__all__ = ["load_bitnet_checkpoint", "convert_bitnet_model", "unpack_hf_bitnet", "pack_grid_weight",
           "convert_grid_linears", "NormedLinearTernary", "load_gguf", "save_gguf"]

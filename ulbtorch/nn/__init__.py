from .bf16 import LinearBF16, bf16_gemv_
from .linear import (MODULE_FOR_FORMAT, Linear1Bit, Linear2Bit, Linear4Bit, Linear8Bit, LinearTernary,
                     LowBitLinear)
from .replace import replace_module

__all__ = ["LowBitLinear", "Linear1Bit", "Linear2Bit", "Linear4Bit", "Linear8Bit", "LinearTernary", "LinearBF16", "MODULE_FOR_FORMAT",
           "bf16_gemv_", "replace_module"]

from .linear import MODULE_FOR_FORMAT, Linear1Bit, Linear2Bit, LinearTernary, LowBitLinear
from .replace import replace_module

__all__ = ["LowBitLinear", "Linear1Bit", "Linear2Bit", "LinearTernary", "MODULE_FOR_FORMAT", "replace_module"]

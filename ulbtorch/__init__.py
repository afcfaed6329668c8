"""ulbtorch: 1-bit, ternary and 2-bit weights at memory speed on CPUs."""
from . import _registrations, hugepages, ops, reference, runtime  # noqa: F401  (_registrations: on import)
from .formats import FORMATS, get_format
from .integrations.hf_attention import decode_attention_
from .integrations.hf_generate import compile_decode
from .nn import Linear1Bit, Linear2Bit, Linear4Bit, Linear8Bit, LinearBF16, LinearTernary, LowBitLinear, bf16_gemv_
from .quantize import QuantConfig, quantize_
from .serialization import load_quantized, save_quantized

__version__ = "0.1.0"

import importlib.util as _util  # noqa: E402

if _util.find_spec("transformers") is not None:
    from .integrations import lazy_hf as _lazy_hf

    _lazy_hf.install()  # quant_method "ulb", once transformers' quantizers load


def __getattr__(name):
    if name == "UlbConfig":  # imports transformers' quantizers: seconds, so only on use
        from .integrations.transformers import UlbConfig

        return UlbConfig
    if name in ("load_gguf", "save_gguf"):  # the importers load transformers on use
        from . import importers

        return getattr(importers, name)
    raise AttributeError(f"module 'ulbtorch' has no attribute {name!r}")

__all__ = ["hugepages", "ops", "reference", "runtime", "FORMATS", "get_format", "Linear1Bit", "Linear2Bit", "Linear4Bit", "Linear8Bit", "LinearTernary",
           "LowBitLinear", "LinearBF16", "QuantConfig", "quantize_", "bf16_gemv_", "save_quantized",
           "load_quantized", "load_gguf", "save_gguf", "compile_decode", "decode_attention_"]

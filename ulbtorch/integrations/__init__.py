"""Hooks into the libraries users already run: transformers (quantization
method "ulb", registered when transformers loads its quantizers: lazy_hf.py)
and vLLM (plugin entry point)."""

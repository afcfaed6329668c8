"""Hooks into the libraries users already run: transformers (quantization
method "ulb"), registered on import when transformers is installed."""

"""Hooks into the libraries users already run: transformers (quantization
method "ulb", registered when transformers loads its quantizers, and the
config quantize_ records in a transformers model: lazy_hf.py), transformers'
mixture-of-experts modules packed (hf_experts.py, which imports no
transformers, so quantize_ and load_quantized use it directly), faster
decode through transformers' generate (hf_generate.py: a static cache and
a compiled step; hf_attention.py: one-token attention) and vLLM (plugin
entry point)."""

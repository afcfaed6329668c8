"""Greedy decode in transformers with a static KV cache and a compiled step,
on the CPU as transformers does it on GPUs:

    ulbtorch.compile_decode(model)      # once, after quantize_ or from_pretrained
    model.generate(ids, max_new_tokens=64)

In eager mode each decode step runs a few hundred PyTorch ops from Python
besides the layers' kernel calls: norms, rotary embedding, attention over a
growing cache, residual adds. Their time does not shrink as the weights
shrink, and at one token it is a real share of a step. A static cache makes
the step's shapes the same every token, so transformers' generate compiles
the step once (torch.compile, fullgraph) and runs that graph for every token
after the prompt: inductor fuses the elementwise work into a few C++ loops
and calls ulbtorch's op for each layer. The prompt itself runs eager (its
length changes from call to call).

What changes for the caller: the first generate call compiles (tens of
seconds), and so does a call whose prompt plus new tokens is longer than
any before (transformers keeps the cache at the longest length seen). The
cache holds max_length positions from the start, and attention reads all of
them every step (masked).

frozen=True promises that the model's modules stay as they are, and drops
the checks torch.compile would make on them before every step (their
attributes and tensors: a thousand or more guards for a 1B model); the
checks on the step's inputs, the KV cache among them, stay, so a longer
cache still compiles anew. Compiled steps are kept per code object, and
every model of a class runs the same forward code: without checks on the
modules one model could take the step compiled for another, so a frozen
model's steps are kept apart (torch.compile's isolate_recompiles)."""
from __future__ import annotations

import torch
from torch import nn

from .hf_attention import decode_attention_


def compile_decode(model: nn.Module, *, attention: bool = True, frozen: bool = False, mode: str | None = None,
                   options: dict | None = None) -> nn.Module:
    """Make `model.generate` use a static KV cache and a compiled decode step
    (transformers' CompileConfig, asked to compile on the CPU too), and with
    attention=True (default) ulbtorch's decode attention
    (hf_attention.decode_attention_): compiled, torch's sdpa keeps its
    flash kernel's cost per call, which is then most of what is left.
    frozen=True: skip the per-step checks on the model's own modules and
    tensors; change none of them afterwards (weights, layers, attention),
    or the step compiled for the old model runs on it unchecked; to change
    the model, call torch._dynamo.reset() and compile_decode again. mode
    or options (one of them, as torch.compile takes) go to torch.compile.
    Returns the model; undo with
    `model.generation_config.cache_implementation = None`,
    `compile_config = None` and `model.set_attn_implementation("sdpa")`."""
    from transformers import CompileConfig

    gen = getattr(model, "generation_config", None)
    if gen is None or not hasattr(model, "generate"):
        raise TypeError(f"compile_decode takes a transformers model with generate(), got {type(model).__name__}")
    if attention:
        decode_attention_(model)
    if frozen:
        if mode is not None:
            raise ValueError("compile_decode: frozen=True passes options to torch.compile, which then takes no mode; "
                             "give the mode's settings as options")
        options = {**(options or {}), "guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe}
    config = CompileConfig(fullgraph=True, dynamic=False, mode=mode, options=options)
    # transformers compiles the step only on accelerators unless asked; this
    # private flag is how its own CPU tests ask (transformers 5.x).
    config._compile_all_devices = True
    if frozen:
        # CompileConfig passes its instance attributes on to torch.compile:
        # this model's compiled steps then stand apart from every other's.
        config.isolate_recompiles = True
    gen.cache_implementation = "static"
    gen.compile_config = config
    return model

"""Registers quant_method "ulb" with transformers without importing it.

Importing transformers' quantizer registry takes seconds, so `import ulbtorch`
does not do it. The method is registered when transformers.quantizers itself
is imported (by from_pretrained, or by anyone), through a one-shot import
hook; if it is already imported, at once. install() also has quantize_ and
the importers record a UlbConfig in the transformers models they convert
(record_for_transformers), importing integrations.transformers only then.
"""
from __future__ import annotations

import importlib.abc
import sys

from torch import nn

from ..quantize import QuantConfig, register_conversion_hook

_TARGET = "transformers.quantizers"


def record_for_transformers(model: nn.Module, config: QuantConfig) -> None:
    """For a transformers model: record in model.config the UlbConfig that
    makes save_pretrained write a checkpoint from_pretrained loads packed
    (integrations.transformers.record_quant_config)."""
    # A whole model (base or head), not a submodule that holds the model's
    # config (transformers' experts modules do): that config is the model's.
    if type(getattr(model, "config", None)).__module__.startswith("transformers.") and hasattr(model, "base_model"):
        from .transformers import record_quant_config
        record_quant_config(model, config)


def _register() -> None:
    from . import transformers  # noqa: F401  (the decorators register "ulb")


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds _TARGET with the other finders and runs _register once the
    module has executed."""

    def find_spec(self, fullname, path, target=None):
        if fullname != _TARGET:
            return None
        sys.meta_path.remove(self)
        spec = None
        for finder in list(sys.meta_path):
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if find else None
            if spec is not None:
                break
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_register(module):
            exec_module(module)
            _register()

        spec.loader.exec_module = exec_then_register
        return spec


def install() -> None:
    register_conversion_hook(record_for_transformers)
    if _TARGET in sys.modules:
        _register()
    elif not any(isinstance(f, _AfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport())

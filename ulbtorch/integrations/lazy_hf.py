"""Registers quant_method "ulb" with transformers without importing it.

Importing transformers' quantizer registry costs seconds, so `import ulbtorch`
does not do it. The method is registered when transformers.quantizers itself
is imported (by from_pretrained, or by anyone), through a one-shot import
hook; if it is already imported, at once.
"""
from __future__ import annotations

import importlib.abc
import sys

_TARGET = "transformers.quantizers"


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
    if _TARGET in sys.modules:
        _register()
    elif not any(isinstance(f, _AfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport())

"""Swapping a submodule of a model by its dotted name, and choosing them."""
import fnmatch

from torch import nn


def name_selected(name: str, include: list[str], exclude: list[str]) -> bool:
    """Whether a dotted module name matches an include pattern and no exclude
    pattern (fnmatch, case-sensitive): exclude wins."""
    match = lambda pats: any(fnmatch.fnmatchcase(name, p) for p in pats)  # noqa: E731
    return match(include) and not match(exclude)


def replace_module(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, new)

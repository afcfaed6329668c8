"""Swapping a submodule of a model by its dotted name, and choosing them."""
import fnmatch

from torch import nn


def patterns(value, what: str) -> list[str]:
    """include / exclude as a list of fnmatch patterns; one string is one
    pattern (iterating it would match every name against its characters)."""
    if isinstance(value, str):
        return [value]
    try:
        out = list(value)
    except TypeError:
        raise TypeError(f"{what} must be a list of fnmatch patterns, got {type(value).__name__}") from None
    if not all(isinstance(p, str) for p in out):
        raise TypeError(f"{what} must be a list of fnmatch patterns (strings), got {out!r}")
    return out


def name_selected(name: str, include: list[str], exclude: list[str]) -> bool:
    """Whether a dotted module name matches an include pattern and no exclude
    pattern (fnmatch, case-sensitive): exclude wins."""
    match = lambda pats: any(fnmatch.fnmatchcase(name, p) for p in pats)  # noqa: E731
    return match(include) and not match(exclude)


def replace_module(model: nn.Module, name: str, new: nn.Module) -> None:
    if not name:  # setattr(model, "", new) would add a child named "" and keep the layer
        raise ValueError(f"cannot swap the model itself ({type(model).__name__}) in place: put the layer in a "
                         f"container (nn.Sequential(layer)), or build the replacement directly "
                         f"({type(new).__name__}.from_linear(layer))")
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, new)

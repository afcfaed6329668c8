"""Swapping a submodule of a model by its dotted name, and choosing them."""
import fnmatch
from collections import defaultdict

from torch import nn


# nn.Linear subclasses whose forward is F.linear's arithmetic, converted as
# nn.Linear is. (Others may compute something else from the weight, or never
# be called: nn.MultiheadAttention reads its out_proj's weight directly.)
SAME_AS_LINEAR = frozenset({
    "transformers.models.falcon.modeling_falcon.FalconLinear",  # input @ W.T, then + bias
})


def is_plain_linear(m: nn.Module) -> bool:
    """nn.Linear itself, or a subclass in SAME_AS_LINEAR."""
    t = type(m)
    return t is nn.Linear or (issubclass(t, nn.Linear) and f"{t.__module__}.{t.__qualname__}" in SAME_AS_LINEAR)


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


def module_names(model: nn.Module) -> dict[int, list[str]]:
    """Every dotted name of each submodule, by id: a module registered twice
    (the same layer used at two places) has two, and named_modules() gives
    only the first."""
    names = defaultdict(list)
    for name, m in model.named_modules(remove_duplicate=False):
        names[id(m)].append(name)
    return names


def replace_everywhere(model: nn.Module, names: dict[int, list[str]], old: nn.Module, new: nn.Module) -> None:
    """replace_module at every name of `old` (names: module_names(model)),
    so that a layer used twice keeps computing one way."""
    for name in names[id(old)]:
        replace_module(model, name, new)

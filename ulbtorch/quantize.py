"""One call to turn the nn.Linear layers of a model into low-bit layers."""
from __future__ import annotations

import glob
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields, replace

from torch import nn

from .finish import finish_conversion
from .formats import FORMAT_FOR_BITS, FORMATS, bits_value, describe_bits
from .integrations.hf_experts import expert_linears, fused_weight_names, is_fused_experts, pack_experts, router_names
from .nn import MODULE_FOR_FORMAT, LinearBF16, LowBitLinear
from .nn.replace import is_plain_linear, module_names, name_selected, patterns, replace_everywhere
from .quantizers import GRANULARITIES, METHODS
from .runtime import _check_bool

# Each `bits` value, as a number and as a string (1 and "1"), and its format.
_BITS_TO_FORMAT = {spelling: name for bits, name in FORMAT_FOR_BITS.items() for spelling in (bits, str(bits))}
_FORMAT_TO_BITS = {f.name: bits_value(f.bits_name) for f in FORMATS.values()}
LM_HEAD = ["lm_head", "*.lm_head"]


def _format_for_bits(bits) -> str:
    if isinstance(bits, bool) or bits not in _BITS_TO_FORMAT:
        raise ValueError(f"bits must be {describe_bits(FORMAT_FOR_BITS)}, got {bits!r}")
    return _BITS_TO_FORMAT[bits]


def linear_layers(model: nn.Module, selects) -> list[tuple[str, nn.Linear]]:
    """The plain nn.Linear layers (nn.replace.is_plain_linear, and LinearBF16,
    a plain one on the bf16 GEMV) whose names `selects`; other subclasses of
    nn.Linear are left alone."""
    return [(n, m) for n, m in model.named_modules()
            if (is_plain_linear(m) or type(m) is LinearBF16) and selects(n)]


@dataclass
class QuantConfig:
    """What quantize_ does.

    bits: 1, "ternary" (or 1.58), 2, 4 or 8 (default 2 unless format is
    given). format: a format name ("int2_sym", "int2", "ternary", "binary",
    "int4", "int8"); with bits too, the two must agree (2: either int2 map).
    group_size: 0 for one scale per output channel, else a multiple of 16
    (2-bit, ternary), 32 (binary), 8 (int4) or 4 (int8); layers no wider than
    a group get one scale per channel.
    granularity: "channel", "group" or "tensor" (default from group_size).
    method: "absmax", "absmean" or "mse" (default per format, see quantizers).
    include / exclude: fnmatch patterns on module names; exclude wins.
    lm_head_bits (default None: lm_head stays bf16): quantize the lm_head
    layers that include/exclude leave out to these bits with the format's
    default scale rule; 8 (int8, absmax) halves the bytes of the largest
    matrix a small model reads per token, 4 (int4) quarters them at a larger
    cost in accuracy (see README). lm_head_group_size (default 0: one scale
    per output channel) sets their group size, e.g. 32 for int4.
    bf16_gemv (default True): also swap the nn.Linear layers left in bf16
    (lm_head by default) for nn.LinearBF16, whose one-token forward runs
    ulbtorch's bf16 GEMV: same weights, fp32 accumulation in another order
    than F.linear. False leaves them stock nn.Linear.
    """
    bits: int | float | str | None = None
    format: str | None = None
    group_size: int = 0
    granularity: str | None = None
    method: str | None = None
    include: list[str] = field(default_factory=lambda: ["*"])
    exclude: list[str] = field(default_factory=lambda: list(LM_HEAD))
    bf16_gemv: bool = True
    lm_head_bits: int | float | str | None = None
    lm_head_group_size: int = 0

    def __post_init__(self):
        self.include, self.exclude = patterns(self.include, "include"), patterns(self.exclude, "exclude")
        _check_bool(self.bf16_gemv, "bf16_gemv")
        if self.format is not None and not isinstance(self.format, str):
            raise TypeError(f"format must be a format name such as 'int2_sym', got {self.format!r}")
        for name in ("group_size", "lm_head_group_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int, got {value!r}")
            if value < 0:
                raise ValueError(f"{name} must be 0 (one scale per output channel) or positive, got {value}")
        if self.format is None:
            self.bits = 2 if self.bits is None else self.bits
            self.format = _format_for_bits(self.bits)
        if self.format not in FORMATS:
            raise ValueError(f"unknown format {self.format!r}; known: {sorted(FORMATS)}")
        if self.bits is None:
            self.bits = _FORMAT_TO_BITS[self.format]
        elif _FORMAT_TO_BITS[_format_for_bits(self.bits)] != _FORMAT_TO_BITS[self.format]:
            # bits names a level set: 2 agrees with both 2-bit maps
            raise ValueError(f"bits={self.bits!r} and format={self.format!r} disagree; give one of them")
        if self.lm_head_group_size and self.lm_head_bits is None:
            raise ValueError(f"lm_head_group_size={self.lm_head_group_size} needs lm_head_bits")
        if self.lm_head_bits is not None:
            try:
                self.head_config()
            except ValueError as e:
                raise ValueError(f"lm_head_bits={self.lm_head_bits!r}, lm_head_group_size={self.lm_head_group_size}: "
                                 f"{e}") from None
            if self.selects("lm_head"):
                raise ValueError(f"lm_head_bits={self.lm_head_bits!r} is for an lm_head that include/exclude "
                                 f"leave out, but they select it (include={self.include}, exclude={self.exclude})")
        block = FORMATS[self.format].tile_k
        if self.group_size and self.group_size % block:
            raise ValueError(f"group_size must be 0 or a multiple of {block} for {self.format!r}, "
                             f"got {self.group_size}")
        if self.granularity is None:
            self.granularity = "group" if self.group_size else "channel"
        # Checked here, not at the first layer: through UlbConfig that comes
        # after from_pretrained has read every float weight.
        if self.granularity not in GRANULARITIES:
            raise ValueError(f"granularity must be one of {GRANULARITIES}, got {self.granularity!r}")
        if self.granularity != "group" and self.group_size:
            raise ValueError(f"group_size={self.group_size} needs granularity='group' (or None), "
                             f"got {self.granularity!r}")
        if self.method is not None and self.method not in METHODS:
            raise ValueError(f"method must be one of {METHODS} (or None: the format's default), got {self.method!r}")

    def layer_args(self, in_features: int) -> dict:
        """group_size and granularity for one layer: a layer whose input is
        no wider than a group has one scale per output channel."""
        if self.granularity == "group" and self.group_size < in_features:
            return dict(group_size=self.group_size, granularity="group")
        granularity = "channel" if self.granularity == "group" else self.granularity
        return dict(group_size=0, granularity=granularity)

    def selects(self, name: str) -> bool:
        return name_selected(name, self.include, self.exclude)

    def head_config(self) -> "QuantConfig | None":
        """What quantize_ does to the lm_head layers (lm_head_bits), or None."""
        if self.lm_head_bits is None:
            return None
        return QuantConfig(bits=self.lm_head_bits, group_size=self.lm_head_group_size, include=list(LM_HEAD),
                           exclude=[], bf16_gemv=False)

    def head_layers(self, model: nn.Module) -> list[tuple[str, nn.Linear]]:
        """The layers lm_head_bits applies to: those named lm_head, and the
        model's output embedding (get_output_embeddings) if it is a linear layer."""
        head = self.head_config()
        if head is None:
            return []
        out = getattr(model, "get_output_embeddings", lambda: None)()
        found = [(n, m) for n, m in linear_layers(model, lambda n: True) if m is out or head.selects(n)]
        if not found:
            raise ValueError(f"lm_head_bits={self.lm_head_bits!r}: the model has no plain linear layer named "
                             "lm_head and no linear output embedding")
        return found

    def targets(self, model: nn.Module) -> list[tuple[str, nn.Linear, "QuantConfig"]]:
        """Every layer this config converts, with the config that applies to
        it: the selected layers, then the lm_head layers of lm_head_bits."""
        main = [(n, m, self) for n, m in linear_layers(model, self.selects)]
        head = self.head_layers(model)
        clash = sorted({n for n, _, _ in main} & {n for n, _ in head})
        if clash:
            raise ValueError(f"lm_head_bits={self.lm_head_bits!r} but include/exclude already select {clash}")
        head_cfg = self.head_config()
        return main + [(n, m, head_cfg) for n, m in head]

    def expert_targets(self, model: nn.Module) -> list[tuple[str, nn.Module, str]]:
        """(module name, module, weight name) of every selected 3-D expert
        weight of transformers' MoE layers (integrations.hf_experts): selected by the name
        "<module>.<weight>", e.g. model.layers.0.mlp.experts.gate_up_proj."""
        return [(n, m, p) for n, m in model.named_modules() if is_fused_experts(m)
                for p in fused_weight_names(m) if self.selects(f"{n}.{p}" if n else p)]

    def to_dict(self) -> dict:
        return asdict(self)


# The options a saved config records (transformers' UlbConfig, which vLLM's
# plugin reads too) with their defaults: every field of QuantConfig but
# include and exclude, which it records as one list of the layers kept in float.
SAVED_OPTIONS = {f.name: f.default for f in fields(QuantConfig) if f.name not in ("include", "exclude")}


# hook(model, config), run once quantize_ or an importer has converted a
# model's layers under config: the integrations record there what they keep
# about a conversion (integrations.lazy_hf: the UlbConfig a transformers model
# is saved with), so that this module imports none of them.
_CONVERSION_HOOKS: list[Callable[[nn.Module, "QuantConfig"], None]] = []


def register_conversion_hook(hook: Callable[[nn.Module, "QuantConfig"], None]) -> None:
    if hook not in _CONVERSION_HOOKS:
        _CONVERSION_HOOKS.append(hook)


def run_conversion_hooks(model: nn.Module, config: QuantConfig) -> None:
    for hook in _CONVERSION_HOOKS:
        hook(model, config)


def _warn_nothing_converted(model: nn.Module, config: QuantConfig) -> None:
    low = [m for m in model.modules() if isinstance(m, LowBitLinear)]
    if low:
        formats = sorted({f"{m.format} (group size {m.group_size})" for m in low})
        warnings.warn(f"quantize_: no layer converted: the model is quantized already ({len(low)} low-bit layers: "
                      f"{', '.join(formats)}); quantize_ converts float layers only, so to change the format start "
                      "again from the float model", stacklevel=3)
        return
    plain = len(linear_layers(model, lambda n: True))
    warnings.warn(f"quantize_: no layer converted: the model has {plain} plain nn.Linear (or LinearBF16) "
                  f"layers and include={config.include} / exclude={config.exclude} select none of them (layers "
                  "of other types, such as GPT-2's Conv1D or nn.Linear subclasses, are never converted)",
                  stacklevel=3)


def _warn_fused_experts(model: nn.Module, config: QuantConfig) -> None:
    """Mixture-of-experts modules (named or typed "...expert...") that keep
    their experts as 3-D parameters but are not transformers' experts modules
    (integrations.hf_experts) stay in float, often most of the model's bytes: say so."""
    fused = [(f"{n}.{p}" if n else p, t) for n, m in model.named_modules()
             if "expert" in f"{n}.{type(m).__name__}".lower() and not is_fused_experts(m)
             for p, t in m.named_parameters(recurse=False)
             if t.dim() == 3 and t.is_floating_point() and config.selects(f"{n}.{p}" if n else p)]
    if fused:
        nbytes = lambda ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
        share = nbytes(t for _, t in fused) / max(1, nbytes(model.parameters()))
        warnings.warn(f"quantize_: {len(fused)} 3-D expert weights of mixture-of-experts layers stay in float "
                      f"({share:.0%} of the model's parameter bytes), e.g. {fused[0][0]}: ulbtorch packs the experts "
                      "of transformers' experts modules (use_experts_implementation) only", stacklevel=3)


def _warn_linear_subclasses(model: nn.Module, config: QuantConfig) -> None:
    """Subclasses of nn.Linear may compute something else from their weight
    (LoRA, nn.MultiheadAttention's out_proj, which it never calls): they stay
    in float, and a user who selected them is told so."""
    skipped = {}
    for n, m in model.named_modules():
        if isinstance(m, nn.Linear) and not is_plain_linear(m) and type(m) is not LinearBF16 and config.selects(n):
            skipped.setdefault(type(m).__qualname__, []).append(n)
    if skipped:
        listed = "; ".join(f"{t}: {', '.join(ns[:3])}{', ...' if len(ns) > 3 else ''} ({len(ns)})"
                           for t, ns in skipped.items())
        warnings.warn(f"quantize_: layers of nn.Linear subclasses stay in float (only plain nn.Linear is "
                      f"converted): {listed}; exclude them to silence this", stacklevel=3)


def _routers_excluded(model: nn.Module, config: QuantConfig) -> QuantConfig:
    """config with the MoE routers it selects (integrations.hf_experts.router_names) added
    to exclude by name, so that the config recorded for transformers keeps
    them too (with the "*.name" copy it gives every exact name of a base model)."""
    routers = [glob.escape(n) for n in router_names(model) if config.selects(n)]
    return replace(config, exclude=config.exclude + routers) if routers else config


def _convert(name: str, lin: nn.Linear, cfg: QuantConfig, exclude: str | None = None):
    """The low-bit layer of cfg for lin; a ValueError names the layer and
    the exclude pattern that keeps it in float."""
    try:
        return MODULE_FOR_FORMAT[cfg.format].from_linear(lin, format=cfg.format, method=cfg.method,
                                                         **cfg.layer_args(lin.in_features))
    except ValueError as e:
        raise ValueError(f"quantize_: layer {name!r}: {e}; exclude=[..., {exclude or name!r}] keeps it in "
                         "float") from e


def quantize_(model: nn.Module, config: QuantConfig | None = None, *, progress: bool = False,
              hugepages: bool = True, **kwargs) -> nn.Module:
    """Replace, in place, every selected nn.Linear of `model` by the low-bit
    layer of config.format and return the model. kwargs build a QuantConfig
    when none is given: quantize_(model, bits=2, group_size=128).
    hugepages (default True): then move the weights the kernels stream into
    2 MiB pages where Linux has transparent huge pages (ulbtorch.hugepages:
    fewer TLB misses on the weight stream); False leaves them where PyTorch
    allocated them."""
    if config is None:
        config = QuantConfig(**kwargs)
    elif kwargs:
        raise TypeError("pass either a QuantConfig or keyword arguments, not both")
    config = _routers_excluded(model, config)
    targets = config.targets(model)
    experts = config.expert_targets(model)
    if not targets and not experts:
        _warn_nothing_converted(model, config)
        return model  # nor the bf16 lm_head's swap: a call that selects nothing changes nothing
    on_meta = [n for n, lin, _ in targets if lin.weight.is_meta] + [
        f"{n}.{p}" for n, m, p in experts if getattr(m, p).is_meta]
    if on_meta:
        raise ValueError(f"quantize_: {len(on_meta)} of the {len(targets) + len(experts)} selected weights are on the "
                         f"meta device (no values), e.g. {on_meta[0]!r}: load the float weights first "
                         "(from_pretrained, or to_empty() and load_state_dict)")
    _warn_linear_subclasses(model, config)
    _warn_fused_experts(model, config)
    names = module_names(model)
    float_bytes = sum(t.numel() * t.element_size() for t in [lin.weight for _, lin, _ in targets] + [
        getattr(m, p) for _, m, p in experts])
    if progress:
        try:
            from tqdm.auto import tqdm
            targets = tqdm(targets, desc=f"quantize_ {config.format}", unit="layer")
        except ImportError:
            pass
    # Every layer built before any is swapped: a layer that cannot be packed
    # leaves the model as it was.
    built = [(lin, _convert(name, lin, cfg)) for name, lin, cfg in targets]
    built_experts = {}  # experts module -> {weight name: a layer per expert}
    for n, m, p in experts:
        prefix = f"{n}.{p}" if n else p
        built_experts.setdefault(m, {})[p] = [_convert(f"{prefix}.{e}", lin, config, exclude=prefix)
                                              for e, lin in enumerate(expert_linears(m, p))]
    for lin, layer in built:
        replace_everywhere(model, names, lin, layer)
    for m, layers in built_experts.items():
        pack_experts(m, layers)
    packed_bytes = sum(layer.packed.numel() for _, layer in built) + sum(
        layer.packed.numel() for layers in built_experts.values() for per in layers.values() for layer in per)
    placed = finish_conversion(model, bf16_gemv=config.bf16_gemv, hugepages=hugepages)
    run_conversion_hooks(model, config)
    if progress:
        print(f"quantize_: {len(targets)} layers, {sum(map(len, built_experts.values()))} expert weights "
              f"to {config.format}: weights {float_bytes / 2**20:.1f} MiB -> "
              f"{packed_bytes / 2**20:.1f} MiB ({(float_bytes - packed_bytes) / 2**20:.1f} MiB saved)")
        if placed is not None:
            print(f"quantize_: {placed}")
    return model

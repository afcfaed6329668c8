"""transformers quantization method "ulb".

    AutoModelForCausalLM.from_pretrained(float_dir, quantization_config=UlbConfig(bits=2, group_size=128))
quantises the float checkpoint as it loads;
    model.save_pretrained(out); AutoModelForCausalLM.from_pretrained(out)
writes and reads back the packed weights bit for bit, without re-quantising:
before the weights load, the selected nn.Linear layers become empty low-bit
layers whose `packed` buffers the checkpoint fills like any other tensor.
"""
from __future__ import annotations

import warnings

from transformers.quantizers import HfQuantizer, register_quantization_config, register_quantizer
from transformers.utils.quantization_config import QuantizationConfigMixin

from ..finish import finish_conversion
from ..nn.normed import NormedLinearTernary, check_eps, input_norm_eps
from ..nn import MODULE_FOR_FORMAT, LinearBF16, LinearTernary, LowBitLinear, replace_module
from ..nn.replace import is_plain_linear, name_selected, patterns
from ..quantize import LM_HEAD, SAVED_OPTIONS, QuantConfig, linear_layers, quantize_
from ..runtime import _check_bool
from .hf_experts import expert_shape, fused_weight_names, is_fused_experts, pack_experts, parse_expert_layer_name

QUANT_METHOD = "ulb"


@register_quantization_config(QUANT_METHOD)
class UlbConfig(QuantizationConfigMixin):
    """bits: 1, "ternary", 2, 4 or 8 (or format: "int2_sym" | "int2" | "ternary" |
    "binary" | "int4" | "int8"); group_size 0 = per output channel; modules_to_not_convert:
    fnmatch patterns kept in float (default lm_head); bf16_gemv (default
    True): run the layers kept in bf16 through nn.LinearBF16; lm_head_bits
    (default None): quantize lm_head too, e.g. 8 for int8, with
    lm_head_group_size (see QuantConfig). Its attributes, and so the saved
    config, are QuantConfig's SAVED_OPTIONS as QuantConfig fills them in, after
    quant_method and modules_to_not_convert (QuantConfig's exclude).
    input_norm_eps (default None, then absent from the saved config): the
    converted layers each hold an RMSNorm of their input with this eps,
    `<layer>.rms_norm.weight` in the checkpoint (BitNet's use_rms_norm, as
    Falcon-E has it: importers.NormedLinearTernary, ternary only). It
    describes a packed checkpoint; a float one has no such norms to load."""

    def __init__(self, modules_to_not_convert=None, input_norm_eps=None, **options):
        quant_method = options.pop("quant_method", QUANT_METHOD)
        if quant_method != QUANT_METHOD:
            raise ValueError(f"UlbConfig reads quant_method {QUANT_METHOD!r}, got {quant_method!r}")
        unknown = sorted(set(options) - set(SAVED_OPTIONS))
        if unknown:
            raise ValueError(f"UlbConfig: unknown options {unknown}")
        self.quant_method = QUANT_METHOD
        # [] converts every layer, as in transformers' other quantizers; None is the default.
        if modules_to_not_convert is None:
            modules_to_not_convert = list(LM_HEAD)
        self.modules_to_not_convert = patterns(modules_to_not_convert,
                                               "modules_to_not_convert")
        _check_bool(options.get("bf16_gemv", SAVED_OPTIONS["bf16_gemv"]), "UlbConfig's bf16_gemv")
        q = QuantConfig(**options, exclude=self.modules_to_not_convert)
        for name in SAVED_OPTIONS:
            setattr(self, name, getattr(q, name))
        if input_norm_eps is not None:
            input_norm_eps = check_eps(input_norm_eps, "UlbConfig's input_norm_eps")
            if MODULE_FOR_FORMAT[q.format] is not LinearTernary:
                raise ValueError(f"UlbConfig: input_norm_eps is for ternary layers (BitNet's use_rms_norm), but "
                                 f"the format is {q.format!r}")
        self.input_norm_eps = input_norm_eps

    @classmethod
    def from_dict(cls, config_dict, return_unused_kwargs=False, **kwargs):
        # The mixin's from_dict and update set matching kwargs as attributes,
        # past __init__'s checks; these build a checked config instead.
        config = cls(**config_dict)
        unused = config.update(**kwargs)
        return (config, unused) if return_unused_kwargs else config

    def update(self, **kwargs) -> dict:
        options = self.to_dict()
        known = {k: v for k, v in kwargs.items() if k in options}
        if "group_size" in known and "granularity" not in known and options["granularity"] != "tensor":
            options["granularity"] = None  # was derived from the old group_size
        if known:
            self.__dict__.update(type(self)(**{**options, **known}).__dict__)
        return {k: v for k, v in kwargs.items() if k not in known}

    def to_dict(self) -> dict:
        d = super().to_dict()
        if not d.get("lm_head_group_size"):
            # Absent means 0, and an older ulbtorch reads such a config.
            d.pop("lm_head_group_size", None)
        if d.get("input_norm_eps") is None:
            # Absent means no norms; an older ulbtorch refuses the option rather than drop the norms.
            d.pop("input_norm_eps", None)
        return d

    def to_quant_config(self) -> QuantConfig:
        return QuantConfig(**{name: getattr(self, name) for name in SAVED_OPTIONS},
                           exclude=self.modules_to_not_convert)


def record_quant_config(model, config: QuantConfig) -> None:
    """After quantize_: set model.config.quantization_config to a UlbConfig
    that describes every linear layer of the model, so that transformers'
    save_pretrained writes a checkpoint that from_pretrained loads packed
    (without it, from_pretrained builds nn.Linear layers and leaves their
    weights random). Include patterns become the exact names of the layers
    they leave out (for a base model such as model.model, also as "*.name",
    which its head model's names match). A second quantize_ that converts nothing keeps the config
    of the first; one that leaves the model in formats no single UlbConfig
    says (two main formats) drops a ulb config and warns: such a model is
    saved with ulbtorch.save_quantized. Another quantization method's config
    is left alone. A quantized lm_head tied to the input embedding is untied
    first (_untie_packed_head)."""
    previous = getattr(model.config, "quantization_config", None)
    if previous is not None and getattr(previous, "quant_method", None) != QUANT_METHOD:
        return
    if not any(isinstance(m, LowBitLinear) for m in model.modules()):
        return  # nothing quantized (include patterns that selected nothing): nothing to say
    _untie_packed_head(model)
    candidate = _config_for(model, config)
    if _describes(model, candidate):
        model.config.quantization_config = candidate
        return
    if previous is not None and _describes(model, previous):
        return
    if previous is not None:
        del model.config.quantization_config
    warnings.warn("quantize_: no UlbConfig describes this model's layers (" +
                  "layers of more than one format or group size, or with and without input norms" +
                  "), so model.config records none and transformers' save_pretrained would write a checkpoint "
                  "that loads unquantized; save it with ulbtorch.save_quantized",
                  stacklevel=5)  # the call of quantize_ or the importer, through run_conversion_hooks


def _untie_packed_head(model) -> None:
    """A quantized lm_head tied to the input embedding (tie_word_embeddings)
    holds a packed weight of its own beside the float embedding: the model is
    no longer tied, and its config says so, so that save_pretrained writes
    both (the packed lm_head and the float embedding) and from_pretrained and
    vLLM load them untied."""
    out = getattr(model, "get_output_embeddings", lambda: None)()
    if not isinstance(out, LowBitLinear):
        return
    for cfg in {id(c): c for c in (model.config, model.config.get_text_config())}.values():
        if getattr(cfg, "tie_word_embeddings", False):
            cfg.tie_word_embeddings = False
    if hasattr(model, "all_tied_weights_keys"):  # what transformers ties at save and load
        model.all_tied_weights_keys = model.get_expanded_tied_weights_keys(all_submodels=True)


def _config_for(model, config: QuantConfig) -> "UlbConfig":
    """config as a UlbConfig (its include patterns turned into the names of
    the float layers they leave out)."""
    out = getattr(model, "get_output_embeddings", lambda: None)()
    exclude = list(config.exclude)
    # A base model (LlamaModel) may be the `model` of a head model that shares
    # its config and saves it with a prefix: its exact names are recorded also
    # as "*.name", and the head model's lm_head, which it cannot see, as float.
    inner = getattr(model, "base_model", None) is model
    if inner:
        # names relative to the base model, matched in the head model's too
        exclude += [f"*.{p}" for p in config.exclude if not p.startswith("*") and f"*.{p}" not in exclude]
        exclude += [p for p in LM_HEAD if p not in exclude]
    if config.include != ["*"]:
        head = config.head_config()
        left = linear_layers(model, lambda n: not config.selects(n)
                             and not name_selected(n, config.exclude, []))  # not named by a pattern already
        left = [n for n, m in left if not (head is not None and (m is out or head.selects(n)))]
        left += [w for n, m in model.named_modules() if is_fused_experts(m)  # expert weights left in float
                 for w in (f"{n}.{p}" for p in fused_weight_names(m))
                 if not config.selects(w) and not name_selected(w, config.exclude, [])]
        for n in sorted(left):
            exclude += [n, f"*.{n}"] if inner else [n]
    # the eps of the layers' input norms (NormedLinearTernary), if any: _describes checks they all agree
    eps = next((e for e in map(input_norm_eps, model.modules()) if e is not None), None)
    return UlbConfig(modules_to_not_convert=exclude, input_norm_eps=eps,
                     **{name: getattr(config, name) for name in SAVED_OPTIONS})


def _describes(model, ulb: UlbConfig) -> bool:
    """Whether loading a float model of this architecture under `ulb`
    gives every linear layer the format, group size and input norm it has
    now (plain nn.Linear and LinearBF16 alike are float)."""
    config = ulb.to_quant_config()
    head_cfg = config.head_config()
    out = getattr(model, "get_output_embeddings", lambda: None)()
    for name, m in model.named_modules():
        if is_plain_linear(m) or type(m) is LinearBF16:
            have = None
        elif isinstance(m, LowBitLinear):
            have = (m.format, m.group_size, input_norm_eps(m))
        elif is_fused_experts(m):  # float experts: a config that packs them does not describe them
            if any(config.selects(f"{name}.{p}") for p in fused_weight_names(m)):
                return False
            continue
        else:
            continue
        expert = parse_expert_layer_name(name)
        if expert is not None:  # selected by its weight's name, as quantize_ selects it
            name = f"{expert[0]}.{expert[1]}"
        if config.selects(name):
            want, eps = config, ulb.input_norm_eps
        elif head_cfg is not None and (m is out or head_cfg.selects(name)):
            want, eps = head_cfg, None
        else:
            want = None
        if (None if want is None else (want.format, want.layer_args(m.in_features)["group_size"], eps)) != have:
            return False
    return True


def _check_untied_output(model, targets) -> None:
    """transformers ties lm_head.weight to the input embedding when the
    config says so, at load; a packed lm_head has no such weight (quantizing
    while loading, quantize_ unties it: _untie_packed_head)."""
    if not getattr(getattr(model, "config", None), "tie_word_embeddings", False):
        return
    out = model.get_output_embeddings()
    for name, m, _ in targets:
        if m is out:
            raise ValueError(f"ulb: the checkpoint's {name!r} is packed but its config ties it to the input "
                             "embedding (tie_word_embeddings), and a packed layer has no weight to share; ulbtorch "
                             "saves a quantized lm_head untied, with the float embedding beside it: set "
                             "tie_word_embeddings to false in config.json if the checkpoint holds both")


def _empty_layer(config: QuantConfig, in_features: int, out_features: int, bias: bool, like,
                 norm_eps: float | None = None) -> LowBitLinear:
    """The low-bit layer config makes of a float weight like `like`, unpacked;
    with norm_eps, behind an input RMSNorm (NormedLinearTernary)."""
    cls, extra = (MODULE_FOR_FORMAT[config.format], {}) if norm_eps is None else (NormedLinearTernary,
                                                                                   dict(eps=norm_eps))
    return cls(in_features, out_features, bias, format=config.format, device=like.device, dtype=like.dtype,
               **config.layer_args(in_features), **extra)


@register_quantizer(QUANT_METHOD)
class UlbHfQuantizer(HfQuantizer):
    requires_calibration = False

    def _process_model_before_weight_loading(self, model, **kwargs):
        config = self.quantization_config.to_quant_config()
        norm_eps = self.quantization_config.input_norm_eps
        targets = config.targets(model)
        if self.pre_quantized:
            _check_untied_output(model, targets)
        if not self.pre_quantized:
            if norm_eps is not None:
                raise ValueError(f"ulb: input_norm_eps={norm_eps} describes a packed checkpoint whose layers hold "
                                 "their input RMSNorms (BitNet's use_rms_norm); a float checkpoint has none to load")
            return model
        expert_targets = config.expert_targets(model)
        if norm_eps is not None and expert_targets:
            raise ValueError(f"ulb: input_norm_eps is for dense layers; {expert_targets[0][0]} is a "
                             "mixture-of-experts module")
        for name, lin, c in targets:
            replace_module(model, name, _empty_layer(c, lin.in_features, lin.out_features, lin.bias is not None,
                                                     lin.weight, norm_eps if c is config else None))
        for _, m, p in expert_targets:
            n_experts, in_f, out_f, bias = expert_shape(m, p)
            like = m._parameters[p]
            pack_experts(m, {p: [_empty_layer(config, in_f, out_f, bias, like) for _ in range(n_experts)]})
        return model

    def _process_model_after_weight_loading(self, model, **kwargs):
        if not self.pre_quantized:
            quantize_(model, self.quantization_config.to_quant_config())
            return model
        for name, m in model.named_modules():
            why = isinstance(m, LowBitLinear) and m.packed_mismatch()
            if why:
                raise ValueError(f"{name}: the checkpoint disagrees with its quantization_config: {why}")
        finish_conversion(model, bf16_gemv=self.quantization_config.bf16_gemv, hugepages=True)
        return model

    def is_serializable(self, **kwargs):
        return True

    @property
    def is_trainable(self) -> bool:
        return False

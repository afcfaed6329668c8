"""Linear layers with packed 1-bit, ternary, 2-bit, 4-bit and 8-bit weights.

Where a layer's weight runs is its `backend`: on the CPU one call of
torch.ops.ulb.linear (int8 activations per token, packed weights streamed by
the C kernels); on an accelerator Triton compiles for (CUDA, ROCm, Intel XPU)
torch.ops.ulb.triton_linear, the same arithmetic on the blob kept packed in
the accelerator layout (ulbtorch/triton/); on any other device (MPS, or no
triton installed) plain PyTorch from a dequantised copy of the weight,
cached for the device last used.
"""
from __future__ import annotations


import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake

from .. import ops, runtime
from .. import triton as accel
from ..formats import FORMATS, get_format, int_arg, module_formats, n_groups, normalize_group_size
from ..quantizers import GRANULARITIES, quantize_weight
from .fast_path import accel_serves, kernel_serves, records_grad, tangents_possible


_ulb_linear = torch.ops.ulb.linear.default
# torch.compile traces __call__: it must not meet the C call (a graph break).
_is_dynamo_compiling = torch.compiler.is_dynamo_compiling


class _KernelLinear(torch.autograd.Function):
    """ulb.linear with a backward, for when autograd records: the gradient
    goes straight through the int8 rounding of the activations (as in
    BitNet's training), dx = dy W with W the dequantised weight."""

    generate_vmap_rule = True  # torch.func.vmap over it (per-sample grads)

    # forward without ctx, and setup_context: the form torch.func's
    # transforms (grad, jacrev) accept.
    @staticmethod
    def forward(x, bias, layer):
        return _call_kernel(layer, x, bias)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, bias, layer = inputs
        ctx.layer, ctx.x_dtype = layer, x.dtype
        ctx.bias_dtype = None if bias is None else bias.dtype
        # The weight of this forward, as autograd saves nn.Linear's: a blob
        # put in its place later does not change this gradient, and one
        # changed in place (load_state_dict) is an error, as there.
        ctx.packed = layer._buffers["packed"]
        compiling = torch.compiler.is_compiling()
        if not compiling and ctx.packed.is_inference():  # as nn.Linear refuses a weight made in inference mode
            raise RuntimeError(f"{type(layer).__name__}: its packed weight was made in inference mode "
                               "(torch.inference_mode), so no gradient can flow through it; build the layer "
                               "outside inference mode to train through it")
        ctx.packed_version = None if compiling else ctx.packed._version

    @staticmethod
    def backward(ctx, gy):
        layer, packed = ctx.layer, ctx.packed
        if ctx.packed_version is not None and packed._version != ctx.packed_version:
            raise RuntimeError(f"one of the variables needed for gradient computation has been modified by an "
                               f"inplace operation: the packed weight of a {type(layer).__name__} (version "
                               f"{packed._version}, {ctx.packed_version} at the forward pass)")
        # Dequantised afresh each time: caching fp32 weights would hold 16x the
        # packed bytes of every layer for as long as training runs. (A graph
        # compiled from the layer reads its buffer as of the forward pass.)
        if ctx.packed_version is None or layer._buffers["packed"] is packed:
            w = layer.dequantize()
        else:  # a blob put in the layer's place since
            w = ops.dequantize_packed(packed, layer.out_features, layer.in_features)
        w = w.to(gy.device)
        gx = (gy.float() @ w).to(ctx.x_dtype) if ctx.needs_input_grad[0] else None
        gb = gy.reshape(-1, gy.shape[-1]).float().sum(0).to(ctx.bias_dtype) if ctx.needs_input_grad[1] else None
        return gx, gb, None


def _call_kernel(layer, x, bias):
    if layer._kmajor:
        return torch.ops.ulb.triton_linear(x, layer._buffers["packed"], bias, get_format(layer.format).id,
                                           layer.out_features, layer.in_features, layer.group_size)
    try:
        return _ulb_linear(x, layer._buffers["packed"], bias, layer.out_features)
    except RuntimeError:
        layer._require_packed()  # a layer never packed: say so rather than "bad header"
        raise


class _KernelLinearTangent(_KernelLinear):
    """_KernelLinear with forward-mode AD: the tangent goes straight through
    the rounding too, dy = dx W^T + db. Apart, as Dynamo traces no Function
    with a jvp."""

    @staticmethod
    def jvp(ctx, x_t, bias_t, _):
        y_t = (torch.zeros((), dtype=torch.float32) if x_t is None
               else x_t.float() @ ctx.layer.dequantize().to(x_t.device).t())
        if bias_t is not None:
            y_t = y_t + bias_t.float()
        return y_t.to(ctx.x_dtype)


def _kernel_linear(layer, x, bias):
    if tangents_possible():
        return _KernelLinearTangent.apply(x, bias, layer)
    if records_grad(x, bias):
        return _KernelLinear.apply(x, bias, layer)
    return _call_kernel(layer, x, bias)


class _FakeQuantSTE(torch.autograd.Function):
    """The kernels' activation rounding, forward bit for bit; backward the identity."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x):
        return ops.fake_quantize_activations(x)

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, g):
        return g


class _FakeQuantSTETangent(_FakeQuantSTE):
    """With forward-mode AD: the tangent the identity too (see _KernelLinearTangent)."""

    @staticmethod
    def jvp(ctx, t):
        return t


class LowBitLinear(nn.Module):
    """Common base: one packed uint8 buffer holds codes, scales and a header."""

    FORMATS: tuple[str, ...] = ()

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 format: str | None = None, group_size: int = 0, granularity: str | None = None,
                 device=None, dtype=None):
        super().__init__()
        if not self.FORMATS:
            raise TypeError("LowBitLinear is the base of the low-bit layers, with no format of its own: use "
                            "Linear1Bit, LinearTernary, Linear2Bit, Linear4Bit or Linear8Bit")
        in_features = int_arg(in_features, f"{type(self).__name__}: in_features")
        out_features = int_arg(out_features, f"{type(self).__name__}: out_features")
        fmt = get_format(format or self.FORMATS[0])
        if fmt.name not in self.FORMATS:
            raise ValueError(f"{type(self).__name__} takes formats {self.FORMATS}, got {fmt.name!r}")
        self.in_features = in_features
        self.out_features = out_features
        self.format = fmt.name
        self.group_size = normalize_group_size(group_size, in_features, fmt)
        self.granularity = granularity or ("group" if self.group_size else "channel")
        if self.granularity not in GRANULARITIES:
            raise ValueError(f"granularity must be one of {GRANULARITIES}, got {self.granularity!r}")
        if (self.granularity == "group") != bool(self.group_size):
            raise ValueError(f"granularity {self.granularity!r} does not fit group_size={self.group_size} "
                             f"(a group_size below in_features={self.in_features} means 'group')")
        # Sized for this geometry so checkpoints load into it like any buffer;
        # all zeros is not a valid blob until packed weights are loaded.
        nbytes = ops.packed_nbytes(fmt, out_features, in_features, self.group_size)
        self.register_buffer("packed", torch.zeros(nbytes, dtype=torch.uint8, device=device))
        if bias:
            self.bias = nn.Parameter(torch.zeros(out_features, device=device, dtype=dtype or torch.float32),
                                     requires_grad=False)
        else:
            self.register_parameter("bias", None)
        self.force_reference = False  # run the pure-PyTorch path even on CPU
        self._dequant_cache: tuple | None = None  # see _dequantized
        self._kmajor = False  # whether `packed` is in the accelerator layout (see _apply)

    # ---- construction -------------------------------------------------------
    @classmethod
    def from_codes(cls, codes: torch.Tensor, scales: torch.Tensor, *, format: str | None = None,
                   group_size: int = 0, bias: torch.Tensor | None = None,
                   granularity: str | None = None) -> "LowBitLinear":
        if codes.dim() != 2:
            raise ValueError(f"codes must be 2-D [out_features, in_features], got shape {tuple(codes.shape)}")
        M, K = codes.shape
        if bias is not None:
            if not isinstance(bias, torch.Tensor) or not bias.is_floating_point() or tuple(bias.shape) != (M,):
                raise ValueError(f"bias must be a floating-point tensor of shape ({M},), got "
                                 f"{getattr(bias, 'dtype', type(bias))} of shape {tuple(getattr(bias, 'shape', ()))}")
            if bias.is_meta:  # the layer is built with values, on the CPU
                raise ValueError("bias is on the meta device: from_codes needs its values")
        layer = cls(K, M, bias is not None, format=format, group_size=group_size,
                    granularity=granularity)
        layer.packed = ops.pack(codes, scales, layer.format, layer.group_size)
        if bias is not None:
            layer.bias.data = bias.detach().clone()
        return layer

    @classmethod
    def from_linear(cls, linear: nn.Linear, *, format: str | None = None, group_size: int = 0,
                    granularity: str | None = None, method: str | None = None) -> "LowBitLinear":
        """Round-to-nearest quantisation of an nn.Linear (see ulbtorch.quantizers)."""
        fmt = format or cls.FORMATS[0]
        if linear.weight.device.type == "meta":
            raise ValueError(f"{cls.__name__}.from_linear: the layer's weight is on the meta device, so there is "
                             "nothing to quantize; load its weights first (or build the layer with device='meta' "
                             "and load a packed state_dict)")
        if linear.in_features < 1 or linear.out_features < 1:
            raise ValueError(f"{cls.__name__}.from_linear: the layer has in_features={linear.in_features}, "
                             f"out_features={linear.out_features}; both must be at least 1")
        gs = normalize_group_size(group_size, linear.in_features, fmt)
        if granularity not in (None, "group") and gs:
            raise ValueError(f"group_size={group_size} needs granularity='group' (or None), got {granularity!r}")
        granularity = granularity or ("group" if gs else "channel")
        codes, scales = quantize_weight(linear.weight, fmt, gs, granularity, method)
        layer = cls.from_codes(codes, scales, format=fmt, group_size=gs if granularity == "group" else 0,
                               bias=linear.bias, granularity=granularity)
        return layer.to(linear.weight.device)

    # ---- inspection ---------------------------------------------------------
    def unpack(self) -> tuple[torch.Tensor, torch.Tensor]:
        self._require_packed()
        if not torch.compiler.is_compiling():
            # __setattr__ and load_state_dict check a new blob; bytes written
            # into `packed` in place are checked here, before dequantize(),
            # the reference path or backward read them under this layer's format.
            why = self.packed_mismatch(verify=False)  # ulb.unpack checks the bytes themselves
            if why:
                raise RuntimeError(f"{type(self).__name__}.packed was overwritten in place: {why}")
        codes, scales = ops.unpack(self.packed)
        # The op's sizes come from the blob's header, unknown to a compiled
        # graph; the layer's geometry (which its blob is checked against) pins them.
        torch._check(codes.shape[0] == self.out_features)
        torch._check(codes.shape[1] == self.in_features)
        torch._check(scales.shape[1] == n_groups(self.group_size, self.in_features))
        return codes, scales

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [out, in] the kernel effectively multiplies by."""
        if torch.compiler.is_compiling():
            return torch.ops.ulb.dequantize_packed(self.packed, self.out_features, self.in_features)
        codes, scales = self.unpack()
        return ops.dequantize(codes, scales, self.format, self.group_size)

    def extra_repr(self) -> str:
        gs = f"group_size={self.group_size}" if self.group_size else f"scale={self.granularity}"
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, format={self.format}, {gs}")

    @property
    def backend(self) -> str:
        """Where forward runs: "cpu" (the C kernels), "triton" (the
        accelerator kernels, on the blob in the accelerator layout) or
        "torch" (F.linear of the dequantised weight: force_reference, or a
        device Triton does not serve)."""
        if self.force_reference:
            return "torch"
        if self._kmajor:
            return "triton"
        return "cpu" if self._buffers["packed"].device.type == "cpu" else "torch"

    # ---- forward ------------------------------------------------------------
    def _require_packed(self):
        # Eager only: a compiled graph cannot branch on the blob's bytes (the
        # kernels still refuse a blob without a header, less helpfully).
        if not torch.compiler.is_compiling() and not bool(self.packed[:4].any()):
            raise RuntimeError(f"{type(self).__name__} has no packed weights: build it with from_linear/"
                               "from_codes or load a state_dict")

    def __call__(self, *args, **kwargs):
        # nn.Module.__call__ walks two Python frames and eight hook tables
        # before forward, a large share of a small decode GEMV. The module
        # call of csrc/eager.cpp makes its checks and forward's in C and runs
        # the kernel, or leaves the call to it.
        call = runtime.eager_module_call
        if call is not None and len(args) == 1 and not kwargs and not _is_dynamo_compiling():
            y = call(self, args[0])
            if y is not NotImplemented:
                return y
        return nn.Module.__call__(self, *args, **kwargs)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        # Decode calls last microseconds: the common case is one call from
        # CPython to the kernel (runtime.eager_linear, NotImplemented for what
        # it leaves to the op), with the parameter dicts read directly
        # (nn.Module.__getattr__ is slow). `input` as nn.Linear names it.
        x = input
        bias = self._parameters["bias"]
        if self._kmajor and accel_serves(self, x, bias):
            return _kernel_linear(self, x, bias)
        eager = runtime.eager_linear
        if eager is not None and not self.force_reference and not torch.compiler.is_compiling():
            y = eager(x, self._buffers["packed"], bias, self.out_features)
            if y is not NotImplemented:
                return y
        if kernel_serves(self, x, bias):
            return _kernel_linear(self, x, bias)
        if x.dim() == 0 or x.shape[-1] != self.in_features:
            raise ValueError(f"{type(self).__name__} expects {self.in_features} input features, "
                             f"got input of shape {tuple(x.shape)}")
        if not x.is_floating_point():
            raise TypeError(f"{type(self).__name__} takes floating-point input, got {x.dtype}")
        if x.device.type == "meta":  # shapes only, as nn.Linear gives on meta
            return x.new_empty(*x.shape[:-1], self.out_features)
        if self._kmajor and not self.force_reference:
            if x.device != self.packed.device:
                raise ValueError(f"{type(self).__name__}: input is on {x.device}, the layer on {self.packed.device}")
            return _kernel_linear(self, x.float(), None if bias is None else bias.float()).to(x.dtype)
        if x.device.type == "cpu" and not self.force_reference:
            return _kernel_linear(self, x.float(), None if bias is None else bias.float()).to(x.dtype)
        return self._reference_forward(x)


    def _dequantized(self, device) -> torch.Tensor:
        """dequantize() on `device`, cached while `packed` reads the same bytes:
        same storage (held by the cache, so a new blob cannot take over its
        address), unmodified (_version; a blob made in inference mode has
        none, and then only load_state_dict and .to() drop the cache)."""
        if torch.compiler.is_compiling():  # no data pointers in a graph; the graph keeps what it computes
            return self.dequantize().to(device)
        packed = self._buffers["packed"]
        key = (packed.data_ptr(), -1 if packed.is_inference() else packed._version, device)
        c = self._dequant_cache
        if c is not None and c[0] == key:
            return c[2]
        self._require_packed()
        w = self.dequantize().to(device)
        self._dequant_cache = (key, packed.untyped_storage(), w)
        return w

    def _reference_forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self._dequantized(x.device)
        if tangents_possible():
            xq = _FakeQuantSTETangent.apply(x)
        else:
            xq = _FakeQuantSTE.apply(x) if torch.is_grad_enabled() else ops.fake_quantize_activations(x)
        bias = None if self.bias is None else self.bias.to(device=x.device, dtype=torch.float32)
        return torch.nn.functional.linear(xq, w, bias).to(x.dtype)

    # ---- state dict -----------------------------------------------------------
    def packed_mismatch(self, blob: torch.Tensor | None = None, verify: bool = True) -> str | None:
        """Why `blob` (default: this layer's) does not fit this layer, or None.
        verify: its bytes checked against the checksum too (the header's tile
        order included), a pass over the blob."""
        blob = self.packed if blob is None else blob
        try:
            info = ops.packed_info(blob, verify=verify)
        except (TypeError, RuntimeError, ValueError) as e:
            return str(e)
        expect = dict(format=self.format, out_features=self.out_features,
                      in_features=self.in_features, group_size=self.group_size)
        got = {k: info[k] for k in expect}
        return None if got == expect else f"packed weight is {got}, but the layer is {expect}"

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        key = prefix + "packed"
        if key in state_dict:
            blob = state_dict[key]
            # A strided blob is copied in like any tensor; its bytes are checked in order.
            why = self.packed_mismatch(blob.contiguous() if isinstance(blob, torch.Tensor) else blob)
            if why:
                error_msgs.append(f"{key}: {why}")
                return
            # The blob's size depends on the shape and format: resize if it
            # differs, then let nn.Module copy it in as usual (checked above, so
            # not through __setattr__). A blob of the right size is written in
            # place, so it stays where it is (ulbtorch.hugepages).
            if self.packed.shape != blob.shape or self.packed.is_meta:
                self._buffers["packed"] = torch.empty(blob.shape, dtype=blob.dtype, device=self.packed.device)
            self._dequant_cache = None
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)
        self.settle_layout()

    # ---- where the blob runs --------------------------------------------------
    def settle_layout(self) -> None:
        """Put the blob in the layout its device runs: the accelerator layout
        (kmajor) where the Triton kernels serve the device, else the CPU's.
        Moving the layer (.to) and giving it a blob (assignment,
        load_state_dict) do this; call it after writing `packed` some other
        way, as loaders that fill module buffers directly do (finish.py)."""
        packed = self._buffers["packed"]
        if packed.device.type == "meta" or is_fake(packed) or not bool(packed[:4].any()):
            return  # no weights yet: the loader that fills them settles them
        kmajor = self._kmajor_on(packed.device)
        if (ops.packed_info(packed)["tiles"] == "kmajor") != kmajor:
            self._buffers["packed"] = ops.retile(packed, "kmajor" if kmajor else None).to(packed.device)
            self._dequant_cache = None
        self._set_kmajor(kmajor)

    def _kmajor_on(self, device: torch.device) -> bool:
        """Whether the blob takes the accelerator layout on `device`: where
        the Triton kernels serve it and the format has that layout (not base
        3, which runs there as the dequantised weight, backend "torch")."""
        return accel.serves(device) and "kmajor" in get_format(self.format).tiles

    def _set_kmajor(self, kmajor: bool) -> None:
        if kmajor:
            accel.load()
        self._kmajor = kmajor

    def _apply(self, fn, recurse=True):
        # Repacked where the blob is, on the CPU, before it moves, so that a
        # layer moved to an accelerator crosses the bus once.
        self._dequant_cache = None
        packed = self._buffers["packed"]
        if packed.device.type != "meta" and not is_fake(packed) and bool(packed[:4].any()):
            kmajor = self._kmajor_on(fn(packed.new_empty(0)).device)
            if kmajor != self._kmajor:
                self._buffers["packed"] = ops.retile(packed, "kmajor" if kmajor else None)
                self._set_kmajor(kmajor)
        return super()._apply(fn, recurse)

    def __setattr__(self, name, value):
        # The kernel follows the blob's header while dequantize(), the
        # reference path and backward follow this layer's format and group
        # size: a blob that disagrees would give two answers. Blobs without
        # bytes to read (meta, fake) are left to the loaders that fill them.
        if (name == "packed" and isinstance(value, torch.Tensor) and "packed" in self.__dict__.get("_buffers", {})
                and value.device.type != "meta" and not is_fake(value)):
            why = self.packed_mismatch(value)
            if why:
                raise ValueError(f"{type(self).__name__}.packed: {why}" + (
                    " (transformers' from_pretrained sets this from uninitialised memory when the checkpoint "
                    "lacks a layer's packed weight)" if "bad header" in why else ""))
            self._dequant_cache = None
            super().__setattr__(name, value)
            self.settle_layout()
            return
        super().__setattr__(name, value)

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name != "weight":
                raise
        # Some models read a linear layer's .weight (its dtype, or to
        # multiply by it): say what to do rather than "no attribute".
        raise AttributeError(f"{type(self).__name__} holds packed weights, not a float `weight`: a model that reads "
                             "`.weight` of this layer needs it kept in float (quantize_(..., exclude=[..., "
                             "'<its name>'])); layer.dequantize() gives the float weight the kernel multiplies by")

    def __getstate__(self):
        # The dequantised weight is a cache: 16x the packed bytes, and its
        # untyped storage does not pickle.
        state = super().__getstate__()
        state["_dequant_cache"] = None
        return state


class Linear2Bit(LowBitLinear):
    """2-bit weights: "int2_sym" levels {-1.5,-0.5,0.5,1.5} x scale (default) or
    "int2" levels {-2,-1,0,1} x scale."""
    FORMATS = module_formats("Linear2Bit")


class LinearTernary(LowBitLinear):
    """Ternary {-1,0,1} x scale, 2 bits per weight. With one per-tensor scale
    and per-token int8 activations this is BitNet b1.58's forward exactly."""
    FORMATS = module_formats("LinearTernary")


class Linear1Bit(LowBitLinear):
    """Binary {-1,+1} x scale, 1 bit per weight."""
    FORMATS = module_formats("Linear1Bit")


class Linear8Bit(LowBitLinear):
    """int8 weights, levels -127..127 x scale: for a layer kept near full
    precision at half the bytes of bf16, such as lm_head
    (quantize_(..., lm_head_bits=8))."""
    FORMATS = module_formats("Linear8Bit")


class Linear4Bit(LowBitLinear):
    """int4 weights, levels -8..7 x scale, two per byte: a quarter of the
    bytes of bf16 (quantize_(..., bits=4), or lm_head_bits=4 for the head)."""
    FORMATS = module_formats("Linear4Bit")


_CLASSES = {cls.__name__: cls for cls in (Linear2Bit, LinearTernary, Linear1Bit, Linear8Bit, Linear4Bit)}
MODULE_FOR_FORMAT = {f.name: _CLASSES[f.module] for f in FORMATS.values()}


def plain_call(layer: nn.Module) -> bool:
    """Whether calling layer runs LowBitLinear's forward and nothing else: no
    hooks of its own (global ones are the caller's to check), no forward
    replaced on the instance or in a subclass."""
    return (isinstance(layer, LowBitLinear) and type(layer).forward is LowBitLinear.forward
            and type(layer).__call__ is LowBitLinear.__call__ and "forward" not in layer.__dict__
            and not layer._forward_hooks and not layer._forward_pre_hooks)


runtime.bind_module_call(LowBitLinear.forward)

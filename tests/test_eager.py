"""The modules' eager fast path (ulbtorch._eager, runtime.eager_linear):
torch.ops.ulb.linear's results bit for bit where it serves a call, and
NotImplemented, so that the op runs, wherever it must not."""
import sys

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

import ulbtorch
from ulbtorch import ops, runtime
from ulbtorch.formats import FORMATS, get_format, n_groups, normalize_group_size

from _layers import fit_group

# Where setup.py could not build it (it is optional), only the first test runs, and fails.
needs_eager = pytest.mark.skipif(not runtime.eager_fast_path_available(),
                                 reason="ulbtorch._eager not built for this torch")

eager = runtime._eager_linear  # the bound function, whatever the switch says


def _blob(gen, fmt, M, K, gs):
    gs = fit_group(fmt, gs)
    f = get_format(fmt)
    codes = torch.randint(0, f.max_code + 1, (M, K), generator=gen, dtype=torch.uint8)
    G = n_groups(normalize_group_size(gs, K, fmt), K)
    return ops.pack(codes, torch.rand(M, G, generator=gen) + 0.05, fmt, gs)


def test_built_for_this_torch():
    """CI builds from source against the installed torch, so the fast path
    must be there: setup.py leaves it out with a warning when it fails to
    build, and every call would then go through the dispatcher unnoticed."""
    assert runtime.eager_fast_path_available(), "ulbtorch._eager was not built (see the pip install log)"
    assert ulbtorch._eager.TORCH_VERSION == torch.__version__
    assert runtime.eager_fast_path()


@needs_eager
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("threads", [1, 2])
def test_bit_identical_to_op(gen, fmt, threads):
    torch.set_num_threads(threads)
    for M, K, gs in ((1, 7, 0), (70, 200, 32), (129, 1000, 128), (300, 4097, 0)):
        blob = _blob(gen, fmt, M, K, gs)
        base = torch.randn(6, 2 * K, generator=gen)
        for dt in (torch.float32, torch.bfloat16):
            b = base.to(dt)
            inputs = {"1 token": b[0, :K], "rows": b[:, :K], "strided rows": b[:, ::2],
                      "3-D": b[:, :K].contiguous().reshape(2, 3, K), "transposed": b[:, :K].t().contiguous().t()}
            for bias in (None, torch.randn(M, generator=gen), torch.randn(M, generator=gen).to(torch.bfloat16)):
                for name, x in inputs.items():
                    got = eager(x, blob, bias, M)
                    assert got is not NotImplemented, f"{fmt} {name} {dt}"
                    want = torch.ops.ulb.linear(x, blob, bias, M)
                    assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want), \
                        f"{fmt} M={M} K={K} gs={gs} {name} {dt} bias={None if bias is None else bias.dtype}"


class _Sub(torch.Tensor):
    pass


class _FnMode(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


class _DispatchMode(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


@needs_eager
def test_leaves_to_the_op_what_it_must(gen):
    M, K = 40, 96
    blob = _blob(gen, "int2_sym", M, K, 32)
    x = torch.randn(3, K, generator=gen)
    bad_blob = blob.clone()
    bad_blob[:8] = 0
    cases = {
        "subclass": (x.as_subclass(_Sub), blob, None, M),
        "meta input": (torch.empty(3, K, device="meta"), blob, None, M),
        "float16": (x.half(), blob, None, M),
        "int input": (x.long(), blob, None, M),
        "K mismatch": (x[:, :K - 1], blob, None, M),
        "out_features": (x, blob, None, M + 1),
        "huge out_features": (x, blob, None, 1 << 70),
        "corrupt blob": (x, bad_blob, None, M),
        "blob of another dtype": (x, blob.view(torch.int8), None, M),
        "strided bias": (x, blob, torch.randn(2 * M, generator=gen)[::2], M),
        "bias shape": (x, blob, torch.randn(M + 1, generator=gen), M),
        "float16 bias": (x, blob, torch.randn(M, generator=gen).half(), M),
        "non-contiguous 3-D": (torch.randn(3, 2, K, generator=gen).transpose(0, 1), blob, None, M),
        "empty": (x[:0], blob, None, M),
        "0-dim": (torch.tensor(1.0), blob, None, M),
        "not a tensor": (x.tolist(), blob, None, M),
    }
    for name, args in cases.items():
        assert eager(*args) is NotImplemented, name
    xg = x.clone().requires_grad_()
    assert eager(xg, blob, None, M) is NotImplemented
    with torch.no_grad():
        assert torch.equal(eager(xg, blob, None, M), torch.ops.ulb.linear(x, blob, None, M))
    with _FnMode():
        assert eager(x, blob, None, M) is NotImplemented
    with _DispatchMode():
        assert eager(x, blob, None, M) is NotImplemented
    with pytest.raises(TypeError, match="takes"):
        eager(x, blob, None)


@needs_eager
def test_leaves_transforms_tracing_and_autocast_to_the_op(gen):
    M, K = 40, 96
    blob = _blob(gen, "int2_sym", M, K, 32)
    x = torch.randn(3, K, generator=gen)
    seen = []

    def f(xi):
        seen.append(eager(xi, blob, None, M))
        return torch.ops.ulb.linear(xi, blob, None, M)

    torch.func.vmap(f)(x)  # xi: a functorch BatchedTensor
    torch.func.functionalize(f)(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        seen.append(eager(x, blob, None, M))
    assert seen and all(r is NotImplemented for r in seen)

    m = ulbtorch.Linear2Bit.from_linear(torch.nn.Linear(K, M))
    traced = torch.jit.trace(m, x, check_trace=False)
    assert "ulb::linear" in str(traced.graph)
    assert torch.equal(traced(x), torch.ops.ulb.linear(x, m.packed, m.bias, M))


@needs_eager
def test_serves_inference_mode(gen):
    m = ulbtorch.Linear2Bit.from_linear(torch.nn.Linear(96, 40))
    x = torch.randn(2, 96, generator=gen)
    with torch.inference_mode():
        xi = x.clone()
        got = eager(xi, m.packed, m.bias, 40)
    assert got is not NotImplemented and torch.equal(got, torch.ops.ulb.linear(x, m.packed, m.bias, 40))


def _spy(monkeypatch, name, calls):
    """Replace runtime.<name> with a wrapper recording, per call, whether
    the real function served it."""
    real = getattr(runtime, "_" + name)

    def spy(*args):
        y = real(*args)
        calls.append((name, y is not NotImplemented))
        return y

    monkeypatch.setattr(runtime, name, spy)


@needs_eager
def test_module_calls_it_and_falls_back(gen, monkeypatch):
    lin = torch.nn.Linear(96, 40)
    m = ulbtorch.Linear2Bit.from_linear(lin)
    calls = []
    _spy(monkeypatch, "eager_module_call", calls)
    _spy(monkeypatch, "eager_linear", calls)
    x = torch.randn(2, 96, generator=gen)
    with torch.no_grad():
        y = m(x)
    assert calls == [("eager_module_call", True)]
    assert torch.equal(y, torch.ops.ulb.linear(x, m.packed, m.bias, 40))
    with runtime.use_eager_fast_path(False):
        assert runtime.eager_linear is None and runtime.eager_module_call is None
        want = m(x)
    assert torch.equal(y, want)
    # Autograd: the op path with its backward.
    _spy(monkeypatch, "eager_module_call", calls)
    _spy(monkeypatch, "eager_linear", calls)
    calls.clear()
    xg = x.clone().requires_grad_()
    m(xg).sum().backward()
    assert calls == [("eager_module_call", False), ("eager_linear", False)] and xg.grad is not None
    # Bad input still raises the op's (or the module's) message.
    with pytest.raises(ValueError, match="expects 96 input features"):
        m(torch.randn(2, 95))
    # Traced by torch.compile: never called, the graph holds the op.
    calls.clear()
    out = torch.compile(m, fullgraph=True, backend="eager")(x)
    assert calls == [] and torch.equal(out, want)
    # Exported: served by neither, the graph holds the op.
    for strict in (True, False):
        calls.clear()
        ep = torch.export.export(torch.nn.Sequential(m), (x,), strict=strict)
        assert "ulb.linear" in str(ep.graph) and not any(ok for _, ok in calls), strict
        assert torch.equal(ep.module()(x), want)


@needs_eager
def test_module_call_leaves_hooks_and_patches_to_nn_module(gen, monkeypatch):
    """The module call serves only calls that nn.Module.__call__ would hand
    straight to LowBitLinear.forward: every hook still runs, and a forward
    overridden or patched, force_reference and module.compile() still apply."""
    M, K = 40, 96
    x = torch.randn(3, K, generator=gen)

    def fresh():
        return ulbtorch.Linear2Bit.from_linear(torch.nn.Linear(K, M))

    m = fresh()
    want = torch.ops.ulb.linear(x, m.packed, m.bias, M)
    calls = []
    _spy(monkeypatch, "eager_module_call", calls)

    def served(mod, *args, **kwargs):
        calls.clear()
        with torch.no_grad():
            y = mod(*args, **kwargs)
        return y, any(c == ("eager_module_call", True) for c in calls)

    y, ok = served(m, x)
    assert ok and torch.equal(y, want)
    seen = []
    cases = {
        "forward hook": lambda mod: mod.register_forward_hook(lambda *a: seen.append("hook")),
        "forward pre-hook": lambda mod: mod.register_forward_pre_hook(lambda *a: seen.append("hook")),
        "global forward hook": lambda mod: torch.nn.modules.module.register_module_forward_hook(
            lambda *a: seen.append("hook")),
        "global forward pre-hook": lambda mod: torch.nn.modules.module.register_module_forward_pre_hook(
            lambda *a: seen.append("hook")),
    }
    for name, register in cases.items():
        mod = fresh()
        mod.load_state_dict(m.state_dict())
        handle = register(mod)
        seen.clear()
        try:
            y, ok = served(mod, x)
        finally:
            handle.remove()
        assert not ok and seen == ["hook"] and torch.equal(y, want), name
        y, ok = served(mod, x)  # hook removed: served again
        assert ok and torch.equal(y, want), name
    module_hooks = torch.nn.modules.module
    for name, register in {"backward hook": lambda mod: mod.register_full_backward_hook(lambda *a: None),
                           "backward pre-hook": lambda mod: mod.register_full_backward_pre_hook(lambda *a: None),
                           "global backward hook": lambda mod: module_hooks.register_module_full_backward_hook(
                               lambda *a: None)}.items():
        handle = register(m)
        try:
            _, ok = served(m, x)
        finally:
            handle.remove()
        assert not ok, name
    # An input rewritten by a pre-hook reaches the kernel.
    handle = m.register_forward_pre_hook(lambda mod, args: (args[0] * 2,))
    y, ok = served(m, x)
    handle.remove()
    assert not ok and torch.equal(y, torch.ops.ulb.linear(x * 2, m.packed, m.bias, M))
    # forward patched on the instance (as accelerate's hooks do), or overridden.
    m.forward = lambda inp: inp[..., :M] * 0
    y, ok = served(m, x)
    assert not ok and torch.equal(y, torch.zeros(3, M))
    del m.forward

    class Doubled(ulbtorch.Linear2Bit):
        def forward(self, inp):
            return 2 * super().forward(inp)

    d = Doubled.from_linear(torch.nn.Linear(K, M))
    d.load_state_dict(m.state_dict())
    y, ok = served(d, x)
    assert not ok and torch.equal(y, 2 * want)
    # The reference path, keyword arguments, no bias.
    m.force_reference = True
    y, ok = served(m, x)
    assert not ok and torch.allclose(y, want, atol=1e-4)
    m.force_reference = False
    y, ok = served(m, input=x)
    assert not ok and torch.equal(y, want)
    nb = ulbtorch.Linear2Bit.from_linear(torch.nn.Linear(K, M, bias=False))
    y, ok = served(nb, x)
    assert ok and torch.equal(y, torch.ops.ulb.linear(x, nb.packed, None, M))
    # nn.Module's call methods replaced: FX patches __call__, a subclass may override _call_impl.
    patched = []
    module_call = torch.nn.Module.__call__

    def patched_call(mod, *args, **kwargs):
        patched.append(mod)
        return module_call(mod, *args, **kwargs)

    monkeypatch.setattr(torch.nn.Module, "__call__", patched_call)
    y, ok = served(m, x)
    assert not ok and patched == [m] and torch.equal(y, want)
    monkeypatch.setattr(torch.nn.Module, "__call__", module_call)

    class Logged(ulbtorch.Linear2Bit):
        def _call_impl(self, *args, **kwargs):
            patched.append(self)
            return super()._call_impl(*args, **kwargs)

    lg = Logged.from_linear(torch.nn.Linear(K, M))
    lg.load_state_dict(m.state_dict())
    patched.clear()
    y, ok = served(lg, x)
    assert not ok and patched == [lg] and torch.equal(y, want)
    # Tables of a dict subclass are read through their own methods.
    class Shifted(dict):
        def __getitem__(self, key):
            v = super().__getitem__(key)
            return None if v is None else v + 100

    sh = fresh()
    sh.load_state_dict(m.state_dict())
    sh._parameters = Shifted(sh._parameters)
    y, ok = served(sh, x)
    assert not ok and torch.equal(y, torch.ops.ulb.linear(x, m.packed, m.bias + 100, M))
    # A profiler records modules by nn.Module.__call__.
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], with_stack=True) as prof:
        y, ok = served(m, x)
    assert not ok and torch.equal(y, want)
    # Where this torch names module calls in its events (2.13 does, 2.11 not), ours is among them.
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], with_stack=True) as control:
        torch.nn.Linear(4, 4)(torch.randn(1, 4))
    if any(e.name.startswith("nn.Module: Linear") for e in control.events()):
        assert any(e.name.startswith("nn.Module: Linear2Bit") for e in prof.events())
    # module.compile(): its compiled call, not ours.
    m.compile(backend="eager", fullgraph=True)
    y, ok = served(m, x)
    assert not ok and torch.equal(y, want)


@needs_eager
def test_module_call_releases_what_it_holds_when_the_kernel_call_throws(gen):
    """An output too large to allocate throws inside the C call: it must give
    back the module's dict and tensors, then leave the call to the op, which
    raises."""
    m = ulbtorch.Linear2Bit.from_linear(torch.nn.Linear(64, 32))
    packed, bias = m._buffers["packed"], m._parameters["bias"]
    before = (sys.getrefcount(packed), sys.getrefcount(bias), sys.getrefcount(m.__dict__))
    huge = torch.randn(1, 64, generator=gen).expand(1 << 50, 64)
    for _ in range(3):
        assert runtime._eager_module_call(m, huge) is NotImplemented
        with torch.no_grad(), pytest.raises(RuntimeError):
            m(huge)
    assert (sys.getrefcount(packed), sys.getrefcount(bias), sys.getrefcount(m.__dict__)) == before


@needs_eager
def test_profiler_sees_the_call(gen):
    m = ulbtorch.Linear2Bit.from_linear(torch.nn.Linear(64, 32))
    x = torch.randn(64, generator=gen)
    with torch.no_grad(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        m(x)
    assert "ulb::linear" in [e.name for e in prof.events()]


@needs_eager
def test_not_bound_under_another_torch(monkeypatch):
    monkeypatch.setattr(torch, "__version__", torch.__version__ + ".other")
    assert runtime._load_eager() is None


@needs_eager
def test_switch():
    with runtime.use_eager_fast_path(False):
        assert not runtime.eager_fast_path()
    assert runtime.eager_fast_path()


@needs_eager
def test_private_names_read_exist_where_they_are_read(gen):
    """ulbtorch._eager reads nn.Module internals by name (NAMES_READ, by where
    it reads each): every one must be where it looks, on a fresh layer, or a
    torch that moved one would turn the fast path off without a sound; and a
    plain layer call must take it."""
    import torch.nn.modules.module as nn_module

    from ulbtorch.nn.linear import LowBitLinear

    m = ulbtorch.Linear2Bit.from_linear(torch.nn.Linear(64, 32))
    where = {
        "torch.nn.Module": lambda n: hasattr(torch.nn.Module, n),
        "LowBitLinear": lambda n: n in vars(LowBitLinear),
        "torch.nn.modules.module": lambda n: n in vars(nn_module),
        "torch.compiler": lambda n: n in vars(torch.compiler),
        "layer": lambda n: n in vars(m),
        "layer._buffers": lambda n: n in m._buffers,
        "layer._parameters": lambda n: n in m._parameters,
    }
    names = ulbtorch._eager.NAMES_READ
    assert set(names) == set(where)
    for place, read in names.items():
        assert read, place
        missing = [n for n in read if not where[place](n)]
        assert not missing, f"{place} lacks {missing}, which csrc/eager.cpp reads"
    x = torch.randn(3, 64, generator=gen)
    with torch.no_grad():
        y = ulbtorch._eager.module_linear(m, x)
    assert isinstance(y, torch.Tensor), y
    assert torch.equal(y, torch.ops.ulb.linear(x, m.packed, m.bias, 32))

"""Runtime controls of the kernel library: ISA and kernel choice, the
thread pool and the scheduler's performance table, prefetch distances, and
the modules' eager fast path. They call the library's plain C functions
(ulbtorch._lib); the ULB_* environment variables are read in ulbtorch._env."""
from __future__ import annotations

import contextlib
import ctypes

from . import _C, _env
from ._lib import CONSTANTS, FORMAT_ROWS, ISAS, TILE_ORDERS, SchedStats, lib as _lib

_MAX_THREADS = CONSTANTS.max_threads
_SLOWDOWN_MAX = CONSTANTS.slowdown_max
PROBE_MAX_STREAMS = CONSTANTS.probe_max_streams


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_bool(on, what: str) -> None:
    """The switches take True or False only: bool("no") is True."""
    if not isinstance(on, bool):
        raise TypeError(f"{what} takes True or False, got {on!r}")


def _check_threads(threads) -> None:
    if not (_is_int(threads) and 1 <= threads <= 1 << 16):
        raise ValueError(f"threads must be an int from 1 to 65536, got {threads!r}")


def _isa_index(name) -> int:
    if name not in ISAS:
        raise ValueError(f"unknown ISA {name!r}; choose from {ISAS}")
    return ISAS.index(name)


def read_probe(buffer, threads: int | None = None, streams: int = 1) -> int:
    """Stream-read a contiguous CPU tensor through the kernels' thread pool
    and work split (the GEMV's memory roofline); returns a checksum. It
    prefetches like the 2-bit kernel on long groups, so set_prefetch_distance(2,
    ...) moves it too. streams > 1 reads each thread's share, 1 MiB at a
    time, as that many runs, a 64-byte line of each in turn: the same bytes
    and checksum, and on some cores (Zen 3) more bandwidth than one run.
    threads: None for torch.get_num_threads()."""
    import torch

    if not (isinstance(buffer, torch.Tensor) and buffer.is_cpu and buffer.is_contiguous()):
        raise ValueError("read_probe takes a contiguous CPU tensor")
    if not (_is_int(streams) and 1 <= streams <= PROBE_MAX_STREAMS):
        raise ValueError(f"read_probe: streams must be an int in [1, {PROBE_MAX_STREAMS}], got {streams!r}")
    if threads is None:
        threads = torch.get_num_threads()
    _check_threads(threads)
    if _thread_pool == "torch" and threads > torch.get_num_threads():
        # parallel_for would run the shares one after another on fewer threads
        raise ValueError(f"read_probe: threads={threads} but PyTorch runs {torch.get_num_threads()}; call "
                         f"torch.set_num_threads({threads}) first, or use set_thread_pool('ulb')")
    out = ctypes.c_uint64()
    n = buffer.numel() * buffer.element_size()
    if n == 0:  # nothing to read (and an empty tensor has no data pointer)
        return 0
    if buffer.data_ptr() % 8 or n % 8:
        raise ValueError(f"read_probe: buffer must be 8-byte aligned and a multiple of 8 bytes long, got {n} bytes "
                         f"at an address {buffer.data_ptr() % 8} past a multiple of 8")
    if _lib.ulb_read_probe_streams(buffer.data_ptr(), n, threads, streams, ctypes.byref(out)) != 0:
        raise ValueError("read_probe: the kernels refused the buffer")
    return out.value


def set_thread_pool(name: str) -> None:
    """"torch" (default): run the kernels' parallel regions on PyTorch's
    intra-op threads, so one OpenMP runtime serves the process. "ulb": the
    kernels' own persistent pool (spin-then-sleep workers)."""
    global _thread_pool
    if name not in ("torch", "ulb"):
        raise ValueError(f"thread pool must be 'torch' or 'ulb', got {name!r}")
    _lib.ulbtorch_use_torch_threads(int(name == "torch"))
    _thread_pool = name


_thread_pool = "torch"  # as ulbtorch._C sets it at load


def thread_pool() -> str:
    """The pool the kernels' parallel regions run on: "torch" or "ulb"."""
    return _thread_pool


def get_isa() -> str:
    return ISAS[_lib.ulb_isa_active()]


def supported_isas() -> list[str]:
    return [name for i, name in enumerate(ISAS) if _lib.ulb_isa_supported(i)]


def set_isa(name: str) -> None:
    global bf16_gemv_native
    if _lib.ulb_isa_set(_isa_index(name)) != 0:
        raise RuntimeError(f"ISA {name!r} is not supported on this CPU (supported: {supported_isas()})")
    bf16_gemv_native = _bf16_gemv_native()


def _bf16_gemv_native() -> bool:
    """Whether the active ISA has a vector kernel for ulb.linear_bf16 (the
    portable ISA runs the reference's rows); without one nn.LinearBF16
    leaves the call to F.linear. Kept in a global, bf16_gemv_native, so
    that the per-call check is a read."""
    return bool(_lib.ulb_gemv_bf16_native(_lib.ulb_isa_active()))


bf16_gemv_native = _bf16_gemv_native()


@contextlib.contextmanager
def _setting(get, set_, value):
    """set_(value) for the enclosed calls, then back to get()'s value.

    The settings are the process's, as the kernels' (C globals), not a
    thread's: a use_* block changes them for every thread while it runs,
    and blocks that overlap in two threads restore in whatever order they
    end. Set them from one thread (torch.backends' flags behave alike)."""
    previous = get()
    set_(value)
    try:
        yield
    finally:
        set_(previous)


def use_isa(name: str):
    """Run the enclosed calls on one ISA's kernels (tests and benchmarks)."""
    return _setting(get_isa, set_isa, name)


def lut1_available(isa: str | None = None) -> bool:
    """Whether a 1-bit lookup-table kernel runs under `isa` on this CPU (None:
    under any ISA it supports): AVX2's over "lanes" tiles (under avx2,
    avxvnni, avx512 and amx), AVX-512 VBMI's over "vnni" tiles."""
    names = supported_isas() if isa is None else [isa]
    return any(_lib.ulb_lut1_available(_isa_index(n)) for n in names)


_LUT1_MODES = {False: CONSTANTS.lut1_off, True: CONSTANTS.lut1_on, "auto": CONSTANTS.lut1_auto}


def lut1_setting() -> bool | str:
    """The 1-bit lookup-table kernels' setting: "auto" (the default), True
    or False (see set_lut1)."""
    mode = _lib.ulb_lut1_get()
    return next(k for k, v in _LUT1_MODES.items() if v == mode)


def lut1_enabled() -> bool:
    """Whether 1-bit GEMVs may run a lookup-table kernel (the setting is not
    False and one runs on this CPU); lut1_serves says which calls do."""
    return lut1_setting() is not False and lut1_available()


def set_lut1(on: bool | str) -> None:
    """The 1-bit lookup-table kernels (after T-MAC). "auto", the default,
    takes them where they pay; True wherever one can run; False never (the
    masking kernels serve). "auto" takes them under AVX2 over "lanes" tiles
    (the default there) for calls of up to 4 tokens, and under AVX-512 VBMI
    over "vnni" tiles for one token on one thread on Intel and Zen 4 only:
    on Zen 5 the masking kernel outruns one core's stream from DRAM
    (benchmarks/results). ULB_LUT1=0|1|auto in the environment sets it at
    load."""
    if not (isinstance(on, bool) or on == "auto"):
        raise TypeError(f"set_lut1 takes True, False or 'auto', got {on!r}")
    if on is True and not lut1_available():
        raise RuntimeError("no 1-bit lookup-table kernel runs on this CPU (they need AVX2, or NEON on AArch64 Linux)")
    _lib.ulb_lut1_set(_LUT1_MODES[on])


def use_lut1(on: bool | str):
    """Run the enclosed calls with the 1-bit lookup-table setting `on`."""
    return _setting(lut1_setting, set_lut1, on)


def lut1_serves(tiles: str, tokens: int, threads: int, isa: str | None = None) -> bool:
    """Whether a 1-bit call of `tokens` tokens on `threads` threads over
    `tiles` ("vnni" or "lanes") takes a lookup-table kernel under `isa`
    (None: the active one), as the setting stands."""
    if tiles not in TILE_ORDERS:
        raise ValueError(f"unknown tile order {tiles!r}; choose from {TILE_ORDERS}")
    if not (_is_int(tokens) and tokens >= 0):
        raise ValueError(f"tokens must be a non-negative int, got {tokens!r}")
    _check_threads(threads)
    index = _lib.ulb_isa_active() if isa is None else _isa_index(isa)
    return bool(_lib.ulb_lut1_serves(TILE_ORDERS.index(tiles), min(tokens, (1 << 63) - 1), threads, index))



def _load_eager():
    """ulbtorch._eager bound to this process's kernels, or None where that
    module is missing or was built for another torch or Python (its classic
    C++ API binds to one torch version; it is compared before any call, and
    importing the module touches nothing of torch)."""
    import torch

    try:
        from . import _eager
    except ImportError:
        return None
    if _eager.TORCH_VERSION != torch.__version__ or not _eager.bind(_C.__file__):
        return None
    return _eager


_eager = _load_eager()
_eager_linear = _eager.linear if _eager is not None else None
_eager_module_call = None  # set by bind_module_call
# What the Linear*Bit modules call in eager mode before torch.ops.ulb.linear:
# the op's kernel straight from CPython (csrc/eager.cpp), or None.
eager_linear = _eager_linear if _env.eager_requested() else None
# What their __call__ tries before nn.Module.__call__: the checks that
# nn.Module.__call__ and forward make, in C, then eager_linear; or None.
eager_module_call = None


def bind_module_call(forward) -> None:
    """Bind the modules' eager call (ulbtorch._eager.module_linear) to
    nn.Module's hook tables and to their class's `forward`, which it checks
    a module still runs (called once, by ulbtorch.nn.linear)."""
    global _eager_module_call, eager_module_call
    import torch.compiler
    import torch.nn.modules.module as nn_module

    if _eager is None or not _eager.bind_module(nn_module.Module, vars(nn_module), vars(torch.compiler), forward):
        return
    _eager_module_call = _eager.module_linear
    eager_module_call = _eager_module_call if eager_linear is not None else None


def eager_fast_path_available() -> bool:
    """Whether ulbtorch._eager loaded for this torch (see eager_linear)."""
    return _eager_linear is not None


def eager_fast_path() -> bool:
    return eager_linear is not None


def set_eager_fast_path(on: bool) -> None:
    """The modules' eager-mode call of the kernel from CPython, beside the op
    (on by default where available; ULB_EAGER=0 turns it off at load). It
    skips the dispatcher's per-call work, which is a large share of a
    one-token call (benchmarks/op_overhead.py); results are the op's bit for
    bit, and whatever it does not serve (tracing, fake tensors, autograd,
    modes, bad input) goes to the op."""
    global eager_linear, eager_module_call
    _check_bool(on, "set_eager_fast_path")
    if on and _eager_linear is None:
        raise RuntimeError("ulbtorch._eager is not built for this torch; the modules call torch.ops.ulb.linear")
    eager_linear = _eager_linear if on else None
    eager_module_call = _eager_module_call if on else None


def use_eager_fast_path(on: bool):
    """Run the enclosed calls with the eager fast path on or off."""
    return _setting(eager_fast_path, set_eager_fast_path, on)


# A setting per code width; base-3 codes take the 2-bit one (kernels/src/prefetch.c).
PREFETCH_WIDTHS = tuple(sorted({row.bits for row in FORMAT_ROWS} - {CONSTANTS.base3_bits}))
_PREFETCH_MAX = CONSTANTS.prefetch_max
_PREFETCH_AUTO = CONSTANTS.prefetch_auto


def _check_bits(bits, widths: tuple, what: str) -> None:
    """bits checked here, before ctypes truncates it to a C int."""
    if not (_is_int(bits) and bits in widths):
        raise ValueError(f"no {what} for bits={bits!r}; widths are {widths}")


def prefetch_distance(bits: int):
    """How many bytes ahead of the codes it reads the kernel for `bits`-bit
    weights (1, 2, 4 or 8) prefetches into L2: an int (0 = none) or "auto",
    the default, which decides per call: 16 KiB for 1 bit; for 2, 4 and 8
    bits 8 KiB on Intel and under the AVX2 kernels on any CPU; for 2 bits
    8 KiB on AMD from Zen 5 on; elsewhere 8 KiB only on one thread with
    groups of at most 40 KiB of codes per 64 rows, else none (the rule is
    kernels/src/prefetch.c's; benchmarks/prefetch_ab.py measures it).
    ULB_PREFETCH_2BIT=bytes|auto (likewise _1BIT, _4BIT, _8BIT) in the
    environment sets it at load."""
    _check_bits(bits, PREFETCH_WIDTHS, "prefetch setting")
    d = ctypes.c_int64()
    _lib.ulb_prefetch_get(bits, ctypes.byref(d))
    return "auto" if d.value == _PREFETCH_AUTO else d.value


def resolved_prefetch_distance(bits: int, threads: int, group_code_bytes: int) -> int:
    """The distance a call would use: `threads` threads, `group_code_bytes`
    bytes of codes per group of a 64-row panel (64 x group length x bits / 8)."""
    _check_bits(bits, PREFETCH_WIDTHS, "prefetch setting")
    _check_threads(threads)
    if not (_is_int(group_code_bytes) and group_code_bytes >= 0):
        raise ValueError(f"group_code_bytes must be a non-negative int, got {group_code_bytes!r}")
    return _lib.ulb_prefetch_resolve(bits, threads, min(group_code_bytes, (1 << 63) - 1))


def set_prefetch_distance(bits: int, nbytes) -> None:
    """Set prefetch_distance(bits): "auto", or a multiple of 64 from 0 (no
    software prefetch) to 1 MiB. Speed only: results are the same bits at any
    distance."""
    _check_bits(bits, PREFETCH_WIDTHS, "prefetch setting")
    if nbytes == "auto":
        nbytes = _PREFETCH_AUTO
    elif not (_is_int(nbytes) and 0 <= nbytes <= _PREFETCH_MAX and nbytes % 64 == 0):
        raise ValueError(f"prefetch distance must be 'auto' or a multiple of 64 bytes from 0 to {_PREFETCH_MAX}, "
                         f"got {nbytes!r}")
    if _lib.ulb_prefetch_set(bits, nbytes) != 0:
        raise RuntimeError(f"the kernels refused prefetch distance {nbytes} for bits={bits}")


def use_prefetch_distance(bits: int, nbytes):
    """Run the enclosed calls with prefetch_distance(bits) == nbytes."""
    return _setting(lambda: prefetch_distance(bits), lambda d: set_prefetch_distance(bits, d), nbytes)


# A table per code width (family_base in kernels/src/sched.c), base 3's too, 16 for the bf16 GEMV, 0 for read_probe.
SCHEDULER_WIDTHS = (0, *sorted({row.bits for row in FORMAT_ROWS}), 16)


def scheduler_stats(bits: int = 2, isa: str | None = None) -> dict:
    """The work-split table of one kernel family (bits 1, 2, 4, 8, 16 for the
    bf16 GEMV, or 0 for read_probe): per-thread share of rows, last measured
    time (us, from the job's publication to the end of the thread's share, so
    the largest is the last multi-thread call's time inside its parallel
    region) and last number of 64-row panels (64 KiB units for the probe).
    isa: None for get_isa()."""
    _check_bits(bits, SCHEDULER_WIDTHS, "scheduler table")
    st = SchedStats()
    if _lib.ulb_sched_stats_get(bits, _isa_index(get_isa() if isa is None else isa), ctypes.byref(st)) != 0:
        raise RuntimeError(f"the kernels refused scheduler_stats(bits={bits}, isa={isa!r})")
    n = st.nthreads
    return dict(nthreads=n, calls=st.calls, ratio=list(st.ratio[:n]),
                last_us=list(st.last_us[:n]), last_panels=list(st.last_panels[:n]))


def scheduler_reset() -> None:
    _lib.ulb_sched_reset()


def scheduler_static(on: bool) -> None:
    """True: split rows equally (no adaptation), for comparisons."""
    _check_bool(on, "scheduler_static")
    _lib.ulb_sched_set_static(int(on))


def set_thread_slowdown(tid: int, factor: float) -> None:
    """Testing knob: make pool thread `tid` (0 to 63) take `factor` (1 to
    1000) times as long."""
    if not (_is_int(tid) and 0 <= tid < _MAX_THREADS and isinstance(factor, (int, float))
            and not isinstance(factor, bool) and 1.0 <= factor <= _SLOWDOWN_MAX):
        raise ValueError(f"invalid slowdown tid={tid!r} factor={factor!r}: tid must be an int from 0 to "
                         f"{_MAX_THREADS - 1}, factor a finite number from 1 to {_SLOWDOWN_MAX:g}")
    if _lib.ulb_sched_set_slowdown(tid, float(factor)) != 0:
        raise RuntimeError(f"the kernels refused slowdown tid={tid} factor={factor}")


def _check_switch_env() -> None:
    """Warn of each ULB_* variable whose value the kernels did not take
    (see _env), and leave ULB_LUT1=1 without a lookup kernel as "auto"."""
    _env.check_isa(get_isa(), ISAS)
    if _env.lut1_on_without_kernel(lut1_available()):
        _lib.ulb_lut1_set(_LUT1_MODES["auto"])
    accepted = ctypes.c_int(1)
    spin = _lib.ulb_spin_us(ctypes.byref(accepted))
    _env.check_spin(bool(accepted.value), spin)
    for bits in PREFETCH_WIDTHS:
        _env.check_prefetch(bits, prefetch_distance(bits), _PREFETCH_MAX)


_check_switch_env()

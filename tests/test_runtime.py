"""ulbtorch.runtime: the ISAs it detects are those /proc/cpuinfo lists, and its
controls (ISA choice, switches also from the environment, the scheduler's
table and test slowdown, the read probe) refuse bad values before they reach C."""
import os
import platform
import subprocess
import sys

import pytest
import torch

from ulbtorch import runtime


# ---- ISA and switches -----------------------------------------------------------------------------

def test_runtime_controls():
    with pytest.raises(ValueError, match="unknown ISA 'sse'"):
        runtime.set_isa("sse")
    with pytest.raises(ValueError, match="unknown ISA"):
        with runtime.use_isa("sve"):
            pass
    if "neon" not in runtime.supported_isas():  # a known name this CPU does not run
        with pytest.raises(RuntimeError, match="ISA 'neon' is not supported on this CPU"):
            runtime.set_isa("neon")
    with pytest.raises(ValueError, match="invalid slowdown"):
        runtime.set_thread_slowdown(-1, 2.0)
    with pytest.raises(ValueError, match="invalid slowdown"):
        runtime.set_thread_slowdown(64, 2.0)
    with pytest.raises(ValueError, match="invalid slowdown"):
        runtime.set_thread_slowdown(0, 0.5)
    with pytest.raises(ValueError, match="no scheduler table for bits=5"):
        runtime.scheduler_stats(5)


def test_runtime_isa_names_checked():
    """Names were looked up with tuple.index: 'x not in tuple'."""
    for call in (lambda: runtime.scheduler_stats(2, "bogus"), lambda: runtime.lut1_available("bogus"),
                 lambda: runtime.set_isa("bogus")):
        with pytest.raises(ValueError, match=r"unknown ISA 'bogus'; choose from \('scalar', 'avx2'"):
            call()
    assert runtime.scheduler_stats(2, runtime.get_isa())["calls"] >= 0


def _cpu_flags():
    try:
        with open("/proc/cpuinfo") as f:
            line = next(ln for ln in f if ln.startswith("flags"))
    except (OSError, StopIteration):
        return None
    return set(line.split(":", 1)[1].split())


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64") or _cpu_flags() is None,
                    reason="x86-64 with /proc/cpuinfo only")
def test_detected_isas_match_cpuinfo():
    """CPUID detection agrees with the kernel's view of the CPU: a detection
    that lost an ISA would shrink every ISA parametrisation of this suite to
    fewer kernels without a single failure."""
    f = _cpu_flags()
    avx2 = {"avx2", "fma"} <= f
    want = {"scalar": True, "avx2": avx2,
            "avx512": {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"} <= f,
            "avxvnni": avx2 and "avx_vnni" in f, "portable": True, "neon": False, "dotprod": False, "i8mm": False}
    # Linux lists amx_tile only where it saves the tiles' state.
    want["amx"] = want["avx512"] and {"amx_tile", "amx_int8", "avx512vbmi"} <= f
    assert runtime.supported_isas() == [isa for isa in runtime.ISAS if want[isa]]
    best = [isa for isa in ("amx", "avx512", "avxvnni", "avx2", "portable") if want[isa]][0]
    if not os.environ.get("ULB_ISA"):
        assert runtime.get_isa() == best


def test_unknown_isa_in_the_environment_warns():
    env = dict(os.environ, ULB_ISA="avx-2")
    out = subprocess.run([sys.executable, "-c", "import ulbtorch; print(ulbtorch.runtime.get_isa())"],
                         capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0 and out.stdout.strip() in runtime.ISAS, out.stderr
    assert "ULB_ISA='avx-2' is not one of" in out.stderr


@pytest.mark.parametrize("switch", [runtime.set_eager_fast_path, runtime.set_lut1, runtime.scheduler_static,
                                    lambda on: runtime.use_eager_fast_path(on).__enter__()])
@pytest.mark.parametrize("bad", ["no", 1, None])
def test_runtime_switches_take_bools(switch, bad):
    """set_eager_fast_path("no") turned the fast path on."""
    before = runtime.eager_fast_path(), runtime.lut1_setting()
    with pytest.raises(TypeError, match=f"takes True(,| or) False.* got {bad!r}"):
        switch(bad)
    assert (runtime.eager_fast_path(), runtime.lut1_setting()) == before


@pytest.mark.parametrize("name,warning,setting", [
    ("ULB_EAGER", "ULB_EAGER='off' is not '0' or '1'; taken as '1' (on)", "eager_fast_path()"),
    ("ULB_LUT1", "ULB_LUT1='off' is not '0', '1' or 'auto'; taken as 'auto'", "lut1_setting() == 'auto'")])
def test_switch_in_the_environment_of_another_value_warns(name, warning, setting):
    env = dict(os.environ, **{name: "off"})
    out = subprocess.run([sys.executable, "-c", f"import ulbtorch; print(ulbtorch.runtime.{setting})"],
                         capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0 and warning in out.stderr, out.stderr
    assert out.stdout.strip() == str(name == "ULB_LUT1" or runtime.eager_fast_path())


# ---- scheduler table and slowdown -----------------------------------------------------------------

@pytest.mark.parametrize("bits", [2 ** 40, 2 ** 32 + 2, -1, 5, 2.0, True, "2", None])
def test_scheduler_stats_checks_bits_before_c(bits):
    """ctypes cut 2**40 to a C int of 0 and gave the read probe's table (3: base 3's)."""
    with pytest.raises(ValueError, match=r"no scheduler table for bits=.*; widths are \(0, 1, 2, 3, 4, 8, 16\)"):
        runtime.scheduler_stats(bits)


@pytest.mark.parametrize("tid,factor", [(2 ** 32, 2.0), (2 ** 40, 2.0), (True, 2.0), (1.0, 2.0), (0, "2"),
                                        (0, None), (0, True), (0, float("nan")), (0, float("inf")), (0, 1e300)])
def test_thread_slowdown_checked_before_c(tid, factor):
    """ctypes cut tid=2**32 to thread 0, float("2") took a string, and an
    infinite factor would have made the thread spin for ever."""
    with pytest.raises(ValueError, match="invalid slowdown .*tid must be an int from 0 to 63, factor a finite number"):
        runtime.set_thread_slowdown(tid, factor)


def test_c_refuses_a_slowdown_past_its_cap():
    assert runtime._lib.ulb_sched_set_slowdown(0, 1e300) != 0


# ---- read probe -----------------------------------------------------------------------------------

@pytest.mark.parametrize("threads", [0, -1, 2 ** 40, 2.0, "2"])
def test_read_probe_thread_count(threads):
    with pytest.raises(ValueError, match="threads must be an int from 1 to 65536"):
        runtime.read_probe(torch.zeros(64), threads)


@pytest.mark.parametrize("streams", [0, -1, 9, 2.0, True, None])
def test_read_probe_stream_count(streams):
    with pytest.raises(ValueError, match="streams must be an int in \\[1, 8\\]"):
        runtime.read_probe(torch.zeros(64), 1, streams)


def test_read_probe_of_nothing():
    assert runtime.read_probe(torch.zeros(0)) == 0
    with pytest.raises(ValueError, match="contiguous CPU tensor"):
        runtime.read_probe(torch.zeros(8, 2)[:, 0])


def test_read_probe_misaligned():
    with pytest.raises(ValueError, match="8-byte aligned"):
        runtime.read_probe(torch.zeros(80, dtype=torch.uint8)[3:])


def test_read_probe_refuses_a_length_not_a_multiple_of_8():
    b = torch.zeros(16, dtype=torch.uint8)
    with pytest.raises(ValueError, match="multiple of 8 bytes long, got 9 bytes"):
        runtime.read_probe(b[:9])
    b[8] = 1
    assert runtime.read_probe(b) != runtime.read_probe(torch.zeros(16, dtype=torch.uint8))


def test_read_probe_on_more_threads_than_torch_runs():
    """On PyTorch's pool the shares of threads > torch.get_num_threads() ran
    one after another, and the probe's split table learned from that."""
    prev = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        with pytest.raises(ValueError, match=r"threads=2 but PyTorch runs 1; call torch.set_num_threads\(2\)"):
            runtime.read_probe(torch.zeros(1 << 16, dtype=torch.uint8), threads=2)
        runtime.set_thread_pool("ulb")
        assert runtime.thread_pool() == "ulb"
        runtime.read_probe(torch.zeros(1 << 16, dtype=torch.uint8), threads=2)  # its own workers
    finally:
        runtime.set_thread_pool("torch")
        torch.set_num_threads(prev)
    assert runtime.thread_pool() == "torch"

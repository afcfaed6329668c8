"""The kernels' software prefetch distance (runtime.prefetch_distance): chosen
at load by CPU vendor, settable, checked, and never a change in results; and
the other choice by CPU, which 1-bit calls take a lookup-table kernel."""
import functools
import os
import subprocess
import sys

import pytest
import torch

from ulbtorch import ops, runtime
from ulbtorch.formats import FORMATS, get_format

from _layers import fit_group

KERNELS = runtime.supported_isas()
DISTANCES = ("auto", 0, 64, 4096, 8192, 1 << 20)  # none, one line, typical, past every matrix here


def _cpu_info():
    """vendor_id, cpu family and flags of the first CPU in /proc/cpuinfo."""
    info = {}
    with open("/proc/cpuinfo") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key.strip() in ("vendor_id", "cpu family", "flags"):
                info.setdefault(key.strip(), value.strip())
    return info


@pytest.mark.skipif(not os.path.exists("/proc/cpuinfo"), reason="reads the CPU vendor from /proc/cpuinfo")
def test_automatic_rule():
    if any(f"ULB_PREFETCH_{b}BIT" in os.environ for b in runtime.PREFETCH_WIDTHS):
        pytest.skip("ULB_PREFETCH_*BIT set in the environment")
    assert [runtime.prefetch_distance(b) for b in runtime.PREFETCH_WIDTHS] == ["auto"] * 4
    cpu = _cpu_info()
    intel = cpu.get("vendor_id") == "GenuineIntel"
    amd_family = int(cpu.get("cpu family", 0)) if cpu.get("vendor_id") == "AuthenticAMD" else 0
    resolve = runtime.resolved_prefetch_distance
    for isa in [i for i in ("avx2", "avxvnni", "avx512", "amx") if i in KERNELS]:
        with runtime.use_isa(isa):
            for threads in (1, 2, 16):
                for group in (2048, 40960, 41024, 1 << 30):
                    assert resolve(1, threads, group) == 16384
                    short = threads == 1 and group <= 40960
                    always = intel or isa in ("avx2", "avxvnni")  # the AVX2 kernels prefetch on every CPU
                    for bits in (2, 4, 8):
                        want = 8192 if always or short or (bits == 2 and amd_family > 25) else 0
                        assert resolve(bits, threads, group) == want, (isa, bits, threads, group)


@pytest.mark.parametrize("threads,group", [(0, 64), (True, 64), (1, -1), (1, 64.0), (2 ** 32 + 1, 64)])
def test_resolve_checks_its_arguments(threads, group):
    with pytest.raises(ValueError, match="threads|group_code_bytes"):
        runtime.resolved_prefetch_distance(2, threads, group)


def test_fixed_setting_overrides_the_rule():
    runtime.set_prefetch_distance(2, 4096)
    assert runtime.prefetch_distance(2) == 4096
    assert runtime.resolved_prefetch_distance(2, 2, 1 << 30) == 4096
    assert runtime.resolved_prefetch_distance(4, 2, 1 << 30) in (0, 8192)  # other widths keep "auto"
    runtime.set_prefetch_distance(1, 0)
    assert runtime.resolved_prefetch_distance(1, 1, 2048) == 0
    runtime.set_prefetch_distance(2, "auto")
    assert runtime.prefetch_distance(2) == "auto"


@pytest.mark.parametrize("isa", KERNELS)
@pytest.mark.parametrize("form", list(FORMATS) + ["binary:lanes"])
def test_results_do_not_depend_on_distance(gen, form, isa):
    """Bit-identical fp32 outputs at every distance (0 compiles out the
    prefetches: the kernels' other variant, the default on AMD), one to three
    and five tokens, one and two threads, per-channel and grouped scales, on
    matrices larger than the common distances (so the prefetches are issued)
    that end in panels of three and of two tiles, equal to the scalar oracle."""
    fmt, _, tiles = form.partition(":")
    f = get_format(fmt)
    K = 4097  # not a multiple of any tile
    x = torch.randn(5, K, generator=gen)
    for M, gs in ((300, 0), (90, fit_group(fmt, 128))):
        codes = torch.randint(0, f.max_code + 1, (M, K), generator=gen, dtype=torch.uint8)
        G = -(-K // gs) if gs else 1
        blob = ops.pack(codes, torch.rand(M, G, generator=gen) + 0.5, fmt, gs, tiles=tiles or "vnni")
        with runtime.use_isa("scalar"):
            want = {n: torch.ops.ulb.linear(x[:n], blob, None, M) for n in (1, 2, 3, 5)}
        with runtime.use_isa(isa):
            for d in DISTANCES:
                runtime.set_prefetch_distance(f.prefetch_bits, d)
                for threads in (1, 2):
                    torch.set_num_threads(threads)
                    for n in (1, 2, 3, 5):
                        got = torch.ops.ulb.linear(x[:n], blob, None, M)
                        assert torch.equal(got, want[n]), (M, gs, d, threads, n)


def test_set_and_context():
    before = {b: runtime.prefetch_distance(b) for b in runtime.PREFETCH_WIDTHS}
    with runtime.use_prefetch_distance(2, 4096):
        assert runtime.prefetch_distance(2) == 4096
        assert {b: runtime.prefetch_distance(b) for b in (1, 4, 8)} == {b: before[b] for b in (1, 4, 8)}
    assert runtime.prefetch_distance(2) == before[2]
    runtime.set_prefetch_distance(8, 0)
    assert runtime.prefetch_distance(8) == 0


@pytest.mark.parametrize("bits,nbytes,match", [
    (3, 64, "no prefetch setting for bits=3"),
    (16, 64, "no prefetch setting for bits=16"),
    (2, 100, "multiple of 64"),
    (2, -64, "multiple of 64"),
    (2, (1 << 20) + 64, "multiple of 64"),
    (2, 64.0, "multiple of 64"),
    (2, "none", "multiple of 64"),
    (2, None, "multiple of 64"),
    (2, False, "multiple of 64"),
])
def test_bad_settings_rejected(bits, nbytes, match):
    before = {b: runtime.prefetch_distance(b) for b in runtime.PREFETCH_WIDTHS}
    with pytest.raises(ValueError, match=match):
        runtime.set_prefetch_distance(bits, nbytes)
    assert {b: runtime.prefetch_distance(b) for b in runtime.PREFETCH_WIDTHS} == before
    with pytest.raises(ValueError, match="no prefetch setting for bits=3"):
        runtime.prefetch_distance(3)


@pytest.mark.parametrize("bits", [2.0, True, 2 ** 32 + 2, "2"])
def test_prefetch_width_checked_before_c(bits):
    with pytest.raises(ValueError, match="no prefetch setting for bits="):
        runtime.prefetch_distance(bits)
    with pytest.raises(ValueError, match="no prefetch setting for bits="):
        runtime.set_prefetch_distance(bits, 64)


def _distances_at_load(env):
    code = ("import warnings; warnings.simplefilter('always'); from ulbtorch import runtime; "
            "print([runtime.prefetch_distance(b) for b in runtime.PREFETCH_WIDTHS])")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, **env})
    assert run.returncode == 0, run.stderr[-2000:]
    return eval(run.stdout.strip().splitlines()[-1]), run.stderr


def test_environment_sets_distance_at_load():
    defaults, _ = _distances_at_load({})
    got, err = _distances_at_load({"ULB_PREFETCH_2BIT": "4096", "ULB_PREFETCH_1BIT": "0", "ULB_PREFETCH_8BIT": "auto"})
    assert got == [0, 4096, defaults[2], "auto"] and "RuntimeWarning" not in err
    got, err = _distances_at_load({"ULB_PREFETCH_4BIT": ""})  # empty: the default, silently
    assert got == defaults and "RuntimeWarning" not in err


def test_environment_value_read_as_the_kernels_read_it():
    got, err = _distances_at_load({"ULB_PREFETCH_2BIT": "08192", "ULB_PREFETCH_4BIT": "+4096"})
    assert got[1:3] == [8192, 4096] and "RuntimeWarning" not in err


@functools.lru_cache(maxsize=1)
def _defaults_at_load():
    return _distances_at_load({})[0]


@pytest.mark.parametrize("value", ["4000", "abc", "-64", "-1", "2097152", "Auto", "8_192"])
def test_bad_environment_value_is_ignored_with_a_warning(value):
    defaults = _defaults_at_load()  # a process each: the defaults once
    got, err = _distances_at_load({"ULB_PREFETCH_4BIT": value})
    assert got == defaults
    assert "ULB_PREFETCH_4BIT" in err and "ignored" in err


def test_read_probe_checksum_does_not_depend_on_distance(gen):
    """The read probe prefetches at the 2-bit distance and may read several
    runs in turn; what it reads is the same."""
    buf = torch.randint(0, 256, (3 * (1 << 20) + 8 * 7,), generator=gen, dtype=torch.uint8)
    want = int(buf.view(torch.int64).sum()) % (1 << 64)
    for d in (0, 64, 8192, 1 << 20):
        runtime.set_prefetch_distance(2, d)
        for threads in (1, 2):
            assert runtime.read_probe(buf, threads) == want, (d, threads)
            for streams in (2, 3, 4, runtime.PROBE_MAX_STREAMS):
                assert runtime.read_probe(buf, threads, streams) == want, (d, threads, streams)


@pytest.mark.skipif(not os.path.exists("/proc/cpuinfo"), reason="reads the CPU vendor from /proc/cpuinfo")
def test_lut1_rule():
    """"auto" takes the one-token lookups over "vnni" tiles on Intel and Zen 4
    only (on Zen 5 masking streams faster); True wherever a kernel runs; the
    AVX2 lookups over "lanes" tiles, up to 4 tokens, under both."""
    cpu = _cpu_info()
    pays = cpu.get("vendor_id") == "GenuineIntel" or (cpu.get("vendor_id") == "AuthenticAMD"
                                                       and cpu.get("cpu family") == "25")  # Zen 4
    for isa in KERNELS:
        vnni = isa in ("avx512", "amx") and "avx512vbmi" in cpu.get("flags", "").split()
        lanes = isa in ("avx2", "avxvnni", "avx512", "amx")
        for setting in ("auto", True, False):
            if setting is True and not runtime.lut1_available():
                continue
            with runtime.use_lut1(setting):
                for tokens in (0, 1, 2, 4, 5):
                    for threads in (1, 2):
                        on = setting is not False and tokens >= 1
                        want_vnni = on and vnni and tokens == 1 and threads == 1 and (setting is True or pays)
                        assert runtime.lut1_serves("vnni", tokens, threads, isa) == want_vnni, (isa, setting, tokens)
                        want_lanes = on and lanes and tokens <= 4
                        assert runtime.lut1_serves("lanes", tokens, threads, isa) == want_lanes, (isa, setting, tokens)
    with pytest.raises(ValueError, match="unknown tile order"):
        runtime.lut1_serves("rows", 1, 1)
    with pytest.raises(ValueError, match="tokens must be"):
        runtime.lut1_serves("vnni", -1, 1)
    with pytest.raises(ValueError, match="threads must be"):
        runtime.lut1_serves("vnni", 1, 0)


def test_lut1_switch(monkeypatch):
    at_load = {"0": False, "1": True}.get(os.environ.get("ULB_LUT1"), "auto")
    assert runtime.lut1_setting() == at_load, "the lookup-table kernels are on 'auto' unless ULB_LUT1 says"
    assert runtime.lut1_enabled() == (at_load is not False and runtime.lut1_available())
    if runtime.lut1_available():
        for other in (True, False, "auto"):
            with runtime.use_lut1(other):
                assert runtime.lut1_setting() == other and runtime.lut1_enabled() == (other is not False)
            assert runtime.lut1_setting() == at_load
        show = "import ulbtorch; print(repr(ulbtorch.runtime.lut1_setting()))"
        for env_value, shown in (("0", "False"), ("1", "True"), ("auto", "'auto'"), ("", "'auto'")):
            out = subprocess.run([sys.executable, "-c", show],
                                 capture_output=True, text=True, timeout=120, env=dict(os.environ, ULB_LUT1=env_value))
            assert out.stdout.strip() == shown, (env_value, out.stderr)
            assert ("ULB_LUT1=" in out.stderr) == (env_value == ""), (env_value, out.stderr)  # '' alone warns
    monkeypatch.setattr(runtime, "lut1_available", lambda isa=None: False)
    assert not runtime.lut1_enabled()
    with pytest.raises(RuntimeError, match="no 1-bit lookup-table kernel runs on this CPU"):
        runtime.set_lut1(True)
    runtime.set_lut1(False)  # turning it off is always allowed


def test_lut1_on_in_the_environment_without_a_kernel_is_auto(monkeypatch):
    """ULB_LUT1=1 where no lookup kernel runs left a setting that set_lut1
    refuses, so restoring it (use_lut1, the tests' fixture) raised."""
    monkeypatch.setenv("ULB_LUT1", "1")
    monkeypatch.setattr(runtime, "lut1_available", lambda isa=None: False)
    runtime.set_lut1(False)
    runtime._lib.ulb_lut1_set(1)  # as the kernels read ULB_LUT1=1 at load
    with pytest.warns(RuntimeWarning, match="ULB_LUT1=1, but no 1-bit lookup-table kernel runs on this CPU"):
        runtime._check_switch_env()
    assert runtime.lut1_setting() == "auto"

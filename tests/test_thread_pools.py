"""Both places a parallel region can run (PyTorch's intra-op threads, the
default, and ulbtorch's own pool) give identical results and feed the same
scheduler table."""
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import ulbtorch
from ulbtorch import runtime


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs 2 cores")
@pytest.mark.parametrize("fmt", ["int2_sym", "binary"])
@pytest.mark.parametrize("N", [1, 3, 37])
def test_pools_agree_and_record_both_threads(fmt, N):
    """The activations are quantised inside the parallel region, every thread
    claiming rows while some are left and then waiting for the rest
    (linear.c): every pool and thread count must give the one-thread result,
    NaN rows included (37 rows make claims of several rows each)."""
    g = torch.Generator().manual_seed(3)
    codes = torch.randint(0, 2 if fmt == "binary" else 4, (2048, 1024), dtype=torch.uint8, generator=g)
    packed = ulbtorch.ops.pack(codes, torch.rand(2048, 1, generator=g), fmt)
    # Several inputs in turn: a thread that read the activations before they
    # were ready would find the previous call's in the reused scratch.
    xs = [torch.randn(N, 1024, generator=g) * (i + 1) for i in range(6)]
    if N > 1:
        xs[2][1, 7] = float("nan")
        xs[2][N - 1, 0] = float("inf")
    prev = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = [torch.ops.ulb.linear(x, packed, None, 2048) for x in xs]
        torch.set_num_threads(2)
        for pool in ("ulb", "torch"):
            runtime.set_thread_pool(pool)
            runtime.scheduler_reset()
            for x, ref in zip(xs, one):
                out = torch.ops.ulb.linear(x, packed, None, 2048)
                assert torch.allclose(out, ref, rtol=0, atol=0, equal_nan=True)
            stats = runtime.scheduler_stats(1 if fmt == "binary" else 2)
            assert stats["nthreads"] == 2 and stats["calls"] == len(xs)
            assert sum(stats["last_panels"]) == 2048 // 64 and min(stats["last_panels"]) > 0
        if N > 1:
            assert torch.isnan(one[2][1]).all() and torch.isnan(one[2][N - 1]).all()
            assert not torch.isnan(one[2][0]).any()
    finally:
        runtime.set_thread_pool("torch")
        torch.set_num_threads(prev)


def test_unknown_pool_rejected():
    with pytest.raises(ValueError, match="thread pool"):
        runtime.set_thread_pool("openmp")


# ---- the pool's spin time (ULB_SPIN_US) -----------------------------------------------------------

@pytest.mark.parametrize("value", ["inf", "1e7", "abc", "", "0x10"])
def test_bad_spin_time_warns_and_workers_still_sleep(value):
    """ULB_SPIN_US=inf once made the ulb pool's workers spin for ever (a
    core's worth of CPU while idle); other bad values silently meant 0."""
    code = textwrap.dedent("""
        import time, torch, ulbtorch
        from ulbtorch import ops, runtime
        runtime.set_thread_pool("ulb")
        torch.set_num_threads(2)
        blob = ops.pack(torch.zeros(1024, 1024, dtype=torch.uint8), torch.ones(1024, 1), "int2_sym")
        torch.ops.ulb.linear(torch.randn(1, 1024), blob, None, 1024)
        assert runtime.scheduler_stats(2)["nthreads"] == 2
        time.sleep(0.05)  # past the default spin
        c0 = time.process_time()
        time.sleep(0.3)
        print("idle cpu", time.process_time() - c0)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, ULB_SPIN_US=value))
    assert out.returncode == 0, out.stderr
    assert f"ULB_SPIN_US={value!r} is not a number of microseconds from 0 to 1e6" in out.stderr
    assert float(out.stdout.split()[-1]) < 0.1, out.stdout  # asleep, not spinning (0.3 s if spinning)


@pytest.mark.parametrize("value", ["0", "50", "1e6", "2.5e1"])
def test_good_spin_time_is_taken_without_a_warning(value):
    code = ("import ctypes, ulbtorch; from ulbtorch import runtime; ok = ctypes.c_int(0); "
            "print(runtime._lib.ulb_spin_us(ctypes.byref(ok)), ok.value)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, ULB_SPIN_US=value))
    assert out.returncode == 0 and "ULB_SPIN_US" not in out.stderr, out.stderr
    assert out.stdout.split() == [repr(float(value)), "1"]


def test_spin_time_set_after_import_is_the_one_in_use():
    """ulb_spin_us once started the pool's setup, which reads ULB_SPIN_US,
    at import: a value set after it was ignored."""
    code = ("import ctypes, os, ulbtorch; from ulbtorch import runtime; os.environ['ULB_SPIN_US'] = '0'; "
            "print(runtime._lib.ulb_spin_us(None))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={k: v for k, v in os.environ.items() if k != "ULB_SPIN_US"})
    assert out.returncode == 0 and out.stdout.split() == ["0.0"], out.stderr

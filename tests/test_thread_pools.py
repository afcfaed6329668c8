"""Both places a parallel region can run (PyTorch's intra-op threads, the
default, and ulbtorch's own pool) give identical results and feed the same
scheduler table."""
import os

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

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
def test_pools_agree_and_record_both_threads(fmt):
    g = torch.Generator().manual_seed(3)
    codes = torch.randint(0, 2 if fmt == "binary" else 4, (2048, 1024), dtype=torch.uint8, generator=g)
    packed = ulbtorch.ops.pack(codes, torch.rand(2048, 1, generator=g), fmt)
    x = torch.randn(3, 1024, generator=g)
    prev = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        out = {}
        for pool in ("ulb", "torch"):
            runtime.set_thread_pool(pool)
            runtime.scheduler_reset()
            out[pool] = torch.ops.ulb.linear(x, packed, None, 2048)
            stats = runtime.scheduler_stats(1 if fmt == "binary" else 2)
            assert stats["nthreads"] == 2 and stats["calls"] == 1
            assert sum(stats["last_panels"]) == 2048 // 64 and min(stats["last_panels"]) > 0
        assert torch.equal(out["ulb"], out["torch"])
    finally:
        runtime.set_thread_pool("torch")
        torch.set_num_threads(prev)


def test_unknown_pool_rejected():
    with pytest.raises(ValueError, match="thread pool"):
        runtime.set_thread_pool("openmp")

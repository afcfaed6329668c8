import os

import pytest
import torch

# Without an accelerator the Triton kernels' tests (tests/test_triton.py) run
# them in Triton's interpreter on CPU tensors, which must be chosen before
# triton is imported; with one, tests/test_accelerator.py runs them compiled.
if not torch.accelerator.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import ulbtorch  # noqa: F401  (registers torch.ops.ulb.*)
from ulbtorch import runtime


@pytest.fixture
def gen():
    """A seeded generator: every test draws its own reproducible data."""
    return torch.Generator().manual_seed(1234)


@pytest.fixture(autouse=True)
def _restore_runtime_state():
    """No test may leak an ISA choice, a kernel switch, a prefetch distance or
    a thread count into the next one."""
    isa = runtime.get_isa()
    lut1 = runtime.lut1_setting()
    eager = runtime.eager_fast_path()
    nthreads = torch.get_num_threads()
    prefetch = {bits: runtime.prefetch_distance(bits) for bits in runtime.PREFETCH_WIDTHS}
    yield
    runtime.set_isa(isa)
    runtime.set_lut1(lut1)
    runtime.set_eager_fast_path(eager)
    torch.set_num_threads(nthreads)
    for bits, d in prefetch.items():
        runtime.set_prefetch_distance(bits, d)

"""A tiny Hugging Face Llama quantised with quantize_: greedy generation and
logits with the C kernels against the pure-PyTorch path of the same layers."""
import pytest
from torch import nn

import ulbtorch
from ulbtorch.nn import Linear1Bit, Linear2Bit, Linear4Bit, Linear8Bit, LinearTernary

from _tiny_llama import CONFIG, PROJ, check_kernels_equal_reference, lowbit_names, set_reference, tiny_llama

pytest.importorskip("transformers")

CLS = {2: Linear2Bit, 1: Linear1Bit, "ternary": LinearTernary, 4: Linear4Bit, 8: Linear8Bit}


@pytest.mark.parametrize("group_size", [0, 64])
@pytest.mark.parametrize("bits", [2, 1, "ternary", 4, 8])
def test_generate_kernels_equal_reference(bits, group_size):
    model = ulbtorch.quantize_(tiny_llama(), bits=bits, group_size=group_size)
    n_layers = CONFIG["num_hidden_layers"] * len(PROJ)
    assert len(lowbit_names(model)) == n_layers
    for name in lowbit_names(model):
        m = model.get_submodule(name)
        assert type(m) is CLS[bits] and m.group_size == group_size
    assert type(model.lm_head) is nn.Linear

    assert set_reference(model, False) == n_layers
    check_kernels_equal_reference(model)

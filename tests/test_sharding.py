"""Tensor-parallel sharding of packed weights (the vLLM plugin's loader),
checked against plain PyTorch on the dequantised weights; no vLLM needed."""
import pytest
import torch

import ulbtorch
from ulbtorch.integrations.sharding import ShardAssembler, VocabShardAssembler


def blob(M, K, fmt="int2_sym", gs=0, seed=0):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, ulbtorch.get_format(fmt).max_code + 1, (M, K), dtype=torch.uint8, generator=g)
    G = 1 if not gs else -(-K // gs)
    return ulbtorch.ops.pack(codes, torch.rand(M, G, generator=g) + 0.1, fmt, gs)


def dequant(packed):
    info = ulbtorch.ops.packed_info(packed)
    return ulbtorch.ops.dequantize(*ulbtorch.ops.unpack(packed), info["format"], info["group_size"])


@pytest.mark.parametrize("tp", [1, 2])
def test_merged_column_parallel_qkv(tp):
    K, sizes = 96, [64, 32, 32]                     # q, k, v rows of the full model
    full = [blob(m, K, gs=32, seed=i) for i, m in enumerate(sizes)]
    ranks = []
    for rank in range(tp):
        a = ShardAssembler("qkv_proj", [m // tp for m in sizes], K, K, "int2_sym", 32, rank, tp)
        for i in (2, 0, 1):                          # any order
            a.load(full[i], i)
        ranks.append(dequant(a.pack()))
    for i, m in enumerate(sizes):
        w = dequant(full[i])
        got = torch.cat([r[sum(s // tp for s in sizes[:i]):][: m // tp] for r in ranks])
        assert torch.equal(got, w)


@pytest.mark.parametrize("fmt,gs", [("int2_sym", 32), ("binary", 64), ("ternary", 0), ("int8", 4), ("int4", 8)])
def test_row_parallel_partial_sums_add_up(fmt, gs):
    M, K, tp = 48, 256, 2
    full = blob(M, K, fmt, gs)
    x = torch.randn(3, K, generator=torch.Generator().manual_seed(1))
    parts = []
    for rank in range(tp):
        a = ShardAssembler("down_proj", [M], K // tp, K, fmt, gs, rank, tp)
        a.load(full)
        parts.append(torch.nn.functional.linear(x[:, rank * K // tp:(rank + 1) * K // tp], dequant(a.pack())))
    want = torch.nn.functional.linear(x, dequant(full))
    # Two fp32 partial sums against one: rounding grows with the outputs' size (int8 levels reach 127).
    torch.testing.assert_close(sum(parts), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def test_bad_shards_name_the_layer():
    with pytest.raises(ValueError, match="o_proj: tensor parallel size 2 .* group_size=64"):
        ShardAssembler("o_proj", [32], 96, 192, "int2_sym", 64, 0, 2)
    a = ShardAssembler("gate_up_proj", [40, 40], 64, 64, "int2_sym", 0, 0, 2)
    with pytest.raises(ValueError, match="gate_up_proj: checkpoint weight is \\(64, 64\\)"):
        a.load(blob(64, 64), 0)                       # 64 rows do not split into 2 x 40
    with pytest.raises(ValueError, match="gate_up_proj: checkpoint blob is binary"):
        a.load(blob(80, 64, "binary"), 0)
    a.load(blob(80, 64), 0)
    with pytest.raises(ValueError, match="gate_up_proj: no checkpoint weight for shard\\(s\\) \\[1\\]"):
        a.pack()


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("fmt,gs", [("int4", 32), ("int8", 0)])
def test_vocab_parallel_lm_head(tp, fmt, gs):
    """vLLM's ParallelLMHead pads the vocabulary to a multiple of 64 and gives
    each rank an equal share of the padded rows; the real rows come first."""
    V, K = 200, 64
    full = blob(V, K, fmt, gs)
    x = torch.randn(2, K, generator=torch.Generator().manual_seed(2))
    padded = -(-V // 64) * 64
    rows = padded // tp
    xq = ulbtorch.ops.fake_quantize_activations(x)  # what the kernel multiplies by
    logits = []
    for rank in range(tp):
        start, end = min(rank * rows, V), min((rank + 1) * rows, V)
        a = VocabShardAssembler("lm_head", rows, K, fmt, gs, V, start, end)
        a.load(full)
        w = dequant(a.pack())
        assert torch.equal(w[:end - start], dequant(full)[start:end])
        assert torch.count_nonzero(w[end - start:]) == 0  # padding rows: logits 0
        y = torch.ops.ulb.linear(x, a.pack(), None, rows)
        ref = torch.nn.functional.linear(xq, w)
        torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
        logits.append(y)
    want = torch.nn.functional.linear(xq, dequant(full))
    got = torch.cat(logits, dim=-1)
    assert got.shape == (2, padded)
    torch.testing.assert_close(got[:, :V], want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def test_vocab_shards_refuse_a_wrong_vocabulary():
    with pytest.raises(ValueError, match="lm_head: vocabulary rows \\[0, 100\\) of 100 do not fit a partition of 64"):
        VocabShardAssembler("lm_head", 64, 32, "int8", 0, 100, 0, 100)
    a = VocabShardAssembler("lm_head", 128, 32, "int8", 0, 100, 0, 100)
    with pytest.raises(ValueError, match="lm_head: checkpoint weight is \\(96, 32\\), expected \\(100, 32\\)"):
        a.load(blob(96, 32, "int8"))
    with pytest.raises(ValueError, match="lm_head: checkpoint blob is int4"):
        a.load(blob(100, 32, "int4"))

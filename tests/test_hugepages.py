"""ulbtorch.hugepages: the streamed weights of a model moved into one arena of
2 MiB pages, with outputs, state_dict, saving and copies unchanged."""
import copy
import gc
import io
import mmap

import pytest
import torch
from torch import nn

import ulbtorch
from ulbtorch import hugepages
from ulbtorch.nn import LinearBF16, LowBitLinear

transformers = pytest.importorskip("transformers")

CONFIG = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=500)
needs_thp = pytest.mark.skipif(not hugepages.available(),
                               reason=f"no transparent huge pages (mode {hugepages.thp_mode()!r})")


def tiny_llama(seed=0, **overrides):
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        cfg = transformers.LlamaConfig(**{**CONFIG, **overrides})
        return transformers.AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16).eval()


def ids(n=6):
    return torch.randint(3, CONFIG["vocab_size"], (1, n), generator=torch.Generator().manual_seed(1))


def streamed(model):
    """The tensors move_to_hugepages moves, in module order."""
    out = []
    for m in model.modules():
        if isinstance(m, LowBitLinear):
            out.append(m.packed)
        elif isinstance(m, LinearBF16) and all(m.weight is not t for t in out):
            out.append(m.weight)
    return out


def logits_and_tokens(model):
    with torch.no_grad():
        logits = model(ids()).logits
        tokens = model.generate(ids(), attention_mask=torch.ones_like(ids()), max_new_tokens=6, min_new_tokens=6,
                                do_sample=False, pad_token_id=0)
    return logits, tokens


@needs_thp
@pytest.mark.parametrize("bits", [2, 1])
def test_moved_model_computes_the_same_bits(bits):
    model = ulbtorch.quantize_(tiny_llama(), bits=bits, hugepages=False)
    before = [t.clone() for t in streamed(model)]
    want = logits_and_tokens(model)
    report = hugepages.move_to_hugepages(model)
    assert report.tensors == len(before) == 15  # 14 projections + the LinearBF16 lm_head
    got = logits_and_tokens(model)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert all(torch.equal(a, b) for a, b in zip(streamed(model), before))


@needs_thp
def test_arena_layout_one_storage_per_tensor():
    model = ulbtorch.quantize_(tiny_llama(), bits=2)  # hugepages=True by default
    ts = streamed(model)
    ptrs = [t.data_ptr() for t in ts]
    assert ptrs[0] % hugepages.HUGE_PAGE == 0, "the arena starts on a 2 MiB boundary"
    assert all(p % 64 == 0 for p in ptrs)
    assert ptrs == sorted(ptrs), "module order"
    for t, nxt in zip(ts, ptrs[1:]):  # packed back to back, each in its own storage of its own size
        end = t.data_ptr() + t.numel() * t.element_size()
        assert end <= nxt < end + 64
        assert t.untyped_storage().data_ptr() == t.data_ptr()
        assert t.untyped_storage().nbytes() == t.numel() * t.element_size()


@needs_thp
def test_report_counts_the_huge_pages_the_kernel_gave():
    def fallbacks():
        with open("/proc/vmstat") as f:
            return sum(int(v) for k, v in (line.split() for line in f) if k == "thp_fault_fallback")

    arena = hugepages.HugePageArena(8 << 20)
    before = fallbacks()
    arena.tensor(torch.ones(8 << 20, dtype=torch.uint8))  # touches 4 huge pages' worth
    huge = arena.huge_bytes()
    assert huge % hugepages.HUGE_PAGE == 0 and huge <= arena.size + hugepages.HUGE_PAGE
    if fallbacks() == before:  # the kernel did not fall back to 4 KiB pages
        assert huge >= 4 * hugepages.HUGE_PAGE
    with pytest.raises(ValueError, match="full"):
        arena.tensor(torch.ones(1, dtype=torch.uint8))


@needs_thp
def test_state_dict_save_load_and_deepcopy_after_the_move(tmp_path):
    model = ulbtorch.quantize_(tiny_llama(), bits=2)
    want = logits_and_tokens(model)[0]
    # safetensors (save_quantized) sees one storage per tensor, not a shared arena
    ulbtorch.save_quantized(model, str(tmp_path))
    loaded = ulbtorch.load_quantized(tiny_llama(seed=5), str(tmp_path))
    assert torch.equal(logits_and_tokens(loaded)[0], want)
    assert streamed(loaded)[0].data_ptr() % hugepages.HUGE_PAGE == 0, "load_quantized moves too"
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    fresh = ulbtorch.quantize_(tiny_llama(seed=7), bits=2)
    ptrs = [t.data_ptr() for t in streamed(fresh)]
    fresh.load_state_dict(torch.load(io.BytesIO(buf.getvalue())))
    assert [t.data_ptr() for t in streamed(fresh)] == ptrs, "load_state_dict copies into the arena"
    assert torch.equal(logits_and_tokens(fresh)[0], want)
    twin = copy.deepcopy(model)
    assert torch.equal(logits_and_tokens(twin)[0], want)
    assert streamed(twin)[0].data_ptr() != streamed(model)[0].data_ptr()


@needs_thp
def test_a_second_move_copies_only_what_is_not_in_an_arena():
    model = ulbtorch.quantize_(tiny_llama(), bits=2, bf16_gemv=False)  # lm_head stays a plain nn.Linear
    placed = [t.data_ptr() for t in streamed(model)]
    assert len(placed) == 14 and all(hugepages.in_arena(t) for t in streamed(model))
    want = logits_and_tokens(model)[0]
    report = hugepages.move_to_hugepages(model, plain_linears=True)  # adds the bf16 lm_head
    assert (report.tensors, report.already) == (1, 14) and "14 already" in str(report)
    assert report.nbytes == model.lm_head.weight.numel() * 2
    assert [t.data_ptr() for t in streamed(model)] == placed, "the packed weights did not move again"
    assert hugepages.in_arena(model.lm_head.weight)
    assert torch.equal(logits_and_tokens(model)[0], want)
    again = hugepages.move_to_hugepages(model, plain_linears=True)
    assert (again.tensors, again.already) == (0, 15) and "left in place" in str(again)
    # a deep copy is in ordinary pages, so it moves whole; a freed arena is forgotten
    twin = copy.deepcopy(model)
    assert not any(hugepages.in_arena(t) for t in streamed(twin))
    assert hugepages.move_to_hugepages(twin, plain_linears=True).tensors == 15
    def arenas_of(m):
        ptrs = [t.untyped_storage().data_ptr() for t in streamed(m)] + [m.lm_head.weight.data_ptr()]
        return {key for key, (lo, hi) in hugepages._live_arenas.items() if any(lo <= p < hi for p in ptrs)}
    keys = arenas_of(model) | arenas_of(twin)
    assert len(keys) == 3  # the model's two arenas and the twin's
    del model, twin
    gc.collect()
    assert not keys & set(hugepages._live_arenas)


@needs_thp
def test_tied_lm_head_moves_once_and_stays_tied():
    model = ulbtorch.quantize_(tiny_llama(tie_word_embeddings=True), bits=2, hugepages=False)
    head, emb = model.lm_head, model.model.embed_tokens
    assert isinstance(head, LinearBF16) and head.weight is emb.weight
    want = logits_and_tokens(model)[0]
    report = hugepages.move_to_hugepages(model)
    assert report.tensors == 15
    assert head.weight is emb.weight and isinstance(head.weight, nn.Parameter)
    assert head.weight.data_ptr() == streamed(model)[-1].data_ptr()
    assert torch.equal(logits_and_tokens(model)[0], want)


@needs_thp
def test_plain_linears_only_when_asked():
    model = tiny_llama()
    assert hugepages.move_to_hugepages(model).tensors == 0
    ptr = model.model.layers[0].mlp.up_proj.weight.data_ptr()
    want = logits_and_tokens(model)[0]
    report = hugepages.move_to_hugepages(model, plain_linears=True)
    assert report.tensors == 15 and model.model.layers[0].mlp.up_proj.weight.data_ptr() != ptr
    assert torch.equal(logits_and_tokens(model)[0], want)


def test_without_thp_nothing_moves(monkeypatch):
    model = ulbtorch.quantize_(tiny_llama(), bits=2, hugepages=False)
    ptrs = [t.data_ptr() for t in streamed(model)]
    monkeypatch.setattr(hugepages, "thp_mode", lambda: "never")
    report = hugepages.move_to_hugepages(model)
    assert report.tensors == 0 and "never" in str(report)
    assert [t.data_ptr() for t in streamed(model)] == ptrs
    with pytest.raises(OSError, match="no transparent huge pages"):
        hugepages.HugePageArena(1 << 20)


@pytest.mark.parametrize("flag", [True, False])
def test_quantize_moves_only_when_asked(monkeypatch, flag):
    calls = []
    monkeypatch.setattr(ulbtorch.finish, "move_to_hugepages", lambda m: calls.append(m))
    model = ulbtorch.quantize_(tiny_llama(), bits=2, hugepages=flag)
    assert calls == ([model] if flag else [])


def test_thp_mode_reads_the_bracketed_word(monkeypatch, tmp_path):
    f = tmp_path / "enabled"
    f.write_text("always [madvise] never\n")
    monkeypatch.setattr(hugepages, "_THP_ENABLED", str(f))
    monkeypatch.setattr(hugepages.sys, "platform", "linux")
    assert hugepages.thp_mode() == "madvise"
    assert hugepages.available() == hasattr(mmap, "MADV_HUGEPAGE")
    f.write_text("always madvise [never]\n")
    assert hugepages.thp_mode() == "never" and not hugepages.available()
    monkeypatch.setattr(hugepages, "_THP_ENABLED", str(tmp_path / "missing"))
    assert hugepages.thp_mode() is None


@needs_thp
def test_moved_under_inference_mode_still_runs_with_autograd():
    # A LinearBF16 weight swapped for an inference tensor could not be used
    # by autograd afterwards (F.linear saves it for backward).
    model = tiny_llama()
    with torch.inference_mode():
        ulbtorch.quantize_(model, bits=2)
    assert not model.lm_head.weight.is_inference() and not streamed(model)[0].is_inference()
    out = model(ids()).logits  # raised "Inference tensors cannot be saved for backward"
    assert out.grad_fn is not None

"""benchmarks/vs_llamacpp.py end to end on a tiny config, where a cached
llama.cpp build is there ($ULB_PEERS_DIR or ~/.cache/ulbtorch/peers; make
one with `python benchmarks/vs_llamacpp.py --build-only`): the HF folder,
llama.cpp's convert + quantize and save_gguf files, llama-bench and our
decode timed in turn, and a table with rows of both engines; and what
benchmarks/results/render.py makes of such a table (always)."""
import json
import os
import sys

import pytest

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
sys.path.insert(0, BENCH)
from peers import llamacpp  # noqa: E402

TINY = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 1024}

BUILD = llamacpp.find_build(llamacpp.default_peers_dir())


@pytest.mark.skipif(BUILD is None, reason=f"no cached llama.cpp build for this CPU in "
                    f"{llamacpp.default_peers_dir()} (python benchmarks/vs_llamacpp.py --build-only)")
def test_tiny_run_has_rows_of_both_engines(tmp_path):
    pytest.importorskip("sentencepiece", reason="convert_hf_to_gguf.py imports sentencepiece")
    import vs_llamacpp

    shapes = tmp_path / "shapes.json"
    shapes.write_text(json.dumps({"configs": {"tiny": TINY}}))
    out = tmp_path / "out.json"
    vs_llamacpp.main(["--shapes", str(shapes), "--model", "tiny", "--peers-dir", llamacpp.default_peers_dir(),
                      "--work-dir", str(tmp_path / "models"), "--formats", "ternary,ternary_base3", "--heads", "bf16",
                      "--threads", "1", "--tokens", "4", "--context", "4", "--prompt-len", "16", "--rounds", "1",
                      "--bw-mib", "64", "--no-torchao", "--no-mix", "--json", str(out)])
    doc = json.loads(out.read_text())
    rows = next(iter(doc["tables"].values()))
    ours = [r for r in rows if r["engine"] == "ulbtorch HF eager"]
    peers = [r for r in rows if r["engine"].startswith("llama.cpp")]
    assert sorted(r["body"] for r in ours) == ["ternary", "ternary_base3"], rows
    # ternary: TQ2_0 from save_gguf and from llama-quantize; ternary_base3: TQ1_0 from llama-quantize only
    assert sorted((r["body"], r["engine"], r["source"]) for r in peers) == [
        ("ternary", "llama.cpp TQ2_0", "convert+quantize"), ("ternary", "llama.cpp TQ2_0", "save_gguf (our weights)"),
        ("ternary_base3", "llama.cpp TQ1_0", "convert+quantize")], peers
    assert any(n.startswith("skipped: save_gguf of ternary_base3 + bf16 head: ") for n in doc["notes"]), doc["notes"]
    for r in ours + peers:
        for key in ("tg_tok_s", "pp_tok_s", "pct_bound", "bytes_per_token"):
            assert r[key] is not None and r[key] > 0, (r["engine"], key, r[key])
    for r in peers:
        assert r["x_decode"] > 0 and r["x_decode_compiled"] > 0 and r["x_prefill"] > 0, r
    # compile_decode's copy: decode timed, its prefill (eager, as the other's) not
    compiled = [r for r in rows if r["engine"] == "ulbtorch HF compiled"]
    assert sorted(r["body"] for r in compiled) == ["ternary", "ternary_base3"], rows
    for r in compiled:
        assert r["tg_tok_s"] > 0 and r["pct_bound"] > 0 and r["pp_tok_s"] is None, r
        assert r["bytes_per_token"] == next(o["bytes_per_token"] for o in ours if o["body"] == r["body"])
    # save_gguf wrote our weights: the same bytes per token as llama-quantize's TQ2_0 of the same folder
    tq2 = {r["source"]: r["bytes_per_token"] for r in peers if r["engine"] == "llama.cpp TQ2_0"}
    assert tq2["save_gguf (our weights)"] == tq2["convert+quantize"], tq2
    assert doc["meta"]["read_gbps"]["used"]["1"] > 0
    # and the same blocks: only the token embedding (quantized by llama-quantize, bf16 in save_gguf) differs
    assert any(n.startswith("save_gguf-ternary-out_bf16.gguf against llama-quantize's TQ2_0-out_bf16.gguf: "
                            "1 tensors differ (token_embd.weight)") for n in doc["notes"]), doc["notes"]


def test_render_summarises_a_vs_llamacpp_json(tmp_path):
    sys.path.insert(0, os.path.join(BENCH, "results"))
    import render

    row = dict(threads=2, body="ternary", head="q8_0", bytes_per_token=1, mib_tok=1.0, pct_bound=50.0)
    rows = [dict(row, engine="ulbtorch HF eager", source="quantize_ ternary", tg_tok_s=30.0, pp_tok_s=300.0),
            dict(row, engine="ulbtorch HF compiled", source="quantize_ ternary", tg_tok_s=40.0, pp_tok_s=None,
                 pct_bound=66.0),
            dict(row, engine="llama.cpp TQ2_0", source="save_gguf (our weights)", tg_tok_s=20.0, pp_tok_s=30.0,
                 x_decode=1.5, x_decode_compiled=2.0, x_prefill=10.0, pct_bound=33.0)]
    env = {"cpu": "AMD EPYC", "cores": 2, "isa": "avx512", "supported_isas": ["avx512"], "torch": "2"}
    path = tmp_path / "vs.json"
    path.write_text(json.dumps({"meta": {"command": "python benchmarks/vs_llamacpp.py --json vs.json", "env": env},
                                "tables": {"vs llama.cpp, falcon3-1b (18 layers)": rows}}))
    out, _ = render.rows_of_file(str(path), "zen5/vs.json")
    assert len(out) == 1, out
    assert out[0]["ours"] == "30.00 tok/s, prefill 300 tok/s; compiled decode 40.00 tok/s"
    assert out[0]["pct_beta"].startswith("50%, compiled 66%")
    assert "llama.cpp TQ2_0 (save_gguf (our weights)): 20.00 tok/s, ours 1.50x (compiled 2.00x) (prefill 10.00x), " \
        "33% of β" == out[0]["vs_peer"]

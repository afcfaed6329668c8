"""The benchmark scripts still run against the current API: each in its
quickest mode (small rotations, few repetitions; the numbers are not looked
at). A refactor once left roofline.py calling an old signature, which only a
full benchmark run would have shown."""
import importlib.util
import json
import os
import subprocess
import sys

import pytest

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")

# The scripts read benchmarks/shapes.json by default; these runs get this
# smaller file in its format so each stays quick.
SHAPES = {
    "gemv_shapes": {"smollm2-135m": [[576, 576], [192, 576]], "falcon3-1b": [[1024, 2048], [2048, 2048]]},
    "prefill_tokens": [32],
    "configs": {"falcon3-1b": {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 18,
                               "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
                               "vocab_size": 131072},
                # gemv_bf16.py times each config's lm_head: a small one here
                "tiny-lm": {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 1,
                            "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 4096}},
}

RUNS = {
    "gemv": (["gemv.py", "--quick", "--threads", "1,2", "--shapes", "{shapes}"], "GEMV cold int2_sym 2 thr"),
    "roofline": (["roofline.py", "--quick", "--formats", "int2_sym,binary", "--shapes", "{shapes}"], "cold median"),
    "scheduler": (["scheduler.py", "--quick"], "Static equal split vs dynamic split"),
    "op_overhead": (["op_overhead.py", "--shapes", "512x512", "--threads", "2", "--reps", "2", "--rotate-mib", "32"],
                    "512x512"),
    "decode": (["decode.py", "--quick", "--shapes", "{shapes}"], "tok/s"),
    # one MoE run for both the profile and the experts' A/B (each run builds the model again)
    "decode_moe": (["decode.py", "--quick", "--config", "olmoe-1b-7b", "--vocab-size", "1000", "--tokens", "2",
                    "--profile", "--experts-ab", "2", "--shapes", "{shapes}"], ("Amdahl", "same tokens: True")),
    "checksum": (["checksum.py", "--quick"], "blob checks at load"),
    "decode_attention": (["decode_attention.py", "--quick", "--shapes", "{shapes}"], "x = sdpa / ulb"),
    "decode_step": (["decode_step.py", "--quick", "--threads", "1", "--shapes", "{shapes}"],
                    ("compiled frozen", "all but ulb::linear")),
    "gemv_bf16": (["gemv_bf16.py", "--models", "tiny-lm", "--threads", "2", "--reps", "1", "--packed", "int8",
                   "--shapes", "{shapes}"], "ulb.linear_bf16 median"),
}
if importlib.util.find_spec("triton"):  # the GPU benchmark's paths, in Triton's interpreter on the CPU
    RUNS["gpu_smoke"] = (["gpu.py", "--smoke", "--decode", "tiny", "--formats", "int2_sym"], "HF greedy decode")
    RUNS["triton_sass"] = (["triton_sass.py"], "instr/weight")
try:
    from ulbtorch import hugepages as _hugepages
    _THP = _hugepages.available()
except ImportError:
    _THP = False
if _THP:  # the same buffers and models in 2 MiB pages
    RUNS["gemv_hugepages"] = (["gemv.py", "--quick", "--threads", "2", "--formats", "int2_sym", "--hugepages",
                               "--shapes", "{shapes}"], "every buffer in 2 MiB pages")
    RUNS["hugepages"] = (["hugepages.py", "--quick", "--shapes", "{shapes}"], "decode, 2 MiB / 4 KiB pages")
    RUNS["roofline_hugepages"] = (["roofline.py", "--quick", "--formats", "int2_sym", "--hugepages",
                                   "--shapes", "{shapes}"], "rotations in 2 MiB pages")
    RUNS["gemv_bf16_hugepages"] = (["gemv_bf16.py", "--models", "tiny-lm", "--threads", "2", "--reps", "1",
                                    "--hugepages", "--shapes", "{shapes}"], "every buffer in 2 MiB pages")


@pytest.fixture(scope="module")
def shapes_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("shapes") / "shapes.json"
    path.write_text(json.dumps(SHAPES))
    return str(path)


def test_default_shapes_ship_with_the_repo():
    """A clone runs the benchmarks without --shapes: the default file is in
    the repo and has every section the scripts read."""
    sys.path.insert(0, BENCH)
    try:
        import common
    finally:
        sys.path.remove(BENCH)
    assert os.path.dirname(common.DEFAULT_SHAPES) == BENCH
    doc = common.load_shapes()
    assert set(SHAPES) <= set(doc)
    assert "falcon3-1b" in doc["configs"] and "smollm2-135m" in doc["gemv_shapes"]


@pytest.mark.parametrize("name", list(RUNS))
def test_benchmark_runs(name, tmp_path, shapes_file):
    args, expect = RUNS[name]
    args = [a.format(shapes=shapes_file) for a in args]
    proc = subprocess.run([sys.executable, os.path.join(BENCH, args[0]), *args[1:]], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    for e in (expect,) if isinstance(expect, str) else expect:
        assert e in proc.stdout, proc.stdout[-2000:]
    assert not os.listdir(tmp_path), "a benchmark wrote files it was not asked for"


def test_results_readme_is_rendered_from_the_json():
    """benchmarks/results/README.md is what render.py makes of the JSON beside
    it: a run added without rendering (or a hand edit) fails here."""
    render = os.path.join(BENCH, "results", "render.py")
    proc = subprocess.run([sys.executable, render, "--check"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, "run: python benchmarks/results/render.py\n" + proc.stderr[-2000:]


def test_render_summarises_a_benchmark_json(tmp_path):
    """A --json file of gemv.py or decode.py becomes a row per format and
    thread count, with the command that wrote it."""
    sys.path.insert(0, os.path.join(BENCH, "results"))
    try:
        import render
    finally:
        sys.path.remove(os.path.join(BENCH, "results"))
    env = {"cpu": "CPU X", "cpu_family": "26", "cpu_model": "2", "cores": 2, "isa": "avx512",
           "supported_isas": ["scalar", "avx512"], "torch": "2.13.0"}
    gemv = [{"model": "m", "threads": 1, "format": "int2_sym", "gbps": g, "speedup": x, "pct_bw": b, "pct_stream": s}
            for g, x, b, s in ((30.0, 16.0, 90.0, 95.0), (34.0, 25.0, 80.0, 85.0))]
    path = tmp_path / "gemv.json"
    path.write_text(json.dumps({"meta": {"command": "python benchmarks/gemv.py --json gemv.json", "env": env},
                                "tables": {"GEMV N=1, cold": gemv}, "notes": []}))
    rows, machine = render.rows_of_file(str(path), "m/gemv.json")
    assert "CPUID family 26 model 2" in machine and "ISA avx512" in machine
    assert len(rows) == 1 and rows[0]["vs_bf16"].startswith("20.00x") and rows[0]["pct_beta"].startswith("85%")
    assert rows[0]["command"] == "python benchmarks/gemv.py --json gemv.json"

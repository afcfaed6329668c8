"""The benchmark scripts still run against the current API: each in its
quickest mode (small rotations, few repetitions; the numbers are not looked
at). A refactor once left roofline.py calling an old signature, which only a
full benchmark run would have shown."""
import os
import subprocess
import sys

import pytest

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")

RUNS = {
    "gemv": (["gemv.py", "--quick", "--threads", "1,2"], "GEMV cold int2_sym 2 thr"),
    "roofline": (["roofline.py", "--quick", "--formats", "int2_sym,binary"], "cold median"),
    "scheduler": (["scheduler.py", "--quick"], "Static equal split vs dynamic split"),
    "op_overhead": (["op_overhead.py", "--shapes", "512x512", "--threads", "2", "--reps", "2"], "512x512"),
    "decode": (["decode.py", "--quick"], "tok/s"),
}


@pytest.mark.parametrize("name", list(RUNS))
def test_benchmark_runs(name, tmp_path):
    args, expect = RUNS[name]
    proc = subprocess.run([sys.executable, os.path.join(BENCH, args[0]), *args[1:]], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert expect in proc.stdout, proc.stdout[-2000:]
    assert not os.listdir(tmp_path), "a benchmark wrote files it was not asked for"

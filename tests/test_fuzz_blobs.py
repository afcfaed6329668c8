"""The blob fuzzer (tests/fuzz/blob_mutations.py) with a small budget, in a
subprocess so that a crash fails this test rather than ending the suite."""
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_mutated_blobs_are_refused_or_load_as_packed():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    run = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "fuzz", "blob_mutations.py"), "--cases", "1500",
                          "--seed", "41"], capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, f"exit status {run.returncode}\n{run.stdout}\n{run.stderr[-4000:]}"
    counts = dict(re.findall(r"(\w+)=(\d+)", run.stdout))
    assert int(counts.get("refused", 0)) > 500, run.stdout  # the mutations reach the checks

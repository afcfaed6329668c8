"""The source distribution carries everything its build needs: setuptools
adds the C and C++ files it compiles but not the headers they include, so
an sdist without MANIFEST.in failed to build ("../src/dtype.h: No such file
or directory")."""
import os
import shutil
import subprocess
import sys
import tarfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _tracked_files():
    if shutil.which("git") is None or not os.path.isdir(os.path.join(ROOT, ".git")):
        pytest.skip("needs the git checkout (its tracked files are what an sdist is made from)")
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


def test_sdist_has_every_header_and_source(tmp_path):
    files = _tracked_files()
    tree = tmp_path / "tree"
    for f in files:  # a copy, so that building the sdist writes nothing into the checkout
        (tree / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(os.path.join(ROOT, f), tree / f)
    run = subprocess.run([sys.executable, "setup.py", "-q", "sdist", "-d", str(tmp_path / "dist")], cwd=tree,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    (archive,) = (tmp_path / "dist").iterdir()
    with tarfile.open(archive) as tar:
        shipped = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    needed = [f for f in files if f.startswith(("kernels/", "csrc/")) and f.endswith((".c", ".h", ".cpp"))]
    assert needed and not [f for f in needed if f not in shipped], sorted(set(needed) - shipped)

"""The C unit test of kernels/ (tests/c/test_kernels.c), built without torch."""
import glob
import os
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CFLAGS = ["-O2", "-std=c11", "-D_GNU_SOURCE", "-ffp-contract=off", "-Wall"]


def _cpu_has_avx2():
    with open("/proc/cpuinfo") as f:
        return " avx2 " in f.read()


@pytest.mark.skipif(shutil.which("gcc") is None, reason="gcc not installed")
@pytest.mark.parametrize("emulate_avxvnni", [False, True])
def test_c_kernels(tmp_path, emulate_avxvnni):
    """Every ISA the CPU runs against the scalar reference; with
    emulate_avxvnni the AVX-VNNI kernels too, their vpdpbusd computed from
    AVX2 (kernels/x86/panel_avxvnni.c), on any CPU with AVX2."""
    sources = [os.path.join(ROOT, "tests", "c", "test_kernels.c")]
    for d in ("kernels/src", "kernels/ref", "kernels/x86"):
        found = sorted(glob.glob(os.path.join(ROOT, d, "*.c")))
        assert found or d == "kernels/x86", f"no C sources in {d}"
        sources += found
    exe = str(tmp_path / "test_kernels")
    flags = CFLAGS + (["-DULB_EMULATE_AVXVNNI"] if emulate_avxvnni else [])
    build = subprocess.run(["gcc", *flags, "-I" + os.path.join(ROOT, "kernels", "include"), *sources,
                            "-o", exe, "-lm", "-lpthread"], capture_output=True, text=True, timeout=180)
    assert build.returncode == 0, build.stderr[-4000:]
    run = subprocess.run([exe], capture_output=True, text=True, timeout=180, cwd=str(tmp_path))
    assert run.returncode == 0, (run.returncode, run.stdout[-4000:], run.stderr[-2000:])
    assert " 0 failed" in run.stdout, run.stdout[-4000:]
    if emulate_avxvnni and os.path.exists("/proc/cpuinfo") and _cpu_has_avx2():
        assert "avxvnni" in run.stdout.split("ISAs run:")[1].splitlines()[0], run.stdout[-500:]


@pytest.mark.skipif(shutil.which("gcc") is None, reason="gcc not installed")
def test_benchmark_c_tools_build(tmp_path):
    """benchmarks/c/ builds against the current C API (the tools are run by hand, so
    nothing else would notice them going stale)."""
    objs = []
    for d in ("kernels/src", "kernels/ref", "kernels/x86"):
        for src in sorted(glob.glob(os.path.join(ROOT, d, "*.c"))):
            obj = str(tmp_path / (os.path.basename(src) + ".o"))
            cc = subprocess.run(["gcc", *CFLAGS, "-I" + os.path.join(ROOT, "kernels", "include"), "-c", src,
                                 "-o", obj], capture_output=True, text=True, timeout=180)
            assert cc.returncode == 0, cc.stderr[-4000:]
            objs.append(obj)
    tools = sorted(glob.glob(os.path.join(ROOT, "benchmarks", "c", "*.c")))
    assert tools
    for tool in tools:
        if os.path.basename(tool) == "ab_linear.c":  # links two renamed builds (ab_builds.sh): compile only
            args = ["-c", tool, "-o", str(tmp_path / "ab_linear.o")]
        else:
            args = [tool, *objs, "-o", str(tmp_path / os.path.basename(tool)[:-2]), "-lm", "-lpthread"]
        cc = subprocess.run(["gcc", *CFLAGS, "-Werror", "-I" + os.path.join(ROOT, "kernels", "include"), *args],
                            capture_output=True, text=True, timeout=180)
        assert cc.returncode == 0, (tool, cc.stderr[-4000:])
    for script in sorted(glob.glob(os.path.join(ROOT, "benchmarks", "c", "*.sh"))):
        check = subprocess.run(["bash", "-n", script], capture_output=True, text=True, timeout=60)
        assert check.returncode == 0, (script, check.stderr)

"""The C unit test of kernels/ (tests/c/test_kernels.c), built without torch."""
import concurrent.futures
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


def _kernel_sources(x86=False, arm=False):
    """The kernel library's C files as setup.py compiles them for x86-64 (x86),
    AArch64 Linux (arm) or another CPU (neither)."""
    sources = []
    for d in ("kernels/src", "kernels/ref") + (("kernels/x86",) if x86 else ()) + (("kernels/arm",) if arm else ()):
        found = sorted(glob.glob(os.path.join(ROOT, d, "*.c")))
        assert found, f"no C sources in {d}"
        sources += found
    return sources


@pytest.fixture(scope="module")
def kernel_objects(tmp_path_factory):
    """objects(cc, flags, x86=, arm=): the kernel library compiled once per
    compiler and flags for the tests of this file, two files at a time (each
    test linking its own copy took most of the file's time)."""
    built = {}

    def objects(cc, flags, x86=False, arm=False):
        key = (cc, tuple(flags), x86, arm)
        if key not in built:
            out = tmp_path_factory.mktemp("objs")
            sources = _kernel_sources(x86=x86, arm=arm)
            objs = [str(out / (os.path.relpath(src, ROOT).replace(os.sep, "_") + ".o")) for src in sources]

            def compile_one(src_obj):
                src, obj = src_obj
                return subprocess.run([cc, *flags, "-I" + os.path.join(ROOT, "kernels", "include"), "-c", src, "-o",
                                       obj], capture_output=True, text=True, timeout=300)

            with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
                for src, cc_run in zip(sources, pool.map(compile_one, zip(sources, objs))):
                    assert cc_run.returncode == 0, (src, cc_run.stderr[-4000:])
            built[key] = objs
        return built[key]
    return objects


def _build_and_run(cc, flags, sources, exe, runner=(), isas_line=True, env=None, timeout=300):
    build = subprocess.run([cc, *flags, "-I" + os.path.join(ROOT, "kernels", "include"), *sources,
                            "-o", exe, "-lm", "-lpthread"], capture_output=True, text=True, timeout=180)
    assert build.returncode == 0, build.stderr[-4000:]
    run = subprocess.run([*runner, exe], capture_output=True, text=True, timeout=timeout, cwd=os.path.dirname(exe),
                         env=None if env is None else {**os.environ, **env})
    assert run.returncode == 0, (run.returncode, run.stdout[-4000:], run.stderr[-2000:])
    assert " 0 failed" in run.stdout, run.stdout[-4000:]
    return run.stdout.split("ISAs run:")[1].splitlines()[0].split() if isas_line else None


@pytest.mark.skipif(shutil.which("gcc") is None, reason="gcc not installed")
@pytest.mark.parametrize("emulate_avxvnni", [False, True])
def test_c_kernels(tmp_path, kernel_objects, emulate_avxvnni):
    """Every ISA the CPU runs against the scalar reference; with
    emulate_avxvnni the AVX-VNNI kernels too, their vpdpbusd computed from
    AVX2 (kernels/x86/panel_avxvnni.c), on any CPU with AVX2, on a sample of
    the shapes (the other ISAs ran on all of them in the first run)."""
    flags = CFLAGS + (["-DULB_EMULATE_AVXVNNI"] if emulate_avxvnni else [])
    sources = [os.path.join(ROOT, "tests", "c", "test_kernels.c"), *kernel_objects("gcc", flags, x86=True)]
    isas = _build_and_run("gcc", flags, sources, str(tmp_path / "test_kernels"),
                          env={"ULB_TEST_FEW_SHAPES": "1"} if emulate_avxvnni else None)
    if emulate_avxvnni and os.path.exists("/proc/cpuinfo") and _cpu_has_avx2():
        assert "avxvnni" in isas, isas


@pytest.mark.skipif(shutil.which("gcc") is None, reason="gcc not installed")
def test_c_scheduler_table(tmp_path, kernel_objects):
    """The dynamic split's table fed made-up times (tests/c/test_sched.c):
    the EMA update exactly, whatever else runs on the machine."""
    sources = [os.path.join(ROOT, "tests", "c", "test_sched.c"), *kernel_objects("gcc", CFLAGS, x86=True)]
    _build_and_run("gcc", CFLAGS, sources, str(tmp_path / "test_sched"), isas_line=False)


@pytest.mark.skipif(shutil.which("gcc") is None, reason="gcc not installed")
def test_c_fork_while_the_pool_runs(tmp_path, kernel_objects):
    """fork() while another thread runs jobs on the pool (tests/c/test_fork.c):
    the child gets free locks, its own workers and right results."""
    sources = [os.path.join(ROOT, "tests", "c", "test_fork.c"), *kernel_objects("gcc", CFLAGS, x86=True)]
    _build_and_run("gcc", CFLAGS, sources, str(tmp_path / "test_fork"), isas_line=False)


@pytest.mark.skipif(shutil.which("gcc") is None, reason="gcc not installed")
def test_c_pool_wakes_sleeping_workers(tmp_path, kernel_objects):
    """Jobs back to back with the workers asleep between them
    (tests/c/test_pool_wake.c): a lost wake-up hangs the caller, and fails
    by timeout."""
    sources = [os.path.join(ROOT, "tests", "c", "test_pool_wake.c"), *kernel_objects("gcc", CFLAGS, x86=True)]
    _build_and_run("gcc", CFLAGS, sources, str(tmp_path / "test_pool_wake"), isas_line=False,
                   env={"ULB_SPIN_US": "0"}, timeout=60)


@pytest.mark.skipif(shutil.which("gcc") is None, reason="gcc not installed")
def test_c_pool_survives_fork(tmp_path, kernel_objects):
    """fork() during another thread's parallel jobs (tests/c/test_pool_fork.c):
    the child's jobs must run on threads of its own; one that waits for the
    parent's workers hangs, and fails by timeout."""
    sources = [os.path.join(ROOT, "tests", "c", "test_pool_fork.c"), *kernel_objects("gcc", CFLAGS, x86=True)]
    _build_and_run("gcc", CFLAGS, sources, str(tmp_path / "test_pool_fork"), isas_line=False, timeout=120)


AARCH64_CC, QEMU = shutil.which("aarch64-linux-gnu-gcc"), shutil.which("qemu-aarch64")
NO_AARCH64 = "no aarch64 cross compiler and qemu-user (apt-get install gcc-aarch64-linux-gnu qemu-user)"


ARM_ISAS = ["neon", "dotprod", "i8mm"]


@pytest.fixture(scope="module")
def aarch64_test_kernels(tmp_path_factory, kernel_objects):
    """tests/c/test_kernels.c with the kernels setup.py builds on AArch64
    Linux (kernels/arm with the rest), cross-compiled once for the runs below."""
    exe = str(tmp_path_factory.mktemp("aarch64") / "test_kernels")
    sources = [os.path.join(ROOT, "tests", "c", "test_kernels.c"), *kernel_objects(AARCH64_CC, CFLAGS, arm=True)]
    build = subprocess.run([AARCH64_CC, *CFLAGS, "-static", "-I" + os.path.join(ROOT, "kernels", "include"), *sources,
                            "-o", exe, "-lm", "-lpthread"], capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr[-4000:]
    return exe


def _run_aarch64(exe, cpu, few_shapes):
    env = {**os.environ, "QEMU_CPU": cpu}
    env.pop("ULB_ISA", None)
    if few_shapes:
        env["ULB_TEST_FEW_SHAPES"] = "1"
    run = subprocess.run([QEMU, exe], capture_output=True, text=True, timeout=900, cwd=os.path.dirname(exe), env=env)
    assert run.returncode == 0, (run.returncode, run.stdout[-4000:], run.stderr[-2000:])
    assert " 0 failed" in run.stdout, run.stdout[-4000:]
    isas = run.stdout.split("ISAs run:")[1].splitlines()[0].split()
    return isas, run.stdout.split("best ISA:")[1].split()[0]


@pytest.mark.skipif(AARCH64_CC is None or QEMU is None, reason=NO_AARCH64)
def test_c_kernels_aarch64(aarch64_test_kernels):
    """The AArch64 build (setup.py adds kernels/arm there and leaves out
    kernels/x86): every ARM ISA, NEON, dotprod and i8mm, against the scalar
    reference bit for bit, on every shape of the test, under qemu-user's
    "max" CPU, which has FEAT_DotProd and FEAT_I8MM; the HWCAPs choose i8mm."""
    isas, best = _run_aarch64(aarch64_test_kernels, "max", few_shapes=False)
    assert isas == ["scalar", "portable"] + ARM_ISAS, isas
    assert best == "i8mm"


@pytest.mark.skipif(AARCH64_CC is None or QEMU is None, reason=NO_AARCH64)
@pytest.mark.parametrize("cpu, isas", [("cortex-a76", ARM_ISAS[:2]), ("cortex-a53", ARM_ISAS[:1])])
def test_c_kernels_aarch64_older_cores(aarch64_test_kernels, cpu, isas):
    """CPUs without FEAT_I8MM (Cortex-A76) or without FEAT_DotProd too
    (Cortex-A53): the HWCAPs offer only the kernels they run, the best of
    them by default, and those run without an instruction the core lacks
    (qemu would stop the test with SIGILL), on a sample of the shapes (the
    "max" run above covers every kernel on all of them)."""
    got, best = _run_aarch64(aarch64_test_kernels, cpu, few_shapes=True)
    assert got == ["scalar", "portable"] + isas, got
    assert best == isas[-1]


@pytest.mark.skipif(AARCH64_CC is None or QEMU is None, reason=NO_AARCH64)
def test_c_pool_wakes_sleeping_workers_aarch64(tmp_path, kernel_objects):
    """The pool's sleep and wake-up under a weaker memory model than
    x86-64's: qemu-user lets an aarch64 load pass an earlier store-release,
    and without fences a worker slept through its job."""
    sources = [os.path.join(ROOT, "tests", "c", "test_pool_wake.c"), *kernel_objects(AARCH64_CC, CFLAGS, arm=True)]
    _build_and_run(AARCH64_CC, CFLAGS + ["-static"], sources, str(tmp_path / "test_pool_wake"), [QEMU],
                   isas_line=False, env={"ULB_SPIN_US": "0"}, timeout=120)


@pytest.mark.skipif(shutil.which("gcc") is None, reason="gcc not installed")
def test_benchmark_c_tools_build(tmp_path, kernel_objects):
    """benchmarks/c/ builds against the current C API (the tools are run by hand, so
    nothing else would notice them going stale)."""
    objs = kernel_objects("gcc", CFLAGS, x86=True)
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

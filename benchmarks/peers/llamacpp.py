"""llama.cpp as a benchmark peer: built once from the llama-cpp-python sdist
(PyPI; its vendor/llama.cpp tree) with native CPU flags and cached in a
folder the user names, then its convert_hf_to_gguf.py, llama-quantize and
llama-bench driven from Python.

Layout of the cache folder (--peers-dir):
  sdist/llama_cpp_python-<version>.tar.gz      what pip download fetched
  src/llama_cpp_python-<version>/              the unpacked sdist
  llama.cpp-<version>-<cpu tag>/bin/           llama-bench, llama-quantize, ...
The CPU tag hashes the CPU's model name and flags: a build with
-DGGML_NATIVE=ON uses every instruction of the CPU it was built on, so a
cache shared between machines of different kinds gets one build per kind.
"""
from __future__ import annotations

import glob
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
from dataclasses import dataclass

PACKAGE = "llama-cpp-python"
REQUIRED = ("llama-bench", "llama-quantize")
# Built where the tree has them: llama-simple and llama-completion run a GGUF
# from a prompt (what tests of save_gguf's output call), not timed here.
OPTIONAL = ("llama-simple", "llama-completion")


def default_peers_dir() -> str:
    """$ULB_PEERS_DIR, else ~/.cache/ulbtorch/peers."""
    return os.environ.get("ULB_PEERS_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "ulbtorch", "peers")


def cpu_tag() -> str:
    """8 hex digits naming this CPU kind (model name and feature flags)."""
    fields = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in ("model name", "flags", "Features", "CPU part") and key not in fields:
                    fields[key] = value.strip()
    except OSError:
        pass
    import platform
    text = platform.machine() + "|" + "|".join(f"{k}={fields[k]}" for k in sorted(fields))
    return hashlib.sha1(text.encode()).hexdigest()[:8]


@dataclass
class LlamaCpp:
    """A built llama.cpp: its source tree (for convert_hf_to_gguf.py) and bin folder."""
    version: str
    src: str
    bin_dir: str

    def tool(self, name: str) -> str:
        path = os.path.join(self.bin_dir, name)
        if not os.access(path, os.X_OK):
            raise FileNotFoundError(f"llama.cpp build {self.bin_dir} has no {name}")
        return path


def _sdist(peers_dir: str, version: str | None, log) -> str:
    """The sdist tarball for version (None: the newest already downloaded,
    else the newest on PyPI), downloaded with pip when missing."""
    folder = os.path.join(peers_dir, "sdist")
    pattern = f"llama_cpp_python-{version or '*'}.tar.gz"
    have = sorted(glob.glob(os.path.join(folder, pattern)), key=_version_key)
    if have:
        return have[-1]
    os.makedirs(folder, exist_ok=True)
    spec = f"{PACKAGE}=={version}" if version else PACKAGE
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", PACKAGE, spec, "-d", folder]
    log(f"  downloading the {spec} sdist: {' '.join(cmd)}")
    proc = subprocess.run(cmd, capture_output=True, text=True)
    have = sorted(glob.glob(os.path.join(folder, pattern)), key=_version_key)
    if proc.returncode != 0 or not have:
        raise RuntimeError(f"pip download of {spec} failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}")
    return have[-1]


def _version_key(path: str) -> tuple:
    m = re.search(r"-(\d+(?:\.\d+)*)\.tar\.gz$", path)
    return tuple(int(x) for x in m.group(1).split(".")) if m else ()


def _unpack(tarball: str, peers_dir: str) -> tuple[str, str]:
    """(version, vendor/llama.cpp folder) of the unpacked sdist."""
    name = os.path.basename(tarball)[: -len(".tar.gz")]
    version = name.rpartition("-")[2]
    root = os.path.join(peers_dir, "src")
    tree = os.path.join(root, name, "vendor", "llama.cpp")
    if not os.path.isfile(os.path.join(tree, "CMakeLists.txt")):
        os.makedirs(root, exist_ok=True)
        with tarfile.open(tarball) as tf:
            tf.extractall(root, filter="data")
    if not os.path.isfile(os.path.join(tree, "CMakeLists.txt")):
        raise RuntimeError(f"{tarball} has no vendor/llama.cpp/CMakeLists.txt")
    return version, tree


def _targets_in(tree: str) -> set[str]:
    """The executable targets the tree's CMake files define."""
    found = set()
    for path in glob.glob(os.path.join(tree, "**", "CMakeLists.txt"), recursive=True):
        with open(path, errors="replace") as f:
            found.update(re.findall(r"set\(TARGET\s+(llama-[\w-]+)\)", f.read()))
    return found


def find_build(peers_dir: str, version: str | None = None) -> LlamaCpp | None:
    """A finished build for this CPU kind in peers_dir (the newest version
    unless one is named), or None."""
    tag = cpu_tag()
    builds = []
    for bin_dir in glob.glob(os.path.join(peers_dir, f"llama.cpp-{version or '*'}-{tag}", "bin")):
        if all(os.access(os.path.join(bin_dir, t), os.X_OK) for t in REQUIRED):
            ver = os.path.basename(os.path.dirname(bin_dir))[len("llama.cpp-"):-len(tag) - 1]
            src = os.path.join(peers_dir, "src", f"llama_cpp_python-{ver}", "vendor", "llama.cpp")
            if os.path.isfile(os.path.join(src, "convert_hf_to_gguf.py")):
                builds.append(LlamaCpp(ver, src, bin_dir))
    builds.sort(key=lambda b: tuple(int(x) for x in b.version.split(".") if x.isdigit()))
    return builds[-1] if builds else None


def build(peers_dir: str, version: str | None = None, jobs: int = 2, nice: int = 10, log=print) -> LlamaCpp:
    """Reuse the cached build for this CPU kind, or build llama.cpp from the
    llama-cpp-python sdist: CMake Release, -DGGML_NATIVE=ON, static, the
    tools in REQUIRED and OPTIONAL (those the tree has), under nice."""
    peers_dir = os.path.abspath(peers_dir)
    found = find_build(peers_dir, version)
    if found:
        log(f"# llama.cpp {found.version}: reusing {found.bin_dir}")
        return found
    if shutil.which("cmake") is None:
        raise RuntimeError("building llama.cpp needs cmake on PATH (pip install cmake)")
    version, tree = _unpack(_sdist(peers_dir, version, log), peers_dir)
    out = os.path.join(peers_dir, f"llama.cpp-{version}-{cpu_tag()}")
    build_dir = os.path.join(out, "cmake")
    if os.path.isdir(build_dir):  # an interrupted build, maybe configured for another path
        shutil.rmtree(build_dir)
    targets = [t for t in REQUIRED + OPTIONAL if t in _targets_in(tree)]
    missing = [t for t in REQUIRED if t not in targets]
    if missing:
        raise RuntimeError(f"llama.cpp {version} in {tree} defines no target {missing}")
    gen = ["-G", "Ninja"] if shutil.which("ninja") else []
    configure = ["cmake", "-S", tree, "-B", build_dir, *gen, "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON",
                 "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
                 "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_BUILD_APP=OFF"]
    make = ["cmake", "--build", build_dir, "-j", str(jobs), "--target", *targets]
    prefix = ["nice", "-n", str(nice)] if nice and shutil.which("nice") else []
    os.makedirs(out, exist_ok=True)
    log_path = os.path.join(out, "build.log")
    log(f"# building llama.cpp {version} ({', '.join(targets)}) into {out}; log {log_path}; this takes "
        "15-30 minutes on 2 cores")
    with open(log_path, "w") as f:
        for cmd in (configure, make):
            f.write("$ " + " ".join(cmd) + "\n")
            f.flush()
            if subprocess.run(prefix + cmd, stdout=f, stderr=subprocess.STDOUT).returncode != 0:
                with open(log_path) as g:
                    tail = g.read()[-3000:]
                raise RuntimeError(f"llama.cpp build failed ({' '.join(cmd[:3])}); the end of {log_path}:\n{tail}")
    bin_dir = os.path.join(out, "bin")
    os.makedirs(bin_dir, exist_ok=True)
    for t in targets:  # the binaries are static: they run from any folder
        shutil.copy2(os.path.join(build_dir, "bin", t), os.path.join(bin_dir, t))
    shutil.rmtree(build_dir)
    return LlamaCpp(version, tree, bin_dir)


def convert(lc: LlamaCpp, hf_dir: str, out_path: str, outtype: str = "bf16") -> None:
    """llama.cpp's convert_hf_to_gguf.py on an HF folder. It imports the
    gguf-py of its own tree, torch, numpy and transformers (for the
    tokenizer): nothing else this repo does not already need."""
    script = os.path.join(lc.src, "convert_hf_to_gguf.py")
    cmd = [sys.executable, script, hf_dir, "--outtype", outtype, "--outfile", out_path + ".part"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    os.replace(out_path + ".part", out_path)


def quantize(lc: LlamaCpp, src: str, out_path: str, qtype: str, output_type: str | None, threads: int) -> None:
    """llama-quantize src -> out_path as qtype; output_type sets the output
    (lm_head) tensor's type, None leaves llama-quantize's own choice."""
    cmd = [lc.tool("llama-quantize")]
    if output_type:
        cmd += ["--output-tensor-type", output_type]
    cmd += [src, out_path + ".part", qtype.upper(), str(threads)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed (exit {proc.returncode}):\n{(proc.stdout + proc.stderr)[-3000:]}")
    os.replace(out_path + ".part", out_path)


def bench(lc: LlamaCpp, model: str, threads: int, *, n_gen: int, n_prompt: int, depth: int, reps: int = 1) -> dict:
    """One llama-bench run: {"tg": tok/s of n_gen one-token steps after
    depth tokens of context, "pp": tok/s of an n_prompt prompt (None when
    n_prompt is 0), "raw": llama-bench's JSON}. llama-bench warms each test
    up once before the timed repetitions."""
    cmd = [lc.tool("llama-bench"), "-m", model, "-t", str(threads), "-n", str(n_gen), "-p", str(n_prompt),
           "-d", str(depth), "-r", str(reps), "-o", "json"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    try:
        raw = json.loads(proc.stdout)
    except json.JSONDecodeError:
        raise RuntimeError(f"llama-bench printed no JSON for {model}:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    out = {"tg": None, "pp": None, "raw": raw, "command": " ".join(cmd)}
    for test in raw:
        if test.get("n_gen", 0) > 0 and test.get("n_prompt", 0) == 0:
            out["tg"] = float(test["avg_ts"])
        elif test.get("n_prompt", 0) > 0 and test.get("n_gen", 0) == 0:
            out["pp"] = float(test["avg_ts"])
    if out["tg"] is None:
        raise RuntimeError(f"llama-bench reported no tg test for {model}: {proc.stdout[-2000:]}")
    return out


def tensor_types(path: str) -> dict[str, str]:
    """GGUF tensor name -> its type name (e.g. "TQ2_0")."""
    import gguf
    return {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors}


def bytes_per_token(path: str) -> int:
    """Bytes of the tensors one decode step reads whole: every tensor but the
    token embedding, of which a step reads one row."""
    import gguf
    return sum(int(t.n_bytes) for t in gguf.GGUFReader(path).tensors if t.name != "token_embd.weight")


def differing_tensors(a: str, b: str) -> list[str]:
    """Names of the tensors of GGUF file a that file b lacks or holds with
    another type or other bytes."""
    import gguf
    import numpy as np

    theirs = {t.name: t for t in gguf.GGUFReader(b).tensors}
    out = []
    for t in gguf.GGUFReader(a).tensors:
        u = theirs.get(t.name)
        if u is None or u.tensor_type != t.tensor_type or not np.array_equal(
                np.asarray(t.data).view(np.uint8), np.asarray(u.data).view(np.uint8)):
            out.append(t.name)
    return out

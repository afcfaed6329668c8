"""Instructions per weight of the microkernels, counted under qemu-user.

Without ARM hardware there is nothing to time, but qemu can say which guest
instructions ran: benchmarks/c/insn_count.c (one ulb_linear call on one
thread) is built statically for x86-64 and for aarch64 with the kernel
library as setup.py compiles it, and run under qemu-x86_64 / qemu-aarch64
(-cpu max) with the execution log (-d in_asm,exec,nochain) filtered to the
microkernel objects (panel_*, lut1_*, gemm_* of kernels/x86 or kernels/arm,
and kernels/src/panel_portable.c): the instructions of every translation
block that ran there, summed. Two calls that differ only in K give the
marginal count, so the per-call set-up and the output step drop out:

    per weight = (I(K2) - I(K1)) / (M * (K2 - K1))

for a call of N tokens (per weight and token: divided by N), each ISA with
the kernels the library picks for it by default (ULB_LUT1 auto: the 1-bit
lookups where they serve). The lookup kernels' table building is in the
count (it grows with K, once per token for all M rows). A count is not a time
(instructions differ in cost, and the one-token loops wait on memory), but it
is what the ARM kernels can be compared on here: against the portable kernel
of the same build and against the AVX2 kernels of the same format.

    python benchmarks/insn_per_weight.py \
        --markdown benchmarks/results/archive/aarch64_qemu/$(date +%F)_insn_per_weight.md \
        --json benchmarks/results/aarch64_qemu/$(date +%F)_transcribed.json    # then results/render.py
    python benchmarks/insn_per_weight.py --isas x86_64:avx2,aarch64:dotprod --tokens 1
    python benchmarks/insn_per_weight.py --quick      # one format, one token: a smoke test

Needs gcc, aarch64-linux-gnu-gcc, qemu-x86_64 and qemu-aarch64 (Debian:
gcc-aarch64-linux-gnu, qemu-user). Standard library only.
"""
from __future__ import annotations

import argparse
import collections
import concurrent.futures
import datetime
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CFLAGS = ["-O3", "-std=c11", "-D_GNU_SOURCE", "-ffp-contract=off", "-Wall"]  # setup.py's KERNEL_CFLAGS, less -fPIC
ARCHES = {"x86_64": ("gcc", "qemu-x86_64", "kernels/x86"), "aarch64": ("aarch64-linux-gnu-gcc", "qemu-aarch64",
                                                                     "kernels/arm")}
# (arch, ISA) in table order; each ISA's kernels run under qemu's -cpu max.
ISAS = [("x86_64", "portable"), ("x86_64", "avx2"), ("aarch64", "portable"), ("aarch64", "neon"),
        ("aarch64", "dotprod"), ("aarch64", "i8mm")]
# (format, tile order): the 2-bit maps (int2, ternary) run int2_sym's kernel.
FORMATS = [("binary", "vnni"), ("binary", "lanes"), ("int2_sym", "vnni"), ("int4", "vnni"), ("int8", "vnni")]
KERNEL_OBJECT = re.compile(r"^(panel_|lut1_|gemm_)")
# One software-prefetch distance for every run, the one the AVX2 kernels take
# on every CPU: the automatic rule elsewhere turns it off past 40 KiB groups,
# which would differ between the two K of a marginal count.
PREFETCH = {"ULB_PREFETCH_1BIT": "16384", "ULB_PREFETCH_2BIT": "8192", "ULB_PREFETCH_4BIT": "8192",
            "ULB_PREFETCH_8BIT": "8192"}


def build(arch: str, out: str) -> tuple[str, list[tuple[int, int]]]:
    """The static insn_count for `arch` in `out`, and the address ranges of
    its microkernel objects' code."""
    cc, _, simd = ARCHES[arch]
    sources = [os.path.join(ROOT, "benchmarks", "c", "insn_count.c")]
    for d in ("kernels/src", "kernels/ref", simd):
        sources += sorted(glob.glob(os.path.join(ROOT, d, "*.c")))
    os.makedirs(out, exist_ok=True)
    objects = []

    def compile_one(src):
        obj = os.path.join(out, os.path.basename(src)[:-2] + ".o")
        subprocess.run([cc, *CFLAGS, "-I" + os.path.join(ROOT, "kernels", "include"), "-c", src, "-o", obj],
                       check=True, capture_output=True, text=True)
        return obj

    with concurrent.futures.ThreadPoolExecutor(os.cpu_count() or 2) as pool:
        objects = list(pool.map(compile_one, sources))
    exe, link_map = os.path.join(out, "insn_count"), os.path.join(out, "map.txt")
    subprocess.run([cc, "-static", *objects, "-o", exe, "-lm", "-lpthread", f"-Wl,-Map={link_map}"], check=True,
                   capture_output=True, text=True)
    ranges = []
    with open(link_map) as f:
        text = f.read()
    # " .text  0xADDR  0xSIZE  path/name.o": each object's code
    for m in re.finditer(r"^ \.text\s+0x([0-9a-f]+)\s+0x([0-9a-f]+)\s+(\S+\.o)$", text, re.MULTILINE):
        start, size, obj = int(m.group(1), 16), int(m.group(2), 16), os.path.basename(m.group(3))
        if size and (KERNEL_OBJECT.match(obj) or obj == "panel_portable.o"):
            ranges.append((start, size))
    if not ranges:
        raise SystemExit(f"no microkernel objects found in {link_map}")
    return exe, ranges


def count(arch: str, exe: str, ranges, isa: str, fmt: str, tiles: str, M: int, K: int, N: int, tmp: str) -> int:
    """Guest instructions executed inside `ranges` by one insn_count run."""
    qemu = ARCHES[arch][1]
    log = os.path.join(tmp, f"{arch}_{isa}_{fmt}_{tiles}_{K}_{N}.log")
    filt = ",".join(f"0x{s:x}+0x{n:x}" for s, n in ranges)
    env = {**os.environ, "ULB_ISA": isa, **PREFETCH}
    run = subprocess.run([qemu, "-cpu", "max", "-d", "in_asm,exec,nochain", "-dfilter", filt, "-D", log, exe, fmt,
                          tiles, str(M), str(K), "0", str(N)], capture_output=True, text=True, env=env, timeout=600,
                         check=False)
    if run.returncode != 0 or f"isa {isa} " not in run.stdout:
        raise SystemExit(f"{qemu} {exe} under ULB_ISA={isa}: {run.returncode} {run.stdout} {run.stderr[-2000:]}")
    sizes, execs = {}, collections.Counter()
    pc, n = None, 0
    with open(log) as f:
        for line in f:
            if line.startswith("Trace "):
                execs[int(line.split("[", 1)[1].split("/")[1], 16)] += 1
            elif line.startswith("0x") and ":" in line:
                addr = int(line.split(":", 1)[0], 16)
                if pc is None:
                    pc, n = addr, 0
                n += 1
            elif pc is not None and not line.strip():  # a block's listing ends with a blank line
                sizes[pc], pc = n, None
    if pc is not None:
        sizes[pc] = n
    os.remove(log)
    missing = [hex(a) for a in execs if a not in sizes]
    if missing:
        raise SystemExit(f"{log}: blocks ran whose listing is missing: {missing[:5]}")
    return sum(sizes[a] * c for a, c in execs.items())


def first_line(cmd) -> str:
    return subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.splitlines()[0]


def results_rows(results: dict, isas, formats, Ns, command: str, source: str) -> list[dict]:
    """Rows of benchmarks/results (a transcription, render.py): per format and
    N, the fewest instructions per weight of the ARM kernels against the AVX2
    kernel and the aarch64 portable one."""
    rows = []
    arm = [i for a, i in isas if a == "aarch64" and i != "portable"]
    for fmt, tiles in formats:
        for N in Ns:
            per = {i: results[("aarch64", i, fmt, tiles, N)] for i in arm}
            low = min(per.values())
            best = ", ".join(i for i, v in per.items() if round(v, 4) == round(low, 4))  # the lookups tie
            avx2, port = results[("x86_64", "avx2", fmt, tiles, N)], results[("aarch64", "portable", fmt, tiles, N)]
            tokens = f"{N} token" + ("s" if N > 1 else "")
            each = ", ".join(f"{i} {v:.3f}" for i, v in per.items())
            rows.append({"what": f"microkernel instructions per weight, {fmt} ({tiles} tiles), a call of {tokens}",
                         "ours": f"{low:.3f} ({best}; {each})",
                         "vs_peer": f"{low / avx2:.2f}x the AVX2 kernel's {avx2:.3f}, "
                                    f"{low / port:.2f}x the aarch64 portable kernel's {port:.3f}",
                         "command": command, "transcribed_from": source})
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--M", type=int, default=512, help="rows (8 panels)")
    p.add_argument("--K", default="2048,4096", help="the two K of the marginal count")
    p.add_argument("--tokens", default="1,4,8", help="N of the calls (8: the i8mm GEMM's block)")
    p.add_argument("--isas", help="arch:isa pairs to count, e.g. x86_64:avx2,aarch64:dotprod (default: all)")
    p.add_argument("--quick", action="store_true", help="int2_sym, one token, M 128, K 512,1024: a smoke test")
    p.add_argument("--markdown", help="write the table as markdown")
    p.add_argument("--json", help="with --markdown and every ISA: write a row per format and N for "
                                  "benchmarks/results (a transcription of the markdown, which render.py reads)")
    args = p.parse_args()
    for tool in ("gcc", "aarch64-linux-gnu-gcc", "qemu-x86_64", "qemu-aarch64"):
        if shutil.which(tool) is None:
            raise SystemExit(f"{tool} not found (Debian: apt-get install gcc-aarch64-linux-gnu qemu-user)")
    isas = ISAS if not args.isas else [tuple(a.split(":")) for a in args.isas.split(",")]
    M, formats = args.M, FORMATS
    K1, K2 = (int(k) for k in args.K.split(","))
    Ns = [int(n) for n in args.tokens.split(",")]
    if args.quick:
        M, K1, K2, Ns, formats = 128, 512, 1024, [1], [("int2_sym", "vnni")]
    with tempfile.TemporaryDirectory() as tmp:
        built = {arch: build(arch, os.path.join(tmp, arch)) for arch in dict.fromkeys(a for a, _ in isas)}
        jobs = [(arch, isa, fmt, tiles, N) for fmt, tiles in formats for N in Ns for arch, isa in isas]

        def per_weight(job):
            arch, isa, fmt, tiles, N = job
            exe, ranges = built[arch]
            i1, i2 = (count(arch, exe, ranges, isa, fmt, tiles, M, K, N, tmp) for K in (K1, K2))
            return (i2 - i1) / (M * (K2 - K1))

        with concurrent.futures.ThreadPoolExecutor(os.cpu_count() or 2) as pool:
            results = dict(zip(jobs, pool.map(per_weight, jobs)))
    compare = ("x86_64", "avx2") in isas and any(a == "aarch64" and i != "portable" for a, i in isas)
    head = ["format", "tiles", "N"] + [f"{arch} {isa}" for arch, isa in isas] + (["best ARM / AVX2"] if compare else [])
    rows = []
    for fmt, tiles in formats:
        for N in Ns:
            vals = {(arch, isa): results[(arch, isa, fmt, tiles, N)] for arch, isa in isas}
            row = [fmt, tiles, N] + [round(vals[k], 4) for k in isas]
            if compare:
                best_arm = min(v for (arch, isa), v in vals.items() if arch == "aarch64" and isa != "portable")
                row.append(round(best_arm / vals[("x86_64", "avx2")], 3))
            rows.append(row)
    command = "python benchmarks/insn_per_weight.py " + " ".join(sys.argv[1:])
    tools = "; ".join(first_line([t, "--version"]) for t in ("qemu-aarch64", "gcc", "aarch64-linux-gnu-gcc"))
    note = (f"Instructions per weight for one call of N tokens, marginal in K (M {M}, K {K1} -> {K2}, "
            "one group per row, one thread, software prefetch 16 KiB ahead for 1-bit codes and 8 KiB for the "
            f"others), counted under qemu-user -cpu max; lower is fewer. Tools: {tools}.")
    widths = [max(len(str(r[i])) for r in [head] + rows) for i in range(len(head))]
    lines = ["| " + " | ".join(str(c).ljust(w) for c, w in zip(r, widths)) + " |" for r in [head] + rows]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    text = "\n".join([note, "", *lines, "", f"Command: `{command}`", ""])
    print(text)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text)
    if args.json:
        if not args.markdown or set(isas) != set(ISAS):
            raise SystemExit("--json needs --markdown and every ISA")
        results_dir = os.path.join(ROOT, "benchmarks", "results")
        source = os.path.relpath(os.path.abspath(args.markdown), results_dir)
        machine = {"cpu": "instruction counts under qemu-user (-cpu max), one thread, no timing, on an x86-64 VM",
                   "cores": os.cpu_count(), "isa": "aarch64 neon, dotprod, i8mm and portable; x86-64 avx2 and portable"}
        with open(args.json, "w") as f:
            json.dump({"machine": machine, "transcribed_from": source, "date": datetime.date.today().isoformat(),
                       "rows": results_rows(results, isas, formats, Ns, command, source)}, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()

"""Instructions per weight of the Triton GEMV's inner loop, from the machine
code Triton compiles for a GPU it need not have (sm_90: H100/H200), for
every code width at the block sizes ulbtorch uses (ulbtorch/triton/gemv.py
CONFIGS) and any others given. A stand-in for timings where no GPU is at
hand: a GEMV stays memory-bound only while the SMs issue its instructions
faster than HBM delivers its weights, so this prints, beside the count, the
most instructions per weight an H200 can issue (132 SMs x 64 int32 lanes x
1.98 GHz) at its HBM rate (4.8 TB/s) for that code width.

    python benchmarks/triton_sass.py [--also 2:64:256:4,...] [--json out.json]

It compiles with Triton's bundled ptxas and reads the SASS with its bundled
cuobjdump; the loop is the longest backward branch of the kernel.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys

os.environ.pop("TRITON_INTERPRET", None)  # the interpreter's triton.jit does not compile

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import Table, write_outputs  # noqa: E402

from ulbtorch import FORMATS  # noqa: E402
from ulbtorch.triton import gemv  # noqa: E402
from ulbtorch.triton.kernel_parts import LAUNCH_OPTIONS  # noqa: E402

BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
H200_ISSUE = 132 * 64 * 1.98e9  # int32 lane-instructions per second
H200_HBM = 4.8e12  # bytes per second
LEVELS = {f.bits: (f.level_a, f.level_b) for f in FORMATS.values()}


def loop_instructions(cubin: bytes, path: str) -> int:
    with open(path, "wb") as f:
        f.write(cubin)
    sass = subprocess.run([os.path.join(BIN, "cuobjdump"), "-sass", path], capture_output=True, text=True,
                          check=True).stdout
    spans = [int(a, 16) - int(b, 16) for a, b in re.findall(r"/\*([0-9a-f]+)\*/\s+@!?P\d BRA 0x([0-9a-f]+)", sass)
             if int(b, 16) < int(a, 16)]
    return max(spans) // 16 + 1


def gemv_loop(bits: int, block_m: int, block_k: int, warps: int, tmp: str) -> dict:
    i32 = "i32"
    sig = {"xpack_ptr": "*i32", "words_ptr": "*i32", "part_ptr": "*i32",
           **{a: i32 for a in ("N", "M", "M_pad", "K_pad", "SEG_WORDS", "SEGS", "SEGS_PER_PROGRAM")},
           **{a: "constexpr" for a in ("BITS", "LEVEL_A", "LEVEL_B", "BLOCK_M", "BLOCK_W", "PTX")}}
    # What a launch specialises: 16-byte aligned pointers, M_pad and K_pad multiples of 16.
    attrs = {(i,): [["tt.divisibility", 16]] for i in (0, 1, 2, 5, 6)}
    a, b = LEVELS[bits]
    k = triton.compile(ASTSource(fn=gemv.gemv_sums_kernel, signature=sig, attrs=attrs, constexprs=dict(
        BITS=bits, LEVEL_A=a, LEVEL_B=b, BLOCK_M=block_m, BLOCK_W=block_k * bits // 32, PTX=True)),
        target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, **LAUNCH_OPTIONS))
    n = loop_instructions(k.asm["cubin"], tmp)
    per_thread = block_m * block_k / (32 * warps)
    bound = H200_ISSUE / (H200_HBM * 8 / bits)
    return dict(bits=bits, block_m=block_m, block_k=block_k, warps=warps, loop=n, weights=per_thread,
                per_weight=n / per_thread, h200_bound=bound, used=gemv.CONFIGS[bits] == (block_m, block_k, warps))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--also", default="", help="more configs, bits:block_m:block_k:warps,...")
    p.add_argument("--json")
    a = p.parse_args()
    configs = [(bits, *cfg) for bits, cfg in sorted(gemv.CONFIGS.items())]
    configs += [tuple(int(v) for v in c.split(":")) for c in a.also.split(",") if c]
    t = Table([("bits", "bits", None), ("block_m", "rows", None), ("block_k", "codes", None),
               ("warps", "warps", None), ("loop", "loop instr", None), ("weights", "weights/thread", ".0f"),
               ("per_weight", "instr/weight", ".2f"), ("h200_bound", "H200 bound", ".2f"), ("used", "used", None)],
              title="GEMV inner loop, sm_90 SASS")
    tmp = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"ulb_sass_{os.getpid()}.cubin")
    try:
        for c in configs:
            t.add(gemv_loop(*c, tmp), echo=True)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    env = dict(cpu="none: Triton's compiler for sm_90 (no GPU)", cores="-", isa="sm_90 SASS",
               supported_isas=[], torch=torch.__version__, triton=triton.__version__)
    write_outputs([t], json_path=a.json, meta={"env": env},
                  notes=["H200 bound: the most instructions per weight at which the SMs keep up with HBM"])


if __name__ == "__main__":
    main()

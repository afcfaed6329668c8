"""The Triton kernels compile for real GPUs, not only run in the
interpreter: each one through Triton's whole pipeline to a CUDA cubin
(sm_90, with Triton's own ptxas) and one to an AMD code object, no GPU
needed; and the PTX has what bit-exactness rests on: the activation
scale's division correctly rounded (div.rn), no fused multiply-add in the
float steps, the GEMV's byte dot products as dp4a, int8 tensor-core
products into int32 in the GEMM. In a
subprocess: the tests' TRITON_INTERPRET=1 (conftest.py) makes triton.jit
build interpreter functions, which do not compile."""
import json
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton")

SCRIPT = textwrap.dedent('''
    import json, re
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from ulbtorch.triton import act_quant, gemm, gemv
    from ulbtorch.triton.kernel_parts import LAUNCH_OPTIONS  # what every launch passes

    def ptx(fn, sig, consts, target=GPUTarget("cuda", 90, 32)):
        k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=target,
                           options=LAUNCH_OPTIONS)
        return k.asm.get("ptx") or k.asm.get("amdgcn")

    i32, out = "i32", {}
    aq = ptx(act_quant._quantize_rows, {"x_ptr": "*bf16", "ldx": i32, "incx": i32, "xq_ptr": "*i8",
             "xscale_ptr": "*fp32", "K": i32, "K_pad": i32, "BLOCK": "constexpr"}, {"BLOCK": 1024})
    out["act_quant"] = dict(div=sorted(set(re.findall(r"div\\.[a-z0-9.]+", aq))), fma=aq.count("fma."))
    sums_sig = {"xpack_ptr": "*i32", "words_ptr": "*i32", "part_ptr": "*i32", **{a: i32 for a in (
        "N", "M", "M_pad", "K_pad", "SEG_WORDS", "SEGS", "SEGS_PER_PROGRAM")}, **{a: "constexpr" for a in (
        "BITS", "LEVEL_A", "LEVEL_B", "BLOCK_M", "BLOCK_W", "PTX")}}
    gemm_sig = {"xq_ptr": "*i8", "xscale_ptr": "*fp32", "words_ptr": "*i32", "scales_ptr": "*fp32",
                "bias_ptr": "*fp32", "y_ptr": "*i16", "sums_ptr": "*i32", **{a: i32 for a in (
                "N", "M", "M_pad", "K_pad", "G", "GS", "ldy")}, **{a: "constexpr" for a in (
                "BITS", "LEVEL_A", "LEVEL_B", "BLOCK_N", "BLOCK_M", "BLOCK_W", "HAS_BIAS", "Y_KIND", "SUMS")}}
    for bits, a, b in ((1, 2, -1), (2, 2, -3), (4, 1, -8), (8, 1, -127)):
        lev = dict(BITS=bits, LEVEL_A=a, LEVEL_B=b)
        block_m, block_k, _ = gemv.CONFIGS[bits]
        sm = ptx(gemv.gemv_sums_kernel, sums_sig, dict(**lev, BLOCK_M=block_m, BLOCK_W=block_k * bits // 32, PTX=True))
        out[f"gemv{bits}"] = dict(dp4a=sm.count("dp4a.u32.s32"))
        g = ptx(gemm.gemm_kernel, gemm_sig, dict(**lev, BLOCK_N=32, BLOCK_M=64, BLOCK_W=64 * bits // 32,
                                                  HAS_BIAS=True, Y_KIND=1, SUMS=False))
        out[f"gemm{bits}"] = dict(mma=sorted(set(re.findall(r"mma\\.[a-z0-9.]+", g))), fma=g.count("fma."))
    st = ptx(gemv.gemv_store_kernel, {"part_ptr": "*i32", "xscale_ptr": "*fp32", "scales_ptr": "*fp32",
             "bias_ptr": "*bf16", "y_ptr": "*i16", "sums_ptr": "*i32", **{a: i32 for a in (
             "N", "M", "M_pad", "G", "SEGS", "SEGS_PER_GROUP", "ldy")}, **{a: "constexpr" for a in (
             "BLOCK_M", "HAS_BIAS", "Y_KIND", "SUMS")}}, dict(BLOCK_M=32, HAS_BIAS=True, Y_KIND=1, SUMS=False))
    out["store"] = dict(fma=st.count("fma."))
    ptx(gemv.gemv_sums_kernel, sums_sig, dict(BITS=2, LEVEL_A=1, LEVEL_B=-1, BLOCK_M=32, BLOCK_W=8, PTX=False),
        target=GPUTarget("hip", "gfx942", 64))
    print(json.dumps(out))
''')


def test_kernels_compile_for_gpus():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # Triton's default (3.9): the launch options must turn fusion off
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["act_quant"] == dict(div=["div.rn.f32"], fma=0)
    assert out["store"]["fma"] == 0
    for bits in (1, 2, 4, 8):
        assert out[f"gemv{bits}"]["dp4a"] > 0
        assert out[f"gemm{bits}"]["fma"] == 0
        assert any(m.endswith(".s32.s8.s8.s32") for m in out[f"gemm{bits}"]["mma"]), out[f"gemm{bits}"]

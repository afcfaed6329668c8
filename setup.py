"""Build ulbtorch._C: the C kernels (kernels/, a static library) plus one thin
C++ file of op registrations (csrc/) against the LibTorch stable ABI; and
ulbtorch._eager, the modules' eager-mode call of those kernels, against the
classic C++ API of the installed torch (used only under that torch version).

Build with the torch already installed: pip install --no-build-isolation -e .
"""
import glob
import os
import platform
import sys

import torch
from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

ROOT = os.path.dirname(os.path.abspath(__file__))


class BuildExtensionOptional(BuildExtension):
    """PyTorch's BuildExtension, where an extension marked optional that fails
    to build is left out with a warning: its ninja build raises errors that
    setuptools' own `optional` handling does not catch."""

    def build_extension(self, ext):
        try:
            super().build_extension(ext)
        except Exception as e:  # noqa: BLE001  (any build failure of an optional part)
            if not ext.optional:
                raise
            print(f"WARNING: {ext.name} not built, the ops serve its calls instead: {e}")


# The SIMD kernels of kernels/x86 only where the compiler targets x86-64, and
# those of kernels/arm only on AArch64 Linux (isa.c reads the HWCAPs there:
# ULB_ARM in kernels/src/internal.h); elsewhere the calls run the portable
# kernel of kernels/src (ISA "portable"), which isa.c selects when no SIMD ISA
# is compiled in.
MACHINE = platform.machine().lower()
X86 = MACHINE in ("x86_64", "amd64")
ARM = MACHINE in ("aarch64", "arm64") and sys.platform.startswith("linux")
SIMD_DIRS = ("kernels/x86",) if X86 else ("kernels/arm",) if ARM else ()
KERNEL_SOURCES = sorted(
    os.path.relpath(p, ROOT)
    for d in ("kernels/src", "kernels/ref") + SIMD_DIRS
    for p in glob.glob(os.path.join(ROOT, d, "*.c"))
)
# Identical rounding on every ISA path needs multiply and add kept separate.
KERNEL_CFLAGS = ["-O3", "-std=c11", "-fPIC", "-D_GNU_SOURCE", "-ffp-contract=off", "-Wall"]

setup(
    libraries=[
        (
            "ulbkernels",
            {"sources": KERNEL_SOURCES, "include_dirs": ["kernels/include"], "cflags": KERNEL_CFLAGS},
        )
    ],
    ext_modules=[
        CppExtension(
            "ulbtorch._C",
            ["csrc/ops.cpp"],
            include_dirs=[os.path.join(ROOT, "kernels/include")],
            extra_compile_args={
                "cxx": [
                    "-O2",
                    "-DPy_LIMITED_API=0x03090000",
                    # Stable ABI of torch 2.10: one build serves any newer torch.
                    "-DTORCH_TARGET_VERSION=0x020a000000000000",
                ]
            },
            extra_link_args=["-lpthread"],
            py_limited_api=True,
        ),
        CppExtension(
            "ulbtorch._eager",
            ["csrc/eager.cpp"],
            include_dirs=[os.path.join(ROOT, "kernels/include")],
            extra_compile_args={"cxx": ["-O2", f'-DULB_EAGER_TORCH_VERSION="{torch.__version__}"']},
            optional=True,  # a torch whose C++ API it does not build against: the op serves instead
        ),
    ],
    cmdclass={"build_ext": BuildExtensionOptional},
    options={"bdist_wheel": {"py_limited_api": "cp39"}},
)

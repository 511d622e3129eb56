"""llama.cpp's build flags for this CPU, from /proc/cpuinfo.

Why not ``-DGGML_NATIVE=ON``: ``-march=native`` turns AMX on where the CPU has it, and the llama.cpp of
llama-cpp-python 0.3.36 built that way puts the Q4_1 weights in its AMX buffer and segfaults in
``ggml_backend_amx_mul_mat`` on the first prompt (seen on a Xeon with AMX). Spelling out the instruction
sets the CPU lists, AMX left out, gives the same code otherwise. Why not one fixed list: a binary built
for another CPU dies with SIGILL (an AMD EPYC has AVX512-VNNI but not AVX-VNNI).

``python -m benchmarks.peers.llama --cmake-args`` prints the flags (``install.sh`` builds with them).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

#: GGML's CPU options and the /proc/cpuinfo flag each needs (AMX left out: see the module docstring)
LLAMA_ISA_OPTIONS = (
    ("GGML_AVX", "avx"),
    ("GGML_AVX2", "avx2"),
    ("GGML_FMA", "fma"),
    ("GGML_F16C", "f16c"),
    ("GGML_BMI2", "bmi2"),
    ("GGML_AVX_VNNI", "avx_vnni"),
    ("GGML_AVX512", "avx512f"),
    ("GGML_AVX512_VBMI", "avx512vbmi"),
    ("GGML_AVX512_VNNI", "avx512_vnni"),
    ("GGML_AVX512_BF16", "avx512_bf16"),
)


def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> set[str]:
    """The instruction-set flags of this CPU (empty where /proc/cpuinfo is unreadable)."""
    from specdec.runtime.backends.onnxruntime import cpu_flags as read_flags

    return read_flags(cpuinfo) or set()


def llama_cmake_args(flags: set[str]) -> str:
    """CMake options for llama.cpp that turn on exactly the instruction sets ``flags`` lists, AMX excepted."""
    return " ".join(
        ["-DGGML_NATIVE=OFF", *(f"-D{option}={'ON' if flag in flags else 'OFF'}" for option, flag in LLAMA_ISA_OPTIONS)]
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cmake-args", action="store_true", help="print llama.cpp's CMake options for this CPU")
    args = parser.parse_args(argv)
    if not args.cmake_args:
        parser.print_help()
        return 2
    print(llama_cmake_args(cpu_flags()))
    return 0


if __name__ == "__main__":
    sys.exit(main())

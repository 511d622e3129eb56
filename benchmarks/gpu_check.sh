#!/usr/bin/env bash
# GPU check of the Triton RaggedTreeAttention kernel (correctness vs the torch reference + timing).
# The GPU image has torch and triton but not this package installed: put the repo on PYTHONPATH.
# Results: $OUT/gpu_check.{json,md} when $OUT is set, else benchmarks/results/. Extra args go to python -m benchmarks.gpu_check.
# Exit: 0 pass or "SKIPPED: no CUDA", 1 mismatch, 3 triton missing, 124 hard timeout (7m50s).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(dirname "$here")"
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET  # compiled kernels, never the interpreter
py="${PYTHON:-$(command -v python3 || command -v python)}"
cd "$repo"
exec timeout 470 "$py" -m benchmarks.gpu_check "$@"

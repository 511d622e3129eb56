#!/usr/bin/env bash
# The edge benchmark's CPU peers, each in a virtual environment of its own (their pins conflict with the
# project's and with each other's), never dependencies of the specdec package:
#
#   .work/peers/ortgenai   onnxruntime-genai (its model builder and Generator API)
#   .work/peers/openvino   openvino-genai, optimum-intel[openvino], nncf (optimum-cli export openvino)
#   .work/peers/llama.cpp  llama-server, llama-perplexity and llama-quantize built natively with cmake from the
#                          llama.cpp source that the llama-cpp-python sdist vendors (vendor/llama.cpp)
#
# Idempotent: a peer whose stamp file exists is skipped (rm its folder, or pass --force, to redo it).
# Usage: bash benchmarks/peers/install.sh [--force] [ortgenai] [openvino] [llama.cpp]   (default: all three)
# Run from the repository root with the project's venv active (its python prints llama.cpp's CPU flags).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
PEERS=${SPECDEC_PEERS_DIR:-$ROOT/.work/peers}
BASE_PYTHON=${PEERS_BASE_PYTHON:-python3}
PROJECT_PYTHON=${PROJECT_PYTHON:-python}
JOBS=${PEERS_BUILD_JOBS:-2}
# the pins: what the benchmark was written and smoke-tested against
TORCH_PIN="torch==2.13.0"  # the project's CPU build; an open range would pull a CUDA build of several GB
# optimum-intel requires torchvision, and PyPI's torchvision needs torch >= 2.14: the pair that installs together
# (the CUDA build, about 6 GB in that venv; only its CPU code runs)
OPENVINO_TORCH_PINS=("torch==2.14.1" "torchvision==0.29.1")
ORT_GENAI_PIN="onnxruntime-genai==0.18.0"
OPENVINO_PINS=("openvino-genai==2026.4.1.0" "optimum-intel[openvino]==2.2.0" "nncf==3.4.0")
LLAMA_CPP_PYTHON_PIN="llama-cpp-python==0.3.36"

force=0
wanted=()
for arg in "$@"; do
  case "$arg" in
    --force) force=1 ;;
    ortgenai|openvino|llama.cpp) wanted+=("$arg") ;;
    *) echo "unknown argument: $arg (expected --force, ortgenai, openvino, llama.cpp)" >&2; exit 2 ;;
  esac
done
[ ${#wanted[@]} -eq 0 ] && wanted=(ortgenai openvino llama.cpp)

done_already() {  # $1: peer folder; true when its stamp exists and --force was not given
  [ "$force" = 0 ] && [ -f "$1/.installed" ]
}

make_venv() {  # $1: folder; a fresh venv with a current pip
  rm -rf "$1"
  "$BASE_PYTHON" -m venv "$1"
  "$1/bin/pip" install --quiet --upgrade pip
}

install_ortgenai() {
  local dir=$PEERS/ortgenai
  if done_already "$dir"; then echo "ortgenai: installed ($dir)"; return; fi
  echo "ortgenai: creating $dir"
  make_venv "$dir"
  # the model builder imports torch and transformers to read the HF checkpoint
  "$dir/bin/pip" install --quiet "$TORCH_PIN"
  "$dir/bin/pip" install --quiet "$ORT_GENAI_PIN" transformers onnx onnx-ir
  "$dir/bin/pip" freeze > "$dir/.installed"
}

install_openvino() {
  local dir=$PEERS/openvino
  if done_already "$dir"; then echo "openvino: installed ($dir)"; return; fi
  echo "openvino: creating $dir"
  make_venv "$dir"
  "$dir/bin/pip" install --quiet "${OPENVINO_TORCH_PINS[@]}"
  "$dir/bin/pip" install --quiet "${OPENVINO_PINS[@]}"
  "$dir/bin/pip" freeze > "$dir/.installed"
}

install_llama_cpp() {
  local dir=$PEERS/llama.cpp
  if done_already "$dir"; then echo "llama.cpp: installed ($dir)"; return; fi
  echo "llama.cpp: building in $dir ($JOBS jobs)"
  rm -rf "$dir" && mkdir -p "$dir/sdist"
  "$BASE_PYTHON" -m pip download --quiet --no-binary :all: --no-deps "$LLAMA_CPP_PYTHON_PIN" -d "$dir/sdist"
  tar -xzf "$dir"/sdist/llama_cpp_python-*.tar.gz -C "$dir/sdist"
  local src
  src=$(echo "$dir"/sdist/llama_cpp_python-*/vendor/llama.cpp)
  # This CPU's instruction sets spelled out, AMX left out, instead of -DGGML_NATIVE=ON: -march=native turns AMX on
  # where the CPU has it, and that build's Q4_1 path crashed in ggml_backend_amx_mul_mat (benchmarks/peers/llama.py)
  local isa
  isa=$(cd "$ROOT" && "$PROJECT_PYTHON" -m benchmarks.peers.llama --cmake-args)
  # shellcheck disable=SC2086
  cmake -S "$src" -B "$dir/build" -DCMAKE_BUILD_TYPE=Release -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_CURL=OFF -DBUILD_SHARED_LIBS=OFF $isa > "$dir/cmake.log"
  cmake --build "$dir/build" -j "$JOBS" --target llama-server llama-perplexity llama-quantize > "$dir/build.log"
  echo "$isa" > "$dir/cmake_args.txt"
  "$dir/build/bin/llama-server" --version > "$dir/.installed" 2>&1
}

mkdir -p "$PEERS"
for peer in "${wanted[@]}"; do
  case "$peer" in
    ortgenai) install_ortgenai ;;
    openvino) install_openvino ;;
    llama.cpp) install_llama_cpp ;;
  esac
done
echo "peers ready under $PEERS"

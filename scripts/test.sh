#!/usr/bin/env bash
# The test command: set up the environment, lint, and run the whole test suite
# (real SmolLM2 tests included; GPU/TensorRT tests skip cleanly without the hardware).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
. .venv/bin/activate
ruff check .
python -m pytest -q "$@"

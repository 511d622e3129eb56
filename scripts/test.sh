#!/usr/bin/env bash
# The test command: set up the environment, lint, check the formatting and the types (the same checks as
# .pre-commit-config.yaml), and run the whole test suite
# (real SmolLM2, tritonserver and statistical tests included; GPU/TensorRT tests skip cleanly without the
# hardware), printing the 20 slowest tests so a test that grows slow is seen in CI.
# The inner loop while editing is scripts/test_fast.sh (-m "not slow").
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
. .venv/bin/activate
ruff check .
ruff format --check .
mypy  # its scope and settings: [tool.mypy] in pyproject.toml
python -m pytest -q --durations=20 "$@"

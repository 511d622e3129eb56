#!/usr/bin/env bash
# The inner loop: every test except the slow tiers (real_model: loads SmolLM2-135M; server: starts a
# tritonserver; statistical: Monte-Carlo law checks), under two minutes on the 2-core CI machine, in one pytest
# worker per core (pytest-xdist: the tiny-model tests are CPU-bound and independent; one worker took ~130 s).
# A test that loads the real model without the real_model marker fails here (tests/conftest.py).
# Extra arguments go to pytest, e.g. `bash scripts/test_fast.sh tests/test_loop_control.py -x`.
# Expects the environment that scripts/setup_env.sh makes; scripts/test.sh runs everything.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh  # idempotent: installs only what pyproject.toml added since
. .venv/bin/activate
python -m pytest -q -m "not slow" -n auto --durations=10 "$@"

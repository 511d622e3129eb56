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
# Two passes, so that CI stays well inside its 30 minutes on 2 cores: every test that starts no server, in one
# pytest-xdist worker per core (a test file stays in one worker, so its module fixtures are made once), then the
# server tier alone, one test at a time (its tests time repairs and drains against a real tritonserver and must
# not share the cores with another worker's). The converted SmolLM2 is cached first: two workers converting it
# at once would replace each other's copy under a reader.
python -c "from specdec.models.loading import load_model; load_model('smollm2-135m')"
status=0
python -m pytest -q -m "not server" -n auto --dist loadfile --durations=20 "$@" || status=$?
[ "$status" -eq 5 ] && status=0  # 5: the arguments selected no such test (e.g. one server test file)
server_status=0
python -m pytest -q -m server --durations=20 "$@" || server_status=$?
[ "$server_status" -eq 5 ] && server_status=0
exit $((status || server_status))

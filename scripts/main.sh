#!/usr/bin/env bash
# The main job: decode a batch of chat prompts on SmolLM2-135M with EMS-SD (n-gram drafter),
# print the answers and per-request acceptance, and the speed-up over autoregressive decoding.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
. .venv/bin/activate
exec specdec generate --target smollm2-135m --method ems --chat --compare-ar --max-tokens 96 \
  --num-draft-tokens 6 "$@"

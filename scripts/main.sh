#!/usr/bin/env bash
# The main job: export the default model pair (SmolLM2-135M target, n-gram drafter) to ONNX with
# the RaggedTreeAttention op, then decode a batch of chat prompts from that export on ONNX Runtime
# with EMS-SD, printing the answers, per-request acceptance, and the speed-up over autoregressive
# decoding measured on the same backend.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
. .venv/bin/activate
specdec-export --target smollm2-135m --out deploy --force --max-batch 8 --max-len 2048
exec specdec generate --target deploy --method ems --chat --compare-ar --max-tokens 96 \
  --num-draft-tokens 6 "$@"

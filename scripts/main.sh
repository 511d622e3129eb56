#!/usr/bin/env bash
# The main job: export the default model pair (SmolLM2-135M target with its shipped distilled draft) to
# ONNX with the RaggedTreeAttention op and its Triton model repository, start Triton Inference Server on
# free loopback ports, send the demo mix of chat requests over gRPC (EMS-SD and method=ar interleaved, all
# at once, then one at a time), print the answers, per-request acceptance, tokens/s and the speed-up, show one
# streamed answer and one DSBD (speculative beam sampling) answer, send one chat request through the OpenAI-compatible
# API with the official openai SDK (scripts/openai_request.py), and stop the server. Extra arguments go to
# the client (e.g. --max-tokens 64). EMS-SD runs with the adaptive draft length: each sequence drafts 0-4
# tokens per step, as its own acceptance says pays on this machine, priced by what a draft token and a
# verified row cost here (--calibrate times the exported graphs before the server starts), drafting by prompt
# lookup where a request's context has a match and by the draft model elsewhere (--drafter hybrid). The graphs
# are w8a8 (ONNX Runtime's integer GEMM over int8 weights per channel and int8 activations per token, smoothed
# on calibration prompts: row-independent, so ems answers equal ar's bit for bit): of the candidate exports
# served with this job's requests, the fastest exact one on this CPU that serves DSBD, whose forests need the
# draft model in the drafter (benchmarks/results/served_configs.md; int4 keeps the GGUF's own blocks and is
# closer to fp32, docs/export.md). Its KV caches are fp16, the quantized exports' default: with the folded
# attention layout ONNX Runtime converts them once per kv head, and fp16 caches ran as fast as fp32 ones on
# this CPU (benchmarks/results/edge_cpu.md, its fp32-caches rows; attention_layout.md).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
. .venv/bin/activate
specdec-export --target smollm2-135m --draft smollm2-135m-draft --quantize w8a8 --drafter hybrid --out deploy --force --max-batch 8 \
  --max-len 2048 --num-draft-tokens 4 --adaptive-draft --calibrate

read -r GRPC HTTP METRICS OPENAI < <(python -c "from specdec.serving.server import free_ports; print(*free_ports(4))")
specdec serve deploy --grpc-port "$GRPC" --http-port "$HTTP" --metrics-port "$METRICS" --openai-port "$OPENAI" &
SERVER=$!
trap 'kill -INT "$SERVER" 2>/dev/null || true; wait "$SERVER" 2>/dev/null || true' EXIT
until specdec client --url "127.0.0.1:$GRPC" --wait 1 --prompt ping --max-tokens 1 >/dev/null 2>&1; do
  kill -0 "$SERVER" 2>/dev/null || { echo "error: the server exited before it was ready" >&2; exit 1; }
  sleep 2
done

echo "the demo mix, all six requests at once (throughput; ems and ar interleaved, after a warm-up):"
specdec client --url "127.0.0.1:$GRPC" --chat --max-tokens 96 --compare-ar --repeats 3 "$@"
echo
echo "the same requests one at a time (latency: one sequence per step, where speculation pays on 2 cores):"
specdec client --url "127.0.0.1:$GRPC" --chat --max-tokens 96 --compare-ar --repeats 3 --concurrency 1 --summary "$@"
echo
echo "streamed through specdec_stream:"
specdec client --url "127.0.0.1:$GRPC" --chat --stream --max-tokens 60 \
  --prompt "Explain in three sentences why the sky is blue."
echo
echo "DSBD through specdec (the draft beam-samples up to 3 layers of 3 nodes, as many as pay; fixed width 3, temperature 1):"
specdec client --url "127.0.0.1:$GRPC" --chat --method dsbd --beam-width 3 --dsbd-threshold 0 \
  --num-draft-tokens 3 --temperature 1 --seed 0 --max-tokens 48 --prompt "Give me three tips for better sleep."
echo
echo "one request through the OpenAI-compatible API (http://127.0.0.1:$OPENAI/v1) with the official openai SDK:"
python scripts/openai_request.py "http://127.0.0.1:$OPENAI/v1"
echo
echo "server-side metrics (Prometheus, 127.0.0.1:$METRICS/metrics):"
python -c "import sys, urllib.request; print(''.join(l + '\n' for l in urllib.request.urlopen(sys.argv[1]).read()
    .decode().splitlines() if l.startswith('specdec_')), end='')" "http://127.0.0.1:$METRICS/metrics"

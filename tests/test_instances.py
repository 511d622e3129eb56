"""Engine instances inside one server (``ServingOptions.instances``, ``specdec-export --instances``): each
instance is its own stub process with its own decoding loops and KV caches, Triton spreads the requests over
them, every answer equals the single-instance answer, and a cancel reaches the instance that holds the request.

A REAL tritonserver on loopback with the real SmolLM2 export; answers are compared token for token with the local
runtime. The render tests are fast and need neither."""

from __future__ import annotations

import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from servers import eventually, free_ports, processes_mentioning, samples

from specdec.runtime.config import EngineConfig
from specdec.serving import protocol
from specdec.serving.repository import ServingOptions, render_configs


def test_the_engine_gets_its_instance_group_and_the_other_models_keep_one() -> None:
    cpu = render_configs("../x", ServingOptions(instances=3))
    assert "instance_group [ { kind: KIND_CPU count: 3 } ]" in cpu[protocol.ENGINE_MODEL]
    gpu = render_configs("../x", ServingOptions(instances=2, gpus=(0, 1)))
    assert "instance_group [ { kind: KIND_GPU count: 2 gpus: [ 0, 1 ] } ]" in gpu[protocol.ENGINE_MODEL]
    for configs in (cpu, gpu):
        for model in protocol.MODELS:
            if model != protocol.ENGINE_MODEL:
                assert "instance_group [ { kind: KIND_CPU count: 1 } ]" in configs[model], model
    with pytest.raises(ValueError, match="instances"):
        ServingOptions(instances=0)
    with pytest.raises(ValueError, match="distinct"):
        ServingOptions(gpus=(1, 1))


def test_specdec_export_writes_the_instances_and_records_the_command_as_typed(tmp_path: Path) -> None:
    import json
    import shlex

    from specdec.export.cli import main as export_main

    out = tmp_path / "with space"
    argv = [
        "--target",
        "tiny-random:seed=3,num_layers=1",
        "--out",
        str(out),
        "--backend",
        "torch",
        "--max-batch",
        "4",
        "--max-len",
        "64",
        "--instances",
        "2",
        "--gpus",
        "0,1",
    ]
    assert export_main(argv) == 0
    config = (out / "triton_repo" / protocol.ENGINE_MODEL / "config.pbtxt").read_text()
    assert "instance_group [ { kind: KIND_GPU count: 2 gpus: [ 0, 1 ] } ]" in config
    command = json.loads((out / "manifest.json").read_text())["command"]
    assert shlex.split(command) == ["specdec-export", *argv]  # the argv given, quoted so a shell runs it again
    assert export_main([*argv[:3], str(tmp_path / "bad"), *argv[4:-4], "--instances", "0"]) == 2


PROMPTS = [
    "Name three colours.",
    "What is a river?",
    "Write one sentence about tea.",
    "Count from one to five.",
    "Why is the sky blue?",
    "Give me a word that rhymes with cat.",
    "What do bees make?",
    "List four fruits.",
]
MAX_TOKENS = 24
WAIT_S = 240.0
#: a client that streams a long answer and prints a line per response, to be SIGKILLed mid-stream
STREAMING_CLIENT = """
import sys
from specdec.serving.client import SpecdecClient
for _ in SpecdecClient(sys.argv[1]).stream("Write a long story about a dragon.", max_tokens=400,
                                          apply_chat_template=True):
    print("response", flush=True)
"""


@pytest.mark.server
def test_two_engine_instances_share_the_load_and_answer_as_one(smollm2_export: Path, tmp_path: Path) -> None:
    from specdec.runtime.engine import Engine
    from specdec.serving.client import SpecdecClient
    from specdec.serving.install import TritonNotFoundError, find_tritonserver
    from specdec.serving.repository import write_repository
    from specdec.serving.server import TritonServer

    try:
        find_tritonserver()
    except TritonNotFoundError as exc:  # pragma: no cover - depends on the machine
        pytest.skip(f"no tritonserver available: {exc}")
    engine = Engine.from_export(smollm2_export, config=EngineConfig(threads=1))
    reference = {
        p: o.token_ids
        for p, o in zip(
            PROMPTS,
            engine.generate([engine.request(p, chat=True, max_tokens=MAX_TOKENS) for p in PROMPTS], "ems").outputs,
        )
    }
    del engine
    repo = write_repository(smollm2_export, tmp_path / "repo", ServingOptions(instances=2, intra_op_threads=1))
    grpc, http, metrics = free_ports()
    server = TritonServer()
    server.start(repo, grpc_port=grpc, http_port=http, metrics_port=metrics, exit_timeout_s=120)
    try:
        server.wait_ready(WAIT_S)
        url = server.grpc_url
        with ThreadPoolExecutor(8) as pool:
            answers = list(
                pool.map(
                    lambda p: SpecdecClient(url).generate(p, max_tokens=MAX_TOKENS, apply_chat_template=True),
                    PROMPTS * 2,
                )
            )
        for prompt, answer in zip(PROMPTS * 2, answers):
            assert answer.output_ids == reference[prompt], prompt
        finished = {
            k: v
            for k, v in samples(server.metrics_url, "specdec_requests_total", per_instance=True).items()
            if 'outcome="finished"' in k
        }
        assert len(finished) == 2 and sum(finished.values()) == 16, finished
        assert all(v > 0 for v in finished.values()), f"one instance served nothing: {finished}"
        # a client killed mid-stream: whichever instance holds its request cancels it and frees the slot
        before = samples(server.metrics_url, "specdec_requests_total")
        for _ in range(2):
            proc = subprocess.Popen([sys.executable, "-c", STREAMING_CLIENT, url], stdout=subprocess.PIPE, text=True)
            assert proc.stdout is not None and proc.stdout.readline().startswith("response")
            proc.send_signal(signal.SIGKILL)
            proc.wait(WAIT_S)
        cancelled = 'specdec_requests_total{outcome="cancelled"}'
        assert eventually(
            lambda: (
                samples(server.metrics_url, "specdec_requests_total").get(cancelled, 0) - before.get(cancelled, 0) == 2
            ),
            timeout=WAIT_S,
        )
        assert eventually(
            lambda: samples(server.metrics_url, "specdec_kv_slots_used").get("specdec_kv_slots_used", -1) == 0,
            timeout=WAIT_S,
        )
        assert (
            SpecdecClient(url).generate(PROMPTS[0], max_tokens=MAX_TOKENS, apply_chat_template=True).output_ids
            == reference[PROMPTS[0]]
        )
    finally:
        assert server.stop() == 0, server.read_log()[-3000:]
        assert eventually(lambda: processes_mentioning(str(repo)) == [])

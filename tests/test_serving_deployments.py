"""Deployments other than the default one, each on a REAL tritonserver over the real SmolLM2-135M export: ``specdec
serve`` refusing a broken repository or export, a deployment without a draft model refusing ``dsbd`` by name, and
an adaptive-draft deployment giving the local runtime's answers.

The default deployment's requests (concurrency, streams, bad input, cancellation, beams) are ``test_serving.py``'s.
"""

from __future__ import annotations

import os
import re
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from servers import free_ports, needs_tritonserver
from serving_cases import (
    CONCURRENT_MAX_TOKENS,
    EXIT_S,
    PROMPTS,
    check_answer,
    local_reference,
    request_params,
    shadow_export,
)

from specdec.runtime.config import EngineConfig
from specdec.runtime.draft_length import DraftLength
from specdec.runtime.engine import Engine
from specdec.serving.client import ClientError, SpecdecClient
from specdec.serving.repository import ServingOptions
from specdec.serving.serve import serve_main
from specdec.serving.server import TritonServer

needs_tritonserver()

pytestmark = [pytest.mark.server, pytest.mark.real_model]


@pytest.fixture(scope="module")
def reference(smollm2_export: Path) -> dict:
    return local_reference(smollm2_export)


def _serve(repo: Path) -> int:
    grpc, http, metrics, openai_port = free_ports(4)
    return serve_main(
        [
            str(repo),
            "--grpc-port",
            str(grpc),
            "--http-port",
            str(http),
            "--metrics-port",
            str(metrics),
            "--openai-port",
            str(openai_port),
            "--ready-timeout",
            "240",
        ]
    )


def test_serve_refuses_a_repository_with_a_missing_model(
    smollm2_export: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    shadow = shadow_export(smollm2_export, tmp_path)
    shutil.rmtree(shadow / "triton_repo" / "specdec_engine")
    assert _serve(shadow) == 1
    assert re.search(r"missing model\(s\) specdec_engine", capsys.readouterr().err)


def test_serve_refuses_a_corrupt_config(
    smollm2_export: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    shadow = shadow_export(smollm2_export, tmp_path)
    (shadow / "triton_repo" / "postprocessing" / "config.pbtxt").write_text('name: "postprocessing"\nbackend: {{{\n')
    assert _serve(shadow) == 1
    err = capsys.readouterr().err
    assert "postprocessing" in err and "error" in err.lower()


def test_serve_refuses_a_corrupt_export(
    smollm2_export: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    shadow = shadow_export(smollm2_export, tmp_path)
    config = shadow / "target" / "tokenizer_config.json"
    text = config.read_text()
    config.unlink()
    config.write_text(text.replace("{", "{ ", 1))  # same meaning, different checksum
    assert _serve(shadow) == 1
    err = capsys.readouterr().err
    assert "specdec_engine" in err and "checksum" in err
    assert os.path.exists(shadow)


def test_dsbd_on_a_deployment_without_a_draft_model_is_a_named_error(
    smollm2_export: Path, reference: dict, tmp_path: Path
) -> None:
    """A deployment whose drafter is the n-gram table (no draft model) refuses method=dsbd with a message that
    says why and what to use instead, on both entry points, while a beam request and an ems stream sent beside it
    finish with their local answers; afterwards the same server still serves beam requests."""
    shadow = shadow_export(smollm2_export, tmp_path, ServingOptions(drafter="ngram"))
    grpc, http, metrics = free_ports()
    srv = TritonServer()
    srv.start(shadow, grpc_port=grpc, http_port=http, metrics_port=metrics, exit_timeout_s=EXIT_S)
    try:
        srv.wait_ready(300)
        engine = Engine.from_export(smollm2_export, config=EngineConfig(threads=1))
        from specdec.runtime.request import BeamParams

        want = engine.generate(
            [engine.request(PROMPTS[0][0], chat=PROMPTS[0][1], max_tokens=12, beam=BeamParams(width=2))], "beam"
        ).outputs[0]
        client = SpecdecClient(srv.grpc_url)
        pool = ThreadPoolExecutor(3)
        stream = pool.submit(
            lambda: SpecdecClient(srv.grpc_url).generate_stream(PROMPTS[3][0], **request_params(3, 24))
        )
        beam = pool.submit(
            lambda: SpecdecClient(srv.grpc_url).generate(
                PROMPTS[0][0], **request_params(0, 12, method="beam", beam_width=2)
            )
        )
        for call in (client.generate, client.generate_stream):
            with pytest.raises(ClientError, match=r"method 'dsbd' needs a draft model.*use 'beam'"):
                call(PROMPTS[0][0], **request_params(0, 12, method="dsbd", beam_width=2))
        check_answer(stream.result(), reference, 3, 24)
        assert beam.result().output_ids == want.token_ids
        again = client.generate(PROMPTS[0][0], **request_params(0, 12, method="beam", beam_width=2))
        assert again.output_ids == want.token_ids and again.beam_widths == want.metrics.beam_widths
    finally:
        assert srv.stop() == 0, srv.read_log()[-3000:]


def test_an_adaptive_draft_deployment_gives_the_same_answers(
    smollm2_export: Path, reference: dict, tmp_path: Path
) -> None:
    """An export served with ``adaptive_draft`` (each sequence picks its own k up to the served 4): its config
    says so; 8 concurrent greedy requests, half of them streamed, give the fixed-k runtime's tokens (greedy
    speculation is exact for any k); a seeded sampled request gives the local adaptive engine's answer (k comes
    from the request's own history, not from its batch-mates), as does a seeded dsbd request (γ chosen the same
    way); and the sequences drafted fewer than 4 tokens per step on average, so the policy did choose.

    The deployment is priced (verified row 0.02, draft token 0.3, as ``--calibrate`` or ``--verify-cost`` /
    ``--draft-cost`` would write them): with either price left at its default, both seeded answers differ
    (checked on the torch backend), so the equalities show the served engine reads both prices."""
    shadow = shadow_export(
        smollm2_export, tmp_path, ServingOptions(adaptive_draft=True, verify_cost=0.02, draft_cost=0.3)
    )
    config = (shadow / "triton_repo" / "specdec_engine" / "config.pbtxt").read_text()
    assert 'key: "adaptive_draft" value: { string_value: "1" }' in config
    assert 'key: "draft_cost" value: { string_value: "0.3" }' in config
    local = Engine.from_export(
        smollm2_export, config=EngineConfig(threads=1, draft_length=DraftLength(verify_cost=0.02, draft_cost=0.3))
    )
    sampled = dict(temperature=0.8, seed=3)
    want = local.generate([local.request(PROMPTS[2][0], chat=PROMPTS[2][1], max_tokens=24, **sampled)], "ems").outputs[
        0
    ]
    from specdec.runtime.request import BeamParams

    want_dsbd = local.generate(
        [local.request(PROMPTS[4][0], chat=PROMPTS[4][1], max_tokens=16, beam=BeamParams(width=3), **sampled)], "dsbd"
    ).outputs[0]
    grpc, http, metrics = free_ports()
    srv = TritonServer()
    srv.start(shadow, grpc_port=grpc, http_port=http, metrics_port=metrics, exit_timeout_s=EXIT_S)
    try:
        srv.wait_ready(300)
        pool = ThreadPoolExecutor(9)
        greedy = [
            pool.submit(
                lambda i=i, m=m: getattr(SpecdecClient(srv.grpc_url), "generate_stream" if i % 2 else "generate")(
                    PROMPTS[i][0], **request_params(i, m)
                )
            )
            for i, m in enumerate(CONCURRENT_MAX_TOKENS)
        ]
        seeded = pool.submit(
            lambda: SpecdecClient(srv.grpc_url).generate(PROMPTS[2][0], **request_params(2, 24, **sampled))
        )
        dsbd = SpecdecClient(srv.grpc_url).generate(
            PROMPTS[4][0], **request_params(4, 16, method="dsbd", beam_width=3, **sampled)
        )
        answers = [f.result() for f in greedy]
        for i, (answer, m) in enumerate(zip(answers, CONCURRENT_MAX_TOKENS)):
            check_answer(answer, reference, i, m)
        assert seeded.result().output_ids == want.token_ids
        # the beam loop of the deployment chooses γ by the same policy (adaptive γ, at most the served 4)
        assert dsbd.output_ids == want_dsbd.token_ids and dsbd.beam_widths == want_dsbd.metrics.beam_widths
        drafted = sum(a.draft_tokens for a in answers)
        decode_steps = sum(a.target_calls - 1 for a in answers)
        assert 0 < drafted < 4 * decode_steps
    finally:
        assert srv.stop() == 0, srv.read_log()[-3000:]

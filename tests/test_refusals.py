"""What a real server refuses, and how it says so (issue 39, observations 6 and 7): every validation failure,
wherever it is found (an entry point, preprocessing, the engine), reaches a tritonclient as INVALID_ARGUMENT naming
the input, on the unary model and on a stream; a request past the server's cost bound is refused the same way; no
value is echoed back whole; every refusal is counted by its reason; a good request beside them answers the same.

Against ``specdec serve`` over the tiny export (``tiny_export``): the subject is the serving path, not the model.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from servers import SPECDEC_SERVE, eventually, free_ports, needs_tritonserver, samples

needs_tritonserver()

from specdec.serving.client import ClientError, SpecdecClient  # noqa: E402

pytestmark = [pytest.mark.server]
WAIT_S = 180.0
NAN = float("nan")
#: (parameters, a word the refusal names): the cases of observation 6, and observation 7's
CASES = [
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=-5), "max_tokens"),
    (dict(max_tokens=100_000), "max_tokens"),
    (dict(temperature=NAN), "temperature"),
    (dict(temperature=-1.0), "temperature"),
    (dict(top_p=NAN), "top_p"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_k=-1), "top_k"),
    (dict(seed=-1), "seed"),
    (dict(stop=[""]), "stop"),
    (dict(stop=[b"\xff\xfe"]), "UTF-8"),
    (dict(method="nope"), "method"),
    (dict(method="x" * 100_000), "method"),
    (dict(method="beam", beam_width=0), "beam_width"),
    (dict(method="beam", beam_width=1000), "beam_width"),
    (dict(method="ems", beam_width=3), "beam_width"),
    (dict(method="dsbd", dsbd_threshold=2.0), "dsbd_threshold"),
    (dict(method="dsbd", dsbd_min_width=5, beam_width=2), "dsbd_min_width"),
    (dict(method="beam", dsbd_threshold=0.5), "dsbd_threshold"),
    (dict(method="ems", memory_mode="single"), "memory_mode"),
    (dict(method="beam", memory_mode="x" * 100_000), "memory_mode"),
    (dict(timeout_ms=0), "timeout_ms"),
    (dict(timeout_ms=-3), "timeout_ms"),
    (dict(num_draft_tokens=-1), "num_draft_tokens"),
    (dict(num_draft_tokens=33), "num_draft_tokens"),
    (dict(top_logprobs=3), "logprobs"),
    (dict(logprobs=True, top_logprobs=21), "top_logprobs"),
    (dict(min_tokens=-1), "min_tokens"),
    (dict(stop_token_ids=[-4]), "stop_token_ids"),
    (dict(stop_token_ids=[10**6]), "stop_token_ids"),
    (dict(method="beam", min_tokens=2), "min_tokens"),
    (dict(method="dsbd", beam_width=8, num_draft_tokens=32), "rows"),  # observation 7: the cost bound
    (dict(text_input="word " * 400), "context"),  # a prompt longer than the context
]


@pytest.fixture(scope="module")
def server(tiny_export: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """(gRPC address, metrics URL) of one ``specdec serve`` the tests share."""
    grpc, http, metrics, openai = free_ports(4)
    log = tmp_path_factory.mktemp("refusals") / "triton.log"
    ports = ["--grpc-port", str(grpc), "--http-port", str(http), "--metrics-port", str(metrics)]
    proc = subprocess.Popen(
        [
            *SPECDEC_SERVE,
            str(tiny_export / "triton_repo"),
            *ports,
            "--openai-port",
            str(openai),
            "--log-file",
            str(log),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        while not (line := proc.stdout.readline()).startswith("(Ctrl-C"):  # type: ignore[union-attr]
            assert line, f"specdec serve did not get ready: {proc.stderr.read()}"  # type: ignore[union-attr]
        yield f"127.0.0.1:{grpc}", f"http://127.0.0.1:{metrics}/metrics"
    finally:
        proc.send_signal(signal.SIGINT)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(60)
        if proc.poll() is None:
            proc.kill()


def _call(grpc: str, stream: bool, prompt: str = "hello there", **params: object) -> list[int]:
    client = SpecdecClient(grpc, timeout_s=WAIT_S)
    return (client.generate_stream if stream else client.generate)(prompt, **params).output_ids


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
@pytest.mark.parametrize("params, names", CASES, ids=[f"{i}-{n}" for i, (_, n) in enumerate(CASES)])
def test_a_bad_request_is_invalid_argument_naming_its_input(server, stream: bool, params: dict, names: str) -> None:
    grpc, _ = server
    params = dict(params)
    prompt = str(params.pop("text_input", "hello there"))
    with pytest.raises(ClientError) as refused:
        _call(grpc, stream, prompt, max_tokens=params.pop("max_tokens", 8), **params)
    assert refused.value.status == "StatusCode.INVALID_ARGUMENT", refused.value
    message = str(refused.value)
    assert names in message and len(message) < 600 and "Traceback" not in message, message


def test_refusals_are_counted_and_a_good_request_beside_them_answers_the_same(server) -> None:
    grpc, metrics = server
    before = _call(grpc, stream=True, max_tokens=8)
    counted = samples(metrics, "specdec_refused_requests_total").get(
        'specdec_refused_requests_total{model="specdec",reason="invalid"}', 0
    )
    for params, _ in CASES[3:8]:  # sampling parameters the engine refuses
        with contextlib.suppress(ClientError):
            _call(grpc, False, max_tokens=8, **params)
    assert _call(grpc, stream=True, max_tokens=8) == before
    assert eventually(
        lambda: (
            samples(metrics, "specdec_refused_requests_total").get(
                'specdec_refused_requests_total{model="specdec",reason="invalid"}', 0
            )
            == counted + 5
        ),
        timeout=30,
    )

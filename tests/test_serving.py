"""The served endpoint end to end: a REAL tritonserver on loopback, the real SmolLM2-135M ONNX export, tritonclient.

Every answer is checked token for token against the local runtime (``Engine.from_export`` on the same
export, greedy), so a lost, mixed-up or re-ordered output fails the test, not just an error.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from servers import eventually, free_ports, needs_tritonserver, processes_mentioning, samples
from serving_cases import (
    CONCURRENT_MAX_TOKENS,
    EXIT_S,
    LOAD_MAX_TOKENS,
    PROMPTS,
    WAIT_S,
    check_answer,
    local_reference,
    request_params,
)

from specdec.serving.server import TritonServer

needs_tritonserver()
import tritonclient.grpc as grpcclient  # noqa: E402

from specdec.runtime.config import EngineConfig  # noqa: E402
from specdec.runtime.engine import Engine  # noqa: E402
from specdec.serving.client import ClientError, SpecdecClient  # noqa: E402

pytestmark = [pytest.mark.server, pytest.mark.real_model]


@pytest.fixture(scope="module")
def reference(smollm2_export: Path) -> dict:
    return local_reference(smollm2_export)


@pytest.fixture(scope="module")
def server(smollm2_export: Path, reference: dict) -> TritonServer:
    """One server for the module, started after the local references (so they do not compete for the CPU)."""
    grpc, http, metrics = free_ports()
    srv = TritonServer()
    srv.start(smollm2_export, grpc_port=grpc, http_port=http, metrics_port=metrics, exit_timeout_s=EXIT_S)
    try:
        srv.wait_ready(300)
        yield srv
    finally:
        code = srv.stop()
        assert code == 0, f"server did not stop cleanly (exit {code})\n{srv.read_log()[-3000:]}"
        assert eventually(lambda: processes_mentioning(str(smollm2_export)) == []), "a stub outlived the server"


def scrape(server: TritonServer) -> dict[str, float]:
    """specdec_* samples of the Prometheus endpoint, keyed by name{labels} (summed over engine instances)."""
    return samples(server.metrics_url, "specdec_")


def test_eight_concurrent_greedy_requests_equal_local_and_share_steps(server: TritonServer, reference: dict) -> None:
    before = scrape(server)
    client_threads = ThreadPoolExecutor(8)
    futures = [
        client_threads.submit(
            lambda i=i, m=m: SpecdecClient(server.grpc_url).generate(PROMPTS[i][0], **request_params(i, m))
        )
        for i, m in enumerate(CONCURRENT_MAX_TOKENS)
    ]
    answers = [f.result() for f in futures]
    for i, (answer, m) in enumerate(zip(answers, CONCURRENT_MAX_TOKENS)):
        check_answer(answer, reference, i, m)
        assert answer.target_calls >= 1 and 0.0 <= answer.acceptance_rate <= 1.0
    # verified together: on average each request's target steps held several sequences
    assert max(a.mean_batch_size for a in answers) > 2.0
    after = scrape(server)
    steps = after["specdec_target_steps_total"] - before["specdec_target_steps_total"]
    sequences = after["specdec_step_sequences_total"] - before["specdec_step_sequences_total"]
    assert steps > 0 and sequences / steps > 1.5, f"mean batch {sequences / steps:.2f} over {steps} steps"
    finished = 'specdec_requests_total{outcome="finished"}'
    assert after[finished] - before[finished] == 8
    generated = after["specdec_generated_tokens_total"] - before["specdec_generated_tokens_total"]
    assert generated == sum(len(a.output_ids) for a in answers)


def test_stream_concatenates_to_the_unary_answer_and_shares_steps_with_unary(
    server: TritonServer, reference: dict
) -> None:
    i, m = 1, CONCURRENT_MAX_TOKENS[1]
    with ThreadPoolExecutor(4) as pool:
        streamed = pool.submit(
            lambda: SpecdecClient(server.grpc_url).generate_stream(PROMPTS[i][0], **request_params(i, m))
        )
        unary = [
            pool.submit(
                lambda j=j: SpecdecClient(server.grpc_url).generate(PROMPTS[j][0], **request_params(j, LOAD_MAX_TOKENS))
            )
            for j in (2, 3, 4)
        ]
        stream_answer = streamed.result()
        unary_answers = [u.result() for u in unary]
    check_answer(stream_answer, reference, i, m)
    assert stream_answer.responses > 3, "a stream of one response is not a stream"
    assert (
        "".join(stream_answer.chunks)
        == SpecdecClient(server.grpc_url).generate(PROMPTS[i][0], **request_params(i, m)).text
    )
    for j, answer in zip((2, 3, 4), unary_answers):
        check_answer(answer, reference, j, LOAD_MAX_TOKENS)
    assert stream_answer.mean_batch_size > 1.0, "the stream never shared a ragged step with the unary requests"


@pytest.mark.reliability("R5")
def test_64_requests_from_8_threads_none_lost_or_mixed_up(server: TritonServer, reference: dict) -> None:
    indices = [k % len(PROMPTS) for k in range(64)]
    prompts = [PROMPTS[i][0] for i in indices]
    # half the requests stream; every answer must be exactly its own prompt's reference
    answers: list = [None] * 64
    with ThreadPoolExecutor(8) as pool:

        def worker(t: int) -> None:
            client = SpecdecClient(server.grpc_url)
            for k in range(t, 64, 8):
                call = client.generate_stream if k % 2 else client.generate
                try:
                    answers[k] = call(prompts[k], **request_params(indices[k], LOAD_MAX_TOKENS))
                except ClientError as exc:
                    answers[k] = exc

        list(pool.map(worker, range(8)))
    for k, answer in enumerate(answers):
        check_answer(answer, reference, indices[k], LOAD_MAX_TOKENS)
    assert SpecdecClient(server.grpc_url).ready()


def _raw_input(name: str, array: np.ndarray, dtype: str) -> object:
    tensor = grpcclient.InferInput(name, list(array.shape), dtype)
    tensor.set_data_from_numpy(array)
    return tensor


BAD_REQUESTS = {
    "empty text": (dict(text=""), r"text_input' is empty"),
    "blank text": (dict(text="   "), r"text_input' is empty"),
    "max_tokens 0": (dict(max_tokens=0), r"max_tokens must be between 1"),
    "max_tokens huge": (dict(max_tokens=2**31 - 1), r"max_tokens must be between 1 and 1023"),
    "negative temperature": (dict(temperature=-0.5), r"temperature must be"),
    "nan temperature": (dict(temperature=float("nan")), r"temperature must be"),
    "top_p 0": (dict(temperature=1.0, top_p=0.0), r"top_p"),
    "negative seed": (dict(temperature=1.0, seed=-3), r"seed"),
    "unknown method": (dict(method="magic"), r"unknown method 'magic'"),
    "beam_width 2 on ems": (dict(beam_width=2), r"beam_width must be 1 for method 'ems'"),
    "beam_width past the slots": (dict(method="beam", beam_width=9), r"beam_width 9 exceeds the 8 KV slots"),
    "dsbd threshold 2": (dict(method="dsbd", dsbd_threshold=2.0), r"dsbd_threshold must be in \[0, 1\]"),
    "dsbd min width > width": (dict(method="dsbd", beam_width=2, dsbd_min_width=3), r"dsbd_min_width"),
    "unknown memory mode": (dict(method="beam", memory_mode="tiny"), r"memory_mode"),
    "num_draft_tokens -1": (dict(num_draft_tokens=-1), r"num_draft_tokens must be between 0 and"),
    "num_draft_tokens 1000": (dict(num_draft_tokens=1000), r"num_draft_tokens must be between 0 and"),
    "empty stop": (dict(stop=[""]), r"stop"),
    "stream on unary": (dict(stream=True), r"specdec_stream"),
    "prompt too long": (dict(text="word " * 1500), r"context holds 1024"),
}


def _send_bad(client: SpecdecClient, case: dict) -> None:
    params = dict(case)
    text = params.pop("text", "Say hi.")
    client.generate(text, **{"max_tokens": 8, **params})


@pytest.mark.reliability("R14")
def test_bad_inputs_get_named_errors_while_a_stream_completes(server: TritonServer, reference: dict) -> None:
    i, m = 5, CONCURRENT_MAX_TOKENS[5]
    in_flight: dict = {}
    thread = threading.Thread(
        target=lambda: in_flight.setdefault(
            "answer", SpecdecClient(server.grpc_url).generate_stream(PROMPTS[i][0], **request_params(i, m))
        )
    )
    thread.start()
    client = SpecdecClient(server.grpc_url)
    for name, (case, pattern) in BAD_REQUESTS.items():
        with pytest.raises(ClientError, match=pattern):
            _send_bad(client, case)
        assert name
    raw = client._client
    from tritonclient.utils import InferenceServerException

    text = np.array([b"Say hi."], dtype=np.object_)
    wrong = {
        "wrong dtype": [
            _raw_input("text_input", text, "BYTES"),
            _raw_input("max_tokens", np.array([8.0], dtype=np.float32), "FP32"),
        ],
        "wrong shape": [_raw_input("text_input", np.array([b"a", b"b"], dtype=np.object_), "BYTES")],
        "missing text_input": [_raw_input("max_tokens", np.array([8], dtype=np.int32), "INT32")],
        "not UTF-8": [_raw_input("text_input", np.array([b"\xff\xfe bad"], dtype=np.object_), "BYTES")],
    }
    patterns = {
        "wrong dtype": r"max_tokens.*(TYPE_INT32|INT32)",
        "wrong shape": r"text_input.*shape|shape.*text_input",
        "missing text_input": r"text_input",
        "not UTF-8": r"UTF-8",
    }
    for name, inputs in wrong.items():
        with pytest.raises(InferenceServerException, match=patterns[name]):
            raw.infer("specdec", inputs)
    # the streaming entry point reports bad input the same way, in the stream
    with pytest.raises(ClientError, match=r"unknown method 'magic'"):
        SpecdecClient(server.grpc_url).generate_stream("Say hi.", method="magic")
    thread.join(600)  # the client's own timeout
    assert not thread.is_alive(), "the stream sent beside the bad requests never finished"
    check_answer(in_flight["answer"], reference, i, m)
    assert client.generate("Say hi.", max_tokens=4).output_ids


CANCELLED = 'specdec_requests_total{outcome="cancelled"}'
STREAMING_CLIENT = """
import sys
from specdec.serving.client import SpecdecClient
client = SpecdecClient(sys.argv[1])
for n, result in enumerate(client.stream("Count from one to five hundred in words.", max_tokens=600)):
    print("response", n, flush=True)
"""


@pytest.mark.reliability("R8", "R9", "R11")
def test_client_killed_mid_stream_is_cancelled_and_does_not_wedge_the_engine(
    server: TritonServer, reference: dict
) -> None:
    before = scrape(server)
    proc = subprocess.Popen(
        [sys.executable, "-c", STREAMING_CLIENT, server.grpc_url], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    for _ in range(3):  # it is streaming
        assert proc.stdout.readline().startswith("response")
    proc.send_signal(signal.SIGKILL)
    proc.wait(WAIT_S)
    i = 0
    answer = SpecdecClient(server.grpc_url).generate(PROMPTS[i][0], **request_params(i, CONCURRENT_MAX_TOKENS[i]))
    check_answer(answer, reference, i, CONCURRENT_MAX_TOKENS[i])
    eventually(
        lambda: (now := scrape(server))[CANCELLED] - before[CANCELLED] >= 1 and now["specdec_active_sequences"] == 0,
        poll_s=0.5,
    )
    now = scrape(server)
    assert now[CANCELLED] - before[CANCELLED] == 1, "the dead client's request was not cancelled"
    assert now["specdec_active_sequences"] == 0


BEAM_CLIENT = """
import sys
from specdec.serving.client import SpecdecClient
client = SpecdecClient(sys.argv[1])
for result in client.stream("Count from one to five hundred in words.", max_tokens=600, method="beam", beam_width=2):
    print("response", flush=True)
"""


@pytest.mark.reliability("R8", "R9", "R11")
def test_client_killed_during_a_beam_request_is_cancelled_between_rounds(server: TritonServer, reference: dict) -> None:
    """A beam search streams only the prefix its beams share; a client killed while it runs is still noticed: the
    request ends *cancelled* (600 tokens would take far longer than the wait), its beams give back their KV slots,
    and the server answers the next beam and ems requests."""
    before = scrape(server)
    proc = subprocess.Popen([sys.executable, "-c", BEAM_CLIENT, server.grpc_url], stdout=subprocess.PIPE, text=True)
    eventually(lambda: scrape(server)["specdec_active_sequences"] >= 1)  # admitted, decoding
    assert scrape(server)["specdec_active_sequences"] == 1, "the beam request never started"
    # a few rounds: it decodes alone, so the target steps counted from now are its rounds
    started = scrape(server)["specdec_target_steps_total"]
    assert eventually(lambda: scrape(server)["specdec_target_steps_total"] >= started + 3), "no rounds ran"
    # between rounds (a round frees a slot before it forks one)
    assert eventually(lambda: scrape(server)["specdec_kv_slots_used"] == 2, poll_s=0.1), (
        "a width-2 beam request holds one KV slot per beam"
    )
    proc.send_signal(signal.SIGKILL)
    proc.wait(WAIT_S)
    eventually(
        lambda: (
            (now := scrape(server))[CANCELLED] - before[CANCELLED] >= 1
            and now["specdec_active_sequences"] == 0
            and now["specdec_kv_slots_used"] == 0
        ),
        poll_s=0.5,
    )
    now = scrape(server)
    assert now[CANCELLED] - before[CANCELLED] == 1, "the dead client's beam request was not cancelled"
    assert now["specdec_active_sequences"] == 0 and now["specdec_kv_slots_used"] == 0
    client = SpecdecClient(server.grpc_url)
    answer = client.generate(PROMPTS[0][0], **request_params(0, 8, method="beam", beam_width=2))
    assert answer.output_ids and max(answer.beam_widths) == 2
    check_answer(
        client.generate(PROMPTS[1][0], **request_params(1, CONCURRENT_MAX_TOKENS[1])),
        reference,
        1,
        CONCURRENT_MAX_TOKENS[1],
    )


def test_sigusr1_dumps_every_stub_thread_and_no_request_thread_outlives_its_request(
    server: TritonServer, smollm2_export: Path, reference: dict
) -> None:
    """``kill -USR1`` on a Python-backend stub writes all its threads' stacks to the log and the stub keeps serving.
    Run after the killed-client tests, the dump of the idle server shows each stub's own threads and, within a
    deadline, no request thread (``_answer``) still running: a killed client's request thread returned."""
    stubs = [
        pid
        for pid in processes_mentioning(str(smollm2_export))
        if b"triton_python_backend_stub" in Path(f"/proc/{pid}/cmdline").read_bytes()
    ]
    assert len(stubs) == 6  # preprocessing, postprocessing, specdec_engine, specdec, specdec_stream, specdec_ready
    assert eventually(lambda: scrape(server)["specdec_active_sequences"] == 0, poll_s=0.5)
    # a killed client's request thread returns once its entry point has heard the engine's cancelled answer: dump
    # until no request thread shows (or the deadline passes: one that never returns still fails below)
    deadline = time.monotonic() + WAIT_S
    while True:
        dump = "".join(_stacks(server, pid) for pid in stubs)  # one at a time: their stacks do not interleave
        if " in _answer" not in dump or time.monotonic() >= deadline:
            break
        time.sleep(0.5)
    assert dump.count("Current thread") == len(stubs), dump[-3000:]
    assert "in _send_loop" in dump and "in _watch" in dump  # the engine's sender and the watchers
    assert " in _answer" not in dump, "a request thread outlived its request:\n" + dump[-3000:]
    check_answer(
        SpecdecClient(server.grpc_url).generate(PROMPTS[1][0], **request_params(1, CONCURRENT_MAX_TOKENS[1])),
        reference,
        1,
        CONCURRENT_MAX_TOKENS[1],
    )


def _stacks(server: TritonServer, pid: int) -> str:
    """What ``kill -USR1 pid`` writes to the server log: that stub's dump of its threads' stacks, whole.

    The stub writes the dump from one signal handler, so once it has begun, the log stops growing when it is
    complete; waiting for that, instead of a fixed moment, keeps a descheduled stub from cutting it short.
    """
    offset = len(server.read_log())
    os.kill(pid, signal.SIGUSR1)
    assert eventually(lambda: "Current thread" in server.read_log()[offset:]), f"stub {pid} dumped no stacks"
    sizes = [-1]

    def settled() -> bool:
        sizes.append(len(server.read_log()))
        return sizes[-1] == sizes[-2]

    eventually(settled, poll_s=0.5)
    return server.read_log()[offset:]


BEAM_CASES = [  # (prompt index, max_tokens, parameters): greedy beam search and seeded i.i.d. beam sampling
    (0, 16, dict(beam_width=3)),
    (2, 12, dict(beam_width=2, temperature=0.8, seed=11)),
    (4, 20, dict(beam_width=4, temperature=1.0, top_p=0.9, seed=5)),
    (6, 10, dict(beam_width=2, memory_mode="single", temperature=0.7, seed=2)),
]


@pytest.mark.parametrize("method", ["beam", "dsbd"])
def test_beam_requests_equal_local_and_run_beside_ems(
    server: TritonServer, smollm2_export: Path, reference: dict, method: str
) -> None:
    """method=beam / dsbd through Triton (unary and streamed, concurrently with an ems request) give the local
    runtime's answer for the same seed (so one request's output does not depend on its batch); the beam widths
    come back, dsbd really speculates with the exported draft, and a streamed request that keeps one beam per
    round streams its answer round by round."""
    engine = Engine.from_export(smollm2_export, config=EngineConfig(threads=1))
    from specdec.runtime.request import BeamParams

    extra = {"dsbd_threshold": 0.5, "num_draft_tokens": 3} if method == "dsbd" else {}
    local = []
    for i, m, params in BEAM_CASES:
        sampling = {k: params[k] for k in ("temperature", "top_p", "seed") if k in params}
        beam = BeamParams(
            width=params["beam_width"],
            memory_mode=params.get("memory_mode", "full"),
            threshold=extra.get("dsbd_threshold", 0.0),
        )
        request = engine.request(
            PROMPTS[i][0],
            chat=PROMPTS[i][1],
            max_tokens=m,
            beam=beam,
            num_draft_tokens=extra.get("num_draft_tokens"),
            **sampling,
        )
        local.append(engine.generate([request], method).outputs[0])
    pool = ThreadPoolExecutor(len(BEAM_CASES) + 1)
    ems = pool.submit(lambda: SpecdecClient(server.grpc_url).generate(PROMPTS[5][0], **request_params(5, 36)))
    futures = [
        pool.submit(
            lambda n=n, i=i, m=m, p=p: getattr(
                SpecdecClient(server.grpc_url), "generate_stream" if n in (1, 3) else "generate"
            )(PROMPTS[i][0], **request_params(i, m, method=method, **p, **extra))
        )
        for n, (i, m, p) in enumerate(BEAM_CASES)
    ]
    for (i, _m, p), future, want in zip(BEAM_CASES, futures, local):
        answer = future.result()
        assert answer.output_ids == want.token_ids, f"{method} case {i}: differs from the local runtime"
        assert answer.text == want.text
        assert answer.beam_widths == want.metrics.beam_widths and answer.beam_widths
        if method == "beam" and p.get("memory_mode") != "single":
            assert max(answer.beam_widths) == p["beam_width"]
        if method == "dsbd":
            assert answer.draft_tokens > 0
        if p.get("memory_mode") == "single":  # one beam kept per round: each round's tokens are final at once
            assert answer.responses > 1, "a beam request that keeps one beam streamed nothing before its end"
    check_answer(ems.result(), reference, 5, 36)
    assert ems.result().beam_widths == []

"""Shutting a loaded server down as an operator (or Kubernetes) does: SIGINT/SIGTERM to ``specdec serve``.

A REAL ``specdec serve`` (tritonserver and its Python-backend stubs) on loopback, the real SmolLM2 export,
tritonclient over gRPC. What must hold (issue 22, observation 1):

* a signal drains: new requests get UNAVAILABLE at once, every request in flight — unary, streamed,
  beam — is answered token for token as the local runtime answers it, then the server exits 0 well
  before its exit timeout and leaves no process and no /dev/shm region;
* a second signal aborts what is left with UNAVAILABLE, and the cleanup still happens.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
from servers import SPECDEC_SERVE, ask, eventually, free_ports, needs_tritonserver, processes_mentioning, samples

from specdec.runtime.config import EngineConfig
from specdec.runtime.engine import Engine
from specdec.runtime.request import BeamParams
from specdec.serving.client import Answer, ClientError, SpecdecClient
from specdec.serving.control import GRPC_ADMIN_HEADER, SHM_DIR, inflight_from_metrics
from specdec.serving.processes import alive, children, stub_pids
from specdec.serving.server import http_ready

needs_tritonserver()
pytestmark = [pytest.mark.server, pytest.mark.real_model]

PROMPTS = [
    "Write a short story about a lighthouse keeper.",
    "List ten facts about the ocean.",
    "Explain how a bicycle works.",
    "Describe a busy market in the morning.",
    "Write a letter to a friend about a trip to the mountains.",
]
MAX_TOKENS = 160  # long enough that every request is still decoding when the signal comes
WAIT_S = 240.0  # what a loaded CI machine may need; a passing run waits for events, never for this
BEAM = dict(method="beam", beam_width=2, temperature=1.0, seed=3)


@pytest.fixture(scope="module")
def reference(smollm2_export: Path) -> dict[str, list[int]]:
    """The local runtime's answers (greedy ems; the beam request with its seed), before any server runs."""
    engine = Engine.from_export(smollm2_export, config=EngineConfig(threads=1))
    greedy = engine.generate([engine.request(p, chat=True, max_tokens=MAX_TOKENS) for p in PROMPTS], "ems").outputs
    beam = engine.request(
        PROMPTS[0], chat=True, max_tokens=MAX_TOKENS, temperature=1.0, seed=3, beam=BeamParams(width=2)
    )
    return {
        **{p: o.token_ids for p, o in zip(PROMPTS, greedy)},
        "beam": engine.generate([beam], "beam").outputs[0].token_ids,
    }


@dataclass
class Served:
    proc: subprocess.Popen[str]
    grpc: str  # host:port
    http: str  # http://host:port
    metrics: str  # its /metrics URL


def _serve(export: Path, log: Path) -> Served:
    """``specdec serve`` in its own process, ready."""
    grpc, http, metrics, openai_port = free_ports(4)
    proc = subprocess.Popen(
        [
            *SPECDEC_SERVE,
            str(export / "triton_repo"),
            "--grpc-port",
            str(grpc),
            "--http-port",
            str(http),
            "--metrics-port",
            str(metrics),
            "--openai-port",
            str(openai_port),
            "--log-file",
            str(log),
            "--ready-timeout",
            str(WAIT_S),
            "--drain-timeout",
            str(WAIT_S),
            "--exit-timeout",
            "60",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        line = proc.stdout.readline()  # type: ignore[union-attr]
        if not line:
            break
        if line.startswith("(Ctrl-C"):
            return Served(proc, f"127.0.0.1:{grpc}", f"http://127.0.0.1:{http}", f"http://127.0.0.1:{metrics}/metrics")
    proc.kill()
    raise AssertionError(f"specdec serve did not get ready: {proc.stderr.read()}\n{log.read_text()[-3000:]}")  # type: ignore[union-attr]


@contextlib.contextmanager
def _served(export: Path, tmp_path: Path) -> Iterator[Served]:
    """``specdec serve`` for one test; afterwards no process of it and no /dev/shm region of it may be left."""
    shm_before = _shm()
    served = _serve(export, tmp_path / "server.log")
    try:
        yield served
    finally:
        if served.proc.poll() is None:
            served.proc.kill()
            served.proc.wait()
    assert eventually(lambda: processes_mentioning(str(export / "triton_repo")) == [])
    # its own regions only (``new_shm_prefix``: specdec_<pid of specdec serve>_...): other servers on the machine
    # (another test run) make and remove theirs meanwhile
    mine = f"specdec_{served.proc.pid}_"
    assert eventually(lambda: not {n for n in _shm() - shm_before if n.startswith(mine)}), _shm() - shm_before


def _loaded(served: Served, prompt: str) -> tuple[list[Future], ThreadPoolExecutor, Iterator]:
    """``_in_flight``'s requests and one more stream, all admitted (so none is still in transit)."""
    futures, pool = _in_flight(served.grpc)
    stream = SpecdecClient(served.grpc).stream(prompt, max_tokens=MAX_TOKENS, apply_chat_template=True)
    next(iter(stream))  # the server is decoding: this stream has its first tokens
    _admitted(served.metrics, len(futures) + 1)
    return futures, pool, stream


def _shm() -> set[str]:
    return {p.name for p in SHM_DIR.iterdir()} if SHM_DIR.is_dir() else set()


def _in_flight(url: str) -> tuple[list[Future], ThreadPoolExecutor]:
    """4 greedy streams, 1 greedy unary request and 1 beam request, sent from their own threads."""
    pool = ThreadPoolExecutor(len(PROMPTS) + 1)
    futures = [
        pool.submit(
            lambda p=p, i=i: getattr(SpecdecClient(url), "generate" if i == 4 else "generate_stream")(
                p, max_tokens=MAX_TOKENS, apply_chat_template=True
            )
        )
        for i, p in enumerate(PROMPTS)
    ]
    futures.append(
        pool.submit(
            lambda: SpecdecClient(url).generate(PROMPTS[0], max_tokens=MAX_TOKENS, apply_chat_template=True, **BEAM)
        )
    )
    return futures, pool


def _admitted(metrics_url: str, n: int) -> None:
    """Until the entry points have admitted ``n`` requests (their in-flight gauge), so none is still in transit."""
    import urllib.request

    def count() -> int:
        with urllib.request.urlopen(metrics_url, timeout=10) as resp:
            return inflight_from_metrics(resp.read().decode()) or 0

    assert eventually(lambda: count() >= n, timeout=WAIT_S), f"fewer than {n} requests admitted"


@pytest.mark.reliability("R4")
def test_sigint_drains_in_flight_requests_then_exits_clean(
    smollm2_export: Path, reference: dict, tmp_path: Path
) -> None:
    with _served(smollm2_export, tmp_path) as served:
        proc, url = served.proc, served.grpc
        futures, pool, first = _loaded(served, PROMPTS[1])
        signalled = time.monotonic()
        proc.send_signal(signal.SIGINT)
        # new requests are refused at once, with UNAVAILABLE, while the others finish
        refused = None
        deadline = time.monotonic() + 30
        while refused is None and time.monotonic() < deadline:
            try:
                SpecdecClient(url).generate("hello", max_tokens=4)
            except ClientError as exc:
                refused = exc
        assert refused is not None and refused.status == "StatusCode.UNAVAILABLE", refused
        assert "draining" in str(refused)
        answers = [f.result(timeout=WAIT_S) for f in futures]
        for prompt, answer in zip(PROMPTS, answers):
            assert isinstance(answer, Answer) and answer.output_ids == reference[prompt], prompt
        assert answers[-1].output_ids == reference["beam"]
        rest = list(first)  # the stream opened last completes too
        assert rest and rest[-1] is not None
        assert proc.wait(WAIT_S) == 0, proc.stderr.read()  # type: ignore[union-attr]
        assert time.monotonic() - signalled < 60 + WAIT_S
        pool.shutdown()


@pytest.mark.reliability("R4")
def test_a_second_signal_aborts_with_unavailable_and_still_cleans_up(smollm2_export: Path, tmp_path: Path) -> None:
    with _served(smollm2_export, tmp_path) as served:
        proc = served.proc
        futures, pool, stream = _loaded(served, PROMPTS[2])
        proc.send_signal(signal.SIGINT)
        time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        outcomes = []
        for f in futures:
            try:
                outcomes.append(f.result(timeout=WAIT_S))
            except ClientError as exc:
                outcomes.append(exc)
        with pytest.raises(ClientError, match="aborted"):  # the stream opened last is aborted too, and closed
            list(stream)
        errors = [o for o in outcomes if isinstance(o, ClientError)]
        assert errors, "a second signal aborted nothing: every request had finished already"
        # unary answers carry the status; a stream's error arrives in band, its message led by the status
        assert all("aborted" in str(e) and e.status == "StatusCode.UNAVAILABLE" for e in errors), errors
        assert any(e.status == "StatusCode.UNAVAILABLE" for e in errors), errors
        assert proc.wait(WAIT_S) == 0, proc.stderr.read()  # type: ignore[union-attr]
        pool.shutdown()


def _tritonserver_pid(export: Path) -> int:
    pids = [
        pid
        for pid in processes_mentioning(str(export / "triton_repo"))
        if Path(Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode()).name == "tritonserver"
    ]
    assert len(pids) == 1, pids
    return pids[0]


def _grpc_ready(url: str) -> bool:
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    try:
        return grpcclient.InferenceServerClient(url).is_server_ready(client_timeout=2)
    except InferenceServerException:
        return False


@pytest.mark.reliability("R1", "R2", "R3")
def test_a_dead_engine_or_server_is_replaced_and_serves_the_same_answers(
    smollm2_export: Path, reference: dict, tmp_path: Path
) -> None:
    """Observation 2: the engine's stub SIGKILLed under a stream, then tritonserver itself SIGKILLed. Each time
    readiness turns false, the stream ends with UNAVAILABLE (no hung client), the server comes back within about
    its cold start, answers exactly as before, and nothing of the dead server is left (processes, /dev/shm)."""
    started = time.monotonic()
    with _served(smollm2_export, tmp_path) as served:
        cold_s = time.monotonic() - started
        proc, url, http = served.proc, served.grpc, served.http
        # R2: the engine SIGKILLed under a stream; R3: tritonserver SIGKILLed; R1: the idle engine crashing (SIGSEGV)
        for victim, sig, busy in (
            ("engine", signal.SIGKILL, True),
            ("tritonserver", signal.SIGKILL, True),
            ("engine", signal.SIGSEGV, False),
        ):
            server_pid = _tritonserver_pid(smollm2_export)
            stubs = list(children(server_pid))
            engine_stubs = stub_pids(server_pid, "specdec_engine")
            assert len(engine_stubs) == 1 and len(stubs) == 6, (engine_stubs, stubs)  # 5 models and the gate
            if busy:
                stream = SpecdecClient(url).stream(PROMPTS[0], max_tokens=MAX_TOKENS, apply_chat_template=True)
                next(iter(stream))
            killed = time.monotonic()
            os.kill(engine_stubs[0] if victim == "engine" else server_pid, sig)
            if busy:
                with pytest.raises(ClientError) as failed:
                    for _ in stream:
                        pass
                assert failed.value.status == "StatusCode.UNAVAILABLE", failed.value
            assert eventually(lambda: not http_ready(http) and not _grpc_ready(url), timeout=WAIT_S, poll_s=0.05)
            print(f"{victim} {signal.Signals(sig).name}: not ready after {time.monotonic() - killed:.2f} s")
            assert eventually(lambda: http_ready(http), timeout=WAIT_S)
            back_s = time.monotonic() - killed
            answer = SpecdecClient(url).generate(PROMPTS[1], max_tokens=MAX_TOKENS, apply_chat_template=True)
            assert answer.output_ids == reference[PROMPTS[1]]
            # how soon (a cold start + 20 % on an idle machine) is measured by benchmarks.reliability, not asserted
            # here: a restart that competes with other jobs for 2 cores is slower than the cold start it is compared to
            print(f"{victim} {signal.Signals(sig).name}: ready again after {back_s:.1f} s (cold start {cold_s:.1f} s)")
            assert eventually(lambda stubs=stubs: not any(alive(pid) for pid in stubs)), "a dead server's stub lives"
        proc.send_signal(signal.SIGINT)
        assert proc.wait(WAIT_S) == 0
        err = proc.stderr.read()  # type: ignore[union-attr]
        assert "the specdec_engine stub" in err and "tritonserver exited" in err and "serving again" in err, err


def _stream_once(client: object, model: str, inputs: list) -> None:
    """One request to a decoupled model over a gRPC stream; its error, if any, raised."""
    import queue

    events: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: events.put(error))  # type: ignore[attr-defined]
    try:
        client.async_stream_infer(model, inputs)  # type: ignore[attr-defined]
        error = events.get(timeout=WAIT_S)
        if error is not None:
            raise error
    finally:
        client.stop_stream()  # type: ignore[attr-defined]


@pytest.mark.reliability("R13")
def test_a_fault_in_one_request_fails_it_alone_with_internal(
    smollm2_export: Path, reference: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Observations 3, 4 and 7: 10 requests that fail inside their own step (the fault hook), mixed into a batch
    of 6 good ones: each bad one ends with INTERNAL and a message without a traceback, every good one is token
    for token the local answer, the counters move by exactly 10, the server stays ready. The internal models
    refuse a client with INVALID_ARGUMENT (no traceback), and Triton's management APIs want the admin key."""
    import numpy as np
    import tritonclient.grpc as grpcclient
    from fault_hooks import FAULT_SEED, MESSAGE
    from tritonclient.utils import InferenceServerException

    from specdec.serving.server import TritonServer

    monkeypatch.setenv("SPECDEC_FAULT_HOOK", f"{Path(__file__).with_name('fault_hooks.py')}:fail_marked")
    grpc, http, metrics = free_ports()
    server = TritonServer()
    server.start(
        smollm2_export / "triton_repo", grpc_port=grpc, http_port=http, metrics_port=metrics, exit_timeout_s=60
    )
    try:
        server.wait_ready(WAIT_S)
        url = server.grpc_url
        before = samples(server.metrics_url, "specdec_requests_total")
        pool = ThreadPoolExecutor(16)

        bad = [
            pool.submit(ask, url, PROMPTS[i % len(PROMPTS)], i % 2 == 0, MAX_TOKENS, seed=FAULT_SEED) for i in range(10)
        ]
        good = [pool.submit(ask, url, p, i % 2 == 1, MAX_TOKENS) for i, p in enumerate(PROMPTS)]
        for future in bad:
            out = future.result(WAIT_S)
            # unary: gRPC INTERNAL; a stream's error is in band, its message led by the same status (protocol.coded)
            assert isinstance(out, ClientError) and out.status == "StatusCode.INTERNAL", out
            assert MESSAGE in str(out) and "Traceback" not in str(out) and 'File "' not in str(out)
        for prompt, future in zip(PROMPTS, good):
            out = future.result(WAIT_S)
            assert isinstance(out, Answer) and out.output_ids == reference[prompt], prompt
        after = samples(server.metrics_url, "specdec_requests_total")
        failed = 'specdec_requests_total{outcome="failed"}'
        assert after[failed] - before.get(failed, 0) == 10
        assert server.is_ready()
        # observation 7: the internal models refuse clients (raw ids, another client's cancel, garbage ids)
        raw = grpcclient.InferenceServerClient(url)
        from specdec.runtime.request import RequestMetrics
        from specdec.serving import protocol, responses

        garbage = responses.engine_response([1, 10**9], 0, True, (), "stop", RequestMetrics())
        wire = {s.name: s.dtype.removeprefix("TYPE_").replace("STRING", "BYTES") for s in protocol.ENGINE_OUTPUTS}
        for model, tensors in (
            ("postprocessing", {name: (wire[name], value) for name, value in garbage.items()}),
            ("specdec_engine", {"input_ids": ("INT32", np.array([1, 2, 3], np.int32))}),
            ("preprocessing", {"text_input": ("BYTES", np.array([b"hi"], object))}),
        ):
            inputs = []
            for name, (dtype, value) in tensors.items():
                inputs.append(grpcclient.InferInput(name, list(value.shape), dtype))
                inputs[-1].set_data_from_numpy(value)
            with pytest.raises(InferenceServerException) as refused:
                if model == "specdec_engine":  # decoupled: only over a stream
                    _stream_once(raw, model, inputs)
                else:
                    raw.infer(model, inputs)
            text = str(refused.value)  # a stream's error is in band, without a status (SpecdecClient.stream)
            assert "internal to the specdec deployment" in text, (model, text)
            assert model == "specdec_engine" or "INVALID_ARGUMENT" in text, (model, text)
            assert "Traceback" not in text and 'File "' not in text, text
        # management APIs want the admin header; inference, health and statistics do not
        with pytest.raises(InferenceServerException):
            raw.get_log_settings()
        assert raw.get_log_settings(headers={GRPC_ADMIN_HEADER: server.admin_key}) is not None
        assert raw.is_server_ready() and raw.get_inference_statistics("specdec") is not None
        pool.shutdown()
    finally:
        assert server.stop() == 0, server.read_log()[-3000:]

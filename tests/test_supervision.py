"""Every process of a served deployment supervised (``specdec.serving.supervisor``), tried as an operator would on a
real ``specdec serve`` over loopback: kill or stop any stub, idle and under load, drain with a readiness poller,
kill the engine as Triton turns ready, kill ``specdec serve`` itself.

The deployment is the tiny export (``tiny_export``: it loads in seconds, so a repair is quick to wait for); its
subject is the supervision, not the model. Timings are measured and printed, never asserted tighter than what a
loaded machine allows: readiness must turn false before the server is ready again and within ``FALSE_WITHIN_S``,
and every wait is for an event, bounded by ``WAIT_S``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from fault_hooks import SLOW_SEED
from servers import SPECDEC_SERVE, eventually, free_ports, needs_tritonserver, samples

needs_tritonserver()
import tritonclient.grpc as grpcclient  # noqa: E402

from specdec.serving import processes, protocol  # noqa: E402
from specdec.serving.client import ClientError, SpecdecClient  # noqa: E402
from specdec.serving.server import CONTROL_DIR_PREFIX, http_ready  # noqa: E402

pytestmark = [pytest.mark.server]
WAIT_S = 180.0
#: readiness must turn false this soon after a failure (the supervisor polls every 0.2 s; generous for a busy CI)
FALSE_WITHIN_S = 10.0
PROMPT = "hello there"
#: a request cut off by a repair ends long before this (the slowest repair measured on a loaded 2-core machine took
#: about 20 s); one that runs into it hung
HANG_S = 60.0


@dataclass
class Served:
    proc: subprocess.Popen[str]
    grpc: str
    http: str
    metrics: str
    log: Path
    started_s: float  # from launch to ready: the cold start a repair is compared with

    def server_pid(self) -> int:
        (pid,) = [p for p, cmd in processes.children(self.proc.pid).items() if Path(cmd[0]).name == "tritonserver"]
        return pid

    def stub(self, model: str) -> int:
        return processes.stub_pids(self.server_pid(), model)[0]

    def grpc_ready(self) -> bool:
        try:
            return bool(grpcclient.InferenceServerClient(self.grpc).is_server_ready(client_timeout=2.0))
        except Exception:
            return False

    def answer(self, **params: object) -> list[int]:
        return SpecdecClient(self.grpc).generate(PROMPT, max_tokens=8, **params).output_ids


def serve(export: Path, log: Path, *args: str) -> Served:
    """``specdec serve`` over the export in its own process, ready (``WAIT_S`` at most)."""
    grpc, http, metrics, openai = free_ports(4)
    started = time.monotonic()
    ports = ["--grpc-port", str(grpc), "--http-port", str(http), "--metrics-port", str(metrics)]
    proc = subprocess.Popen(
        [
            *(*SPECDEC_SERVE, str(export / "triton_repo"), *ports, "--openai-port", str(openai)),
            *("--log-file", str(log), "--ready-timeout", str(WAIT_S), "--exit-timeout", "30", *args),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "SPECDEC_FAULT_HOOK": f"{Path(__file__).parent / 'fault_hooks.py'}:slow_marked"},
    )
    while line := proc.stdout.readline():  # type: ignore[union-attr]
        if line.startswith("(Ctrl-C"):
            return Served(
                proc,
                f"127.0.0.1:{grpc}",
                f"http://127.0.0.1:{http}",
                f"http://127.0.0.1:{metrics}/metrics",
                log,
                time.monotonic() - started,
            )
    proc.kill()
    raise AssertionError(f"specdec serve did not get ready: {proc.stderr.read()}")  # type: ignore[union-attr]


@contextlib.contextmanager
def served(export: Path, tmp_path: Path, *args: str) -> Iterator[Served]:
    """A server for one test; afterwards none of its processes may be left."""
    server = serve(export, tmp_path / "triton.log", *args)
    tree: list[int] = []
    try:
        yield server
    finally:
        tree = descendants(server.proc.pid)
        if server.proc.poll() is None:
            server.proc.send_signal(signal.SIGINT)
            try:
                server.proc.wait(60)
            except subprocess.TimeoutExpired:
                server.proc.kill()
                server.proc.wait()
    assert eventually(lambda: not any(processes.alive(pid) for pid in tree), timeout=WAIT_S), tree


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` now (its tritonserver, the stubs, the frontend)."""
    import psutil

    try:
        return [p.pid for p in psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


@pytest.fixture(scope="module")
def server(tiny_export: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """One server the repair tests share: each leaves it serving again. It is repaired on purpose, over and over, so
    its window is one second: each repair is the first of its window, at once, neither backed off (up to 30 s each
    by the tenth) nor a crash loop; ``test_a_crash_loop_gives_up_with_exit_1`` is the one about those."""
    args = ("--max-restarts", "100", "--restart-window", "1")
    with served(tiny_export, tmp_path_factory.mktemp("supervised"), *args) as running:
        yield running


def readiness_after(server: Served, kill: callable) -> tuple[float, float]:  # type: ignore[valid-type]
    """Do ``kill``; (seconds until readiness was false on both HTTP and gRPC, seconds until ready again)."""
    start = time.monotonic()
    kill()
    assert eventually(lambda: not http_ready(server.http) and not server.grpc_ready(), timeout=WAIT_S, poll_s=0.02)
    false_after = time.monotonic() - start
    assert eventually(lambda: http_ready(server.http) and server.grpc_ready(), timeout=WAIT_S, poll_s=0.1)
    return false_after, time.monotonic() - start


@pytest.mark.reliability("R1", "R2")
@pytest.mark.parametrize(
    "model",
    [
        protocol.PREPROCESSING_MODEL,
        protocol.POSTPROCESSING_MODEL,
        protocol.UNARY_MODEL,
        protocol.STREAM_MODEL,
        protocol.READY_MODEL,
        protocol.ENGINE_MODEL,
    ],
)
def test_a_dead_stub_turns_readiness_false_and_is_replaced(server: Served, model: str) -> None:
    """Observation 1 (and the engine's, which was the only one watched): SIGKILL of any stub, idle. Before the fix a
    dead preprocessing, postprocessing, specdec or specdec_stream stub left readiness true forever."""
    before = server.answer()
    false_after, back_after = readiness_after(server, lambda: os.kill(server.stub(model), signal.SIGKILL))
    print(
        f"{model}: readiness false after {false_after:.2f} s, ready again after {back_after:.1f} s "
        f"(cold start {server.started_s:.1f} s)"
    )
    assert false_after < FALSE_WITHIN_S
    assert server.answer() == before  # the same answer after the repair
    assert server.answer(method="ar") == before


def test_a_stopped_engine_is_a_failure(server: Served) -> None:
    """Observation 2: SIGSTOP of the engine stub left readiness true and the model dead after SIGCONT."""
    before = server.answer()
    engine = server.stub(protocol.ENGINE_MODEL)
    try:
        false_after, back_after = readiness_after(server, lambda: os.kill(engine, signal.SIGSTOP))
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(engine, signal.SIGCONT)
    print(f"stopped engine: readiness false after {false_after:.2f} s, ready again after {back_after:.1f} s")
    assert false_after < FALSE_WITHIN_S and not processes.alive(engine)
    assert server.answer() == before


@pytest.mark.reliability("R2")
@pytest.mark.parametrize(
    ("model", "streamed"),
    [(protocol.POSTPROCESSING_MODEL, True), (protocol.STREAM_MODEL, True), (protocol.UNARY_MODEL, False)],
)
def test_requests_in_flight_on_a_dead_stub_end_with_unavailable(server: Served, model: str, streamed: bool) -> None:
    """Under load: requests decoding (slowed, so they are) when postprocessing or the entry point holding them dies
    each end promptly, with UNAVAILABLE or a whole answer, none hung; the server serves again. The entry points'
    case hung its clients until their deadline while a reload replaced the stub: Triton never answers a decoupled
    request whose stub died, so their death restarts the server, whose closed ports end every call at once."""
    before = server.answer()
    outcomes: list[object] = []

    def ask(i: int) -> None:
        client = SpecdecClient(server.grpc, timeout_s=HANG_S)  # a hung call ends DEADLINE_EXCEEDED: the test fails
        call = client.generate_stream if streamed else client.generate
        try:
            outcomes.append(call(PROMPT, max_tokens=60, min_tokens=60, seed=SLOW_SEED, temperature=1.0))
        except ClientError as exc:
            outcomes.append(exc)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(3)]
    for thread in threads:
        thread.start()
    time.sleep(1.0)  # admitted and decoding (each step is slowed: fault_hooks.slow_marked)
    killed = time.monotonic()
    os.kill(server.stub(model), signal.SIGKILL)
    for thread in threads:
        thread.join(WAIT_S)
    assert not any(t.is_alive() for t in threads), "a client hung"
    print(f"{model} killed: the last of its clients answered after {time.monotonic() - killed:.1f} s")
    errors = [o for o in outcomes if isinstance(o, ClientError)]
    assert errors and all(e.status == "StatusCode.UNAVAILABLE" for e in errors), outcomes
    assert eventually(lambda: http_ready(server.http), timeout=WAIT_S)
    assert server.answer() == before


def test_the_repairs_are_counted_on_the_metrics_port(server: Served) -> None:
    """Observation 8: restarts were counted by no metric. The launcher's counts are published by the readiness
    gate (the launcher has no metrics port of its own), as they are after every repair this server had before:
    each reload of the gate once, never added to its predecessor's (which Triton keeps by name)."""
    import tempfile

    from specdec.serving.control import Control

    (directory,) = Path(tempfile.gettempdir()).glob(f"{CONTROL_DIR_PREFIX}{server.proc.pid}-*")

    def published() -> dict[str, float]:
        return samples(server.metrics, "specdec_server")

    before = published()["specdec_server_reloads_total"]
    readiness_after(server, lambda: os.kill(server.stub(protocol.PREPROCESSING_MODEL), signal.SIGKILL))
    assert eventually(lambda: published()["specdec_server_reloads_total"] == before + 1), (before, published())
    launcher = Control(directory).counts()
    assert published() == {f"specdec_server_{name}_total": count for name, count in launcher.items()}


@pytest.mark.reliability("R4")
def test_readiness_is_false_from_the_first_instant_of_a_drain(tiny_export: Path, tmp_path: Path) -> None:
    """Observation 3: half a second into a drain readiness still answered 200. A poller on both protocols sees
    nothing ready after SIGTERM reaches ``specdec serve``; liveness stays true until the process exits."""
    with served(tiny_export, tmp_path) as server:
        seen: list[tuple[float, bool, bool]] = []
        stop = threading.Event()

        def poll() -> None:
            live = grpcclient.InferenceServerClient(server.grpc)
            while not stop.is_set():
                at = time.monotonic()
                try:
                    alive = bool(live.is_server_live(client_timeout=2.0))
                except Exception:
                    alive = False
                seen.append((at, http_ready(server.http) or server.grpc_ready(), alive))

        poller = threading.Thread(target=poll, daemon=True)
        poller.start()
        assert eventually(lambda: len(seen) > 3)
        slow = threading.Thread(target=lambda: server.answer(seed=SLOW_SEED, temperature=1.0), daemon=True)
        slow.start()
        time.sleep(0.5)
        signalled = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(WAIT_S) == 0
        stop.set()
        poller.join(10)
    late = [(at - signalled, ready) for at, ready, _ in seen if at > signalled + 0.05 and ready]
    assert not late, f"ready after the drain began: {late[:3]}"
    assert any(alive and not ready for at, ready, alive in seen if at > signalled), "liveness fell with readiness"


def test_an_engine_killed_as_triton_turns_ready_is_repaired(tiny_export: Path, tmp_path: Path) -> None:
    """Observation 4: an engine killed at the first HTTP 200, before ``specdec serve`` printed ready, was never
    watched: every request failed. Its heartbeat is watched from the moment it loads."""
    grpc, http, metrics, openai = free_ports(4)
    ports = ["--grpc-port", str(grpc), "--http-port", str(http), "--metrics-port", str(metrics)]
    proc = subprocess.Popen(
        [*SPECDEC_SERVE, str(tiny_export / "triton_repo"), *ports, "--openai-port", str(openai)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        url = f"http://127.0.0.1:{http}"
        assert eventually(lambda: http_ready(url), timeout=WAIT_S, poll_s=0.01)
        server_pid = next(p for p, cmd in processes.children(proc.pid).items() if Path(cmd[0]).name == "tritonserver")
        os.kill(processes.stub_pids(server_pid, protocol.ENGINE_MODEL)[0], signal.SIGKILL)
        assert eventually(lambda: "repairing" in _read_err(proc), timeout=WAIT_S)
        assert eventually(lambda: http_ready(url), timeout=WAIT_S)
        assert SpecdecClient(f"127.0.0.1:{grpc}").generate(PROMPT, max_tokens=4).output_ids
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(60)


_ERR: dict[int, str] = {}  # stderr read so far, per process


def _read_err(proc: subprocess.Popen[str]) -> str:
    """What ``proc`` wrote to stderr so far (read line by line without blocking the test: the supervisor prints)."""
    import select

    while select.select([proc.stderr], [], [], 0)[0]:
        line = proc.stderr.readline()  # type: ignore[union-attr]
        if not line:
            break
        _ERR[proc.pid] = _ERR.get(proc.pid, "") + line
    return _ERR.get(proc.pid, "")


@pytest.mark.reliability("R3")
def test_killing_specdec_serve_takes_its_whole_tree_down(tiny_export: Path, tmp_path: Path) -> None:
    """Observation 5: SIGKILL of ``specdec serve`` orphaned tritonserver and its stubs (still serving, holding the
    ports) and left the control directory with the admin key behind. Now they die with it, and the next start
    reclaims the directory."""
    server = serve(tiny_export, tmp_path / "triton.log")
    tree = descendants(server.proc.pid)
    control = [d for d in Path(os.environ.get("TMPDIR", "/tmp")).glob(f"{CONTROL_DIR_PREFIX}{server.proc.pid}-*")]
    assert control, "no control directory named by the launcher's pid"
    server.proc.kill()
    server.proc.wait()
    assert eventually(lambda: not any(processes.alive(pid) for pid in tree), timeout=WAIT_S)
    assert eventually(lambda: not http_ready(server.http), timeout=30)
    (tmp_path / "again").mkdir()
    with served(tiny_export, tmp_path / "again"):
        assert not any(d.exists() for d in control), "the dead launcher's control directory was not reclaimed"


def test_a_crash_loop_gives_up_with_exit_1(tiny_export: Path, tmp_path: Path) -> None:
    """Observation 8: a second engine death ended the server whatever the time between them; now repairs back off
    and only more than ``--max-restarts`` within ``--restart-window`` is a crash loop (exit 1, said so)."""
    server = serve(tiny_export, tmp_path / "triton.log", "--max-restarts", "1", "--restart-window", "600")
    tree = descendants(server.proc.pid)
    try:
        readiness_after(server, lambda: os.kill(server.stub(protocol.ENGINE_MODEL), signal.SIGKILL))  # repaired
        tree += descendants(server.proc.pid)
        os.kill(server.stub(protocol.ENGINE_MODEL), signal.SIGKILL)
        assert server.proc.wait(WAIT_S) == 1
        assert "crash loop" in server.proc.stderr.read()  # type: ignore[union-attr]
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
    assert eventually(lambda: not any(processes.alive(pid) for pid in tree), timeout=WAIT_S)

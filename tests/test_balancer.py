"""Replicas behind a real load balancer (issue 23): two ``specdec serve`` of one SmolLM2 export behind HAProxy.

Everything is real and on loopback: two ``specdec serve`` processes (tritonserver, Python-backend stubs), Debian's
``haproxy`` run by ``specdec.deploy.balancer.Balancer``, tritonclient over gRPC through the balancer. What must hold:

* requests from concurrent clients are spread over both replicas (each replica's own Prometheus counter moves)
  and every answer, unary or streamed, is token for token the local runtime's;
* a replica SIGKILLed under load (``specdec serve`` and its tritonserver: a lost machine) fails exactly the
  requests that were on it, with an error and no hang; requests sent after its death succeed through the
  survivor (connection refused -> redispatched), the health check marks it down, and once it is started again
  on the same ports it takes traffic again.
"""

from __future__ import annotations

import http.server
import importlib.util
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from servers import SPECDEC_SERVE, eventually, failed, free_ports, processes_mentioning

from specdec.deploy.balancer import (
    HTTP_BACKEND,
    INSTALL_HINT,
    OPENAI_BACKEND,
    OPENAI_READY_PATH,
    READY_PATH,
    Balancer,
    BalancerError,
    HealthCheck,
    Replica,
    find_haproxy,
    render_config,
)
from specdec.runtime.config import EngineConfig
from specdec.runtime.engine import Engine
from specdec.serving.client import Answer, ClientError, SpecdecClient
from specdec.serving.control import inflight_from_metrics, remove_shm
from specdec.serving.install import TritonNotFoundError, find_tritonserver
from specdec.serving.processes import alive, children, stub_pids
from specdec.serving.server import error_summary, http_ready, read_log


def _missing() -> tuple[str | None, str | None]:
    """Why the balancer tests cannot run here (no haproxy), and why the replica tests cannot (no server)."""
    try:
        find_haproxy()
        haproxy = None
    except BalancerError as exc:
        haproxy = str(exc)
    try:
        find_tritonserver()
        server = None if importlib.util.find_spec("tritonclient") else "tritonclient (the `serve` extra) not installed"
    except TritonNotFoundError as exc:  # pragma: no cover - depends on the machine
        server = f"no tritonserver available: {exc}"
    return haproxy, server


NO_HAPROXY, NO_SERVER = _missing()
needs_haproxy = pytest.mark.skipif(NO_HAPROXY is not None, reason=f"{NO_HAPROXY} ({INSTALL_HINT})")
needs_server = pytest.mark.skipif(NO_SERVER is not None, reason=str(NO_SERVER))

PROMPTS = [
    "Write a short story about a lighthouse keeper.",
    "List ten facts about the ocean.",
    "Explain how a bicycle works.",
    "Describe a busy market in the morning.",
    "Write a letter to a friend about a trip to the mountains.",
    "What is the capital of France?",
    "Give three tips for learning a language.",
    "Summarize the plot of a fairy tale.",
]
MAX_TOKENS = 24  # a couple of seconds per request on 2 cores: enough to be in flight when a replica dies
CLIENTS = 8
WAIT_S = 240.0  # what a loaded CI machine may need to load a replica; a passing run waits for events, not this
CLIENT_TIMEOUT_S = 60.0  # every request ends within this (a hung one would end DEADLINE_EXCEEDED: it fails the test)
NO_HANG_S = 30.0  # the target is 5 s to the first success after a kill; this bound only catches a hang
REQUESTS = "specdec_requests_total"  # {outcome=...}, summed over any other label (e.g. the engine instance)


@pytest.fixture(scope="module")
def reference(smollm2_export: Path) -> dict[str, list[int]]:
    """The local runtime's greedy answers, before any server runs."""
    engine = Engine.from_export(smollm2_export, config=EngineConfig(threads=1))
    outputs = engine.generate([engine.request(p, chat=True, max_tokens=MAX_TOKENS) for p in PROMPTS], "ems").outputs
    return {p: o.token_ids for p, o in zip(PROMPTS, outputs)}


@dataclass
class Served:
    """One ``specdec serve`` replica on fixed ports (so it can be started again where the balancer expects it)."""

    repository: Path
    replica: Replica
    metrics_port: int
    log_dir: Path
    proc: subprocess.Popen[bytes] | None = None
    starts: int = 0

    def start(self) -> None:
        self.starts += 1
        out = (self.log_dir / f"{self.replica.name}-serve-{self.starts}.out").open("wb")
        self.proc = subprocess.Popen(
            [
                *SPECDEC_SERVE,
                str(self.repository),
                "--grpc-port",
                str(self.replica.grpc_port),
                "--http-port",
                str(self.replica.http_port),
                "--metrics-port",
                str(self.metrics_port),
                "--openai-port",
                str(self.replica.openai_port),
                "--log-file",
                str(self.log_dir / f"{self.replica.name}-triton-{self.starts}.log"),
                "--ready-timeout",
                str(WAIT_S),
                "--drain-timeout",
                "30",
                "--exit-timeout",
                "30",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
        out.close()

    def wait_ready(self) -> None:
        assert eventually(lambda: self.ready() or self.proc.poll() is not None, timeout=WAIT_S)  # type: ignore[union-attr]
        assert self.ready(), f"{self.replica.name} did not get ready:\n{self.output()[-3000:]}"

    def ready(self) -> bool:
        return http_ready(f"http://127.0.0.1:{self.replica.http_port}")

    def output(self) -> str:
        return (self.log_dir / f"{self.replica.name}-serve-{self.starts}.out").read_text(errors="replace")

    def metrics(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10) as resp:
            return resp.read().decode()

    def finished(self, outcome: str = "finished") -> float:
        """Requests this replica answered in full (its own Prometheus counter), or that ended with ``outcome``."""
        total = 0.0
        for line in self.metrics().splitlines():
            series, _, value = line.rpartition(" ")
            name, _, labels = series.partition("{")
            if name == REQUESTS and f'outcome="{outcome}"' in labels.rstrip("}").split(","):
                total += float(value)
        return total

    def inflight(self) -> int:
        return inflight_from_metrics(self.metrics()) or 0

    def kill(self) -> float:
        """SIGKILL ``specdec serve`` (so nothing restarts it), its tritonserver, then the orphaned stubs: the
        machine is lost. Returns when tritonserver is dead (its sockets closed), the monotonic time of that."""
        assert self.proc is not None
        server = [pid for pid, cmd in children(self.proc.pid).items() if Path(cmd[0]).name == "tritonserver"]
        assert len(server) == 1, server
        stubs = list(children(server[0]))
        self.proc.kill()
        os.kill(server[0], signal.SIGKILL)
        assert eventually(lambda: not alive(server[0]), timeout=30, poll_s=0.01)
        dead = time.monotonic()
        self.proc.wait(30)
        for pid in stubs:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        assert eventually(lambda: not any(alive(pid) for pid in stubs), timeout=30)
        remove_shm(f"specdec_{self.proc.pid}_")  # what its supervisor would have removed
        return dead

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGINT)
        try:
            assert self.proc.wait(WAIT_S) == 0, self.output()[-3000:]
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()


@dataclass
class Cluster:
    balancer: Balancer
    replicas: list[Served]

    def states(self) -> dict[str, str]:
        return self.balancer.server_states()


@pytest.fixture(scope="module")
def cluster(smollm2_export: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """Two replicas of the export (loaded side by side) behind one balancer, gRPC and HTTP frontends."""
    logs = tmp_path_factory.mktemp("balancer")
    replicas = []
    for index in range(2):
        grpc, http, metrics, openai_port = free_ports(4)
        replica = Replica("127.0.0.1", grpc, http, f"r{index}", openai_port)
        replicas.append(Served(smollm2_export / "triton_repo", replica, metrics, logs))
    lb_grpc, lb_http = free_ports(2)
    balancer = Balancer([s.replica for s in replicas], grpc_port=lb_grpc, http_port=lb_http, workdir=logs / "haproxy")
    try:
        for served in replicas:
            served.start()
        for served in replicas:
            served.wait_ready()
        with balancer:
            cluster = Cluster(balancer, replicas)
            assert eventually(lambda: set(cluster.states().values()) == {"UP"}, timeout=60), cluster.states()
            yield cluster
            for served in replicas:
                served.stop()
    finally:
        for served in replicas:
            if served.proc is not None and served.proc.poll() is None:
                served.proc.kill()
                served.proc.wait()
    assert eventually(lambda: processes_mentioning(str(smollm2_export / "triton_repo")) == [])


@pytest.fixture(autouse=True)
def _replica_output_on_failure(request: pytest.FixtureRequest) -> Iterator[None]:
    """A failed test shows what each replica said (its repairs, why it gave up) and Triton's errors: all CI gives."""
    yield
    if "cluster" in request.fixturenames and failed(request):
        for served in request.getfixturevalue("cluster").replicas:
            log = read_log(served.log_dir / f"{served.replica.name}-triton-{served.starts}.log")
            code = served.proc.poll() if served.proc is not None else None
            print(f"--- {served.replica.name}, start {served.starts}, exit code {code}:\n{served.output()[-4000:]}")
            print(error_summary(log))


def _ask(url: str, prompt: str, stream: bool) -> Answer | ClientError:
    client = SpecdecClient(url, timeout_s=CLIENT_TIMEOUT_S)
    try:
        call = client.generate_stream if stream else client.generate
        return call(prompt, max_tokens=MAX_TOKENS, apply_chat_template=True)
    except ClientError as exc:
        return exc
    finally:
        client.close()


@pytest.mark.server
@needs_server
@needs_haproxy
def test_requests_are_spread_over_both_replicas_and_answered_exactly(cluster: Cluster, reference: dict) -> None:
    url = cluster.balancer.grpc_url
    before = [s.finished() for s in cluster.replicas]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(64)]
    with ThreadPoolExecutor(CLIENTS) as pool:
        answers = list(pool.map(lambda p: _ask(url, p, stream=False), prompts))
    for prompt, answer in zip(prompts, answers):
        assert isinstance(answer, Answer) and answer.output_ids == reference[prompt], (prompt, answer)

    def served() -> list[float]:
        return [s.finished() - b for s, b in zip(cluster.replicas, before)]

    # the counters count each request once, on the replica that ran it; both ran some
    assert eventually(lambda: sum(served()) == len(prompts), timeout=30), served()
    assert all(n > 0 for n in served()), served()
    print(f"\n64 requests through the balancer: served {served()} by r0, r1")
    # streaming through the balancer: partial responses arrive, and they add up to the unary answer
    with ThreadPoolExecutor(4) as pool:
        streamed = list(pool.map(lambda p: _ask(url, p, stream=True), PROMPTS[:4]))
    for prompt, answer in zip(PROMPTS, streamed):
        assert isinstance(answer, Answer) and answer.output_ids == reference[prompt], (prompt, answer)
        assert answer.responses > 1, answer
    # a client that stops reading cancels its stream: the cancel crosses the balancer and the engine stops
    cancelled_before = sum(s.finished("cancelled") for s in cluster.replicas)
    client = SpecdecClient(url, timeout_s=CLIENT_TIMEOUT_S)
    stream = iter(client.stream(PROMPTS[0], max_tokens=400, apply_chat_template=True))
    next(stream)
    stream.close()  # SpecdecClient.stream's finally: stop_stream(cancel_requests=True)
    client.close()
    assert eventually(
        lambda: sum(s.finished("cancelled") for s in cluster.replicas) == cancelled_before + 1, timeout=60
    ), "the cancel did not reach the engine"
    # Triton's HTTP API balanced on the second frontend, checked the same way
    assert set(cluster.balancer.server_states(HTTP_BACKEND).values()) == {"UP"}
    with urllib.request.urlopen(f"{cluster.balancer.http_url}{READY_PATH}", timeout=10) as resp:
        assert resp.status == 200


@dataclass
class Outcome:
    started: float
    ended: float
    stream: bool
    prompt: str
    result: Answer | ClientError


@dataclass
class Load:
    """``CLIENTS`` threads sending requests through the balancer back to back (every other one streamed)."""

    url: str
    outcomes: list[Outcome] = field(default_factory=list)
    stopping: threading.Event = field(default_factory=threading.Event)
    threads: list[threading.Thread] = field(default_factory=list)

    def start(self) -> None:
        self.threads = [threading.Thread(target=self._client, args=(i,), daemon=True) for i in range(CLIENTS)]
        for thread in self.threads:
            thread.start()

    def _client(self, index: int) -> None:
        sent = 0
        while not self.stopping.is_set():
            prompt, stream = PROMPTS[(index + sent) % len(PROMPTS)], (index + sent) % 2 == 0
            started = time.monotonic()
            result = _ask(self.url, prompt, stream)
            self.outcomes.append(Outcome(started, time.monotonic(), stream, prompt, result))
            sent += 1

    def stop(self) -> None:
        self.stopping.set()
        for thread in self.threads:  # each request ends within CLIENT_TIMEOUT_S
            thread.join(CLIENT_TIMEOUT_S + 30)
            assert not thread.is_alive(), "a client hung"

    def ok_after(self, moment: float) -> list[Outcome]:
        return [o for o in list(self.outcomes) if o.started >= moment and isinstance(o.result, Answer)]


@pytest.mark.server
@needs_server
@needs_haproxy
def test_a_killed_replica_fails_only_its_requests_and_the_survivor_takes_over(
    cluster: Cluster, reference: dict
) -> None:
    victim, survivor = cluster.replicas
    load = Load(cluster.balancer.grpc_url)
    load.start()
    try:
        # both replicas busy (the victim has requests on it to lose), then the victim's machine is lost
        assert eventually(
            lambda: len(load.outcomes) >= CLIENTS and victim.inflight() >= 2 and survivor.inflight() >= 1,
            timeout=WAIT_S,
            poll_s=0.05,
        )
        survivor_before = survivor.finished()
        dead = victim.kill()
        assert eventually(lambda: cluster.states()[victim.replica.name] == "DOWN", timeout=NO_HANG_S, poll_s=0.05)
        down_s = time.monotonic() - dead
        assert eventually(lambda: len(load.ok_after(dead)) >= 2 * CLIENTS, timeout=WAIT_S)
    finally:
        load.stop()
    errors = [o for o in load.outcomes if isinstance(o.result, ClientError)]
    after = load.ok_after(dead)
    first_ok_s = min(o.ended for o in after) - dead
    first_response_s = min(o.started + o.result.first_response_seconds for o in after) - dead  # type: ignore[union-attr]
    before_kill = [o.result.seconds for o in load.outcomes if isinstance(o.result, Answer) and o.ended < dead]
    print(
        f"\nkill -> balancer marks it DOWN: {down_s:.2f} s; kill -> first response to a request sent after it: "
        f"{first_response_s:.2f} s, its first complete answer: {first_ok_s:.2f} s (a request took "
        f"{min(before_kill):.2f}-{max(before_kill):.2f} s before the kill); {len(errors)} request(s) on it failed: "
        f"{sorted({f'{o.result.status}: {o.result}'[:120] for o in errors})}"
    )
    # what was on the victim failed, fast and with an error (not the client's deadline); nothing sent later did
    assert errors, "no request was on the killed replica"
    assert all(o.started < dead for o in errors), [(o.started - dead, str(o.result)) for o in errors]
    assert all(o.ended - dead < NO_HANG_S for o in errors), [o.ended - dead for o in errors]
    assert not [o for o in errors if o.result.status == "StatusCode.DEADLINE_EXCEEDED"], "a request hung"
    assert first_ok_s < NO_HANG_S
    for o in load.outcomes:
        if isinstance(o.result, Answer):
            assert o.result.output_ids == reference[o.prompt], o
    assert survivor.finished() > survivor_before
    # started again on the same ports, it is checked back in and takes traffic again
    victim.start()
    victim.wait_ready()
    assert eventually(lambda: cluster.states()[victim.replica.name] == "UP", timeout=60), cluster.states()

    def victim_serves() -> bool:
        with ThreadPoolExecutor(CLIENTS) as pool:
            answers = list(pool.map(lambda p: _ask(cluster.balancer.grpc_url, p, stream=False), PROMPTS))
        assert all(isinstance(a, Answer) and a.output_ids == reference[p] for p, a in zip(PROMPTS, answers)), answers
        return victim.finished() > 0  # a new server's counter starts at 0

    assert eventually(victim_serves, timeout=WAIT_S, poll_s=0)
    # the recipe's planned stop: the survivor drained on the balancer first, so every new request goes to the other
    cluster.balancer.set_state(survivor.replica.name, "drain")
    assert cluster.states()[survivor.replica.name] == "DRAIN"
    counts = [victim.finished(), survivor.finished()]
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda p: _ask(cluster.balancer.grpc_url, p, stream=False), PROMPTS[:4]))
    assert all(isinstance(a, Answer) and a.output_ids == reference[p] for p, a in zip(PROMPTS, answers)), answers
    assert eventually(lambda: victim.finished() == counts[0] + 4, timeout=30)
    assert survivor.finished() == counts[1]
    cluster.balancer.set_state(survivor.replica.name, "ready")


@pytest.mark.server
@needs_server
@needs_haproxy
@pytest.mark.parametrize("process", ["tritonserver", "specdec_engine", "postprocessing", "specdec_stream"])
def test_any_process_of_a_replica_killed_the_next_request_through_the_balancer_succeeds(
    cluster: Cluster, reference: dict, process: str
) -> None:
    """Issue 39's acceptance: kill any one process of a replica's tree; the replica turns not ready at once (its
    supervisor closes the readiness gate, or its ports close), the balancer routes around it, a client that retries
    what was refused gets its answer, identical, and the replica is repaired and checked back in."""
    victim = cluster.replicas[0]
    assert victim.proc is not None
    (server,) = [pid for pid, cmd in children(victim.proc.pid).items() if Path(cmd[0]).name == "tritonserver"]
    target = server if process == "tritonserver" else stub_pids(server, process)[0]
    killed = time.monotonic()
    os.kill(target, signal.SIGKILL)
    answer: Answer | ClientError = ClientError("not asked")
    refused: list[str] = []  # what requests racing the death met before the balancer routed around it
    while time.monotonic() - killed < WAIT_S and not isinstance(answer, Answer):
        answer = _ask(cluster.balancer.grpc_url, PROMPTS[0], stream=process == "specdec_stream")
        if not isinstance(answer, Answer):
            refused.append(f"{answer.status}: {str(answer)[:80]}")
            time.sleep(0.2)
    first_ok_s = time.monotonic() - killed
    assert isinstance(answer, Answer) and answer.output_ids == reference[PROMPTS[0]], answer
    assert eventually(lambda: cluster.states()[victim.replica.name] == "UP", timeout=WAIT_S), cluster.states()
    print(
        f"\n{process} killed: first answer through the balancer after {first_ok_s:.2f} s; the replica repaired "
        f"and UP again after {time.monotonic() - killed:.1f} s"
    )


# --------------------------------------------------------------------------- haproxy alone (the fast tier)


@needs_haproxy
def test_the_config_is_valid_and_resends_only_what_never_reached_a_replica(tmp_path: Path) -> None:
    replicas = [Replica("127.0.0.1", 9001, 9000), Replica("::1", 9011, 9010, "b")]
    config = render_config(replicas, ("0.0.0.0", 8001), ("0.0.0.0", 8000))
    (tmp_path / "haproxy.cfg").write_text(config)
    checked = subprocess.run(
        [str(find_haproxy()), "-c", "-f", str(tmp_path / "haproxy.cfg")], capture_output=True, text=True
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
    lines = [line.strip() for line in config.splitlines()]
    # connection failures only: no L7 retry-on keyword, so a request a replica received is never run twice
    assert [line for line in lines if line.startswith("retry-on")] == ["retry-on conn-failure"]
    assert "option redispatch 1" in lines and f"http-check send meth GET uri {READY_PATH}" in lines
    grpc = [line for line in lines if line.startswith("server") and "proto h2" in line]
    assert [line.split()[2] for line in grpc] == ["127.0.0.1:9001", "[::1]:9011"]
    # traffic to the gRPC port over h2c, the readiness check to the HTTP port over HTTP/1.1
    assert all(" check " in line and "check-proto h1" in line for line in grpc)
    assert [line.split(" port ")[1].split()[0] for line in grpc] == ["9000", "9010"]
    assert Replica.parse("10.0.0.5:8001:8000") == Replica("10.0.0.5", 8001, 8000)
    with pytest.raises(ValueError, match="HOST:GRPC_PORT:HTTP_PORT"):
        Replica.parse("10.0.0.5:8001")
    with pytest.raises(ValueError, match="differ"):
        render_config([Replica("a", 1, 2, "x"), Replica("b", 3, 4, "x")], ("127.0.0.1", 8001))


@needs_haproxy
def test_the_openai_api_is_balanced_on_each_frontends_own_readiness(tmp_path: Path) -> None:
    replicas = [Replica("127.0.0.1", 9001, 9000, openai_port=9003), Replica("::1", 9011, 9010, "b", 9013)]
    config = render_config(replicas, ("0.0.0.0", 8001), None, openai_listen=("0.0.0.0", 8003))
    (tmp_path / "haproxy.cfg").write_text(config)
    checked = subprocess.run(
        [str(find_haproxy()), "-c", "-f", str(tmp_path / "haproxy.cfg")], capture_output=True, text=True
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
    section = config.split(f"\nbackend {OPENAI_BACKEND}\n")[1].split("\n\n")[0].splitlines()
    assert f"    http-check send meth GET uri {OPENAI_READY_PATH}" in section
    servers = [line.split()[2] for line in section if line.strip().startswith("server")]
    assert servers == ["127.0.0.1:9003", "[::1]:9013"]
    assert all(" check " in line for line in section if line.strip().startswith("server"))
    assert "bind 0.0.0.0:8003" in config.split("frontend specdec_openai_in")[1].splitlines()[1]
    assert Replica.parse("10.0.0.5:8001:8000:8003") == Replica("10.0.0.5", 8001, 8000, openai_port=8003)
    assert Replica.parse("[::1]:8001:8000:8003") == Replica("::1", 8001, 8000, openai_port=8003)
    with pytest.raises(ValueError, match="OpenAI port"):
        render_config([Replica("a", 1, 2)], ("127.0.0.1", 8001), openai_listen=("127.0.0.1", 8003))


class _Readiness(http.server.BaseHTTPRequestHandler):
    """A replica's readiness endpoint and nothing else (HTTP/1.x only, as Triton's is): 200 while ``ready``."""

    ready = threading.Event()
    path_checked = READY_PATH

    def do_GET(self) -> None:
        ok = self.path == self.path_checked and self.ready.is_set()
        self.send_response(200 if ok else 400)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@needs_haproxy
def test_a_replica_is_checked_on_its_http_port_and_taken_out_when_not_ready(tmp_path: Path) -> None:
    """The check goes to the HTTP port (nothing listens on the gRPC one), wants 200, and flips within bounds."""
    grpc, lb = free_ports(2)
    readiness = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Readiness)
    threading.Thread(target=readiness.serve_forever, daemon=True).start()
    _Readiness.ready.set()
    check = HealthCheck()
    try:
        with Balancer(
            [Replica("127.0.0.1", grpc, readiness.server_address[1])], grpc_port=lb, workdir=tmp_path
        ) as balancer:
            assert eventually(lambda: balancer.server_states() == {"r0": "UP"}, timeout=30), balancer.read_log()
            _Readiness.ready.clear()  # loading models again: it answers, with 400
            assert eventually(lambda: balancer.server_states() == {"r0": "DOWN"}, timeout=30)
            _Readiness.ready.set()
            assert eventually(lambda: balancer.server_states() == {"r0": "UP"}, timeout=30)
            readiness.shutdown()
            readiness.server_close()  # its port closes: refused
            gone = time.monotonic()
            assert eventually(lambda: balancer.server_states() == {"r0": "DOWN"}, timeout=30, poll_s=0.02)
            # the bound a dead replica is out within, with room for a loaded machine (this only catches a check
            # that never runs or runs far less often)
            assert time.monotonic() - gone < 10 * check.down_after_s()
            assert "r0 is DOWN" in balancer.read_log()
        assert not balancer.running()
    finally:
        readiness.server_close()


class _FrontendReadiness(_Readiness):
    """An OpenAI frontend's readiness: 503 while it drains."""

    ready = threading.Event()
    path_checked = OPENAI_READY_PATH


@needs_haproxy
def test_a_draining_openai_frontend_is_taken_out(tmp_path: Path) -> None:
    """The OpenAI backend asks each frontend's own ``/health/ready``, which turns 503 when ``specdec serve`` drains:
    the balancer stops sending it requests without the admin socket."""
    grpc, http_port, lb, lb_openai = free_ports(4)
    frontend = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _FrontendReadiness)
    threading.Thread(target=frontend.serve_forever, daemon=True).start()
    _FrontendReadiness.ready.set()
    replica = Replica("127.0.0.1", grpc, http_port, openai_port=frontend.server_address[1])
    try:
        with Balancer([replica], grpc_port=lb, openai_port=lb_openai, workdir=tmp_path) as balancer:
            assert balancer.openai_url == f"http://127.0.0.1:{lb_openai}"
            up = lambda: balancer.server_states(OPENAI_BACKEND) == {"r0": "UP"}  # noqa: E731
            assert eventually(up, timeout=30), balancer.read_log()
            _FrontendReadiness.ready.clear()  # draining
            assert eventually(lambda: balancer.server_states(OPENAI_BACKEND) == {"r0": "DOWN"}, timeout=30)
            _FrontendReadiness.ready.set()
            assert eventually(up, timeout=30)
    finally:
        frontend.shutdown()
        frontend.server_close()


@needs_haproxy
def test_specdec_deploy_balancer_runs_until_sigint(tmp_path: Path) -> None:
    grpc, http_port, lb = free_ports(3)
    code = "import sys; from specdec.cli import main; sys.exit(main(sys.argv[1:]))"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            code,
            "deploy",
            "balancer",
            "--replica",
            f"127.0.0.1:{grpc}:{http_port}",
            "--listen",
            f"127.0.0.1:{lb}",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stdout.readline()  # type: ignore[union-attr]
        assert line.startswith("specdec deploy balancer: gRPC 127.0.0.1:"), line + proc.stderr.read()  # type: ignore[union-attr]
        config = Path(line.split("config ")[1].split(",")[0])
        assert f"port {http_port} check-proto h1" in config.read_text()
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0, proc.stderr.read()  # type: ignore[union-attr]
        assert not config.exists()  # its private directory is removed
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()

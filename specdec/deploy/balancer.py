"""A load balancer in front of several ``specdec serve`` replicas: HAProxy's config, its runner, the CLI.

Why HAProxy (Debian's ``haproxy`` package, 2.6 on bookworm) and not nginx (Debian's ``nginx``, 1.22):

* **Active health checks on another port.** A replica is fit for traffic when Triton's readiness endpoint
  (``GET /v2/health/ready`` on its HTTP port) answers 200; the traffic goes to its gRPC port. HAProxy checks
  each server itself (``option httpchk`` with ``check port <http>``), every ``interval_ms``, whether or not any
  traffic flows, so a replica that died, or one still loading its models, is taken out or kept out before a
  client meets it. nginx OSS only has passive checks (``max_fails``/``fail_timeout``: a server is skipped after
  *client requests* to it failed); its active ``health_check`` directive is NGINX Plus only. A replica
  restarting under ``specdec serve``'s supervision answers connections on its HTTP port while its models
  load, which only a readiness check tells apart from a serving one.
* **gRPC.** Both proxy gRPC over cleartext HTTP/2 (h2c): HAProxy with ``proto h2`` on the frontend's ``bind``
  and on each ``server``, trailers (``grpc-status``) and server streaming included, every gRPC call
  balanced on its own (one HTTP/2 stream = one HAProxy transaction).
* **Retries that are safe.** ``retry-on conn-failure`` with ``option redispatch 1`` resends a request only when
  the connection to a replica could not be made (refused, timed out), i.e. the request never reached it, and
  sends it to another replica. A request that reached a replica is never resent (no L7 ``retry-on`` keyword
  is set), so a replica killed mid-request fails that request back to its client instead of running it twice.
* **Runtime control.** Its admin socket marks a replica ``drain`` (no new requests, the open ones finish)
  before ``specdec serve`` is stopped, which Triton's readiness alone does not do (it stays 200 while specdec
  drains; see docs/deployment-balancer.md).

Timeouts are those of long streams: a gRPC stream may be silent for a long prefill or a full queue, so the
client/server inactivity timeouts are ``Timeouts.idle_s`` (default 10 minutes, the client's own default), and
only the connect and check timeouts are short.

``render_config`` writes the config; ``Balancer`` runs ``haproxy`` in the foreground with it (a context manager)
and reads the servers' states from its admin socket; ``balancer_main`` is ``specdec deploy balancer``.
Beyond the standard library it needs only the name of Triton's readiness endpoint.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType, TracebackType

from specdec.serving.openai.process import READY_PATH as OPENAI_READY_PATH
from specdec.serving.server import READY_PATH

GRPC_BACKEND = "specdec_grpc"
HTTP_BACKEND = "specdec_http"
OPENAI_BACKEND = "specdec_openai"
#: where Debian puts the binary; /usr/sbin is not on a non-root PATH
DEBIAN_BINARY = Path("/usr/sbin/haproxy")
INSTALL_HINT = "install Debian's haproxy package (as root: apt-get install -y haproxy; scripts/setup_env.sh does it)"


class BalancerError(RuntimeError):
    """haproxy is missing, refused its config, or exited."""


@dataclass(frozen=True)
class Replica:
    """One ``specdec serve``: where its gRPC traffic goes and where its readiness is checked (its HTTP port), and
    where its OpenAI-compatible API listens (None: not balanced)."""

    host: str
    grpc_port: int
    http_port: int
    name: str = ""  # its HAProxy server name; default r<index>
    openai_port: int | None = None

    @classmethod
    def parse(cls, text: str) -> Replica:
        """``HOST:GRPC_PORT:HTTP_PORT[:OPENAI_PORT]`` (what ``--replica`` takes; IPv6 hosts in brackets)."""
        parts = text.rsplit(":", 3)
        bracketed = text.startswith("[")
        plain_host = parts[0].endswith("]") if bracketed else ":" not in parts[0]  # a bare IPv6 host: 3 ports
        if len(parts) == 4 and plain_host and all(p.isdigit() for p in parts[1:]):
            host, ports = parts[0], parts[1:]
        else:
            host, _, rest = text.rpartition(":")
            host, _, grpc = host.rpartition(":")
            ports = [grpc, rest]
        host = host.strip("[]") if bracketed else host
        if not (host and all(p.isdigit() for p in ports)):
            raise ValueError(
                f"replica {text!r}: expected HOST:GRPC_PORT:HTTP_PORT[:OPENAI_PORT], e.g. 10.0.0.5:8001:8000:8003"
            )
        return cls(host, int(ports[0]), int(ports[1]), openai_port=int(ports[2]) if len(ports) == 3 else None)


@dataclass(frozen=True)
class HealthCheck:
    """How often each replica's readiness is probed and how many probes flip its state.

    A dead replica (its ports closed: refused at once) is marked down after ``fall`` failed probes: the first
    within ``interval_ms``, the next ones ``fast_interval_ms`` apart, so within ``down_after_s()`` (0.7 s by
    default). A hung one (no answer) takes ``timeout_ms`` per probe more (2.7 s). A down replica is probed every
    ``down_interval_ms`` and takes traffic again after ``rise`` good probes (about 1-2 s after it is ready).
    Requests that meet a dead replica before it is marked down are redispatched (connection refused), so the
    checks bound how long the balancer keeps trying it, not how long clients see errors.
    """

    interval_ms: int = 500
    fast_interval_ms: int = 200  # while a state change is under way (after one failed or one good probe)
    down_interval_ms: int = 1000
    timeout_ms: int = 1000  # a loaded 2-core machine still answers a readiness probe well within it
    fall: int = 2
    rise: int = 2

    def down_after_s(self, hung: bool = False) -> float:
        """The longest time from a replica's death to its being marked down (``hung``: it accepts, never answers)."""
        probe = self.timeout_ms if hung else 0
        return (self.interval_ms + probe + (self.fall - 1) * (self.fast_interval_ms + probe)) / 1000


@dataclass(frozen=True)
class Timeouts:
    """HAProxy's timeouts: short where a healthy peer answers at once, long where a stream may be quiet."""

    connect_ms: int = 1000  # a replica that drops SYNs is given up (and the request redispatched) after this
    idle_s: int = 600  # client/server inactivity: a stream may wait this long between responses
    retries: int = 3  # connection attempts redispatched to another replica (only for requests never sent)


def render_config(
    replicas: Sequence[Replica],
    grpc_listen: tuple[str, int],
    http_listen: tuple[str, int] | None = None,
    check: HealthCheck = HealthCheck(),
    timeouts: Timeouts = Timeouts(),
    admin_socket: Path | None = None,
    openai_listen: tuple[str, int] | None = None,
) -> str:
    """The ``haproxy.cfg`` for ``replicas``: gRPC (h2c) on ``grpc_listen``, optionally Triton's HTTP API on
    ``http_listen`` and the OpenAI-compatible API on ``openai_listen``; every replica health-checked on
    ``READY_PATH`` of its HTTP port, and its OpenAI frontend on the frontend's own readiness (which also turns
    503 while the replica drains, so the balancer stops sending it new requests by itself)."""
    if not replicas:
        raise ValueError("a balancer needs at least one replica")
    if openai_listen is not None and any(r.openai_port is None for r in replicas):
        raise ValueError("balancing the OpenAI API needs every replica's OpenAI port (HOST:GRPC:HTTP:OPENAI)")
    names = [r.name or f"r{i}" for i, r in enumerate(replicas)]
    if len(set(names)) != len(names):
        raise ValueError(f"replica names must differ: {names}")
    check_args = (
        f"check inter {check.interval_ms}ms fastinter {check.fast_interval_ms}ms "
        f"downinter {check.down_interval_ms}ms fall {check.fall} rise {check.rise}"
    )
    lines = ["# written by specdec.deploy.balancer (docs/deployment-balancer.md)", "global"]
    if admin_socket is not None:
        lines.append(f"    stats socket {admin_socket} mode 600 level admin")
    lines += [
        "    log stdout format raw local0 info",
        "    hard-stop-after 60s  # a soft stop (SIGUSR1) waits this long at most for open streams",
        "",
        "defaults",
        "    mode http",
        "    log global",
        "    option httplog",
        "    option log-health-checks",
        f"    timeout connect {timeouts.connect_ms}ms",
        f"    timeout client {timeouts.idle_s}s",
        f"    timeout server {timeouts.idle_s}s",
        f"    timeout check {check.timeout_ms}ms",
        "    timeout http-request 10s",
        "    timeout http-keep-alive 10s",
        # only what never reached a replica is resent, and always to another one
        f"    retries {timeouts.retries}",
        "    retry-on conn-failure",
        "    option redispatch 1",
        "    option httpchk",
        f"    http-check send meth GET uri {READY_PATH}",
        "    http-check expect status 200",
        "",
        "frontend specdec_grpc_in",
        f"    bind {_address(*grpc_listen)} proto h2",
        f"    default_backend {GRPC_BACKEND}",
        "",
        f"backend {GRPC_BACKEND}",
        "    balance leastconn  # streams differ in length by orders of magnitude: count open ones, not turns",
    ]
    # the check goes to the HTTP port over HTTP/1.1 (Triton's HTTP endpoint speaks no h2), the traffic over h2c
    lines += [
        f"    server {name} {_address(r.host, r.grpc_port)} proto h2 {check_args} port {r.http_port} check-proto h1"
        for name, r in zip(names, replicas)
    ]
    if http_listen is not None:
        lines += [
            "",
            "frontend specdec_http_in",
            f"    bind {_address(*http_listen)}",
            f"    default_backend {HTTP_BACKEND}",
            "",
            f"backend {HTTP_BACKEND}",
            "    balance leastconn",
        ]
        lines += [f"    server {name} {_address(r.host, r.http_port)} {check_args}" for name, r in zip(names, replicas)]
    if openai_listen is not None:
        lines += [
            "",
            "frontend specdec_openai_in",
            f"    bind {_address(*openai_listen)}",
            f"    default_backend {OPENAI_BACKEND}",
            "",
            f"backend {OPENAI_BACKEND}",
            "    balance leastconn  # SSE streams, like gRPC ones, differ in length by orders of magnitude",
            f"    http-check send meth GET uri {OPENAI_READY_PATH}",
            "    http-check expect status 200",
        ]
        lines += [
            f"    server {name} {_address(r.host, r.openai_port)} {check_args}"  # type: ignore[arg-type]
            for name, r in zip(names, replicas)
        ]
    return "\n".join(lines) + "\n"


def _address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def find_haproxy() -> Path:
    """The haproxy binary: on PATH, else Debian's /usr/sbin/haproxy."""
    found = shutil.which("haproxy")
    if found:
        return Path(found)
    if DEBIAN_BINARY.is_file():
        return DEBIAN_BINARY
    raise BalancerError(f"haproxy not found: {INSTALL_HINT}")


@dataclass
class Balancer:
    """``haproxy`` in the foreground on a rendered config, in a private directory (config, admin socket, log).

    ``with Balancer(replicas, grpc_port=...) as lb:`` starts it and returns once its frontends listen; leaving
    the block stops it (soft stop: the listeners close, open streams get ``grace_s`` to finish).
    """

    replicas: Sequence[Replica]
    host: str = "127.0.0.1"
    grpc_port: int = 8001
    http_port: int | None = None
    openai_port: int | None = None
    check: HealthCheck = HealthCheck()
    timeouts: Timeouts = Timeouts()
    binary: Path | None = None
    workdir: Path | None = None  # where config, socket and log go (kept); default a temporary directory (removed)
    process: subprocess.Popen[bytes] | None = field(default=None, init=False)
    directory: Path | None = field(default=None, init=False)

    @property
    def grpc_url(self) -> str:
        return _address(self.host, self.grpc_port)

    @property
    def http_url(self) -> str | None:
        return None if self.http_port is None else f"http://{_address(self.host, self.http_port)}"

    @property
    def openai_url(self) -> str | None:
        return None if self.openai_port is None else f"http://{_address(self.host, self.openai_port)}"

    @property
    def config_path(self) -> Path:
        assert self.directory is not None, "not started"
        return self.directory / "haproxy.cfg"

    @property
    def log_path(self) -> Path:
        assert self.directory is not None, "not started"
        return self.directory / "haproxy.log"

    def start(self, timeout_s: float = 30.0) -> None:
        """Write the config, have haproxy check it (a bad one fails here with haproxy's words), run it."""
        binary = self.binary or find_haproxy()
        if self.workdir is not None:
            self.workdir.mkdir(parents=True, exist_ok=True)
        self.directory = self.workdir or Path(tempfile.mkdtemp(prefix="specdec-haproxy-"))
        http_listen = None if self.http_port is None else (self.host, self.http_port)
        self.config_path.write_text(
            render_config(
                self.replicas,
                (self.host, self.grpc_port),
                http_listen,
                self.check,
                self.timeouts,
                self.directory / "admin.sock",
                None if self.openai_port is None else (self.host, self.openai_port),
            )
        )
        checked = subprocess.run([str(binary), "-c", "-f", str(self.config_path)], capture_output=True, text=True)
        if checked.returncode != 0:
            raise BalancerError(f"haproxy refused {self.config_path}:\n{checked.stdout}{checked.stderr}")
        with self.log_path.open("wb") as log:  # -db: foreground, no daemon; haproxy logs to its stdout
            self.process = subprocess.Popen(
                [str(binary), "-db", "-f", str(self.config_path)],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        deadline = time.monotonic() + timeout_s
        while not self._listening():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise BalancerError(f"haproxy did not start listening on {self.grpc_url}:\n{self.read_log()}")
            time.sleep(0.05)

    def _listening(self) -> bool:
        """Whether the admin socket answers: haproxy binds every listener before it serves any, so its frontends
        listen too (asked there rather than by connecting to a frontend, which would log a bad request)."""
        try:
            return "Pid:" in self.admin("show info")
        except OSError:
            return False

    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def stop(self, grace_s: float = 5.0) -> int | None:
        """Soft stop (SIGUSR1: stop listening, let open streams end), SIGTERM after ``grace_s``, then SIGKILL."""
        if self.process is None:
            return None
        for sig, wait_s in ((signal.SIGUSR1, grace_s), (signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
            if self.process.poll() is not None:
                break
            with contextlib.suppress(ProcessLookupError):
                self.process.send_signal(sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(wait_s)
        return self.process.poll()

    def read_log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.directory and self.log_path.exists() else ""

    def admin(self, command: str) -> str:
        """One command on haproxy's admin socket (``show stat``, ``set server specdec_grpc/r0 state drain``)."""
        assert self.directory is not None, "not started"
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(5)
            sock.connect(str(self.directory / "admin.sock"))
            sock.sendall(command.encode() + b"\n")
            chunks = []
            while chunk := sock.recv(65536):
                chunks.append(chunk)
        return b"".join(chunks).decode(errors="replace")

    def server_states(self, backend: str = GRPC_BACKEND) -> dict[str, str]:
        """Each server's state as HAProxy sees it: ``UP``, ``DOWN``, ``UP 1/2`` (rising), ``DRAIN``, ``MAINT``..."""
        rows = csv.DictReader(self.admin("show stat").lstrip("# ").splitlines())
        return {
            row["svname"]: row["status"]
            for row in rows
            if row["pxname"] == backend and row["svname"] not in ("FRONTEND", "BACKEND")
        }

    def set_state(self, name: str, state: str) -> None:
        """``ready``, ``drain`` (no new requests; before stopping that replica's ``specdec serve``) or ``maint``,
        in every backend."""
        backends = (
            GRPC_BACKEND,
            *((HTTP_BACKEND,) if self.http_port is not None else ()),
            *((OPENAI_BACKEND,) if self.openai_port is not None else ()),
        )
        for backend in backends:
            answer = self.admin(f"set server {backend}/{name} state {state}").strip()
            if answer:
                raise BalancerError(f"haproxy: {answer}")

    def __enter__(self) -> Balancer:
        self.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.stop()
        if self.directory is not None and self.workdir is None:
            shutil.rmtree(self.directory, ignore_errors=True)


# --------------------------------------------------------------------------- `specdec deploy balancer`


def _listen(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    if not port.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r}: expected HOST:PORT")
    return host.strip("[]") or "0.0.0.0", int(port)


def _replica(text: str) -> Replica:
    try:
        return Replica.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def add_balancer_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Options of ``specdec deploy balancer`` (kept here so cli.py only wires the subcommand)."""
    parser.add_argument(
        "--replica",
        action="append",
        type=_replica,
        required=True,
        metavar="HOST:GRPC:HTTP[:OPENAI]",
        help="a `specdec serve` replica: its host, gRPC port and HTTP port (readiness is checked "
        "there), and its OpenAI port to balance that API too; repeat for each",
    )
    parser.add_argument(
        "--listen",
        type=_listen,
        default=("127.0.0.1", 8001),
        metavar="HOST:PORT",
        help="where clients connect over gRPC (default 127.0.0.1:8001)",
    )
    parser.add_argument(
        "--http-listen",
        type=_listen,
        metavar="HOST:PORT",
        help="also balance Triton's HTTP API here (default: gRPC only)",
    )
    parser.add_argument(
        "--openai-listen",
        type=_listen,
        metavar="HOST:PORT",
        help="also balance the OpenAI-compatible API here (every --replica then names its OpenAI port)",
    )
    parser.add_argument(
        "--check-interval-ms",
        type=int,
        default=HealthCheck.interval_ms,
        help=f"readiness probe interval (default {HealthCheck.interval_ms}; a dead replica is out "
        f"within {HealthCheck().down_after_s():.1f} s)",
    )
    parser.add_argument(
        "--print-config",
        action="store_true",
        help="print the haproxy.cfg and exit (to run it with the system's haproxy)",
    )
    return parser


def balancer_main(args: argparse.Namespace | Sequence[str] | None = None) -> int:
    """Run haproxy in front of the replicas until SIGINT/SIGTERM (or print its config)."""
    if not isinstance(args, argparse.Namespace):
        parser = add_balancer_args(argparse.ArgumentParser(prog="specdec deploy balancer", description=__doc__))
        args = parser.parse_args(None if args is None else list(args))
    check = HealthCheck(interval_ms=args.check_interval_ms)
    if args.print_config:
        print(
            render_config(args.replica, args.listen, args.http_listen, check, openai_listen=args.openai_listen), end=""
        )
        return 0
    for flag, listen in (("--http-listen", args.http_listen), ("--openai-listen", args.openai_listen)):
        if listen is not None and listen[0] != args.listen[0]:
            print(f"error: {flag} must use the host of --listen", file=sys.stderr)
            return 2
    if args.openai_listen is not None and any(r.openai_port is None for r in args.replica):
        print("error: --openai-listen needs every --replica as HOST:GRPC:HTTP:OPENAI", file=sys.stderr)
        return 2
    balancer = Balancer(
        args.replica,
        host=args.listen[0],
        grpc_port=args.listen[1],
        http_port=None if args.http_listen is None else args.http_listen[1],
        openai_port=None if args.openai_listen is None else args.openai_listen[1],
        check=check,
    )
    signals: list[int] = []

    def remember(signum: int, _frame: FrameType | None) -> None:
        signals.append(signum)

    previous = {sig: signal.signal(sig, remember) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        with balancer:
            print(
                f"specdec deploy balancer: gRPC {balancer.grpc_url}"
                + (f", HTTP {balancer.http_url}" if balancer.http_url else "")
                + (f", OpenAI {balancer.openai_url}/v1" if balancer.openai_url else "")
                + f" -> {len(args.replica)} replica(s); config {balancer.config_path}, log {balancer.log_path}",
                flush=True,
            )
            while not signals and balancer.running():
                time.sleep(0.2)
            if not balancer.running():
                print(f"error: haproxy exited\n{balancer.read_log()[-3000:]}", file=sys.stderr)
                return 1
        return 0
    except BalancerError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)

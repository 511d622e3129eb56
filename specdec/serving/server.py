"""Run a real ``tritonserver`` for ``specdec serve`` (found by ``specdec.serving.install``), drain it, stop it.

The server is a subprocess: the decoding core never depends on it, and tests start it on free
loopback ports and stop it again. Only the standard library is imported here so that
``specdec serve --help`` and the CLI stay fast and work without the ``serve`` extra.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import IO

from specdec.serving.control import (
    ABORT,
    ADMIN_HEADER,
    CLOSED,
    CONTROL_ENV,
    DRAIN,
    INTERNAL_KEY_ENV,
    RESTRICTED_APIS,
    SHM_DIR,
    Control,
    inflight_from_metrics,
    new_secret,
    new_shm_prefix,
    remove_shm,
)
from specdec.serving.install import TritonError, TritonInstall, find_tritonserver, libpython_dir
from specdec.serving.protocol import READY_MODEL
from specdec.serving.repository import validate_repository

#: the launcher's control directories (``Control``) are named by its pid, so a later start reclaims those whose
#: launcher is gone (killed with SIGKILL, it could not remove its own: the admin key stays in it)
CONTROL_DIR_PREFIX = "specdec-control-"


def _owned(path: Path) -> bool:
    """Whether this user owns ``path``; False once it is gone (another launcher starting beside this one reclaimed
    it first: two replicas started together both found a dead launcher's directory, and one crashed on its stat)."""
    try:
        return path.stat().st_uid == os.getuid()
    except FileNotFoundError:
        return False


def reclaim_control_directories() -> list[Path]:
    """Remove the control directories (and /dev/shm regions) of launchers that are gone; what was removed."""
    from specdec.serving.processes import alive

    removed = []
    for directory in Path(tempfile.gettempdir()).glob(f"{CONTROL_DIR_PREFIX}*"):
        owner = directory.name.removeprefix(CONTROL_DIR_PREFIX).split("-", 1)[0]
        if owner.isdigit() and not alive(int(owner)) and _owned(directory):
            shutil.rmtree(directory, ignore_errors=True)
            removed.append(directory)
    for region in SHM_DIR.glob("specdec_*") if SHM_DIR.is_dir() else ():
        owner = region.name.removeprefix("specdec_").split("_", 1)[0]
        if owner.isdigit() and not alive(int(owner)):
            region.unlink(missing_ok=True)
            removed.append(region)
    return removed


def die_with_parent() -> None:
    """In a child, before it runs: the kernel kills it when ``specdec serve`` dies (Linux ``PR_SET_PDEATHSIG``), so
    no tritonserver, and so no stub (they exit with their server), outlives its launcher and holds its ports."""
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG = 1


#: Triton's HTTP health endpoints: ready (200 once every model is loaded and the server serves) and live (the
#: process answers); what ``is_ready``, the balancer's checks and the Kubernetes probes all ask
READY_PATH, LIVE_PATH = "/v2/health/ready", "/v2/health/live"


def http_ready(http_url: str, timeout_s: float = 2.0) -> bool:
    """One probe of ``READY_PATH`` at ``http_url`` (``http://host:port``): 200 means every model loaded and the
    server serves; a refused connection, a timeout or any other status means not (yet)."""
    try:
        with urllib.request.urlopen(f"{http_url}{READY_PATH}", timeout=timeout_s) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False


class TritonStartError(TritonError):
    """The server exited (or never became ready) while starting; the message carries its log."""


class PortInUseError(TritonError):
    """A port the server needs is already taken; raised before the server is started."""


def free_ports(n: int = 3, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct free ports on ``host`` (all bound at once so the kernel cannot hand out one twice)."""
    socks = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(n)]
    try:
        for sock in socks:
            sock.bind((host, 0))
        return [sock.getsockname()[1] for sock in socks]
    finally:
        for sock in socks:
            sock.close()


def port_free(host: str, port: int) -> bool:
    """True when nothing listens on ``host:port`` (SO_REUSEADDR: TIME_WAIT leftovers do not count)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


# --------------------------------------------------------------------------- the server process


def client_host(host: str) -> str:
    """Where a client on this machine reaches a server listening on ``host`` (a wildcard: loopback)."""
    return "127.0.0.1" if host in ("", "0.0.0.0", "::") else host


def loopback(host: str) -> bool:
    """Whether ``host`` is this machine only."""
    return host in ("localhost", "::1") or host.startswith("127.")


def read_log(path: Path | None) -> str:
    """A server's log as text ('' when there is none yet)."""
    if path is None or not path.exists():
        return ""
    return path.read_text(encoding="utf-8", errors="replace")


def error_summary(log_text: str, tail_lines: int = 30) -> str:
    """Triton's error lines (glog ``E`` lines, 'failed to load', 'error:') and the log's tail."""
    lines = log_text.splitlines()
    errors = [ln for ln in lines if ln.startswith("E") or "failed to load" in ln or ln.startswith("error:")]
    tail = lines[-tail_lines:]
    parts = []
    if errors:
        parts.append("errors:\n" + "\n".join(errors[-20:]))
    parts.append("log tail:\n" + "\n".join(tail))
    return "\n".join(parts)


@dataclass
class TritonServer:
    """A ``tritonserver`` subprocess in its own process group (so its Python-backend stubs can be reaped)."""

    install: TritonInstall | None = None
    log_file: Path | None = None
    #: environment whose ``bin/python3`` the Python-backend stub runs (default: this interpreter's venv;
    #: ``SPECDEC_TRITON_PYTHON_ENV`` overrides it, e.g. an env with numpy<2 for the bundled 2.51 stub)
    python_env: Path | None = None
    process: subprocess.Popen[bytes] | None = field(default=None, init=False)
    host: str = field(default="127.0.0.1", init=False)
    grpc_port: int = field(default=8001, init=False)
    http_port: int = field(default=8000, init=False)
    metrics_port: int = field(default=8002, init=False)
    exit_timeout_s: int = field(default=30, init=False)
    #: the drain/abort flags of this server (``specdec.serving.control``) and its stubs' /dev/shm prefix
    control: Control = field(default=Control(None), init=False)
    shm_prefix: str = field(default="", init=False)
    #: the header value Triton's management APIs require (``RESTRICTED_APIS``); random per server unless given
    admin_key: str = field(default="", init=False, repr=False)
    _internal_key: str = field(default="", init=False, repr=False)
    restarts: int = field(default=0, init=False)
    #: models reloaded after their stub failed (``supervisor``); with ``restarts``, published by the readiness gate
    reloads: int = field(default=0, init=False)
    _start_args: dict = field(default_factory=dict, init=False, repr=False)
    _log_handle: IO[bytes] | None = field(default=None, init=False, repr=False)
    _own_log: bool = field(default=False, init=False, repr=False)  # log_file was made here, not given
    #: something went wrong that the log records (a failed start, a dead engine, a restart, a forced stop): it stays
    _keep_log: bool = field(default=False, init=False, repr=False)

    def command(
        self, model_repository: Path, *, log_verbose: int, exit_timeout_s: int, extra_args: Sequence[str]
    ) -> list[str]:
        """The exact command line (exposed so the CLI can print it and tests can inspect it)."""
        assert self.install is not None
        return [
            str(self.install.binary),
            f"--model-repository={model_repository}",
            f"--backend-directory={self.install.backend_directory}",
            f"--grpc-address={self.host}",
            f"--grpc-port={self.grpc_port}",
            f"--http-address={self.host}",
            f"--http-port={self.http_port}",
            f"--metrics-address={self.host}",
            f"--metrics-port={self.metrics_port}",
            f"--exit-timeout-secs={exit_timeout_s}",
            # explicit model control, every model loaded at start: the launcher unloads the readiness gate to turn
            # readiness false at once, and reloads a model whose stub failed (``supervisor``)
            "--model-control-mode=explicit",
            "--load-model=*",
            f"--log-verbose={log_verbose}",
            *([f"--backend-config=python,shm-region-prefix-name={self.shm_prefix}"] if self.shm_prefix else []),
            *(
                [
                    f"--grpc-restricted-protocol={','.join(RESTRICTED_APIS)}:{ADMIN_HEADER}={self.admin_key}",
                    f"--http-restricted-api={','.join(RESTRICTED_APIS)}:{ADMIN_HEADER}={self.admin_key}",
                ]
                if self.admin_key
                else []
            ),
            *extra_args,
        ]

    def environment(self) -> dict[str, str]:
        """The server's env: bundled libs on LD_LIBRARY_PATH and this venv's ``bin`` first on PATH.

        The Python-backend stub runs the first ``python3`` on PATH; without this venv first, model.py
        would run in the system Python and fail with ``No module named 'numpy'`` (environment.md).
        """
        assert self.install is not None
        env = dict(os.environ)
        libs = [str(p) for p in self.install.ld_library_path]
        own = libpython_dir()
        if own is not None:  # the stub must embed the libpython whose extension modules it will import
            libs.insert(0, str(own))
        if env.get("LD_LIBRARY_PATH"):
            libs.append(env["LD_LIBRARY_PATH"])
        if libs:
            env["LD_LIBRARY_PATH"] = os.pathsep.join(libs)
        python_env = self.python_env or os.environ.get("SPECDEC_TRITON_PYTHON_ENV")
        if python_env:
            bin_dirs = [str(Path(python_env) / "bin")]
        else:
            bin_dirs = [str(Path(sys.prefix) / "bin"), str(Path(sys.executable).parent)]
        path = [*dict.fromkeys(bin_dirs), *(p for p in env.get("PATH", "").split(os.pathsep) if p)]
        env["PATH"] = os.pathsep.join(dict.fromkeys(path))
        if python_env:
            env["VIRTUAL_ENV"] = str(python_env)
        elif sys.prefix != sys.base_prefix:
            env["VIRTUAL_ENV"] = sys.prefix
        if self.control.directory is not None:
            env[CONTROL_ENV] = str(self.control.directory)
        if self._internal_key:
            env[INTERNAL_KEY_ENV] = self._internal_key
        return env

    def start(
        self,
        model_repository: str | os.PathLike[str],
        *,
        host: str = "127.0.0.1",
        grpc_port: int = 8001,
        http_port: int = 8000,
        metrics_port: int = 8002,
        log_verbose: int = 0,
        exit_timeout_s: int = 30,
        extra_args: Sequence[str] = (),
        admin_key: str | None = None,
    ) -> TritonServer:
        """Validate, check the ports, and launch the server (returns at once; call :meth:`wait_ready`).

        ``admin_key``: what clients of Triton's management APIs must send in the ``specdec-admin-key`` header
        (default: a random key of this server, ``self.admin_key``); inference, health, metadata, model config
        and statistics stay open.
        """
        if self.process is not None and self.process.poll() is None:
            raise TritonError("this TritonServer is already running")
        repo = validate_repository(model_repository).resolve()
        for flag, port in (("--grpc-port", grpc_port), ("--http-port", http_port), ("--metrics-port", metrics_port)):
            if not port_free(host, port):
                raise PortInUseError(f"port {port} on {host} ({flag}) is already in use; pick another with {flag}")
        if len({grpc_port, http_port, metrics_port}) != 3:
            raise PortInUseError(
                f"grpc, http and metrics ports must differ (got {grpc_port}, {http_port}, {metrics_port})"
            )
        if self.install is None:
            self.install = find_tritonserver()
        self.host, self.grpc_port, self.http_port, self.metrics_port = host, grpc_port, http_port, metrics_port
        self.exit_timeout_s = exit_timeout_s
        if self.log_file is None:
            fd, name = tempfile.mkstemp(prefix="specdec-tritonserver-", suffix=".log")
            os.close(fd)
            self.log_file = Path(name)
            self._own_log = True
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        self._start_args = dict(
            model_repository=model_repository,
            host=host,
            grpc_port=grpc_port,
            http_port=http_port,
            metrics_port=metrics_port,
            log_verbose=log_verbose,
            exit_timeout_s=exit_timeout_s,
            extra_args=tuple(extra_args),
            admin_key=admin_key,
        )
        handle = open(self.log_file, "ab" if self.restarts else "wb")  # a restart keeps the log of what died
        self._log_handle = handle
        reclaim_control_directories()
        self.control = Control(Path(tempfile.mkdtemp(prefix=f"{CONTROL_DIR_PREFIX}{os.getpid()}-")))
        self.record_counts()
        self.shm_prefix = new_shm_prefix()
        self.admin_key = admin_key or self.admin_key or new_secret()
        self._internal_key = self._internal_key or new_secret()
        cmd = self.command(repo, log_verbose=log_verbose, exit_timeout_s=exit_timeout_s, extra_args=extra_args)
        try:
            self.process = subprocess.Popen(
                cmd,
                preexec_fn=die_with_parent,
                stdin=subprocess.DEVNULL,
                stdout=handle,
                stderr=subprocess.STDOUT,
                env=self.environment(),
                start_new_session=True,
            )
        except OSError as exc:
            handle.close()
            raise TritonStartError(f"cannot run {cmd[0]}: {exc}") from exc
        return self

    @property
    def grpc_url(self) -> str:
        return f"{client_host(self.host)}:{self.grpc_port}"

    @property
    def http_url(self) -> str:
        return f"http://{client_host(self.host)}:{self.http_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{client_host(self.host)}:{self.metrics_port}/metrics"

    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def read_log(self) -> str:
        return read_log(self.log_file)

    def is_ready(self) -> bool:
        return http_ready(self.http_url)

    def metrics_up(self) -> bool:
        """Whether the Prometheus endpoint answers (Triton opens it on its own, after the models may be ready)."""
        try:
            with urllib.request.urlopen(self.metrics_url, timeout=2.0) as resp:
                return resp.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def wait_ready(self, timeout: float = 300.0, poll_s: float = 0.25) -> None:
        """Block until every model is ready and the metrics endpoint answers; raise TritonStartError with the log
        if the server dies or the time runs out.

        Checking the process between probes turns "failed to load all models" into an error within a
        poll interval instead of a silent timeout. Why the metrics endpoint too: Triton reports ready before
        it listens there, and on a busy machine a scrape right after "ready" was refused (a test saw it).
        """
        if self.process is None:
            raise TritonError("server not started")
        deadline = time.monotonic() + timeout
        while True:
            code = self.process.poll()
            if code is not None:
                self._keep_log = True
                raise TritonStartError(
                    f"tritonserver exited with code {code} while starting (log: {self.log_file})\n"
                    + error_summary(self.read_log())
                )
            if self.is_ready() and self.metrics_up():
                return
            if time.monotonic() >= deadline:
                self._keep_log = True
                raise TritonStartError(
                    f"tritonserver not ready after {timeout:.0f} s (log: {self.log_file})\n"
                    + error_summary(self.read_log())
                )
            time.sleep(poll_s)

    def write_admin_key(self) -> Path:
        """The admin key in a file only this user can read (in the control directory, removed at exit)."""
        assert self.control.directory is not None
        path = self.control.directory / "admin-key"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(self.admin_key + "\n")
        return path

    def inflight(self) -> int | None:
        """Requests the entry points have admitted and not yet answered (their gauge), None if unreadable.

        A page without the gauge is 0: no specdec entry point is loaded, so none holds a request (a repository of
        other models: Triton's own exit waits for theirs). Read as unknown, it held every drain for its whole
        timeout."""
        try:
            with urllib.request.urlopen(self.metrics_url, timeout=2) as resp:
                return inflight_from_metrics(resp.read().decode(errors="replace")) or 0
        except (urllib.error.URLError, OSError, ValueError):
            return None

    def drain(self, timeout: float, abort: Callable[[], bool] = lambda: False, poll_s: float = 0.1) -> int:
        """Admit nothing new and wait until every admitted request is answered; returns how many were aborted.

        Readiness turns false before anything else (the gate is unloaded), liveness stays true until the process
        exits. After ``timeout`` s, or as soon as ``abort()`` says so (a second signal), the rest are ended by the
        entry points with UNAVAILABLE, and this waits a few seconds more for those answers to go out.
        """
        if not self.running():
            return 0
        with contextlib.suppress(TritonError):  # readiness false first: a balancer stops routing here at once
            self.set_ready(False)
        self.control.ask(DRAIN)
        deadline = time.monotonic() + timeout
        left = None
        while self.running():
            left = self.inflight()
            if left == 0:
                return 0
            if abort() or time.monotonic() >= deadline:
                break
            time.sleep(poll_s)
        if not self.running():
            return 0
        self.control.ask(ABORT)
        settle = time.monotonic() + 5.0
        while self.running() and time.monotonic() < settle and self.inflight() not in (0, None):
            time.sleep(poll_s)
        return left or 0

    def send_signal(self, sig: int) -> None:
        if self.running():
            assert self.process is not None
            with contextlib.suppress(ProcessLookupError):
                self.process.send_signal(sig)

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the server to exit and return its exit code."""
        if self.process is None:
            raise TritonError("server not started")
        return self.process.wait(timeout)

    def stop(self, timeout: float | None = None) -> int | None:
        """Graceful stop: SIGINT (Triton drains in-flight requests), then SIGTERM, then SIGKILL.

        ``timeout`` is how long SIGINT may take; by default the server's own ``--exit-timeout-secs``
        and a margin, so that an exit Triton still allows itself (unloading models on a loaded
        machine) is not cut short by SIGTERM into a failure exit code. Afterwards anything left in
        the server's process group (Python-backend stubs) is killed, so no process outlives the
        server. Returns the server's exit code (None if it was never started).
        """
        if self.process is None:
            return None
        if timeout is None:
            timeout = self.exit_timeout_s + 30.0
        proc = self.process
        code = proc.poll()
        if code is None:
            for sig, wait_s in ((signal.SIGINT, timeout), (signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(sig)
                try:
                    code = proc.wait(wait_s)
                    break
                except subprocess.TimeoutExpired:
                    self._keep_log = True  # SIGINT did not end it in time
                    continue
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        self.cleanup()
        if self._log_handle is not None:
            self._log_handle.close()
            self._log_handle = None
        if code == 0 and self._own_log and not self._keep_log and self.log_file is not None:
            # a log named by nobody, of a server that started, served and exited clean, is nothing anyone will
            # read: left in /tmp it is one more file per start (a test run starts ~200). Whatever went wrong on
            # the way (``_keep_log``) keeps it for diagnosis, a clean exit after it included.
            self.log_file.unlink(missing_ok=True)
        return code

    def record_counts(self) -> None:
        """Leave the restart and reload counts where the readiness gate reads them when it loads."""
        self.control.record(restarts=self.restarts, reloads=self.reloads)

    def _management(self, path: str) -> None:
        """POST a model-repository call (``/v2/repository/...``) with the admin key; ``TritonError`` if refused."""
        request = urllib.request.Request(
            f"{self.http_url}{path}", data=b"", method="POST", headers={ADMIN_HEADER: self.admin_key}
        )
        try:
            with urllib.request.urlopen(request, timeout=120) as resp:
                resp.read()
        except (urllib.error.URLError, OSError) as exc:
            raise TritonError(f"tritonserver refused {path}: {exc}") from exc

    def set_ready(self, ready: bool) -> None:
        """Open or close the readiness gate (``gate_model``): readiness follows at once, on HTTP and gRPC."""
        gate = f"/v2/repository/models/{READY_MODEL}"
        if ready:
            self.control.lower(CLOSED)
            self._management(f"{gate}/load")
            return
        if self.control.closed():  # closed already (a signal's thread, a repair under way)
            return
        self.control.ask(CLOSED)
        self._management(f"{gate}/unload")
        with contextlib.suppress(TritonError):  # the gate refuses to load while closed: the failure holds it false
            self._management(f"{gate}/load")

    def reload(self, model: str) -> None:
        """Unload ``model`` and load it again (a fresh stub): what replaces one that died or froze. A load alone
        would not do: Triton takes a load of a model it holds as loaded, unchanged, as done."""
        self._management(f"/v2/repository/models/{model}/unload")
        self._management(f"/v2/repository/models/{model}/load")

    def restart(self) -> None:
        """Kill what is left of this server (its stubs included), clean up after it and start it again.

        Killing, not draining: the engine is gone, so nothing in flight can finish, and the closed ports tell
        every client and health probe at once (UNAVAILABLE, readiness refused) instead of hanging them.
        """
        self._keep_log = True  # the log of what died, appended to by the new server
        if self.process is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.process.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(10)
        self.cleanup()
        if self._log_handle is not None:
            self._log_handle.close()
            self._log_handle = None
        self.restarts += 1
        self.start(**self._start_args)

    def cleanup(self) -> None:
        """Remove what an exited server leaves behind: its stubs' /dev/shm regions (a SIGKILLed server leaves
        them all) and its control directory. Safe to call more than once."""
        if self.running():
            raise TritonError("cleanup() of a running server")
        remove_shm(self.shm_prefix)
        if self.control.directory is not None:
            shutil.rmtree(self.control.directory, ignore_errors=True)

    def __enter__(self) -> TritonServer:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

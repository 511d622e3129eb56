"""Find and run a real ``tritonserver`` for ``specdec serve``.

Two installs are supported, in this order:

1. a ``tritonserver`` on ``PATH`` (the NGC Triton container: it has the onnxruntime and
   tensorrt backends a GPU deployment wants);
2. the binary bundled in the ``nvidia-pytriton`` wheel (CPU-friendly, no Docker; it has only the
   Python backend, which is all the specdec engine model needs).

The server is a subprocess: the decoding core never depends on it, and tests start it on free
loopback ports and stop it again. Only the standard library is imported here so that
``specdec serve --help`` and the CLI stay fast and work without the ``serve`` extra.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.util
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType, TracebackType
from typing import Literal

INSTALL_HINT = (
    "install the bundled server with `pip install 'specdec-toolkit[serve]'` "
    "(or `pip install nvidia-pytriton==0.7.0`), or put a `tritonserver` binary on PATH "
    "(e.g. run inside the NGC container nvcr.io/nvidia/tritonserver:<yy.mm>-py3)"
)
STUB_NAME = "triton_python_backend_stub"


class TritonError(RuntimeError):
    """Base class of every launcher error, so the CLI can report all of them the same way."""


class TritonNotFoundError(TritonError):
    """No usable ``tritonserver`` binary (neither on PATH nor in the nvidia-pytriton wheel)."""


class TritonStartError(TritonError):
    """The server exited (or never became ready) while starting; the message carries its log."""


class PortInUseError(TritonError):
    """A port the server needs is already taken; raised before the server is started."""


class InvalidRepositoryError(TritonError):
    """The model repository is missing or malformed (checked before Triton would fail more obscurely)."""


@dataclass(frozen=True)
class TritonInstall:
    """Where a tritonserver lives and what it needs to run."""

    binary: Path
    backend_directory: Path
    ld_library_path: tuple[Path, ...] = ()
    source: Literal["PATH", "nvidia-pytriton"] = "PATH"


# --------------------------------------------------------------------------- locating the server


def find_tritonserver() -> TritonInstall:
    """Locate tritonserver: PATH first (production images have more backends), else the pytriton wheel."""
    on_path = shutil.which("tritonserver")
    if on_path:
        binary = Path(on_path).resolve()
        override = os.environ.get("SPECDEC_TRITON_BACKENDS")
        if override:
            backends = Path(override)
        elif Path("/opt/tritonserver/backends").is_dir():
            backends = Path("/opt/tritonserver/backends")
        else:
            backends = binary.parent.parent / "backends"
        return TritonInstall(binary=binary, backend_directory=backends, source="PATH")
    bundled = _find_bundled()
    if bundled is None:
        raise TritonNotFoundError(f"tritonserver not found: {INSTALL_HINT}")
    return bundled


def _find_bundled() -> TritonInstall | None:
    """The wheel's tritonserver, found without importing pytriton (its import pulls heavy deps)."""
    try:
        spec = importlib.util.find_spec("pytriton")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    pkg = Path(next(iter(spec.submodule_search_locations)))
    root = pkg / "tritonserver"
    binary = root / "bin" / "tritonserver"
    if not (binary.is_file() and os.access(binary, os.X_OK)):
        return None
    libs = pkg.parent / "nvidia_pytriton.libs"
    backends = _ensure_python_stub(root)
    return TritonInstall(
        binary=binary,
        backend_directory=backends,
        ld_library_path=(libs,) if libs.is_dir() else (),
        source="nvidia-pytriton",
    )


def _ensure_python_stub(root: Path) -> Path:
    """Give the bundled Python backend a stub for *this* interpreter and return the backend directory.

    The wheel ships one stub per Python version beside the backend; the backend only looks in
    ``backends/python/``. Copy it there (atomically, so concurrent starts never see half a file), or,
    when site-packages is read-only, mirror the backend directory under the user cache with symlinks.
    """
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = root / "python_backend_stubs" / version / STUB_NAME
    backends = root / "backends"
    python_dir = backends / "python"
    if not stub.is_file():
        raise TritonNotFoundError(
            f"the bundled tritonserver has no Python-backend stub for Python {version} (looked for {stub})"
        )
    target = python_dir / STUB_NAME
    if _same_file_content(target, stub):
        return backends
    if os.access(python_dir, os.W_OK):
        try:
            _atomic_copy(stub, target)
            return backends
        except OSError:
            pass
    return _private_backends(backends, stub, version)


def _same_file_content(a: Path, b: Path) -> bool:
    try:
        return a.is_file() and a.stat().st_size == b.stat().st_size and os.access(a, os.X_OK)
    except OSError:
        return False


def _atomic_copy(src: Path, dst: Path) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{dst.name}.", dir=dst.parent)
    os.close(fd)
    try:
        shutil.copyfile(src, tmp)
        os.chmod(tmp, 0o755)
        os.replace(tmp, dst)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _private_backends(backends: Path, stub: Path, version: str) -> Path:
    """A backend directory of symlinks under the cache whose ``python/`` also links this Python's stub."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    digest = hashlib.sha256(str(backends).encode()).hexdigest()[:12]
    private = cache / "specdec" / "triton-backends" / f"py{version}-{digest}"
    (private / "python").mkdir(parents=True, exist_ok=True)
    for entry in backends.iterdir():
        if entry.name != "python":
            _symlink(entry, private / entry.name)
    for entry in (backends / "python").iterdir():
        if entry.name != STUB_NAME and not entry.name.startswith("."):
            _symlink(entry, private / "python" / entry.name)
    _symlink(stub, private / "python" / STUB_NAME)
    return private


def _symlink(src: Path, dst: Path) -> None:
    if dst.is_symlink() and os.readlink(dst) == str(src):
        return
    tmp = dst.with_name(f".{dst.name}.{os.getpid()}")
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()
    tmp.symlink_to(src)
    os.replace(tmp, dst)


# --------------------------------------------------------------------------- checks before starting


def _libpython_dir() -> Path | None:
    """The directory of this interpreter's shared libpython, if it has one.

    The bundled stub links ``libpython3.X.so.1.0`` by soname and the loader finds the system's copy
    first. When this interpreter is a different patch release (pyenv, conda), its extension modules
    need symbols the system library lacks: ``import ssl`` (and so transformers) fails in the stub
    with ``undefined symbol: _PyModule_Add``. Putting this interpreter's library first fixes that.
    """
    libdir, name = sysconfig.get_config_var("LIBDIR"), sysconfig.get_config_var("INSTSONAME")
    if not libdir or not name or not (Path(libdir) / name).is_file():
        return None
    return Path(libdir)


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


def validate_repository(path: str | os.PathLike[str]) -> Path:
    """Check the model repository's shape so a typo fails in a second with a clear message.

    Triton itself would start, fail to load, and bury the reason in its log. Every model directory needs
    a ``config.pbtxt`` and at least one numeric version directory.
    """
    repo = Path(path)
    if (repo / "manifest.json").is_file() and (repo / "triton_repo").is_dir():  # an export directory
        repo = repo / "triton_repo"
    if not repo.is_dir():
        raise InvalidRepositoryError(f"model repository {repo} does not exist or is not a directory")
    models = sorted(p for p in repo.iterdir() if p.is_dir() and not p.name.startswith("."))
    if not models:
        raise InvalidRepositoryError(f"model repository {repo} contains no model directories")
    for model in models:
        if not (model / "config.pbtxt").is_file():
            raise InvalidRepositoryError(f"model {model.name!r} in {repo} has no config.pbtxt")
        if not any(v.is_dir() and v.name.isdigit() for v in model.iterdir()):
            raise InvalidRepositoryError(
                f"model {model.name!r} in {repo} has no version directory (e.g. {model / '1'})"
            )
    names = {model.name for model in models}
    from specdec.serving.repository import missing_models

    missing = missing_models(repo)
    if missing:
        raise InvalidRepositoryError(f"specdec model repository {repo} is missing model(s) {', '.join(missing)} "
                                     "(rewrite it with `specdec-export`, or copy the whole triton_repo)")
    for model in models:
        for needed in re.findall(r'model_name:\s*"([^"]+)"', (model / "config.pbtxt").read_text(errors="replace")):
            if needed not in names:
                raise InvalidRepositoryError(f"ensemble {model.name!r} in {repo} uses model {needed!r}, which is "
                                             "missing from the repository")
    return repo


# --------------------------------------------------------------------------- the server process


def _client_host(host: str) -> str:
    return "127.0.0.1" if host in ("", "0.0.0.0", "::") else host


def _error_summary(log_text: str, tail_lines: int = 30) -> str:
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
    _log_handle: object = field(default=None, init=False, repr=False)

    def command(self, model_repository: Path, *, log_verbose: int, exit_timeout_s: int,
                extra_args: Sequence[str]) -> list[str]:
        """The exact command line (exposed so the CLI can print it and tests can inspect it)."""
        assert self.install is not None
        return [
            str(self.install.binary),
            f"--model-repository={model_repository}",
            f"--backend-directory={self.install.backend_directory}",
            f"--grpc-address={self.host}", f"--grpc-port={self.grpc_port}",
            f"--http-address={self.host}", f"--http-port={self.http_port}",
            f"--metrics-address={self.host}", f"--metrics-port={self.metrics_port}",
            f"--exit-timeout-secs={exit_timeout_s}",
            f"--log-verbose={log_verbose}",
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
        own = _libpython_dir()
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
        return env

    def start(self, model_repository: str | os.PathLike[str], *, host: str = "127.0.0.1", grpc_port: int = 8001,
              http_port: int = 8000, metrics_port: int = 8002, log_verbose: int = 0, exit_timeout_s: int = 30,
              extra_args: Sequence[str] = ()) -> TritonServer:
        """Validate, check the ports, and launch the server (returns at once; call :meth:`wait_ready`)."""
        if self.process is not None and self.process.poll() is None:
            raise TritonError("this TritonServer is already running")
        repo = validate_repository(model_repository).resolve()
        for flag, port in (("--grpc-port", grpc_port), ("--http-port", http_port), ("--metrics-port", metrics_port)):
            if not port_free(host, port):
                raise PortInUseError(f"port {port} on {host} ({flag}) is already in use; pick another with {flag}")
        if len({grpc_port, http_port, metrics_port}) != 3:
            raise PortInUseError(f"grpc, http and metrics ports must differ (got {grpc_port}, {http_port}, "
                                 f"{metrics_port})")
        if self.install is None:
            self.install = find_tritonserver()
        self.host, self.grpc_port, self.http_port, self.metrics_port = host, grpc_port, http_port, metrics_port
        self.exit_timeout_s = exit_timeout_s
        if self.log_file is None:
            fd, name = tempfile.mkstemp(prefix="specdec-tritonserver-", suffix=".log")
            os.close(fd)
            self.log_file = Path(name)
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        handle = open(self.log_file, "wb")
        self._log_handle = handle
        cmd = self.command(repo, log_verbose=log_verbose, exit_timeout_s=exit_timeout_s, extra_args=extra_args)
        try:
            self.process = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=handle, stderr=subprocess.STDOUT,
                                            env=self.environment(), start_new_session=True)
        except OSError as exc:
            handle.close()
            raise TritonStartError(f"cannot run {cmd[0]}: {exc}") from exc
        return self

    @property
    def grpc_url(self) -> str:
        return f"{_client_host(self.host)}:{self.grpc_port}"

    @property
    def http_url(self) -> str:
        return f"http://{_client_host(self.host)}:{self.http_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{_client_host(self.host)}:{self.metrics_port}/metrics"

    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def read_log(self) -> str:
        if self.log_file is None or not self.log_file.exists():
            return ""
        return self.log_file.read_text(encoding="utf-8", errors="replace")

    def is_ready(self) -> bool:
        """One probe of ``/v2/health/ready`` (200 means every model loaded and the server serves)."""
        try:
            with urllib.request.urlopen(f"{self.http_url}/v2/health/ready", timeout=2) as resp:
                return resp.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def wait_ready(self, timeout: float = 300.0, poll_s: float = 0.25) -> None:
        """Block until ready; raise TritonStartError with the log if the server dies or the time runs out.

        Checking the process between probes turns "failed to load all models" into an error within a
        poll interval instead of a silent timeout.
        """
        if self.process is None:
            raise TritonError("server not started")
        deadline = time.monotonic() + timeout
        while True:
            code = self.process.poll()
            if code is not None:
                raise TritonStartError(
                    f"tritonserver exited with code {code} while starting (log: {self.log_file})\n"
                    + _error_summary(self.read_log())
                )
            if self.is_ready():
                return
            if time.monotonic() >= deadline:
                raise TritonStartError(
                    f"tritonserver not ready after {timeout:.0f} s (log: {self.log_file})\n"
                    + _error_summary(self.read_log())
                )
            time.sleep(poll_s)

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
                    continue
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        if self._log_handle is not None:
            self._log_handle.close()  # type: ignore[attr-defined]
            self._log_handle = None
        return code

    def __enter__(self) -> TritonServer:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()


# --------------------------------------------------------------------------- CLI


def add_serve_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Options of ``specdec serve`` (kept here so cli.py only wires the subcommand)."""
    parser.add_argument("model_repository", help="Triton model repository (e.g. the one `specdec export` wrote)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1; 0.0.0.0 for all)")
    parser.add_argument("--grpc-port", type=int, default=8001, help="gRPC port (default 8001)")
    parser.add_argument("--http-port", type=int, default=8000, help="HTTP port (default 8000)")
    parser.add_argument("--metrics-port", type=int, default=8002, help="Prometheus metrics port (default 8002)")
    parser.add_argument("--log-file", type=Path, help="server log (default: a temporary file, printed at start)")
    parser.add_argument("--log-verbose", type=int, default=0, help="tritonserver --log-verbose level")
    parser.add_argument("--ready-timeout", type=float, default=300.0,
                        help="seconds to wait for all models to load (default 300)")
    return parser


def serve_main(args: argparse.Namespace | Sequence[str] | None = None) -> int:
    """Run the server in the foreground until SIGINT/SIGTERM; return its exit code (1 on launcher errors)."""
    if not isinstance(args, argparse.Namespace):
        parser = add_serve_args(argparse.ArgumentParser(prog="specdec serve", description=__doc__))
        args = parser.parse_args(None if args is None else list(args))
    server = TritonServer(log_file=args.log_file)
    stop_requested: list[int] = []

    def forward(signum: int, _frame: FrameType | None) -> None:
        stop_requested.append(signum)
        server.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        try:
            server.start(args.model_repository, host=args.host, grpc_port=args.grpc_port, http_port=args.http_port,
                         metrics_port=args.metrics_port, log_verbose=args.log_verbose)
            print(f"specdec serve: starting {server.install.binary} ({server.install.source}); "  # type: ignore[union-attr]
                  f"log: {server.log_file}", file=sys.stderr, flush=True)
            server.wait_ready(args.ready_timeout)
        except TritonError as exc:
            server.stop()
            if stop_requested:
                return 128 + stop_requested[0]
            print(f"error: {exc}", file=sys.stderr)
            return 1
        print(f"specdec serve: ready\n  gRPC    {server.grpc_url}\n  HTTP    {server.http_url}\n"
              f"  metrics {server.metrics_url}\n(Ctrl-C to stop)", flush=True)
        while True:
            try:
                code = server.wait()
                break
            except InterruptedError:  # pragma: no cover - PEP 475 retries, kept for safety
                continue
        server.stop()
        if code < 0:  # killed by a signal: report it the way a shell would
            code = 128 - code
        if code != 0 and not stop_requested:
            print(f"error: tritonserver exited with code {code}\n{_error_summary(server.read_log())}",
                  file=sys.stderr)
        return code
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)

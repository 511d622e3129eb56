"""The frontend as a process beside tritonserver: start it, wait until it listens, drain it, stop it.

The one place that starts and stops the OpenAI frontend, so ``specdec serve`` (and a supervisor that restarts a
dead one) has a single handle on it. Standard library only (``specdec serve --help`` stays fast): the app runs in
its own interpreter, ``python -m specdec.serving.openai``, so a crash of either side leaves the other serving,
and the frontend scales apart from the engine.

Draining: ``drain`` raises a flag in the frontend's own control directory (``specdec.serving.control``), which the
app reads on every request: new requests get 503 at once and ``/health/ready`` turns 503, while the answers in
flight go on. ``stop`` then sends SIGTERM, on which uvicorn stops listening and waits for the open responses
(the SSE streams) to finish before it exits 0.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from specdec.serving.control import CONTROL_ENV, DRAIN, Control
from specdec.serving.install import TritonError
from specdec.serving.server import client_host, die_with_parent, read_log

DEFAULT_PORT = 8003
#: the frontend's health endpoints: live (the process answers) and ready (Triton serves and no drain is under way)
LIVE_PATH, READY_PATH = "/health/live", "/health/ready"
#: the environment variable the API key travels in (never on a command line, which every user can read)
API_KEY_ENV = "SPECDEC_OPENAI_API_KEY"


class FrontendError(TritonError):
    """The frontend exited or never listened; the message carries its log."""


def http_status(url: str, timeout_s: float = 2.0) -> int | None:
    """The HTTP status of a GET of ``url``, None when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except (urllib.error.URLError, OSError):
        return None


def model_name(repository: Path) -> str:
    """The name the frontend serves an export under: its target's name in the manifest ('specdec' if none).

    ``repository`` is the export directory or its ``triton_repo``.
    """
    import json

    for folder in (repository, repository.parent):
        manifest = folder / "manifest.json"
        if manifest.is_file():
            try:
                name = json.loads(manifest.read_text()).get("target", {}).get("name")
            except (ValueError, OSError, AttributeError):
                name = None
            if isinstance(name, str) and name:
                return name
    return "specdec"


@dataclass
class OpenAIFrontend:
    """``python -m specdec.serving.openai`` in a process of its own, logging to ``log_file``."""

    triton_url: str
    model: str
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    api_key: str | None = None
    log_file: Path | None = None
    #: how long SIGTERM lets the open responses finish before uvicorn closes them
    graceful_s: float = 60.0
    extra_args: tuple[str, ...] = ()
    process: subprocess.Popen[bytes] | None = field(default=None, init=False)
    control: Control = field(default=Control(None), init=False)
    _own_log: bool = field(default=False, init=False, repr=False)
    _log_handle: IO[bytes] | None = field(default=None, init=False, repr=False)

    @property
    def url(self) -> str:
        host = client_host(self.host)
        return f"http://[{host}]:{self.port}" if ":" in host else f"http://{host}:{self.port}"

    def command(self) -> list[str]:
        assert self.control.directory is not None
        return [
            sys.executable,
            "-m",
            "specdec.serving.openai",
            "--triton-url",
            self.triton_url,
            "--host",
            self.host,
            "--port",
            str(self.port),
            "--model-name",
            self.model,
            "--control-dir",
            str(self.control.directory),
            "--graceful-timeout",
            f"{self.graceful_s:g}",
            *self.extra_args,
        ]

    def start(self) -> OpenAIFrontend:
        """Launch it (returns at once: ``wait_ready``)."""
        if self.running():
            raise FrontendError("this frontend is already running")
        if self.log_file is None:
            fd, name = tempfile.mkstemp(prefix="specdec-openai-", suffix=".log")
            os.close(fd)
            self.log_file, self._own_log = Path(name), True
        self.control = Control(Path(tempfile.mkdtemp(prefix="specdec-openai-control-")))
        env = {k: v for k, v in os.environ.items() if k not in (API_KEY_ENV, CONTROL_ENV)}
        if self.api_key:
            env[API_KEY_ENV] = self.api_key
        handle = open(self.log_file, "ab")
        self._log_handle = handle
        try:
            # a session of its own, as tritonserver's: a terminal's Ctrl-C reaches ``specdec serve`` alone, which
            # drains the frontend in its turn (``drain``, then ``stop``) instead of having it stop at the same time
            self.process = subprocess.Popen(
                self.command(),
                preexec_fn=die_with_parent,
                stdin=subprocess.DEVNULL,
                stdout=handle,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        except OSError as exc:
            handle.close()
            raise FrontendError(f"cannot start the OpenAI frontend: {exc}") from exc
        return self

    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def read_log(self) -> str:
        return read_log(self.log_file)

    def wait_ready(self, timeout_s: float = 60.0, poll_s: float = 0.1) -> None:
        """Until it answers ``LIVE_PATH``; ``FrontendError`` with its log if it exits or the time runs out."""
        deadline = time.monotonic() + timeout_s
        while http_status(f"{self.url}{LIVE_PATH}") != 200:
            if not self.running() or time.monotonic() >= deadline:
                code = None if self.process is None else self.process.poll()
                why = f"exited with code {code}" if code is not None else f"not listening after {timeout_s:.0f} s"
                raise FrontendError(f"the OpenAI frontend {why} (log: {self.log_file})\n{self.read_log()[-3000:]}")
            time.sleep(poll_s)

    def live(self) -> bool:
        """One liveness check: the process answers ``LIVE_PATH``."""
        return http_status(f"{self.url}{LIVE_PATH}") == 200

    def drain(self) -> None:
        """Refuse new requests (503) and report not ready, while the answers in flight go on."""
        if self.running() and self.control.directory is not None:
            self.control.ask(DRAIN)

    def stop(self, timeout_s: float | None = None) -> int | None:
        """SIGTERM (the open responses finish), SIGKILL if it outlives ``timeout_s``; its exit code."""
        if self.process is None:
            return None
        timeout_s = self.graceful_s + 10.0 if timeout_s is None else timeout_s
        code = self.process.poll()
        if code is None:
            with contextlib.suppress(ProcessLookupError):
                self.process.send_signal(signal.SIGTERM)
            try:
                code = self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                code = self.process.wait()
        if self._log_handle is not None:
            self._log_handle.close()
            self._log_handle = None
        if self.control.directory is not None:
            shutil.rmtree(self.control.directory, ignore_errors=True)
        if code == 0 and self._own_log and self.log_file is not None:
            self.log_file.unlink(missing_ok=True)
        return code

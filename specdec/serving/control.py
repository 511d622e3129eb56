"""The launcher's side channel to the served models: drain and abort, and what a server leaves in /dev/shm.

Why a channel of its own: Triton counts no in-flight work for specdec's decoupled Python models (their
``execute`` hands each request to a thread and returns at once), so on SIGINT it unloads the models at
once, ``postprocessing`` first, under the streams still using it. ``specdec serve`` therefore drains
before it lets Triton shut down: it tells the entry points to admit nothing new (new requests get
UNAVAILABLE at once), waits until their in-flight gauge reads 0, and only then signals tritonserver. A
second signal aborts what is left: the entry points end those requests with UNAVAILABLE.

Cancels go the same way, the one path a cancellation takes: with several engine instances (each its own stub
process, ``--instances``), an entry point cannot address the instance that holds its request, since Triton hands a
request to any instance, and Triton 2.51 passes a client's cancellation on through no BLS call. So the entry point
leaves a cancel file named by the engine request id, every instance looks for its own ids at each poll, and the
one holding it cancels it and removes the file.

Why flag files in a private directory: the models run in stub processes that tritonserver starts and
that inherit its environment, so a directory named by ``SPECDEC_CONTROL_DIR`` is something both sides
reach without opening an API that clients could call. A server started without ``specdec serve``
(plain ``tritonserver`` on the repository) gets a directory of its own, named by the server's process id (every
stub's parent), so its cancels work the same; nobody raises its drain flags, so it never drains.

Shared memory: each Python-backend stub maps a ``/dev/shm`` region named by the backend's
``shm-region-prefix-name``. ``specdec serve`` gives every server its own prefix, so after the server
exits (cleanly, or killed with SIGKILL, which leaves the regions behind) exactly its regions are removed.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from specdec.serving import processes

CONTROL_ENV = "SPECDEC_CONTROL_DIR"
#: the per-server secret the entry points pass to the internal models (engine, pre- and postprocessing) as a
#: request parameter: a client that calls an internal model directly does not know it and is refused, so it
#: cannot skip the entry points' limits, feed the engine raw token ids or cancel another client's request
INTERNAL_KEY_ENV = "SPECDEC_INTERNAL_KEY"
INTERNAL_KEY_PARAMETER = "specdec_internal_key"
#: the header Triton's management APIs (model repository, shared memory, logging, trace) require under specdec serve;
#: over gRPC Triton expects it with its own prefix (``GRPC_ADMIN_HEADER``)
ADMIN_HEADER = "specdec-admin-key"
GRPC_ADMIN_HEADER = f"triton-grpc-protocol-{ADMIN_HEADER}"
RESTRICTED_APIS = ("model-repository", "shared-memory", "logging", "trace")
DRAIN, ABORT = "drain", "abort"
#: a stub of the server failed and is being replaced: the entry points end what they hold and admit nothing until
#: the launcher lowers it again (``specdec.serving.supervisor``)
RESET = "reset"
#: readiness is held false (``gate_model``): the readiness gate refuses to load while it is up
CLOSED = "closed"
FLAGS = (DRAIN, ABORT, RESET, CLOSED)
#: the launcher's counts of what it did to keep the server up (restarts, reloads), which a model publishes on the
#: metrics port (the launcher has none of its own)
SUPERVISION_FILE = "supervision.json"
CANCEL_PREFIX = "cancel-"
SHM_DIR = Path("/dev/shm")
#: the entry points' gauge of requests admitted and not yet answered, which the launcher's drain waits on
INFLIGHT_METRIC = "specdec_inflight_requests"


@dataclass(frozen=True)
class Control:
    """The flag files of one server; ``directory`` None means no launcher is listening (never draining)."""

    directory: Path | None

    @classmethod
    def from_env(cls) -> Control:
        """The launcher's directory (``SPECDEC_CONTROL_DIR``), else this server's own (``server_directory``)."""
        value = os.environ.get(CONTROL_ENV)
        return cls(Path(value) if value else server_directory())

    def _flag(self, name: str) -> bool:
        return self.directory is not None and (self.directory / name).exists()

    def draining(self) -> bool:
        """Whether new requests must be refused (a drain or an abort was asked for)."""
        return self._flag(DRAIN) or self._flag(ABORT)

    def aborting(self) -> bool:
        """Whether the requests still in flight must end now."""
        return self._flag(ABORT)

    def resetting(self) -> bool:
        """Whether a stub failed and is being replaced (``RESET``)."""
        return self._flag(RESET)

    def closed(self) -> bool:
        """Whether readiness is held false (``CLOSED``)."""
        return self._flag(CLOSED)

    def ask(self, name: str) -> None:
        """The launcher's side: raise a flag of ``FLAGS``."""
        if name not in FLAGS:
            raise ValueError(f"unknown control flag {name!r}")
        if self.directory is None:
            raise RuntimeError("this server has no control directory")
        (self.directory / name).touch()

    def lower(self, name: str) -> None:
        """The launcher's side: lower a flag (the ``RESET`` of a recovery that is over)."""
        if name not in FLAGS:
            raise ValueError(f"unknown control flag {name!r}")
        if self.directory is not None:
            (self.directory / name).unlink(missing_ok=True)

    def record(self, **counts: int) -> None:
        """The launcher's side: its counts of restarts and reloads (``SUPERVISION_FILE``)."""
        if self.directory is not None:
            tmp = self.directory / f"{SUPERVISION_FILE}.tmp"
            tmp.write_text(json.dumps(counts))
            os.replace(tmp, self.directory / SUPERVISION_FILE)

    def counts(self) -> dict[str, int]:
        """What ``record`` wrote (empty before anything was recorded)."""
        try:
            return {k: int(v) for k, v in json.loads((self.directory / SUPERVISION_FILE).read_text()).items()}  # type: ignore[operator]
        except (OSError, ValueError, TypeError, AttributeError):
            return {}

    def cancel(self, request_id: str) -> None:
        """The entry point's side: ask whichever engine instance holds ``request_id`` to cancel it."""
        if self.directory is None:
            raise RuntimeError("this server has no control directory")
        (self.directory / f"{CANCEL_PREFIX}{request_id.encode().hex()}").touch()

    def cancels(self) -> set[str]:
        """The engine's side: the request ids whose cancel is asked for (any instance's)."""
        if self.directory is None:
            return set()
        try:
            names = [p.name for p in self.directory.iterdir() if p.name.startswith(CANCEL_PREFIX)]
        except OSError:
            return set()
        return {bytes.fromhex(n.removeprefix(CANCEL_PREFIX)).decode(errors="replace") for n in names}

    def forget_cancel(self, request_id: str) -> None:
        """Remove ``request_id``'s cancel file: done by the instance that cancelled it, or by the entry point
        when its request ended anyway."""
        if self.directory is not None:
            (self.directory / f"{CANCEL_PREFIX}{request_id.encode().hex()}").unlink(missing_ok=True)


SERVER_DIR_PREFIX = "specdec-server-"


def server_directory(server_pid: int | None = None) -> Path:
    """The control directory of the tritonserver ``server_pid`` (default: this stub's parent), private to this
    user; directories of servers that are gone are removed on the way (a SIGKILLed server leaves its own)."""
    pid = os.getppid() if server_pid is None else server_pid
    root = Path(tempfile.gettempdir())
    for stale in root.glob(f"{SERVER_DIR_PREFIX}{os.getuid()}-*"):
        other = stale.name.rsplit("-", 1)[-1]
        if other.isdigit() and int(other) != pid and not processes.alive(int(other)):
            shutil.rmtree(stale, ignore_errors=True)
    directory = root / f"{SERVER_DIR_PREFIX}{os.getuid()}-{pid}"
    directory.mkdir(mode=0o700, exist_ok=True)
    if directory.stat().st_uid != os.getuid():
        raise PermissionError(f"{directory} belongs to another user: refusing its control files")
    return directory


def internal_key() -> str | None:
    """This server's internal key (None: a server not started by ``specdec serve``, whose models accept all)."""
    return os.environ.get(INTERNAL_KEY_ENV) or None


def new_secret() -> str:
    return secrets.token_hex(16)


def new_shm_prefix() -> str:
    """A Python-backend shared-memory prefix no other server on the machine uses."""
    return f"specdec_{os.getpid()}_{secrets.token_hex(4)}_"


def shm_regions(prefix: str) -> list[Path]:
    """The /dev/shm regions of the server whose stubs used ``prefix``."""
    if not prefix or not SHM_DIR.is_dir():
        return []
    return sorted(p for p in SHM_DIR.iterdir() if p.name.startswith(prefix))


def remove_shm(prefix: str) -> list[Path]:
    """Remove what a server that has exited left in /dev/shm; returns what was removed."""
    removed = []
    for region in shm_regions(prefix):
        try:
            region.unlink()
            removed.append(region)
        except FileNotFoundError:
            continue
    return removed


def inflight_from_metrics(text: str) -> int | None:
    """The sum of ``INFLIGHT_METRIC`` over its labels in a Prometheus exposition, or None when it is absent."""
    total, seen = 0.0, False
    for line in text.splitlines():
        if line.startswith(INFLIGHT_METRIC) and not line.startswith("#"):
            name = line.split("{", 1)[0].split(" ", 1)[0]
            if name == INFLIGHT_METRIC:
                total += float(line.rsplit(" ", 1)[1])
                seen = True
    return int(total) if seen else None

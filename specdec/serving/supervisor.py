"""Keep every process of a served deployment up: see a dead or frozen one, say so at once, replace it.

What is watched, every ``POLL_S``:

- tritonserver itself (its exit code);
- every Python-backend stub, through the heartbeat each model renews (``serving.heartbeat``): a stub whose process
  is gone died; one that is stopped (SIGSTOP, a debugger) or whose beat is older than ``heartbeat.STALE_S`` is
  frozen; an engine whose decoding loop has been inside one step past that step's limit (its rows at the pace
  of the steps before it) is wedged. Both ages leave out the time the whole host was paused
  (``heartbeat.PauseClock``): a VM descheduled for seconds is not a frozen server. Stubs are watched from their
  first beat, while the models still load;
- the OpenAI frontend's process.

What a failure sets off: readiness turns false at once on HTTP and gRPC (the readiness gate is unloaded:
``gate_model``); the entry points end every request they hold with UNAVAILABLE and refuse new ones until the
repair is over (``Control`` flag ``RESET``), so no client hangs; then the repair, the smallest that is sound:

- a stub of preprocessing, postprocessing or the gate: killed if it still runs, its model reloaded through Triton's
  model control (a fresh stub), readiness back once it answers;
- the engine, an entry point, or tritonserver: tritonserver restarted (the engine holds every request's decoding
  state, the entry points' calls into a dead engine would never return, and Triton never answers the requests a
  dead entry point held), its closed ports ending every client's call at once;
- the frontend: restarted beside the server, which keeps serving gRPC meanwhile.

How often: each repair waits out an exponential backoff (``RestartPolicy``), and more than ``max_restarts`` repairs
within ``window_s`` is a crash loop: ``specdec serve`` gives up and exits 1, so whatever runs it (Kubernetes'
restart policy, systemd) replaces the whole pod or unit. Each repair is logged and counted on the metrics port.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from specdec.serving import heartbeat, processes
from specdec.serving.control import RESET
from specdec.serving.install import TritonError
from specdec.serving.protocol import ENGINE_MODEL, READY_MODEL, STREAM_MODEL, UNARY_MODEL

if TYPE_CHECKING:
    from specdec.serving.openai.process import OpenAIFrontend
    from specdec.serving.server import TritonServer

#: how often the supervisor looks
POLL_S = 0.2
#: the frontend is frozen after this many failed liveness checks in a row (one per ``FRONTEND_CHECK_S``)
FRONTEND_CHECK_S, FRONTEND_MISSES = 1.0, 3


@dataclass(frozen=True)
class Fault:
    """What failed: ``model`` (a stub's model; None: tritonserver or the frontend), its ``pid``, and why."""

    what: str
    model: str | None = None
    pid: int | None = None
    frontend: bool = False

    @property
    def needs_restart(self) -> bool:
        """Whether only a tritonserver restart repairs it: the server itself, the engine, or an entry point (Triton
        never answers a decoupled request whose stub died: a reload left the entry point's clients waiting for their
        deadline, ``tests/test_supervision.py``)."""
        return not self.frontend and self.model in (None, ENGINE_MODEL, UNARY_MODEL, STREAM_MODEL)


@dataclass
class RestartPolicy:
    """Exponential backoff between repairs, and a crash-loop limit per time window."""

    max_restarts: int = 5
    window_s: float = 600.0
    backoff_s: float = 1.0
    max_backoff_s: float = 30.0
    clock: Callable[[], float] = time.monotonic
    history: list[float] = field(default_factory=list)

    def delay(self) -> float | None:
        """Seconds to wait before the next repair, or None: the window holds ``max_restarts`` already (give up).

        The first repair in a quiet window is at once; each further one waits twice the one before."""
        now = self.clock()
        self.history = [t for t in self.history if now - t < self.window_s]
        if len(self.history) >= self.max_restarts:
            return None
        recent = len(self.history)
        self.history.append(now)
        return 0.0 if recent == 0 else min(self.max_backoff_s, self.backoff_s * 2 ** (recent - 1))


def _say(message: str) -> None:
    print(f"specdec serve: {message}", file=sys.stderr, flush=True)


class Supervisor:
    """The watcher and the repairs of one ``TritonServer`` (and its ``OpenAIFrontend``, if any)."""

    def __init__(
        self,
        server: TritonServer,
        frontend: OpenAIFrontend | None,
        policy: RestartPolicy,
        pauses: heartbeat.PauseClock | None = None,
    ) -> None:
        self.server, self.frontend, self.policy = server, frontend, policy
        #: beats and steps are aged by the time the host ran (``heartbeat.PauseClock``)
        self.pauses = pauses if pauses is not None else heartbeat.PauseClock().start()
        self._frontend_misses = 0
        self._frontend_checked = 0.0

    # -- seeing -----------------------------------------------------------------------------------------------------
    def fault(self) -> Fault | None:
        """The first failure found, or None when every process serves."""
        server = self.server
        code = server.process.poll() if server.process is not None else None
        if code is not None:
            return Fault(f"tritonserver exited with code {code}")
        found = self._stub_fault()
        return found if found is not None else self._frontend_fault()

    def _stub_fault(self) -> Fault | None:
        directory = self.server.control.directory
        if directory is None:
            return None
        for beat in heartbeat.read_all(directory):
            name = f"the {beat.model} stub (pid {beat.pid})"
            if not processes.alive(beat.pid):
                return Fault(f"{name} died", beat.model, beat.pid)
            if processes.stopped(beat.pid):
                return Fault(f"{name} is stopped", beat.model, beat.pid)
            silent_s = self.pauses.ran(beat.time)
            if silent_s > heartbeat.STALE_S:
                return Fault(f"{name} is frozen: no heartbeat for {silent_s:.1f} s", beat.model, beat.pid)
            limit = beat.step_limit()
            if limit is not None and (busy_s := self.pauses.ran(beat.busy_since)) > limit:  # type: ignore[arg-type]
                return Fault(f"{name} is wedged: one step of {beat.rows} rows for {busy_s:.1f} s", beat.model, beat.pid)
        return None

    def _frontend_fault(self) -> Fault | None:
        frontend = self.frontend
        if frontend is None or frontend.process is None:
            return None
        code = frontend.process.poll()
        if code is not None:
            return Fault(f"the OpenAI frontend exited with code {code}", frontend=True)
        now = time.monotonic()
        if now - self._frontend_checked >= FRONTEND_CHECK_S:
            self._frontend_checked = now
            self._frontend_misses = 0 if frontend.live() else self._frontend_misses + 1
            if self._frontend_misses >= FRONTEND_MISSES:
                return Fault("the OpenAI frontend does not answer its liveness check", frontend=True)
        return None

    # -- repairing --------------------------------------------------------------------------------------------------
    def repair(self, fault: Fault, wait_ready: Callable[[], None]) -> bool:
        """Bring the deployment back from ``fault``; False when it cannot be (a crash loop, a failed restart)."""
        started = time.monotonic()
        delay = self.policy.delay()
        # readiness false and every request released before anything else; a restart due at once needs none of it
        # (killing tritonserver closes its ports: readiness refused, every request UNAVAILABLE), and the gate's
        # unload and failed reload would cost a stub start, about 1.7 s of the repair
        # (benchmarks/results/reliability.md)
        if not fault.frontend and not (fault.needs_restart and delay == 0):
            self._hold()
        if delay is None:
            _say(
                f"error: {fault.what}; {self.policy.max_restarts} repairs within {self.policy.window_s:.0f} s: a "
                "crash loop, giving up (exit 1: the pod's or unit's restart policy takes over)"
            )
            return False
        _say(f"{fault.what}: " + (f"repairing in {delay:.0f} s" if delay else "repairing"))
        time.sleep(delay)
        try:
            if fault.frontend:
                self._restart_frontend()
            elif fault.needs_restart:
                self._restart_server(wait_ready)
            else:
                self._reload(fault, wait_ready)
        except TritonError as exc:
            _say(f"error: the repair failed: {exc}")
            return False
        _say(f"serving again after {time.monotonic() - started:.1f} s")
        return True

    def _hold(self) -> None:
        """Readiness false (the gate unloaded) and the entry points told to release what they hold (``RESET``)."""
        server = self.server
        with contextlib.suppress(TritonError, OSError):
            server.set_ready(False)
        with contextlib.suppress(OSError, RuntimeError):
            server.control.ask(RESET)

    def _reload(self, fault: Fault, wait_ready: Callable[[], None]) -> None:
        server = self.server
        if fault.pid is not None and processes.alive(fault.pid):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(fault.pid, signal.SIGKILL)
        # a stub's fault comes from a heartbeat in the control directory, and names its model
        assert fault.model is not None and server.control.directory is not None
        heartbeat.forget(server.control.directory, fault.pid or 0)
        server.reloads += 1
        server.record_counts()
        if fault.model != READY_MODEL:  # the gate itself is reloaded by opening it, below
            # Triton answers the load once the model is loaded, and an error (TritonError) when it failed: no probe
            # after it, which on a loaded host could time out on a model that loaded and give the server up
            server.reload(fault.model)
        server.control.lower(RESET)
        server.set_ready(True)
        wait_ready()

    def _restart_server(self, wait_ready: Callable[[], None]) -> None:
        self.server.restart()
        wait_ready()
        if self.frontend is not None:  # it talks to the same address: the new server is reachable again
            self._frontend_misses = 0

    def _restart_frontend(self) -> None:
        frontend = self.frontend
        assert frontend is not None  # a frontend's fault comes from a frontend (``_frontend_fault``)
        frontend.stop(timeout_s=5.0)
        frontend.start()
        frontend.wait_ready()
        self._frontend_misses = 0

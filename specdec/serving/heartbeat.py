"""Each model's sign of life, written where the launcher reads it: a small file per stub process, renewed a few
times a second by a thread of its own, which also ends the stub when tritonserver is gone.

Why: Triton notices a dead stub only when a request reaches it, and a stopped or wedged one never (a SIGSTOPped
engine kept readiness true and failed every request). A heartbeat that stops being renewed says the process is
frozen; a pid that no longer runs says it died; and the engine's beat also says how long its decoding loop has been
inside one ragged step and how many rows that step has, so the launcher can tell a wedged step from a long one
(``Beat.step_limit``): a prefill of many rows takes long but is priced by its rows, at the pace of the steps before it.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

PREFIX = "heartbeat-"
#: how often a stub renews its beat
BEAT_S = 0.25
#: a beat older than this says its stub is frozen (stopped, or its interpreter starved of every thread); generous
#: against a loaded machine, where a sleeping thread may wake a second late
STALE_S = 5.0
#: a step is wedged past the longest of this and ``STEP_FACTOR`` times what its rows took at the measured pace
STEP_FLOOR_S = 10.0
STEP_FACTOR = 20.0
#: the pace a step is priced at before any step was measured (CPU, a small model: generous)
DEFAULT_ROW_S = 0.02
#: the watcher's pause clock ticks this often, and a tick this much later than due marks a pause (``PauseClock``)
TICK_S, PAUSE_S = 0.1, 1.0


@dataclass(frozen=True)
class Beat:
    """One stub's state at ``time`` (``time.monotonic``, the same clock across the host's processes)."""

    model: str
    pid: int
    time: float
    #: the engine: since when its decoding loop has been inside one step (None: between steps), that step's rows,
    #: and the seconds a row took over the steps so far (None before the first)
    busy_since: float | None = None
    rows: int = 0
    row_seconds: float | None = None

    def step_limit(self) -> float | None:
        """How long the step in progress may run before it counts as wedged (None: no step in progress)."""
        if self.busy_since is None:
            return None
        pace = self.row_seconds if self.row_seconds is not None else DEFAULT_ROW_S
        return max(STEP_FLOOR_S, STEP_FACTOR * pace * max(self.rows, 1))


def write(directory: Path, beat: Beat) -> None:
    """Replace the stub's beat file at once (rename), so a reader never sees half of one."""
    path = directory / f"{PREFIX}{beat.pid}"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(asdict(beat)))
    os.replace(tmp, path)


def read_all(directory: Path) -> list[Beat]:
    """Every beat in ``directory`` (unreadable files, being replaced, are skipped)."""
    beats = []
    for path in directory.glob(f"{PREFIX}*"):
        if path.suffix == ".tmp":
            continue
        with contextlib.suppress(OSError, ValueError, TypeError):
            beats.append(Beat(**json.loads(path.read_text())))
    return beats


def forget(directory: Path, pid: int) -> None:
    (directory / f"{PREFIX}{pid}").unlink(missing_ok=True)


class Heartbeat:
    """A daemon thread renewing this process's beat for ``model``; ``progress`` adds the engine's step state
    (``busy_since``, ``rows``, ``row_seconds``)."""

    def __init__(self, directory: Path | None, model: str, progress: Callable[[], dict] | None = None) -> None:
        self.directory, self.model, self.progress = directory, model, progress
        self._parent = os.getppid()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="specdec-heartbeat", daemon=True)

    def start(self) -> Heartbeat:
        if self.directory is not None:
            self._beat()
            self._thread.start()
        return self

    def _beat(self) -> None:
        state = self.progress() if self.progress is not None else {}
        with contextlib.suppress(OSError):
            write(self.directory, Beat(self.model, os.getpid(), time.monotonic(), **state))  # type: ignore[arg-type]

    def orphaned(self) -> bool:
        """Whether tritonserver is gone: this stub was re-parented, and nothing can reach it any more."""
        return os.getppid() != self._parent

    def exit_if_orphaned(self) -> None:
        """First thing in a model's ``finalize``: a stub whose server is gone leaves at once. Why: Triton's stub
        finalizes its model when it sees its server die, and the cleanup (releasing response senders and metric
        families) talks to the server over IPC, which waits forever for a dead one (a stub outlived a SIGKILLed
        ``specdec serve`` that way, ``tests/test_supervision.py``). The beat thread keeps watching until ``stop``,
        the last thing ``finalize`` does, in case the server dies during the cleanup."""
        if self.orphaned():
            os._exit(0)

    def _run(self) -> None:
        while not self._stop.wait(BEAT_S):
            if self.orphaned():
                # a stub that finalizes a busy engine may take long to notice on its own; it goes now
                os._exit(0)
            self._beat()

    def stop(self) -> None:
        """No more beats, and this process's file goes: a model that unloads is not a stub that died."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(2 * BEAT_S)
        if self.directory is not None:
            forget(self.directory, os.getpid())


class PauseClock:
    """The watcher's own pauses, so that a beat's age and a step's length count only the time the host ran.

    Why: when the whole host pauses (a VM descheduled or live-migrated, a suspend, every process starved), the beat
    threads stop and so does the watcher. When it resumes, every beat is as old as the pause: judged by the wall
    clock, each stub would be frozen and the step in progress wedged, and a healthy server would be torn down with
    every request on it. A thread of the watcher's own ticks every ``TICK_S``; a tick ``PAUSE_S`` or more late marks
    a pause, and ``ran`` leaves out the pauses a span overlaps. The price is a stub that truly froze during a pause
    of the watcher is seen up to that pause later.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic, keep: int = 256) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._last = clock()
        self._pauses: deque[tuple[float, float]] = deque(maxlen=keep)
        self._thread = threading.Thread(target=self._run, name="specdec-pause-clock", daemon=True)

    def start(self) -> PauseClock:
        """Tick from a daemon thread for as long as the watcher's process runs."""
        self._thread.start()
        return self

    def tick(self) -> float:
        """Note the time now (a pause if the last tick is ``PAUSE_S`` overdue); returns it."""
        with self._lock:
            now = self._clock()
            if now - self._last > TICK_S + PAUSE_S:
                self._pauses.append((self._last, now))
            self._last = now
            return now

    def ran(self, since: float) -> float:
        """Seconds from ``since`` until now that were not inside a pause. Ticks first: the watcher's own thread may
        wake from a pause before the ticker does."""
        now = self.tick()
        with self._lock:
            paused = sum(max(0.0, min(end, now) - max(start, since)) for start, end in self._pauses)
        return now - since - paused

    def _run(self) -> None:
        while True:
            time.sleep(TICK_S)
            self.tick()

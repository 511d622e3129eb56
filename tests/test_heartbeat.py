"""The stubs' heartbeat (``specdec.serving.heartbeat``) as their orphan guard and as what the supervisor judges them
by: the logic, without a server.

The server-level behaviour (a SIGKILLed ``specdec serve`` takes its whole tree down) is
``tests/test_supervision.py``; this pins the two ways a stub notices its server is gone, and the host pauses the
supervisor leaves out of a beat's age.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import pytest

from specdec.serving import heartbeat
from specdec.serving.supervisor import RestartPolicy, Supervisor


def test_an_orphaned_stub_leaves_at_once_when_finalized(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A finalize that starts after the server died must not reach the cleanup that waits on the dead server."""
    beat = heartbeat.Heartbeat(tmp_path, "model")
    exits: list[int] = []
    monkeypatch.setattr(heartbeat.os, "_exit", exits.append)
    assert not beat.orphaned()
    beat.exit_if_orphaned()
    assert exits == []
    monkeypatch.setattr(heartbeat.os, "getppid", lambda: -1)  # re-parented: tritonserver is gone
    assert beat.orphaned()
    beat.exit_if_orphaned()
    assert exits == [0]


def test_the_beat_thread_exits_an_orphan_while_it_runs(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Until ``stop`` (the last thing a finalize does), the beat thread leaves as soon as the server is gone."""
    exited: list[int] = []
    beat = heartbeat.Heartbeat(tmp_path, "model")

    def leave(code: int) -> None:
        exited.append(code)
        beat._stop.set()  # the real os._exit ends the thread with the process

    monkeypatch.setattr(heartbeat.os, "_exit", leave)
    beat.start()
    assert heartbeat.read_all(tmp_path)  # it beats
    monkeypatch.setattr(heartbeat.os, "getppid", lambda: -1)
    beat._thread.join(20 * heartbeat.BEAT_S)
    assert exited == [0] and not beat._thread.is_alive()


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_the_pause_clock_leaves_out_the_pauses_a_span_overlaps() -> None:
    clock = FakeClock()
    pauses = heartbeat.PauseClock(clock)
    for _ in range(10):  # one second of ticks on time: no pause
        clock.now += heartbeat.TICK_S
        pauses.tick()
    assert pauses.ran(clock.now - 1.0) == pytest.approx(1.0)
    clock.now += 6.0  # the host paused for six seconds
    resumed = pauses.tick()
    for _ in range(20):  # then it ran two more seconds
        clock.now += heartbeat.TICK_S
        pauses.tick()
    assert pauses.ran(resumed - 7.0) == pytest.approx(3.0)  # 1 s before the pause, 2 s after it
    assert pauses.ran(resumed) == pytest.approx(2.0)  # a span after the pause is not shortened
    clock.now += heartbeat.TICK_S + heartbeat.PAUSE_S - 0.01  # a tick late, but within the allowance: no pause
    assert pauses.ran(resumed) == pytest.approx(2.0 + heartbeat.TICK_S + heartbeat.PAUSE_S - 0.01)
    clock.now += 3.0  # ``ran`` itself sees a pause its ticker has not woken from yet
    assert pauses.ran(resumed) == pytest.approx(2.0 + heartbeat.TICK_S + heartbeat.PAUSE_S - 0.01)


class _Control:
    def __init__(self, directory: Path) -> None:
        self.directory = directory


class _Server:
    """What ``Supervisor.fault`` reads of a server: its process (none here) and its control directory."""

    def __init__(self, directory: Path) -> None:
        self.process = None
        self.control = _Control(directory)


@pytest.mark.parametrize("busy", [False, True])
@pytest.mark.parametrize("watcher_ran", [False, True])
def test_a_beat_as_old_as_a_pause_of_the_whole_host_is_no_fault(tmp_path: Path, busy: bool, watcher_ran: bool) -> None:
    """A VM descheduled for longer than ``STALE_S`` (every process paused, the watcher too) must not take a healthy
    server down as frozen, nor a step in progress as wedged; the same silence while the watcher ran is a fault."""
    clock = FakeClock()
    pauses = heartbeat.PauseClock(clock)
    supervisor = Supervisor(_Server(tmp_path), None, RestartPolicy(), pauses)  # type: ignore[arg-type]
    started = clock.now
    silent_s = 2 * heartbeat.STEP_FLOOR_S if busy else 2 * heartbeat.STALE_S
    if watcher_ran:
        for _ in range(round(silent_s / heartbeat.TICK_S)):
            clock.now += heartbeat.TICK_S
            pauses.tick()
    else:
        clock.now += silent_s  # nothing ran, the watcher's ticker neither
    # a busy engine's beat thread beats on through its step; an idle stub's last beat is from before the silence
    beat = heartbeat.Beat("specdec_engine", os.getpid(), clock.now if busy else started, rows=4)
    heartbeat.write(tmp_path, replace(beat, busy_since=started) if busy else beat)
    fault = supervisor.fault()
    if watcher_ran:
        assert fault is not None and ("wedged" if busy else "frozen") in fault.what, fault
    else:
        assert fault is None, fault

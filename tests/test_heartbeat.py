"""The stubs' heartbeat as their orphan guard (``specdec.serving.heartbeat``): the logic, without a server.

The server-level behaviour (a SIGKILLed ``specdec serve`` takes its whole tree down) is
``tests/test_supervision.py``; this pins the two ways a stub notices its server is gone.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from specdec.serving import heartbeat


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

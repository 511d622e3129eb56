"""The launcher's side channel and cleanup helpers, without a server (the real-server behaviour is in
``tests/test_lifecycle.py``)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

from specdec.serving import control, processes, server
from specdec.serving.server import loopback


def test_flags_drain_then_abort(tmp_path: Path) -> None:
    ctl = control.Control(tmp_path)
    assert not ctl.draining() and not ctl.aborting()
    ctl.ask(control.DRAIN)
    assert ctl.draining() and not ctl.aborting()
    ctl.ask(control.ABORT)
    assert ctl.draining() and ctl.aborting()
    with pytest.raises(ValueError, match="unknown control flag"):
        ctl.ask("reboot")
    nobody = control.Control(None)  # a plain tritonserver: no launcher, never draining
    assert not nobody.draining() and not nobody.aborting()


def test_the_inflight_gauge_is_summed_over_its_labels() -> None:
    text = (
        "# HELP specdec_inflight_requests requests\n# TYPE specdec_inflight_requests gauge\n"
        'specdec_inflight_requests{model="specdec"} 2\nspecdec_inflight_requests{model="specdec_stream"} 3\n'
        'specdec_inflight_requests_other{model="x"} 7\nnv_inference_count{model="specdec"} 9\n'
    )
    assert control.inflight_from_metrics(text) == 5
    assert control.inflight_from_metrics("nv_inference_count 1\n") is None


def test_only_this_servers_shared_memory_is_removed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(control, "SHM_DIR", tmp_path)
    prefix, other = control.new_shm_prefix(), control.new_shm_prefix()
    assert prefix != other and prefix.startswith(f"specdec_{os.getpid()}_")
    for name in (f"{prefix}1", f"{prefix}2", f"{other}1", "triton_python_backend_shm_region_1"):
        (tmp_path / name).write_bytes(b"x")
    assert [p.name for p in control.remove_shm(prefix)] == [f"{prefix}1", f"{prefix}2"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([f"{other}1", "triton_python_backend_shm_region_1"])
    assert control.remove_shm("") == []  # never everything


def test_this_process_is_alive_and_its_stubs_are_found_by_parent_and_model() -> None:
    assert processes.alive(os.getpid()) and not processes.alive(2**22 + 12345)
    assert processes.stub_pids(os.getpid(), "specdec_engine") == []


@pytest.mark.parametrize(
    "host, local",
    [("127.0.0.1", True), ("localhost", True), ("::1", True), ("0.0.0.0", False), ("::", False), ("10.1.2.3", False)],
)
def test_a_public_bind_is_told_apart(host: str, local: bool) -> None:
    assert loopback(host) is local


def test_a_dead_launchers_directory_reclaimed_by_a_neighbour_first_is_skipped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two launchers starting together both find a dead one's control directory; the one that loses the race to
    remove it must skip it, not crash on its stat (CI: a replica of a balanced pair died that way at startup)."""
    stale = tmp_path / f"{server.CONTROL_DIR_PREFIX}999999-abc"
    stale.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(server, "SHM_DIR", tmp_path / "no-shm")

    def dead_and_reclaimed_meanwhile(pid: int) -> bool:
        stale.rmdir()  # the neighbour removes it between this launcher's glob and its stat
        return False

    monkeypatch.setattr(processes, "alive", dead_and_reclaimed_meanwhile)
    assert server.reclaim_control_directories() == []
    assert not stale.exists()

"""The Triton models' client watchers, without Triton: what they keep alive between polls.

Triton deletes a decoupled request's response factory only when the Python response sender is
destroyed, and the factory holds the model: a watcher that keeps the last client it looked at
keeps its model from unloading (``tritonserver`` then fails its exit timeout).
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable

import pytest

from specdec.serving import triton_models
from specdec.serving.triton_models import CANCEL_POLL_S


class FakeClient:
    """Stands for a ``_Client``: a request that is never cancelled."""

    def is_cancelled(self) -> bool:
        return False


def _released(ref: weakref.ref, timeout_s: float = 30.0) -> bool:
    """Whether the client is released within ``timeout_s``: generous, as a loaded machine may starve the watcher
    thread for seconds, and the answer comes as soon as it is released."""
    deadline = time.monotonic() + timeout_s
    while ref() is not None and time.monotonic() < deadline:
        time.sleep(CANCEL_POLL_S)
    return ref() is None


def _watched_then_dropped(add: Callable[[FakeClient], None], drop: Callable[[], None]) -> weakref.ref:
    client = FakeClient()
    ref = weakref.ref(client)
    add(client)
    del client
    time.sleep(5 * CANCEL_POLL_S)  # polled several times while its request runs
    drop()  # the request ended
    return ref


def test_entry_point_watcher_keeps_no_client_after_its_request(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(triton_models, "dump_threads_on_sigusr1", lambda: None)
    entry = triton_models.StreamModel()
    entry.initialize({"model_config": "{}"})
    try:
        ref = _watched_then_dropped(lambda c: entry._active.__setitem__("e1", c), lambda: entry._active.pop("e1"))
        assert _released(ref), "the watcher still holds the last client it polled"
    finally:
        entry.finalize()
    assert not entry._watcher.is_alive()  # finalize waited for it


def test_engine_watcher_keeps_no_client_after_its_request() -> None:
    class Quiet:  # the services, metrics and entry-point control the watcher polls, with nothing to do
        def cancel(self, request_id: str) -> bool:
            return False

        def expire(self) -> None:
            return None

        def cancels(self) -> list[str]:
            return []

        def update(self, *services: object) -> None:
            return None

    engine = object.__new__(triton_models.EngineModel)
    engine._closing, engine._lock, engine._streams, engine._external = threading.Event(), threading.Lock(), {}, {}
    engine.service = engine.beam_service = engine.metrics = engine._control = Quiet()
    watcher = threading.Thread(target=engine._watch, daemon=True)
    watcher.start()
    try:
        ref = _watched_then_dropped(
            lambda c: engine._streams.__setitem__("r1", triton_models._Stream(c, False, ())),  # type: ignore[arg-type]
            lambda: engine._streams.pop("r1"),
        )
        assert watcher.is_alive(), "the watcher died: the check below would hold vacuously"
        assert _released(ref), "the watcher still holds the last client it polled"
    finally:
        engine._closing.set()
        watcher.join(5)

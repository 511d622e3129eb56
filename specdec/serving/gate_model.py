"""``specdec_ready``: the model whose presence is the server's readiness.

Why a model: Triton has no call by which a Python model could say the server is not ready. Its strict readiness
is false while a model it was asked to load is unloading, loading, or failed its last load. So ``specdec serve``
runs Triton with explicit model control, and the instant the server should stop taking traffic (a drain begins, a
stub died or froze) it raises the ``CLOSED`` flag, unloads this gate and asks to load it again: readiness is false
from the unload on, and stays false because the gate refuses to load while the flag is up. Lowering the flag and
loading the gate makes the server ready again. Readiness turns within milliseconds on HTTP and gRPC alike, while
liveness stays true (a Kubernetes pod that drains is not killed early). As tritonserver 2.51 behaves (held by
tests/test_supervision.py): an unload alone turns readiness false only until the unload is over (about a second), a
failed reload of a loaded model keeps the old one, but an unload followed by a load that fails holds it false with
no gap. It answers no request, and publishes the launcher's counts of restarts and reloads, which survive a restart
in the launcher's hands.
"""

from __future__ import annotations

from typing import Any

from specdec.serving.control import Control
from specdec.serving.diagnostics import dump_threads_on_sigusr1
from specdec.serving.heartbeat import Heartbeat
from specdec.serving.protocol import READY_MODEL
from specdec.serving.triton_io import error_response
from specdec.serving.triton_metrics import SupervisionCounters, release_metrics


class ReadinessGate:
    def initialize(self, args: dict[str, str]) -> None:
        dump_threads_on_sigusr1()
        control = Control.from_env()
        if control.closed():  # what keeps readiness false (module docstring): Triton logs this load as failed
            raise RuntimeError("readiness is held false by specdec serve (a drain, or a repair under way)")
        self.counters = SupervisionCounters(control.counts())
        self.heartbeat = Heartbeat(control.directory, args.get("model_name", READY_MODEL)).start()

    def execute(self, requests: list[Any]) -> list[Any]:
        message = f"{READY_MODEL} is the server's readiness, not a model to infer with: send requests to 'specdec'"
        return [error_response(message) for _ in requests]

    def finalize(self) -> None:
        self.heartbeat.exit_if_orphaned()
        release_metrics()
        self.heartbeat.stop()

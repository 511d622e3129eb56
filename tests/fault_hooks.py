"""Fault hooks a served engine loads from ``$SPECDEC_FAULT_HOOK`` (``fault_hooks:fail_marked``) in the fault tests.

A request marks itself with ``seed=FAULT_SEED`` (greedy requests ignore the seed otherwise), so a test can send
bad and good requests into one batch through the real server and know which must fail.
"""

from __future__ import annotations

from typing import Any

FAULT_SEED = 4242
MESSAGE = "injected fault for a test"


def fail_marked(seq: Any, point: str) -> None:
    """Fail a marked request at its own verification, after its first few tokens (mid-stream)."""
    if point == "verify" and seq.request.sampling.seed == FAULT_SEED and seq.num_generated >= 3:
        raise RuntimeError(MESSAGE)


SLOW_SEED = 4343
SLOW_STEP_S = 0.05


def slow_marked(seq: Any, point: str) -> None:
    """Slow a marked request's steps (``seed=SLOW_SEED``), so a test can act on it while it decodes."""
    if point == "step" and seq.request.sampling.seed == SLOW_SEED:
        import time

        time.sleep(SLOW_STEP_S)

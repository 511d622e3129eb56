"""A failure tied to one request fails that request only (issue 22, observation 4).

Injected through the engine's fault hook (what ``$SPECDEC_FAULT_HOOK`` installs in a served engine): a raise in
that request's target step (a graph that fails on its rows) or in its own verification. The batch-mates must
finish token for token as they do without the bad requests, and the loop must keep serving. A drafter that fails
costs only drafts. The served path (a real tritonserver, INTERNAL for the failed request, the counters) is in
``tests/test_lifecycle.py``.
"""

from __future__ import annotations

import pytest

from specdec.models.loading import tiny_random
from specdec.runtime.backends.torch_backend import TorchBackend
from specdec.runtime.config import EngineConfig
from specdec.runtime.drafters import NgramDrafter
from specdec.runtime.engine import Engine
from specdec.runtime.request import Request, SeqState

PROMPTS = [[1, 2, 3, 1, 2, 3, 1, 2], [5, 6, 7], [9, 9, 9, 9, 9], [4, 3, 2, 1]]


class InjectedFault(RuntimeError):
    pass


def hook(point: str, after: int = 0):
    """Raise at ``point`` for requests named bad-*, once they have ``after`` output tokens."""

    def fault(seq: SeqState, at: str) -> None:
        if at == point and seq.request.request_id.startswith("bad") and seq.num_generated >= after:
            raise InjectedFault(f"injected at {at}")

    return fault


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(
        TorchBackend(tiny_random(seed=9, num_layers=2)), NgramDrafter(), config=EngineConfig(max_batch=8, max_len=96)
    )


def _requests(bad: int) -> list[Request]:
    good = [Request(p, max_tokens=10, request_id=f"good{i}") for i, p in enumerate(PROMPTS)]
    return good + [Request(PROMPTS[i % len(PROMPTS)], max_tokens=10, request_id=f"bad{i}") for i in range(bad)]


@pytest.mark.parametrize("method", ["ar", "ems"])
@pytest.mark.parametrize("point, after", [("step", 0), ("step", 4), ("verify", 6)])
def test_a_request_that_fails_fails_alone(engine: Engine, method: str, point: str, after: int) -> None:
    engine.fault_hook = None
    clean = engine.generate(_requests(0), method).outputs
    engine.fault_hook = hook(point, after)
    try:
        mixed = engine.generate(_requests(2), method).outputs
    finally:
        engine.fault_hook = None
    good, bad = mixed[: len(PROMPTS)], mixed[len(PROMPTS) :]
    assert [o.token_ids for o in good] == [o.token_ids for o in clean]
    assert all(o.error is None for o in good)
    for out in bad:
        assert out.error is not None and "InjectedFault" in out.error and out.finish_reason is None
    # the slots of the failed requests came back: the same engine serves a full batch again, exactly
    assert [o.token_ids for o in engine.generate(_requests(0), method).outputs] == [o.token_ids for o in clean]


def test_a_failing_drafter_costs_drafts_not_answers(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    clean = engine.generate(_requests(0), "ems").outputs
    real = NgramDrafter.propose

    def propose(self, seqs, ks):  # fails whenever a bad request is among the sequences asked
        if any(s.request.request_id.startswith("good1") for s in seqs):
            raise InjectedFault("drafter")
        return real(self, seqs, ks)

    monkeypatch.setattr(NgramDrafter, "propose", propose)
    out = engine.generate(_requests(0), "ems").outputs
    assert [o.token_ids for o in out] == [o.token_ids for o in clean] and not any(o.error for o in out)
    assert out[1].metrics.draft_tokens == 0 and out[0].metrics.draft_tokens > 0

"""Chunked prefill with a token budget per ragged step (issue 22, observation 5).

A long prompt admitted beside running sequences is prefilled over several steps, each spending at most the
budget on it, while the running sequences keep getting a token (or a verified chain, or a beam round) every step.
The answers are the same as with whole-prompt prefill: prefilling in chunks is the same causal computation in
another order.
"""

from __future__ import annotations

import pytest

from specdec.models.loading import tiny_random
from specdec.runtime.backends.torch_backend import TorchBackend
from specdec.runtime.config import EngineConfig
from specdec.runtime.context import MIN_PREFILL_CHUNK
from specdec.runtime.drafters import ModelDrafter, NgramDrafter
from specdec.runtime.engine import Engine
from specdec.runtime.request import BeamParams, Request
from specdec.runtime.sampling import SamplingParams

SHORT = [[1, 2, 3, 1, 2, 3], [5, 6, 7], [9, 9, 9, 9]]
LONG = [(7 * i) % 50 + 3 for i in range(64)]


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(
        TorchBackend(tiny_random(seed=9, num_layers=2)), NgramDrafter(), config=EngineConfig(max_batch=6, max_len=160)
    )


def _run(engine: Engine, budget: int | None, method: str, temperature: float = 0.0):
    engine.reconfigure(prefill_budget=budget)
    try:
        requests = [
            Request(p, max_tokens=12, sampling=SamplingParams(temperature, seed=i), request_id=f"r{i}")
            for i, p in enumerate([*SHORT, LONG])
        ]
        return engine.generate(requests, method)
    finally:
        engine.reconfigure(prefill_budget=None)


@pytest.mark.parametrize("method", ["ar", "ems"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_chunked_prefill_gives_the_same_answers(engine: Engine, method: str, temperature: float) -> None:
    whole = _run(engine, None, method, temperature)
    chunked = _run(engine, 24, method, temperature)
    assert [o.token_ids for o in chunked.outputs] == [o.token_ids for o in whole.outputs]
    # the whole run prefilled all four prompts in its first step; the chunked one spread the long prompt out
    assert whole.run.steps[0].prefill_rows == sum(map(len, [*SHORT, LONG]))
    assert max(s.prefill_rows for s in chunked.run.steps) <= 24
    assert sum(s.prefill_rows for s in chunked.run.steps) == sum(map(len, [*SHORT, LONG]))


def test_a_long_prompt_does_not_stall_the_running_sequences(engine: Engine) -> None:
    """Every step that prefills a chunk of the long prompt also decodes the running ones: no step is all prefill
    once they run, and the long prompt's first token comes after its last chunk."""
    result = _run(engine, MIN_PREFILL_CHUNK, "ar")
    steps = result.run.steps
    chunk_steps = [s for s in steps if s.prefill_rows]
    assert len(chunk_steps) >= len(LONG) // MIN_PREFILL_CHUNK
    assert all(s.real_rows > s.prefill_rows for s in chunk_steps[1:])  # decode rows beside each later chunk
    assert result.outputs[-1].metrics.target_calls == 12  # its own decode steps (+ the one that prefilled its end)


@pytest.fixture(scope="module")
def beam_engine() -> Engine:
    """A target and a different draft model, for ``beam`` and DSBD (whose forests come from a draft model)."""
    drafter = ModelDrafter(TorchBackend(tiny_random(seed=10, num_layers=1)), 16, 160)
    return Engine(
        TorchBackend(tiny_random(seed=9, num_layers=2)),
        drafter,
        config=EngineConfig(max_batch=16, max_len=160, num_draft_tokens=2),
    )


def _run_beams(engine: Engine, budget: int | None, method: str, temperature: float):
    engine.reconfigure(prefill_budget=budget)
    try:
        requests = [
            Request(
                p,
                max_tokens=10,
                sampling=SamplingParams(temperature, seed=i),
                request_id=f"b{i}",
                beam=BeamParams(width=2, num_return_sequences=2),
            )
            for i, p in enumerate([*SHORT, LONG])
        ]
        return engine.generate(requests, method)
    finally:
        engine.reconfigure(prefill_budget=None)


@pytest.mark.parametrize("method", ["beam", "dsbd"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_beam_groups_prefill_in_chunks_with_the_same_answers(
    beam_engine: Engine, method: str, temperature: float
) -> None:
    """A beam or DSBD request with a long prompt prefills in chunks (target and draft cache) beside the rounds of
    the others, and every request's candidates, with their log-likelihoods, are those of whole-prompt prefill."""
    whole = _run_beams(beam_engine, None, method, temperature)
    chunked = _run_beams(beam_engine, 24, method, temperature)

    def answers(result):
        return [[(c.token_ids, round(c.logprob, 5)) for c in o.sequences] for o in result.outputs]

    assert answers(chunked) == answers(whole)
    assert [o.token_ids for o in chunked.outputs] == [o.token_ids for o in whole.outputs]
    assert whole.run.steps[0].prefill_rows == sum(map(len, [*SHORT, LONG]))
    assert max(s.prefill_rows for s in chunked.run.steps) <= 24
    assert sum(s.prefill_rows for s in chunked.run.steps) == sum(map(len, [*SHORT, LONG]))
    chunk_steps = [s for s in chunked.run.steps if s.prefill_rows]
    assert len(chunk_steps) >= len(LONG) // 24 + 1
    assert all(s.real_rows > s.prefill_rows for s in chunk_steps[1:])  # the others' rounds beside each chunk

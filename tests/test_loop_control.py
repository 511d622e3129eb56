"""Loop control, counted: how many target and draft calls the loops make, what k they draft, where they stop.

The backends are scripted (``tests/fakes.py``): the target continues a known sequence and the draft
proposes known right or wrong tokens, so every count here is exact and no torch model runs. These
checks catch an off-by-one in a budget or a stop that a random model's output would hide.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from fakes import ScriptedBackend, counting, wrong_where

from specdec.runtime.config import EngineConfig
from specdec.runtime.drafters import ModelDrafter
from specdec.runtime.engine import Engine, GenerationResult
from specdec.runtime.request import BeamParams

VOCAB = 64
EOS = 63  # unreachable by the counting rule from the prompts below unless a test says so
CHAINS = ("ems", "vanilla")


def make_engine(
    target_rule=None, draft_rule=None, *, k: int = 4, max_len: int = 64, max_batch: int = 4, eos: Sequence[int] = (EOS,)
) -> tuple[Engine, ScriptedBackend, ScriptedBackend]:
    """(engine, target, draft): scripted backends, a model drafter over the draft, token-id prompts only."""
    target = ScriptedBackend(target_rule or counting(VOCAB), VOCAB)
    draft = ScriptedBackend(draft_rule or counting(VOCAB), VOCAB)
    engine = Engine(
        target,
        ModelDrafter(draft, max_batch, max_len),
        eos_token_ids=eos,
        config=EngineConfig(max_batch=max_batch, max_len=max_len, num_draft_tokens=k),
    )
    return engine, target, draft


def run(
    engine: Engine,
    prompts: Sequence[Sequence[int]],
    method: str,
    max_tokens: int | Sequence[int],
    temperature: float = 0.0,
    beam: BeamParams | None = None,
) -> GenerationResult:
    budgets = [max_tokens] * len(prompts) if isinstance(max_tokens, int) else list(max_tokens)
    requests = [
        engine.request(list(p), max_tokens=m, temperature=temperature, seed=i, beam=beam)
        for i, (p, m) in enumerate(zip(prompts, budgets))
    ]
    result = engine.generate(requests, method)
    assert all(o.error is None for o in result.outputs), [o.error for o in result.outputs]
    return result


def continuation(last: int, n: int) -> list[int]:
    return [(last + 1 + i) % VOCAB for i in range(n)]


@pytest.mark.parametrize("method", ["ems", "vanilla", "dsbd", "beam"])
def test_one_token_requests_never_call_the_drafter(method: str) -> None:
    """max_tokens = 1: the prefill's token is the whole answer, so nothing is drafted and one target call runs
    (6 slots: each beam group reserves its width, so all three are admitted together)."""
    engine, target, draft = make_engine(max_batch=6)
    beam = BeamParams(width=2) if method in ("dsbd", "beam") else None
    result = run(engine, [[3, 4], [10], [20, 21, 22]], method, max_tokens=1, beam=beam)
    assert [o.token_ids for o in result.outputs] == [[5], [11], [23]]
    assert draft.calls == 0
    assert target.calls == 1 and target.rows_in(0) == [2, 1, 3]  # one prefill of all three prompts


@pytest.mark.parametrize("method", CHAINS)
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_eos_inside_an_accepted_chain_ends_the_answer_there(method: str, temperature: float) -> None:
    """The target accepts drafts past EOS (it does not know EOS ends the answer); the output stops at EOS
    all the same, and the batch-mate without an EOS keeps decoding."""
    engine, target, _ = make_engine(eos=(12,))
    result = run(engine, [[8], [20]], method, max_tokens=10, temperature=temperature)
    stopped, other = result.outputs
    assert stopped.token_ids == [9, 10, 11, 12] and stopped.finish_reason == "stop"
    assert other.token_ids == continuation(20, 10) and other.finish_reason == "length"
    verified = target.batches[1].input_ids.tolist()
    assert verified[:5] == [9, 10, 11, 12, 13]  # the last token and 4 drafts, one past EOS, all accepted
    assert stopped.metrics.accepted_draft_tokens == 4


@pytest.mark.parametrize("method", CHAINS)
def test_k_is_capped_by_the_remaining_context(method: str) -> None:
    """max_len 14 and a prompt of 10: after the prefill the slot has room for 4 rows, the last token and 3
    drafts (not 4), and the answer ends when the context is full."""
    engine, target, draft = make_engine(k=4, max_len=14)
    result = run(engine, [list(range(10))], method, max_tokens=50)
    assert [target.rows_in(i) for i in range(target.calls)] == [[10], [4]]
    assert result.outputs[0].token_ids == [10, 11, 12, 13] and result.outputs[0].finish_reason == "context"
    assert draft.calls == 3


def test_k_is_capped_by_the_remaining_max_tokens_per_sequence() -> None:
    """Two sequences in one step draft 1 and 4 tokens: each k_i stops one short of its own max_tokens, since
    the target adds a token of its own; each answer is exactly max_tokens long after two target calls."""
    engine, target, draft = make_engine(k=4)
    result = run(engine, [[3, 4], [30, 31]], "ems", max_tokens=[3, 6])
    assert [target.rows_in(i) for i in range(target.calls)] == [[2, 2], [2, 5]]
    assert [o.token_ids for o in result.outputs] == [[5, 6, 7], continuation(31, 6)]
    assert draft.calls == 4  # the deeper chain sets the number of draft steps


@pytest.mark.parametrize("method", CHAINS)
@pytest.mark.parametrize("k", [1, 3, 5])
def test_a_perfect_draft_gets_k_plus_one_tokens_per_target_call(method: str, k: int) -> None:
    steps = 4
    engine, target, draft = make_engine(k=k)
    result = run(engine, [[2]], method, max_tokens=1 + steps * (k + 1))
    out = result.outputs[0]
    assert out.token_ids == continuation(2, 1 + steps * (k + 1))
    assert target.calls == 1 + steps and all(target.rows_in(i) == [k + 1] for i in range(1, target.calls))
    assert [s.accepted_draft_tokens for s in result.run.steps[1:]] == [k] * steps
    assert out.metrics.mean_accepted_length == k + 1
    assert draft.calls == steps * k


@pytest.mark.parametrize("method", CHAINS)
def test_an_always_wrong_draft_gets_exactly_one_token_per_target_call(method: str) -> None:
    """Every draft is rejected at its first token: one token per call, and k shrinks near max_tokens."""
    engine, target, _ = make_engine(draft_rule=counting(VOCAB, stride=2), k=4)
    result = run(engine, [[1]], method, max_tokens=10)
    out = result.outputs[0]
    assert out.token_ids == continuation(1, 10)
    assert target.calls == 10 and out.metrics.accepted_draft_tokens == 0
    # after g generated tokens a step drafts min(4, 10 - g - 1)
    assert [target.rows_in(i)[0] - 1 for i in range(1, 10)] == [4, 4, 4, 4, 4, 3, 2, 1, 0]


def _mixed_rule(context: Sequence[int]) -> int:
    """A target that depends on the whole context (and ends an answer with EOS now and then)."""
    return (7 * sum(context) + 3 * len(context)) % VOCAB


@pytest.mark.parametrize("method", CHAINS)
def test_greedy_speculative_output_equals_ar(method: str) -> None:
    """A draft that is right except at every third position: partial acceptance everywhere, ragged k
    (budgets and context), in-flight admission (6 requests, 3 slots); output is ar's, token for token."""
    draft_rule = wrong_where(_mixed_rule, VOCAB, lambda context: len(context) % 3 == 0)
    prompts = [[1], [5, 9, 2], [40, 41], [7] * 9, [3, 1, 4, 1, 5], [60]]
    budgets = [12, 7, 20, 3, 16, 1]

    def answers(name: str) -> GenerationResult:
        engine, _, _ = make_engine(_mixed_rule, draft_rule, k=3, max_len=24, max_batch=3)
        return run(engine, prompts, name, max_tokens=budgets)

    want, got = answers("ar"), answers(method)
    assert [o.token_ids for o in got.outputs] == [o.token_ids for o in want.outputs]
    assert [o.finish_reason for o in got.outputs] == [o.finish_reason for o in want.outputs]
    summary = got.run.summary()
    assert 0 < summary["accepted_draft_tokens"] < summary["draft_tokens"]

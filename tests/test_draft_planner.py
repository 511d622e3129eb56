"""The draft planner's own contract (``specdec.runtime.draft_planner``), with small fake drafters and no engine: the
fixed null object, what the adaptive planner prices each sequence by, when it plans a batch, and what it learns.

The policy's arithmetic (``DraftLength.choose`` / ``plan``) and decoding with the planner (greedy output equal to
``ar``, the loops' use of it) are ``test_draft_length.py``'s; here only what the planner adds: which sequences
are priced how, with which history, and that a drafter that cannot answer costs only speed.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import pytest

from specdec.runtime.draft_length import POOLED_MEMORY, Candidate, DraftLength, DraftStats
from specdec.runtime.draft_planner import (
    AdaptiveDraftLength,
    ChainStep,
    FixedDraftLength,
    make_planner,
)
from specdec.runtime.drafters import Draft, Drafter
from specdec.runtime.request import Request, SeqState
from specdec.runtime.sampling import SamplingParams

#: drafts that always pay for a sampled sequence (free, priced alone) and never for a greedy one in a batch of 4
BATCH_PRICED = DraftLength(verify_cost=0.0, draft_cost=0.0, verify_by_batch=((1, 0.0), (4, 5.0)), probe_every=1000)


class FakeDrafter:
    """A drafter of one kind that only states its price (the planner never asks it for drafts)."""

    vocab_size = None

    def __init__(self, relative_cost: float = 0.2) -> None:
        self.relative_cost = relative_cost

    def propose(self, seqs: Sequence[SeqState], ks: Sequence[int]) -> list[Draft]:
        raise AssertionError("the planner never drafts")

    def release(self, seq: SeqState) -> None:
        return None

    def reset(self) -> None:
        return None

    def fork(self) -> Drafter:
        return self


class OfferingFake(FakeDrafter):
    """Prompt lookup's question: how many tokens it has for a sequence now (``offers[slot]``, or raises)."""

    def __init__(self, offers: dict[int, int] | Exception) -> None:
        super().__init__(relative_cost=0.0)
        self.offers = offers

    def offer(self, seq: SeqState, k: int) -> int:
        if isinstance(self.offers, Exception):
            raise self.offers
        return self.offers[seq.slot]


class SourcedFake(FakeDrafter):
    """The hybrid's questions: which proposer drafts for a sequence (``sources[slot]``, or raises) and its price
    (lookup: free, its own; the model: None, the calibrated one)."""

    def __init__(self, sources: dict[int, str] | Exception) -> None:
        super().__init__(relative_cost=0.3)
        self.sources = sources

    def source(self, seq: SeqState) -> str:
        if isinstance(self.sources, Exception):
            raise self.sources
        return self.sources[seq.slot]

    def source_cost(self, source: str) -> float | None:
        return 0.0 if source == "lookup" else None


def seq(slot: int, sampled: bool = False) -> SeqState:
    sampling = SamplingParams(temperature=1.0, seed=slot) if sampled else SamplingParams()
    return SeqState.start(Request([1, 2, 3], max_tokens=64, sampling=sampling), slot)


def with_history(s: SeqState, acceptance: float, source: str = "") -> SeqState:
    """``s`` after a long history of drafts accepted at ``acceptance`` at every depth."""
    s.draft_stats[source] = DraftStats([100.0] * 4, [100.0 * acceptance] * 4)
    return s


def step(k_max: Sequence[int], budgets: Sequence[int] | None = None, plan: bool = False) -> ChainStep:
    return ChainStep(list(k_max), list(budgets or [40] * len(k_max)), plan=plan)


# -- the null planner ---------------------------------------------------------------------------------------------


def test_the_fixed_planner_drafts_the_most_each_may_and_learns_nothing() -> None:
    planner = FixedDraftLength()
    seqs = [seq(0), seq(1, sampled=True), seq(2)]
    assert planner.chain_lengths(seqs, step([4, 0, 2], budgets=[3, 9, 1], plan=True)) == [4, 0, 2]
    assert planner.forest_layers(seqs[0], gamma_max=3, rows=2.5) == 3
    planner.record(seqs[0], drafted=4, accepted=1)
    assert all(s.draft_stats == {} and s.draft_source == "" for s in seqs)


def test_an_engine_without_a_policy_gets_the_null_planner() -> None:
    drafter = FakeDrafter()
    assert isinstance(make_planner(None, drafter), FixedDraftLength)
    adaptive = make_planner(DraftLength(), drafter)
    assert isinstance(adaptive, AdaptiveDraftLength) and adaptive.drafter is drafter and adaptive.pooled == {}
    # no drafter (ar, beam): nothing to price, every sequence keeps its k
    assert AdaptiveDraftLength(DraftLength(), None).chain_lengths([seq(0)], step([3])) == [3]


# -- pricing alone, and the plan ----------------------------------------------------------------------------------


def test_greedy_sequences_pay_the_batchs_price_sampled_ones_their_own() -> None:
    """In a step of 4, greedy sequences see batch 4's prohibitive verify price; sampled ones are priced alone (their
    k must not depend on their batch-mates) at the free flat price."""
    planner = AdaptiveDraftLength(BATCH_PRICED, FakeDrafter(relative_cost=0.0))
    seqs = [seq(0), seq(1, sampled=True), seq(2), seq(3, sampled=True)]
    assert planner.chain_lengths(seqs, step([4, 4, 4, 4])) == [0, 4, 0, 4]
    assert planner.chain_lengths(seqs[:1], step([4])) == [4]  # alone, the greedy one pays batch 1's price


def test_a_greedy_sequence_starts_from_the_pooled_acceptance_a_sampled_one_from_the_prior() -> None:
    policy = DraftLength(verify_cost=0.2, probe_every=1000)
    planner = AdaptiveDraftLength(policy, FakeDrafter(relative_cost=0.1))
    assert planner.chain_lengths([seq(0)], step([4])) == [policy.choose(DraftStats(), 4, 0.1, batch=1)] != [0]
    veteran = seq(9)
    for _ in range(40):  # every draft of earlier sequences rejected
        planner.record(veteran, drafted=2, accepted=0)
    fresh_greedy, fresh_sampled = seq(0), seq(1, sampled=True)
    assert planner.chain_lengths([fresh_greedy], step([4])) == [0]
    assert planner.chain_lengths([fresh_sampled], step([4])) == [policy.choose(DraftStats(), 4, 0.1)] != [0]


def test_the_batch_is_planned_only_when_nobody_waits_to_join_it() -> None:
    """A copier (acceptance 0.9) beside an answer no draft speeds up, both 40 tokens from their end: priced alone
    the copier drafts; planned, it does not, since the other sets the batch's length anyway."""
    policy = DraftLength(verify_by_batch=((1, 0.1), (2, 0.2)), probe_every=1000)
    planner = AdaptiveDraftLength(policy, FakeDrafter(relative_cost=0.0))
    seqs = [with_history(seq(0), 0.9), with_history(seq(1), 0.0)]
    alone = planner.chain_lengths(seqs, step([4, 4], plan=False))
    assert alone[0] > 0 and alone[1] == 0
    assert planner.chain_lengths(seqs, step([4, 4], plan=True)) == [0, 0]
    # the other sequence ends first: now the copier is the batch's length and drafts in the plan too
    assert planner.chain_lengths(seqs, step([4, 4], budgets=[40, 5], plan=True))[0] > 0
    # ... unless a prompt still prefilling will outlast it
    waiting = ChainStep([4, 4], [40, 5], waiting=[80], plan=True)
    assert planner.chain_lengths(seqs, waiting) == [0, 0]


def test_a_floor_of_drafts_is_never_planned() -> None:
    """The plan's empty group drafts nothing, which a policy with ``min_k`` forbids: each sequence is priced alone."""
    policy = DraftLength(verify_by_batch=((1, 0.1), (2, 0.2)), probe_every=1000, min_k=1)
    planner = AdaptiveDraftLength(policy, FakeDrafter(relative_cost=0.0))
    seqs = [with_history(seq(0), 0.9), with_history(seq(1), 0.0)]
    assert planner.chain_lengths(seqs, step([4, 4], plan=True)) == planner.chain_lengths(seqs, step([4, 4]))


class RecordingPolicy(DraftLength):
    """A ``DraftLength`` that keeps what ``plan`` was asked."""

    def plan(self, seqs: Sequence[Candidate], batch: int, floor: float = 0.0) -> list[int]:
        self.__dict__.setdefault("asked", []).append((list(seqs), batch, floor))
        return super().plan(seqs, batch, floor)


def test_sampled_sequences_are_never_planned_and_bound_the_batch_instead() -> None:
    policy = RecordingPolicy(verify_by_batch=((1, 0.1), (3, 0.3)), probe_every=1000)
    planner = AdaptiveDraftLength(policy, FakeDrafter(relative_cost=0.0))
    sampled = with_history(seq(1, sampled=True), 0.9)
    seqs = [with_history(seq(0), 0.9), sampled, with_history(seq(2), 0.0)]
    ks = planner.chain_lengths(seqs, step([4, 4, 4], budgets=[40, 30, 40], plan=True))
    (candidates, batch, floor), *_ = policy.asked
    assert len(candidates) == 2 and batch == 3  # the two greedy ones, in a step of three
    assert floor == pytest.approx(30 / policy.rate(sampled.draft_stats[""], ks[1]))  # its steps to go at its k
    assert ks[1] == policy.choose(sampled.draft_stats[""], 4, 0.0)  # as if alone: batch-free prices, no pool


# -- what the drafter can tell: its proposers and its offer -------------------------------------------------------


def test_each_proposer_of_a_drafter_is_priced_and_remembered_by_its_own_history() -> None:
    hybrid = SourcedFake({0: "lookup", 1: "model"})
    planner = AdaptiveDraftLength(DraftLength(verify_cost=0.2, probe_every=1000), hybrid)
    # each sequence's lookups were accepted and its model's drafts rejected: priced by the proposer drafting now
    lookup = with_history(with_history(seq(0), 0.0, source="model"), 0.9, source="lookup")
    model = with_history(with_history(seq(1), 0.9, source="lookup"), 0.0, source="model")
    ks = planner.chain_lengths([lookup, model], step([4, 4]))
    assert (lookup.draft_source, model.draft_source) == ("lookup", "model")
    assert ks[0] > 0 and ks[1] == 0
    planner.record(lookup, drafted=3, accepted=3)  # counted for the proposer its k was chosen for
    assert lookup.draft_stats["lookup"].reached == pytest.approx([96.0, 96.0, 96.0, 95.0])  # faded by 0.95, + 1
    assert lookup.draft_stats["model"].reached == [100.0] * 4
    assert planner.pooled["lookup"].reached == [1.0, 1.0, 1.0] and planner.pooled["model"].reached == []
    # a sequence that may not draft this step is not asked for its proposer
    idle = seq(2)
    planner.chain_lengths([idle], step([0]))
    assert idle.draft_source == ""


def test_an_offer_caps_k_and_is_counted_for_the_sequence_and_the_pool() -> None:
    planner = AdaptiveDraftLength(DraftLength(verify_cost=0.0, probe_every=1000), OfferingFake({0: 2, 1: 0, 2: 9}))
    seqs = [with_history(seq(s), 1.0) for s in range(3)]
    assert planner.chain_lengths(seqs, step([4, 4, 4])) == [2, 0, 4]  # at most the offer, never above k_max
    assert [(s.draft_stats[""].asked, s.draft_stats[""].offered) for s in seqs] == [(1, 1), (1, 0), (1, 1)]
    pooled, m = planner.pooled[""], POOLED_MEMORY  # every sequence's, in order, faded by the pool's memory
    assert (pooled.asked, pooled.offered) == pytest.approx((m * m + m + 1, m * m + 1))


@pytest.mark.parametrize(
    "drafter,question",
    [
        (SourcedFake(RuntimeError("no source")), "could not tell the proposer"),
        (OfferingFake(RuntimeError("no offer")), "could not tell what it offers"),
    ],
)
def test_a_drafter_that_cannot_answer_costs_only_speed(
    drafter: Drafter, question: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Its sequences are priced as for a drafter of one kind that offers its whole k; the step goes on."""
    policy = DraftLength(verify_cost=0.0, probe_every=1000)
    planner = AdaptiveDraftLength(policy, drafter)
    seqs = [with_history(seq(0), 1.0), with_history(seq(1, sampled=True), 1.0)]
    with caplog.at_level(logging.ERROR, logger="specdec.runtime.draft_planner"):
        ks = planner.chain_lengths(seqs, step([3, 3]))
    assert ks == [3, 3] and all(s.draft_source == "" for s in seqs)
    assert question in caplog.text and seqs[0].request.request_id in caplog.text
    assert seqs[0].draft_stats[""].asked == 0  # an offer nobody answered is not counted


# -- forests and learning -----------------------------------------------------------------------------------------


def test_a_forest_chooses_its_layers_at_batch_free_prices() -> None:
    policy = DraftLength(verify_cost=0.1, verify_by_batch=((1, 5.0),), probe_every=1000)
    planner = AdaptiveDraftLength(policy, FakeDrafter(relative_cost=0.1))
    group = with_history(seq(0), 0.8)
    for rows in (0.5, 1.0, 4.0):
        want = policy.choose(group.draft_stats[""], 3, 0.1, rows=rows)
        assert planner.forest_layers(group, gamma_max=3, rows=rows) == want
    assert planner.forest_layers(group, 3, rows=0.5) > planner.forest_layers(group, 3, rows=4.0)


def test_a_verification_updates_the_sequences_history_and_the_pool() -> None:
    planner = AdaptiveDraftLength(DraftLength(memory=0.5), FakeDrafter())
    first, second = seq(0), seq(1)
    planner.record(first, drafted=3, accepted=1)
    assert (first.draft_stats[""].reached, first.draft_stats[""].accepted) == ([1, 1, 0], [1, 0, 0])
    planner.record(second, drafted=1, accepted=1)
    assert second.draft_stats[""].reached == [1] and first.draft_stats[""].reached == [1, 1, 0]  # its own only
    # the pool holds both, faded by the pool's slower memory; a sequence's history by the policy's
    assert planner.pooled[""].reached == pytest.approx([POOLED_MEMORY * 1 + 1, POOLED_MEMORY, 0])
    planner.record(first, drafted=1, accepted=0)
    assert first.draft_stats[""].reached == pytest.approx([0.5 + 1, 0.5, 0])
    planner.record(first, drafted=0, accepted=0)  # a step without drafts: only the wait for a probe grows
    assert first.draft_stats[""].idle == 1 and first.draft_stats[""].reached == pytest.approx([1.5, 0.5, 0])

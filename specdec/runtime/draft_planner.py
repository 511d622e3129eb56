"""The draft planner: one object that chooses each sequence's draft length (EMS-SD's k, DSBD's γ) and learns from
its verifications, so the decoding loops read as the papers' steps and ask it one question per step.

``FixedDraftLength`` is the null object: every sequence drafts the most it may (its request's k, capped by its
budget), and nothing is recorded. ``AdaptiveDraftLength`` prices each sequence's k from its own acceptance by depth
(``draft_length.DraftLength``), per proposer of a drafter with several (``drafters.SourcedDrafter``), pools the
verifications of every sequence as a greedy sequence's prior, probes sequences that stopped drafting, and plans a
batch nobody waits to join so that it ends soonest (``DraftLength.plan``). Why an object beside the loops and not
inside them: the policy is most of the code and none of the algorithm; greedy output never depends on k, and a
sampled sequence's k depends on its own past only, so the planner changes speed, never an answer.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from specdec.runtime.draft_length import POOLED_MEMORY, Candidate, DraftLength, DraftStats
from specdec.runtime.drafters import Drafter, OfferingDrafter, SourcedDrafter
from specdec.runtime.request import SeqState

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ChainStep:
    """What the planner knows of a step of chains besides its sequences.

    ``k_max[i]``: the most sequence i may draft now (its request's k within its ``max_tokens`` and its KV slot's
    room). ``budgets[i]``: the tokens it may still generate. ``waiting``: ``max_tokens`` (within the context) of
    each prompt admitted but still prefilling. ``plan``: the batch may be planned as a whole: nobody waits to join
    it (a ``generate`` call, not a server, and no request queued), so its throughput is its tokens over the time its
    last sequence takes.
    """

    k_max: Sequence[int]
    budgets: Sequence[int]
    waiting: Sequence[int] = ()
    plan: bool = False


class DraftPlanner(Protocol):
    """Chooses draft lengths and records what verification made of them."""

    def chain_lengths(self, seqs: Sequence[SeqState], step: ChainStep) -> list[int]:
        """k per sequence of a step of chains, each at most ``step.k_max``."""
        ...

    def forest_layers(self, seq: SeqState, gamma_max: int, rows: float) -> int:
        """DSBD's γ for a beam group this round, at most ``gamma_max``; ``rows``: draft and verified rows one layer
        adds per live beam of the round."""
        ...

    def record(self, seq: SeqState, drafted: int, accepted: int) -> None:
        """``seq``'s verification: the first ``accepted`` of ``drafted`` drafts (or layers) passed."""
        ...


class FixedDraftLength:
    """The null planner: every sequence drafts its most, and nothing is learnt."""

    def chain_lengths(self, seqs: Sequence[SeqState], step: ChainStep) -> list[int]:
        return list(step.k_max)

    def forest_layers(self, seq: SeqState, gamma_max: int, rows: float) -> int:
        return gamma_max

    def record(self, seq: SeqState, drafted: int, accepted: int) -> None:
        return None


class AdaptiveDraftLength:
    """Each sequence drafts what its own acceptance says pays, at ``policy``'s prices.

    ``pooled``: every sequence's verifications per draft source, kept across runs of one engine (a greedy
    sequence's prior acceptance; "" = a drafter of one kind, ``SeqState.draft_source``).
    """

    def __init__(self, policy: DraftLength, drafter: Drafter | None) -> None:
        self.policy, self.drafter = policy, drafter
        self.pooled: dict[str, DraftStats] = {}
        # what the drafter can tell the policy, asked once: a runtime-checkable Protocol's isinstance walks its
        # members, too slow to ask per sequence and step (benchmarks/results/runtime_choices.md)
        self._sourced = drafter if isinstance(drafter, SourcedDrafter) else None
        self._offering = drafter if isinstance(drafter, OfferingDrafter) else None

    # -- chains ---------------------------------------------------------------------------------------------------
    def chain_lengths(self, seqs: Sequence[SeqState], step: ChainStep) -> list[int]:
        """Greedy sequences at the prices of a step of ``len(seqs)`` (their output does not depend on k), sampled
        ones alone; with ``step.plan`` the greedy ones are planned together to end the batch soonest. Why not in a
        server: there each request waits for its own answer only, and the newest request always has the most to
        go, so planned, the others would stop drafting whenever one arrived."""
        offers = []
        for seq, k_max in zip(seqs, step.k_max):
            seq.draft_source = self._source(self._sourced, seq) if self._sourced is not None and k_max > 0 else ""
            offers.append(self._offer(seq, k_max))
        if self.drafter is None:
            return list(step.k_max)
        if not step.plan or self.policy.min_k > 0:  # the plan's empty group drafts nothing: below a floor of k
            return self._priced_alone(seqs, offers)
        try:
            return self._planned(seqs, step, offers)
        except Exception:  # a plan that fails costs only speed: each sequence is priced alone, as in a server
            log.exception("planning the draft lengths of %d sequences failed; pricing each alone", len(seqs))
            return self._priced_alone(seqs, offers)

    def _priced_alone(self, seqs: Sequence[SeqState], offers: Sequence[int]) -> list[int]:
        return [
            self._choose(seq, k, greedy_batch=len(seqs) if seq.request.sampling.greedy else None)
            for seq, k in zip(seqs, offers)
        ]

    def _planned(self, seqs: Sequence[SeqState], step: ChainStep, offers: Sequence[int]) -> list[int]:
        """The greedy sequences by ``DraftLength.plan``, the sampled ones alone as always (their k must not depend
        on batch-mates); those and the prompts still prefilling bound the batch's length (``floor``: a prompt at
        one token a step)."""
        policy = self.policy
        ks, floor = list(offers), float(max(step.waiting, default=0))
        candidates, planned = [], []
        for i, seq in enumerate(seqs):
            stats, cost, own_price, prior = self._pricing(seq, greedy=seq.request.sampling.greedy)
            if not seq.request.sampling.greedy:
                ks[i] = policy.choose(stats, offers[i], cost, prior=prior, own_price=own_price)
                floor = max(floor, step.budgets[i] / policy.rate(stats, ks[i]))
                continue
            pooled = _history(self.pooled, seq.draft_source)
            candidates.append(
                Candidate(
                    stats,
                    step.k_max[i],
                    cost,
                    step.budgets[i],
                    own_price,
                    prior,
                    k_now=offers[i],
                    offer_rate=policy.offer_rate(stats, policy.offer_rate(pooled)),
                )
            )
            planned.append(i)
        for i, k in zip(planned, policy.plan(candidates, len(seqs), floor)):
            ks[i] = k
        return ks

    # -- forests --------------------------------------------------------------------------------------------------
    def forest_layers(self, seq: SeqState, gamma_max: int, rows: float) -> int:
        """A layer passes or not, as a chain's draft is accepted or not: the same policy, over layers. Batch- and
        history-independent prices (a beam request samples, and its law must not depend on its batch)."""
        return self._choose(seq, gamma_max, rows=rows)

    # -- learning -------------------------------------------------------------------------------------------------
    def record(self, seq: SeqState, drafted: int, accepted: int) -> None:
        """Counted for the proposer the k was chosen for (``seq.draft_source``), in the sequence's own faded
        history and in the engine's pool."""
        _history(seq.draft_stats, seq.draft_source).record(drafted, accepted, self.policy.memory)
        _history(self.pooled, seq.draft_source).record(drafted, accepted, POOLED_MEMORY)

    # -- what the policy prices by --------------------------------------------------------------------------------
    def _choose(self, seq: SeqState, k_max: int, rows: float = 1.0, greedy_batch: int | None = None) -> int:
        stats, cost, own_price, prior = self._pricing(seq, greedy=greedy_batch is not None)
        return self.policy.choose(stats, k_max, cost, rows, batch=greedy_batch, prior=prior, own_price=own_price)

    def _pricing(self, seq: SeqState, greedy: bool) -> tuple[DraftStats, float, bool, float | None]:
        """``seq``'s history for the proposer drafting now, that proposer's own price of a token (and whether it is
        its own: a hybrid's lookup), and its prior (greedy: the pooled acceptance)."""
        source = seq.draft_source
        prior = self.policy.pooled_prior(_history(self.pooled, source)) if greedy else None
        own = self._sourced.source_cost(source) if source and self._sourced is not None else None
        cost = own if own is not None else getattr(self.drafter, "relative_cost", 0.0)
        return _history(seq.draft_stats, source), cost, own is not None, prior

    def _offer(self, seq: SeqState, k: int) -> int:
        """At most ``k``: fewer where the drafter can tell it has fewer to offer ``seq`` now, so the policy does not
        price drafts that will not come; counted for the plan's ``offer_rate``. A drafter that cannot tell costs
        only speed."""
        if k <= 0 or self._offering is None:
            return k
        try:
            offer = max(0, min(k, self._offering.offer(seq, k)))
        except Exception:
            log.exception(
                "the drafter could not tell what it offers request %r; pricing it for k=%d", seq.request.request_id, k
            )
            return k
        _history(seq.draft_stats, seq.draft_source).note_offer(offer > 0, self.policy.memory)
        _history(self.pooled, seq.draft_source).note_offer(offer > 0, POOLED_MEMORY)
        return offer

    @staticmethod
    def _source(drafter: SourcedDrafter, seq: SeqState) -> str:
        """The proposer that would draft for ``seq`` ("" for a drafter of one kind); one that cannot tell is priced
        and counted as a drafter of one kind."""
        try:
            return drafter.source(seq)
        except Exception:
            log.exception(
                "the drafter could not tell the proposer for request %r; pricing it as one drafter",
                seq.request.request_id,
            )
            return ""


def make_planner(policy: DraftLength | None, drafter: Drafter | None) -> DraftPlanner:
    """The planner an engine runs: adaptive with a policy, else the fixed null object."""
    return FixedDraftLength() if policy is None else AdaptiveDraftLength(policy, drafter)


def _history(table: dict[str, DraftStats], source: str) -> DraftStats:
    """Proposer ``source``'s acceptance history in ``table`` (a sequence's, or the pooled one), made on first use."""
    return table.setdefault(source, DraftStats())

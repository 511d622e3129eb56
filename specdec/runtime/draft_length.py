"""Adaptive draft length: each sequence drafts the k its own acceptance history says pays most.

Why: a draft token pays only when it is accepted often enough to cover what it costs, its
draft step and its row in the verification. On a CPU a verified row costs a tenth to a quarter
of a one-row target step (``benchmarks/results/draft_pair.md``), and acceptance differs from
request to request: an answer that copies its prompt accepts far more than a free-form one. So
no fixed k suits every sequence: the best fixed k of that benchmark changes with the workload
and the batch size, and a k that is too long makes speculation slower than ``ar``. EMS-SD
already lets every sequence draft its own k_i at no padding cost, so k can be chosen per
sequence.

The choice: with ``beta_j`` the sequence's rate of acceptance at depth j given the j-1 drafts
before it were accepted, k drafts yield ``1 + sum_{j<=k} prod_{i<=j} beta_i`` tokens per step
and cost ``1 + k * (draft_cost + verify_cost)`` one-row target steps; the policy takes the k
with the most tokens per cost. Each ``beta_j`` is the sequence's own count, shrunk toward the
rate one depth shallower (``prior_acceptance`` at depth 1), so a short history or a depth never
drafted yet does not swing k.

Batch size: what a draft costs depends on how many sequences share the step. A step's fixed
part (weights read, per-op overhead) is shared by its sequences, while a verified row is paid by
the one that drafts it; so relative to a sequence's share of a one-row step, a row costs more the
larger the batch (SmolLM2 int4 on this CPU: 0.13 of a step at batch 1, 0.33 at 4, 0.39 at 8: the
exports' calibration in ``benchmarks/results/edge_cpu.md``). Priced by one number, the policy
drafts too little alone and too much in a full batch, where ``ems`` fell behind ``ar``. With prices
calibrated per batch size
(``verify_by_batch``, ``draft_by_batch``) a greedy sequence is priced at its step's batch size.

Exactness: k is fixed before the drafts are drawn and depends only on the sequence's own past
(and, for a greedy one, on how many sequences share the step, or in a planned batch, ``plan``, on
its batch-mates' budgets and histories), and verification is exact for any such k. Greedy output
is unchanged whatever k is, so pricing it by the batch changes only speed.
A sampled sequence's drafts consume its random draws, so its k must not depend on batch-mates: it
is priced at the batch-independent price, and a seeded request gives the same output alone and in
any batch.

Prior: a sequence that has verified nothing yet drafts by ``prior_acceptance`` (0.5), whatever the
drafter; a drafter that rarely agrees with the target pays for those first drafts on every request,
which on short answers is much of what it drafts at all (the main job's). A greedy sequence (again:
k changes only speed) starts instead from the acceptance the engine has pooled over the sequences
before it (``pooled_prior``), so a new request drafts as the drafter has been doing lately.

Proposers: the hybrid drafter copies from the context where it can and asks its draft model
elsewhere. Its two proposals differ in price (a lookup is free, a model token costs a draft step)
and in acceptance (a lookup in quoted text is accepted far more often), so each sequence keeps a
history per proposer, the k is chosen from the one that will draft this step at that one's price
(``drafters.SourcedDrafter``), and the pooled prior is per proposer too. Priced as one drafter, the
hybrid drafted lookups too short and the model too long, and at batches 4 and 8 fell behind both
prompt lookup alone and ``ar`` (``benchmarks/results/runtime_choices.md``).
"""

from __future__ import annotations

import argparse
import bisect
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

#: a price per batch size: ((batch size, price), ...), batch sizes increasing
BatchPrices = tuple[tuple[int, float], ...]
#: how much of the pooled acceptance (``DraftLength.pooled_prior``) each verification of any sequence keeps: about
#: the last 200 verifications count, a few dozen steps of a full batch
POOLED_MEMORY = 0.995
#: the calibration's keys (``costs.DraftCosts.as_dict``, an export's manifest) of the prices per batch size
VERIFY_BY_BATCH, DRAFT_BY_BATCH = "verify_cost_by_batch", "draft_cost_by_batch"


def price_at(prices: BatchPrices, batch: int) -> float:
    """The price at ``batch``: linear between the measured batch sizes, the nearest one's outside them."""
    sizes = [b for b, _ in prices]
    i = bisect.bisect_left(sizes, batch)
    if i < len(sizes) and sizes[i] == batch:
        return prices[i][1]
    if i == 0:
        return prices[0][1]
    if i == len(sizes):
        return prices[-1][1]
    (b0, p0), (b1, p1) = prices[i - 1], prices[i]
    return p0 + (p1 - p0) * (batch - b0) / (b1 - b0)


def prices_text(prices: BatchPrices) -> str:
    """``"1:0.13,4:0.41"``: prices per batch size as a config parameter holds them (``parse_prices``)."""
    return ",".join(f"{b}:{p:g}" for b, p in prices)


def parse_prices(text: str) -> BatchPrices:
    """The inverse of ``prices_text`` ("" is no prices); ValueError names what is malformed."""
    try:
        pairs = [item.split(":") for item in text.split(",") if item.strip()]
        return batch_prices([(int(b), float(p)) for b, p in pairs])
    except ValueError as exc:
        raise ValueError(f"prices per batch size must read 'batch:price,...', got {text!r}: {exc}") from None


def batch_prices(pairs: Iterable[Sequence[float]] | None) -> BatchPrices:
    """A ``BatchPrices`` from (batch size, price) pairs as a manifest keeps them (JSON lists), checked."""
    out = tuple(sorted((int(b), float(p)) for b, p in (pairs or ())))
    if any(b < 1 or not p >= 0 for b, p in out) or len({b for b, _ in out}) != len(out):
        raise ValueError(f"prices per batch size need distinct batch sizes >= 1 and prices >= 0, got {list(out)}")
    return out


@dataclass
class DraftStats:
    """One sequence's verification history by draft depth (index 0 = the first draft of a step).

    ``reached[j]``: drafts at depth j+1 that were verified with every draft before them accepted
    (the only ones whose fate says something about depth j+1); ``accepted[j]``: those accepted.
    Counts fade by ``memory`` per verification, so they describe the text the sequence is in now.
    """

    reached: list[float] = field(default_factory=list)
    accepted: list[float] = field(default_factory=list)
    idle: int = 0  # steps since the last one with a draft
    misses: int = 0  # verifications in a row whose drafts were all rejected
    #: steps the sequence could have drafted, and those of them its drafter had tokens to offer (prompt lookup:
    #: a match), faded by the same memory; ``DraftLength.offer_rate``
    asked: float = 0.0
    offered: float = 0.0

    def note_offer(self, offered: bool, memory: float = 1.0) -> None:
        """One step in which the sequence could draft: whether its drafter had anything to offer
        (``drafters.OfferingDrafter``)."""
        self.asked = memory * self.asked + 1.0
        self.offered = memory * self.offered + float(offered)

    def record(self, drafted: int, accepted: int, memory: float = 1.0) -> None:
        """One verification: ``drafted`` drafts, of which the first ``accepted`` were accepted.

        Steps without drafts say nothing about acceptance and fade nothing.
        """
        if not 0 <= accepted <= drafted:
            raise ValueError(f"need 0 <= accepted <= drafted, got {accepted} of {drafted}")
        self.idle = 0 if drafted else self.idle + 1
        if not drafted:
            return
        self.misses = 0 if accepted else self.misses + 1
        if memory != 1.0:
            self.reached = [memory * n for n in self.reached]
            self.accepted = [memory * n for n in self.accepted]
        grow = drafted - len(self.reached)
        if grow > 0:
            self.reached.extend([0.0] * grow)
            self.accepted.extend([0.0] * grow)
        for j in range(min(drafted, accepted + 1)):
            self.reached[j] += 1
        for j in range(accepted):
            self.accepted[j] += 1


@dataclass(frozen=True)
class DraftLength:
    """The per-sequence draft-length policy; costs are in units of one one-row target step.

    ``draft_cost``: one draft token (None: the drafter's own ``relative_cost``, 0 for prompt
    lookup). ``verify_cost``: one more verified row per sequence. ``prior_acceptance`` and
    ``prior_weight``: the depth-1 rate assumed before any verification, worth that many
    observations. ``memory``: how much of its history a sequence keeps per verification
    (0.95: about the last 20 count), so k follows a text that turns from free-form to copied.
    ``min_k``: the shortest draft (0: a sequence whose drafts do not pay stops drafting).
    ``probe_every``: a sequence that stopped drafts one token again after that many steps
    without, so it notices when its text turns predictable (a list it starts to copy);
    otherwise its estimate, and its k, could never change again. ``probe_backoff``: each probe in
    a row that got nothing accepted doubles that wait, up to ``probe_every * 2**probe_backoff``
    steps (8 to 64 by default); an accepted draft resets it. Why: a probe costs a verified row,
    and for a draft model also the draft steps that catch its cache up, so on this CPU a
    sequence that probes every 8 steps in text its drafter cannot predict loses a few percent
    against ``ar`` (``benchmarks/results/edge_cpu.md``); backed off, about half a percent.
    ``verify_by_batch`` / ``draft_by_batch``: the same prices per batch size (module docstring), used
    for greedy sequences; each replaces its flat price there when given. ``fixed_by_batch``: the share of a
    step that no one sequence adds, per batch size (``fixed_shares``), for ``plan``.
    """

    draft_cost: float | None = None
    verify_cost: float = 0.15
    prior_acceptance: float = 0.5
    prior_weight: float = 2.0
    memory: float = 0.95
    min_k: int = 0
    probe_every: int = 8
    probe_backoff: int = 3
    verify_by_batch: BatchPrices = ()
    draft_by_batch: BatchPrices = ()
    fixed_by_batch: BatchPrices = ()

    def __post_init__(self) -> None:
        for name in ("verify_by_batch", "draft_by_batch", "fixed_by_batch"):
            object.__setattr__(self, name, batch_prices(getattr(self, name)))
        if any(share > 1.0 for _, share in self.fixed_by_batch):
            raise ValueError(f"a fixed share of a step is at most 1, got {list(self.fixed_by_batch)}")
        if self.draft_cost is not None and self.draft_cost < 0:
            raise ValueError(f"draft_cost must be >= 0, got {self.draft_cost}")
        if self.verify_cost < 0:
            raise ValueError(f"verify_cost must be >= 0, got {self.verify_cost}")
        if not 0.0 <= self.prior_acceptance <= 1.0:
            raise ValueError(f"prior_acceptance must be in [0, 1], got {self.prior_acceptance}")
        if self.prior_weight <= 0:
            raise ValueError(f"prior_weight must be > 0, got {self.prior_weight}")
        if not 0.0 < self.memory <= 1.0:
            raise ValueError(f"memory must be in (0, 1], got {self.memory}")
        if self.min_k < 0:
            raise ValueError(f"min_k must be >= 0, got {self.min_k}")
        if self.probe_every < 1:
            raise ValueError(f"probe_every must be >= 1, got {self.probe_every}")
        if self.probe_backoff < 0:
            raise ValueError(f"probe_backoff must be >= 0, got {self.probe_backoff}")

    def pooled_prior(self, pooled: DraftStats) -> float:
        """The depth-1 acceptance pooled over earlier sequences (``DraftStats`` of every verification), shrunk
        toward ``prior_acceptance``: a greedy sequence's prior."""
        return self.rates(pooled, 1)[0]

    def rates(self, stats: DraftStats, depth: int, prior: float | None = None) -> list[float]:
        """``beta_1..beta_depth``, each shrunk toward the one before (the first toward ``prior``, by default
        ``prior_acceptance``)."""
        prior, out = (self.prior_acceptance if prior is None else prior), []
        for j in range(depth):
            reached = stats.reached[j] if j < len(stats.reached) else 0
            accepted = stats.accepted[j] if j < len(stats.accepted) else 0
            prior = (accepted + self.prior_weight * prior) / (reached + self.prior_weight)
            out.append(prior)
        return out

    def prices(self, drafter_cost: float, batch: int | None = None, own_price: bool = False) -> tuple[float, float]:
        """(a draft token, a verified row) in one-row target steps: at ``batch`` sequences where prices per batch
        size were measured, else the flat ones (``draft_cost``, else the drafter's own ``drafter_cost``).
        ``own_price``: the draft token costs ``drafter_cost`` whatever was calibrated (a hybrid's lookups: the
        calibration priced its model)."""
        draft = self.draft_cost if self.draft_cost is not None and not own_price else drafter_cost
        verify = self.verify_cost
        if batch is not None:
            draft = price_at(self.draft_by_batch, batch) if self.draft_by_batch and not own_price else draft
            verify = price_at(self.verify_by_batch, batch) if self.verify_by_batch else verify
        return draft, verify

    def choose(
        self,
        stats: DraftStats,
        k_max: int,
        draft_cost: float,
        rows: float = 1.0,
        batch: int | None = None,
        prior: float | None = None,
        own_price: bool = False,
    ) -> int:
        """The k in ``[min(min_k, k_max), k_max]`` with the most expected tokens per unit of cost (ties: shorter).

        ``draft_cost``: the drafter's own price of a draft token (used where the policy has none).
        ``rows``: draft and verified rows one unit of k adds per sequence of the step (1 for a chain;
        for a DSBD layer, W_S nodes over the group's live beams). ``batch``: the sequences sharing the
        step, for a greedy sequence (prices per batch size); None: the batch-independent prices. ``prior``:
        the depth-1 rate before any verification (a greedy sequence's ``pooled_prior``; None:
        ``prior_acceptance``). ``own_price``: ``draft_cost`` is the token's price whatever was calibrated
        (``prices``). A choice of 0 becomes 1 once the sequence has gone ``probe_every`` steps
        without a draft (doubled per fruitless probe in a row, up to ``probe_backoff`` times).
        """
        return self._best(stats, k_max, sum(self.prices(draft_cost, batch, own_price)) * rows, prior)[0]

    def offer_rate(self, stats: DraftStats, prior: float = 1.0) -> float:
        """The share of steps in which the sequence's drafter has tokens to offer, shrunk toward ``prior`` (a greedy
        sequence: the pooled share) like the acceptance rates."""
        return (stats.offered + self.prior_weight * prior) / (stats.asked + self.prior_weight)

    def rate(self, stats: DraftStats, k: int, prior: float | None = None) -> float:
        """Expected tokens per step of a sequence that drafts ``k``: 1 + sum_{j<=k} prod_{i<=j} beta_i."""
        return self._expected(stats, k, prior)[-1]

    def _best(
        self, stats: DraftStats, k_max: int, per_draft: float, prior: float | None, probe: bool = True
    ) -> tuple[int, float]:
        """``choose``'s k at ``per_draft`` (one unit of k's price, in the step's units), with its ``rate``;
        ``probe``: a probe that is due replaces a choice of 0."""
        expected = self._expected(stats, max(0, k_max), prior)
        if k_max <= self.min_k:
            return max(0, k_max), expected[-1]
        best_k, best_rate = self._pick(expected, k_max, per_draft)
        if probe and best_k == 0 and self._probe_due(stats):
            return 1, expected[1]
        return best_k, best_rate

    def _expected(self, stats: DraftStats, k_max: int, prior: float | None) -> list[float]:
        """``rate`` for k = 0..k_max."""
        out, survive = [1.0], 1.0
        for beta in self.rates(stats, k_max, prior):
            survive *= beta
            out.append(out[-1] + survive)
        return out

    def _pick(self, expected: Sequence[float], k_max: int, per_draft: float) -> tuple[int, float]:
        """The k in ``[min_k, k_max]`` (0 when ``min_k`` is 0) with the most ``expected[k]`` per cost, and its
        rate (ties: shorter)."""
        best_k, best, best_rate = (0, 1.0, 1.0) if self.min_k == 0 else (-1, -1.0, 1.0)
        for k in range(max(1, self.min_k), k_max + 1):
            value = expected[k] / (1.0 + k * per_draft)
            if value > best * (1 + 1e-9):
                best_k, best, best_rate = k, value, expected[k]
        return best_k, best_rate

    def _probe_due(self, stats: DraftStats) -> bool:
        """Whether a sequence that stopped drafting has waited long enough to try one draft again (``choose``)."""
        return stats.idle >= self.probe_every << min(stats.misses, self.probe_backoff)

    def plan(self, seqs: Sequence[Candidate], batch: int, floor: float = 0.0) -> list[int]:
        """k per greedy sequence of a batch no request waits to join, chosen to end the batch soonest.

        Why: with nobody waiting for a slot, the batch's throughput is its tokens over the time until its last
        sequence finishes, and a step's time is shared. A sequence that would finish before the slowest one even
        without drafting cannot end the batch sooner by drafting; its drafts only lengthen every step for the
        others (in the edge benchmark's batches of 4 and 8, the prompt lookups of answers that copy their
        prompt, while the free-form answer beside them set the batch's length: ``ems`` fell behind ``ar``,
        ``benchmarks/results/runtime_choices.md``). And a sequence the batch waits for
        gains a whole step of the batch from each accepted token, not its share of one.

        What a step costs: the part of it no sequence adds (``fixed_share``: weights read, per-op overhead) for
        as long as the batch lasts, and each sequence's own share for as long as *it* lasts. So a sequence that
        finishes sooner by drafting frees its share of every later step, which pays for free lookups even when
        another sequence sets the batch's length (extractive answers at batch 8; ``runtime_choices.md``).
        A draft model's proposals get no such credit: they are priced as if their sequence stayed to the end,
        since their saving did not cover the draft steps and the catch-up of the draft's cache (measured there);
        nor does anyone where the shares were not measured (``fixed_share``).

        How: only a group of the sequences with the most tokens still to go drafts (``Candidate.budget``;
        sequences with equal budgets go together, since leaving one out leaves the batch as long). A group of c
        of the step's ``batch`` sequences pays c/batch of what every sequence drafting a verified row costs
        (``prices``; the draft step keeps the whole batch's price, an upper bound for a smaller batch), and each
        member drafts the k that pays most at that price. The batch lasts ``max(budget / rate)`` steps over the
        group and the budgets left out, at least ``floor`` (sequences that are not planned: sampled ones,
        prompts still prefilling). The plan takes the group, none included, with the least expected time; an
        empty group is ``ar``, so the plan drafts only where drafting is expected to end the batch sooner, and
        where a sequence alone in its batch is due to probe. Greedy output does not depend on k, so the plan
        changes only speed. Budgets count ``max_tokens``, not an end of sequence nobody can foresee: a batch
        whose answers end early is planned as if they ran to their limit.
        """
        budgets = [s.budget for s in seqs]
        order = sorted(range(len(seqs)), key=lambda i: -budgets[i])
        # what does not depend on the group's size, once per sequence: its prices at the step's batch and its
        # expected tokens per step for every k
        priced = [self.prices(seq.draft_cost, batch, seq.own_price) for seq in seqs]
        expected = [self._expected(seq.stats, max(seq.k_max, 0), seq.prior) for seq in seqs]
        fixed = self.fixed_share(batch)
        credited = fixed < 1.0  # sequences that end sooner free their share (free lookups only, below)
        own_share = (1.0 - fixed) / batch  # a sequence's share of a step of the whole batch

        def batch_time(horizon: float, steps: Sequence[float], drafting: float) -> float:
            """In steps of the whole batch: the fixed part over the batch's length, each sequence's share over its
            own steps, and the drafts."""
            return fixed * max(floor, horizon) + own_share * sum(steps) + drafting

        best_total, best_ks = batch_time(max(budgets, default=0.0), budgets, 0.0), [0] * len(seqs)
        for size in _group_sizes([budgets[i] for i in order]):
            ks, steps = [0] * len(seqs), [float(b) for b in budgets]
            horizon = budgets[order[size]] if size < len(seqs) else 0.0
            drafting = lasting = 0.0  # drafts priced per step of their own sequence / of the whole batch
            for i in order[:size]:
                seq, (draft, verify) = seqs[i], priced[i]
                per_draft = draft + verify * size / batch
                # the sequence's steps: at the rate it keeps over the steps to come, where its drafter has something
                # to offer in ``offer_rate`` of them; this step: what it has now
                k, rate = self._pick(expected[i], max(seq.k_max, 0), per_draft)
                own_steps = seq.budget / (1.0 + seq.offer_rate * (rate - 1.0))
                horizon = max(horizon, own_steps)
                ks[i] = k if seq.k_now >= seq.k_max else self._pick(expected[i], seq.k_now, per_draft)[0]
                if draft > 0 or not credited:
                    lasting += ks[i] * per_draft / size
                else:
                    steps[i] = own_steps
                    drafting += own_steps * ks[i] * per_draft / size
            total = batch_time(horizon, steps, drafting) + max(floor, horizon) * lasting
            if total < best_total * (1 - 1e-9):
                best_total, best_ks = total, ks
        # alone in its batch a sequence still probes when due, as ``choose`` has it do: its text may turn
        # predictable, and at the price of its first draft a probe would never pay. Beside others it does not:
        # a probe lengthens every sequence's step, tied sequences fall due in the same step, and a draft model's
        # probe first catches its cache up over every token since it last drafted (measured in the edge benchmark
        # and in-process: benchmarks/results/runtime_choices.md)
        alone = seqs[0] if batch == 1 and len(seqs) == 1 and seqs[0].budget >= floor else None
        if alone is not None and best_ks[0] == 0 and alone.k_now > 0 and self._probe_due(alone.stats):
            best_ks[0] = 1
        return best_ks

    def fixed_share(self, batch: int) -> float:
        """The share of a step of ``batch`` sequences that no one sequence adds (``fixed_by_batch``), 1 where not
        measured: then every sequence is priced as if it stayed to the batch's end.

        Not extrapolated past the largest measured batch: there the verified row's price is the largest
        measured one too, below what a row costs in the larger batch, and credited lookups drafted at 40 %
        acceptance (w8a8, chat, batch 16 on an export calibrated up to 8: ``runtime_choices.md``).
        """
        if not self.fixed_by_batch or batch > self.fixed_by_batch[-1][0]:
            return 1.0
        return min(1.0, max(0.0, price_at(self.fixed_by_batch, batch)))


@dataclass(frozen=True)
class Candidate:
    """What ``DraftLength.plan`` knows of one greedy sequence: its history and prices as ``choose`` takes them;
    ``budget``, the tokens it may still generate (``max_tokens`` and its KV slot's room); ``k_now``, the most its
    drafter offers this step (at most ``k_max``, the most it may draft); ``offer_rate``, how often its drafter has
    something to offer (``DraftLength.offer_rate``)."""

    stats: DraftStats
    k_max: int
    draft_cost: float
    budget: int
    own_price: bool = False
    prior: float | None = None
    k_now: int = -1  # -1: k_max
    offer_rate: float = 1.0

    def __post_init__(self) -> None:
        if self.k_now < 0:
            object.__setattr__(self, "k_now", self.k_max)


#: the most group sizes ``DraftLength.plan`` weighs (each prices every member once): a batch of many distinct
#: budgets is planned at sizes spread over it
MAX_GROUP_SIZES = 12


def _group_sizes(budgets_descending: Sequence[int]) -> list[int]:
    """The group sizes ``plan`` weighs: prefixes of the sequences by budget that do not split equal budgets."""
    n = len(budgets_descending)
    sizes = [c for c in range(1, n + 1) if c == n or budgets_descending[c - 1] != budgets_descending[c]]
    if len(sizes) <= MAX_GROUP_SIZES:
        return sizes
    step = (len(sizes) - 1) / (MAX_GROUP_SIZES - 1)
    return sorted({sizes[round(j * step)] for j in range(MAX_GROUP_SIZES)})


def fixed_shares(measured: Mapping[str, Any]) -> BatchPrices:
    """The share of a plain step that does not grow with its sequences, per calibrated batch size (``plan``).

    From a calibration's plain step times (``costs.DraftCosts.as_dict``: ``batch_sizes``, ``plain_ms``): the
    least-squares line ``f + c * B`` through them, and ``f / (f + c * B)`` at each B, within [0, 1]. Empty with
    fewer than two batch sizes (a line needs two), which ``plan`` reads as "every sequence lasts the batch".
    """
    sizes, times = measured.get("batch_sizes") or [], measured.get("plain_ms") or []
    points = sorted({int(b): float(t) for b, t in zip(sizes, times)}.items())
    if len(points) < 2:
        return ()
    slope, fixed = (float(x) for x in np.polyfit([b for b, _ in points], [t for _, t in points], 1))
    return batch_prices(
        [
            (b, round(min(1.0, max(0.0, fixed / (fixed + slope * b))) if fixed + slope * b > 0 else 1.0, 4))
            for b, _ in points
        ]
    )


def _cost(text: str) -> float:
    """A cost flag's value: a number >= 0 (refused at parsing, before an export writes anything)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def add_draft_length_args(parser: argparse.ArgumentParser) -> None:
    """The adaptive draft length's options, the same on ``specdec generate`` and ``specdec-export``."""
    parser.add_argument(
        "--adaptive-draft",
        action="store_true",
        help="each sequence drafts the k (ems) or γ (dsbd), at most --num-draft-tokens or the "
        "request's, that its own acceptance says pays most",
    )
    parser.add_argument(
        "--verify-cost",
        type=_cost,
        default=None,
        help="--adaptive-draft: a verified row per sequence, in target steps (default: measured by "
        f"--calibrate or at export, else {DraftLength.verify_cost}; CPU ~0.15, GPU ~0)",
    )
    parser.add_argument(
        "--draft-cost",
        type=_cost,
        default=None,
        help="--adaptive-draft: a draft token, in target steps (default: measured by --calibrate "
        "or at export, else the drafter's estimate: 0.1 for a draft model, 0 for prompt lookup)",
    )
    parser.add_argument(
        "--calibrate",
        action="store_true",
        help="--adaptive-draft: measure both costs on this machine's backends first (seconds); "
        "--verify-cost / --draft-cost still win",
    )


def check_draft_length_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse cost options that would be ignored (they price the adaptive draft length only)."""
    if not args.adaptive_draft:
        given = [
            flag
            for flag, value in (
                ("--calibrate", args.calibrate),
                ("--verify-cost", args.verify_cost),
                ("--draft-cost", args.draft_cost),
            )
            if value not in (None, False)
        ]
        if given:
            parser.error(f"{', '.join(given)} price(s) the adaptive draft length: add --adaptive-draft")


def draft_length_from(args: argparse.Namespace, measured: Mapping[str, Any] | None = None) -> DraftLength | None:
    """The policy those options ask for (None: a fixed k); ``measured``: costs calibrated on this hardware.

    A cost given on the command line wins over a measured one (flat and per batch size alike), and a
    measured one over the default. The measured draft prices per batch size go with the measured flat
    one: a caller that drops ``draft_cost`` (prompt lookup's tokens cost nothing) drops them too. The
    plain steps' fixed shares (``fixed_shares``) come from the measured step times whatever the flags say.
    """
    if not args.adaptive_draft:
        return None
    measured = measured or {}
    verify = args.verify_cost if args.verify_cost is not None else measured.get("verify_cost")
    draft = args.draft_cost if args.draft_cost is not None else measured.get("draft_cost")
    return DraftLength(
        verify_cost=DraftLength.verify_cost if verify is None else float(verify),
        draft_cost=None if draft is None else float(draft),
        verify_by_batch=batch_prices(measured.get(VERIFY_BY_BATCH)) if args.verify_cost is None else (),
        draft_by_batch=batch_prices(measured.get(DRAFT_BY_BATCH))
        if args.draft_cost is None and measured.get("draft_cost") is not None
        else (),
        fixed_by_batch=fixed_shares(measured),
    )

"""Decoding loops: ``ar`` (baseline), ``vanilla`` (padded speculative baseline), ``ems`` (EMS-SD).

Each loop reads top to bottom: admit → draft → one target ragged step → verify → commit
KV and outputs → retire finished sequences. The bookkeeping they share (admission, the
target call and its metrics, acceptance, stop checks, streaming callbacks) lives in
``DecodeContext`` so each loop shows only what makes it different.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from specdec.runtime.backends.base import Backend
from specdec.runtime.draft_length import POOLED_MEMORY, Candidate, DraftLength, DraftStats
from specdec.runtime.drafters import Draft, Drafter, OfferingDrafter, SourcedDrafter
from specdec.runtime.kv import KVCacheManager
from specdec.runtime.metrics import RunMetrics, StepRecord
from specdec.runtime.packed import SeqWork, pack
from specdec.runtime.request import CANCELLED, CONTEXT, SeqState, StopChecker
from specdec.runtime.sampling import next_token, verify_greedy, verify_sampling, warp
from specdec.runtime.scheduler import Scheduler

TokenCallback = Callable[[SeqState, list[int]], None]
#: fault injection for tests: called with a sequence and the point it is at ("step", "verify"); raising there is a
#: failure that belongs to that sequence alone (a served engine installs one only from $SPECDEC_FAULT_HOOK)
FaultHook = Callable[[SeqState, str], None]
log = logging.getLogger(__name__)
MIN_PREFILL_CHUNK = 16  # rows a prompt still prefilling gets in a step whose budget the other rows used up


@dataclass
class DecodeContext:
    """Everything a loop needs besides its own control flow."""

    target: Backend
    kv: KVCacheManager
    scheduler: Scheduler
    stopper: StopChecker
    drafter: Drafter | None = None
    num_draft_tokens: int = 4
    on_tokens: TokenCallback | None = None  # called with each sequence's newly appended tokens
    on_finish: Callable[[SeqState], None] | None = None
    keep_running: Callable[[], bool] | None = None  # serving: wait for work instead of returning
    #: ``ar`` only: the target logits each sampled token was drawn from (distillation records them)
    on_logits: Callable[[SeqState, np.ndarray], None] | None = None
    #: serving: whether a caller gave up on a sequence; every loop asks it when it retires sequences (after each
    #: step or round), so a cancelled sequence ends there, whether or not it streamed anything
    is_cancelled: Callable[[SeqState], bool] | None = None
    #: adaptive draft length: each sequence's k from its own acceptance, at most the k above (None: always that k)
    draft_length: DraftLength | None = None
    #: every sequence's verifications pooled per draft source (the engine's, kept across runs; "" = a drafter of one
    #: kind, ``SeqState.draft_source``): a greedy sequence's prior acceptance
    pooled_drafts: dict[str, DraftStats] = field(default_factory=dict)
    run: RunMetrics = field(default_factory=lambda: RunMetrics("?"))
    fault_hook: FaultHook | None = None
    #: rows a ragged step may spend on prompt prefills (None: every admitted prompt whole, in its first step).
    #: A long prompt is then prefilled in chunks over several steps beside the running sequences' decode and
    #: verification rows, so it delays their next tokens by one bounded step per chunk, not by its whole prefill
    prefill_budget: int | None = None

    def __post_init__(self) -> None:
        # what the drafter can tell the policy, asked once: a runtime-checkable Protocol's isinstance walks its
        # members (~80 us a step at batch 1 when asked per sequence and step)
        self._sourced = isinstance(self.drafter, SourcedDrafter)
        self._offering = isinstance(self.drafter, OfferingDrafter)

    def has_work(self, live: Sequence[SeqState]) -> bool:
        if live or self.scheduler.pending():
            return True
        while self.keep_running is not None and self.keep_running():
            if self.scheduler.wait_for_work(timeout=0.1):
                return True
        return False

    def admit(self, live: Sequence[SeqState]) -> list[SeqState]:
        return self.scheduler.admit(self.kv, len(live))

    def draft_lengths(self, seqs: Sequence[SeqState], waiting: Sequence[SeqState] | None = None) -> list[int]:
        """k_i per sequence: its requested k, capped so it never drafts past max_tokens or the context, chosen by
        the adaptive policy per sequence or planned over the batch.

        With an adaptive ``draft_length`` that k is the most a sequence drafts; the policy picks
        k_i from the sequence's own acceptance so far, a greedy sequence at the prices of a step of
        ``len(seqs)`` sequences (``draft_length``: its output does not depend on k). ``waiting``: the
        sequences admitted but still prefilling (ems); given, in a call that returns when all its requests are
        done (``generate``, not a server's loop) and with no request waiting for a slot, the greedy sequences are
        planned together to end the batch soonest (``DraftLength.plan``). A server's requests each wait for their
        own answer only, and the newest request always has the most to go: planned, the others would stop
        drafting whenever one arrives.
        """
        k_maxes, offers = [], []
        sourced = self.draft_length is not None and self._sourced
        for seq in seqs:
            room = self.kv.room(seq.slot) - 1  # rows written: last token + k drafts
            k_max = max(0, min(self.draft_budget(seq, seq.num_generated), room))
            seq.draft_source = self._source(seq) if sourced and k_max > 0 else ""
            k_maxes.append(k_max)
            offers.append(self._offer(seq, k_max))
        if self.draft_length is None or self.drafter is None:
            return k_maxes
        if (
            waiting is None or self.keep_running is not None or self.scheduler.pending() or self.draft_length.min_k > 0
        ):  # the plan's empty group drafts nothing: below a floor of k
            return self._priced_alone(seqs, offers)
        try:
            return self._planned(seqs, k_maxes, offers, waiting)
        except Exception:  # a plan that fails costs only speed: each sequence is priced alone, as in a server
            log.exception("planning the draft lengths of %d sequences failed; pricing each alone", len(seqs))
            return self._priced_alone(seqs, offers)

    def _priced_alone(self, seqs: Sequence[SeqState], offers: Sequence[int]) -> list[int]:
        """``draft_lengths`` per sequence: a greedy one at the prices of the step's batch, a sampled one alone."""
        return [
            self.choose_draft_length(seq, k, greedy_batch=len(seqs) if seq.request.sampling.greedy else None)
            for seq, k in zip(seqs, offers)
        ]

    def _planned(
        self, seqs: Sequence[SeqState], k_maxes: Sequence[int], offers: Sequence[int], waiting: Sequence[SeqState]
    ) -> list[int]:
        """``draft_lengths`` of a batch nobody waits to join: the greedy sequences by ``DraftLength.plan``, the
        sampled ones alone as always (their k must not depend on batch-mates); those and the prompts still
        prefilling bound the batch's length (``floor``: a prompt at one token a step)."""
        policy = self.draft_length
        assert policy is not None
        ks, floor = (
            list(offers),
            max((min(s.request.max_tokens, self.kv.max_len - s.num_prompt) for s in waiting), default=0),
        )
        candidates, planned = [], []
        for i, seq in enumerate(seqs):
            stats, cost, own_price, prior = self._pricing(seq, greedy=seq.request.sampling.greedy)
            if not seq.request.sampling.greedy:
                ks[i] = policy.choose(stats, offers[i], cost, prior=prior, own_price=own_price)
                floor = max(floor, self._budget(seq) / policy.rate(stats, ks[i]))
                continue
            pooled = _history(self.pooled_drafts, seq.draft_source)
            candidates.append(
                Candidate(
                    stats,
                    k_maxes[i],
                    cost,
                    self._budget(seq),
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

    def _budget(self, seq: SeqState) -> int:
        """Tokens ``seq`` may still generate: to ``max_tokens`` or its KV slot's end, whichever comes first."""
        return max(0, min(seq.request.max_tokens - seq.num_generated, self.kv.room(seq.slot)))

    def draft_budget(self, seq: SeqState, generated: int) -> int:
        """The most ``seq`` may draft now, chain tokens or forest layers alike: its requested k (or the engine's),
        never past ``max_tokens``, since one token of every step always comes from the target.

        ``generated``: output tokens so far (a beam group counts its beams' common length). Where the drafts
        must also fit the KV slot, the caller lowers it further by its own shape (k rows, or W_S rows a layer).
        """
        k = self.num_draft_tokens if seq.request.num_draft_tokens is None else seq.request.num_draft_tokens
        return max(0, min(k, seq.request.max_tokens - generated - 1))

    def retire_cancelled(self, seq: SeqState) -> bool:
        """Whether the caller gave up on ``seq``; if so it ends now with ``CANCELLED`` (the one cancellation path)."""
        if self.is_cancelled is None or not self.is_cancelled(seq):
            return False
        seq.finish_reason = CANCELLED
        return True

    def choose_draft_length(self, seq: SeqState, k_max: int, rows: float = 1.0, greedy_batch: int | None = None) -> int:
        """``k_max``, or with an adaptive ``draft_length`` what ``seq``'s own history says pays (chains and forests).

        ``rows``: draft and verified rows one unit of k adds per sequence of the step (a DSBD layer: W_S per beam).
        ``greedy_batch``: for a greedy sequence, the step's sequences: it is priced at that batch size and starts
        from the pooled acceptance (``draft_length``: its output does not depend on k); None: batch- and
        history-independent, as a sampled sequence must be. A hybrid drafter's sequence is priced and counted
        per proposer (``seq.draft_source``, set by ``draft_lengths``; ``drafters.SourcedDrafter``).
        """
        if self.draft_length is None:
            return k_max
        stats, cost, own_price, prior = self._pricing(seq, greedy=greedy_batch is not None)
        return self.draft_length.choose(stats, k_max, cost, rows, batch=greedy_batch, prior=prior, own_price=own_price)

    def _pricing(self, seq: SeqState, greedy: bool) -> tuple[DraftStats, float, bool, float | None]:
        """What the policy prices ``seq`` by: its history for the proposer drafting now, that proposer's own price
        of a token (and whether it is its own: a hybrid's lookup), and its prior (greedy: the pooled acceptance)."""
        assert self.draft_length is not None
        source = seq.draft_source
        prior = self.draft_length.pooled_prior(_history(self.pooled_drafts, source)) if greedy else None
        own = self.drafter.source_cost(source) if source and self._sourced else None  # type: ignore[union-attr]
        cost = own if own is not None else getattr(self.drafter, "relative_cost", 0.0)
        return _history(seq.draft_stats, source), cost, own is not None, prior

    def record_drafts(self, seq: SeqState, drafted: int, accepted: int) -> None:
        """``seq``'s verification, for the adaptive draft length: ``accepted`` of ``drafted`` (in order) passed,
        counted for the proposer its k was chosen for (``seq.draft_source``)."""
        memory = 1.0 if self.draft_length is None else self.draft_length.memory
        _history(seq.draft_stats, seq.draft_source).record(drafted, accepted, memory)
        _history(self.pooled_drafts, seq.draft_source).record(drafted, accepted, POOLED_MEMORY)

    def _offer(self, seq: SeqState, k: int) -> int:
        """At most ``k``: fewer where the drafter can tell it has fewer to offer ``seq`` now (``OfferingDrafter``),
        so the policy does not price drafts that will not come; counted for the plan's ``offer_rate``. A drafter
        that cannot tell costs only speed."""
        if k <= 0 or self.draft_length is None or not self._offering:
            return k
        try:
            offer = max(0, min(k, self.drafter.offer(seq, k)))
        except Exception:
            log.exception(
                "the drafter could not tell what it offers request %r; pricing it for k=%d", seq.request.request_id, k
            )
            return k
        _history(seq.draft_stats, seq.draft_source).note_offer(offer > 0, self.draft_length.memory)
        _history(self.pooled_drafts, seq.draft_source).note_offer(offer > 0, POOLED_MEMORY)
        return offer

    def _source(self, seq: SeqState) -> str:
        """The proposer that would draft for ``seq`` ("" for a drafter of one kind). A drafter that cannot tell
        costs only speed: the sequence is priced and counted as by a drafter of one kind."""
        try:
            return self.drafter.source(seq)  # type: ignore[union-attr]  # a SourcedDrafter (draft_lengths checks)
        except Exception:
            log.exception(
                "the drafter could not tell the proposer for request %r; pricing it as one drafter",
                seq.request.request_id,
            )
            return ""

    def propose(
        self, seqs: Sequence[SeqState], ks: Sequence[int] | None = None, waiting: Sequence[SeqState] | None = None
    ) -> tuple[list[Draft], float]:
        """Drafts for ``seqs``, with the time choosing their k took (``draft_lengths``, ``waiting`` passed on). A
        drafter that raises costs only speed: each sequence is asked alone, and one whose own drafting fails
        verifies no drafts this step (exact either way: drafts never change an answer)."""
        if self.drafter is None or not seqs:
            return [Draft([]) for _ in seqs], 0.0
        start = time.perf_counter()
        ks = self.draft_lengths(seqs, waiting) if ks is None else ks
        try:
            drafts = self.drafter.propose(seqs, ks)
        except Exception:
            log.exception("drafting %d sequences failed; drafting each alone", len(seqs))
            drafts = [self._propose_alone(seq, k) for seq, k in zip(seqs, ks)]
        return drafts, time.perf_counter() - start

    def _propose_alone(self, seq: SeqState, k: int) -> Draft:
        assert self.drafter is not None
        try:
            return self.drafter.propose([seq], [k])[0]
        except Exception:
            log.exception("drafting for request %r failed; it verifies no drafts this step", seq.request.request_id)
            return Draft([])

    def fail(self, seq: SeqState, exc: BaseException) -> None:
        """End ``seq`` alone with an internal error (``retire`` frees its slot); the traceback goes to the log."""
        log.error("request %r failed", seq.request.request_id, exc_info=exc)
        seq.error = f"internal error: {type(exc).__name__}: {exc}"

    @contextlib.contextmanager
    def isolated(self, seq: SeqState) -> Iterator[None]:
        """Per-sequence work (verification, commit, emit): an exception fails ``seq`` only."""
        try:
            yield
        except Exception as exc:
            self.fail(seq, exc)

    def step_isolated(
        self,
        seqs: Sequence[SeqState],
        work: Sequence[SeqWork],
        real_rows: int,
        prefill_rows: int,
        draft_tokens: int,
        draft_seconds: float = 0.0,
    ) -> list[np.ndarray | None]:
        """``target_step`` in which a failure that belongs to one sequence fails that sequence only.

        A step of several sequences that raises runs again one sequence at a time: each retry rewrites the same
        uncommitted cache rows of its own slot, so a survivor ends the step exactly as the whole step would have
        left it, and only the sequences whose own step raises fail (``None`` rows). ``seqs[i]`` owns ``work[i]``.
        """
        try:
            self._fault(seqs, "step")
            return list(
                self.target_step(
                    work,
                    real_rows=real_rows,
                    prefill_rows=prefill_rows,
                    draft_tokens=draft_tokens,
                    draft_seconds=draft_seconds,
                )
            )
        except Exception as exc:
            if len(work) == 1:
                self.fail(seqs[0], exc)
                return [None]
            log.warning(
                "a target step of %d sequences failed (%s: %s); running them one at a time",
                len(work),
                type(exc).__name__,
                exc,
            )
        rows: list[np.ndarray | None] = []
        for seq, item in zip(seqs, work):
            prefill = len(item.token_ids) if item.past_len == 0 else 0
            try:
                self._fault([seq], "step")
                rows.append(
                    self.target_step(
                        [item],
                        real_rows=len(item.token_ids),
                        prefill_rows=prefill,
                        draft_tokens=len(item.token_ids) - 1 if not prefill else 0,
                    )[0]
                )
            except Exception as exc:
                self.fail(seq, exc)
                rows.append(None)
        return rows

    def _fault(self, seqs: Sequence[SeqState], point: str) -> None:
        if self.fault_hook is not None:
            for seq in seqs:
                self.fault_hook(seq, point)

    def target_step(
        self,
        work: Sequence[SeqWork],
        real_rows: int,
        prefill_rows: int,
        draft_tokens: int,
        draft_seconds: float = 0.0,
        cache_mask: np.ndarray | None = None,
        active: int | None = None,
    ) -> list[np.ndarray]:
        """Run one packed target call; returns each work item's logits rows."""
        batch = pack(work, cache_mask)
        rows_before = self.target.rows_processed
        start = time.perf_counter()
        logits = self.target.step(batch, self.kv.storage)
        self.run.steps.append(
            StepRecord(
                batch_size=batch.num_seqs,
                rows=self.target.rows_processed - rows_before,
                real_rows=real_rows,
                prefill_rows=prefill_rows,
                draft_tokens=draft_tokens,
                accepted_draft_tokens=0,
                seconds=time.perf_counter() - start,
                draft_seconds=draft_seconds,
                active=active,
            )
        )
        return np.split(logits, np.cumsum([len(w.logit_offsets()) for w in work])[:-1])

    def count_call(self, seq: SeqState) -> None:
        """Record that ``seq`` took part in the last target step (and with how many others)."""
        seq.metrics.target_calls += 1
        seq.metrics.batch_size_sum += self.run.steps[-1].batch_size

    def prefill_work(self, seq: SeqState) -> SeqWork:
        return SeqWork(seq.slot, 0, seq.request.prompt_ids, logits="last")

    def prefill_chunks(self, filling: Sequence[SeqState], rows_used: int) -> list[SeqWork]:
        """This step's prefill work for the sequences still prefilling, in admission order.

        Without a ``prefill_budget``: each whole prompt (what remains of it). With one: chunks that fill what the
        step's other ``rows_used`` rows leave of the budget, and never less than ``MIN_PREFILL_CHUNK`` rows for
        the first one, so a prompt always advances. Only a prompt's last chunk asks for logits (its first token).
        """
        work = []
        budget = None if self.prefill_budget is None else max(self.prefill_budget - rows_used, MIN_PREFILL_CHUNK)
        for seq in filling:
            done = self.kv.length(seq.slot)
            rest = seq.num_prompt - done
            n = rest if budget is None else min(rest, budget)
            if n <= 0:
                break
            work.append(
                SeqWork(seq.slot, done, seq.request.prompt_ids[done : done + n], logits="last" if n == rest else "none")
            )
            if budget is not None:
                budget -= n
        return work

    def prefilled(self, seq: SeqState, item: SeqWork, logits: np.ndarray) -> bool:
        """Commit a prefill chunk; after the prompt's last one emit the first token. Whether the prompt is done."""
        if item.logits == "none":
            self.kv.commit(seq.slot, len(item.token_ids))
            return False
        self.start(seq, logits)
        return True

    def start(self, seq: SeqState, logits: np.ndarray) -> None:
        """After the prompt's prefill (or its last chunk): commit it and emit the first token."""
        self.kv.commit(seq.slot, seq.num_prompt - self.kv.length(seq.slot))
        self.count_call(seq)
        self.next_from(seq, logits[-1])

    def next_from(self, seq: SeqState, logits: np.ndarray) -> None:
        """Emit the one token the target's ``logits`` give (greedy or sampled)."""
        self._fault([seq], "verify")
        if self.on_logits is not None:
            self.on_logits(seq, logits)
        self.emit(seq, [next_token(logits, seq.request.sampling, seq.generator)])

    def verify(self, seq: SeqState, draft: Draft, logits: np.ndarray) -> list[int]:
        """Accepted drafts + one target token, from logits after [last, *drafts]."""
        self._fault([seq], "verify")
        params = seq.request.sampling
        if params.greedy:
            tokens = verify_greedy(draft.tokens, np.argmax(logits, axis=-1).tolist())
        else:
            tokens = verify_sampling(draft.tokens, draft.probs, warp(logits, params), seq.generator)
        accepted = len(tokens) - 1
        self.count_call(seq)
        seq.metrics.draft_tokens += len(draft.tokens)
        seq.metrics.accepted_draft_tokens += accepted
        self.record_drafts(seq, len(draft.tokens), accepted)
        self.run.steps[-1].accepted_draft_tokens += accepted
        return tokens

    def emit(self, seq: SeqState, tokens: Sequence[int]) -> None:
        appended = self.stopper.append(seq, tokens)
        self.run.generated_tokens += len(appended)
        if self.on_tokens is not None and appended:
            self.on_tokens(seq, appended)

    def retire(self, seqs: Sequence[SeqState]) -> list[SeqState]:
        """Free the slots of finished sequences; return the live ones."""
        live = []
        for seq in seqs:
            if not seq.finished and not self.retire_cancelled(seq):
                live.append(seq)
                continue
            self.kv.free(seq.slot)
            if self.drafter is not None:
                self.drafter.release(seq)
            if self.on_finish is not None:
                self.on_finish(seq)
        return live


def _history(table: dict[str, DraftStats], source: str) -> DraftStats:
    """Proposer ``source``'s acceptance history in ``table`` (a sequence's, or the pooled one), made on first use."""
    return table.setdefault(source, DraftStats())


def ar(ctx: DecodeContext) -> RunMetrics:
    """Batched autoregressive decoding with in-flight admission: one new token per sequence per step."""
    ctx.run.method = "ar"
    live: list[SeqState] = []
    filling: list[SeqState] = []  # admitted, prompt not fully prefilled yet (chunked prefill)
    while ctx.has_work(live + filling):
        filling += ctx.admit(live + filling)
        work = [SeqWork(s.slot, ctx.kv.length(s.slot), [s.tokens[-1]]) for s in live]
        chunks = ctx.prefill_chunks(filling, len(work))
        prompt_rows = sum(len(c.token_ids) for c in chunks)
        rows = ctx.step_isolated(
            live + filling[: len(chunks)],
            work + chunks,
            real_rows=len(live) + prompt_rows,
            prefill_rows=prompt_rows,
            draft_tokens=0,
        )
        for seq, logits in zip(live, rows):
            if logits is not None:
                with ctx.isolated(seq):
                    ctx.kv.commit(seq.slot, 1)
                    ctx.count_call(seq)
                    ctx.next_from(seq, logits[0])
        live, filling = _prefill_done(ctx, live, filling, chunks, rows[len(live) :])
    return ctx.run


def _prefill_done(
    ctx: DecodeContext,
    live: list[SeqState],
    filling: list[SeqState],
    chunks: Sequence[SeqWork],
    rows: Sequence[np.ndarray | None],
) -> tuple[list[SeqState], list[SeqState]]:
    """After a step: commit its prefill chunks, move prompts prefilled in full to the live sequences, retire.

    Returns (live, still prefilling); a prompt whose chunk failed is retired with its error.
    """
    started = []
    for seq, item, logits in zip(filling, chunks, rows):
        if logits is not None:
            with ctx.isolated(seq):
                if ctx.prefilled(seq, item, logits):
                    started.append(seq)
    waiting = [s for s in filling if s not in started]
    gone = [s for s in waiting if s.finished or ctx.retire_cancelled(s)]  # failed or cancelled mid-prefill
    ctx.retire(gone)
    return ctx.retire(live + started), [s for s in waiting if s not in gone]


def ems(ctx: DecodeContext) -> RunMetrics:
    """EMS-SD: ragged drafts, ragged acceptance, no padding anywhere, in-flight admission.

    Each live sequence feeds its last token plus its own k_i drafts at its own past length;
    newly admitted prompts are prefilled in the same packed call. After verification each
    sequence commits exactly 1 + a_i cache positions (a chain needs no compaction); the
    rejected drafts' K/V beyond that are never read and are overwritten next step.
    """
    ctx.run.method = "ems"
    live: list[SeqState] = []
    filling: list[SeqState] = []  # admitted, prompt not fully prefilled yet (chunked prefill)
    while ctx.has_work(live + filling):
        filling += ctx.admit(live + filling)
        drafts, draft_seconds = ctx.propose(live, waiting=filling)
        work = [SeqWork(s.slot, ctx.kv.length(s.slot), [s.tokens[-1], *d.tokens]) for s, d in zip(live, drafts)]
        num_drafts = sum(len(d.tokens) for d in drafts)
        chunks = ctx.prefill_chunks(filling, len(live) + num_drafts)
        prompt_rows = sum(len(c.token_ids) for c in chunks)
        rows = ctx.step_isolated(
            live + filling[: len(chunks)],
            work + chunks,
            real_rows=len(live) + num_drafts + prompt_rows,
            prefill_rows=prompt_rows,
            draft_tokens=num_drafts,
            draft_seconds=draft_seconds,
        )
        for seq, draft, logits in zip(live, drafts, rows):
            if logits is not None:
                with ctx.isolated(seq):
                    tokens = ctx.verify(seq, draft, logits)
                    ctx.kv.commit(seq.slot, len(tokens))  # last token + accepted drafts
                    ctx.emit(seq, tokens)
        live, filling = _prefill_done(ctx, live, filling, chunks, rows[len(live) :])
    return ctx.run


def vanilla(ctx: DecodeContext) -> RunMetrics:
    """The papers' padded multi-sample baseline, kept to measure what EMS-SD saves.

    Static batches: a batch is admitted, prefilled, and decoded until all of it finishes;
    a finished sequence stays in the batch and keeps computing padding rows (dropping it
    is one of EMS-SD's own ideas). Every sequence feeds 1 + max_i k_i rows (drafts padded
    to the batch max), and every write position advances by the batch's largest accepted
    length, leaving masked holes in the caches of the sequences that accepted less. Holes
    are still read by attention.
    """
    ctx.run.method = "vanilla"
    while ctx.has_work([]):
        batch = ctx.admit([])
        prompt_rows = sum(s.num_prompt for s in batch)
        rows = ctx.target_step(
            [ctx.prefill_work(s) for s in batch], real_rows=prompt_rows, prefill_rows=prompt_rows, draft_tokens=0
        )
        for seq, logits in zip(batch, rows):
            ctx.start(seq, logits)
        while live := [s for s in batch if not s.finished]:
            min_room = min(ctx.kv.room(s.slot) for s in live)  # padded rows must fit every slot
            ks = [min(k, min_room - 1) for k in ctx.draft_lengths(live)]
            drafts, draft_seconds = ctx.propose(live, ks)
            width = 1 + max(len(d.tokens) for d in drafts)
            work = [
                SeqWork(
                    s.slot,
                    ctx.kv.length(s.slot),
                    _padded([s.tokens[-1], *d.tokens], width),
                    position_offset=ctx.kv.num_tokens(s.slot),
                )
                for s, d in zip(live, drafts)
            ]
            # finished sequences compute `width` padding rows at a scratch position of their slot
            work += [
                SeqWork(s.slot, min(ctx.kv.length(s.slot), ctx.kv.max_len - width), [s.tokens[-1]] * width)
                for s in batch
                if s.finished
            ]
            num_drafts = sum(len(d.tokens) for d in drafts)
            mask = ctx.kv.cache_mask([w.slot_id for w in work])
            rows = ctx.target_step(
                work,
                real_rows=len(live) + num_drafts,
                prefill_rows=0,
                draft_tokens=num_drafts,
                draft_seconds=draft_seconds,
                cache_mask=mask,
                active=len(live),
            )
            verified = [ctx.verify(s, d, logits[: 1 + len(d.tokens)]) for s, d, logits in zip(live, drafts, rows)]
            advance = max(len(tokens) for tokens in verified)
            for seq, tokens in zip(live, verified):
                ctx.kv.commit_padded(seq.slot, len(tokens), advance)
                ctx.emit(seq, tokens)
                if not seq.finished and ctx.kv.room(seq.slot) == 0:
                    seq.finish_reason = CONTEXT  # holes used up the cache: the baseline's worst-case cost
        ctx.retire(batch)
    return ctx.run


def _padded(tokens: list[int], width: int) -> list[int]:
    """Pad with copies of the last token; padded rows are computed and discarded."""
    return tokens + [tokens[-1]] * (width - len(tokens))

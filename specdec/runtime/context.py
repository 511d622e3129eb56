"""What every decoding loop shares: admission, drafting, the target call and its metrics, verification, stops,
streaming callbacks and retirement, so each loop (``loops.py``, ``beams.py``) shows only its own steps.

A loop asks its ``DraftPlanner`` how much to draft, builds one ``SeqWork`` per sequence saying what it is, and
calls ``step_isolated``; every count of the step is derived from those items (``StepRecord.of``). Tokens reach the
answer only through ``emit`` (the one stop rule, ``StopChecker``), each with its log-probability when the request
asks (``logprobs.token_logprob``), and a sequence leaves only through ``retire``.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from specdec.runtime.backends.base import Backend
from specdec.runtime.config import EngineConfig
from specdec.runtime.draft_planner import ChainStep, DraftPlanner, FixedDraftLength
from specdec.runtime.drafters import Draft, Drafter
from specdec.runtime.kv import KVCacheManager
from specdec.runtime.logprobs import TokenLogprob, suppress, token_logprob
from specdec.runtime.metrics import RunMetrics, StepRecord
from specdec.runtime.packed import SeqWork, WorkKind, pack
from specdec.runtime.request import CANCELLED, SeqState, StopChecker
from specdec.runtime.sampling import next_token, verify_greedy, verify_sampling, warp
from specdec.runtime.scheduler import Scheduler

TokenCallback = Callable[[SeqState, list[int]], None]
#: fault injection for tests: called with a sequence and the point it is at ("step", "verify"); raising there is a
#: failure that belongs to that sequence alone (a served engine installs one only from $SPECDEC_FAULT_HOOK)
FaultHook = Callable[[SeqState, str], None]
log = logging.getLogger(__name__)
MIN_PREFILL_CHUNK = 16  # rows a prompt still prefilling gets in a step whose budget the other rows used up


@dataclass
class LoopHooks:
    """How the loop's caller follows it. ``keep_running`` set: a server's loop, which waits for work instead of
    returning when its queue is empty (and whose requests each wait for their own answer only)."""

    on_tokens: TokenCallback | None = None  # each sequence's newly appended tokens
    on_finish: Callable[[SeqState], None] | None = None
    keep_running: Callable[[], bool] | None = None
    #: ``ar`` only: the target logits each sampled token was drawn from (distillation records them)
    on_logits: Callable[[SeqState, np.ndarray], None] | None = None
    #: whether a caller gave up on a sequence; every loop asks it when it retires sequences (after each step or
    #: round), so a cancelled sequence ends there, whether or not it streamed anything
    is_cancelled: Callable[[SeqState], bool] | None = None
    fault_hook: FaultHook | None = None

    @property
    def serving(self) -> bool:
        return self.keep_running is not None


@dataclass
class DecodeContext:
    """Everything a loop needs besides its own control flow."""

    target: Backend
    kv: KVCacheManager
    scheduler: Scheduler
    stopper: StopChecker
    config: EngineConfig
    drafter: Drafter | None = None
    planner: DraftPlanner = field(default_factory=FixedDraftLength)
    hooks: LoopHooks = field(default_factory=LoopHooks)
    run: RunMetrics = field(default_factory=lambda: RunMetrics("?"))
    #: the target step in progress: since when (``time.monotonic``) and its rows; None between steps. A server's
    #: heartbeat reads it, so a supervisor can tell a wedged step from a long one
    current_step: tuple[float, int] | None = None

    # -- admission ------------------------------------------------------------------------------------------------
    def has_work(self, live: Sequence[object]) -> bool:
        if live or self.scheduler.pending():
            return True
        while self.hooks.keep_running is not None and self.hooks.keep_running():
            if self.scheduler.wait_for_work(timeout=0.1):
                return True
        return False

    def admit(self, live: Sequence[SeqState]) -> list[SeqState]:
        return self.scheduler.admit(self.kv, len(live))

    # -- drafting -------------------------------------------------------------------------------------------------
    def draft_budget(self, seq: SeqState, generated: int) -> int:
        """The most ``seq`` may draft now, chain tokens or forest layers alike: its requested k (or the engine's),
        never past ``max_tokens``, since one token of every step always comes from the target.

        ``generated``: output tokens so far (a beam group counts its beams' common length). Where the drafts
        must also fit the KV slot, the caller lowers it further by its own shape (k rows, or W_S rows a layer).
        """
        k = self.config.num_draft_tokens if seq.request.num_draft_tokens is None else seq.request.num_draft_tokens
        return max(0, min(k, seq.request.max_tokens - generated - 1))

    def draft_lengths(self, seqs: Sequence[SeqState], waiting: Sequence[SeqState] | None = None) -> list[int]:
        """k per sequence: the planner's choice within what it may draft (its budget and its slot's room).

        ``waiting``: the sequences admitted but still prefilling (ems); given, in a call that returns when all its
        requests are done (not a server's loop) and with no request waiting for a slot, the planner may plan the
        batch as a whole (``ChainStep.plan``).
        """
        k_max = [max(0, min(self.draft_budget(seq, seq.num_generated), self.kv.room(seq.slot) - 1)) for seq in seqs]
        budgets = [max(0, min(s.request.max_tokens - s.num_generated, self.kv.room(s.slot))) for s in seqs]
        plan = waiting is not None and not self.hooks.serving and not self.scheduler.pending()
        prefilling = [min(s.request.max_tokens, self.kv.max_len - s.num_prompt) for s in waiting or ()]
        return self.planner.chain_lengths(seqs, ChainStep(k_max, budgets, prefilling, plan))

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

    # -- the target call ------------------------------------------------------------------------------------------
    def step_isolated(
        self, seqs: Sequence[SeqState], work: Sequence[SeqWork], draft_seconds: float = 0.0
    ) -> list[np.ndarray | None]:
        """``target_step`` in which a failure that belongs to one sequence fails that sequence only.

        A step of several sequences that raises runs again one sequence at a time: each retry rewrites the same
        uncommitted cache rows of its own slot, so a survivor ends the step exactly as the whole step would have
        left it, and only the sequences whose own step raises fail (``None`` rows). ``seqs[i]`` owns ``work[i]``.
        """
        try:
            self._fault(seqs, "step")
            return list(self.target_step(work, draft_seconds=draft_seconds))
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
            try:
                self._fault([seq], "step")
                rows.append(self.target_step([item])[0])
            except Exception as exc:
                self.fail(seq, exc)
                rows.append(None)
        return rows

    def target_step(
        self,
        work: Sequence[SeqWork],
        draft_seconds: float = 0.0,
        cache_mask: np.ndarray | None = None,
        active: int | None = None,
    ) -> list[np.ndarray]:
        """Run one packed target call and record it; returns each work item's logits rows."""
        batch = pack(work, cache_mask)
        rows_before = self.target.rows_processed
        start = time.perf_counter()
        self.current_step = (time.monotonic(), batch.num_tokens)
        try:
            logits = self.target.step(batch, self.kv.storage)
        finally:
            self.current_step = None
        self.run.steps.append(
            StepRecord.of(
                work,
                batch_size=batch.num_seqs,
                rows=self.target.rows_processed - rows_before,
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

    # -- prefill --------------------------------------------------------------------------------------------------
    def prefill_work(self, seq: SeqState) -> SeqWork:
        return SeqWork(seq.slot, 0, seq.request.prompt_ids, logits="last", kind=WorkKind.LAST_CHUNK)

    def prefill_chunks(self, filling: Sequence[SeqState], rows_used: int) -> list[SeqWork]:
        """This step's prefill work for the sequences still prefilling, in admission order.

        Without a ``prefill_budget``: each whole prompt (what remains of it). With one: chunks that fill what the
        step's other ``rows_used`` rows leave of the budget, and never less than ``MIN_PREFILL_CHUNK`` rows for
        the first one, so a prompt always advances. Only a prompt's last chunk asks for logits (its first token).
        """
        work = []
        limit = self.config.prefill_budget
        budget = None if limit is None else max(limit - rows_used, MIN_PREFILL_CHUNK)
        for seq in filling:
            done = self.kv.length(seq.slot)
            rest = seq.num_prompt - done
            n = rest if budget is None else min(rest, budget)
            if n <= 0:
                break
            last = n == rest
            work.append(
                SeqWork(
                    seq.slot,
                    done,
                    seq.request.prompt_ids[done : done + n],
                    logits="last" if last else "none",
                    kind=WorkKind.LAST_CHUNK if last else WorkKind.PREFILL,
                )
            )
            if budget is not None:
                budget -= n
        return work

    def prefilled(self, seq: SeqState, item: SeqWork, logits: np.ndarray) -> bool:
        """Commit a prefill chunk; after the prompt's last one emit the first token. Whether the prompt is done."""
        if item.kind is WorkKind.PREFILL:
            self.kv.commit(seq.slot, len(item.token_ids))
            return False
        self.start(seq, logits)
        return True

    def start(self, seq: SeqState, logits: np.ndarray) -> None:
        """After the prompt's prefill (or its last chunk): commit it and emit the first token."""
        self.kv.commit(seq.slot, seq.num_prompt - self.kv.length(seq.slot))
        self.count_call(seq)
        self.next_from(seq, logits[-1])

    # -- verification and output ----------------------------------------------------------------------------------
    def constrained(self, seq: SeqState, logits: np.ndarray) -> np.ndarray:
        """``logits`` (rows for ``seq``'s next tokens, in order) with its stop tokens kept out of every row whose
        token would come before ``min_tokens``; the rows themselves where none would."""
        early = seq.request.min_tokens - seq.num_generated
        if early <= 0:
            return logits
        rows = np.array(logits, copy=True)
        rows[:early] = suppress(rows[:early], self.stopper.stop_ids(seq.request))
        return rows

    def next_from(self, seq: SeqState, logits: np.ndarray) -> None:
        """Emit the one token the target's ``logits`` give (greedy or sampled)."""
        self._fault([seq], "verify")
        row = self.constrained(seq, logits[None])[0]
        if self.hooks.on_logits is not None:
            self.hooks.on_logits(seq, row)
        self.emit(seq, [next_token(row, seq.request.sampling, seq.generator)], row[None])

    def verify(self, seq: SeqState, draft: Draft, logits: np.ndarray) -> tuple[list[int], np.ndarray]:
        """Accepted drafts + one target token, from logits after [last, *drafts]; and the rows they came from."""
        self._fault([seq], "verify")
        params = seq.request.sampling
        rows = self.constrained(seq, logits)
        if params.greedy:
            tokens = verify_greedy(draft.tokens, np.argmax(rows, axis=-1).tolist())
        else:
            tokens = verify_sampling(draft.tokens, draft.probs, warp(rows, params), seq.generator)
        accepted = len(tokens) - 1
        self.count_call(seq)
        seq.metrics.draft_tokens += len(draft.tokens)
        seq.metrics.accepted_draft_tokens += accepted
        self.planner.record(seq, len(draft.tokens), accepted)
        self.run.steps[-1].accepted_draft_tokens += accepted
        return tokens, rows

    def emit(
        self,
        seq: SeqState,
        tokens: Sequence[int],
        rows: np.ndarray | None = None,
        logprobs: Sequence[TokenLogprob] = (),
    ) -> None:
        """Append ``tokens`` (until a stop) and stream them. For a request that asks for log-probabilities:
        ``rows[j]``, the target logits token j was chosen from, or ``logprobs[j]``, its log-probability as a beam
        search kept it."""
        appended = self.stopper.append(seq, tokens)
        if seq.request.logprobs is not None:
            if rows is not None:
                params, top = seq.request.sampling, seq.request.logprobs
                seq.logprobs.extend(token_logprob(rows[j], t, params, top) for j, t in enumerate(appended))
            else:
                seq.logprobs.extend(logprobs[: len(appended)])
        self.run.generated_tokens += len(appended)
        if self.hooks.on_tokens is not None and appended:
            self.hooks.on_tokens(seq, appended)

    # -- failures and retirement ----------------------------------------------------------------------------------
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

    def _fault(self, seqs: Sequence[SeqState], point: str) -> None:
        if self.hooks.fault_hook is not None:
            for seq in seqs:
                self.hooks.fault_hook(seq, point)

    def retire_cancelled(self, seq: SeqState) -> bool:
        """Whether the caller gave up on ``seq``; if so it ends now with ``CANCELLED`` (the one cancellation path)."""
        if self.hooks.is_cancelled is None or not self.hooks.is_cancelled(seq):
            return False
        seq.finish_reason = CANCELLED
        return True

    def finished(self, seq: SeqState) -> None:
        """``seq`` left the loop: its caller hears of it."""
        if self.hooks.on_finish is not None:
            self.hooks.on_finish(seq)

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
            self.finished(seq)
        return live

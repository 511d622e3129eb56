"""Decoding loops: ``ar`` (baseline), ``vanilla`` (padded speculative baseline), ``ems`` (EMS-SD).

Each loop reads top to bottom: admit → draft → one target ragged step → verify → commit
KV and outputs → retire finished sequences. The bookkeeping they share (admission, the
target call and its metrics, acceptance, stop checks, streaming callbacks) lives in
``context.DecodeContext``, and how much each sequence drafts in its ``DraftPlanner``, so each
loop shows only what makes it different.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from specdec.runtime.context import DecodeContext
from specdec.runtime.metrics import RunMetrics
from specdec.runtime.packed import SeqWork, WorkKind
from specdec.runtime.request import CONTEXT, SeqState


def ar(ctx: DecodeContext) -> RunMetrics:
    """Batched autoregressive decoding with in-flight admission: one new token per sequence per step."""
    ctx.run.method = "ar"
    live: list[SeqState] = []
    filling: list[SeqState] = []  # admitted, prompt not fully prefilled yet (chunked prefill)
    while ctx.has_work(live + filling):
        filling += ctx.admit(live + filling)
        work = [_chain(ctx, s, ()) for s in live]
        chunks = ctx.prefill_chunks(filling, len(work))
        rows = ctx.step_isolated(live + filling[: len(chunks)], work + chunks)
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
        work = [_chain(ctx, s, d.tokens) for s, d in zip(live, drafts)]
        chunks = ctx.prefill_chunks(filling, sum(len(w.token_ids) for w in work))
        rows = ctx.step_isolated(live + filling[: len(chunks)], work + chunks, draft_seconds)
        for seq, draft, logits in zip(live, drafts, rows):
            if logits is not None:
                with ctx.isolated(seq):
                    tokens, verified = ctx.verify(seq, draft, logits)
                    ctx.kv.commit(seq.slot, len(tokens))  # last token + accepted drafts
                    ctx.emit(seq, tokens, verified)
        live, filling = _prefill_done(ctx, live, filling, chunks, rows[len(live) :])
    return ctx.run


def _chain(ctx: DecodeContext, seq: SeqState, drafts: Sequence[int]) -> SeqWork:
    """``seq``'s last token and its drafts, at its own past length: a decode step, or a chain to verify."""
    tokens = [seq.tokens[-1], *drafts]
    kind = WorkKind.VERIFY if drafts else WorkKind.DECODE
    return SeqWork(seq.slot, ctx.kv.length(seq.slot), tokens, kind=kind, drafts=len(drafts))


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
        rows = ctx.target_step([ctx.prefill_work(s) for s in batch])
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
                    kind=WorkKind.VERIFY,
                    drafts=len(d.tokens),
                    padding=width - 1 - len(d.tokens),
                )
                for s, d in zip(live, drafts)
            ]
            # finished sequences compute `width` padding rows at a scratch position of their slot
            work += [
                SeqWork(
                    s.slot,
                    min(ctx.kv.length(s.slot), ctx.kv.max_len - width),
                    [s.tokens[-1]] * width,
                    padding=width,
                )
                for s in batch
                if s.finished
            ]
            mask = ctx.kv.cache_mask([w.slot_id for w in work])
            rows = ctx.target_step(work, draft_seconds, cache_mask=mask, active=len(live))
            verified = [ctx.verify(s, d, logits[: 1 + len(d.tokens)]) for s, d, logits in zip(live, drafts, rows)]
            advance = max(len(tokens) for tokens, _ in verified)
            for seq, (tokens, verified_rows) in zip(live, verified):
                ctx.kv.commit_padded(seq.slot, len(tokens), advance)
                ctx.emit(seq, tokens, verified_rows)
                if not seq.finished and ctx.kv.room(seq.slot) == 0:
                    seq.finish_reason = CONTEXT  # holes used up the cache: the baseline's worst-case cost
        ctx.retire(batch)
    return ctx.run


def _padded(tokens: list[int], width: int) -> list[int]:
    """Pad with copies of the last token; padded rows are computed and discarded."""
    return tokens + [tokens[-1]] * (width - len(tokens))

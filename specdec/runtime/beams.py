"""Beam decoding on the ragged step: the ``beam`` baseline and DSBD, batched over requests.

A request decoded with beams is a *group* of live beams, each a sequence with its own KV
slot in the target cache (and, for DSBD, in the draft cache). Every round of every group
goes into the same packed target call, so concurrent beam requests share ragged steps just
as EMS-SD's chains do. The method itself (joint warping, i.i.d. drafts, layer verification,
dynamic width) is the model-free core in :mod:`specdec.runtime.dsbd`; this module feeds it
the logits of real models and keeps the KV caches in step with the beams.

One round of a group (``docs/algorithms.md``, DSBD):

1. *Draft* (``dsbd`` only): the draft model beam-samples γ layers of ``W_S`` i.i.d. nodes
   from the live beams, one ragged draft step per layer for all groups; each root beam's
   tree is fed with its tree mask, its uncached tail committed on the first layer.
2. *Target*: one packed call; each beam feeds its uncached tail plus its tree (tree mask,
   position = past + depth), with logits at the tail's last row and at every node.
3. *Verify* layer by layer (:func:`~specdec.runtime.dsbd.verify_layer`); the first failing
   layer, a layer whose accepted nodes end a beam (EOS), or the extra layer after γ passes
   gives the round's output beams.
4. *KV*: each output beam commits its root's tail and its accepted path (compaction inside
   the slot); beams sharing a root fork its slot (prefix and written tree rows copied); roots
   without children free theirs. The output token itself is the next round's tail.

γ = 0 is exactly the ``beam`` baseline (same calls, same draws from the request's RNG). With
the engine's adaptive draft length, γ is chosen per request and round (at most the requested
γ) from the request's own record of layer passes, by the policy that chooses EMS-SD's k: a
layer is to a round what a draft token is to a chain. It depends on the request's past only,
so every slot keeps its law and a request's output does not depend on its batch.
Greedy requests run deterministic beam search; greedy DSBD verifies the draft's top-``W_S``
pairs against the target's top-W per layer and outputs exactly what beam search would.

Beams end on EOS (they become candidates) or at ``max_tokens``; a group stops when it has
``width`` candidates or no live beam. The answer is the candidate with the best
``logprob / length ** length_penalty`` (logprob = the target's log-likelihood at temperature 1).
After every round a group streams the prefix that all its live beams and finished candidates
share (final, whatever the search does next); the rest streams when the group ends. Stop
strings see the streamed tokens in order, so a stopped answer equals the stopper applied to
the whole chosen answer.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from specdec.runtime.backends.base import Backend
from specdec.runtime.context import DecodeContext
from specdec.runtime.drafters import ForestDrafter
from specdec.runtime.dsbd import (
    BeamStep,
    beam_distribution,
    beam_search_step,
    beam_step,
    draft_layer,
    dynamic_width,
    verify_layer,
    verify_layer_greedy,
)
from specdec.runtime.logprobs import TokenLogprob, token_logprob
from specdec.runtime.metrics import RunMetrics
from specdec.runtime.packed import ROOT, SeqWork, WorkKind, pack
from specdec.runtime.request import BeamCandidate, BeamMode, BeamParams, SeqState
from specdec.runtime.sampling import log_softmax

NodeRef = tuple[int, int]  # (root beam index, tree position); position -1 is the root's own last token


@dataclass
class Hyp:
    """One beam: ``slot`` caches ``tokens[:kv.length(slot)]``, the rest is its uncached tail."""

    tokens: list[int]
    score: float  # log p_beam of its last step (sampling), or cumulative log-probability (beam search)
    logprob: float  # target log-likelihood of the output tokens at temperature 1
    slot: int
    draft_slot: int | None = None
    finish_reason: str | None = None
    #: with the request's ``logprobs``: one per output token, the target's unwarped (``logprobs`` module)
    logprobs: list[TokenLogprob] = field(default_factory=list)


@dataclass
class Layer:
    """One drafted forest layer: the draft's ``q_beam`` over its parents, and the i.i.d. nodes.

    The parents are the roots (first layer) or the previous layer's ``refs``; flat indices
    ``parent * V + token`` refer to that list.
    """

    q_beam: np.ndarray | None  # flat [len(parents) * V]; None for greedy drafts
    nodes: list[int]  # flat (parent, token) indices, in draw order
    refs: list[NodeRef] = field(default_factory=list)  # each node's place in its root's tree
    scores: list[float] = field(default_factory=list)  # the draft's score of each node


@dataclass
class Group:
    """A beam request in flight."""

    seq: SeqState
    params: BeamParams
    beams: list[Hyp]
    width: int
    finished: list[Hyp] = field(default_factory=list)
    layers: list[Layer] = field(default_factory=list)
    trees: list[list[tuple[int, int]]] = field(default_factory=list)  # per root: (token, parent position)

    @property
    def num_generated(self) -> int:
        return len(self.beams[0].tokens) - self.seq.num_prompt if self.beams else 0

    @property
    def done(self) -> bool:
        return not self.beams or len(self.finished) >= self.params.width


class BeamDecoder:
    """The state of one beam or dsbd run: groups, the draft cache, and the round logic."""

    def __init__(self, ctx: DecodeContext, speculative: bool) -> None:
        self.ctx, self.speculative = ctx, speculative
        self.drafter: ForestDrafter | None = None
        if speculative:
            if not isinstance(ctx.drafter, ForestDrafter):
                raise ValueError(
                    "dsbd needs a draft model (the draft beam-samples the forest with its q): "
                    f"got {type(ctx.drafter).__name__ if ctx.drafter else 'no drafter'}"
                )
            self.drafter = ctx.drafter
        self.groups: list[Group] = []
        self.vocab = ctx.target.vocab_size

    # -- admission and retirement ---------------------------------------------------------
    def admit(self) -> None:
        kv = self.ctx.kv
        reserved = sum(g.params.width - len(g.beams) for g in self.groups)
        new = self.ctx.scheduler.admit(
            kv, len(self.groups), slots=lambda r: _params(r).width, free=kv.num_free - reserved
        )
        for seq in new:
            params = _params(seq.request)
            root = Hyp(list(seq.tokens), 0.0, 0.0, seq.slot, self.drafter.open_slot() if self.drafter else None)
            self.groups.append(Group(seq, params, [root], params.width))

    def retire(self) -> None:
        """Finish the groups that are done, and drop (``"cancelled"``) the ones a caller gave up on."""
        live = []
        for group in self.groups:
            cancelled = not group.seq.finished and self.ctx.retire_cancelled(group.seq)
            if not group.done and not cancelled:
                live.append(group)
                continue
            for hyp in group.beams:
                self._free(hyp)
            if cancelled:
                self.ctx.finished(group.seq)
            else:
                self._finish(group)
        self.groups = live

    def _free(self, hyp: Hyp) -> None:
        self.ctx.kv.free(hyp.slot)
        if hyp.draft_slot is not None and self.drafter is not None:
            self.drafter.close_slot(hyp.draft_slot)

    def _finish(self, group: Group) -> None:
        """Rank the candidates, emit the best one's tokens, and report the group."""
        seq, params = group.seq, group.params
        candidates = group.finished or list(group.beams)

        def rank(h: Hyp) -> float:
            length = max(1, len(h.tokens) - seq.num_prompt)
            return h.logprob / length**params.length_penalty

        ranked = sorted(candidates, key=rank, reverse=True)[: params.num_return_sequences]
        best = ranked[0]
        seq.metrics.logprob = best.logprob
        if not seq.finished:  # the rest after the streamed prefix (unless a stop string already ended it there)
            self.ctx.emit(seq, best.tokens[len(seq.tokens) :], logprobs=best.logprobs[seq.num_generated :])
        if not seq.finished:
            seq.finish_reason = best.finish_reason or "length"
        seq.sequences = [
            BeamCandidate(h.tokens[seq.num_prompt :], h.logprob, rank(h), h.finish_reason or "length") for h in ranked
        ]
        self.ctx.finished(seq)

    # -- one round for every group ----------------------------------------------------------
    def round(self) -> None:
        """One round of every group that is ready, plus a prefill chunk of each long prompt the budget allows.

        With the context's ``prefill_budget`` a group whose prompt does not fit what the step's other rows
        leave of the budget only prefills a chunk of it this round (target and draft cache alike); it
        drafts and verifies from the round in which the rest of its prompt fits, so a long prompt never
        stalls the running groups for its whole prefill, and the rounds it takes are the same computation.
        """
        ctx = self.ctx
        filling = [g for g in self.groups if self._prefilling(g)]
        decoding = [g for g in self.groups if all(g is not f for f in filling)]
        gammas = {id(g): self._gamma(g) for g in decoding}
        rows_used = sum(len(g.beams) + gammas[id(g)] * g.params.width for g in decoding)
        ready, chunks = self._prefill_plan(filling, rows_used)
        groups = [g for g in self.groups if id(g) in gammas or id(g) in ready]
        gammas.update((id(g), self._gamma(g)) for g in groups if id(g) not in gammas)
        start = time.perf_counter()
        if self.speculative:
            self._draft(groups, [gammas[id(g)] for g in groups])
            self._draft_chunks(chunks)
        draft_seconds = time.perf_counter() - start
        work, owners, tails = [], [], []
        for gi, group in enumerate(groups):
            tails.append([len(h.tokens) - ctx.kv.length(h.slot) for h in group.beams])
            for bi in range(len(group.beams)):
                work.append(self._target_work(group, bi))
                owners.append((gi, bi))
        work += [item for item, _ in chunks]  # no logits: zip below leaves them out
        rows = ctx.target_step(work, draft_seconds=draft_seconds)
        for item, _ in chunks:
            ctx.kv.commit(item.slot_id, len(item.token_ids))
        logits: dict[tuple[int, int], np.ndarray] = dict(zip(owners, rows))
        for gi, group in enumerate(groups):
            ctx.count_call(group.seq)
            mine = {bi: logits[(gi, bi)] for bi in range(len(group.beams))}
            outputs, accepted, passed = self._verify(group, mine)
            ctx.planner.record(group.seq, len(group.layers), passed)
            group.seq.metrics.draft_tokens += sum(len(layer.nodes) for layer in group.layers)
            group.seq.metrics.accepted_draft_tokens += accepted
            ctx.run.steps[-1].accepted_draft_tokens += accepted
            self._advance(group, outputs, tails[gi], mine)
            self._stream_settled(group)

    def _prefilling(self, group: Group) -> bool:
        """The group's prompt is not all in the target cache yet (it has produced nothing)."""
        return group.num_generated == 0 and self.ctx.kv.length(group.beams[0].slot) < group.seq.num_prompt

    def _prefill_plan(self, filling: Sequence[Group], rows_used: int) -> tuple[set[int], list[tuple[SeqWork, Group]]]:
        """Of the prefilling groups (``filling``), those whose prompt's rest fits this step (they take a normal
        round), and the chunks of the others that the budget left by ``rows_used`` allows
        (``DecodeContext.prefill_chunks``: admission order, at least a minimum chunk); a prefilling group in
        neither waits for a later step."""
        ready: set[int] = set()
        chunks: list[tuple[SeqWork, Group]] = []
        for group, item in zip(filling, self.ctx.prefill_chunks([g.seq for g in filling], rows_used)):
            if item.kind is WorkKind.PREFILL:
                chunks.append((item, group))
            else:
                ready.add(id(group))
        return ready, chunks

    def _draft_chunks(self, chunks: Sequence[tuple[SeqWork, Group]]) -> None:
        """The draft cache takes each target prefill chunk too, so the round that ends a long prompt drafts from
        a draft cache as full as the target's, not after a whole-prompt draft prefill."""
        assert self.drafter is not None
        work = []
        for item, group in chunks:
            slot = group.beams[0].draft_slot
            assert slot is not None
            past = self.drafter.cached_length(slot)
            work.append(
                SeqWork(slot, past, group.beams[0].tokens[past : item.past_len + len(item.token_ids)], logits="none")
            )
        if work:
            self.drafter.forest_step(work)
            for item in work:
                self.drafter.keep(item.slot_id, len(item.token_ids))

    def _stream_settled(self, group: Group) -> None:
        """Emit the output tokens every candidate now shares: whatever the search does next, the answer starts so.

        Why: the answer is chosen only when the search ends, but it is a finished candidate or a
        descendant of a live beam, so the common prefix of those is final. Streaming it lets a
        beam request stream like the others; the answer is the same as emitting it whole at the
        end, since the stopper sees the same tokens in the same order.
        """
        seq = group.seq
        hyps = group.beams + group.finished
        if seq.finished or not hyps:
            return
        first, start = hyps[0].tokens, len(seq.tokens)
        end = min(len(h.tokens) for h in hyps)
        settled = start
        while settled < end and all(h.tokens[settled] == first[settled] for h in hyps[1:]):
            settled += 1
        if settled > start:
            done = seq.num_generated
            self.ctx.emit(seq, first[start:settled], logprobs=hyps[0].logprobs[done : done + settled - start])

    def _gamma(self, group: Group) -> int:
        """Draft layers this round: γ, capped by max_tokens and by the room of every beam's slot, then (adaptive
        draft length) lowered to what the request's own layer passes say pays."""
        if not self.speculative:
            return 0
        seq = group.seq
        gamma = self.ctx.draft_budget(seq, group.num_generated)
        kv = self.ctx.kv
        while gamma > 0 and any(
            len(h.tokens) - kv.length(h.slot) + gamma * group.params.width > kv.room(h.slot) for h in group.beams
        ):
            gamma -= 1
        # a layer passes or not, as a chain's draft is accepted or not: the same policy, over layers, where one
        # layer adds W_S draft and verified rows to the round of the group's live beams
        return self.ctx.planner.forest_layers(seq, gamma, rows=group.params.width / len(group.beams))

    # -- draft forest ---------------------------------------------------------------------
    def _draft(self, groups: Sequence[Group], gammas: Sequence[int]) -> None:
        """Beam-sample the forest of every group of the round, one draft ragged step per layer for all of them."""
        assert self.drafter is not None
        for group, gamma in zip(groups, gammas):
            group.layers = []
            group.trees = [[] for _ in group.beams] if gamma else []
        for depth in range(max(gammas, default=0)):
            drafting = [g for g, gamma in zip(groups, gammas) if gamma > depth]
            work: list[SeqWork] = []
            asked: list[tuple[int, NodeRef]] = []  # (group, node) of each logits row forest_step returns
            for group in drafting:
                parents, _ = _layer_parents(group, depth)
                for b in range(len(group.beams)):
                    item = self._draft_work(group, b, depth, parents)
                    if item is not None:
                        work.append(item[0])
                        asked.extend((id(group), ref) for ref in item[1])
            table = dict(zip(asked, self.drafter.forest_step(work)))
            if depth == 0:  # the tails are the beams' real tokens: keep them in the draft cache
                for hyp in (h for g in drafting for h in g.beams):
                    assert hyp.draft_slot is not None
                    self.drafter.keep(hyp.draft_slot, len(hyp.tokens) - self.drafter.cached_length(hyp.draft_slot))
            for group in drafting:
                parents, scores = _layer_parents(group, depth)
                rows = np.stack([table[(id(group), r)] for r in parents])
                self._draft_layer(group, parents, np.asarray(scores, dtype=np.float64), rows)

    def _draft_work(
        self, group: Group, b: int, depth: int, parents: Sequence[NodeRef]
    ) -> tuple[SeqWork, list[NodeRef]] | None:
        """Root ``b``'s draft work: its tail (depth 0) or its tree so far; logits at the layer's parents."""
        assert self.drafter is not None
        hyp = group.beams[b]
        slot = hyp.draft_slot
        assert slot is not None
        mine = [ref for ref in parents if ref[0] == b]
        if not mine:
            return None
        past = self.drafter.cached_length(slot)
        if depth == 0:
            return SeqWork(slot, past, hyp.tokens[past:], logits="last"), mine
        tree = group.trees[b]
        return SeqWork(
            slot, past, [t for t, _ in tree], [ROOT if p < 0 else p for _, p in tree], logits=[pos for _, pos in mine]
        ), mine

    def _draft_layer(self, group: Group, parents: list[NodeRef], scores: np.ndarray, logits: np.ndarray) -> None:
        """Draw one forest layer from the draft's beam distribution over ``parents`` and grow the trees."""
        params, gen = group.seq.request.sampling, group.seq.generator
        if params.greedy:
            step = beam_search_step(scores, logits, group.params.width, logits=True)
            nodes = [p * self.vocab + t for p, t in zip(step.parents, step.tokens)]
            layer = Layer(None, nodes, scores=step.scores)
        else:
            q_beam = beam_distribution(scores, logits, params, logits=True)
            nodes = draft_layer(q_beam, group.params.width, gen)
            layer = Layer(q_beam, nodes, scores=[math.log(float(q_beam[x])) for x in nodes])
        for x in nodes:
            root, pos = parents[x // self.vocab]
            tree = group.trees[root]
            tree.append((x % self.vocab, pos))
            layer.refs.append((root, len(tree) - 1))
        group.layers.append(layer)

    # -- target call and verification -------------------------------------------------------
    def _target_work(self, group: Group, b: int) -> SeqWork:
        """Beam ``b``'s uncached tail and its tree; logits at the tail's last row and at every node. A tail that is
        the whole prompt (the group's first round) is its prefill."""
        hyp = group.beams[b]
        past = self.ctx.kv.length(hyp.slot)
        tail = hyp.tokens[past:]
        tree = group.trees[b] if group.trees else []
        kind = WorkKind.LAST_CHUNK if len(hyp.tokens) == group.seq.num_prompt else WorkKind.VERIFY
        if not tree:
            return SeqWork(hyp.slot, past, tail, logits="last", kind=kind)
        n = len(tail)
        parents = [ROOT, *range(n - 1)] + [n - 1 if p < 0 else n + p for _, p in tree]
        return SeqWork(
            hyp.slot,
            past,
            tail + [t for t, _ in tree],
            parents,
            logits=[n - 1, *range(n, n + len(tree))],
            kind=kind,
            drafts=len(tree),
        )

    def _verify(self, group: Group, rows: dict[int, np.ndarray]) -> tuple[list[tuple[NodeRef, int, float]], int, int]:
        """The round's output beams as (parent, token, score), the accepted drafts, and the layers that passed."""
        params, gen = group.seq.request.sampling, group.seq.generator
        eos = self.ctx.stopper.stop_ids(group.seq.request)

        def logits_of(ref: NodeRef) -> np.ndarray:
            return rows[ref[0]][ref[1] + 1]

        def table(refs: Sequence[NodeRef], valid: Sequence[bool]) -> np.ndarray:
            return np.stack(
                [logits_of(r) if ok else np.zeros(self.vocab, dtype=np.float32) for r, ok in zip(refs, valid)]
            )

        def masked(scores: Sequence[float], valid: Sequence[bool]) -> np.ndarray:
            """Parent scores with invalid parents absent (-inf), as the beam distribution takes them."""
            return np.asarray([s if ok else -math.inf for s, ok in zip(scores, valid)], dtype=np.float64)

        parents: list[NodeRef] = [(b, -1) for b in range(len(group.beams))]
        valid = [True] * len(parents)
        scores = [h.score for h in group.beams]
        width, accepted_total = group.width, 0
        for passed, layer in enumerate(group.layers):
            score_t = masked(scores, valid)
            logits = table(parents, valid)
            if params.greedy:
                greedy = verify_layer_greedy(score_t, logits, layer.nodes, group.params.width)
                accepted_total += greedy.accepted
                if not greedy.passed or any(t in eos for t in greedy.step.tokens):
                    return _outputs(parents, greedy.step), accepted_total, passed
                chosen, new_scores = greedy.found, greedy.step.scores
            else:
                pb = beam_distribution(score_t, logits, params, logits=True)
                assert layer.q_beam is not None
                width = dynamic_width(
                    pb, layer.q_beam, group.params.width, group.params.threshold, group.params.min_width
                )
                verdict = verify_layer(pb, layer.q_beam, layer.nodes, np.asarray(valid), width, gen)
                accepted_total += len(verdict.accepted)
                out = [(parents[x // self.vocab], x % self.vocab, math.log(float(pb[x]))) for x in verdict.outputs]
                if not verdict.passed or any(t in eos for _, t, _ in out):
                    group.width = width
                    return out, accepted_total, passed
                chosen, new_scores = verdict.accepted, [s for _, _, s in out]
            valid = [False] * len(layer.nodes)
            scores = [-math.inf] * len(layer.nodes)
            for i, s in zip(chosen, new_scores):
                valid[i], scores[i] = True, s
            parents = layer.refs
        group.width = width
        score_t = masked(scores, valid)
        mode: BeamMode = "iid" if group.layers else group.params.mode  # a drafted round reproduces i.i.d. beam sampling
        step = beam_step(
            score_t, table(parents, valid), params, width if not params.greedy else group.params.width, gen, mode
        )
        return _outputs(parents, step), accepted_total, len(group.layers)

    # -- after verification: new beams and their caches -------------------------------------
    def _advance(
        self, group: Group, outputs: list[tuple[NodeRef, int, float]], tails: list[int], rows: dict[int, np.ndarray]
    ) -> None:
        """Turn the outputs into the group's beams; compact, fork and free the KV slots to match.

        ``rows[b]`` are root ``b``'s target logits (row 0: its last token, row 1 + j: tree node j).
        """
        ctx, seq = self.ctx, group.seq
        trees = group.trees or [[] for _ in group.beams]
        log_probs: dict[NodeRef, np.ndarray] = {}
        logprob: dict[NodeRef, float] = {}

        def lsm(ref: NodeRef) -> np.ndarray:
            """Temperature-1 log-probabilities after ``ref`` (the answer's logprob is measured unwarped)."""
            if ref not in log_probs:
                log_probs[ref] = log_softmax(rows[ref[0]][ref[1] + 1].astype(np.float64))
            return log_probs[ref]

        def lp(ref: NodeRef) -> float:
            """The output log-likelihood of the sequence that ends at ``ref``."""
            if ref not in logprob:
                root, pos = ref
                if pos < 0:
                    logprob[ref] = group.beams[root].logprob
                else:
                    token, parent = trees[root][pos]
                    logprob[ref] = lp((root, parent)) + float(lsm((root, parent))[token])
            return logprob[ref]

        def token_logprobs(ref: NodeRef, steps: list[int], token: int) -> list[TokenLogprob]:
            """The new beam's output log-probabilities: its root's, then each accepted node's and the output
            token's, from the target rows they were chosen after (asked for only)."""
            top = seq.request.logprobs
            if top is None:
                return []
            root = ref[0]
            chosen = [(p, trees[root][p]) for p in steps]
            rows_at = [(root, parent) for _, (_, parent) in chosen] + [ref]
            tokens_at = [t for _, (t, _) in chosen] + [token]
            return group.beams[root].logprobs + [
                token_logprob(rows[r][pos + 1], t, None, top) for (r, pos), t in zip(rows_at, tokens_at)
            ]

        def path(ref: NodeRef) -> list[int]:
            root, pos = ref
            out = []
            while pos >= 0:
                out.append(pos)
                pos = trees[root][pos][1]
            return out[::-1]

        new: list[tuple[Hyp, int, list[int]]] = []  # (beam, root, offsets it commits in the root's slot)
        for ref, token, score in outputs:
            root = ref[0]
            steps = path(ref)
            tokens = group.beams[root].tokens + [trees[root][p][0] for p in steps] + [token]
            hyp = Hyp(tokens, score, lp(ref) + float(lsm(ref)[token]), -1, logprobs=token_logprobs(ref, steps, token))
            hyp.finish_reason = ctx.stopper.reason(seq.request, tokens[seq.num_prompt :], len(tokens), strings=False)
            new.append((hyp, root, list(range(tails[root])) + [tails[root] + p for p in steps]))
        seq.metrics.beam_widths.append(len(new))
        if group.params.memory_mode == "single":
            new = [max(new, key=lambda item: item[0].score)]
        group.finished.extend(hyp for hyp, _, _ in new if hyp.finish_reason is not None)
        live = [] if len(group.finished) >= group.params.width else [i for i in new if i[0].finish_reason is None]
        self._rebind(group, live, [tails[b] + len(trees[b]) for b in range(len(group.beams))])
        group.beams = [hyp for hyp, _, _ in live]
        group.layers, group.trees = [], []

    def _rebind(self, group: Group, live: list[tuple[Hyp, int, list[int]]], written: list[int]) -> None:
        """Give each live output beam a slot: its root's (compacted to its path) or a fork of it.

        Roots without children are freed first, so forks never need more slots than the group
        has beams. ``written[b]``: rows root ``b`` wrote this round (tail + tree), which a fork
        copies before committing its own path's offsets.
        """
        kv = self.ctx.kv
        by_root: dict[int, list[tuple[Hyp, list[int]]]] = {}
        for hyp, root, offsets in live:
            by_root.setdefault(root, []).append((hyp, offsets))
        for b, old in enumerate(group.beams):
            if b not in by_root:
                self._free(old)
        for b, children in by_root.items():
            old = group.beams[b]
            for hyp, offsets in children[1:]:
                hyp.slot = kv.fork(old.slot, written[b])
                kv.commit(hyp.slot, offsets)
                if old.draft_slot is not None and self.drafter is not None:
                    hyp.draft_slot = self.drafter.fork_slot(old.draft_slot)
            hyp, offsets = children[0]
            hyp.slot, hyp.draft_slot = old.slot, old.draft_slot
            kv.commit(old.slot, offsets)


def _layer_parents(group: Group, depth: int) -> tuple[list[NodeRef], list[float]]:
    """The draft's parents of forest layer ``depth + 1`` and their scores (the roots carry the target's)."""
    if depth == 0:
        return [(b, -1) for b in range(len(group.beams))], [h.score for h in group.beams]
    return group.layers[-1].refs, group.layers[-1].scores


def continuation_logprob(backend: Backend, prompt_ids: Sequence[int], output_ids: Sequence[int]) -> float:
    """The target's log-likelihood (temperature 1) of ``output_ids`` after ``prompt_ids``, by one fresh prefill.

    The quality measure of beam outputs, computed the same way whatever produced them (a beam
    method's own ``metrics.logprob`` must agree with it, which the tests check).
    """
    tokens = [*prompt_ids, *output_ids]
    if not output_ids:
        return 0.0
    cache = backend.allocate_cache(1, len(tokens))
    first = len(prompt_ids) - 1
    logits = backend.step(pack([SeqWork(0, 0, tokens, logits=list(range(first, len(tokens) - 1)))]), cache)
    log_probs = log_softmax(logits.astype(np.float64))
    return float(log_probs[np.arange(len(output_ids)), np.asarray(list(output_ids))].sum())


def _outputs(parents: Sequence[NodeRef], step: BeamStep) -> list[tuple[NodeRef, int, float]]:
    return [(parents[p], t, s) for p, t, s in zip(step.parents, step.tokens, step.scores)]


def _params(request: object) -> BeamParams:
    return getattr(request, "beam", None) or BeamParams()


def _run(ctx: DecodeContext, speculative: bool) -> RunMetrics:
    decoder = BeamDecoder(ctx, speculative)
    while ctx.has_work(decoder.groups):
        decoder.admit()
        if decoder.groups:
            decoder.round()
        decoder.retire()
    return ctx.run


def beam(ctx: DecodeContext) -> RunMetrics:
    """Target-only beam sampling (i.i.d. or without replacement) or, greedy, deterministic beam search."""
    ctx.run.method = "beam"
    return _run(ctx, speculative=False)


def dsbd(ctx: DecodeContext) -> RunMetrics:
    """DSBD: the draft beam-samples a forest per request, the target verifies all forests in one call."""
    ctx.run.method = "dsbd"
    return _run(ctx, speculative=True)

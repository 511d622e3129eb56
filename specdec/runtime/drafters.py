"""Drafters propose up to k_i tokens per sequence; k_i differs per sequence and may be 0.

* ``NgramDrafter`` (prompt lookup, LLMA): copies the continuation of the most recent
  earlier occurrence of the sequence's last n-gram. Its draft is deterministic, so q is a
  point mass (``probs=None``), which the sampling verifier handles exactly.
* ``ModelDrafter``: a small LLaMA run as ragged steps over its own KV cache. Only the
  sequences still drafting take part in each draft step, and each feeds just its uncached
  tail — one token normally, two after it accepted every draft (the draft never cached
  its last proposal), the whole prompt the first time.

  A draft with a restricted-vocabulary LM head (K rows for K target tokens) samples a head
  column and maps it to its target id; its q is zero outside the head, scattered into a
  ``[k, V]`` row so the verifier sees q over the full vocabulary. Such a q is exactly the
  law the draft sampled from, so verification stays lossless: tokens the draft can never
  propose reach the output through the residual max(0, p - q).
* ``HybridDrafter``: prompt lookup where the sequence's context offers a match, the draft model
  elsewhere, chosen per sequence and step, so requests that quote their prompt and free-form
  ones in one batch each get the drafter that pays for them. It says which would draft before k
  is chosen (``SourcedDrafter``), so the adaptive draft length prices and counts each on its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np

from specdec.runtime.backends.base import Backend
from specdec.runtime.config import DrafterKind
from specdec.runtime.kv import KVCacheManager
from specdec.runtime.packed import SeqWork, pack
from specdec.runtime.request import SeqState
from specdec.runtime.sampling import sample, warp


@dataclass
class Draft:
    """Proposed tokens and, for sampled drafts, the distribution q each was drawn from."""

    tokens: list[int]  # target token ids
    probs: np.ndarray | None = None  # [len(tokens), V] over the full vocabulary; None = deterministic proposal


class Drafter(Protocol):
    # read-only members: a drafter may hold them as class constants, instance attributes or properties
    @property
    def vocab_size(self) -> int | None:
        """The token-id space of the drafts (None: any, as prompt lookup copies the context's own ids)."""
        ...

    @property
    def relative_cost(self) -> float:
        """One draft token's cost in one-row target steps (what the adaptive draft length charges for it)."""
        ...

    def propose(self, seqs: Sequence[SeqState], ks: Sequence[int]) -> list[Draft]:
        """At most ``ks[i]`` draft tokens continuing ``seqs[i].tokens``."""
        ...

    def release(self, seq: SeqState) -> None:
        """Forget a finished sequence."""
        ...

    def reset(self) -> None:
        """Forget every sequence (a new run starts with all slots free)."""
        ...

    def fork(self) -> Drafter:
        """A drafter of the same kind and settings for a second decoding loop: the same model, its own state."""
        ...


@runtime_checkable
class SourcedDrafter(Drafter, Protocol):
    """A drafter with several proposers whose acceptance and price differ (the hybrid: prompt lookup and a model).

    Why the policy must know: a lookup's drafts are free and accepted far more often than a small
    model's, so pricing and counting them as one drafter drafts lookups too short and the model too
    long (measured: ``benchmarks/results/edge_cpu.md``, the hybrid rows). The source is a function of
    the sequence's own tokens, so a k chosen from it still depends on the sequence's past only.
    """

    def source(self, seq: SeqState) -> str:
        """The proposer that would draft for ``seq`` now (non-empty)."""
        ...

    def source_cost(self, source: str) -> float | None:
        """A draft token's own price for ``source`` in one-row target steps; None: the draft model's calibrated one."""
        ...


@runtime_checkable
class OfferingDrafter(Drafter, Protocol):
    """A drafter that can tell, before drafting, how many tokens it has to offer a sequence now (prompt lookup: what
    followed the matched n-gram, often nothing).

    Why: the adaptive draft length plans a batch nobody waits to join by how soon each sequence could finish
    (``DraftLength.plan``); a sequence whose lookup finds no match will not speed up whatever k it is given, and
    counted as if it would, it makes the plan draft for batch-mates that cannot end the batch sooner.
    """

    def offer(self, seq: SeqState, k: int) -> int:
        """The most tokens ``propose`` would draft for ``seq`` with ``k`` (0..k); a function of its tokens only."""
        ...


@runtime_checkable
class ForestDrafter(Drafter, Protocol):
    """A drafter DSBD can beam-sample forests with: a draft model whose slots the beam decoder steers.

    The beam decoder owns the trees and decides what each draft slot caches (a beam's tail, then
    its tree layer by layer); the drafter owns the model and its cache, so the decoder never
    touches a backend or a KV manager of the draft.
    """

    def open_slot(self) -> int:
        """A free draft slot for a new root beam."""
        ...

    def close_slot(self, slot: int) -> None: ...

    def fork_slot(self, slot: int) -> int:
        """A new slot holding ``slot``'s committed prefix (a beam that forks)."""
        ...

    def cached_length(self, slot: int) -> int:
        """Tokens whose K/V ``slot`` holds (committed)."""
        ...

    def keep(self, slot: int, count: int) -> None:
        """Commit the next ``count`` rows the last forest step wrote into ``slot``."""
        ...

    def forest_step(self, work: Sequence[SeqWork]) -> np.ndarray:
        """One ragged draft step over ``work``: logits ``[rows, V]`` over the target's vocabulary (-inf off a
        restricted head), in the order of the work items' logit rows."""
        ...


class NgramDrafter:
    """Prompt-lookup drafting: index every n-gram of prompt + output, copy what followed it."""

    vocab_size = None
    relative_cost = 0.0  # a dictionary lookup

    def __init__(self, max_ngram: int = 3, min_ngram: int = 2) -> None:
        """Match the longest n-gram from ``max_ngram`` down to ``min_ngram`` (LLMA uses 2-grams;
        1-gram matches propose long, mostly rejected drafts that cost verification time)."""
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self._index: dict[int, dict[tuple[int, ...], int]] = {}  # id(seq) -> n-gram -> end position
        self._indexed: dict[int, int] = {}  # id(seq) -> positions already indexed

    def _update(self, seq: SeqState) -> dict[tuple[int, ...], int]:
        index = self._index.setdefault(id(seq), {})
        toks = seq.tokens
        # an n-gram ending at `end` is indexed once a token follows it (end <= len - 2)
        for end in range(self._indexed.get(id(seq), 0), len(toks) - 1):
            for n in range(self.min_ngram, self.max_ngram + 1):
                if end - n + 1 >= 0:
                    index[tuple(toks[end - n + 1 : end + 1])] = end
        self._indexed[id(seq)] = max(self._indexed.get(id(seq), 0), len(toks) - 1)
        return index

    def propose(self, seqs: Sequence[SeqState], ks: Sequence[int]) -> list[Draft]:
        return [Draft(self.lookup(seq, k)) for seq, k in zip(seqs, ks)]

    def offer(self, seq: SeqState, k: int) -> int:
        return len(self.lookup(seq, k))

    def lookup(self, seq: SeqState, k: int) -> list[int]:
        """Up to ``k`` tokens that followed the latest earlier occurrence of ``seq``'s longest matching n-gram."""
        index = self._update(seq)
        toks = seq.tokens
        if k > 0:
            for n in range(min(self.max_ngram, len(toks)), self.min_ngram - 1, -1):
                end = index.get(tuple(toks[-n:]))
                if end is not None:
                    return list(toks[end + 1 : end + 1 + k])
        return []

    def release(self, seq: SeqState) -> None:
        self._index.pop(id(seq), None)
        self._indexed.pop(id(seq), None)

    def reset(self) -> None:
        self._index.clear()
        self._indexed.clear()

    def fork(self) -> NgramDrafter:
        return NgramDrafter(self.max_ngram, self.min_ngram)


class ModelDrafter:
    """A draft LLaMA proposing chains, batched as ragged steps over its own KV slots."""

    #: the default price of a draft token; the shipped distilled draft's measured one: benchmarks/results/draft_pair.md
    relative_cost = 0.1

    def __init__(self, backend: Backend, max_batch: int, max_len: int) -> None:
        """``backend`` may have a restricted head (``backend.head_token_ids``); proposals are target ids."""
        self.backend = backend
        self.vocab_size = backend.vocab_size
        head = getattr(backend, "head_token_ids", None)
        self.head_token_ids: np.ndarray | None = None if head is None else np.asarray(head, dtype=np.int64)
        self._head_list: list[int] | None = None if self.head_token_ids is None else self.head_token_ids.tolist()
        self.kv = KVCacheManager(backend.allocate_cache(max_batch, max_len))
        self._slot: dict[int, int] = {}  # id(seq) -> draft slot
        self._cached: dict[int, list[int]] = {}  # id(seq) -> token ids whose K/V the slot holds

    def _sync(self, seq: SeqState) -> list[int]:
        """Drop rejected proposals from the draft cache; return the uncached tail to feed."""
        key = id(seq)
        if key not in self._slot:
            self._slot[key] = self.kv.alloc()
            self._cached[key] = []
        cached, toks = self._cached[key], seq.tokens
        valid = 0
        limit = min(len(cached), len(toks) - 1)  # keep at least one token to feed
        while valid < limit and cached[valid] == toks[valid]:
            valid += 1
        del cached[valid:]
        self.kv.truncate(self._slot[key], valid)
        return toks[valid:]

    def propose(self, seqs: Sequence[SeqState], ks: Sequence[int]) -> list[Draft]:
        drafts = [Draft([]) for _ in seqs]
        probs: list[list[np.ndarray]] = [[] for _ in seqs]
        active = [i for i, k in enumerate(ks) if k > 0]
        feed = {i: self._sync(seqs[i]) for i in active}
        for depth in range(max((ks[i] for i in active), default=0)):
            active = [i for i in active if ks[i] > depth]
            work = [
                SeqWork(self._slot[id(seqs[i])], self.kv.length(self._slot[id(seqs[i])]), feed[i], logits="last")
                for i in active
            ]
            logits = self.backend.step(pack(work), self.kv.storage)
            for row, i in enumerate(active):
                seq = seqs[i]
                self.kv.commit(self._slot[id(seq)], len(feed[i]))
                self._cached[id(seq)].extend(feed[i])
                params = seq.request.sampling
                if params.greedy:
                    column = int(np.argmax(logits[row]))
                else:
                    q = warp(logits[row], params)  # over the head's columns
                    column = sample(q, seq.generator)
                    probs[i].append(q)
                token = column if self._head_list is None else self._head_list[column]
                drafts[i].tokens.append(token)
                feed[i] = [token]
        for i, p in enumerate(probs):
            if p:
                drafts[i].probs = self._full_vocab(np.stack(p))
        return drafts

    def _full_vocab(self, q: np.ndarray) -> np.ndarray:
        """``[n, head]`` draft probabilities as ``[n, V]``: a restricted head's q is 0 off the head."""
        if self.head_token_ids is None:
            return q
        full = np.zeros((q.shape[0], self.vocab_size), dtype=q.dtype)
        full[:, self.head_token_ids] = q
        return full

    def full_vocab_logits(self, logits: np.ndarray) -> np.ndarray:
        """``[n, head]`` draft logits as ``[n, V]``: -inf off a restricted head (q = 0 there)."""
        if self.head_token_ids is None:
            return logits
        full = np.full((logits.shape[0], self.vocab_size), -np.inf, dtype=logits.dtype)
        full[:, self.head_token_ids] = logits
        return full

    def release(self, seq: SeqState) -> None:
        slot = self._slot.pop(id(seq), None)
        self._cached.pop(id(seq), None)
        if slot is not None:
            self.kv.free(slot)

    def reset(self) -> None:
        self.kv = KVCacheManager(self.kv.storage)
        self._slot.clear()
        self._cached.clear()

    def fork(self) -> ModelDrafter:
        """The same draft model (its weights are shared) with its own KV cache of the same size."""
        return ModelDrafter(self.backend, self.kv.num_slots, self.kv.max_len)

    # -- forests (``ForestDrafter``, for DSBD) -------------------------------------------
    def open_slot(self) -> int:
        return self.kv.alloc()

    def close_slot(self, slot: int) -> None:
        self.kv.free(slot)

    def fork_slot(self, slot: int) -> int:
        return self.kv.fork(slot)

    def cached_length(self, slot: int) -> int:
        return self.kv.length(slot)

    def keep(self, slot: int, count: int) -> None:
        self.kv.commit(slot, count)

    def forest_step(self, work: Sequence[SeqWork]) -> np.ndarray:
        return self.full_vocab_logits(self.backend.step(pack(work), self.kv.storage))


class HybridDrafter:
    """Prompt lookup where it finds a match, the draft model elsewhere: per sequence, per step.

    Why: copying from the context is free and long when an answer quotes or reworks its prompt,
    and finds nothing in free-form text, where a draft model still agrees with the target. The
    choice depends only on the sequence's own tokens, so a request's drafts, and with them its
    output (greedy, or seeded sampling), do not depend on its batch-mates; verification is the
    same lossless rule for either proposal (a lookup's q is a point mass, the model's is its
    law). The model's cache simply lags while lookup drafts and catches up (a longer uncached
    tail) the next time the model drafts. Forests (DSBD) come from the draft model alone.
    """

    LOOKUP, MODEL = "lookup", "model"

    def __init__(self, lookup: NgramDrafter, model: ModelDrafter) -> None:
        self.lookup, self.model = lookup, model
        self.vocab_size = model.vocab_size

    @property
    def relative_cost(self) -> float:
        """The model's price: what a caller that does not ask per source (``source_cost``) pays per draft token."""
        return self.model.relative_cost

    def source(self, seq: SeqState) -> str:
        """``LOOKUP`` where the context offers a match (what ``propose`` then copies), else ``MODEL``."""
        return self.LOOKUP if self.lookup.lookup(seq, 1) else self.MODEL

    def source_cost(self, source: str) -> float | None:
        return self.lookup.relative_cost if source == self.LOOKUP else None

    def offer(self, seq: SeqState, k: int) -> int:
        """A lookup's tokens where the context matches (``propose`` copies them alone), else the model's k."""
        return self.lookup.offer(seq, k) or k

    def propose(self, seqs: Sequence[SeqState], ks: Sequence[int]) -> list[Draft]:
        drafts = [Draft(self.lookup.lookup(seq, k)) for seq, k in zip(seqs, ks)]
        by_model = [i for i, (d, k) in enumerate(zip(drafts, ks)) if k > 0 and not d.tokens]
        if by_model:
            for i, draft in zip(by_model, self.model.propose([seqs[i] for i in by_model], [ks[i] for i in by_model])):
                drafts[i] = draft
        return drafts

    def release(self, seq: SeqState) -> None:
        self.lookup.release(seq)
        self.model.release(seq)

    def reset(self) -> None:
        self.lookup.reset()
        self.model.reset()

    def fork(self) -> HybridDrafter:
        return HybridDrafter(self.lookup.fork(), self.model.fork())

    # -- forests: the draft model's (``ForestDrafter``) -----------------------------------
    def open_slot(self) -> int:
        return self.model.open_slot()

    def close_slot(self, slot: int) -> None:
        self.model.close_slot(slot)

    def fork_slot(self, slot: int) -> int:
        return self.model.fork_slot(slot)

    def cached_length(self, slot: int) -> int:
        return self.model.cached_length(slot)

    def keep(self, slot: int, count: int) -> None:
        self.model.keep(slot, count)

    def forest_step(self, work: Sequence[SeqWork]) -> np.ndarray:
        return self.model.forest_step(work)


def make_drafter(
    kind: DrafterKind | str,
    *,
    max_batch: int,
    max_len: int,
    ngram: int = 3,
    min_ngram: int = 2,
    model: Backend | None = None,
) -> Drafter | None:
    """The one place a drafter is built, by ``kind`` (``config.DrafterKind``): the draft ``model``'s, prompt
    lookup, prompt lookup with the model where lookup has nothing, or none.

    ``max_batch`` and ``max_len`` size a draft model's own KV cache like the target's, so every
    target sequence has a draft slot as long as its context.
    """
    kind = DrafterKind.parse(kind) or DrafterKind.NONE
    if kind is DrafterKind.NONE:
        return None
    if kind is DrafterKind.NGRAM:
        return NgramDrafter(max_ngram=ngram, min_ngram=min_ngram)
    if model is None:
        raise ValueError(f"the {kind.value} drafter needs a draft model")
    if kind is DrafterKind.HYBRID:
        return HybridDrafter(
            NgramDrafter(max_ngram=ngram, min_ngram=min_ngram), ModelDrafter(model, max_batch, max_len)
        )
    return ModelDrafter(model, max_batch, max_len)

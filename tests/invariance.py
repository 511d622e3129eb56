"""Decode the same token sequences in two ways and compare every position's logits (the batch-invariance probe).

``one_token_per_step`` is the reference (each sequence alone, one row per step, as ``ar`` runs it);
``random_steps`` decodes them together in random ragged steps beside forests. Used by
``test_batch_invariance`` and by the GGUF case in ``test_quantize``.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import numpy as np

from specdec.runtime.backends.onnxruntime import OrtBackend
from specdec.runtime.packed import ROOT, SeqWork, pack

MAX_LEN = 48


def one_token_per_step(backend: OrtBackend, sequences: Sequence[list[int]]) -> list[np.ndarray]:
    """Each sequence alone in slot 0, one token per step: the logits of every position (the reference)."""
    out = []
    for tokens in sequences:
        cache = backend.allocate_cache(1, MAX_LEN)
        out.append(np.stack([backend.step(pack([SeqWork(0, i, [t])]), cache)[0].copy() for i, t in enumerate(tokens)]))
    return out


def random_steps(backend: OrtBackend, sequences: Sequence[list[int]], rng: random.Random) -> list[np.ndarray]:
    """All sequences in one cache, advanced together in random chunks (1 to 9 rows; some sit a step out), each in a
    random slot, with a random forest in a spare slot beside them now and then: every position's logits."""
    slots = rng.sample(range(len(sequences) + 2), len(sequences) + 1)
    cache = backend.allocate_cache(len(sequences) + 2, MAX_LEN)
    done = [0] * len(sequences)
    logits: list[list[np.ndarray]] = [[] for _ in sequences]
    while any(d < len(s) for d, s in zip(done, sequences)):
        work, owners = [], []
        for i, tokens in enumerate(sequences):
            if done[i] < len(tokens) and rng.random() < 0.8:
                n = min(rng.choice((1, 1, 2, 3, 5, 9)), len(tokens) - done[i])
                work.append(SeqWork(slots[i], done[i], tokens[done[i] : done[i] + n]))
                owners.append((i, n))
        if rng.random() < 0.3:  # a forest that is written and forgotten (its slot's past stays 0)
            forest = [rng.randrange(backend.vocab_size) for _ in range(4)]
            work.insert(rng.randrange(len(work) + 1), SeqWork(slots[-1], 0, forest, parents=[ROOT, 0, 0, ROOT]))
        if not owners:
            continue
        rows = backend.step(pack(work), cache)
        offset = 0
        for w in work:
            owner = next(((i, n) for i, n in owners if slots[i] == w.slot_id), None)
            if owner is not None:
                i, n = owner
                logits[i].extend(r.copy() for r in rows[offset : offset + n])
                done[i] += n
            offset += len(w.token_ids)
    return [np.stack(rows) for rows in logits]


def sequences_to_the_end(
    rng: random.Random, vocab_size: int, lengths: Sequence[int] = (MAX_LEN, 17, 30, 3)
) -> list[list[int]]:
    """Token sequences of several lengths, the first filling the whole context (its last row uses the spare
    position)."""
    return [[rng.randrange(vocab_size) for _ in range(n)] for n in lengths]


def differing_positions(want: Sequence[np.ndarray], got: Sequence[np.ndarray]) -> list[tuple[int, int]]:
    assert [w.shape for w in want] == [g.shape for g in got] and [w.dtype for w in want] == [g.dtype for g in got]
    return [
        (s, p) for s, (w, g) in enumerate(zip(want, got)) for p in range(w.shape[0]) if not np.array_equal(w[p], g[p])
    ]

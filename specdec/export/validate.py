"""Check an exported backend against the torch reference on random ragged forests.

An export is declared good only after its graph reproduced the reference logits on packs
that mix prefill, single-token decode, chains and forests of several trees per sequence,
idle slots and zero-token sequences — every shape the decoding loops will send it.
"""

from __future__ import annotations

import random

import numpy as np

from specdec.runtime.backends.base import Backend
from specdec.runtime.packed import ROOT, SeqWork, pack


def random_forest(rng: random.Random, size: int) -> list[int]:
    """Parents of a random forest of ``size`` nodes in topological order (several roots)."""
    return [ROOT if j == 0 or rng.random() < 0.25 else rng.randrange(j) for j in range(size)]


def random_packs(vocab: int, num_slots: int, max_len: int, seed: int = 0, rounds: int = 3) -> list[list[SeqWork]]:
    """Work lists of successive steps over the same slots: prefill first, then mixed steps."""
    rng = random.Random(seed)
    past = {slot: 0 for slot in range(num_slots)}
    steps: list[list[SeqWork]] = []
    idle = num_slots - 1  # never touched: must stay unchanged
    prefill = [
        SeqWork(s, 0, [rng.randrange(vocab) for _ in range(rng.randint(1, max_len // 4))], logits="last")
        for s in range(idle)
    ]
    steps.append(prefill)
    for w in prefill:
        past[w.slot_id] = len(w.token_ids)
    for _ in range(rounds):
        work = []
        for slot in range(idle):
            kind = rng.choice(["decode", "chain", "forest", "empty"])
            n = {"decode": 1, "chain": rng.randint(2, 6), "forest": rng.randint(3, 8), "empty": 0}[kind]
            n = min(n, max_len - past[slot])
            tokens = [rng.randrange(vocab) for _ in range(n)]
            parents = random_forest(rng, n) if kind == "forest" else None
            work.append(SeqWork(slot, past[slot], tokens, parents=parents))
            past[slot] += 1 if n else 0  # commit the first new token (a root), as a loop would
        rng.shuffle(work)
        steps.append(work)
    return steps


def max_logit_error(
    reference: Backend, candidate: Backend, *, num_slots: int = 4, max_len: int = 64, seed: int = 0
) -> float:
    """Largest |Δlogit| between ``candidate`` and ``reference`` over a few random ragged steps.

    Inputs cover the whole vocabulary the model reads; the logits compared are its head's
    columns, so both backends must agree on which token each column means.
    """
    ref_head, cand_head = getattr(reference, "head_token_ids", None), getattr(candidate, "head_token_ids", None)
    same_head = (ref_head is None) == (cand_head is None) and (
        ref_head is None or (cand_head is not None and np.array_equal(ref_head, cand_head))
    )
    if not same_head:
        raise ValueError(
            "the exported model's head_token_ids differ from the reference's: its logits columns would "
            "mean other tokens"
        )
    ref_cache = reference.allocate_cache(num_slots, max_len)
    cand_cache = candidate.allocate_cache(num_slots, max_len)
    worst = 0.0
    for work in random_packs(reference.vocab_size, num_slots, max_len, seed):
        batch = pack(work)
        want = reference.step(batch, ref_cache)
        got = candidate.step(batch, cand_cache)
        worst = max(worst, float(np.abs(want.astype(np.float32) - got.astype(np.float32)).max()))
    idle = num_slots - 1
    for (rk, rv), (ck, cv) in zip(ref_cache.read(idle, max_len), cand_cache.read(idle, max_len)):
        if not (np.array_equal(rk, ck.astype(rk.dtype)) and np.array_equal(rv, cv.astype(rv.dtype))):
            raise AssertionError("an idle KV slot was modified by the exported graph")
    return worst

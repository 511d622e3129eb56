"""``ragged_tree_attention`` against a naive per-token, per-head softmax written here."""

from __future__ import annotations

import math

import pytest
import torch
from forests import ROOT, Seq, mixed_batch, visible_new

from specdec.plugins.reference import ragged_tree_attention


def naive_attention(q, k, v, k_cache_before, v_cache_before, seqs, scale, cache_mask=None):
    """Dense float64 attention, token by token and head by head, KV heads repeated for GQA."""
    hq, hkv = q.shape[1], k.shape[1]
    group = hq // hkv
    out = torch.zeros(q.shape, dtype=torch.float64)
    start = 0
    for b, seq in enumerate(seqs):
        n = len(seq.parents)
        sees = visible_new(seq.parents)
        for t in range(n):
            for h in range(hq):
                kvh = h // group  # repeat_interleave layout: query heads [g*group, (g+1)*group) share KV head g
                keys, values = [], []
                for j in range(seq.past):
                    if cache_mask is None or bool(cache_mask[b, j]):
                        keys.append(k_cache_before[seq.slot, kvh, j].double())
                        values.append(v_cache_before[seq.slot, kvh, j].double())
                for j in range(n):
                    if sees[t, j]:
                        keys.append(k[start + j, kvh].double())
                        values.append(v[start + j, kvh].double())
                scores = torch.stack([q[start + t, h].double() @ key for key in keys]) * scale
                probs = torch.exp(scores - scores.max())
                probs = probs / probs.sum()
                out[start + t, h] = sum(p * val for p, val in zip(probs, values))
        start += n
    return out


def _random_parents(n: int, kind: str, gen: torch.Generator) -> list[int]:
    if kind == "chain":
        return [ROOT, *range(n - 1)]
    if kind == "forest":
        roots = int(torch.randint(2, max(3, n // 2 + 1), (1,), generator=gen))
        return [ROOT if j < roots else int(torch.randint(-1, j, (1,), generator=gen)) for j in range(n)]
    raise ValueError(kind)


def _random_batch(seed: int, num_slots: int = 6, max_len: int = 40):
    """A ragged batch mixing prefill, decode (n = 1), chains and forests; some slots stay idle."""
    gen = torch.Generator().manual_seed(seed)
    num_seqs = int(torch.randint(1, num_slots, (1,), generator=gen))  # at least one idle slot
    slots = torch.randperm(num_slots, generator=gen)[:num_seqs].tolist()
    seqs = []
    for i, slot in enumerate(slots):
        kind = ["prefill", "decode", "chain", "forest", "forest_past0"][(i + seed) % 5]
        n = int(torch.randint(1, 9, (1,), generator=gen))
        past = int(torch.randint(1, 20, (1,), generator=gen))
        if kind == "prefill":
            seqs.append(Seq(slot, 0, _random_parents(n, "chain", gen)))
        elif kind == "decode":
            seqs.append(Seq(slot, past, [ROOT]))
        elif kind == "chain":
            seqs.append(Seq(slot, past, _random_parents(n, "chain", gen)))
        elif kind == "forest":
            seqs.append(Seq(slot, past, _random_parents(max(n, 3), "forest", gen)))
        else:
            seqs.append(Seq(slot, 0, _random_parents(max(n, 3), "forest", gen)))
        assert seqs[-1].past + len(seqs[-1].parents) <= max_len
    return seqs


def _inputs(seqs, hq, hkv, d, num_slots, max_len, seed):
    gen = torch.Generator().manual_seed(1000 + seed)
    total = sum(len(s.parents) for s in seqs)
    q = torch.randn(total, hq, d, generator=gen)
    k = torch.randn(total, hkv, d, generator=gen)
    v = torch.randn(total, hkv, d, generator=gen)
    k_cache = torch.randn(num_slots, hkv, max_len, d, generator=gen)
    v_cache = torch.randn(num_slots, hkv, max_len, d, generator=gen)
    cu = [0]
    for s in seqs:
        cu.append(cu[-1] + len(s.parents))
    s_max = max(len(s.parents) for s in seqs)
    tree = torch.zeros(total, s_max, dtype=torch.bool)
    for b, s in enumerate(seqs):
        n = len(s.parents)
        tree[cu[b] : cu[b + 1], :n] = visible_new(s.parents)
    return q, k, v, k_cache, v_cache, cu, tree


def _run_and_check(seqs, hq, hkv, d, seed, num_slots=6, max_len=40, cache_mask=None):
    q, k, v, k_cache, v_cache, cu, tree = _inputs(seqs, hq, hkv, d, num_slots, max_len, seed)
    k_before, v_before = k_cache.clone(), v_cache.clone()
    scale = 1 / math.sqrt(d)
    out = ragged_tree_attention(
        q,
        k,
        v,
        k_cache,
        v_cache,
        cu,
        [s.past for s in seqs],
        [s.slot for s in seqs],
        tree,
        scale,
        cache_mask,
    )
    want = naive_attention(q, k, v, k_before, v_before, seqs, scale, cache_mask)
    assert out.shape == q.shape
    assert out.dtype == q.dtype
    err = (out.double() - want).abs().max().item()
    assert err < 1e-5, f"max |Δ| = {err}"

    # the cache: new K/V at [past, past + n) of each active slot, everything else bitwise unchanged
    k_expect, v_expect = k_before.clone(), v_before.clone()
    for b, s in enumerate(seqs):
        n = len(s.parents)
        k_expect[s.slot, :, s.past : s.past + n] = k[cu[b] : cu[b + 1]].transpose(0, 1)
        v_expect[s.slot, :, s.past : s.past + n] = v[cu[b] : cu[b + 1]].transpose(0, 1)
    assert torch.equal(k_cache, k_expect)
    assert torch.equal(v_cache, v_expect)
    idle = set(range(num_slots)) - {s.slot for s in seqs}
    assert idle, "every random batch leaves at least one slot idle"
    for slot in idle:
        assert torch.equal(k_cache[slot], k_before[slot])
        assert torch.equal(v_cache[slot], v_before[slot])
    return out


@pytest.mark.parametrize("heads", [(4, 2), (4, 4), (6, 2), (4, 1)], ids=["gqa2", "mha", "gqa3", "mqa"])
@pytest.mark.parametrize("seed", range(6))
def test_random_ragged_batches(seed: int, heads: tuple[int, int]) -> None:
    hq, hkv = heads
    seqs = _random_batch(seed)
    _run_and_check(seqs, hq, hkv, d=8, seed=seed)


def test_mixed_batch_all_kinds_at_once() -> None:
    seqs = mixed_batch()  # slot 2 idle
    _run_and_check(seqs, hq=4, hkv=2, d=16, seed=99)


def test_single_sequence_prefill_is_causal() -> None:
    seqs = [Seq(slot=1, past=0, parents=[ROOT, 0, 1, 2, 3, 4])]
    out = _run_and_check(seqs, hq=2, hkv=1, d=8, seed=5, num_slots=3, max_len=8)
    assert out.isfinite().all()


@pytest.mark.parametrize("seed", range(4))
def test_cache_mask_with_holes(seed: int) -> None:
    seqs = _random_batch(seed + 10)
    width = max(s.past for s in seqs) + 3  # the mask may be wider than the longest past
    gen = torch.Generator().manual_seed(seed)
    cache_mask = torch.rand(len(seqs), width, generator=gen) > 0.4
    cache_mask[0, :] = True  # one row without holes
    if len(seqs) > 1 and seqs[1].past:
        cache_mask[1, : seqs[1].past] = False  # one row whose whole past is masked out
    _run_and_check(seqs, hq=4, hkv=2, d=8, seed=seed, cache_mask=cache_mask)


def test_cache_mask_hides_decode_token_history() -> None:
    """A single new token (the fast path without a mask) must still honour the holes."""
    seqs = [Seq(slot=0, past=6, parents=[ROOT]), Seq(slot=2, past=3, parents=[ROOT])]
    cache_mask = torch.tensor([[True, False, True, False, False, True], [False, True, True, True, True, True]])
    _run_and_check(seqs, hq=4, hkv=2, d=8, seed=3, num_slots=3, max_len=10, cache_mask=cache_mask)


def test_holes_change_the_result() -> None:
    """Sanity check of the test itself: a hole really changes the output."""
    seqs = [Seq(slot=0, past=5, parents=[ROOT, 0])]
    full = _run_and_check(seqs, hq=2, hkv=2, d=8, seed=1, num_slots=2, max_len=8)
    holes = _run_and_check(
        seqs,
        hq=2,
        hkv=2,
        d=8,
        seed=1,
        num_slots=2,
        max_len=8,
        cache_mask=torch.tensor([[True, False, True, True, True]]),
    )
    assert (full - holes).abs().max() > 1e-3


def test_no_attention_across_sequences() -> None:
    """Changing one sequence's inputs leaves the other sequences' outputs bitwise unchanged."""
    seqs = [Seq(0, 3, [ROOT, 0]), Seq(1, 2, [ROOT, ROOT, 0]), Seq(2, 0, [ROOT, 0, 1])]
    q, k, v, k_cache, v_cache, cu, tree = _inputs(seqs, 4, 2, 8, 4, 12, seed=7)
    args = (cu, [s.past for s in seqs], [s.slot for s in seqs], tree, 8**-0.5)
    out1 = ragged_tree_attention(q, k, v, k_cache.clone(), v_cache.clone(), *args)
    k2, v2, kc2 = k.clone(), v.clone(), k_cache.clone()
    k2[cu[1] : cu[2]] += 1.0
    v2[cu[1] : cu[2]] -= 1.0
    kc2[1] += 0.5
    out2 = ragged_tree_attention(q, k2, v2, kc2, v_cache.clone(), *args)
    assert torch.equal(out1[cu[0] : cu[1]], out2[cu[0] : cu[1]])
    assert torch.equal(out1[cu[2] : cu[3]], out2[cu[2] : cu[3]])
    assert not torch.equal(out1[cu[1] : cu[2]], out2[cu[1] : cu[2]])

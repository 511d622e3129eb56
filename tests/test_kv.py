"""KVCacheManager over a real ``TorchKVStorage``: bookkeeping invariants and cache contents."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from specdec.models.loading import LoadedModel, tiny_random
from specdec.runtime.backends.torch_backend import TorchBackend, TorchKVStorage
from specdec.runtime.kv import ContextOverflowError, KVCacheManager, KVCapacityError
from specdec.runtime.packed import ROOT, SeqWork, pack

NUM_SLOTS, MAX_LEN = 4, 12

_BACKEND: TorchBackend | None = None


def _tiny_backend() -> TorchBackend:
    """A tiny TorchBackend shared by the property tests (built once, cheap)."""
    global _BACKEND
    if _BACKEND is None:
        _BACKEND = TorchBackend(tiny_random(seed=1, init_std=0.1))
    return _BACKEND


@pytest.fixture(scope="module")
def backend(tiny_pair: tuple[LoadedModel, LoadedModel]) -> TorchBackend:
    return TorchBackend(tiny_pair[0])


# -- property-based: the manager as a state machine ---------------------------------------


class KVMachine(RuleBasedStateMachine):
    """Random alloc / write / commit / commit_padded / fork / truncate / free sequences.

    The model keeps, for every live slot, the values that must be committed at positions
    ``[0, length)`` and the values a ragged step wrote at ``length + i`` since the last
    commit. Values are distinct floats written into every layer, K and V, so any move to
    the wrong place, wrong slot or wrong layer shows up in ``storage.read``.
    """

    def __init__(self) -> None:
        super().__init__()
        self.storage: TorchKVStorage = _tiny_backend().allocate_cache(NUM_SLOTS, MAX_LEN)
        self.kv = KVCacheManager(self.storage)
        self.committed: dict[int, list[float]] = {}  # slot -> value id at each committed position
        self.holes: dict[int, set[int]] = {}  # slot -> hole positions (padded baseline)
        self.scratch: dict[int, list[float]] = {}  # slot -> values written at length + i
        self.counter = itertools.count(1)

    # helpers
    def _write(self, slot: int, pos: int, value: float) -> None:
        for layer, (k, v) in enumerate(zip(self.storage.k, self.storage.v)):
            k[slot, :, pos] = value + 1000.0 * layer
            v[slot, :, pos] = -value - 1000.0 * layer

    def _expected_kv(self, values: list[float]) -> list[tuple[np.ndarray, np.ndarray]]:
        heads, dim = self.storage.k[0].shape[1], self.storage.k[0].shape[3]
        out = []
        for layer in range(len(self.storage.k)):
            col = np.asarray(values, dtype=np.float32) + np.float32(1000.0 * layer)
            k = np.broadcast_to(col[None, :, None], (heads, len(values), dim))
            out.append((k, -k))
        return out

    def _unallocated(self) -> list[int]:
        return [s for s in range(NUM_SLOTS) if s not in self.committed]

    # rules
    @rule()
    def alloc(self) -> None:
        if len(self.committed) == NUM_SLOTS:
            with pytest.raises(KVCapacityError):
                self.kv.alloc()
            return
        slot = self.kv.alloc()
        assert slot not in self.committed
        assert 0 <= slot < NUM_SLOTS
        self.committed[slot], self.holes[slot], self.scratch[slot] = [], set(), []
        assert self.kv.length(slot) == 0

    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        slot = data.draw(st.integers(0, NUM_SLOTS - 1))
        if slot not in self.committed:
            with pytest.raises(KeyError):
                self.kv.free(slot)
            return
        self.kv.free(slot)
        del self.committed[slot], self.holes[slot], self.scratch[slot]

    @precondition(lambda self: self.committed)
    @rule(data=st.data(), n=st.integers(1, 5))
    def write_step(self, data: st.DataObject, n: int) -> None:
        """What a ragged step does: n new K/V rows at ``length .. length + n - 1``."""
        slot = data.draw(st.sampled_from(sorted(self.committed)))
        base = self.kv.length(slot)
        n = min(n, MAX_LEN - base)
        values = [float(next(self.counter)) for _ in range(n)]
        for i, value in enumerate(values):
            self._write(slot, base + i, value)
        self.scratch[slot] = values + self.scratch[slot][n:]

    @precondition(lambda self: any(self.scratch.values()))
    @rule(data=st.data())
    def commit_accepted(self, data: st.DataObject) -> None:
        """Accept a subset of the written rows (a tree path: increasing offsets)."""
        slot = data.draw(st.sampled_from(sorted(s for s, v in self.scratch.items() if v)))
        written = self.scratch[slot]
        if data.draw(st.booleans()):
            offsets: list[int] | int = data.draw(st.integers(0, len(written)))  # a chain
            accepted = written[: int(offsets)]
        else:
            keep = data.draw(st.lists(st.booleans(), min_size=len(written), max_size=len(written)))
            offsets = [i for i, k in enumerate(keep) if k]
            accepted = [written[i] for i in offsets]
        self.kv.commit(slot, offsets)
        self.committed[slot] += accepted
        self.scratch[slot] = []

    @precondition(lambda self: self.committed)
    @rule(data=st.data(), extra=st.integers(1, 4))
    def commit_past_context(self, data: st.DataObject, extra: int) -> None:
        slot = data.draw(st.sampled_from(sorted(self.committed)))
        room = self.kv.room(slot)
        with pytest.raises(ContextOverflowError):
            self.kv.commit(slot, room + extra)
        with pytest.raises(ContextOverflowError):
            self.kv.commit(slot, [room + extra - 1])
        with pytest.raises(ContextOverflowError):
            self.kv.ensure_room(slot, room + extra)
        self.kv.ensure_room(slot, room)

    @precondition(lambda self: self.committed)
    @rule(data=st.data())
    def commit_padded(self, data: st.DataObject) -> None:
        slot = data.draw(st.sampled_from(sorted(self.committed)))
        room = self.kv.room(slot)
        advance = data.draw(st.integers(0, room))
        accepted = data.draw(st.integers(0, advance))
        base = len(self.committed[slot])
        values = [float(next(self.counter)) for _ in range(advance)]
        for i, value in enumerate(values):
            self._write(slot, base + i, value)
        self.kv.commit_padded(slot, accepted, advance)
        self.committed[slot] += values
        self.holes[slot] |= set(range(base + accepted, base + advance))
        self.scratch[slot] = []

    @precondition(lambda self: self.committed)
    @rule(data=st.data())
    def truncate(self, data: st.DataObject) -> None:
        slot = data.draw(st.sampled_from(sorted(self.committed)))
        length = data.draw(st.integers(0, len(self.committed[slot])))
        self.kv.truncate(slot, length)
        self.committed[slot] = self.committed[slot][:length]
        self.holes[slot] = {h for h in self.holes[slot] if h < length}
        self.scratch[slot] = []
        with pytest.raises(ValueError):
            self.kv.truncate(slot, length + 1)
        with pytest.raises(ValueError):
            self.kv.truncate(slot, -1)

    @precondition(lambda self: self.committed)
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        slot = data.draw(st.sampled_from(sorted(self.committed)))
        if len(self.committed) == NUM_SLOTS:
            with pytest.raises(KVCapacityError):
                self.kv.fork(slot)
            return
        new = self.kv.fork(slot)
        assert new not in self.committed
        self.committed[new] = list(self.committed[slot])
        self.holes[new] = set(self.holes[slot])
        self.scratch[new] = []

    @rule(data=st.data())
    def unallocated_slots_raise_key_error(self, data: st.DataObject) -> None:
        free = self._unallocated()
        slot = data.draw(st.sampled_from([*free, NUM_SLOTS, -1]))
        for call in (
            lambda: self.kv.length(slot),
            lambda: self.kv.num_tokens(slot),
            lambda: self.kv.room(slot),
            lambda: self.kv.commit(slot, 1),
            lambda: self.kv.commit_padded(slot, 0, 1),
            lambda: self.kv.truncate(slot, 0),
            lambda: self.kv.fork(slot),
            lambda: self.kv.free(slot),
        ):
            with pytest.raises(KeyError):
                call()

    @precondition(lambda self: self.committed)
    @rule(data=st.data())
    def bad_offsets_are_refused(self, data: st.DataObject) -> None:
        slot = data.draw(st.sampled_from(sorted(self.committed)))
        bad = data.draw(st.sampled_from([[1, 0], [0, 0], [-1], [2, 1, 3]]))
        with pytest.raises(ValueError):
            self.kv.commit(slot, bad)
        with pytest.raises(ValueError):
            self.kv.commit_padded(slot, 2, 1)

    # invariants
    @invariant()
    def bookkeeping(self) -> None:
        assert self.kv.num_free + len(self.committed) == NUM_SLOTS
        assert self.kv.live_slots == sorted(self.committed)
        for slot, values in self.committed.items():
            assert self.kv.length(slot) == len(values)
            assert self.kv.num_tokens(slot) == len(values) - len(self.holes[slot])
            assert self.kv.room(slot) == MAX_LEN - len(values)

    @invariant()
    def cache_mask_marks_holes(self) -> None:
        slots = sorted(self.committed)
        mask = self.kv.cache_mask(slots)
        if mask is None:
            assert not any(self.holes[s] for s in slots)
            return
        assert mask.shape == (len(slots), MAX_LEN)
        for row, slot in enumerate(slots):
            length = len(self.committed[slot])
            want = np.array([p not in self.holes[slot] for p in range(length)], dtype=bool)
            assert np.array_equal(mask[row, :length], want)

    @invariant()
    def committed_contents(self) -> None:
        for slot, values in self.committed.items():
            got = self.storage.read(slot, len(values))
            for (k, v), (k_want, v_want) in zip(got, self._expected_kv(values)):
                assert np.array_equal(k, k_want)
                assert np.array_equal(v, v_want)


KVMachine.TestCase.settings = settings(
    max_examples=50,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestKVMachine = KVMachine.TestCase


# -- targeted unit tests -----------------------------------------------------------------


def _storage(num_slots: int = 3, max_len: int = 8) -> TorchKVStorage:
    return _tiny_backend().allocate_cache(num_slots, max_len)


def test_alloc_hands_out_slot_zero_first_and_reuses_freed_slots() -> None:
    kv = KVCacheManager(_storage())
    assert [kv.alloc(), kv.alloc(), kv.alloc()] == [0, 1, 2]
    assert kv.num_free == 0
    with pytest.raises(KVCapacityError, match="3"):
        kv.alloc()
    kv.commit(1, 4)
    kv.free(1)
    assert kv.num_free == 1
    assert kv.alloc() == 1
    assert kv.length(1) == 0  # a reused slot starts empty
    with pytest.raises(KeyError):
        kv.free(7)


def test_freed_slot_forgets_its_holes() -> None:
    kv = KVCacheManager(_storage())
    slot = kv.alloc()
    kv.commit_padded(slot, 1, 3)
    assert kv.num_tokens(slot) == 1
    kv.free(slot)
    assert kv.alloc() == slot
    kv.commit(slot, 3)
    assert kv.num_tokens(slot) == 3
    assert kv.cache_mask([slot]) is None


def test_commit_moves_tree_path_to_the_front() -> None:
    storage = _storage(num_slots=2, max_len=10)
    kv = KVCacheManager(storage)
    slot = kv.alloc()
    other = kv.alloc()
    for layer in range(len(storage.k)):
        for pos in range(10):
            storage.k[layer][slot, :, pos] = 100 * layer + pos
            storage.v[layer][slot, :, pos] = -(100 * layer + pos)
        storage.k[layer][other] = 7.0
    kv.commit(slot, 3)  # positions 0..2 committed as a chain: no move
    before = storage.read(slot, 10)
    kv.commit(slot, [1, 3, 4])  # tree path at 3 + [1, 3, 4] = [4, 6, 7] -> [3, 4, 5]
    assert kv.length(slot) == 6
    after = storage.read(slot, 10)
    for layer, ((k, v), (k0, v0)) in enumerate(zip(after, before)):
        assert np.array_equal(k[:, :3], k0[:, :3])  # the committed prefix is untouched
        assert np.array_equal(v[:, :3], v0[:, :3])
        assert k[:, 3:6, 0].tolist() == [[100 * layer + p for p in (4, 6, 7)]] * k.shape[0]
        assert v[:, 3:6, 0].tolist() == [[-(100 * layer + p) for p in (4, 6, 7)]] * v.shape[0]
        assert (storage.k[layer][other] == 7.0).all()  # other slots untouched


def test_commit_chain_is_a_noop_move() -> None:
    storage = _storage()
    kv = KVCacheManager(storage)
    slot = kv.alloc()
    storage.k[0][slot].normal_()
    before = storage.k[0].clone()
    kv.commit(slot, [0, 1, 2])
    kv.commit(slot, 2)
    kv.commit(slot, [])
    assert kv.length(slot) == 5
    assert torch.equal(storage.k[0], before)


def test_commit_negative_count_is_refused() -> None:
    kv = KVCacheManager(_storage())
    slot = kv.alloc()
    kv.commit(slot, 3)
    with pytest.raises(ValueError):
        kv.commit(slot, -2)


def test_context_overflow() -> None:
    kv = KVCacheManager(_storage(max_len=8))
    slot = kv.alloc()
    kv.commit(slot, 6)
    with pytest.raises(ContextOverflowError, match="exceed the context of 8"):
        kv.commit(slot, 3)
    with pytest.raises(ContextOverflowError):
        kv.commit(slot, [0, 2])
    with pytest.raises(ContextOverflowError):
        kv.commit_padded(slot, 1, 3)
    assert kv.length(slot) == 6  # a refused commit changes nothing
    kv.commit(slot, [0, 1])
    assert kv.room(slot) == 0


# -- with a real model: compaction equals a from-scratch prefill -------------------------


def _random_forest(n: int, roots: int, gen: np.random.Generator) -> list[int]:
    return [ROOT if j < roots else int(gen.integers(-1, j)) for j in range(n)]


def _path_to(parents: list[int], node: int) -> list[int]:
    path = []
    while node != ROOT:
        path.append(node)
        node = parents[node]
    return path[::-1]


def _assert_same_kv(storage: TorchKVStorage, slot_a: int, slot_b: int, length: int) -> None:
    for layer, ((ka, va), (kb, vb)) in enumerate(zip(storage.read(slot_a, length), storage.read(slot_b, length))):
        assert np.allclose(ka, kb, atol=1e-5), f"layer {layer} K: max |Δ| {np.abs(ka - kb).max()}"
        assert np.allclose(va, vb, atol=1e-5), f"layer {layer} V: max |Δ| {np.abs(va - vb).max()}"


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**16))
def test_compaction_equals_from_scratch_prefill(seed: int) -> None:
    """Prefill, verify forests (several trees, several sequences in one pack), commit an accepted
    root-to-leaf path: the slot must then hold exactly the K/V of prefilling prompt + path."""
    backend = _tiny_backend()
    storage = backend.allocate_cache(6, 48)
    kv = KVCacheManager(storage)
    gen = np.random.default_rng(seed)
    vocab = backend.vocab_size
    num_seqs = 2
    slots = [kv.alloc() for _ in range(num_seqs)]
    prompts = [gen.integers(0, vocab, int(gen.integers(1, 12))).tolist() for _ in range(num_seqs)]
    backend.step(pack([SeqWork(s, 0, p, logits="last") for s, p in zip(slots, prompts)]), storage)
    for s, p in zip(slots, prompts):
        kv.commit(s, len(p))

    forests, tokens = [], []
    for _ in slots:
        n = int(gen.integers(3, 14))
        roots = int(gen.integers(2, 4))
        forests.append(_random_forest(n, roots, gen))
        tokens.append(gen.integers(0, vocab, n).tolist())
    work = [SeqWork(s, kv.length(s), t, parents=f) for s, t, f in zip(slots, tokens, forests)]
    backend.step(pack(work), storage)

    paths = []
    for s, t, f in zip(slots, tokens, forests):
        leaves = [j for j in range(len(f)) if j not in f]
        leaf = leaves[int(gen.integers(0, len(leaves)))]
        path = _path_to(f, leaf)
        kv.commit(s, path)
        paths.append([t[j] for j in path])

    for s, p, path in zip(slots, prompts, paths):
        ref = kv.alloc()
        full = p + path
        backend.step(pack([SeqWork(ref, 0, full, logits="none")]), storage)
        kv.commit(ref, len(full))
        assert kv.length(s) == len(full)
        _assert_same_kv(storage, s, ref, len(full))
        kv.free(ref)

    # the compacted slot continues exactly like the from-scratch one
    nxt = [int(gen.integers(0, vocab)) for _ in slots]
    got = backend.step(pack([SeqWork(s, kv.length(s), [x]) for s, x in zip(slots, nxt)]), storage)
    ref_slot = kv.alloc()
    for i, (p, path, x) in enumerate(zip(prompts, paths, nxt)):
        want = backend.step(pack([SeqWork(ref_slot, 0, [*p, *path, x], logits="last")]), storage)
        assert np.allclose(got[i], want[0], atol=1e-5)


def test_compaction_with_inner_node_accepted(backend: TorchBackend) -> None:
    """Accepting a path that stops at an inner node (not a leaf) also compacts correctly."""
    storage = backend.allocate_cache(3, 32)
    kv = KVCacheManager(storage)
    slot = kv.alloc()
    prompt = [5, 9, 17, 3, 44]
    backend.step(pack([SeqWork(slot, 0, prompt)]), storage)
    kv.commit(slot, len(prompt))
    parents = [ROOT, ROOT, 0, 1, 2, 2, ROOT, 4]
    tokens = [60, 61, 62, 63, 64, 65, 66, 67]
    backend.step(pack([SeqWork(slot, kv.length(slot), tokens, parents=parents)]), storage)
    kv.commit(slot, [0, 2, 4])  # 60 -> 62 -> 64; node 7 (child of 4) rejected
    ref = kv.alloc()
    full = [*prompt, 60, 62, 64]
    backend.step(pack([SeqWork(ref, 0, full)]), storage)
    kv.commit(ref, len(full))
    _assert_same_kv(storage, slot, ref, len(full))


def test_fork_copies_prefix_and_diverges_independently(backend: TorchBackend) -> None:
    storage = backend.allocate_cache(4, 32)
    kv = KVCacheManager(storage)
    src = kv.alloc()
    prompt = [1, 2, 3, 4, 5, 6, 7]
    backend.step(pack([SeqWork(src, 0, prompt)]), storage)
    kv.commit(src, len(prompt))
    src_before = storage.read(src, 32)

    new = kv.fork(src)
    assert new != src
    assert kv.length(new) == len(prompt)
    _assert_same_kv(storage, src, new, len(prompt))
    for (ka, va), (kb, vb) in zip(storage.read(src, len(prompt)), storage.read(new, len(prompt))):
        assert np.array_equal(ka, kb) and np.array_equal(va, vb)  # a copy, bit for bit

    # the two beams continue differently; each matches its own from-scratch prefill
    la = backend.step(pack([SeqWork(new, kv.length(new), [50, 51])]), storage)
    kv.commit(new, 2)
    for (k0, v0), (k1, v1) in zip(src_before, storage.read(src, 32)):
        assert np.array_equal(k0, k1) and np.array_equal(v0, v1)  # writes to the fork leave the source alone
    fork_after = storage.read(new, kv.length(new))
    lb = backend.step(pack([SeqWork(src, kv.length(src), [70])]), storage)
    kv.commit(src, 1)
    for (k0, v0), (k1, v1) in zip(fork_after, storage.read(new, kv.length(new))):
        assert np.array_equal(k0, k1) and np.array_equal(v0, v1)  # writes to the source leave the fork alone

    ref = kv.alloc()
    want_a = backend.step(pack([SeqWork(ref, 0, [*prompt, 50, 51])]), storage)
    assert np.allclose(la, want_a[-2:], atol=1e-5)
    _assert_same_kv(storage, new, ref, len(prompt) + 2)
    want_b = backend.step(pack([SeqWork(ref, 0, [*prompt, 70], logits="last")]), storage)
    assert np.allclose(lb, want_b, atol=1e-5)


def test_padded_holes_are_invisible(backend: TorchBackend) -> None:
    """Padded baseline: rows committed as holes are masked, later tokens see only the real ones."""
    storage = backend.allocate_cache(2, 32)
    kv = KVCacheManager(storage)
    slot = kv.alloc()
    prompt = [7, 8, 9, 10]
    backend.step(pack([SeqWork(slot, 0, prompt, logits="last")]), storage)
    kv.commit(slot, len(prompt))
    # three rows fed ([a, pad, pad]); one accepted, the write position advances by three
    backend.step(pack([SeqWork(slot, kv.length(slot), [40, 41, 42], position_offset=kv.num_tokens(slot))]), storage)
    kv.commit_padded(slot, 1, 3)
    assert (kv.length(slot), kv.num_tokens(slot)) == (7, 5)
    mask = kv.cache_mask([slot])
    assert mask is not None and mask[0, :7].tolist() == [True] * 5 + [False] * 2
    got = backend.step(
        pack([SeqWork(slot, kv.length(slot), [50, 51], position_offset=kv.num_tokens(slot))], cache_mask=mask),
        storage,
    )
    ref = kv.alloc()
    want = backend.step(pack([SeqWork(ref, 0, [*prompt, 40, 50, 51])]), storage)
    assert np.allclose(got, want[-2:], atol=1e-5)


def test_fork_keeps_holes() -> None:
    kv = KVCacheManager(_storage(num_slots=3, max_len=10))
    slot = kv.alloc()
    kv.commit_padded(slot, 2, 4)
    new = kv.fork(slot)
    assert kv.num_tokens(new) == 2 and kv.length(new) == 4
    mask = kv.cache_mask([slot, new])
    assert mask is not None
    assert np.array_equal(mask[0], mask[1])
    kv.commit_padded(new, 0, 2)  # the copy's holes are its own
    assert kv.num_tokens(slot) == 2 and kv.num_tokens(new) == 2
    assert kv.length(slot) == 4 and kv.length(new) == 6

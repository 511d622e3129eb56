"""``pack()``: the packed ragged batch built from per-sequence work items."""

from __future__ import annotations

import numpy as np
import pytest
from forests import visible_new

from specdec.runtime.packed import ROOT, PackedBatch, SeqWork, pack


def _mask(rows: list[str]) -> np.ndarray:
    """Bool matrix from strings of '1' (True) and '.' (False)."""
    return np.array([[c == "1" for c in row] for row in rows], dtype=bool)


def _i32(values: list[int]) -> np.ndarray:
    return np.array(values, dtype=np.int32)


def _i64(values: list[int]) -> np.ndarray:
    return np.array(values, dtype=np.int64)


def _assert_batch(batch: PackedBatch, **expected: np.ndarray) -> None:
    for name, want in expected.items():
        got = getattr(batch, name)
        assert got.dtype == want.dtype, f"{name}: dtype {got.dtype} != {want.dtype}"
        assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
        assert np.array_equal(got, want), f"{name}:\n{got}\n!=\n{want}"


# -- the docstring's worked example -------------------------------------------------------

P0, P1, P2, X0, X1, A, B, C = 10, 11, 12, 20, 21, 30, 31, 32


def _worked_example(**kw: object) -> list[SeqWork]:
    return [
        SeqWork(slot_id=4, past_len=0, token_ids=[P0, P1, P2], **kw),
        SeqWork(slot_id=0, past_len=7, token_ids=[X0, X1], **kw),
        SeqWork(slot_id=2, past_len=5, token_ids=[A, B, C], parents=[ROOT, ROOT, 0], **kw),
    ]


def test_worked_example_exact() -> None:
    batch = pack(_worked_example())
    _assert_batch(
        batch,
        input_ids=_i64([P0, P1, P2, X0, X1, A, B, C]),
        position_ids=_i64([0, 1, 2, 7, 8, 5, 5, 6]),
        cu_seqlens=_i32([0, 3, 5, 8]),
        past_lens=_i32([0, 7, 5]),
        slot_ids=_i32([4, 0, 2]),
        tree_mask=_mask(
            [
                "1..",  # p0
                "11.",  # p1
                "111",  # p2
                "1..",  # x0
                "11.",  # x1
                "1..",  # a
                ".1.",  # b
                "1.1",  # c
            ]
        ),
        logits_indices=_i32(list(range(8))),
    )
    assert batch.cache_mask is None
    assert batch.num_tokens == 8
    assert batch.num_seqs == 3


def test_worked_example_logits_last() -> None:
    batch = pack(_worked_example(logits="last"))
    _assert_batch(batch, logits_indices=_i32([2, 4, 7]))


# -- chains ---------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 5])
def test_chain_is_lower_triangular(n: int) -> None:
    batch = pack([SeqWork(slot_id=1, past_len=3, token_ids=list(range(n)))])
    _assert_batch(
        batch,
        input_ids=_i64(list(range(n))),
        position_ids=_i64([3 + i for i in range(n)]),
        cu_seqlens=_i32([0, n]),
        past_lens=_i32([3]),
        slot_ids=_i32([1]),
        tree_mask=np.tri(n, dtype=bool),
        logits_indices=_i32(list(range(n))),
    )


def test_explicit_chain_parents_equal_implicit_chain() -> None:
    implicit = pack([SeqWork(0, 4, [5, 6, 7, 8])])
    explicit = pack([SeqWork(0, 4, [5, 6, 7, 8], parents=[ROOT, 0, 1, 2])])
    for name in ("input_ids", "position_ids", "cu_seqlens", "past_lens", "slot_ids", "tree_mask", "logits_indices"):
        assert np.array_equal(getattr(implicit, name), getattr(explicit, name)), name


def test_tree_mask_width_is_longest_sequence() -> None:
    batch = pack([SeqWork(0, 0, [1]), SeqWork(1, 2, [1, 2, 3, 4, 5]), SeqWork(2, 9, [1, 2])])
    assert batch.tree_mask.shape == (8, 5)
    # rows of shorter sequences never see beyond their own length
    _assert_batch(
        batch,
        tree_mask=_mask(
            [
                "1....",
                "1....",
                "11...",
                "111..",
                "1111.",
                "11111",
                "1....",
                "11...",
            ]
        ),
    )


def test_position_offset_overrides_past_for_positions_only() -> None:
    batch = pack([SeqWork(3, past_len=10, token_ids=[1, 2, 3], position_offset=7)])
    _assert_batch(batch, position_ids=_i64([7, 8, 9]), past_lens=_i32([10]))
    tree = pack([SeqWork(3, past_len=10, token_ids=[1, 2, 3], parents=[ROOT, ROOT, 1], position_offset=7)])
    _assert_batch(tree, position_ids=_i64([7, 7, 8]), past_lens=_i32([10]))
    zero = pack([SeqWork(3, past_len=10, token_ids=[1, 2], position_offset=0)])  # 0 is not "unset"
    _assert_batch(zero, position_ids=_i64([0, 1]), past_lens=_i32([10]))


# -- forests --------------------------------------------------------------------------------


def _depths(parents: list[int]) -> list[int]:
    out = []
    for j in range(len(parents)):
        d, node = 0, parents[j]
        while node != ROOT:
            d, node = d + 1, parents[node]
        out.append(d)
    return out


def test_forest_three_trees_depths_and_ancestors() -> None:
    #  tree 1: 0 -> 1 -> 3 -> 6 ; 1 -> 4     tree 2: 2 -> 5     tree 3: 7 (lone root)
    parents = [ROOT, 0, ROOT, 1, 1, 2, 3, ROOT]
    batch = pack([SeqWork(5, past_len=11, token_ids=list(range(100, 108)), parents=parents)])
    _assert_batch(
        batch,
        position_ids=_i64([11, 12, 11, 13, 13, 12, 14, 11]),
        tree_mask=_mask(
            [
                "1.......",
                "11......",
                "..1.....",
                "11.1....",
                "11..1...",
                "..1..1..",
                "11.1..1.",
                ".......1",
            ]
        ),
    )
    assert np.array_equal(batch.tree_mask, visible_new(parents).numpy())


def test_random_forests_match_ancestor_definition() -> None:
    gen = np.random.default_rng(0)
    work, masks, positions = [], [], []
    for seq in range(6):
        n = int(gen.integers(1, 12))
        parents = [int(gen.integers(-1, j)) if j else ROOT for j in range(n)]
        past = int(gen.integers(0, 20))
        work.append(SeqWork(seq, past, list(range(n)), parents=parents))
        masks.append(visible_new(parents).numpy())
        positions.extend(past + d for d in _depths(parents))
    batch = pack(work)
    s_max = max(m.shape[0] for m in masks)
    assert batch.tree_mask.shape == (sum(m.shape[0] for m in masks), s_max)
    start = 0
    for m in masks:
        n = m.shape[0]
        assert np.array_equal(batch.tree_mask[start : start + n, :n], m)
        assert not batch.tree_mask[start : start + n, n:].any()
        start += n
    _assert_batch(batch, position_ids=_i64(positions))


def test_every_row_sees_itself() -> None:
    batch = pack(_worked_example())
    cu = batch.cu_seqlens.tolist()
    for b in range(batch.num_seqs):
        for j in range(cu[b + 1] - cu[b]):
            assert batch.tree_mask[cu[b] + j, j]


@pytest.mark.parametrize("parents", [[0], [ROOT, 1], [ROOT, 2, ROOT], [ROOT, -2], [ROOT, ROOT, 5]])
def test_parent_must_precede_child(parents: list[int]) -> None:
    with pytest.raises(ValueError, match="parents must precede"):
        pack([SeqWork(0, 0, list(range(len(parents))), parents=parents)])


def test_parents_length_must_match_tokens() -> None:
    with pytest.raises(ValueError):
        pack([SeqWork(0, 0, [1, 2, 3], parents=[ROOT])])


@pytest.mark.parametrize("offsets", [[2], [-1]])
def test_explicit_logit_offsets_must_be_in_range(offsets: list[int]) -> None:
    with pytest.raises((ValueError, IndexError)):
        pack([SeqWork(0, 0, [1, 2, 3]), SeqWork(1, 0, [4, 5], logits=offsets), SeqWork(2, 0, [6, 7])])


# -- empty sequences, slots ----------------------------------------------------------------


def test_sequences_with_no_tokens_are_dropped() -> None:
    batch = pack(
        [
            SeqWork(0, 3, []),
            SeqWork(1, 4, [7, 8]),
            SeqWork(2, 5, [], parents=[]),
            SeqWork(3, 6, [9], logits="last"),
            SeqWork(4, 9, []),
        ]
    )
    _assert_batch(
        batch,
        input_ids=_i64([7, 8, 9]),
        position_ids=_i64([4, 5, 6]),
        cu_seqlens=_i32([0, 2, 3]),
        past_lens=_i32([4, 6]),
        slot_ids=_i32([1, 3]),
        tree_mask=_mask(["1.", "11", "1."]),
        logits_indices=_i32([0, 1, 2]),
    )


def test_all_empty_gives_an_empty_batch() -> None:
    batch = pack([SeqWork(0, 3, []), SeqWork(1, 0, [])])
    assert batch.num_tokens == 0
    assert batch.num_seqs == 0
    _assert_batch(batch, cu_seqlens=_i32([0]), logits_indices=_i32([]), past_lens=_i32([]), slot_ids=_i32([]))
    assert pack([]).num_tokens == 0


def test_non_contiguous_active_slots() -> None:
    """Slots 0 and 2 are active, slot 1 is idle (absent or with an empty work item)."""
    for work in (
        [SeqWork(0, 5, [1, 2, 3]), SeqWork(2, 1, [4, 5], parents=[ROOT, ROOT])],
        [SeqWork(0, 5, [1, 2, 3]), SeqWork(1, 8, []), SeqWork(2, 1, [4, 5], parents=[ROOT, ROOT])],
    ):
        batch = pack(work)
        _assert_batch(
            batch,
            input_ids=_i64([1, 2, 3, 4, 5]),
            position_ids=_i64([5, 6, 7, 1, 1]),
            cu_seqlens=_i32([0, 3, 5]),
            past_lens=_i32([5, 1]),
            slot_ids=_i32([0, 2]),
            tree_mask=_mask(["1..", "11.", "111", "1..", ".1."]),
            logits_indices=_i32([0, 1, 2, 3, 4]),
        )


def test_slot_order_follows_work_order() -> None:
    batch = pack([SeqWork(7, 0, [1]), SeqWork(3, 0, [2]), SeqWork(5, 0, [3])])
    _assert_batch(batch, slot_ids=_i32([7, 3, 5]), cu_seqlens=_i32([0, 1, 2, 3]))


# -- logits selection ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("modes", "expected"),
    [
        (["all", "all", "all"], [0, 1, 2, 3, 4, 5, 6]),
        (["last", "last", "last"], [2, 4, 6]),
        (["none", "none", "none"], []),
        (["none", "all", "last"], [3, 4, 6]),
        (["last", "none", "all"], [2, 5, 6]),
        ([[0, 2], [1], []], [0, 2, 4]),
        ([[1], "last", [0, 1]], [1, 4, 5, 6]),
    ],
)
def test_logits_selection(modes: list, expected: list[int]) -> None:
    work = [
        SeqWork(0, 0, [1, 2, 3], logits=modes[0]),
        SeqWork(1, 4, [4, 5], logits=modes[1]),
        SeqWork(2, 2, [6, 7], parents=[ROOT, ROOT], logits=modes[2]),
    ]
    batch = pack(work)
    _assert_batch(batch, logits_indices=_i32(expected))
    assert sum(len(w.logit_offsets()) for w in work) == len(expected)


def test_logits_of_dropped_sequence_are_dropped() -> None:
    batch = pack([SeqWork(0, 1, [], logits="last"), SeqWork(1, 1, [5, 6], logits="last")])
    _assert_batch(batch, logits_indices=_i32([1]))


def test_logit_offsets() -> None:
    assert SeqWork(0, 0, [1, 2, 3]).logit_offsets() == [0, 1, 2]
    assert SeqWork(0, 0, [1, 2, 3], logits="last").logit_offsets() == [2]
    assert SeqWork(0, 0, [], logits="last").logit_offsets() == []
    assert SeqWork(0, 0, [1, 2, 3], logits="none").logit_offsets() == []
    assert SeqWork(0, 0, [1, 2, 3], logits=(2, 0)).logit_offsets() == [2, 0]


# -- cache_mask --------------------------------------------------------------------------


def test_cache_mask_is_cut_to_longest_past() -> None:
    mask = np.random.default_rng(0).random((3, 16)) > 0.3
    batch = pack([SeqWork(0, 4, [1]), SeqWork(1, 9, [2, 3]), SeqWork(2, 2, [4])], cache_mask=mask)
    assert batch.cache_mask is not None
    assert batch.cache_mask.shape == (3, 9)
    assert np.array_equal(batch.cache_mask, mask[:, :9])


def test_cache_mask_rows_of_empty_sequences_are_dropped() -> None:
    """One mask row per work item (as ``KVCacheManager.cache_mask(slots)`` gives); empty items drop out."""
    mask = np.zeros((4, 10), dtype=bool)
    for row in range(4):
        mask[row, row] = True  # row r is identifiable by its single set column
    batch = pack(
        [SeqWork(0, 6, [1]), SeqWork(1, 9, []), SeqWork(2, 5, [2]), SeqWork(3, 8, [])],
        cache_mask=mask,
    )
    assert batch.cache_mask is not None
    assert batch.cache_mask.shape == (2, 6)
    assert np.array_equal(batch.cache_mask, mask[[0, 2], :6])


def test_cache_mask_width_zero_when_no_past() -> None:
    mask = np.ones((2, 4), dtype=bool)
    batch = pack([SeqWork(0, 0, [1, 2]), SeqWork(1, 0, [3])], cache_mask=mask)
    assert batch.cache_mask is not None
    assert batch.cache_mask.shape == (2, 0)

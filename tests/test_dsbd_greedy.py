"""Greedy forest acceptance (``dsbd.verify_layer_greedy``): hand-written cases and a plain-loop reference."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specdec.runtime.dsbd import verify_layer_greedy

V = 5


def _logits(*rows: list[float]) -> np.ndarray:
    return np.log(np.array(rows, dtype=np.float64))


def test_a_layer_that_drafted_every_pick_passes_and_finds_each_pick_where_it_was_drafted() -> None:
    scores = np.array([0.0, math.log(0.5)], dtype=np.float64)
    logits = _logits([0.6, 0.3, 0.05, 0.03, 0.02], [0.9, 0.05, 0.03, 0.01, 0.01])
    # joint: (0,0)=.6 (1,0)=.45 (0,1)=.3 ...: beam search keeps (0,0) and (1,0)
    nodes = [1 * V + 0, 0 * V + 4, 0 * V + 0]
    verdict = verify_layer_greedy(scores, logits, nodes, width=2)
    assert (verdict.step.parents, verdict.step.tokens) == ([0, 1], [0, 0])
    assert verdict.found == [2, 0] and verdict.passed and verdict.accepted == 2


def test_one_missing_pick_fails_the_layer_and_the_round_continues_from_the_target_picks() -> None:
    scores = np.array([0.0, math.log(0.5)], dtype=np.float64)
    logits = _logits([0.6, 0.3, 0.05, 0.03, 0.02], [0.9, 0.05, 0.03, 0.01, 0.01])
    verdict = verify_layer_greedy(scores, logits, [0 * V + 0, 0 * V + 1], width=2)
    assert verdict.found == [0, -1] and not verdict.passed and verdict.accepted == 1
    assert (verdict.step.parents, verdict.step.tokens) == ([0, 1], [0, 0])  # the outputs are beam search's own


def test_invalid_parents_are_never_picked_and_duplicate_drafts_count_once() -> None:
    scores = np.array([-math.inf, 0.0], dtype=np.float64)  # parent 0 was not accepted last layer
    logits = _logits([0.97, 0.01, 0.01, 0.005, 0.005], [0.5, 0.4, 0.05, 0.03, 0.02])
    nodes = [0 * V + 0, 1 * V + 1, 1 * V + 1, 1 * V + 0]
    verdict = verify_layer_greedy(scores, logits, nodes, width=2)
    assert verdict.step.parents == [1, 1] and verdict.step.tokens == [0, 1]
    assert verdict.found == [3, 1] and verdict.passed


def test_an_empty_layer_never_passes() -> None:
    verdict = verify_layer_greedy(np.zeros(1, dtype=np.float64), _logits([0.5, 0.2, 0.1, 0.1, 0.1]), [], 1)
    assert verdict.found == [-1] and not verdict.passed


def _reference(scores: list[float], probs: list[list[float]], nodes: list[int], width: int) -> list[int]:
    """Plain loops: rank every (parent, token) pair, ties to the lower flat index; look each pick up in the drafts."""
    pairs = [
        (scores[b] + math.log(probs[b][v]), -(b * V + v))
        for b in range(len(scores))
        for v in range(V)
        if scores[b] > -math.inf
    ]
    picks = [-flat for _, flat in sorted(pairs, reverse=True)[:width]]
    return [nodes.index(x) if x in nodes else -1 for x in picks]


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_matches_a_plain_loop_reference(data: st.DataObject) -> None:
    parents = data.draw(st.integers(1, 3))
    scores = [data.draw(st.sampled_from([0.0, -0.5, -1.5, -math.inf])) for _ in range(parents)]
    if all(s == -math.inf for s in scores):
        scores[0] = 0.0
    probs = []
    for _ in range(parents):
        raw = [data.draw(st.integers(1, 20)) for _ in range(V)]
        probs.append([r / sum(raw) for r in raw])
    live = sum(s > -math.inf for s in scores) * V
    width = data.draw(st.integers(1, min(4, live)))
    nodes = data.draw(st.lists(st.integers(0, parents * V - 1), max_size=6))
    verdict = verify_layer_greedy(
        np.array(scores, dtype=np.float64), np.log(np.array(probs, dtype=np.float64)), nodes, width
    )
    expected = _reference(scores, probs, nodes, width)
    assert verdict.found == expected
    assert verdict.passed == all(i >= 0 for i in expected)


@pytest.mark.parametrize("width", [0, 6])
def test_a_width_beam_search_cannot_fill_is_refused(width: int) -> None:
    with pytest.raises(ValueError, match="width must be in"):
        verify_layer_greedy(np.zeros(1, dtype=np.float64), _logits([0.5, 0.2, 0.1, 0.1, 0.1]), [0], width)

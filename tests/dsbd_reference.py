"""The DSBD reference simulator: one whole round over pure table-defined models (no KV, no batching).

The exactness tests compare the runtime's beam decoder against it draw for draw and measure its
per-slot law; it lives with the tests because nothing in the package runs it. It calls the core
through the module (``dsbd.verify_layer``, ...), so the negative controls that patch one of those
functions see the patched one. Arrays are numpy and the RNG a ``numpy.random.Generator``, as in the
runtime, so one seed gives the runtime and the reference the same stream of uniforms.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from specdec.runtime import dsbd
from specdec.runtime.dsbd import Beam
from specdec.runtime.sampling import SamplingParams

ProbsFn = Callable[[tuple[int, ...]], np.ndarray]


@dataclass(frozen=True)
class LayerTrace:
    """One verified layer of a round: its valid parents (target beams) and its output slots.

    ``slots[j] = (i, v)``: slot j extends ``parents[i]`` by token ``v``. ``drafted`` is 0 for
    the extra layer sampled directly from the target after all γ layers passed.
    """

    parents: list[Beam]
    slots: list[tuple[int, int]]
    passed: bool
    drafted: int
    accepted: int


@dataclass(frozen=True)
class RoundResult:
    """Output beams of a round (the next round's input) and the trace of its layers."""

    beams: list[Beam]
    layers: list[LayerTrace]


def _memo_beam_distribution(
    kind: str, beams: Sequence[Beam], absent: Sequence[bool], fn: ProbsFn, params: SamplingParams, memo: dict | None
) -> np.ndarray:
    """``p_beam`` of ``beams`` under ``fn`` (absent parents: score -inf), cached in ``memo`` by state.

    The key holds ``fn`` and ``params`` too, so one dict may serve several models and settings,
    as long as the functions are pure (same prefix, same distribution).
    """
    key = (kind, fn, params, tuple(beams), tuple(absent))
    if memo is not None and key in memo:
        return memo[key]
    scores = np.array([-math.inf if gone else b.score for b, gone in zip(beams, absent)], dtype=np.float64)
    table = np.stack([fn(b.prefix) for b in beams])
    result = dsbd.beam_distribution(scores, table, params)
    if memo is not None:
        memo[key] = result
    return result


def _extend(parents: Sequence[Beam], flat: Sequence[int], dist: np.ndarray, vocab: int) -> list[Beam]:
    """New beams for flat pairs, scored ``log dist(pair)``."""
    return [Beam((*parents[x // vocab].prefix, x % vocab), math.log(float(dist[x]))) for x in flat]


def _trace(
    parents: Sequence[Beam],
    valid: Sequence[bool],
    outputs: Sequence[int],
    vocab: int,
    passed: bool,
    drafted: int,
    accepted: int,
) -> LayerTrace:
    """The layer's trace, with slots re-indexed over the valid parents only."""
    index = {p: i for i, p in enumerate(p for p, ok in enumerate(valid) if ok)}
    return LayerTrace(
        [b for b, ok in zip(parents, valid) if ok],
        [(index[x // vocab], x % vocab) for x in outputs],
        passed,
        drafted,
        accepted,
    )


def dsbd_round(
    input_beams: Sequence[tuple[tuple[int, ...], float]],
    target_fn: ProbsFn,
    draft_fn: ProbsFn,
    params: SamplingParams,
    w_s: int,
    gamma: int,
    width: int,
    generator: np.random.Generator,
    *,
    threshold: float | None = None,
    w_min: int = 1,
    memo: dict | None = None,
) -> RoundResult:
    """One DSBD round over pure table models, for exactness tests (no KV, no batching).

    ``target_fn(prefix)`` / ``draft_fn(prefix)`` give the unwarped next-token distribution
    ``[V]``. The draft runs beam sampling with width ``w_s`` for ``gamma`` layers (the forest,
    nodes i.i.d. per layer, each scored with its own ``log q_beam``); the layers are then
    verified in order with :func:`verify_layer`, the valid parents of layer l+1 being the
    drafts accepted at layer l, scored ``log p_beam`` by the target. The first failing layer's
    outputs end the round; if all ``gamma`` pass, one more layer is drawn i.i.d. from the target's
    ``p_beam`` over the last accepted drafts. Width: ``width`` for every layer, or with
    ``threshold`` set, :func:`dynamic_width` per layer (the extra layer keeps the last layer's
    width; ``width`` is then only the extra layer's width when ``gamma == 0``).
    ``memo`` (a dict reused across rounds) caches ``p_beam`` per state: tens of thousands of
    test rounds visit a few thousand states.
    """
    if gamma < 0 or w_s < 1 or width < 1:
        raise ValueError(f"need gamma >= 0, w_s >= 1, width >= 1; got {gamma}, {w_s}, {width}")
    roots = [Beam(tuple(prefix), float(score)) for prefix, score in input_beams]
    # the forest: per layer, the draft's parents, q_beam over them, and the drafted nodes
    forest: list[tuple[list[Beam], np.ndarray, list[int]]] = []
    parents = roots
    for _ in range(gamma):
        q_beam = _memo_beam_distribution("draft", parents, [False] * len(parents), draft_fn, params, memo)
        nodes = dsbd.draft_layer(q_beam, w_s, generator)
        forest.append((parents, q_beam, nodes))
        parents = _extend(parents, nodes, q_beam, q_beam.size // len(parents))
    # verification: target beams are the valid parents, with the target's scores
    target_beams, valid = list(roots), [True] * len(roots)
    layers: list[LayerTrace] = []
    for draft_parents, q_beam, nodes in forest:
        vocab = q_beam.size // len(draft_parents)
        pb = _memo_beam_distribution("target", target_beams, [not ok for ok in valid], target_fn, params, memo)
        layer_width = width if threshold is None else dsbd.dynamic_width(pb, q_beam, w_s, threshold, w_min)
        verdict = dsbd.verify_layer(pb, q_beam, nodes, np.array(valid), layer_width, generator)
        layers.append(
            _trace(target_beams, valid, verdict.outputs, vocab, verdict.passed, len(nodes), len(verdict.accepted))
        )
        if not verdict.passed:
            return RoundResult(_extend(target_beams, verdict.outputs, pb, vocab), layers)
        width = layer_width
        # next layer's parents: every draft node of this layer; valid = the accepted ones, scored
        # log p_beam by the target; the others stay as absent parents (score -inf), so that p_beam
        # lies on the same parents x vocabulary space as the draft's q_beam.
        valid = [False] * len(nodes)
        for i in verdict.accepted:
            valid[i] = True
        target_beams = [
            Beam((*draft_parents[x // vocab].prefix, x % vocab), math.log(float(pb[x])) if ok else -math.inf)
            for x, ok in zip(nodes, valid)
        ]
    pb = _memo_beam_distribution("target", target_beams, [not ok for ok in valid], target_fn, params, memo)
    vocab = pb.size // len(target_beams)
    outputs = dsbd.sample_pairs_iid(pb, width, generator).tolist()
    layers.append(_trace(target_beams, valid, outputs, vocab, True, 0, 0))
    return RoundResult(_extend(target_beams, outputs, pb, vocab), layers)

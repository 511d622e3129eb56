"""The model-free core of DSBD (dynamic-width speculative beam decoding), as pure numpy functions.

Method and conventions: ``docs/algorithms.md`` (DSBD). Everything here works on probability tensors
that a runtime gets from one packed target call over a draft forest; nothing touches a model,
a KV cache or I/O, so the exactness of the method can be tested on enumerable toy models.

Index convention. A beam step over ``W`` parents and a vocabulary of ``V`` tokens works on the
flattened ``W * V`` vector: the pair (parent ``b``, token ``v``) is index ``b * V + v``
(``divmod(index, V)`` gives it back). A parent whose score is ``-inf`` is absent: its pairs
have probability 0. That is how the target's ``p_beam`` is laid over the draft's parents,
of which only the accepted ones are valid, so that ``p_beam`` and the draft's ``q_beam`` live
on the same index space and the residual ``max(0, p' - q_beam)`` is a plain vector operation.

Exactness (what ``tests/test_dsbd_math.py`` checks): conditional on the beams entering a
layer, every output slot of the layer is one draw from the target's ``p_beam``, as in the
``beam`` baseline that draws its W pairs i.i.d. Within one layer the slots are even i.i.d.;
across the layers of a round the joint law differs from the baseline's, because a round only
goes on to layer l+1 when layer l passed, and passing depends on the slots' values.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple

import numpy as np

from specdec.runtime.sampling import SamplingParams, log_softmax, sample, sample_many, warp

# When the residual max(0, p' - q) has total mass <= RESIDUAL_EPS the rejection that led to
# it had probability exactly that mass (P(reject) = sum max(0, q - p') = sum max(0, p' - q)),
# so whatever distribution follows a rejection changes the slot's law by at most this much in
# total variation. With mass 0, p' <= q and both sum to 1, so p' == q: every draft is accepted
# and a rejection can only be a rounding artefact. We then keep p' (== q): the next draft,
# drawn from q, is accepted with probability 1 and so is still a draw from p'. Normalising
# rounding noise instead would sample from an arbitrary law.
RESIDUAL_EPS = 1e-9


class Beam(NamedTuple):
    """A live beam: its token sequence and its score ``log p_beam`` (target's, or draft's in the forest)."""

    prefix: tuple[int, ...]
    score: float


class BeamStep(NamedTuple):
    """One beam step: new beam ``i`` extends parent ``parents[i]`` by ``tokens[i]`` and scores ``scores[i]``."""

    parents: list[int]
    tokens: list[int]
    scores: list[float]


@dataclass(frozen=True)
class LayerVerdict:
    """The verification of one forest layer.

    ``accepted``: positions in the layer's draft list (draw order) of the accepted drafts.
    ``passed``: ``width`` drafts were accepted; they are the valid parents of the next layer.
    ``outputs``: the layer's ``width`` output slots as flat (parent, token) indices: the
    accepted drafts, then (on failure) one draw from the current ``p'`` and fresh draws from ``pb``.
    """

    accepted: list[int]
    passed: bool
    outputs: list[int]


# -- the beam distribution -------------------------------------------------------------------


def _log_joint(scores: np.ndarray, probs_or_logits: np.ndarray, logits: bool) -> np.ndarray:
    """``s_b + log p(v | b)`` as a flat ``[W * V]`` float64 vector; ``-inf`` for absent parents."""
    scores, table = np.asarray(scores, dtype=np.float64), np.asarray(probs_or_logits, dtype=np.float64)
    if scores.ndim != 1 or table.ndim != 2 or table.shape[0] != scores.shape[0]:
        raise ValueError(f"expected scores [W] and a [W, V] table, got {scores.shape} and {table.shape}")
    if np.isnan(scores).any() or (scores == math.inf).any():
        raise ValueError(f"beam scores must be finite or -inf (absent parent), got {scores.tolist()}")
    # log_softmax also for probabilities: it renormalises rows, and beam_step(logits=log(probs))
    # then computes bit for bit what the probability path does
    with np.errstate(divide="ignore", invalid="ignore"):  # rows of absent parents may hold anything (even NaN)
        log_p = log_softmax(table if logits else np.log(table))
    absent = np.isinf(scores)[:, None]
    joint = np.where(absent, -math.inf, scores[:, None] + np.where(absent, 0.0, log_p)).reshape(-1)
    if not np.isfinite(joint).any():
        raise ValueError("no (beam, token) pair has positive probability: every parent is absent")
    return joint


def beam_distribution(
    scores: np.ndarray, probs_or_logits: np.ndarray, params: SamplingParams, *, logits: bool = False
) -> np.ndarray:
    """``p_beam`` over the flat ``[W * V]`` pairs: ``warp(exp(s_b) * p(v | b))``, normalised (float64).

    ``probs_or_logits[b]`` is the *unwarped* next-token distribution of beam ``b`` (probabilities,
    or logits with ``logits=True``). Warping is applied once, jointly, to the flattened vector:
    the log-joint ``s_b + log p(v|b)`` plays the role of logits, so temperature also tempers
    the beam scores, and top-k / top-p cut across beams, not per beam. The ``beam`` baseline
    and DSBD must share this definition, or "DSBD samples the baseline's law" compares two
    different targets. ``scores[b] = -inf`` marks an absent parent (probability 0).

    Greedy parameters have no distribution: use :func:`beam_search_step`.
    """
    if params.greedy:
        raise ValueError("temperature 0 is deterministic beam search: use beam_search_step")
    joint = _log_joint(scores, probs_or_logits, logits)
    # shift in float64 before warp() casts to float32, so large |scores| lose no precision
    probs = warp(joint - joint.max(), params).astype(np.float64)
    return probs / probs.sum()


def beam_search_step(scores: np.ndarray, probs_or_logits: np.ndarray, width: int, *, logits: bool = False) -> BeamStep:
    """Deterministic beam search (the temperature -> 0 limit): the ``width`` best pairs.

    Pairs are ranked by ``s_b + log p(v | b)`` and the new score is that cumulative
    log-probability (the usual beam-search score, which length normalisation needs). It differs
    from ``log p_beam`` at temperature 1 by one constant per step, so the ranking is the same.
    Ties go to the lower flat index (lower parent, then lower token), so the result is
    reproducible; top-k / top-p never change the argmax set and are ignored.
    """
    joint = _log_joint(scores, probs_or_logits, logits)
    live = int(np.isfinite(joint).sum())
    if not 1 <= width <= live:
        raise ValueError(f"width must be in [1, {live}] (pairs of positive probability), got {width}")
    order = np.argsort(-joint, kind="stable")[:width]  # descending, ties to the lower index
    vocab = probs_or_logits.shape[-1]
    return BeamStep([int(i) // vocab for i in order], [int(i) % vocab for i in order], [float(joint[i]) for i in order])


# -- sampling pairs --------------------------------------------------------------------------


def sample_pairs_iid(p_beam: np.ndarray, n: int, generator: np.random.Generator) -> np.ndarray:
    """``n`` flat (beam, token) indices drawn i.i.d. (with replacement) from a flat ``p_beam``."""
    if p_beam.ndim != 1:
        raise ValueError(f"p_beam must be the flat [W * V] vector, got shape {p_beam.shape}")
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    return sample_many(p_beam, n, generator)


def sample_pairs_without_replacement(p_beam: np.ndarray, n: int, generator: np.random.Generator) -> np.ndarray:
    """``n`` distinct flat indices: successive draws from ``p_beam`` with the drawn ones removed (renormalised)."""
    remaining = np.array(p_beam, dtype=np.float64)
    drawn = []
    for _ in range(n):
        index = sample(remaining, generator)
        drawn.append(index)
        remaining[index] = 0.0
    return np.asarray(drawn, dtype=np.int64)


def beam_step(
    scores: np.ndarray,
    logits: np.ndarray,
    params: SamplingParams,
    width: int,
    generator: np.random.Generator,
    mode: Literal["iid", "without_replacement"] = "iid",
) -> BeamStep:
    """One step of the target-only ``beam`` process: ``width`` new beams from ``W`` parents.

    ``logits`` is ``[W, V]``. Each drawn pair becomes a beam scored ``log p_beam(b, v)``
    (dsbd.md). ``mode="iid"`` draws with replacement (duplicates possible): the law DSBD
    reproduces slot by slot. ``"without_replacement"`` draws distinct pairs (classic beam
    sampling); DSBD does not reproduce it. Greedy parameters run :func:`beam_search_step`.
    """
    if params.greedy:
        return beam_search_step(scores, logits, width, logits=True)
    p_beam = beam_distribution(scores, logits, params, logits=True)
    if mode == "iid":
        flat = sample_pairs_iid(p_beam, width, generator)
    elif mode == "without_replacement":
        support = int((p_beam > 0).sum())
        if width > support:
            raise ValueError(f"cannot draw {width} distinct pairs from {support} of positive probability")
        flat = sample_pairs_without_replacement(p_beam, width, generator)
    else:
        raise ValueError(f"mode must be 'iid' or 'without_replacement', got {mode!r}")
    vocab = logits.shape[-1]
    return BeamStep(
        [int(i) // vocab for i in flat], [int(i) % vocab for i in flat], [math.log(float(p_beam[i])) for i in flat]
    )


def draft_layer(q_beam: np.ndarray, n: int, generator: np.random.Generator) -> list[int]:
    """The ``n = W_S`` draft nodes of one forest layer, drawn i.i.d. **with** replacement from ``q_beam``.

    The verifier's residual rule is exact only for i.i.d. drafts: drafts drawn without
    replacement are not, and verifying them this way is biased (dsbd.md; the tests keep that
    variant as a negative control).
    """
    return sample_pairs_iid(q_beam, n, generator).tolist()


# -- verification ----------------------------------------------------------------------------


def _residual(current: np.ndarray, q: np.ndarray) -> np.ndarray:
    """``norm(max(0, p' - q))``, subtracted once; ``p'`` itself when the residual is degenerate (see RESIDUAL_EPS)."""
    residual = np.maximum(current - q, 0.0)
    mass = float(residual.sum())
    return current if mass <= RESIDUAL_EPS else residual / mass


def _check_layer(pb: np.ndarray, q_beam: np.ndarray, valid_parent_mask: np.ndarray) -> int:
    """The vocabulary size, after checking that ``pb`` and ``q_beam`` share the parents x vocab space."""
    parents = valid_parent_mask.size
    if pb.shape != q_beam.shape or pb.ndim != 1 or parents == 0 or pb.size % parents:
        raise ValueError(
            f"pb {pb.shape} and q_beam {q_beam.shape} must be flat vectors over the same {parents} parents x vocabulary"
        )
    vocab = pb.size // parents
    if float(np.abs(pb.reshape(parents, vocab)[~valid_parent_mask.astype(bool)]).sum()) > 0:
        raise ValueError("pb must be 0 on pairs of invalid parents (give them score -inf)")
    return vocab


def verify_layer(
    pb: np.ndarray,
    q_beam: np.ndarray,
    nodes: Sequence[int],
    valid_parent_mask: np.ndarray,
    width: int,
    generator: np.random.Generator,
) -> LayerVerdict:
    """Verify one forest layer: steps 4-6 of dsbd.md.

    ``pb`` and ``q_beam`` are flat over *all* the draft's parents of this layer x vocabulary;
    ``pb`` is the target's ``p_beam`` over the valid parents (the beams accepted at the
    previous layer), 0 on the others. ``nodes`` are the layer's drafts (flat indices, i.i.d.
    from ``q_beam``) in draw order. Starting from ``p' = pb``, each draft is:

    * rejected outright when its parent is invalid (``pb`` is 0 there, so the ratio rule would
      reject it too; the residual must still be updated, since dropping such drafts is biased);
    * else accepted with probability ``min(1, p'(x) / q_beam(x))``.

    On acceptance ``p' = pb``; on rejection ``p' = norm(max(0, p' - q_beam))``. Why each slot is
    a draw from ``pb``: the first acceptance among i.i.d. drafts, or a draw from the residual
    when none is accepted, is distributed as ``p'`` (recursive rejection sampling); after an
    acceptance the remaining drafts are fresh i.i.d. draws, so the next slot starts over from
    ``pb``. Hence the completion on failure: one draw from the current ``p'`` finishes the slot
    in progress, and slots never started are fresh draws from ``pb``.
    """
    if width < 1:
        raise ValueError(f"width must be >= 1, got {width}")
    pb, q_beam, valid_parent_mask = np.asarray(pb), np.asarray(q_beam), np.asarray(valid_parent_mask)
    vocab = _check_layer(pb, q_beam, valid_parent_mask)
    pb, q_beam = pb.astype(np.float64), q_beam.astype(np.float64)
    valid = valid_parent_mask.astype(bool).tolist()
    current = pb
    accepted: list[int] = []
    for position, x in enumerate(nodes):
        qx = float(q_beam[x])
        if qx <= 0.0:
            raise ValueError(f"draft {x} has q_beam 0: drafts must be drawn from q_beam")
        if valid[x // vocab] and generator.random() * qx < float(current[x]):
            accepted.append(position)
            if len(accepted) == width:
                return LayerVerdict(accepted, True, [nodes[i] for i in accepted])
            current = pb
        else:
            current = _residual(current, q_beam)
    outputs = [nodes[i] for i in accepted]
    outputs.append(sample(current, generator))
    outputs.extend(sample_pairs_iid(pb, width - len(outputs), generator).tolist())
    return LayerVerdict(accepted, False, outputs)


@dataclass(frozen=True)
class GreedyLayerVerdict:
    """The verification of one greedy forest layer.

    ``step``: the target's own beam-search step over the layer's valid parents (the round's
    outputs when the layer fails). ``found[i]``: the position in the layer's draft list of the
    target's i-th pick, or -1 where the draft did not propose it. ``passed``: every pick was drafted.
    """

    step: BeamStep
    found: list[int]
    passed: bool

    @property
    def accepted(self) -> int:
        return sum(i >= 0 for i in self.found)


def verify_layer_greedy(scores: np.ndarray, logits: np.ndarray, nodes: Sequence[int], width: int) -> GreedyLayerVerdict:
    """Greedy DSBD's layer check: the layer passes when the draft proposed every pair beam search picks.

    ``scores`` are the parents' cumulative target log-probabilities (-inf for parents that are not
    target beams), ``logits`` their target logits ``[parents, V]``, ``nodes`` the draft's top pairs
    as flat ``parent * V + token`` indices. Why this is exact: beam search's next beams are a
    function of the target alone, so a layer is usable exactly when its drafts contain them, and
    the round then continues from the target's picks, never from the draft's scores.
    """
    step = beam_search_step(scores, logits, width, logits=True)
    vocab = logits.shape[-1]
    position = {x: i for i, x in reversed(list(enumerate(nodes)))}  # first occurrence, as list.index
    found = [position.get(p * vocab + t, -1) for p, t in zip(step.parents, step.tokens)]
    return GreedyLayerVerdict(step, found, min(found, default=-1) >= 0)


# -- dynamic width ---------------------------------------------------------------------------


def _acceptance_rates(pb: np.ndarray, q: np.ndarray, m: int) -> list[float]:
    """``alpha_1..alpha_m``: P(the k-th draft since the last acceptance is accepted | k-1 rejections)."""
    current, q = np.asarray(pb, dtype=np.float64).reshape(-1), np.asarray(q, dtype=np.float64).reshape(-1)
    if current.shape != q.shape:
        raise ValueError(f"pb {np.shape(pb)} and q {np.shape(q)} must have the same shape")
    rates = []
    for _ in range(m):
        # sum min(p_k, q) = 1 - sum max(0, p_k - q): the second form is exactly 1 when p_k == q
        # (the first sums q's rounding errors), so "every draft is accepted" survives rounding
        excess = float(np.maximum(current - q, 0.0).sum())
        rates.append(min(1.0, max(0.0, 1.0 - excess)))
        current = _residual(current, q)  # once per step
    return rates


def acceptance_count_distribution(pb: np.ndarray, q: np.ndarray, m: int) -> np.ndarray:
    """``[m + 1]`` float64: P(exactly k of ``m`` i.i.d. drafts from ``q`` are accepted), k = 0..m.

    The process is :func:`verify_layer` without the stop at a width. With
    ``alpha_k = sum min(p_k, q)``, ``p_1 = pb`` and ``p_k = norm(max(p_{k-1} - q, 0))`` (one
    subtraction per rejection), the first acceptance comes at draft i with probability
    ``f_i = alpha_i * prod_{j<i} (1 - alpha_j)``; the distribution then resets to ``pb`` and
    the m - i later drafts are a fresh instance: ``P(m, k) = sum_i f_i P(m - i, k - 1)``,
    ``P(m, 0) = prod_{j<=m} (1 - alpha_j)``.

    Drafts with an invalid parent are included when ``pb`` is laid over all the draft's
    parents (0 on invalid ones, as :func:`verify_layer` takes it): the ratio rule rejects them
    with probability 1 and applies the same residual update that verify_layer applies, so the
    recursion over the full ``q`` is the exact law of the real process, not an optimistic one.
    """
    alphas = _acceptance_rates(pb, q, m)
    first = []  # f_i, i = 1..m
    none_yet = 1.0
    for alpha in alphas:
        first.append(none_yet * alpha)
        none_yet *= 1.0 - alpha
    # table[n][k] = P(n, k)
    table = [[1.0] + [0.0] * m]
    for n in range(1, m + 1):
        row = [math.prod(1.0 - a for a in alphas[:n])] + [0.0] * m
        for k in range(1, n + 1):
            row[k] = sum(first[i - 1] * table[n - i][k - 1] for i in range(1, n + 1))
        table.append(row)
    return np.asarray(table[m], dtype=np.float64)


def acceptance_probability(pb: np.ndarray, q: np.ndarray, m: int, k: int) -> float:
    """``P(m, k)``: probability that exactly ``k`` of ``m`` i.i.d. drafts from ``q`` are accepted."""
    if not 0 <= k <= m:
        return 0.0
    return float(acceptance_count_distribution(pb, q, m)[k])


def acceptance_tail(pb: np.ndarray, q: np.ndarray, m: int) -> np.ndarray:
    """``[m + 1]``: P(at least K accepted among ``m`` drafts), K = 0..m (= P(a layer of width K passes))."""
    law = acceptance_count_distribution(pb, q, m)
    tail = np.clip(np.cumsum(law[::-1])[::-1], 0.0, 1.0)
    tail[0] = 1.0  # exactly, not 1 - rounding
    return tail


def dynamic_width(pb: np.ndarray, q: np.ndarray, w_s: int, threshold: float, w_min: int) -> int:
    """The layer's width: ``max(w_min, max{K : P(>= K accepted among w_s) >= threshold})``.

    A function of (pb, q) only, decided before any draft is verified, so every slot of the
    layer is still exactly a draw from ``pb`` for whatever width comes out.
    """
    if not 0.0 <= threshold <= 1.0:
        raise ValueError(f"threshold must be in [0, 1], got {threshold}")
    if not 1 <= w_min <= w_s:
        raise ValueError(f"need 1 <= w_min <= w_s, got w_min={w_min}, w_s={w_s}")
    tail = acceptance_tail(pb, q, w_s)
    # a 1e-12 slack so that rounding in the recursion cannot flip a comparison like 1 - 4e-16 >= 1
    best = max(k for k in range(w_s + 1) if float(tail[k]) >= threshold - 1e-12)
    return max(w_min, best)

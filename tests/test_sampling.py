"""Unit tests of ``specdec.runtime.sampling``: parameters, warping and the acceptance rules.

The statistical tests compare empirical laws with exact ones by a chi-square
goodness-of-fit test. Every draw comes from a fixed-seed generator, so each test is
deterministic; the threshold ``ALPHA = 1e-3`` means a *correct* sampler would fail a given
check for at most 0.1 % of seed choices (the false-alarm rate we accept if a change to the
code re-rolls the random streams), while each test's negative control shows that the same
check, on the same number of draws, rejects a wrong sampler by many orders of magnitude.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Sequence
from functools import cache

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from scipy.stats import chisquare

from specdec.runtime.sampling import (
    InvalidRequestError,
    SamplingParams,
    next_token,
    sample,
    sample_many,
    verify_greedy,
    verify_sampling,
    warp,
)

ALPHA = 1e-3  # a correct sampler fails one check with probability 0.001 (see module docstring)


def _draw(probs: np.ndarray, g: np.random.Generator) -> int:
    """One draw from ``probs`` by numpy's own ``Generator.choice``: the tests' draft proposals and wrong
    samplers do not go through the sampler under test."""
    return int(g.choice(probs.size, p=probs))


def chi_square_pvalue(counts: Counter, probs: dict[tuple[int, ...], float] | np.ndarray) -> float:
    """Goodness of fit of ``counts`` to ``probs``, cells with expected count < 5 pooled.

    Cells of probability 0 are left out of the test but must be empty: a single draw there
    is an outright failure, so it is asserted, not tested.
    """
    if isinstance(probs, np.ndarray):
        probs = {(i,): float(v) for i, v in enumerate(probs)}
        counts = Counter({(k if isinstance(k, tuple) else (k,)): v for k, v in counts.items()})
    n = sum(counts.values())
    impossible = {k: v for k, v in counts.items() if probs.get(k, 0.0) == 0.0}
    assert not impossible, f"outcomes of probability 0 were drawn: {impossible}"
    keys = [k for k, v in probs.items() if v > 0]
    p = np.array([probs[k] for k in keys], dtype=np.float64)
    p /= p.sum()
    observed = np.array([counts.get(k, 0) for k in keys], dtype=np.float64)
    expected = p * n
    big = expected >= 5
    f_obs, f_exp = list(observed[big]), list(expected[big])
    if (~big).any():
        f_obs.append(observed[~big].sum())
        f_exp.append(expected[~big].sum())
    return float(chisquare(f_obs, f_exp).pvalue)


# -- SamplingParams -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"temperature": -0.5}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": 1.0, "top_p": 0.0}, "top_p"),
        ({"temperature": 1.0, "top_p": 1.5}, "top_p"),
        ({"temperature": 1.0, "top_p": -0.2}, "top_p"),
        ({"temperature": 1.0, "top_p": float("nan")}, "top_p"),
        ({"temperature": 1.0, "top_k": -1}, "top_k"),
        ({"temperature": 1.0, "top_k": 2.5}, "top_k"),
        ({"temperature": 1.0, "seed": -3}, "seed"),
        ({"temperature": 1.0, "seed": 1.5}, "seed"),
    ],
)
def test_sampling_params_rejects_invalid_values_naming_the_parameter(kwargs: dict, name: str) -> None:
    with pytest.raises(InvalidRequestError, match=name):
        SamplingParams(**kwargs)


def test_sampling_params_accepts_the_edges_of_the_valid_range() -> None:
    greedy = SamplingParams(temperature=0.0, top_k=0, top_p=1.0, seed=0)
    assert greedy.greedy
    assert not SamplingParams(temperature=1e-3, top_k=1, top_p=1e-9, seed=2**62).greedy
    assert issubclass(InvalidRequestError, ValueError)


@pytest.mark.parametrize("temperature", [1e-38, 1e-40, 1e-46])
def test_tiny_positive_temperature_is_refused_or_sampled(temperature: float) -> None:
    """Regression: such temperatures used to pass validation and make warp() return NaN, so
    sampling raised inside the decoding loop and failed every request of the batch."""
    try:
        params = SamplingParams(temperature=temperature)
    except InvalidRequestError as exc:
        assert "temperature" in str(exc)
        return  # refused up front, naming the parameter
    logits = np.array([5.0, 1.0, -2.0], dtype=np.float32)
    probs = warp(logits, params)
    assert np.isfinite(probs).all() and float(probs.sum()) == pytest.approx(1.0)
    assert next_token(logits, params, np.random.default_rng(0)) == 0


@pytest.mark.parametrize("temperature", [1e-5, 1e-3])
def test_smallest_accepted_temperatures_give_finite_probabilities(temperature: float) -> None:
    logits = np.array([[300.0, 299.0, -300.0, 0.0], [-1e4, -1e4, -2e4, -1e4 - 1e-2]], dtype=np.float32)
    probs = warp(logits, SamplingParams(temperature=temperature, top_k=3, top_p=0.9))
    assert probs.dtype == np.float32 and np.isfinite(probs).all()
    assert probs.sum(-1).tolist() == pytest.approx([1.0, 1.0])
    assert probs[0].tolist() == [1.0, 0.0, 0.0, 0.0]
    assert probs[1].tolist() == [0.5, 0.5, 0.0, 0.0]  # an exact tie for the max shares the mass


def test_seeded_generators_repeat_and_unseeded_ones_differ() -> None:
    a, b = SamplingParams(1.0, seed=7).make_generator(), SamplingParams(1.0, seed=7).make_generator()
    assert isinstance(a, np.random.Generator)
    assert np.array_equal(a.random(16), b.random(16))
    c, d = SamplingParams(1.0).make_generator(), SamplingParams(1.0).make_generator()
    assert not np.array_equal(c.random(16), d.random(16))


# -- warp vs an independent reference ------------------------------------------------------


def reference_warp(logits: Sequence[float], temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """Hugging Face's warper chain in float64 numpy: temperature → top-k → top-p.

    Top-k keeps every token tied with the k-th score (``scores < kth`` is removed, as in
    ``TopKLogitsWarper``). Top-p removes, in ascending order of probability, the tokens
    whose cumulative mass stays <= 1 - top_p, always keeping the most likely token (as in
    ``TopPLogitsWarper`` with ``min_tokens_to_keep=1``).
    """
    scores = np.asarray(logits, dtype=np.float64) / temperature
    if 0 < top_k < scores.size:
        kth = np.sort(scores)[-top_k]
        scores = np.where(scores < kth, -np.inf, scores)
    probs = _softmax(scores)
    if top_p < 1.0:
        order = np.argsort(probs, kind="stable")
        cumulative = np.cumsum(probs[order])
        remove_sorted = cumulative <= 1.0 - top_p
        remove_sorted[-1] = False
        remove = np.zeros(scores.size, dtype=bool)
        remove[order] = remove_sorted
        probs = _softmax(np.where(remove, -np.inf, scores))
    return probs


def _softmax(scores: np.ndarray) -> np.ndarray:
    e = np.exp(scores - scores.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def _top_p_boundary_gap(logits: Sequence[float], temperature: float, top_k: int, top_p: float) -> float:
    """How far the top-p threshold is from any cumulative mass (float32 vs float64 safety margin)."""
    if top_p >= 1.0:
        return math.inf
    probs = reference_warp(logits, temperature, top_k, 1.0)
    cumulative = np.cumsum(np.sort(probs))
    return float(np.min(np.abs(cumulative - (1.0 - top_p))))


def test_warp_matches_reference_on_hand_cases() -> None:
    logits = np.log(np.array([0.4, 0.3, 0.2, 0.1], dtype=np.float32))
    # top-k first, then top-p on the renormalised survivors: [4/7, 3/7] then 4/7 >= 0.5 ends it
    assert np.allclose(warp(logits, SamplingParams(1.0, top_k=2, top_p=0.5)), [1.0, 0, 0, 0])
    # top-p alone keeps 0.4 and 0.3 (mass before 0.3 is 0.4 < 0.5)
    assert np.allclose(warp(logits, SamplingParams(1.0, top_p=0.5)), [4 / 7, 3 / 7, 0, 0])
    # temperature 0.5 squares the probabilities before renormalising
    squared = np.array([0.16, 0.09, 0.04, 0.01]) / 0.30
    assert np.allclose(warp(logits, SamplingParams(0.5)), squared, atol=1e-6)
    # top_k >= V and top_p == 1 are no-ops
    plain = warp(logits, SamplingParams(1.0))
    assert plain.dtype == np.float32
    assert np.allclose(warp(logits, SamplingParams(1.0, top_k=4)), plain)
    assert np.allclose(warp(logits, SamplingParams(1.0, top_k=40)), plain)
    assert np.allclose(plain, [0.4, 0.3, 0.2, 0.1], atol=1e-6)


def test_warp_top_k_keeps_every_token_tied_with_the_kth() -> None:
    logits = np.array([3.0, 2.0, 2.0, 1.0, 2.0, -1.0], dtype=np.float32)
    probs = warp(logits, SamplingParams(1.0, top_k=2))
    assert (probs > 0).tolist() == [True, True, True, False, True, False]
    expected = reference_warp(logits.tolist(), 1.0, 2, 1.0)
    np.testing.assert_allclose(probs, expected, atol=1e-6)


def test_warp_top_p_with_ties_across_the_threshold_keeps_the_right_count() -> None:
    # four equal tokens, top_p = 0.5: exactly two survive (which two is unspecified, as in HF)
    probs = warp(np.zeros(4, dtype=np.float32), SamplingParams(1.0, top_p=0.5))
    assert sorted(probs.tolist()) == [0.0, 0.0, 0.5, 0.5]
    # four tied tokens after one of mass 0.5: top_p = 0.55 keeps the top one and one of the ties
    logits = np.log(np.array([0.5, 0.125, 0.125, 0.125, 0.125], dtype=np.float32))
    kept = warp(logits, SamplingParams(1.0, top_p=0.55))
    assert float(kept[0]) == pytest.approx(0.8) and sorted(kept[1:].tolist()) == pytest.approx([0, 0, 0, 0.2])


@pytest.mark.parametrize("top_p", [1e-9, 0.01, 0.3])
def test_warp_top_p_always_keeps_the_most_likely_token(top_p: float) -> None:
    logits = np.array([0.0, 4.0, 1.0, -2.0], dtype=np.float32)
    probs = warp(logits, SamplingParams(1.0, top_p=top_p))
    assert probs.tolist() == [0.0, 1.0, 0.0, 0.0]
    # ... also with -inf logits (masked vocabulary) present
    masked = warp(np.array([-math.inf, 1.0, -math.inf], dtype=np.float32), SamplingParams(0.7, top_k=2, top_p=top_p))
    assert masked.tolist() == [0.0, 1.0, 0.0]


def test_warp_is_batched_over_leading_dimensions() -> None:
    logits = np.random.default_rng(0).standard_normal((3, 2, 7)).astype(np.float32)
    params = SamplingParams(0.9, top_k=4, top_p=0.8)
    batched = warp(logits, params)
    assert batched.shape == (3, 2, 7)
    for i in range(3):
        for j in range(2):
            assert np.allclose(batched[i, j], warp(logits[i, j], params))


def test_warp_refuses_greedy_params() -> None:
    with pytest.raises(ValueError, match="greedy"):
        warp(np.zeros(3, dtype=np.float32), SamplingParams(0.0))


# Logits on a grid of quarters: ties are exact in float32 and float64 alike, and distinct
# scores stay far apart, so top-k cannot disagree by rounding; top-p cases whose threshold
# lies within 1e-5 of a cumulative mass are skipped (float32 vs float64 rounding).
@settings(max_examples=300, deadline=None)
@given(
    logits=st.lists(st.integers(-24, 24).map(lambda x: x / 4), min_size=1, max_size=14),
    temperature=st.sampled_from([0.3, 0.7, 1.0, 1.3, 2.5]),
    top_k=st.integers(0, 16),
    top_p=st.one_of(st.just(1.0), st.floats(0.01, 0.999)),
)
def test_warp_matches_hf_style_reference(logits: list[float], temperature: float, top_k: int, top_p: float) -> None:
    assume(_top_p_boundary_gap(logits, temperature, top_k, top_p) > 1e-5)
    params = SamplingParams(temperature, top_k, top_p)
    got = warp(np.array(logits, dtype=np.float32), params).astype(np.float64)
    want = reference_warp(logits, temperature, top_k, top_p)
    assert got.sum() == pytest.approx(1.0, abs=1e-5)
    # which of several tied tokens straddling the top-p threshold survive is unspecified
    # (HF and this code both leave it to the sort); the kept masses must agree regardless
    np.testing.assert_allclose(np.sort(got), np.sort(want), atol=1e-5)
    before_top_p = reference_warp(logits, temperature, top_k, 1.0)
    kept, dropped = before_top_p[want > 0], before_top_p[(want == 0) & (before_top_p > 0)]
    if not np.intersect1d(kept, dropped).size:
        np.testing.assert_allclose(got, want, atol=1e-5)


# -- drawing tokens --------------------------------------------------------------------------


class _FixedUniforms:
    """A stand-in for ``numpy.random.Generator`` whose ``random()`` returns the given uniforms, in order."""

    def __init__(self, values: Sequence[float]) -> None:
        self.values = [float(v) for v in values]

    def random(self, size: int | None = None) -> float | np.ndarray:
        if size is None:
            return self.values.pop(0)
        out, self.values = np.array(self.values[:size]), self.values[size:]
        assert out.size == size, "the test gave too few uniforms"
        return out


#: the ends of what ``Generator.random()`` returns: [0, 1)
LOWEST, HIGHEST = 0.0, float(np.nextafter(1.0, 0.0))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("scale", [1.0, 0.37, 1e-30])  # a residual max(0, p - q) is passed unnormalised
def test_sample_never_draws_a_zero_probability_token_even_at_the_edges(dtype: type, scale: float) -> None:
    """Zero-probability tokens (first, inner, last) own an empty interval of the CDF, so no uniform reaches them:
    neither the ends of [0, 1) nor uniforms within a few ulps of every inner boundary."""
    probs = (np.array([0.0, 0.0, 0.3, 0.0, 0.45, 0.25, 0.0, 0.0]) * scale).astype(dtype)
    possible = set(np.flatnonzero(probs).tolist())
    assert sample_many(probs, 2, _FixedUniforms([LOWEST, HIGHEST])).tolist() == [2, 5]
    assert sample(probs, _FixedUniforms([LOWEST])) == 2 and sample(probs, _FixedUniforms([HIGHEST])) == 5
    cdf = np.cumsum(probs, dtype=np.float64)
    near = []
    for boundary in cdf[:-1] / cdf[-1]:
        below = above = float(boundary)
        near.append(below)
        for _ in range(4):
            below, above = float(np.nextafter(below, 0.0)), float(np.nextafter(above, 1.0))
            near += [below, above]
    near = [u for u in near if 0.0 <= u < 1.0]
    drawn = sample_many(probs, len(near), _FixedUniforms(near))
    assert drawn.dtype == np.int64 and set(drawn.tolist()) <= possible
    assert set(drawn.tolist()) == possible  # every boundary was straddled: each side was drawn
    drawn = sample_many(probs, 100_000, np.random.default_rng(0))
    assert set(drawn.tolist()) == possible
    with pytest.raises(ValueError, match="positive mass"):
        sample_many(np.zeros(4, dtype=dtype), 1, np.random.default_rng(0))


@pytest.mark.statistical
def test_sample_many_draws_the_law_of_its_unnormalised_float32_input() -> None:
    """200,000 draws from a float32 vector that does not sum to 1 (a residual, as verify_sampling passes it)
    follow the normalised law; the same check on the same draws rejects a law moved by 0.01."""
    probs = (P_ONE * 0.37).astype(np.float32)
    counts = Counter(sample_many(probs, 200_000, np.random.default_rng(30)).tolist())
    pvalue = chi_square_pvalue(counts, P_ONE)
    moved = P_ONE.copy()
    moved[0], moved[1] = moved[0] - 0.01, moved[1] + 0.01
    wrong = chi_square_pvalue(counts, moved)
    print(f"sample_many: p = {pvalue:.3g}; against a law moved by 0.01: p = {wrong:.3g}")
    assert pvalue > ALPHA
    assert wrong < 1e-12


# -- greedy verification -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("drafts", "argmax", "expected"),
    [
        ([1, 2, 3], [1, 2, 3, 4], [1, 2, 3, 4]),  # perfect match: every draft + the bonus token
        ([1, 2, 3], [1, 5, 3, 4], [1, 5]),  # mismatch at position 1: the target's token replaces it
        ([7, 2], [0, 2, 9], [0]),  # mismatch at once: only the target's token
        ([], [4], [4]),  # no draft: plain decoding, one token
        ([3, 3], [3, 3, 3], [3, 3, 3]),  # repeated tokens are fine
    ],
)
def test_verify_greedy(drafts: list[int], argmax: list[int], expected: list[int]) -> None:
    assert verify_greedy(drafts, argmax) == expected


def test_next_token_greedy_is_argmax_and_consumes_no_randomness() -> None:
    g = np.random.default_rng(0)
    state = g.bit_generator.state
    assert next_token(np.array([0.1, 2.0, -1.0], dtype=np.float32), SamplingParams(0.0), g) == 1
    assert g.bit_generator.state == state


# -- sampling verification: hand cases -----------------------------------------------------


def test_verify_sampling_accepts_everything_when_draft_equals_target() -> None:
    g = np.random.default_rng(1)
    q = np.array([[0.2, 0.3, 0.5], [0.6, 0.2, 0.2]], dtype=np.float32)
    p = np.concatenate([q, np.array([[0.0, 0.0, 1.0]], dtype=np.float32)])
    for _ in range(200):
        assert verify_sampling([2, 0], q, p, g) == [2, 0, 2]


def test_verify_sampling_always_rejects_a_token_the_target_rules_out() -> None:
    g = np.random.default_rng(2)
    q = np.array([[0.5, 0.5, 0.0]], dtype=np.float32)
    p = np.array([[0.0, 0.3, 0.7], [1.0, 0.0, 0.0]], dtype=np.float32)
    outs = {tuple(verify_sampling([0], q, p, g)) for _ in range(300)}
    # residual norm(max(0, p - q)) = [0, 0, 1]: token 2, never the rejected draft
    assert outs == {(2,)}
    # a point-mass draft of an impossible token is replaced by a draw from p itself
    outs = Counter(tuple(verify_sampling([0], None, p, g)) for _ in range(300))
    assert set(outs) == {(1,), (2,)}


def test_verify_sampling_empty_draft_samples_from_the_last_row() -> None:
    g = np.random.default_rng(3)
    p = np.array([[0.0, 0.0, 1.0, 0.0]], dtype=np.float32)
    assert verify_sampling([], np.zeros((0, 4), dtype=np.float32), p, g) == [2]
    assert verify_sampling([], None, p, g) == [2]


def test_verify_sampling_output_is_an_accepted_prefix_plus_one() -> None:
    g = np.random.default_rng(4)
    gen = np.random.default_rng(5)
    for _ in range(300):
        q = _softmax(gen.standard_normal((3, 6)) * 2).astype(np.float32)
        p = _softmax(gen.standard_normal((4, 6)) * 2).astype(np.float32)
        drafts = [_draw(q[j], gen) for j in range(3)]
        out = verify_sampling(drafts, q, p, g)
        assert 1 <= len(out) <= 4
        assert out[:-1] == drafts[: len(out) - 1]
        if len(out) <= 3:  # the last token replaced a rejected draft: it had positive residual mass
            j = len(out) - 1
            assert float(p[j, out[-1]]) > float(q[j, out[-1]]) and out[-1] != drafts[j]


# -- sampling verification: exactness -------------------------------------------------------

P_ONE = np.array([0.35, 0.25, 0.2, 0.2, 0.0])  # target: token 4 impossible
Q_ONE = np.array([0.1, 0.5, 0.0, 0.15, 0.25])  # draft: token 2 never proposed, token 4 proposed
N_ONE = 20_000


def _first_token_counts(n: int, seed: int, draw: Callable[[np.random.Generator], int]) -> Counter:
    g = np.random.default_rng(seed)
    return Counter(draw(g) for _ in range(n))


def _one_position_draw(p: np.ndarray, q: np.ndarray | None, fixed: int | None = None):
    bonus = np.array([0.0, 0.0, 0.0, 0.0, 1.0], dtype=np.float32)  # never emitted if verification is right

    def draw(g: np.random.Generator) -> int:
        x = fixed if fixed is not None else _draw(q, g)
        out = verify_sampling([x], None if q is None else q[None], np.stack([p, bonus]), g)
        return out[0]

    return draw


@pytest.mark.statistical
def test_verify_sampling_first_token_has_the_target_law() -> None:
    # float32, as warp() gives them: the float64 P_ONE of the check differs by rounding only (~1e-8)
    p, q = P_ONE.astype(np.float32), Q_ONE.astype(np.float32)
    counts = _first_token_counts(N_ONE, 10, _one_position_draw(p, q))
    pvalue = chi_square_pvalue(counts, P_ONE)
    print(f"one position, sampled draft: p = {pvalue:.3g}")
    assert pvalue > ALPHA


@pytest.mark.parametrize("fixed", [1, 3, 4])  # a likely token, a less likely one, an impossible one
@pytest.mark.statistical
def test_verify_sampling_point_mass_draft_has_the_target_law(fixed: int) -> None:
    p = P_ONE.astype(np.float32)
    counts = _first_token_counts(N_ONE, 20 + fixed, _one_position_draw(p, None, fixed))
    pvalue = chi_square_pvalue(counts, P_ONE)
    print(f"one position, point-mass draft {fixed}: p = {pvalue:.3g}")
    assert pvalue > ALPHA


@pytest.mark.statistical
def test_one_position_check_rejects_wrong_samplers() -> None:
    """Negative controls: the same check, on as many draws, fails two wrong samplers."""
    p, q = P_ONE.astype(np.float32), Q_ONE.astype(np.float32)

    def from_draft(g: np.random.Generator) -> int:  # plain sampling from q (= accepting every draft)
        return _draw(q, g)

    def resample_from_p(g: np.random.Generator) -> int:  # a classic bug: on rejection draw from p, not the residual
        x = _draw(q, g)
        if g.random() * float(q[x]) < float(p[x]):
            return x
        return _draw(p, g)

    # drawing from q emits token 4, which p rules out: the zero-probability assertion fires;
    # the chi-square on the possible tokens alone rejects it as well
    counts = _first_token_counts(N_ONE, 11, from_draft)
    with pytest.raises(AssertionError, match="probability 0"):
        chi_square_pvalue(counts, P_ONE)
    from_q = chi_square_pvalue(Counter({t: c for t, c in counts.items() if P_ONE[t] > 0}), P_ONE)
    from_p = chi_square_pvalue(_first_token_counts(N_ONE, 12, resample_from_p), P_ONE)
    print(f"negative controls, one position: from q p = {from_q:.3g}, resample from p: p = {from_p:.3g}")
    assert from_q < 1e-12
    assert from_p < 1e-12


# Multi-position: context-dependent target and draft laws over V = 4 tokens, decoded by a
# miniature speculative loop (draft k tokens, verify, append, repeat) until 3 tokens exist.
V_CHAIN = 4
N_CHAIN = 20_000


@cache
def _chain_law(kind: str, prefix: tuple[int, ...]) -> np.ndarray:
    """A fixed pseudo-random law after ``prefix`` (float32, as warp() gives it); p rules one token out, q another."""
    rng = np.random.default_rng([ord(kind), len(prefix), *prefix])
    law = rng.dirichlet(np.full(V_CHAIN, 0.8))
    law[(sum(prefix) + (0 if kind == "p" else 1)) % V_CHAIN] = 0.0
    law = (law / law.sum()).astype(np.float32)
    law.flags.writeable = False  # cached: shared by every call
    return law


def _exact_chain_joint(n: int) -> dict[tuple[int, ...], float]:
    joint = {(): 1.0}
    for _ in range(n):
        joint = {
            (*prefix, t): mass * float(_chain_law("p", prefix)[t])
            for prefix, mass in joint.items()
            for t in range(V_CHAIN)
        }
    return joint


Verifier = Callable[[list[int], "np.ndarray | None", np.ndarray, np.random.Generator], list[int]]


def _chain_decode(
    k: int, n: int, g: np.random.Generator, point_mass: bool, verifier: Verifier = verify_sampling
) -> tuple[int, ...]:
    out: list[int] = []
    while len(out) < n:
        drafts: list[int] = []
        qs = []
        for _ in range(k):
            ctx = (*out, *drafts)
            if point_mass:  # deterministic proposal, like the n-gram drafter
                drafts.append((3 * sum(ctx) + len(ctx)) % V_CHAIN)
            else:
                q = _chain_law("q", ctx)
                qs.append(q)
                drafts.append(_draw(q, g))
        p = np.stack([_chain_law("p", (*out, *drafts[:j])) for j in range(k + 1)])
        out += verifier(drafts, None if point_mass else np.stack(qs), p, g)
    return tuple(out[:n])


@pytest.mark.parametrize(
    ("k", "n", "point_mass"),
    [
        (3, 3, False),  # the first three tokens all come from one k = 3 chain when accepted
        (2, 3, False),  # the third token is the bonus token when both drafts are accepted
        (3, 3, True),  # deterministic drafts (draft_probs=None)
    ],
)
@pytest.mark.statistical
def test_verify_sampling_chain_joint_law_equals_target(k: int, n: int, point_mass: bool) -> None:
    g = np.random.default_rng(100 + 10 * k + point_mass)
    counts = Counter(_chain_decode(k, n, g, point_mass) for _ in range(N_CHAIN))
    pvalue = chi_square_pvalue(counts, _exact_chain_joint(n))
    print(f"chain k={k}, {n} tokens, point_mass={point_mass}: p = {pvalue:.3g}")
    assert pvalue > ALPHA


@pytest.mark.statistical
def test_chain_check_rejects_accepting_every_draft() -> None:
    """Negative control: a verifier that accepts every draft fails the same multi-position check."""

    def accept_all(drafts, q, p, g):
        return [*drafts, sample(p[len(drafts)], g)]

    g = np.random.default_rng(7)
    counts = Counter(_chain_decode(3, 3, g, False, accept_all) for _ in range(N_CHAIN))
    exact = _exact_chain_joint(3)
    assert any(exact[c] == 0.0 for c in counts)  # it even emits impossible sequences
    possible = Counter({c: v for c, v in counts.items() if exact[c] > 0})
    pvalue = chi_square_pvalue(possible, exact)
    print(f"negative control, chain accepting every draft: p = {pvalue:.3g}")
    assert pvalue < 1e-12


# -- determinism ---------------------------------------------------------------------------


def _verify_many(seed: int) -> list[list[int]]:
    g = np.random.default_rng(seed)
    data = np.random.default_rng(99)  # the same inputs for every call of this helper
    outs = []
    for _ in range(200):
        q = _softmax(data.standard_normal((3, 8))).astype(np.float32)
        p = _softmax(data.standard_normal((4, 8))).astype(np.float32)
        drafts = [_draw(q[j], data) for j in range(3)]
        outs.append(verify_sampling(drafts, q, p, g))
        outs.append(verify_sampling(drafts, None, p, g))
        outs.append([next_token(np.log(p[0]), SamplingParams(0.8, top_k=5, top_p=0.9), g)])
    return outs


def test_same_generator_seed_gives_identical_outputs() -> None:
    assert _verify_many(5) == _verify_many(5)
    assert _verify_many(5) != _verify_many(6)

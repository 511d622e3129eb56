"""How many of DSBD's W_S drafts a layer accepts (``specdec.runtime.dsbd``): the acceptance-count recursion that
sets the dynamic width, against Monte Carlo runs of the accept / residual loop and an exact enumeration, and
``verify_layer`` (its counts, a degenerate residual, bad inputs).

The per-slot exactness of whole rounds, with the toy models, is ``test_dsbd_math.py``'s.
"""

from __future__ import annotations

import numpy as np
import pytest

from specdec.runtime import dsbd
from specdec.runtime.dsbd import (
    acceptance_count_distribution,
    acceptance_probability,
    acceptance_tail,
    draft_layer,
    dynamic_width,
    verify_layer,
)

#: tokens per parent beam in the joint (parent, token) vectors of "invalid parent 3x5"
PARENT_TOKENS = 5


def _recursion_cases() -> dict[str, tuple[np.ndarray, np.ndarray, int]]:
    rng = np.random.default_rng(7)
    cases = {}
    cases["dirichlet 2x5, m=4"] = (rng.dirichlet(np.ones(10)), rng.dirichlet(np.ones(10)), 4)
    pb = np.concatenate([rng.dirichlet(np.ones(10)), np.zeros(5)])  # third parent invalid
    cases["invalid parent 3x5, m=5"] = (pb, rng.dirichlet(np.ones(15)), 5)
    q = rng.dirichlet(np.ones(10))
    q[[1, 4, 8]] = 0.0  # warped draft: pairs it never proposes
    cases["sparse q, m=3"] = (rng.dirichlet(np.full(10, 0.5)), q / q.sum(), 3)
    close = rng.dirichlet(np.ones(12))
    cases["p close to q, m=6"] = (close, 0.8 * close + 0.2 * rng.dirichlet(np.ones(12)), 6)
    cases["m=1"] = (rng.dirichlet(np.ones(6)), rng.dirichlet(np.ones(6)), 1)
    return cases


RECURSION_CASES = _recursion_cases()


def monte_carlo_acceptances(pb: np.ndarray, q: np.ndarray, m: int, n: int, seed: int) -> np.ndarray:
    """Counts of accepted drafts in ``n`` runs of the real accept / residual loop (no width stop), vectorised."""
    rng = np.random.default_rng(seed)
    drafts = rng.choice(q.size, size=(n, m), p=q)
    current = np.tile(pb, (n, 1))
    accepted = np.zeros(n, dtype=int)
    rows = np.arange(n)
    for i in range(m):
        x = drafts[:, i]
        accept = rng.random(n) * q[x] < current[rows, x]
        accepted += accept
        residual = np.clip(current - q, 0.0, None)
        mass = residual.sum(axis=1, keepdims=True)
        after_reject = np.where(mass > dsbd.RESIDUAL_EPS, residual / np.maximum(mass, 1e-300), current)
        current = np.where(accept[:, None], pb, after_reject)
    return np.bincount(accepted, minlength=m + 1) / n


def _tail(law: np.ndarray) -> np.ndarray:
    return np.cumsum(law[::-1])[::-1]


@pytest.mark.parametrize("case", list(RECURSION_CASES))
@pytest.mark.statistical
def test_acceptance_recursion_matches_monte_carlo(case: str) -> None:
    """P(>= K accepted among W_S) from the recursion vs 40,000 runs of the accept / residual loop (|diff| < 0.01)."""
    pb, q, m = RECURSION_CASES[case]
    exact = acceptance_tail(pb, q, m)
    simulated = _tail(monte_carlo_acceptances(pb, q, m, 40_000, seed=len(case)))
    print(f"{case}: recursion {np.round(exact, 4)}, Monte Carlo {np.round(simulated, 4)}")
    assert np.abs(exact - simulated).max() < 0.01
    assert 0.02 < exact[1] and exact[-1] < 0.98  # not a trivial case


@pytest.mark.statistical
def test_recursion_that_subtracts_twice_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control: the reference code's double subtraction disagrees with the simulation."""
    real = dsbd._residual
    monkeypatch.setattr(dsbd, "_residual", lambda current, q: real(real(current, q), q))
    worst = 0.0
    for case, (pb, q, m) in RECURSION_CASES.items():
        wrong = acceptance_tail(pb, q, m)
        worst = max(worst, float(np.abs(wrong - _tail(monte_carlo_acceptances(pb, q, m, 40_000, len(case)))).max()))
    print(f"double subtraction: worst |diff| = {worst:.3f}")
    assert worst > 0.03


def _exact_acceptance_law(pb: np.ndarray, q: np.ndarray, m: int) -> np.ndarray:
    """Exact law of the accept count, by enumerating every draft sequence and accept / reject branch."""
    law = np.zeros(m + 1)

    def walk(current: np.ndarray, left: int, count: int, weight: float) -> None:
        if left == 0:
            law[count] += weight
            return
        for x in np.nonzero(q)[0]:
            accept = min(1.0, current[x] / q[x])
            if accept > 0:
                walk(pb, left - 1, count + 1, weight * q[x] * accept)
            if accept < 1:
                residual = np.clip(current - q, 0.0, None)
                walk(residual / residual.sum(), left - 1, count, weight * q[x] * (1 - accept))

    walk(pb, m, 0, 1.0)
    return law


def test_acceptance_recursion_equals_exact_enumeration() -> None:
    rng = np.random.default_rng(3)
    pb = np.concatenate([rng.dirichlet(np.ones(4)), np.zeros(2)])  # one invalid parent of 2 tokens
    q = rng.dirichlet(np.ones(6))
    for m in (1, 2, 3):
        law = acceptance_count_distribution(pb, q, m)
        assert law.dtype == np.float64 and law.shape == (m + 1,)
        np.testing.assert_allclose(law, _exact_acceptance_law(pb, q, m), atol=1e-12)
        assert acceptance_probability(pb, q, m, m) == pytest.approx(law[m])
    assert law[1] + law[2] + law[3] > 0.3 and law[3] > 0.01


def test_verify_layer_acceptance_counts_match_the_recursion() -> None:
    """The recursion models verify_layer itself (width = W_S: never stops early), invalid parent included."""
    pb, q, m = RECURSION_CASES["invalid parent 3x5, m=5"]
    mask = np.array([True, True, False])
    generator = np.random.default_rng(21)
    counts = np.zeros(m + 1)
    n = 4000
    for _ in range(n):
        verdict = verify_layer(pb, q, draft_layer(q, m, generator), mask, m, generator)
        counts[len(verdict.accepted)] += 1
        assert len(verdict.outputs) == m and all(mask[x // PARENT_TOKENS] for x in verdict.outputs)
    exact = acceptance_tail(pb, q, m)
    print(f"verify_layer tail {np.round(_tail(counts / n), 4)} vs recursion {np.round(exact, 4)}")
    assert np.abs(_tail(counts / n) - exact).max() < 0.03  # 4,000 runs: sd <= 0.008


def test_dynamic_width() -> None:
    rng = np.random.default_rng(9)
    q = rng.dirichlet(np.ones(10))
    assert acceptance_tail(q, q, 4).tolist() == [1.0] * 5
    assert dynamic_width(q, q, 4, threshold=1.0, w_min=1) == 4  # p == q: every draft accepted
    disjoint = np.zeros(10, dtype=np.float64)
    disjoint[int(np.argmin(q))] = 1.0
    q_off = q.copy()
    q_off[int(np.argmin(q))] = 0.0
    q_off /= q_off.sum()
    assert dynamic_width(disjoint, q_off, 4, threshold=0.01, w_min=2) == 2  # nothing is ever accepted
    pb = rng.dirichlet(np.ones(10))
    tail = acceptance_tail(pb, q, 4)
    widths = [dynamic_width(pb, q, 4, t, 1) for t in np.linspace(0, 1, 21)]
    assert widths == sorted(widths, reverse=True) and widths[0] == 4 and widths[-1] == 1
    for t in (0.1, 0.5, 0.9):
        expected = max([k for k in range(5) if tail[k] >= t] + [1])
        assert dynamic_width(pb, q, 4, t, 1) == expected
    with pytest.raises(ValueError):
        dynamic_width(pb, q, 4, 1.5, 1)


def test_degenerate_residual_keeps_p() -> None:
    """p' == q up to rounding: max(0, p' - q) is ~0 and must not be normalised into noise."""
    q = np.array([0.1, 0.2, 0.3, 0.4], dtype=np.float64)
    p = q.copy()
    p[0] += 1e-17 * 8  # a rounding-sized excess
    p /= p.sum()
    assert np.array_equal(dsbd._residual(p, q), p)
    assert np.array_equal(dsbd._residual(q, q), q)
    law = acceptance_count_distribution(q, q, 3)
    assert law.tolist() == [0.0, 0.0, 0.0, 1.0]
    verdict = verify_layer(q, q, [0, 1, 2, 3], np.array([True, True]), 4, np.random.default_rng(0))
    assert verdict.passed and verdict.accepted == [0, 1, 2, 3]


def test_verify_layer_rejects_bad_inputs() -> None:
    pb = np.array([0.5, 0.5, 0.0, 0.0], dtype=np.float64)
    q = np.array([0.25, 0.25, 0.25, 0.25], dtype=np.float64)
    with pytest.raises(ValueError, match="invalid parents"):
        verify_layer(q, q, [0], np.array([True, False]), 1, np.random.default_rng())
    with pytest.raises(ValueError, match="q_beam 0"):
        verify_layer(pb, pb, [2], np.array([True, False]), 1, np.random.default_rng())
    with pytest.raises(ValueError, match="same 2 parents"):
        verify_layer(pb, q[:3], [0], np.array([True, False]), 1, np.random.default_rng())
    verdict = verify_layer(pb, q, [2, 3], np.array([True, False]), 1, np.random.default_rng())
    assert not verdict.passed and verdict.accepted == [] and verdict.outputs[0] in (0, 1)

"""``specdec.bench.paired``: the paired speed ratio and its verdicts (pure arithmetic, fast tier)."""

from __future__ import annotations

import math

import pytest

from specdec.bench.paired import paired_ratio


def test_identical_speeds_give_ratio_one_within_noise() -> None:
    r = paired_ratio([100.0, 120.0, 90.0], [100.0, 120.0, 90.0])
    assert r.ratio == pytest.approx(1.0)
    assert r.verdict == "within noise"  # zero spread: the interval collapses onto 1, which it contains
    assert r.low == pytest.approx(1.0) and r.high == pytest.approx(1.0)


def test_pairing_cancels_a_drift_both_arms_share() -> None:
    # the machine slows from repeat to repeat by 30 %, and the arm is 10 % faster in every repeat: unpaired
    # medians would be noise-dominated, paired samples are all exactly 1.1
    base = [100.0, 85.0, 70.0, 120.0]
    r = paired_ratio([1.1 * b for b in base], base)
    assert r.ratio == pytest.approx(1.1)
    assert r.samples == pytest.approx((1.1,) * 4)
    assert r.verdict == "faster"


def test_interval_is_the_student_t_interval_of_the_mean_log_ratio() -> None:
    samples = [1.02, 0.97, 1.05, 0.99, 1.01]
    r = paired_ratio(samples, [1.0] * 5)
    logs = [math.log(x) for x in samples]
    mean = sum(logs) / 5
    sd = math.sqrt(sum((x - mean) ** 2 for x in logs) / 4)
    half = 2.7764451051977987 * sd / math.sqrt(5)  # t(0.975, 4 df)
    assert r.ratio == pytest.approx(math.exp(mean))
    assert (r.low, r.high) == pytest.approx((math.exp(mean - half), math.exp(mean + half)))
    assert r.verdict == "within noise"


def test_a_consistent_slowdown_is_called_slower_and_the_ratio_is_symmetric() -> None:
    arm, base = [90.0, 92.0, 89.0, 91.0], [100.0, 101.0, 99.0, 100.0]
    slower, faster = paired_ratio(arm, base), paired_ratio(base, arm)
    assert slower.verdict == "slower" and faster.verdict == "faster"
    assert slower.ratio * faster.ratio == pytest.approx(1.0)
    assert slower.low * faster.high == pytest.approx(1.0)


def test_a_wider_level_widens_the_interval() -> None:
    arm, base = [95.0, 99.0, 93.0, 97.0], [100.0, 100.0, 100.0, 100.0]
    narrow, wide = paired_ratio(arm, base, level=0.95), paired_ratio(arm, base, level=0.995)
    assert wide.low < narrow.low and wide.high > narrow.high


def test_one_pair_cannot_tell_a_difference_from_noise() -> None:
    r = paired_ratio([50.0], [100.0])
    assert r.ratio == pytest.approx(0.5)
    assert r.verdict == "within noise" and math.isinf(r.high)


@pytest.mark.parametrize(("arm", "base"), [([], []), ([1.0], [1.0, 2.0]), ([0.0], [1.0]), ([1.0], [-1.0])])
def test_bad_samples_are_refused(arm: list[float], base: list[float]) -> None:
    with pytest.raises(ValueError, match="paired_ratio"):
        paired_ratio(arm, base)

"""Paired speed ratios with a confidence interval: is one configuration faster than another, or is it noise?

Why: on a shared 2-core VM the same work measured twice moves by up to ±10 % (the same ``ar`` run
read 129-158 tok/s within one process, ``benchmarks/results/ems_vs_ar.md``), so a single ratio of two
runs cannot say whether ``ems`` is slower than ``ar``. Runs are therefore *paired*: each repeat runs
both arms back to back (the order rotated), the ratio of that repeat's two speeds is one sample, and
drifts slower than a repeat cancel in it. The samples' logarithms are averaged and Student's t gives
the interval of the mean log-ratio (a geometric-mean ratio, symmetric in which arm is the base); the
same statistic on two arms running identical work (``ar`` against ``ar``) measures the noise floor.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class PairedRatio:
    """Geometric-mean ratio of ``arm`` over ``base`` speeds across repeats, with its confidence interval."""

    ratio: float
    low: float
    high: float
    samples: tuple[float, ...]  # per-repeat ratios, in repeat order
    level: float

    @property
    def verdict(self) -> str:
        """``faster`` / ``slower`` when the whole interval lies above / below 1, else ``within noise``."""
        if self.low > 1.0:
            return "faster"
        if self.high < 1.0:
            return "slower"
        return "within noise"

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "samples": list(self.samples), "verdict": self.verdict}


def paired_ratio(arm: Sequence[float], base: Sequence[float], level: float = 0.95) -> PairedRatio:
    """The ratio ``arm / base`` of paired speeds (``arm[i]`` and ``base[i]`` measured in repeat i).

    With one repeat the interval is unbounded (no spread to estimate), so the verdict is never
    better than ``within noise``: a single pair cannot tell a difference from noise.
    """
    if len(arm) != len(base) or not arm:
        raise ValueError(f"paired_ratio needs equally many samples, at least one: got {len(arm)} and {len(base)}")
    if min(*arm, *base) <= 0:
        raise ValueError("paired_ratio needs positive speeds")
    logs = [math.log(a / b) for a, b in zip(arm, base, strict=True)]
    n = len(logs)
    mean = sum(logs) / n
    if n == 1:
        return PairedRatio(math.exp(mean), 0.0, math.inf, (math.exp(mean),), level)
    from scipy.stats import t

    sd = math.sqrt(sum((x - mean) ** 2 for x in logs) / (n - 1))
    half = float(t.ppf(0.5 + level / 2, n - 1)) * sd / math.sqrt(n)
    return PairedRatio(
        math.exp(mean), math.exp(mean - half), math.exp(mean + half), tuple(math.exp(x) for x in logs), level
    )

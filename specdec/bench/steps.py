"""Timing single backend steps against each other: interleaved rounds of back-to-back steps, medians.

Why one helper: the step benchmarks (``benchmarks.kv_cache_dtype``, ``benchmarks.attention_layout``)
compare variants of one step on a shared 2-core machine whose speed drifts by ±10% within minutes,
so every variant must be timed in the same rounds, in a rotating order, and each block of steps
must start with an untimed step: after another session's steps a step costs more (idle worker
threads of the other session still spinning, caches holding its data), which no decoding loop pays.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Hashable, Mapping
from typing import Any

from tqdm import tqdm

#: steps per variant per round; the first is untimed (module docstring)
BLOCK = 4


def interleaved_step_ms(
    work: Mapping[Hashable, tuple[Any, Any, Any]], rounds: int, desc: str = "steps", block: int = BLOCK
) -> dict[Hashable, float]:
    """Median ms of ``backend.step(batch, cache)`` per key of ``work`` (key -> (backend, batch, cache)).

    Each round runs every variant's block of ``block`` back-to-back steps, the order rotated by one
    each round; every variant is stepped once before the first round (first-touch allocations).
    """
    keys = list(work)
    for key in keys:
        backend, batch, cache = work[key]
        backend.step(batch, cache)
    samples: dict[Hashable, list[float]] = {key: [] for key in keys}
    for r in tqdm(range(rounds), desc=desc, leave=False):
        for key in keys[r % len(keys) :] + keys[: r % len(keys)]:
            backend, batch, cache = work[key]
            for i in range(block):
                start = time.perf_counter()
                backend.step(batch, cache)
                if i:
                    samples[key].append((time.perf_counter() - start) * 1000)
    return {key: round(statistics.median(values), 2) for key, values in samples.items()}

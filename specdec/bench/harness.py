"""What every benchmark measures with: one timed run, repeated runs of a method, cache sizing, the machine.

The benchmark programs (``specdec bench``, ``specdec bench beams``) and the scripts in
``benchmarks/`` share these pieces so that they time, repeat and describe runs the same way:

* **One timed run** (``run_once``): a garbage collection first, so a collection inside a timed
  run is not charged to whichever method hit it, and the process CPU time next to the wall
  time, because other jobs on a shared machine stretch the one and hardly the other.
* **Repeats** (``MethodRuns``): the median over repeats, taken by the caller over runs
  interleaved between methods, so a machine whose load drifts favours none of them.
* **The machine** (``machine_info``): CPU, threads, library versions and load average, which
  every report records because the numbers depend on them.
* **The record** (``utc_stamp``, ``run_command``): when a result was made and the command line that makes
  it again, which every committed result names.
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import os
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from specdec.runtime.engine import Engine, GenerationResult
from specdec.runtime.methods import BASELINE_METHOD, get_method

#: what ``specdec bench`` compares: the baseline, the padded multi-sample baseline, and EMS-SD
BASELINE, PADDED, RAGGED = BASELINE_METHOD, "vanilla", "ems"
METHODS = (BASELINE, PADDED, RAGGED)
SPECULATIVE = tuple(name for name in METHODS if get_method(name).uses_drafter)


@dataclass
class BenchConfig:
    """What a benchmark run measures; the same values apply to every method."""

    batch_sizes: tuple[int, ...] = (1, 4, 8, 16)
    max_tokens: int = 128
    num_draft_tokens: int = 7  # LLMA / EMS-SD copy up to 7 tokens on an n-gram hit
    ngram: int = 2  # LLMA / EMS-SD: look up the last 2-gram ...
    min_ngram: int = 2  # ... and only the 2-gram (a 1-gram "hit" is nearly always a wrong guess)
    repeats: int = 3
    methods: tuple[str, ...] = METHODS
    warmup: bool = True


@dataclass
class MethodRuns:
    """Every timed run of one method at one batch size, with the process CPU time of each."""

    results: list[GenerationResult] = field(default_factory=list)
    cpu_seconds: list[float] = field(default_factory=list)

    def median_run(self) -> GenerationResult:
        """The run with the median wall time (the lower middle one for an even count)."""
        ordered = sorted(self.results, key=lambda r: r.run.wall_seconds)
        return ordered[(len(ordered) - 1) // 2]

    def tokens_per_second(self) -> float:
        """Median over runs of generated tokens / wall seconds (prefill included)."""
        return statistics.median(r.run.generated_tokens / r.run.wall_seconds for r in self.results)

    def decode_tokens_per_second(self) -> float:
        """Median over runs of tokens after each request's first / ``RunMetrics.decode_seconds``.

        The prefill step emits every request's first token, so those are not decode tokens.
        """
        return statistics.median((r.run.generated_tokens - r.run.requests) / r.run.decode_seconds for r in self.results)

    def cpu_tokens_per_second(self) -> float:
        """Median over runs of generated tokens / process CPU seconds: insensitive to other jobs."""
        return statistics.median(r.run.generated_tokens / c for r, c in zip(self.results, self.cpu_seconds))


def required_max_len(prompt_lens: Sequence[int], config: BenchConfig) -> int:
    """Cache length at which vanilla can never run out of room.

    Vanilla advances every write position by the batch's largest accepted length, so in
    the worst case each of the ``max_tokens`` steps leaves ``k + 1`` positions behind.
    EMS-SD needs only ``prompt + max_tokens + k``; its cost does not depend on this size
    (attention reads only committed positions), so one cache serves all three methods.
    """
    return max(prompt_lens) + config.max_tokens * (config.num_draft_tokens + 1) + 1


def run_once(
    engine: Engine,
    prompts: Sequence[str | Sequence[int]],
    method: str,
    max_tokens: int,
    chat: bool,
    temperature: float = 0.0,
    seed: int = 0,
) -> tuple[GenerationResult, float]:
    """One ``generate`` call; returns its result and the process CPU seconds it used.

    ``temperature`` > 0 samples, prompt i with seed ``seed + i``, so every run draws the same way.
    """
    requests = [
        engine.request(
            p,
            chat=chat,
            max_tokens=max_tokens,
            request_id=f"p{i}",
            temperature=temperature,
            seed=seed + i if temperature > 0 else None,
        )
        for i, p in enumerate(prompts)
    ]
    gc.collect()  # a collection inside a timed run would be charged to whichever method hit it
    cpu_start = time.process_time()
    result = engine.generate(requests, method)
    cpu_seconds = time.process_time() - cpu_start
    failed = [o.error for o in result.outputs if o.error]
    if failed:
        raise RuntimeError(f"{method}: {len(failed)} request(s) failed, first: {failed[0]}")
    return result, cpu_seconds


def mean_accepted_length(result: GenerationResult) -> float:
    """Tokens per sequence per decoding step, counted per request while it is unfinished.

    ``RunMetrics.summary()`` divides by the sequences in each pack, and vanilla's packs
    also hold finished sequences that only compute padding; counting per request keeps
    the number comparable between methods (greedy: it is the same for vanilla and ems).
    """
    steps = sum(o.metrics.target_calls - 1 for o in result.outputs)  # minus the prefill call
    tokens = sum(o.metrics.generated_tokens - 1 for o in result.outputs)  # minus the prefill's token
    return round(tokens / steps, 4) if steps > 0 else 0.0


def machine_info() -> dict[str, Any]:
    """What the numbers depend on: CPU, threads, library versions, load from other users."""
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "processor": platform.processor() or "unknown",
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
    }
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            models = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        if models:
            info["processor"] = models[0]
    except OSError:
        pass
    if hasattr(os, "getloadavg"):
        info["load_average"] = [round(x, 2) for x in os.getloadavg()]
    return info


def int_list(text: str) -> tuple[int, ...]:
    """An argparse type for ``--batch-sizes 1,4,8``: positive integers, refused with a usage error otherwise."""
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from exc
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def utc_stamp() -> str:
    """The date every report records, in UTC (the zone of a shared machine says nothing to a reader)."""
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def run_command(module: str, argv: Sequence[str] | None = None) -> str:
    """The command line that makes a result again, as its report records it: ``python -m <module> <args>``,
    ``argv`` or, when None, this process's own arguments."""
    return shlex.join(["python", "-m", module, *(sys.argv[1:] if argv is None else argv)])

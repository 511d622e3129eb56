"""Chunked prefill: what a long prompt arriving mid-stream does to the running streams, with and without a budget.

What: the engine service (``EngineService``, the loop the served engine runs) on an export, ``ems``. Four chat
streams start; once each has streamed a few tokens, a prompt of ``--long-tokens`` tokens (near the context) is
submitted. Measured per configuration: the running streams' inter-token gaps (time between streamed events;
p50 / p99 / max), their time to first token, the long prompt's time to first token, and the same streams alone
(no long prompt) as the baseline. Configurations: ``prefill_budget`` None (the whole prompt in one step, what the
server did before) and the budgets given (rows per ragged step spent on prefill).

Why: issue 22 observation 5: a 2,000-token prompt froze a concurrent stream for 26.6 s through the server. With a
budget the prompt is prefilled in chunks that share steps with the running streams, so their tokens keep coming.

Run::

    python -m benchmarks.chunked_prefill --export benchmarks/.cache/edge/fp32

(writes benchmarks/results/chunked_prefill.md, .json and .png)
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import threading
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

from specdec.bench.figures import figure
from specdec.runtime.config import EngineConfig

STREAM_PROMPTS = [
    "Write a short story about a lighthouse keeper.",
    "List ten facts about the ocean.",
    "Explain how a bicycle works.",
    "Describe a busy market in the morning.",
]


def long_prompt(engine: Any, tokens: int) -> list[int]:
    """``tokens`` ids of ordinary English (standard-library docstrings), not a repeated token."""
    import argparse as a
    import collections
    import json as j
    import pathlib
    import threading as t

    text = "\n\n".join(m.__doc__ or "" for m in (a, collections, j, pathlib, t, statistics))
    ids = engine.encode(text)
    while len(ids) < tokens:
        ids += ids
    return ids[:tokens]


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def run_once(engine: Any, budget: int | None, long_ids: list[int] | None, max_tokens: int) -> dict[str, Any]:
    from specdec.serving.service import EngineService

    engine.reconfigure(prefill_budget=budget)
    service = EngineService(engine, "ems").start()
    events: dict[str, list[float]] = {}
    lock = threading.Lock()

    def recorder(name: str):
        def on_event(event: Any) -> None:
            with lock:
                events.setdefault(name, []).append(time.perf_counter())

        return on_event

    try:
        start = time.perf_counter()
        handles = [
            service.submit(engine.request(p, chat=True, max_tokens=max_tokens, request_id=f"s{i}"), recorder(f"s{i}"))
            for i, p in enumerate(STREAM_PROMPTS)
        ]
        long_sent = long_first = None
        if long_ids is not None:
            while True:  # every stream is decoding before the long prompt comes
                with lock:
                    if all(len(events.get(f"s{i}", [])) >= 5 for i in range(len(STREAM_PROMPTS))):
                        break
                time.sleep(0.005)
            long_sent = time.perf_counter()
            long_handle = service.submit(engine.request(long_ids, max_tokens=4, request_id="long"), recorder("long"))
            handles.append(long_handle)
        for h in handles:
            out = h.result(600)
            assert not out.error, out.error
        if long_sent is not None:
            long_first = events["long"][0] - long_sent
        gaps, ttft = [], []
        for i in range(len(STREAM_PROMPTS)):
            times = events[f"s{i}"]
            ttft.append(times[0] - start)
            gaps += [b - a for a, b in itertools.pairwise(times)]
        return {
            "budget": budget,
            "long": long_ids is not None,
            "gap_p50_ms": 1e3 * percentile(gaps, 50),
            "gap_p99_ms": 1e3 * percentile(gaps, 99),
            "gap_max_ms": 1e3 * max(gaps),
            "stream_ttft_p50_ms": 1e3 * statistics.median(ttft),
            "long_ttft_ms": None if long_first is None else 1e3 * long_first,
            "gaps": gaps,
        }
    finally:
        service.stop(drain=False, timeout=30)
        engine.reconfigure(prefill_budget=None)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--export", type=Path, default=Path("benchmarks/.cache/edge/fp32"))
    parser.add_argument("--budgets", default="0,128,64", help="prefill budgets (0 = whole prompt)")
    parser.add_argument("--long-tokens", type=int, default=1800)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out-dir", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args(argv)

    from specdec.runtime.engine import Engine

    engine = Engine.from_export(args.export, config=EngineConfig(max_batch=8, threads=args.threads, torch_threads=1))
    long_ids = long_prompt(engine, min(args.long_tokens, engine.max_len - 8))
    budgets = [int(b) or None for b in args.budgets.split(",")]
    configs = [(None, False)] + [(b, True) for b in budgets]
    run_once(engine, None, None, 8)  # warm-up
    rows: dict[tuple, list[dict]] = {}
    for _ in tqdm(range(args.repeats), desc="repeats"):
        for budget, with_long in tqdm(configs, desc="configs", leave=False):
            rows.setdefault((budget, with_long), []).append(
                run_once(engine, budget, long_ids if with_long else None, args.max_tokens)
            )
    summary = []
    for (budget, with_long), runs in rows.items():
        merged = {
            k: statistics.median(r[k] for r in runs)
            for k in runs[0]
            if k not in ("budget", "long", "gaps") and runs[0][k] is not None
        }
        summary.append({"budget": budget, "long": with_long, **merged, "gaps": [g for r in runs for g in r["gaps"]]})
    write(summary, args, len(long_ids))
    return 0


def write(summary: list[dict], args: argparse.Namespace, long_tokens: int) -> None:
    args.out_dir.mkdir(parents=True, exist_ok=True)
    label = {True: "with the long prompt", False: "streams alone"}
    lines = [
        "# Chunked prefill: a long prompt arriving mid-stream",
        "",
        f"Command: `python -m benchmarks.chunked_prefill --export {args.export} --budgets {args.budgets} "
        f"--long-tokens {args.long_tokens} --repeats {args.repeats}`. Engine service (the served loop), `ems`, "
        f"{len(STREAM_PROMPTS)} chat streams of {args.max_tokens} tokens; the long prompt ({long_tokens} tokens) "
        "arrives once every stream has streamed 5 events. Gaps: time between a stream's consecutive events "
        f"(one per step it took part in), pooled over streams and {args.repeats} repeats; other numbers are "
        "medians over repeats.",
        "",
        "| prefill budget | mix | gap p50 ms | gap p99 ms | gap max ms | streams' TTFT ms | long prompt TTFT ms |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for row in summary:
        budget = "whole prompt" if row["budget"] is None else f"{row['budget']} rows/step"
        lines.append(
            f"| {budget} | {label[row['long']]} | {row['gap_p50_ms']:.0f} | {row['gap_p99_ms']:.0f} | "
            f"{row['gap_max_ms']:.0f} | {row['stream_ttft_p50_ms']:.0f} | "
            f"{'-' if row.get('long_ttft_ms') is None else format(row['long_ttft_ms'], '.0f')} |"
        )
    (args.out_dir / "chunked_prefill.md").write_text("\n".join(lines) + "\n")
    (args.out_dir / "chunked_prefill.json").write_text(json.dumps(summary, indent=1))
    with figure(args.out_dir / "chunked_prefill.png", figsize=(8, 4.5)) as (_, ax):
        for row in summary:
            gaps = sorted(1e3 * g for g in row["gaps"])
            name = ("whole prompt" if row["budget"] is None else f"budget {row['budget']}") + f", {label[row['long']]}"
            ax.plot(gaps, [i / max(1, len(gaps) - 1) for i in range(len(gaps))], label=name)
        ax.set_xscale("log")
        ax.set_xlabel("gap between a stream's events (ms, log)")
        ax.set_ylabel("share of gaps ≤ x")
        ax.set_title("Running streams while a long prompt is prefilled")
        ax.legend()


if __name__ == "__main__":
    raise SystemExit(main())

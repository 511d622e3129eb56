"""Two runs of ``benchmarks/triton_serving.py`` side by side: before and after a change to the served path.

How it is used (from the repository root; the "before" checkout runs its own code through ``PYTHONPATH``, which
Python puts ahead of this venv's editable install, and its server's stubs inherit it; a checkout older than the
``benchmarks`` package runs ``python benchmarks/triton_serving.py`` instead)::

    git worktree add /tmp/before 8b48558
    (cd /tmp/before && PYTHONPATH=/tmp/before python -m benchmarks.triton_serving --out-dir /tmp/before-results)
    python -m benchmarks.triton_serving --force-export
    python -m benchmarks.serving_before_after /tmp/before-results/triton_serving.json \\
        benchmarks/results/triton_serving.json --before-label 8b48558 --after-label HEAD --stem supervision_before_after

Results: ``benchmarks/results/<stem>.{md,png}`` (``--stem``, default ``triton_serving_before_after``).

Why: the fault-handling work (drain, supervision, limits, deadlines, per-sequence isolation, chunked prefill)
adds checks to every request and every step; the issue asks that nothing that passed gets slower by more than
noise, which only the same benchmark run on both versions, on one machine, back to back, can show.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from specdec.bench.figures import figure

DEFAULT_OUT = Path(__file__).resolve().parent / "results"


def _rows(run: dict[str, Any]) -> dict[tuple[int, str], dict[str, Any]]:
    return {(row["concurrency"], row["method"]): row for row in run["throughput"]["median"]}


def report(
    before: dict[str, Any],
    after: dict[str, Any],
    labels: tuple[str, str],
    out: Path,
    stem: str = "triton_serving_before_after",
) -> str:
    old, new = _rows(before), _rows(after)
    lines = [
        f"# Serving through Triton, before ({labels[0]}) and after ({labels[1]})",
        "",
        "- Made by `python -m benchmarks.serving_before_after` over the two runs below (its docstring: how)",
        f"- Before: {before['date']}, `{before['command']}` ({before['total_seconds']:.0f} s), load after "
        f"{before['load_average_after']}",
        f"- After: {after['date']}, `{after['command']}` ({after['total_seconds']:.0f} s), load after "
        f"{after['load_average_after']}",
        f"- Machine: {after['machine'].get('processor')}, {after['machine'].get('cpu_count')} cores; each run "
        "exported and served with its own code, back to back",
        "",
        "| clients | method | tokens/s before | tokens/s after | after ÷ before | mean latency before (s) | "
        "after (s) | errors before / after |",
        "|---:|---|---:|---:|---:|---:|---:|---|",
    ]
    for key in sorted(set(old) & set(new)):
        a, b = old[key], new[key]
        lines.append(
            f"| {key[0]} | {key[1]} | {a['tokens_per_second']:.1f} | {b['tokens_per_second']:.1f} | "
            f"{b['tokens_per_second'] / a['tokens_per_second']:.2f}× | {a['mean_latency_seconds']:.2f} | "
            f"{b['mean_latency_seconds']:.2f} | {a['errors']} / {b['errors']} |"
        )
    lines += [
        "",
        "| one request, method | unary ms before | after | stream first-response ms before | after |",
        "|---|---:|---:|---:|---:|",
    ]
    for method, a in before["latency"]["summary"].items():
        b = after["latency"]["summary"].get(method)
        if b:
            lines.append(
                f"| {method} | {a['unary_ms']:.0f} | {b['unary_ms']:.0f} | {a['stream_first_ms']:.0f} | "
                f"{b['stream_first_ms']:.0f} |"
            )
    text = "\n".join(lines) + "\n"
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.md").write_text(text)
    keys = sorted(set(old) & set(new))
    with figure(out / f"{stem}.png", figsize=(8, 4), dpi=110) as (_, ax):
        xs = range(len(keys))
        ax.bar([x - 0.2 for x in xs], [old[k]["tokens_per_second"] for k in keys], 0.4, label=labels[0])
        ax.bar([x + 0.2 for x in xs], [new[k]["tokens_per_second"] for k in keys], 0.4, label=labels[1])
        ax.set_xticks(list(xs), [f"{c} × {m}" for c, m in keys])
        ax.set_xlabel("clients × method")
        ax.set_ylabel("tokens/s")
        ax.legend()
        ax.set_title("benchmarks/triton_serving.py, before and after")
    return text


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("before", type=Path)
    parser.add_argument("after", type=Path)
    parser.add_argument("--before-label", default="before")
    parser.add_argument("--after-label", default="after")
    parser.add_argument("--out-dir", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--stem", default="triton_serving_before_after", help="the results' file name")
    args = parser.parse_args(argv)
    print(
        report(
            json.loads(args.before.read_text()),
            json.loads(args.after.read_text()),
            (args.before_label, args.after_label),
            args.out_dir,
            args.stem,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The OpenAI load benchmark's report: every run's numbers folded into one row per engine and concurrency (the
median over repeats), the markdown table and notes, and the plot (``specdec.bench.report.write_report`` writes the
three files)."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from specdec.bench.figures import figure

#: the per-run numbers whose median over repeats a row shows
MEDIANS = (
    "tokens_per_s",
    "ttft_p50_ms",
    "ttft_p99_ms",
    "itl_p50_ms",
    "itl_p99_ms",
    "output_tokens_mean",
    "prompt_tokens_mean",
)
BASELINE = "llama-server"


def _median(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def fold(runs: Sequence[dict[str, Any]], engines: Sequence[str], concurrencies: Sequence[int]) -> list[dict[str, Any]]:
    """One row per (engine, concurrency), in that order: the median of each of ``MEDIANS`` over the runs that
    completed, the requests and request errors summed over all of them, and the runs that failed outright."""
    rows = []
    for engine in engines:
        for c in concurrencies:
            mine = [r for r in runs if r["engine"] == engine and r["concurrency"] == c]
            done = [r for r in mine if "error" not in r]
            row: dict[str, Any] = {"engine": engine, "concurrency": c, "runs": len(done)}
            row.update({k: _median([r.get(k) for r in done]) for k in MEDIANS})
            row["requests"] = sum(r.get("requests", 0) for r in done)
            row["errors"] = sum(r.get("errors", 0) for r in done)
            row["failed_runs"] = [r["error"] for r in mine if "error" in r]
            rows.append(row)
    return rows


def _cell(x: float | None, digits: int = 1) -> str:
    return "–" if x is None else f"{x:.{digits}f}"


def _pair(a: float | None, b: float | None) -> str:
    return "–" if a is None and b is None else f"{_cell(a, 0)} / {_cell(b, 0)}"


def ratio_to_baseline(rows: Sequence[dict[str, Any]], row: dict[str, Any]) -> float | None:
    """A row's tokens/s over llama-server's at the same concurrency (None where either is missing)."""
    base = next((r for r in rows if r["engine"] == BASELINE and r["concurrency"] == row["concurrency"]), None)
    if base is None or not base.get("tokens_per_s") or row.get("tokens_per_s") is None:
        return None
    return row["tokens_per_s"] / base["tokens_per_s"]


def table(rows: Sequence[dict[str, Any]], labels: dict[str, str]) -> list[str]:
    lines = [
        "| engine | concurrency | tokens/s | / llama-server | TTFT p50 / p99 (ms) | ITL p50 / p99 (ms) "
        "| output tokens (mean) | requests | errors |",
        "|:---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        ratio = ratio_to_baseline(rows, row)
        errors = str(row["errors"]) + (f" + {len(row['failed_runs'])} failed run(s)" if row["failed_runs"] else "")
        lines.append(
            f"| {labels.get(row['engine'], row['engine'])} | {row['concurrency']} | {_cell(row['tokens_per_s'])} "
            f"| {'–' if ratio is None else f'{ratio:.2f}×'} | {_pair(row['ttft_p50_ms'], row['ttft_p99_ms'])} "
            f"| {_pair(row['itl_p50_ms'], row['itl_p99_ms'])} | {_cell(row['output_tokens_mean'])} "
            f"| {row['requests']} | {errors} |"
        )
    return lines


def notes(rows: Sequence[dict[str, Any]], labels: dict[str, str]) -> list[str]:
    """What the table says, stated from its numbers: the best engine at each concurrency, and every failure."""
    out = []
    for c in sorted({r["concurrency"] for r in rows}):
        at = [r for r in rows if r["concurrency"] == c and r["tokens_per_s"] is not None]
        if len(at) > 1:
            best = max(at, key=lambda r: r["tokens_per_s"])
            ratio = ratio_to_baseline(rows, best)
            versus = "" if ratio is None or best["engine"] == BASELINE else f" ({ratio:.2f}× llama-server)"
            out.append(
                f"- Concurrency {c}: most tokens/s from {labels.get(best['engine'], best['engine'])}, "
                f"{best['tokens_per_s']:.1f}{versus}."
            )
    differ = []
    for c in sorted({r["concurrency"] for r in rows}):
        counted = {r["engine"]: r["prompt_tokens_mean"] for r in rows if r["concurrency"] == c}
        if len({round(v, 6) for v in counted.values() if v is not None}) > 1:
            differ.append(f"C={c}: " + ", ".join(f"{labels.get(k, k)} {v}" for k, v in counted.items()))
    if len({r["engine"] for r in rows}) > 1:
        out.append(
            "- Prompt tokens per request as each server counted them (`usage`, mean of a run): "
            + (
                f"they DIFFER ({'; '.join(differ)})."
                if differ
                else "the same for every engine at every concurrency "
                "(the same requests through the same chat template)."
            )
        )
    for row in rows:
        if row["errors"] or row["failed_runs"]:
            out.append(
                f"- {labels.get(row['engine'], row['engine'])} at concurrency {row['concurrency']}: "
                f"{row['errors']} request error(s), {len(row['failed_runs'])} failed run(s)"
                + (f": {row['failed_runs'][0][:300]}" if row["failed_runs"] else ".")
            )
    return out


def busy_warning(meta: dict[str, Any]) -> list[str]:
    """A warning when other work loaded the machine as the run began: llama-server's OpenMP threads wait for each
    other by spinning, so another runnable process on its cores slows it far more than it slows specdec, and such
    a run compares nothing."""
    cores = (meta.get("machine") or {}).get("cpu_count") or 1
    load = (meta.get("load_before") or [0.0])[0]
    if load < 0.5 * cores:
        return []
    return [
        f"- **Warning: the machine was busy when the run began** (1-minute load {load} on {cores} cores): "
        "llama-server slows far more than specdec under other load; rerun on an idle machine."
    ]


def _machine(m: dict[str, Any]) -> str:
    return f"{m.get('processor')}, {m.get('cpu_count')} cores, {m.get('platform')}, Python {m.get('python')}"


def markdown(doc: dict[str, Any]) -> str:
    meta, rows, labels = doc["meta"], doc["rows"], doc["labels"]
    lines = [
        "# OpenAI-API load: specdec beside llama-server, driven by aiperf",
        "",
        f"- Date: {meta['date']}",
        f"- Command: `{meta['command']}` (total {meta['seconds']:.0f} s)",
        f"- Load generator: {meta['loadgen']}",
        f"- Requests: {meta['workload']}",
        f"- Order: {meta['order']}",
        f"- llama-server (its last run; `-np` is each run's concurrency, `-c` 2048 per slot): "
        f"`{meta.get('llama_server_command', '–')}` ({meta.get('llama_server_version', '–')})",
        f"- specdec: `{meta.get('specdec_command', '–')}` over the main job's export, "
        f"`{meta['export']['command']}`" + (" (reused)" if meta["export"].get("reused") else ""),
        f"- Machine: {_machine(meta['machine'])}",
        f"- Load average (1, 5, 15 min): {meta['load_before']} before, {meta['load_after']} after",
        "",
        "## Results",
        "",
        *table(rows, labels),
        "",
        *notes(rows, labels),
        *busy_warning(meta),
        "",
        "## How to read it",
        "",
        "- tokens/s: aiperf's output token throughput, the output tokens of a run's successful requests (as the "
        "server reported them in `usage`) over the run's duration; median over the repeats.",
        "- TTFT: from sending a request to its first streamed token. ITL: per request, (latency − TTFT) / "
        "(output tokens − 1), so an engine that streams several tokens per chunk (speculation) is timed per "
        "token like one that streams one; p50 / p99 over a run's requests, median over the repeats.",
        "- output tokens (mean): answers end at EOS or the budget; the engines' answers differ (llama-server "
        "runs the Q4_1 file, specdec the export's quantized graphs), so a row's tokens/s is over its own answers.",
        "- errors: requests that failed (aiperf's error summary); a failed run (a server that did not start, "
        "aiperf that failed) is named in the notes.",
        f"- Every run's numbers, aiperf's commands and the raw per-run rows: `{meta['stem']}.json`; aiperf's own "
        f"artifacts (per-request records) stay under `{meta['work_dir']}`.",
        "",
    ]
    return "\n".join(lines)


def plot(doc: dict[str, Any], path: Path) -> None:
    """Tokens/s, TTFT and ITL against concurrency, one line per engine (p50 solid, p99 dashed)."""
    rows, labels = doc["rows"], doc["labels"]
    with figure(path, 1, 3, figsize=(15, 4.2)) as (fig, axes):
        panels = (
            ("tokens/s", [("tokens_per_s", "-")]),
            ("TTFT (ms)", [("ttft_p50_ms", "-"), ("ttft_p99_ms", "--")]),
            ("inter-token latency (ms)", [("itl_p50_ms", "-"), ("itl_p99_ms", "--")]),
        )
        for ax, (title, series) in zip(axes, panels, strict=True):
            for i, engine in enumerate(dict.fromkeys(r["engine"] for r in rows)):
                mine = [r for r in rows if r["engine"] == engine]
                for key, style in series:
                    points = [(r["concurrency"], r[key]) for r in mine if r[key] is not None]
                    if not points:
                        continue
                    name = labels.get(engine, engine) + ("" if len(series) == 1 else f" {key.split('_')[1]}")
                    xs, ys = zip(*points, strict=True)
                    ax.plot(xs, ys, style, marker="o", color=f"C{i}", label=name)
            ax.set_xscale("log", base=2)
            if title != "tokens/s":
                ax.set_yscale("log")  # a queue's TTFT grows by orders of magnitude with the concurrency
            ax.set_xticks(
                sorted({r["concurrency"] for r in rows}), [str(c) for c in sorted({r["concurrency"] for r in rows})]
            )
            ax.set_xlabel("concurrency (requests in flight)")
            ax.set_title(title)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
        fig.suptitle(doc["meta"].get("title", "OpenAI-API load, aiperf"), fontsize=10)

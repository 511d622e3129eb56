"""How benchmark results are written: the shared three-file writer and each program's table, plot and notes.

Every committed result in ``benchmarks/results/`` comes as the same three files, ``<stem>.json``
(the data), ``.md`` (tables, the command, the machine, how to read them) and ``.png`` (a plot),
so a reader finds any benchmark's numbers the same way. The notes are stated from the numbers
themselves (``ems_notes``, ``pareto_notes``), so a report cannot drift from its own table.

Sections: the shared writer (``write_report``); ``specdec bench``'s report over batch sizes
(``markdown_report``, ``plot_throughput``, ``write_results``); ``specdec bench beams``'s report
of speed against quality (``pareto_markdown``, ``plot_pareto``).
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

from specdec.bench.figures import figure
from specdec.bench.harness import PADDED, RAGGED, SPECULATIVE

# -- the shared writer ------------------------------------------------------------------


def write_report(
    doc: dict[str, Any],
    out_dir: Path,
    stem: str,
    markdown: Callable[[dict[str, Any]], str],
    draw: Callable[[dict[str, Any], Path], None],
) -> str:
    """Write a benchmark's ``<stem>.json``, ``.md`` and ``.png`` into ``out_dir``; returns the markdown.

    One writer, so every committed result comes as the same three files (data, table, plot).
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    text = markdown(doc)
    (out_dir / f"{stem}.json").write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    (out_dir / f"{stem}.md").write_text(text, encoding="utf-8")
    draw(doc, out_dir / f"{stem}.png")
    return text


def step_bars(path: Path, labels: list[str], series: dict[str, list[float]], title: str) -> None:
    """Grouped bars of ms per step: one group per label (a step shape), one bar per series (a variant)."""
    with figure(path, figsize=(max(9, 1.1 * len(labels)), 3.8)) as (_, ax):
        width = 0.8 / len(series)
        for i, (name, values) in enumerate(series.items()):
            ax.bar([j + (i - (len(series) - 1) / 2) * width for j in range(len(labels))], values, width, label=name)
        ax.set_xticks(range(len(labels)), labels, fontsize=8)
        ax.set_ylabel("ms per step")
        ax.set_title(title)
        ax.legend(fontsize=8)


def write_json(results: dict[str, dict[str, Any]], path: Path) -> None:
    """Top-level keys are batch sizes only; run metadata goes to the markdown report."""
    path.write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")


def fmt_cell(x: float | None, digits: int = 2, suffix: str = "") -> str:
    """A number for a table cell, or a dash where a method did not run (so every row has every column)."""
    return "–" if x is None else f"{x:.{digits}f}{suffix}"


# -- specdec bench: EMS-SD vs vanilla vs ar over batch sizes ----------------------------


def throughput_table(results: dict[str, dict[str, Any]], tps_key: str | None, prefix: str) -> list[str]:
    """One markdown table: tok/s of each method, speed-ups over ar, ems / vanilla."""
    lines = [
        "| batch | ar tok/s | vanilla tok/s | ems tok/s | vanilla / ar | ems / ar | ems / vanilla |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for batch, r in results.items():
        tps = r if tps_key is None else r[tps_key]
        sp = r[f"{prefix}speedup_over_ar"]
        lines.append(
            f"| {batch} | {fmt_cell(tps.get('ar'), 1)} | {fmt_cell(tps.get('vanilla'), 1)} | "
            f"{fmt_cell(tps.get('ems'), 1)} | "
            f"{fmt_cell(sp.get('vanilla'), 2, '×')} | {fmt_cell(sp.get('ems'), 2, '×')} | "
            f"{fmt_cell(r[f'{prefix}ems_over_vanilla'], 2, '×')} |"
        )
    return lines


def _work_table(results: dict[str, dict[str, Any]]) -> list[str]:
    """What the target computed: acceptance, padding, rows, calls, correctness."""
    lines = [
        "| batch | mean accepted length | acceptance rate | vanilla padded fraction (all / decode rows) |"
        " target rows (ar / vanilla / ems) | target calls (ar / vanilla / ems) | identical to ar |",
        "|---:|---:|---:|---:|---:|---:|:---:|",
    ]
    for batch, r in results.items():
        acc, rate, rows, calls = (r["mean_accepted_length"], r["acceptance_rate"], r["target_rows"], r["target_calls"])
        # vanilla and ems verify the same drafts greedily, so their acceptance is the same
        same = acc.get("vanilla") == acc.get("ems") and rate.get("vanilla") == rate.get("ems")
        acc_text = fmt_cell(acc.get("ems")) if same else f"{fmt_cell(acc.get('vanilla'))} / {fmt_cell(acc.get('ems'))}"
        rate_text = (
            fmt_cell(rate.get("ems")) if same else f"{fmt_cell(rate.get('vanilla'))} / {fmt_cell(rate.get('ems'))}"
        )
        identical = {True: "yes", False: "NO", None: "–"}[r["identical_to_ar"]]
        lines.append(
            f"| {batch} | {acc_text} | {rate_text} | {fmt_cell(r['padded_fraction'].get('vanilla'), 3)} / "
            f"{fmt_cell(r['decode_padded_fraction'].get('vanilla'), 3)} | "
            f"{rows.get('ar', '–')} / {rows.get('vanilla', '–')} / {rows.get('ems', '–')} | "
            f"{calls.get('ar', '–')} / {calls.get('vanilla', '–')} / {calls.get('ems', '–')} | {identical} |"
        )
    return lines


def markdown_report(results: dict[str, dict[str, Any]], meta: dict[str, Any]) -> str:
    """The human-readable report: tables, the command, the machine, and how to read them."""
    cfg, machine = meta["config"], meta["machine"]
    lines = [
        "# EMS-SD vs vanilla (padded) multi-sample speculative decoding",
        "",
        f"- Date: {meta['date']}",
        f"- Command: `{meta['command']}` (total {meta.get('elapsed_seconds', 0):.0f} s)",
        f"- Target: {meta['target']}, fp32, greedy, {cfg['max_tokens']} new tokens per request",
        f"- Drafter: prompt lookup on the last {cfg['min_ngram']}..{cfg['ngram']}-gram of prompt + output, "
        f"copying up to k = {cfg['num_draft_tokens']} tokens (same drafter and k for vanilla and ems)",
        f"- Workload: {meta['workload']}",
        f"- Machine: {machine['processor']}, {machine['cpu_count']} cores, {machine['platform']}; "
        f"Python {machine['python']}, torch {machine['torch']} with {machine['torch_threads']} intra-op "
        f"thread(s)",
        f"- Shared machine: load average (1, 5, 15 min) {meta.get('load_before', '?')} before, "
        f"{meta.get('load_after', '?')} after",
        f"- Timing: median of {cfg['repeats']} interleaved repeat(s) per method and batch size "
        "(method order rotated each repeat)",
        "",
        "## Throughput: generated tokens / wall seconds, prefill included",
        "",
        *throughput_table(results, None, ""),
        "",
        "## Decode-only throughput: prefill step excluded",
        "",
        *throughput_table(results, "decode_tokens_per_second", "decode_"),
        "",
        "## CPU-time throughput: generated tokens / process CPU seconds, prefill included",
        "",
        *throughput_table(results, "cpu_tokens_per_second", "cpu_"),
        "",
        "## What the target computed",
        "",
        *_work_table(results),
        "",
        "## How to read this",
        "",
        "- *Throughput* (JSON keys `ar`, `vanilla`, `ems`): generated tokens divided by the wall time of "
        "`Engine.generate`: prefill of all prompts, drafting, every target call, verification and Python "
        "bookkeeping. The median over repeats.",
        "- *Decode-only*: tokens after each request's first one, divided by `RunMetrics.decode_seconds` "
        "(target calls without prompt rows plus their drafting; verification and bookkeeping between "
        "calls are not in it). Closest to the paper's timing, which excludes prefill.",
        "- *CPU-time*: the same runs, divided by the CPU time this process used instead of wall time. Other "
        "jobs on a shared machine stretch wall time but hardly CPU time, so on a busy machine this is the "
        "steadier comparison of the work each method does.",
        "- *Mean accepted length*: tokens committed per sequence per decoding step (1 + accepted drafts); "
        "*acceptance rate*: accepted / proposed draft tokens. Vanilla and ems verify the same drafts "
        "greedily, so both are the same for the two; only the cost of a step differs.",
        "- *Padded fraction*: target rows that were padding (vanilla pads every sequence's drafts to the "
        "batch maximum), among all rows and among decode rows (prompt rows are never padded). Vanilla "
        "also leaves masked holes in the KV cache that attention still reads; "
        "that cost shows in time, not in rows.",
    ]
    notes = meta.get("notes", [])
    if notes:
        lines += ["", "## Notes", "", *(f"- {note}" for note in notes)]
    return "\n".join(lines) + "\n"


def plot_throughput(results: dict[str, dict[str, Any]], path: Path, title: str = "") -> None:
    """Throughput and speed-up over ar against batch size, one line per method."""
    batches = [int(b) for b in results]
    with figure(path, 1, 2, figsize=(11, 4.2)) as (fig, (ax1, ax2)):
        styles = {"ar": ("tab:gray", "s"), "vanilla": ("tab:orange", "o"), "ems": ("tab:blue", "D")}
        for method, (color, marker) in styles.items():
            if all(method in results[str(b)] for b in batches):
                ax1.plot(batches, [results[str(b)][method] for b in batches], marker=marker, color=color, label=method)
        for method in SPECULATIVE:
            color, marker = styles[method]
            values = [results[str(b)]["speedup_over_ar"].get(method) for b in batches]
            if all(v is not None for v in values):
                ax2.plot(batches, values, marker=marker, color=color, label=method)
        ax2.axhline(1.0, color="tab:gray", linestyle="--", linewidth=1, label="ar")
        ax1.set(xlabel="batch size", ylabel="generated tokens / s (prefill included)", title="Throughput")
        ax2.set(xlabel="batch size", ylabel="speed-up over ar (same batch size)", title="Speed-up over greedy")
        for ax in (ax1, ax2):
            ax.set_xticks(batches)
            ax.grid(alpha=0.3)
            ax.legend()
        if title:
            fig.suptitle(title, fontsize=10)


def write_results(
    results: dict[str, dict[str, Any]], meta: dict[str, Any], out_dir: Path, stem: str = "ems_vs_vanilla"
) -> list[Path]:
    """Write ``<stem>.json``, ``<stem>.md`` and ``<stem>.png`` into ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / f"{stem}.json", out_dir / f"{stem}.md", out_dir / f"{stem}.png"]
    write_json(results, paths[0])
    paths[1].write_text(markdown_report(results, meta), encoding="utf-8")
    cfg = meta["config"]
    plot_throughput(
        results,
        paths[2],
        f"{meta['target']}, prompt lookup k={cfg['num_draft_tokens']}, {cfg['max_tokens']} new tokens, "
        f"greedy, {meta['machine']['torch_threads']} thread(s)",
    )
    return paths


def ems_notes(results: dict[str, dict[str, Any]]) -> list[str]:
    """Plain statements of what the numbers show, so the report cannot drift from them."""
    bad = [b for b, r in results.items() if r["identical_to_ar"] is False]
    notes = [
        "Every vanilla and ems output was token-identical to ar's."
        if not bad
        else f"OUTPUTS DIFFER from ar at batch size(s) {', '.join(bad)}: see identical_to_ar_by_method."
    ]
    for label, key in (
        ("wall", "ems_over_vanilla"),
        ("decode-only", "decode_ems_over_vanilla"),
        ("CPU-time", "cpu_ems_over_vanilla"),
    ):
        ratios = {b: r[key] for b, r in results.items() if r[key] is not None}
        if ratios:
            behind = [b for b, x in ratios.items() if round(x, 2) < 1.0]  # as printed: 0.996 is a tie
            notes.append(
                f"ems / vanilla, {label}: "
                + ", ".join(f"B={b} {x:.2f}×" for b, x in ratios.items())
                + ("." if not behind else f" (ems behind at B={', '.join(behind)}).")
            )
    both = {b: r for b, r in results.items() if {PADDED, RAGGED} <= r["decode_rows"].keys()}
    if both:
        notes.append(
            "Target rows in decode steps, vanilla / ems: "
            + ", ".join(
                f"B={b} {r['decode_rows']['vanilla']} / {r['decode_rows']['ems']}"
                f" ({r['decode_rows']['vanilla'] / max(r['decode_rows']['ems'], 1):.2f}×)"
                for b, r in both.items()
            )
            + ". The prompt rows (prefill) are the same for every method."
        )
        notes.append(
            "Share of ems's wall time spent in the prefill step, which every method pays alike: "
            + ", ".join(
                f"B={b} {r['prefill_seconds']['ems'] / statistics.median(r['wall_seconds']['ems']):.0%}"
                for b, r in both.items()
            )
            + "."
        )
    return notes


# -- specdec bench beams: DSBD vs beam vs ems, speed against quality --------------------


def pareto_markdown(doc: dict[str, Any]) -> str:
    """The speed-against-quality table, with each dsbd row's speed over beam of its width (the law it keeps)."""
    meta, rows = doc["meta"], doc["results"]
    beam = {int(label.split("=")[1]): r for label, r in rows.items() if label.startswith("beam W=")}
    lines = [
        "# DSBD vs beam sampling vs EMS-SD sampling: speed and quality",
        "",
        f"- Date: {meta['date']}; command: `{meta['command']}` ({meta['elapsed_seconds']:.0f} s)",
        f"- Target {meta['target']}, draft {meta['draft']}; torch, fp32, {meta['machine']['torch_threads']} thread",
        f"- {meta['prompts']} requests decoded together (one batch), {meta['max_tokens']} new tokens at most, "
        f"temperature {meta['temperature']}, seeds fixed; γ = {meta['gamma']} draft layers (ems: k = {meta['gamma']})",
        f"- Workload: {meta['workload']}",
        f"- Median of {meta['repeats']} interleaved repeat(s); load average before {meta['load_before']}, after "
        f"{meta['load_after']}",
        "",
        f"- Extractive QA: {meta['qa_items']} items ({meta['qa_workload']}), {meta['qa_max_tokens']} new tokens at "
        "most, same method and temperature; exact match = the first line is the bare name, QA accuracy = the first "
        "listed module the answer names is the right one (a guess scores 0.20); the target at temperature 0 "
        f"scores {', '.join(f'{k} {v:.2f}' for k, v in meta.get('qa_reference', {}).items()) or '–'}",
        "",
        "| method | tokens/s | log-likelihood / token | exact match | QA accuracy | target calls | tokens / call | "
        "acceptance | mean beams / round | speed vs beam of the same width |",
        "|:---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for label, r in rows.items():
        width = next((w for w in beam if f"W_S={w} " in label), None)
        vs = f"{r['tokens_per_second'] / beam[width]['tokens_per_second']:.2f}×" if width else "–"
        acc = "–" if r["acceptance_rate"] is None else f"{r['acceptance_rate']:.2f}"
        mbw = "–" if r["mean_beam_width"] is None else f"{r['mean_beam_width']:.2f}"
        em, acc_qa = ("–" if r.get(key) is None else f"{r[key]:.2f}" for key in ("exact_match", "qa_accuracy"))
        lines.append(
            f"| {label} | {r['tokens_per_second']:.1f} | {r['logprob_per_token']:.3f} | {em} | {acc_qa} "
            f"| {r['target_calls']} | {r['tokens_per_call']:.2f} | {acc} | {mbw} | {vs} |"
        )
    lines += [
        "",
        f"Pareto front (fastest first): {', '.join(doc['pareto'])}.",
        "",
        "## Notes",
        "",
        *(f"- {n}" for n in meta["notes"]),
    ]
    return "\n".join(lines) + "\n"


def plot_pareto(doc: dict[str, Any], path: Path) -> None:
    """Log-likelihood per token against tokens/s, one labelled point per method, and the Pareto front."""
    with figure(path, figsize=(7.5, 5)) as (_, ax):
        colors = {"ems": "tab:gray", "beam": "tab:orange", "dsbd": "tab:blue"}
        for label, r in doc["results"].items():
            kind = label.split()[0]
            ax.scatter(
                r["tokens_per_second"],
                r["logprob_per_token"],
                color=colors[kind],
                marker="s" if "single" in label else "^" if "adaptive" in label else "o",
                s=50,
            )
            ax.annotate(
                label,
                (r["tokens_per_second"], r["logprob_per_token"]),
                textcoords="offset points",
                xytext=(5, 4),
                fontsize=7,
            )
        front = [doc["results"][label] for label in doc["pareto"]]
        ax.plot(
            [r["tokens_per_second"] for r in front],
            [r["logprob_per_token"] for r in front],
            "--",
            color="tab:green",
            linewidth=1,
            label="Pareto front",
        )
        ax.set(
            xlabel="tokens / s (batch, prefill included)",
            ylabel="target log-likelihood per token (higher = better)",
            title=f"{doc['meta']['target']}: DSBD vs beam sampling vs EMS-SD, {doc['meta']['prompts']} requests",
        )
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)


def pareto_notes(rows: dict[str, dict[str, Any]]) -> list[str]:
    """What the table says, stated from the numbers themselves."""
    notes = []
    ems = rows["ems"]
    for label, r in rows.items():
        if not label.startswith("dsbd") or "single" in label:
            continue
        width = int(label.split("W_S=")[1].split()[0])
        b = rows.get(f"beam W={width}")
        if b:
            speed = r["tokens_per_second"] / b["tokens_per_second"]
            notes.append(
                f"{label}: {speed:.2f}× the tokens/s of beam W={width} at log-likelihood/token "
                f"{r['logprob_per_token']:.3f} vs {b['logprob_per_token']:.3f} "
                f"(acceptance {r['acceptance_rate']:.2f}, {r['mean_beam_width']:.2f} beams per round, "
                f"{r['tokens_per_call']:.2f} tokens per target call vs {b['tokens_per_call']:.2f}"
                + (
                    f"; QA accuracy {r['qa_accuracy']:.2f} vs {b['qa_accuracy']:.2f}"
                    if r.get("qa_accuracy") is not None and b.get("qa_accuracy") is not None
                    else ""
                )
                + ")."
            )
    best = max(rows, key=lambda label: rows[label]["logprob_per_token"])
    fastest = max(rows, key=lambda label: rows[label]["tokens_per_second"])
    notes.append(
        f"Highest quality: {best} ({rows[best]['logprob_per_token']:.3f} per token) vs ems sampling "
        f"{ems['logprob_per_token']:.3f}; fastest: {fastest} ({rows[fastest]['tokens_per_second']:.1f} "
        "tokens/s)."
    )
    return notes

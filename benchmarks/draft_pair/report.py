"""The report of ``python -m benchmarks.draft_pair``: its tables, markdown, plot and the three files."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.draft_pair import DRAFTER_LABELS, DRAFTERS
from benchmarks.draft_pair.grid import break_even
from specdec.bench.figures import figure
from specdec.bench.report import fmt_cell

# -- reporting ---------------------------------------------------------------------------


def cost_table(costs: dict[str, Any], ks: Sequence[int]) -> list[str]:
    kk = " / ".join(str(k) for k in ks)
    lines = [
        f"| batch | draft ms / step | target ms / step | draft / target | target verify ms, k = {kk} "
        f"| verify / target step, k = {kk} | break-even accepted length, draft model, k = {kk} "
        f"| break-even accepted length, n-gram, k = {kk} |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for batch, c in costs.items():

        def row(values: dict[str, float], digits: int) -> str:
            return " / ".join(fmt_cell(values.get(str(k)), digits) for k in ks)

        even = c["break_even_accepted_length"]
        lines.append(
            f"| {batch} | {c['draft_ms']:.2f} | {c['target_ms']:.2f} | {c['draft_over_target']:.1%} | "
            f"{row(c['verify_ms'], 1)} | {row(c['verify_over_target'], 2)} | {row(even['draft'], 2)} | "
            f"{row(even['ngram'], 2)} |"
        )
    return lines


def best_k_table(best: dict[str, Any], batches: Sequence[str]) -> list[str]:
    lines = [
        "| workload | drafter | method | " + " | ".join(f"B = {b}" for b in batches) + " |",
        "|:---|:---|:---|" + "---:|" * len(batches),
    ]
    for workload, by_drafter in best.items():
        for drafter, by_method in by_drafter.items():
            for method, row in by_method.items():
                cells = [f"{row[b]['speedup_over_ar']:.2f}× (k={row[b]['k']})" for b in batches]
                lines.append(f"| {workload} | {DRAFTER_LABELS[drafter]} | {method} | " + " | ".join(cells) + " |")
    return lines


def grid_table(cells: dict[str, Any], costs: dict[str, Any]) -> list[str]:
    lines = [
        "| drafter | batch | k | ar tok/s | ems tok/s | vanilla tok/s | ems / ar | vanilla / ar | ems / ar, decode "
        "| acceptance rate | mean accepted length | break-even length | ems time drafting | identical to ar |",
        "|:---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|:---:|",
    ]
    for drafter in DRAFTERS:
        for batch, cell in cells.items():
            for k, by_m in cell[drafter].items():
                e, v = by_m["ems"], by_m["vanilla"]
                same = e["identical_to_ar"] and v["identical_to_ar"]
                identical = "yes" if same else f"NO (ems {e['identical_to_ar']}, vanilla {v['identical_to_ar']})"
                lines.append(
                    f"| {DRAFTER_LABELS[drafter]} | {batch} | {k} | {cell['ar']['tokens_per_second']:.1f} | "
                    f"{e['tokens_per_second']:.1f} | {v['tokens_per_second']:.1f} | {e['speedup_over_ar']:.2f}× | "
                    f"{v['speedup_over_ar']:.2f}× | {e['decode_speedup_over_ar']:.2f}× | {e['acceptance_rate']:.2f} | "
                    f"{e['mean_accepted_length']:.2f} | {fmt_cell(break_even(costs, batch, drafter, int(k)))} | "
                    f"{e['draft_share']:.0%} | {identical} |"
                )
    return lines


def markdown_report(doc: dict[str, Any]) -> str:
    meta, cfg, machine = doc["meta"], doc["meta"]["config"], doc["meta"]["machine"]
    batches = [str(b) for b in cfg["batch_sizes"]]
    lines = [
        "# Distilled draft model vs prompt lookup: EMS-SD vs vanilla vs ar",
        "",
        f"- Date: {meta['date']}",
        f"- Command: `{meta['command']}` (total {meta['elapsed_seconds']:.0f} s)",
        f"- Target: {meta['target']}, fp32, greedy, {cfg['max_tokens']} new tokens per request",
        f"- Draft model: {meta['draft']}",
        f"- n-gram drafter: prompt lookup on the last {cfg['min_ngram']}..{cfg['ngram']}-gram of prompt + output",
        *(f"- Workload *{w}*: {text}" for w, text in meta["workloads"].items()),
        f"- Machine: {machine['processor']}, {machine['cpu_count']} cores, {machine['platform']}; Python "
        f"{machine['python']}, torch {machine['torch']} with {machine['torch_threads']} intra-op thread(s)",
        f"- Shared machine: load average (1, 5, 15 min) {meta['load_before']} before, {meta['load_after']} after",
        f"- Timing: median of {cfg['repeats']} repeat(s) per run; ar once per (workload, batch size), shared by "
        "every drafter and k of it",
        "",
        "## Cost of a draft token",
        "",
        f"One ragged step at a fixed decode shape: B sequences, {cfg['context']} cached tokens each, one new token "
        f"each (median of {cfg['cost_steps']} interleaved steps). *verify*: the target step that checks k drafts "
        "(k + 1 tokens per sequence). *Break-even accepted length*: (k · draft step + verify step) / target step, "
        "the tokens per sequence a speculative step must yield to match ar (n-gram lookup counted as free).",
        "",
        *cost_table(doc["cost"], cfg["ks"]),
        "",
        "## Best k: ems and vanilla speed-up over ar (tokens/s, prefill included)",
        "",
        *best_k_table(doc["best_k"], batches),
        "",
    ]
    for workload, cells in doc["grid"].items():
        lines += [f"## Workload *{workload}*: every run", "", *grid_table(cells, doc["cost"]), ""]
    lines += [
        "## How to read this",
        "",
        "- *tok/s*: generated tokens / wall seconds of `Engine.generate` (prefill, drafting, target calls, "
        "verification, bookkeeping). *decode*: the same without the prefill step.",
        "- *Mean accepted length*: tokens committed per sequence per speculative step (1 + accepted drafts); "
        "ems and vanilla verify the same greedy drafts, so theirs are equal. Speculation pays roughly when it "
        "exceeds the break-even length of the cost table (which ignores prefill and Python overhead).",
        "- *ems time drafting*: share of the ems run's wall time spent in the drafter (the draft model's steps, "
        "or the n-gram lookup).",
        "",
        "## Notes",
        "",
        *(f"- {note}" for note in meta["notes"]),
    ]
    return "\n".join(lines) + "\n"


def plot(doc: dict[str, Any], path: Path) -> None:
    """One panel per workload: best-k speed-up over ar against batch size; vanilla dashed."""
    best = doc["best_k"]
    with figure(path, 1, len(best), figsize=(5.5 * len(best), 4.2), squeeze=False) as (fig, axes):
        colors = {"draft": "tab:blue", "ngram": "tab:green"}
        for ax, (workload, by_drafter) in zip(axes[0], best.items()):
            for drafter, by_method in by_drafter.items():
                for method, style in (("ems", "-"), ("vanilla", "--")):
                    row = by_method[method]
                    xs = [int(b) for b in row]
                    ys = [row[b]["speedup_over_ar"] for b in row]
                    ax.plot(
                        xs,
                        ys,
                        style,
                        marker="o" if method == "ems" else "x",
                        color=colors[drafter],
                        label=f"{DRAFTER_LABELS[drafter]}, {method}",
                    )
                    if method == "ems":
                        for x, y, b in zip(xs, ys, row):
                            ax.annotate(
                                f"k={row[b]['k']}",
                                (x, y),
                                textcoords="offset points",
                                xytext=(4, 4),
                                fontsize=7,
                                color=colors[drafter],
                            )
            ax.axhline(1.0, color="tab:gray", linewidth=1, label="ar")
            ax.set_xticks([int(b) for b in by_drafter["draft"]["ems"]])
            ax.set(
                xlabel="batch size",
                ylabel="best-k speed-up over ar (tokens/s, prefill included)",
                title=f"{workload} workload",
            )
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
        cfg = doc["meta"]["config"]
        fig.suptitle(
            f"{doc['meta']['target']} + distilled draft vs n-gram, k in {list(cfg['ks'])}, "
            f"{cfg['max_tokens']} new tokens, greedy, {doc['meta']['machine']['torch_threads']} thread(s)",
            fontsize=10,
        )


def write_results(doc: dict[str, Any], out_dir: Path, stem: str = "draft_pair") -> list[Path]:
    """Write ``<stem>.json``, ``<stem>.md`` and ``<stem>.png`` into ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / f"{stem}.json", out_dir / f"{stem}.md", out_dir / f"{stem}.png"]
    paths[0].write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    paths[1].write_text(markdown_report(doc), encoding="utf-8")
    plot(doc, paths[2])
    return paths

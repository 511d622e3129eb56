"""The distilled draft model vs prompt lookup, each under EMS-SD and the padded baseline, against greedy.

What: SmolLM2-135M as target with the draft that ``specdec distill`` made for it and that ships
as ``smollm2-135m-draft`` (a few target layers, a restricted LM head), and beside it the
prompt-lookup (n-gram) drafter. ``ems`` (EMS-SD), ``vanilla`` (the padded multi-sample
baseline) and ``ar`` (greedy autoregressive decoding) run at batch sizes 1, 4, 8 and 16 for
k = 2, 4 and 6 draft tokens, on two workloads:

* *chat*: 24 general questions and instructions written for this benchmark, none of them a
  prompt the draft was distilled on (``specdec.distill.prompts.builtin_prompts``), chat template
  applied. The answers are new text: what a draft model can predict and prompt lookup rarely can.
* *extractive*: the workload of ``specdec bench`` (summarise or list the points of a
  standard-library docstring, chat template applied): answers copy the prompt, where prompt
  lookup pays.

Why the cost measurement: a speculative step pays when its mean accepted length (tokens per
sequence per step) exceeds its cost in target steps: k draft steps plus one target step that
verifies k + 1 tokens per sequence. So the parts are timed too, at one fixed decode shape
(B sequences, one new token each, ``--context`` cached tokens): ms per ragged step of the
draft and of the target (their ratio is the cost of a draft token relative to a target token)
and of the target verifying k + 1 tokens per sequence. From them the report derives the
break-even mean accepted length of every (B, k) and prints it next to the measured one.

How it is measured, as in ``specdec bench``: one process, one torch thread, greedy decoding;
one engine per batch size over one shared target backend (drafter and k are switched between
runs, the KV cache is sized for the largest k); runs interleaved with their order rotated
between repeats, the median over repeats kept; tokens/s counts prefill. Every output is
compared with ``ar``'s token for token: greedy speculative decoding must reproduce it, and a
difference is reported (in the tables, the JSON and the exit status 1), not raised.

Run::

    python benchmarks/draft_pair.py            # the full grid, about 25 minutes on a 2-core CPU
    python benchmarks/draft_pair.py --quick --out-dir /tmp/draftbench   # smoke run, a few minutes

Writes ``<out-dir>/draft_pair.{json,md,png}`` (default ``benchmarks/results``).
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import platform
import shlex
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from specdec.bench.harness import (
    BenchConfig,
    MethodRuns,
    int_list,
    machine_info,
    mean_accepted_length,
    required_max_len,
    run_once,
)
from specdec.bench.workloads import MAX_DOC_CHARS, MIN_DOC_CHARS, build_workload
from specdec.models.drafts import load_pair
from specdec.models.loading import LoadedModel
from specdec.models.presets import DEFAULT_TARGET
from specdec.runtime.backends.torch_backend import TorchBackend
from specdec.runtime.config import EngineConfig
from specdec.runtime.costs import step_costs
from specdec.runtime.drafters import Drafter, ModelDrafter, NgramDrafter
from specdec.runtime.engine import Engine
from specdec.runtime.text import encode_text

DEFAULT_DRAFT = "smollm2-135m-draft"
WORKLOADS = ("chat", "extractive")
DRAFTERS = ("draft", "ngram")  # the distilled draft model; prompt lookup
DRAFTER_LABELS = {"draft": "draft model", "ngram": "n-gram"}
SPECULATIVE = ("ems", "vanilla")
COST_TARGET = 0.15  # the bound: a draft token costs at most 15 % of a target token

# General questions and instructions, deliberately not in the shapes or topics of the
# prompts the draft was distilled on (``specdec.distill.prompts._TEMPLATES`` x ``_TOPICS``).
CHAT_PROMPTS = (
    "Explain why the sky looks blue during the day and red at sunset.",
    "Write a short email to a colleague asking to move tomorrow's meeting to Friday afternoon.",
    "Give three tips for staying focused while working from home.",
    "What is the difference between a list and a tuple in Python?",
    "Describe how to make a simple tomato pasta sauce, step by step.",
    "Why do cats purr? Keep the answer brief.",
    "Write a polite message declining an invitation to a birthday party.",
    "Give me five ideas for a rainy weekend with children.",
    "Explain what a mortgage is and how the interest rate affects the monthly payment.",
    "How can I improve my handwriting? Give practical advice.",
    "Write a thank-you note to a teacher at the end of the school year.",
    "What should I pack for a three-day hiking trip?",
    "Explain the difference between weather and climate.",
    "Suggest a name for a small bakery and explain your choice.",
    "Give three reasons why regular exercise is good for mental health.",
    "How does a refrigerator keep food cold?",
    "Write a short product description for a reusable water bottle.",
    "What are the main steps to repot a houseplant?",
    "Explain what an API is to someone who is just starting to learn programming.",
    "Write a short apology email for missing a project deadline.",
    "Give four tips for doing well in a job interview.",
    "Why do leaves change colour in autumn?",
    "Compare travelling by train and by plane for a 500 km trip.",
    "Write a to-do list for preparing a dinner party for six people.",
)


@dataclass
class PairConfig:
    """What one run measures; every method, drafter and k sees the same prompts and budget."""

    batch_sizes: tuple[int, ...] = (1, 4, 8, 16)
    ks: tuple[int, ...] = (2, 4, 6)
    max_tokens: int = 64
    prompts: int | None = None  # distinct prompts per workload (None: the largest batch size)
    repeats: int = 1
    cost_batch_sizes: tuple[int, ...] | None = None  # None: the grid's batch sizes
    context: int = 200  # cached tokens per sequence in the cost measurement
    cost_steps: int = 20
    ngram: int = 2  # the n-gram drafter of ``specdec bench`` (LLMA: the last 2-gram only)
    min_ngram: int = 2
    warmup: bool = True

    @property
    def num_prompts(self) -> int:
        return self.prompts or max(self.batch_sizes)


# -- workloads ---------------------------------------------------------------------------


def chat_workload(n: int) -> list[str]:
    """``n`` chat prompts, ``CHAT_PROMPTS`` in order (cycled past 24)."""
    return [CHAT_PROMPTS[i % len(CHAT_PROMPTS)] for i in range(n)]


def build_workloads(n: int) -> dict[str, list[str]]:
    """``n`` distinct prompts of each workload (the extractive ones are ``specdec bench``'s)."""
    return {"chat": chat_workload(n), "extractive": build_workload(n)}


def batch_of(items: Sequence[Any], batch: int) -> list[Any]:
    """The first ``batch`` items, cycling when there are fewer (``--prompts`` below the batch size)."""
    return [items[i % len(items)] for i in range(batch)]


# -- cost of a draft token ---------------------------------------------------------------


def measure_costs(
    target: TorchBackend, draft: TorchBackend, stream: Sequence[int], config: PairConfig, progress: bool = True
) -> dict[str, dict[str, Any]]:
    """``step_costs`` at every cost batch size: ``{"<batch>": record}``."""
    batches = config.cost_batch_sizes or config.batch_sizes
    costs = {}
    for batch in tqdm(batches, desc="step cost", unit="batch", disable=not progress):
        costs[str(batch)] = step_costs(
            target, draft, batch, context=config.context, ks=config.ks, steps=config.cost_steps, stream=stream
        )
    return costs


# -- the grid ----------------------------------------------------------------------------

Run = tuple[str, str | None, int]  # (method, drafter, k); ar: (ar, None, 0)


def run_plan(ks: Sequence[int]) -> list[Run]:
    """Every run of one (workload, batch size) cell: ar once, then ems and vanilla per k and drafter."""
    return [("ar", None, 0), *((m, d, k) for k in ks for d in DRAFTERS for m in SPECULATIVE)]


def run_name(run: Run) -> str:
    method, drafter, k = run
    return method if drafter is None else f"{method} {drafter} k={k}"


def _use(engine: Engine, drafters: dict[str, Drafter], drafter: str | None, k: int) -> None:
    """Point the engine at a drafter and k; a run's context resets the drafter's state."""
    engine.drafter = None if drafter is None else drafters[drafter]
    engine.reconfigure(num_draft_tokens=k)


def _mismatches(tokens: list[list[int]], reference: list[list[int]]) -> list[dict[str, int]]:
    """Requests whose tokens differ from ar's, with the first differing position."""
    out = []
    for i, (got, want) in enumerate(zip(tokens, reference)):
        if got != want:
            pos = next((j for j, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
            out.append({"request": i, "position": pos, "length": len(got), "ar_length": len(want)})
    return out


def _record(runs: MethodRuns) -> dict[str, Any]:
    """Throughputs (medians over repeats) and counters (from the median run) of one run kind."""
    median = runs.median_run()
    summary = median.run.summary()
    return {
        "tokens_per_second": round(runs.tokens_per_second(), 3),
        "decode_tokens_per_second": round(runs.decode_tokens_per_second(), 3),
        "cpu_tokens_per_second": round(runs.cpu_tokens_per_second(), 3),
        "wall_seconds": [round(r.run.wall_seconds, 3) for r in runs.results],
        "generated_tokens": summary["generated_tokens"],
        "target_calls": summary["target_calls"],
        "target_rows": summary["target_rows"],
    }


def _speculative_record(runs: MethodRuns, ar: dict[str, Any], reference: list[list[int]]) -> dict[str, Any]:
    """``_record`` plus acceptance, drafting time, speed-ups over ar and the token-for-token check."""
    median = runs.median_run()
    summary = median.run.summary()
    record = _record(runs)
    bad = [m for r in runs.results for m in _mismatches([o.token_ids for o in r.outputs], reference)]
    return {
        **record,
        "speedup_over_ar": round(record["tokens_per_second"] / ar["tokens_per_second"], 3),
        "decode_speedup_over_ar": round(record["decode_tokens_per_second"] / ar["decode_tokens_per_second"], 3),
        "acceptance_rate": summary["acceptance_rate"],
        "mean_accepted_length": mean_accepted_length(median),
        "draft_tokens": summary["draft_tokens"],
        "draft_seconds": summary["draft_seconds"],
        "draft_share": round(summary["draft_seconds"] / median.run.wall_seconds, 4),
        "identical_to_ar": not bad,
        "mismatches": bad,
    }


def measure_cell(
    engine: Engine, drafters: dict[str, Drafter], prompts: Sequence[str], config: PairConfig, bar: tqdm, label: str
) -> dict[str, Any]:
    """All runs of one (workload, batch size): ``{"ar": rec, "<drafter>": {"<k>": {"ems": rec, ...}}}``."""
    plan = run_plan(config.ks)
    if config.warmup:  # lazy initialisation and first-touch allocations of every loop and drafter, untimed
        for method, drafter in [("ar", None), *((m, d) for d in DRAFTERS for m in SPECULATIVE)]:
            _use(engine, drafters, drafter, max(config.ks))
            run_once(engine, prompts[:1], method, min(4, config.max_tokens), True)
    runs = {run: MethodRuns() for run in plan}
    for repeat in range(config.repeats):
        shift = repeat % len(plan)
        for run in plan[shift:] + plan[:shift]:
            method, drafter, k = run
            bar.set_postfix_str(f"{label} {run_name(run)} #{repeat + 1}")
            _use(engine, drafters, drafter, k)
            result, cpu_seconds = run_once(engine, prompts, method, config.max_tokens, True)
            runs[run].results.append(result)
            runs[run].cpu_seconds.append(cpu_seconds)
            bar.update()
    ar = _record(runs[plan[0]])
    reference = [o.token_ids for o in runs[plan[0]].results[0].outputs]
    cell: dict[str, Any] = {"ar": ar}
    for method, drafter, k in plan[1:]:
        assert drafter is not None
        by_k = cell.setdefault(drafter, {}).setdefault(str(k), {})
        by_k[method] = _speculative_record(runs[(method, drafter, k)], ar, reference)
    return cell


def run_grid(
    target: LoadedModel,
    target_backend: TorchBackend,
    draft_backend: TorchBackend,
    prompts: dict[str, list[str]],
    config: PairConfig,
    progress: bool = True,
) -> dict[str, dict[str, Any]]:
    """``{workload: {"<batch>": cell}}``; one engine per batch size serves both workloads.

    The cache is sized for the longest prompt of either workload and the largest k (vanilla's
    worst case), which does not change any method's cost: attention reads committed positions only.
    """
    lens = {w: [len(encode_text(target.tokenizer, p, True)) for p in ps] for w, ps in prompts.items()}
    sizing = BenchConfig(max_tokens=config.max_tokens, num_draft_tokens=max(config.ks))
    grid: dict[str, dict[str, Any]] = {w: {} for w in prompts}
    bar = tqdm(
        total=len(config.batch_sizes) * len(prompts) * config.repeats * len(run_plan(config.ks)),
        desc="grid",
        unit="run",
        disable=not progress,
    )
    for batch in config.batch_sizes:
        max_len = required_max_len([n for w in prompts for n in batch_of(lens[w], batch)], sizing)
        engine = Engine(
            target_backend,
            None,
            tokenizer=target.tokenizer,
            eos_token_ids=target.eos_token_ids,
            config=EngineConfig(max_batch=batch, max_len=max_len, num_draft_tokens=0),
        )
        drafters: dict[str, Drafter] = {
            "draft": ModelDrafter(draft_backend, batch, max_len),
            "ngram": NgramDrafter(max_ngram=config.ngram, min_ngram=config.min_ngram),
        }
        for workload, items in prompts.items():
            cell = measure_cell(engine, drafters, batch_of(items, batch), config, bar, f"{workload} B={batch}")
            grid[workload][str(batch)] = {**cell, "prompt_tokens": batch_of(lens[workload], batch)}
        del engine, drafters
        gc.collect()
    bar.close()
    return grid


# -- analysis ----------------------------------------------------------------------------


def best_k(cell: dict[str, Any], drafter: str, method: str) -> tuple[int, dict[str, Any]]:
    """The k with the highest speed-up over ar (prefill included) and its record."""
    k, record = max(cell[drafter].items(), key=lambda item: item[1][method]["speedup_over_ar"])
    return int(k), record[method]


def best_k_summary(grid: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """``{workload: {drafter: {method: {"<batch>": {"k": k, "speedup_over_ar": x}}}}}``."""
    out: dict[str, Any] = {}
    for workload, cells in grid.items():
        for drafter in DRAFTERS:
            for method in SPECULATIVE:
                row = out.setdefault(workload, {}).setdefault(drafter, {}).setdefault(method, {})
                for batch, cell in cells.items():
                    k, record = best_k(cell, drafter, method)
                    row[batch] = {
                        "k": k,
                        "speedup_over_ar": record["speedup_over_ar"],
                        "mean_accepted_length": record["mean_accepted_length"],
                    }
    return out


def _break_even(costs: dict[str, Any], batch: str, drafter: str, k: int) -> float | None:
    cost = costs.get(batch)
    return None if cost is None else cost["break_even_accepted_length"][drafter].get(str(k))


def speculative_runs(grid: dict[str, dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    """``(label, record)`` of every ems and vanilla run of the grid."""
    return [
        (f"{w} B={b} {d} k={k} {m}", r)
        for w, cells in grid.items()
        for b, cell in cells.items()
        for d in DRAFTERS
        for k, by_m in cell[d].items()
        for m, r in by_m.items()
    ]


def auto_notes(grid: dict[str, dict[str, Any]], costs: dict[str, Any]) -> list[str]:
    """Plain statements of what the numbers show, so the report cannot drift from them."""
    bad = [label for label, r in speculative_runs(grid) if not r["identical_to_ar"]]
    notes = [
        "Every ems and vanilla output was token-identical to ar's."
        if not bad
        else f"OUTPUTS DIFFER from ar in {len(bad)} run(s): {'; '.join(bad)} (see `mismatches` in the JSON)."
    ]
    ratios = {b: c["draft_over_target"] for b, c in costs.items()}
    over = [b for b, r in ratios.items() if r > COST_TARGET]
    notes.append(
        "One draft step costs "
        + ", ".join(f"{r:.1%} (B={b})" for b, r in ratios.items())
        + f" of a target step of the same shape: {'within' if not over else 'OVER'} the "
        f"{COST_TARGET:.0%} bound" + ("." if not over else f" at B={', '.join(over)}.")
    )
    for workload, cells in grid.items():
        for drafter in DRAFTERS:
            parts, pays = [], []
            for batch, cell in cells.items():
                k, r = best_k(cell, drafter, "ems")
                even = _break_even(costs, batch, drafter, k)
                parts.append(
                    f"B={batch} {r['speedup_over_ar']:.2f}× (k={k}, accepted length "
                    f"{r['mean_accepted_length']:.2f} vs break-even {_fmt(even)})"
                )
                if round(r["speedup_over_ar"], 2) > 1.0:
                    pays.append(batch)
            verdict = (f"pays at B={', '.join(pays)}" if pays else "does not pay at any batch size") + (
                f", not at B={', '.join(b for b in cells if b not in pays)}" if pays and len(pays) < len(cells) else ""
            )
            notes.append(f"{workload}, {DRAFTER_LABELS[drafter]}: ems {verdict}. Best k: " + "; ".join(parts) + ".")
    return notes


# -- reporting ---------------------------------------------------------------------------


def _fmt(x: float | None, digits: int = 2, suffix: str = "") -> str:
    return "–" if x is None else f"{x:.{digits}f}{suffix}"


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
            return " / ".join(_fmt(values.get(str(k)), digits) for k in ks)

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
                    f"{e['mean_accepted_length']:.2f} | {_fmt(_break_even(costs, batch, drafter, int(k)))} | "
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
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    best = doc["best_k"]
    fig, axes = plt.subplots(1, len(best), figsize=(5.5 * len(best), 4.2), squeeze=False)
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
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_results(doc: dict[str, Any], out_dir: Path, stem: str = "draft_pair") -> list[Path]:
    """Write ``<stem>.json``, ``<stem>.md`` and ``<stem>.png`` into ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / f"{stem}.json", out_dir / f"{stem}.md", out_dir / f"{stem}.png"]
    paths[0].write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    paths[1].write_text(markdown_report(doc), encoding="utf-8")
    plot(doc, paths[2])
    return paths


# -- command line ------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--target", default=DEFAULT_TARGET, help="preset, Hugging Face directory or .gguf file")
    p.add_argument("--draft", default=DEFAULT_DRAFT, help="shipped draft name or distilled draft directory")
    p.add_argument("--batch-sizes", type=int_list, default=(1, 4, 8, 16), help="comma-separated")
    p.add_argument("--ks", type=int_list, default=(2, 4, 6), help="draft lengths k, comma-separated")
    p.add_argument("--max-tokens", type=int, default=64, help="new tokens per request")
    p.add_argument(
        "--prompts",
        type=int,
        default=None,
        help="distinct prompts per workload (default: the largest batch size; cycled when fewer)",
    )
    p.add_argument("--repeats", type=int, default=1, help="timed runs per (workload, batch, drafter, k, method)")
    p.add_argument(
        "--cost-batch-sizes",
        type=int_list,
        default=None,
        help="batch sizes of the draft / target step cost (default: --batch-sizes)",
    )
    p.add_argument("--context", type=int, default=200, help="cached tokens per sequence in the step cost")
    p.add_argument("--cost-steps", type=int, default=20, help="timed steps per shape in the step cost (median)")
    p.add_argument("--ngram", type=int, default=2, help="longest n-gram the n-gram drafter looks up")
    p.add_argument("--min-ngram", type=int, default=2, help="shortest n-gram that counts as a hit")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (0 = torch's default)")
    p.add_argument("--out-dir", type=Path, default=Path("benchmarks/results"))
    p.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: batch sizes 1,4, k 2, 16 tokens, 2 prompts per workload, 5 cost steps",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--note", action="append", default=[], help="a line for the report's notes (repeatable)")
    return p


def config_from_args(args: argparse.Namespace) -> PairConfig:
    if args.quick:
        return PairConfig(
            batch_sizes=(1, 4),
            ks=(2,),
            max_tokens=16,
            prompts=2,
            repeats=1,
            cost_steps=5,
            context=args.context,
            ngram=args.ngram,
            min_ngram=args.min_ngram,
        )
    return PairConfig(
        batch_sizes=args.batch_sizes,
        ks=args.ks,
        max_tokens=args.max_tokens,
        prompts=args.prompts,
        repeats=args.repeats,
        cost_batch_sizes=args.cost_batch_sizes,
        context=args.context,
        cost_steps=args.cost_steps,
        ngram=args.ngram,
        min_ngram=args.min_ngram,
    )


def _draft_description(draft: LoadedModel) -> str:
    manifest = draft.extra.get("draft_manifest", {})
    metrics = manifest.get("metrics", {})
    after = metrics.get("after", {})
    greedy = metrics.get("heldout_greedy", {}).get("after")
    head = draft.extra.get("head_token_ids")
    text = (
        f"{draft.name}, {draft.config.num_hidden_layers} layer(s), LM head of "
        f"{'all' if head is None else len(head)} tokens, distilled {manifest.get('train_minutes', '?')} min "
        f"({manifest.get('steps', '?')} steps); held-out sampled continuations: greedy agreement "
        f"{_fmt(after.get('greedy_agreement'), 3)}, expected acceptance at T=1 "
        f"{_fmt(after.get('expected_acceptance'), 3)}"
    )
    if greedy:
        text += (
            f"; held-out greedy continuations: {_fmt(greedy.get('greedy_agreement'), 3)} / "
            f"{_fmt(greedy.get('expected_acceptance'), 3)}"
        )
    return text


def _workload_text(prompts: dict[str, list[str]], grid: dict[str, dict[str, Any]]) -> dict[str, str]:
    def lengths(workload: str) -> str:
        lens = [n for cell in grid[workload].values() for n in cell["prompt_tokens"]]
        return f"{min(lens)}-{max(lens)} prompt tokens each, chat template included"

    return {
        "chat": f"{len(prompts['chat'])} general questions / instructions written for this benchmark (not the "
        f"draft's training prompts); {lengths('chat')}",
        "extractive": f"{len(prompts['extractive'])} prompts of `specdec bench`: summarise / list the points of a "
        f"Python {platform.python_version()} standard-library docstring ({MIN_DOC_CHARS}-"
        f"{MAX_DOC_CHARS} characters); {lengths('extractive')}",
    }


def main(argv: Sequence[str] | None = None) -> int:
    """Run the cost measurement and the grid, write the report; 1 if any output differs from ar."""
    args = build_parser().parse_args(argv)
    command = shlex.join(["python", "benchmarks/draft_pair.py", *(sys.argv[1:] if argv is None else argv)])
    config = config_from_args(args)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    load_before = machine_info().get("load_average")
    start = time.perf_counter()
    target, draft = load_pair(args.target, args.draft)
    target_backend, draft_backend = TorchBackend(target), TorchBackend(draft)
    prompts = build_workloads(config.num_prompts)
    stream = [t for p in prompts["extractive"] for t in encode_text(target.tokenizer, p, True)]
    costs = measure_costs(target_backend, draft_backend, stream, config, progress=not args.no_progress)
    grid = run_grid(target, target_backend, draft_backend, prompts, config, progress=not args.no_progress)
    info = machine_info()
    doc: dict[str, Any] = {
        "meta": {
            "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "command": command,
            "target": target.name,
            "draft": _draft_description(draft),
            "workloads": _workload_text(prompts, grid),
            "machine": info,
            "load_before": load_before,
            "load_after": info.get("load_average"),
            "elapsed_seconds": round(time.perf_counter() - start, 1),
            "config": asdict(config),
            "notes": [*auto_notes(grid, costs), *args.note],
        },
        "cost": costs,
        "best_k": best_k_summary(grid),
        "grid": grid,
    }
    for path in write_results(doc, args.out_dir):
        print(f"wrote {path}")
    print(
        "\n".join(
            [
                "",
                *cost_table(costs, config.ks),
                "",
                *best_k_table(doc["best_k"], list(grid["chat"])),
                "",
                *(f"- {n}" for n in doc["meta"]["notes"]),
            ]
        )
    )
    return 0 if all(r["identical_to_ar"] for _, r in speculative_runs(grid)) else 1


if __name__ == "__main__":
    sys.exit(main())

"""The grid of ``python -m benchmarks.draft_pair``: the workloads, the cost of a draft token, every
(batch, drafter, method, k) run, and what the grid says (best k, break-even lengths, notes)."""

from __future__ import annotations

import gc
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tqdm.auto import tqdm

from benchmarks.draft_pair import COST_TARGET, DRAFTER_LABELS, DRAFTERS, SPECULATIVE
from specdec.bench.harness import (
    BenchConfig,
    MethodRuns,
    mean_accepted_length,
    required_max_len,
    run_once,
)
from specdec.bench.report import fmt_cell
from specdec.bench.workloads import batch_of, build_workload, chat_workload
from specdec.models.loading import LoadedModel
from specdec.runtime.backends.torch_backend import TorchBackend
from specdec.runtime.config import EngineConfig
from specdec.runtime.costs import step_costs
from specdec.runtime.drafters import Drafter, ModelDrafter, NgramDrafter
from specdec.runtime.engine import Engine
from specdec.runtime.text import encode_text


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


def build_workloads(n: int) -> dict[str, list[str]]:
    """``n`` distinct prompts of each workload (the extractive ones are ``specdec bench``'s)."""
    return {"chat": chat_workload(n), "extractive": build_workload(n)}


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


def break_even(costs: dict[str, Any], batch: str, drafter: str, k: int) -> float | None:
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
                even = break_even(costs, batch, drafter, k)
                parts.append(
                    f"B={batch} {r['speedup_over_ar']:.2f}× (k={k}, accepted length "
                    f"{r['mean_accepted_length']:.2f} vs break-even {fmt_cell(even)})"
                )
                if round(r["speedup_over_ar"], 2) > 1.0:
                    pays.append(batch)
            verdict = (f"pays at B={', '.join(pays)}" if pays else "does not pay at any batch size") + (
                f", not at B={', '.join(b for b in cells if b not in pays)}" if pays and len(pays) < len(cells) else ""
            )
            notes.append(f"{workload}, {DRAFTER_LABELS[drafter]}: ems {verdict}. Best k: " + "; ".join(parts) + ".")
    return notes

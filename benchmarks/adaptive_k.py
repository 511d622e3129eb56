"""Adaptive draft length vs fixed k: EMS-SD with each sequence choosing its own k, against ar.

What: SmolLM2-135M with its shipped distilled draft and with prompt lookup (n-gram), greedy
(or sampled with ``--temperature``, every request seeded), on the two workloads of
``draft_pair.py`` (*chat*: questions no draft was trained on; *extractive*: summarise a
standard-library docstring, where answers copy the prompt). Per (workload, batch size):
``ar`` once, then ``ems`` with every fixed k of ``--ks`` and with the adaptive draft length
(``specdec.runtime.draft_length``, at most ``--cap`` drafts) per drafter, and with
``--calibrate`` the same policy priced by what a draft token and a verified row cost when
timed on this machine first (``specdec.runtime.costs``, as ``--calibrate`` does for users).

Why: ``draft_pair.md`` shows that the best fixed k changes with the drafter, the workload and
the batch size, and that a wrong one makes speculation slower than ``ar``. The policy picks
k per sequence from its own acceptance and the drafter's cost; this measures whether that
lands near the best fixed k without being told it, with the same default costs everywhere.

How, as in ``draft_pair.py``: one process, one torch thread, one engine per batch size (the
drafter, k and the policy are switched between runs), runs interleaved and rotated between
repeats (median kept), tokens/s with prefill; every output is compared with ``ar``'s token for
token and a difference is reported (exit status 1), not raised. Sampled runs are not compared:
their law is the target's (``tests/test_lossless_sampling.py``), not ar's draw.

Run::

    python -m benchmarks.adaptive_k                      # about 12 minutes on a 2-core CPU
    python -m benchmarks.adaptive_k --quick --out-dir /tmp/adaptive
    python -m benchmarks.adaptive_k --temperature 1 --calibrate --stem adaptive_k_sampled

Writes ``<out-dir>/<stem>.{json,md,png}`` (default ``benchmarks/results/adaptive_k``).
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

# a sibling script, not a package
from benchmarks.draft_pair import DEFAULT_DRAFT, DRAFTER_LABELS, DRAFTERS
from specdec.bench.figures import figure
from specdec.bench.harness import (
    BenchConfig,
    MethodRuns,
    int_list,
    machine_info,
    required_max_len,
    run_command,
    run_once,
    utc_stamp,
)
from specdec.bench.report import write_report
from specdec.bench.workloads import CHAT_PROMPTS, batch_of, build_workload
from specdec.models.drafts import load_pair
from specdec.models.presets import DEFAULT_TARGET
from specdec.runtime.backends.torch_backend import TorchBackend
from specdec.runtime.config import EngineConfig
from specdec.runtime.costs import calibrate
from specdec.runtime.draft_length import DraftLength
from specdec.runtime.drafters import Drafter, ModelDrafter, NgramDrafter
from specdec.runtime.engine import Engine
from specdec.runtime.text import encode_text

Config = tuple[str, int, str]  # (drafter, k or cap, "fixed" | "adaptive" | "calibrated")
MODE_LABELS = {"fixed": "k=", "adaptive": "adaptive k<=", "calibrated": "calibrated adaptive k<="}


def config_name(config: Config) -> str:
    drafter, k, mode = config
    return f"{drafter} {MODE_LABELS[mode]}{k}"


def plan(ks: Sequence[int], cap: int, calibrated: bool = False) -> list[Config | None]:
    """``None`` (ar) first, then per drafter every fixed k, the adaptive policy and (``calibrated``) its priced twin."""
    modes = ("adaptive", "calibrated") if calibrated else ("adaptive",)
    return [None, *((d, k, "fixed") for d in DRAFTERS for k in ks), *((d, cap, m) for m in modes for d in DRAFTERS)]


def measure_cell(
    engine: Engine,
    drafters: dict[str, Drafter],
    prompts: Sequence[str],
    configs: list[Config | None],
    policies: dict[tuple[str, str], DraftLength],
    max_tokens: int,
    repeats: int,
    bar: tqdm,
    label: str,
    temperature: float = 0.0,
) -> dict[str, Any]:
    """Every config of one (workload, batch size): tokens/s, speed-up over ar, acceptance, k used, identity.

    ``policies``: the adaptive policy per (mode, drafter), mode "adaptive" or "calibrated".
    """

    def use(config: Config | None) -> str:
        engine.drafter = None if config is None else drafters[config[0]]
        engine.reconfigure(num_draft_tokens=0 if config is None else config[1])
        engine.reconfigure(
            draft_length=None if config is None or config[2] == "fixed" else policies[config[2], config[0]]
        )
        return "ar" if config is None else "ems"

    for config in configs:  # untimed warm-up of every loop and drafter
        run_once(engine, prompts[:1], use(config), 4, True, temperature)
    runs = {config: MethodRuns() for config in configs}
    for repeat in range(repeats):
        shift = repeat % len(configs)
        for config in configs[shift:] + configs[:shift]:
            bar.set_postfix_str(f"{label} {'ar' if config is None else config_name(config)}")
            result, cpu = run_once(engine, prompts, use(config), max_tokens, True, temperature)
            runs[config].results.append(result)
            runs[config].cpu_seconds.append(cpu)
            bar.update()
    ar = runs[None]
    reference = [o.token_ids for o in ar.results[0].outputs]
    cell: dict[str, Any] = {"ar": {"tokens_per_second": round(ar.tokens_per_second(), 3)}}
    for config in configs[1:]:
        assert config is not None
        median = runs[config].median_run()
        summary = median.run.summary()
        decode_steps = sum(o.metrics.target_calls - 1 for o in median.outputs)
        tps = runs[config].tokens_per_second()
        cell[config_name(config)] = {
            "tokens_per_second": round(tps, 3),
            "speedup_over_ar": round(tps / ar.tokens_per_second(), 3),
            "acceptance_rate": summary["acceptance_rate"],
            "mean_k": round(summary["draft_tokens"] / max(1, decode_steps), 3),
            "identical_to_ar": None
            if temperature > 0
            else all([o.token_ids for o in r.outputs] == reference for r in runs[config].results),
        }
    return cell


def markdown(doc: dict[str, Any]) -> str:
    meta, grid = doc["meta"], doc["grid"]
    batches = [str(b) for b in meta["batch_sizes"]]
    lines = [
        f"# Adaptive draft length vs fixed k (EMS-SD, {_decoding(meta)})",
        "",
        f"- Date: {meta['date']}; command: `{meta['command']}` ({meta['elapsed_seconds']:.0f} s)",
        f"- Target {meta['target']}, draft {meta['draft']} and prompt lookup (n-gram); torch, fp32, "
        f"{meta['machine']['torch_threads']} thread; {meta['max_tokens']} new tokens per request; median of "
        f"{meta['repeats']} interleaved repeat(s); load average before {meta['load_before']}, "
        f"after {meta['load_after']}",
        f"- Policy: `{meta['policy']}`; cap k <= {meta['cap']}; drafter costs: draft model "
        f"{meta['drafter_costs']['draft']}, n-gram {meta['drafter_costs']['ngram']} of a target step",
        *(
            [
                f"- Calibrated (timed on this machine before the grid, `specdec.runtime.costs.calibrate`: batch sizes "
                f"{c['batch_sizes']}, {c['context']} cached tokens, verifying k = {c['k']}): a draft token costs "
                f"{c['draft_cost']} and a verified row {c['verify_cost']} of a target step; policy "
                f"`{meta['calibrated_policy']}` (prompt lookup keeps its draft cost of 0)"
            ]
            if (c := meta.get("calibration"))
            else []
        ),
        "- Requests per cell: " + ", ".join(f"B={b}: {n}" for b, n in meta["requests"].items()),
        "- Cells: speed-up of tokens/s over ar (prefill included), with the acceptance rate and the mean k "
        "drafted per sequence per step in brackets",
        "",
    ]
    for workload, cells in grid.items():
        lines += [
            f"## Workload *{workload}*",
            "",
            "| drafter | k | " + " | ".join(f"B = {b}" for b in batches) + " |",
            "|:---|:---|" + "---:|" * len(batches),
        ]
        lines.append(
            "| – | ar tokens/s | " + " | ".join(f"{cells[b]['ar']['tokens_per_second']:.1f}" for b in batches) + " |"
        )
        for name in [n for n in cells[batches[0]] if n != "ar"]:
            drafter, k = name.split(" ", 1)
            row = []
            for b in batches:
                r = cells[b][name]
                mark = " DIFFERS" if r["identical_to_ar"] is False else ""
                row.append(f"{r['speedup_over_ar']:.2f}× ({r['acceptance_rate']:.2f}, k {r['mean_k']:.2f}){mark}")
            lines.append(f"| {DRAFTER_LABELS[drafter]} | {k} | " + " | ".join(row) + " |")
        lines.append("")
    lines += ["## Notes", "", *(f"- {n}" for n in meta["notes"])]
    return "\n".join(lines) + "\n"


def auto_notes(grid: dict[str, dict[str, Any]]) -> list[str]:
    """Adaptive against the best and the worst fixed k of each (workload, drafter, batch), from the numbers."""
    notes = []
    bad = [
        f"{w} B={b} {n}"
        for w, cells in grid.items()
        for b, cell in cells.items()
        for n, r in cell.items()
        if n != "ar" and r["identical_to_ar"] is False
    ]
    sampled = any(
        r["identical_to_ar"] is None
        for cells in grid.values()
        for cell in cells.values()
        for n, r in cell.items()
        if n != "ar"
    )
    notes.append(
        "Sampled: every output is a seeded draw of the target's law, not compared with ar's."
        if sampled
        else "Every ems output was token-identical to ar's."
        if not bad
        else f"OUTPUTS DIFFER: {'; '.join(bad)}."
    )
    for workload, cells in grid.items():
        for drafter in DRAFTERS:
            for mode in ("adaptive", "calibrated"):
                prefix = f"{drafter} {MODE_LABELS[mode]}"
                if not any(n.startswith(prefix) for n in cells[next(iter(cells))]):
                    continue
                parts = []
                for b, cell in cells.items():
                    fixed = {n: r["speedup_over_ar"] for n, r in cell.items() if n.startswith(f"{drafter} k=")}
                    adaptive = next(r for n, r in cell.items() if n.startswith(prefix))
                    best, worst = max(fixed, key=fixed.get), min(fixed, key=fixed.get)
                    parts.append(
                        f"B={b} {adaptive['speedup_over_ar']:.2f}× (best fixed {best.split()[1]} "
                        f"{fixed[best]:.2f}×, worst {worst.split()[1]} {fixed[worst]:.2f}×)"
                    )
                notes.append(
                    f"{workload}, {DRAFTER_LABELS[drafter]}, {MODE_LABELS[mode].split(' k')[0]}: "
                    + "; ".join(parts)
                    + "."
                )
    return notes


def _decoding(meta: dict[str, Any]) -> str:
    t = meta.get("temperature", 0.0)
    return "greedy" if not t else f"sampled at T={t}, seeded"


def plot(doc: dict[str, Any], path: Path) -> None:
    grid = doc["grid"]
    with figure(path, len(grid), len(DRAFTERS), figsize=(11, 4 * len(grid)), squeeze=False, dpi=110) as (fig, axes):
        for row, (workload, cells) in enumerate(grid.items()):
            batches = list(cells)
            for col, drafter in enumerate(DRAFTERS):
                ax = axes[row][col]
                names = [n for n in cells[batches[0]] if n.startswith(f"{drafter} ")]
                for name in names:
                    adaptive = "adaptive" in name
                    ax.plot(
                        batches,
                        [cells[b][name]["speedup_over_ar"] for b in batches],
                        marker="o",
                        linewidth=2.5 if adaptive else 1,
                        linestyle="-" if adaptive else "--",
                        label=name.split(" ", 1)[1],
                    )
                ax.axhline(1.0, color="gray", linewidth=0.8)
                ax.set(title=f"{workload}, {DRAFTER_LABELS[drafter]}", xlabel="batch size", ylabel="speed-up over ar")
                ax.grid(alpha=0.3)
                ax.legend(fontsize=8)
        fig.suptitle(
            f"{doc['meta']['target']}: EMS-SD with adaptive vs fixed draft length ({_decoding(doc['meta'])}, CPU)"
        )


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default=DEFAULT_TARGET)
    p.add_argument("--draft", default=DEFAULT_DRAFT)
    p.add_argument("--batch-sizes", type=int_list, default=(1, 4, 16))
    p.add_argument("--ks", type=int_list, default=(1, 2, 4), help="fixed draft lengths")
    p.add_argument("--cap", type=int, default=4, help="the most the adaptive policy drafts")
    p.add_argument(
        "--verify-cost",
        type=float,
        default=DraftLength().verify_cost,
        help="the policy's cost of one more verified row, in one-row target steps",
    )
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy; else sampled, every request seeded")
    p.add_argument(
        "--calibrate",
        action="store_true",
        help="also run the adaptive policy priced by costs timed on this machine first",
    )
    p.add_argument("--stem", default="adaptive_k", help="output file name without extension")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out-dir", type=Path, default=Path("benchmarks/results"))
    p.add_argument("--quick", action="store_true", help="batch 1 and 2, k = 1, 2, 8 tokens")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--note", action="append", default=[])
    args = p.parse_args(argv)
    if args.quick:
        args.batch_sizes, args.ks, args.cap, args.max_tokens = (1, 2), (1, 2), 2, 8
    torch.set_num_threads(args.threads)
    command = run_command("benchmarks.adaptive_k", argv)
    load_before, start = machine_info().get("load_average"), time.perf_counter()
    target, draft = load_pair(args.target, args.draft)
    target_backend, draft_backend = TorchBackend(target), TorchBackend(draft)
    policy = DraftLength(verify_cost=args.verify_cost)
    policies = {("adaptive", d): policy for d in DRAFTERS}
    calibration = None
    if args.calibrate:  # the prices a user's --calibrate would measure here; prompt lookup's draft stays free
        costs = calibrate(target_backend, draft_backend)
        calibration = costs.as_dict()
        policies["calibrated", "draft"] = DraftLength(verify_cost=costs.verify_cost, draft_cost=costs.draft_cost)
        policies["calibrated", "ngram"] = DraftLength(verify_cost=costs.verify_cost)
    workloads = {"chat": list(CHAT_PROMPTS), "extractive": build_workload(len(CHAT_PROMPTS))}
    lens = {w: [len(encode_text(target.tokenizer, t, True)) for t in texts] for w, texts in workloads.items()}
    configs = plan(args.ks, args.cap, args.calibrate)
    requests = {str(b): max(4, b) for b in args.batch_sizes}
    grid: dict[str, dict[str, Any]] = {w: {} for w in workloads}
    bar = tqdm(
        total=len(args.batch_sizes) * len(workloads) * len(configs) * args.repeats,
        desc="adaptive k",
        unit="run",
        disable=args.no_progress,
    )
    for batch in args.batch_sizes:
        n = requests[str(batch)]
        sizing = BenchConfig(max_tokens=args.max_tokens, num_draft_tokens=max(*args.ks, args.cap))
        max_len = required_max_len([x for w in workloads for x in batch_of(lens[w], n)], sizing)
        engine = Engine(
            target_backend,
            None,
            tokenizer=target.tokenizer,
            eos_token_ids=target.eos_token_ids,
            config=EngineConfig(max_batch=batch, max_len=max_len),
        )
        drafters: dict[str, Drafter] = {
            "draft": ModelDrafter(draft_backend, batch, max_len),
            "ngram": NgramDrafter(max_ngram=2, min_ngram=2),
        }
        for workload, texts in workloads.items():
            grid[workload][str(batch)] = measure_cell(
                engine,
                drafters,
                batch_of(texts, n),
                configs,
                policies,
                args.max_tokens,
                args.repeats,
                bar,
                f"{workload} B={batch}",
                args.temperature,
            )
        del engine, drafters
        gc.collect()
    bar.close()
    info = machine_info()
    doc = {
        "meta": {
            "date": utc_stamp(),
            "command": command,
            "target": target.name,
            "draft": args.draft,
            "batch_sizes": list(args.batch_sizes),
            "ks": list(args.ks),
            "cap": args.cap,
            "policy": repr(policy),
            "max_tokens": args.max_tokens,
            "repeats": args.repeats,
            "requests": requests,
            "machine": info,
            "load_before": load_before,
            "load_after": info.get("load_average"),
            "drafter_costs": {"draft": ModelDrafter.relative_cost, "ngram": NgramDrafter.relative_cost},
            "elapsed_seconds": time.perf_counter() - start,
            "notes": [*auto_notes(grid), *args.note],
            "temperature": args.temperature,
            "calibration": calibration,
            "calibrated_policy": repr(policies.get(("calibrated", "draft"))),
        },
        "grid": grid,
    }
    print(write_report(doc, args.out_dir, args.stem, markdown, plot))
    identical = all(
        r["identical_to_ar"] is not False
        for cells in grid.values()
        for cell in cells.values()
        for n, r in cell.items()
        if n != "ar"
    )
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())

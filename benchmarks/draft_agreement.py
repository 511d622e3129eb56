"""How well drafts agree with the target on the benchmark workloads, teacher-forced (no decoding).

Why: ``specdec distill`` reports agreement on held-out continuations of *its own* prompt set,
and those prompts resemble the training prompts (the built-in set is topics x instruction
shapes), so the figure overstates what a draft does on requests of another origin. This
measures the drafts on the prompts the speed benchmarks use, which no draft was trained on:

* *chat*: the 24 questions of ``benchmarks/draft_pair.py``, written for that benchmark;
* *extractive*: ``specdec bench``'s prompts (summarise / list the points of a standard-library
  docstring).

For each workload the target answers every prompt twice, greedily and sampled at temperature
1 (``--max-tokens`` tokens each, same seeds for every draft); each draft is then scored on every
answer position against the target's full distribution there (``specdec.distill.objective.evaluate``):
greedy agreement (argmax q = argmax p, what greedy speculation accepts) and expected acceptance
Σ min(p, q) at temperature 1 (what sampled speculation accepts per drafted token).

Run::

    python -m benchmarks.draft_agreement --draft shipped=smollm2-135m-draft --draft old=/path/to/draft

Writes ``<out-dir>/draft_agreement.{json,md,png}`` (default ``benchmarks/results``).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from specdec.bench.figures import figure
from specdec.bench.harness import machine_info, run_command, utc_stamp
from specdec.bench.report import write_report

# a sibling script, not a package
from specdec.bench.workloads import CHAT_PROMPTS, build_workload
from specdec.distill.net import DraftNet
from specdec.distill.records import generate_records
from specdec.models.drafts import resolve_draft
from specdec.models.loading import load_model
from specdec.models.presets import DEFAULT_TARGET

ANSWERS = {"greedy": 0.0, "sampled": 1.0}


def _label(spec: str) -> tuple[str, str]:
    """``LABEL=PATH`` or a bare draft spec (labelled by itself)."""
    label, sep, path = spec.partition("=")
    return (label, path) if sep else (spec, spec)


def measure(
    target_spec: str, drafts: list[str], prompts: int, max_tokens: int, seed: int, progress: bool = True
) -> dict[str, Any]:
    """Agreement and expected acceptance of every draft on every (workload, answer kind)."""
    from specdec.distill.objective import evaluate

    target = load_model(target_spec)
    workloads = {
        "chat": [CHAT_PROMPTS[i % len(CHAT_PROMPTS)] for i in range(prompts)],
        "extractive": build_workload(prompts),
    }
    answers = {}
    for (workload, texts), (kind, temperature) in tqdm(
        [(w, a) for w in workloads.items() for a in ANSWERS.items()], desc="target answers", disable=not progress
    ):
        answers[(workload, kind)] = [
            r
            for r in generate_records(
                target,
                texts,
                max_new_tokens=max_tokens,
                temperature=temperature,
                teacher_k=1,
                seed=seed,
                max_batch=len(texts),
            )
            if r.positions
        ]
    rows = []
    for spec in tqdm(drafts, desc="drafts", disable=not progress):
        label, path = _label(spec)
        draft = resolve_draft(path, target)
        net = DraftNet(draft).eval()
        manifest = draft.extra.get("draft_manifest", {})
        for (workload, kind), records in answers.items():
            scores = evaluate(net, target, records)
            rows.append(
                {
                    "draft": label,
                    "path": path,
                    "commands": manifest.get("commands", [manifest.get("command")]),
                    "workload": workload,
                    "answers": kind,
                    **scores,
                }
            )
    return {
        "rows": rows,
        "answer_tokens": {f"{w}/{k}": sum(len(r.positions) for r in v) for (w, k), v in answers.items()},
    }


def markdown_report(doc: dict[str, Any]) -> str:
    meta = doc["meta"]
    lines = [
        "# Draft agreement with the target on the benchmark workloads (teacher-forced)",
        "",
        f"- Date: {meta['date']}; command: `{meta['command']}` ({meta['elapsed_seconds']:.0f} s)",
        f"- Target {meta['target']}; {meta['prompts']} prompts per workload, {meta['max_tokens']} answer "
        f"tokens at most, seed {meta['seed']}",
        "- Agreement: argmax q = argmax p on the target's answer; acceptance: Σ min(p, q) at temperature 1",
        "",
        "| draft | workload | answers | positions | greedy agreement | expected acceptance |",
        "|:---|:---|:---|---:|---:|---:|",
    ]
    for r in doc["rows"]:
        lines.append(
            f"| {r['draft']} | {r['workload']} | {r['answers']} | {r['positions']} | "
            f"{r['greedy_agreement']:.3f} | {r['expected_acceptance']:.3f} |"
        )
    lines += ["", "Drafts:", ""]
    for label in dict.fromkeys(r["draft"] for r in doc["rows"]):
        commands = next(r["commands"] for r in doc["rows"] if r["draft"] == label)
        lines.append(f"- {label}: " + "; then ".join(f"`{c}`" for c in commands if c))
    return "\n".join(lines) + "\n"


def plot(doc: dict[str, Any], path: Path) -> None:
    rows = doc["rows"]
    drafts = list(dict.fromkeys(r["draft"] for r in rows))
    cases = list(dict.fromkeys((r["workload"], r["answers"]) for r in rows))
    with figure(path, 1, 2, figsize=(11, 4), sharey=True) as (fig, axes):
        width = 0.8 / len(drafts)
        for ax, metric in zip(axes, ("greedy_agreement", "expected_acceptance")):
            for i, label in enumerate(drafts):
                values = [
                    next(r[metric] for r in rows if r["draft"] == label and (r["workload"], r["answers"]) == c)
                    for c in cases
                ]
                ax.bar([j + i * width for j in range(len(cases))], values, width, label=label)
            ax.set_xticks([j + 0.4 - width / 2 for j in range(len(cases))], [f"{w}\n{a}" for w, a in cases])
            ax.set_title(metric.replace("_", " "))
            ax.set_ylim(0, 1)
            ax.grid(axis="y", alpha=0.3)
        axes[0].legend()
        fig.suptitle(f"Drafts vs {doc['meta']['target']} on the benchmark workloads (teacher-forced)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default=DEFAULT_TARGET)
    p.add_argument("--draft", action="append", help="LABEL=PATH or a draft spec (repeatable; default: the shipped)")
    p.add_argument("--prompts", type=int, default=24, help="prompts per workload")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", type=Path, default=Path("benchmarks/results"))
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    torch.set_num_threads(2)
    start = time.perf_counter()
    doc = measure(
        args.target,
        args.draft or ["shipped=smollm2-135m-draft"],
        args.prompts,
        args.max_tokens,
        args.seed,
        progress=not args.no_progress,
    )
    doc["meta"] = {
        "date": utc_stamp(),
        "command": run_command("benchmarks.draft_agreement", argv),
        "target": args.target,
        "prompts": args.prompts,
        "max_tokens": args.max_tokens,
        "seed": args.seed,
        "elapsed_seconds": time.perf_counter() - start,
        "machine": machine_info(),
    }
    print(write_report(doc, args.out_dir, "draft_agreement", markdown_report, plot))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

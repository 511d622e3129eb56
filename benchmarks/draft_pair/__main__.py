"""``python -m benchmarks.draft_pair``: its command line and the run from prompts to the written report."""

from __future__ import annotations

import argparse
import platform
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from benchmarks.draft_pair import DEFAULT_DRAFT
from benchmarks.draft_pair.grid import (
    PairConfig,
    auto_notes,
    best_k_summary,
    build_workloads,
    measure_costs,
    run_grid,
    speculative_runs,
)
from benchmarks.draft_pair.report import best_k_table, cost_table, write_results
from specdec.bench.harness import (
    int_list,
    machine_info,
    run_command,
    utc_stamp,
)
from specdec.bench.report import fmt_cell
from specdec.bench.workloads import MAX_DOC_CHARS, MIN_DOC_CHARS
from specdec.models.drafts import load_pair
from specdec.models.loading import LoadedModel
from specdec.models.presets import DEFAULT_TARGET
from specdec.runtime.backends.torch_backend import TorchBackend
from specdec.runtime.text import encode_text

# -- command line ------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.draft_pair",
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
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
        f"{fmt_cell(after.get('greedy_agreement'), 3)}, expected acceptance at T=1 "
        f"{fmt_cell(after.get('expected_acceptance'), 3)}"
    )
    if greedy:
        text += (
            f"; held-out greedy continuations: {fmt_cell(greedy.get('greedy_agreement'), 3)} / "
            f"{fmt_cell(greedy.get('expected_acceptance'), 3)}"
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
    command = run_command("benchmarks.draft_pair", argv)
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
            "date": utc_stamp(),
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

"""EMS-SD vs the padded ("vanilla") multi-sample baseline vs plain greedy decoding.

``specdec bench`` (and ``python -m benchmarks.ems_vs_vanilla``) runs the three decoding loops of
``specdec.runtime.loops`` side by side on one target and one prompt-lookup drafter, at
several batch sizes, and writes ``ems_vs_vanilla.{json,md,png}``.

Why it is built this way:

* **Workload.** EMS-SD's paper measures summarisation with a prompt-lookup drafter, where
  answers copy spans of the prompt; ``specdec.bench.workloads.build_workload`` asks the chat
  model to summarise or list the points of standard-library docstrings, so the answer quotes them.
* **Fairness on a shared, noisy machine.** All methods of one batch size use one engine
  (same weights, same cache), run in the same process, interleaved, with the order
  rotated between repeats, and the median over repeats is reported. Torch runs one
  intra-op thread by default: two threads on a 2-core machine that other jobs share made a
  step's time erratic (benchmarks/results/ems_vs_vanilla.md, notes). CPU-time throughput is
  reported next to wall-clock throughput because other jobs stretch the one and hardly the other.
* **Correctness is part of the result.** Greedy speculative decoding must reproduce
  greedy autoregressive decoding token for token; every run is compared with ``ar`` and
  the JSON says whether it did.
"""

from __future__ import annotations

import argparse
import datetime as dt
import platform
import shlex
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from specdec.bench.harness import (
    BASELINE,
    PADDED,
    RAGGED,
    SPECULATIVE,
    BenchConfig,
    MethodRuns,
    int_list,
    machine_info,
    mean_accepted_length,
    required_max_len,
    run_once,
)
from specdec.bench.report import ems_notes, throughput_table, write_results
from specdec.bench.workloads import MAX_DOC_CHARS, MIN_DOC_CHARS, build_workload, collect_documents
from specdec.models.loading import LoadedModel, load_model
from specdec.models.presets import DEFAULT_TARGET
from specdec.runtime.backends.torch_backend import TorchBackend
from specdec.runtime.config import EngineConfig
from specdec.runtime.drafters import NgramDrafter
from specdec.runtime.engine import Engine, GenerationResult

# -- running ----------------------------------------------------------------------------

EngineFactory = Callable[[int, int], Engine]  # (max_batch, max_len) -> Engine


def engine_factory(target: LoadedModel, config: BenchConfig) -> EngineFactory:
    """Engines over one shared target backend, each with a fresh n-gram drafter.

    The backend (fused weights) is built once and shared by every batch size; only the KV
    cache depends on ``max_batch`` and ``max_len``. ``min_ngram`` is not an argument of
    ``Engine.from_models``, so the engine is assembled here from the same parts.
    """
    backend = TorchBackend(target)

    def make(max_batch: int, max_len: int) -> Engine:
        drafter = NgramDrafter(max_ngram=config.ngram, min_ngram=config.min_ngram)
        return Engine(
            backend,
            drafter,
            tokenizer=target.tokenizer,
            eos_token_ids=target.eos_token_ids,
            config=EngineConfig(max_batch=max_batch, max_len=max_len, num_draft_tokens=config.num_draft_tokens),
        )

    return make


def _ratios(values: dict[str, float]) -> dict[str, Any]:
    """Speed-ups over ar and the ems / vanilla ratio of one family of throughputs."""
    out: dict[str, Any] = {
        "over_ar": {m: round(values[m] / values[BASELINE], 3) for m in SPECULATIVE if m in values}
        if BASELINE in values
        else {},
        "ems_over_vanilla": round(values[RAGGED] / values[PADDED], 3) if {RAGGED, PADDED} <= values.keys() else None,
    }
    return out


def _identical(runs: dict[str, MethodRuns]) -> dict[str, bool]:
    """Per speculative method: did every run reproduce ar's tokens exactly?"""
    if BASELINE not in runs:
        return {}
    reference = [o.token_ids for o in runs[BASELINE].results[0].outputs]
    return {
        m: all([o.token_ids for o in r.outputs] == reference for r in mr.results)
        for m, mr in runs.items()
        if m != BASELINE
    }


def _decode_rows(result: GenerationResult) -> tuple[int, int]:
    """(rows, padded rows) of the decode steps (prompt rows are the same for every method)."""
    decode = [s for s in result.run.steps if s.prefill_rows == 0]
    return sum(s.rows for s in decode), sum(s.padded_rows for s in decode)


def _decode_padded_fraction(result: GenerationResult) -> float:
    """Padding among decode rows (``padded_fraction`` also counts prompt rows, never padded)."""
    rows, padded = _decode_rows(result)
    return round(padded / rows, 4) if rows else 0.0


def summarise(runs: dict[str, MethodRuns], batch: int) -> dict[str, Any]:
    """The JSON record of one batch size.

    Throughputs are medians over repeats. Counters (rows, acceptance) come from the median
    run, but greedy decoding makes them the same in every run.
    """
    tps = {m: round(mr.tokens_per_second(), 3) for m, mr in runs.items()}
    decode_tps = {m: round(mr.decode_tokens_per_second(), 3) for m, mr in runs.items()}
    cpu_tps = {m: round(mr.cpu_tokens_per_second(), 3) for m, mr in runs.items()}
    summary = {m: mr.median_run().run.summary() for m, mr in runs.items()}
    spec = [m for m in SPECULATIVE if m in runs]
    wall, decode, cpu = _ratios(tps), _ratios(decode_tps), _ratios(cpu_tps)
    identical = _identical(runs)
    return {
        **tps,
        "batch_size": batch,
        "speedup_over_ar": wall["over_ar"],
        "ems_over_vanilla": wall["ems_over_vanilla"],
        "decode_tokens_per_second": decode_tps,
        "decode_speedup_over_ar": decode["over_ar"],
        "decode_ems_over_vanilla": decode["ems_over_vanilla"],
        "cpu_tokens_per_second": cpu_tps,
        "cpu_speedup_over_ar": cpu["over_ar"],
        "cpu_ems_over_vanilla": cpu["ems_over_vanilla"],
        "mean_accepted_length": {m: mean_accepted_length(runs[m].median_run()) for m in spec},
        "acceptance_rate": {m: summary[m]["acceptance_rate"] for m in spec},
        "padded_fraction": {m: summary[m]["padded_fraction"] for m in spec},
        "decode_rows": {m: _decode_rows(mr.median_run())[0] for m, mr in runs.items()},
        "decode_padded_fraction": {m: _decode_padded_fraction(runs[m].median_run()) for m in spec},
        "target_rows": {m: s["target_rows"] for m, s in summary.items()},
        "target_rows_padded": {m: s["target_rows_padded"] for m, s in summary.items()},
        "target_calls": {m: s["target_calls"] for m, s in summary.items()},
        "generated_tokens": {m: s["generated_tokens"] for m, s in summary.items()},
        "wall_seconds": {m: [round(r.run.wall_seconds, 3) for r in mr.results] for m, mr in runs.items()},
        "decode_seconds": {m: [round(r.run.decode_seconds, 3) for r in mr.results] for m, mr in runs.items()},
        "cpu_seconds": {m: [round(c, 3) for c in mr.cpu_seconds] for m, mr in runs.items()},
        "prefill_seconds": {
            m: round(sum(s.seconds for s in mr.median_run().run.steps if s.prefill_rows), 3) for m, mr in runs.items()
        },
        "draft_seconds": {m: summary[m]["draft_seconds"] for m in spec},
        "identical_to_ar": all(identical.values()) if identical else None,
        "identical_to_ar_by_method": identical,
    }


def run_benchmark(
    make_engine: EngineFactory,
    prompts: Sequence[str | Sequence[int]],
    config: BenchConfig,
    *,
    chat: bool = True,
    progress: bool = True,
) -> dict[str, dict[str, Any]]:
    """Measure every method at every batch size; returns ``{"<batch>": record}``.

    Batch size B takes the first B prompts, submits them at once to an engine with
    ``max_batch=B``, and runs the methods interleaved ``repeats`` times, rotating their
    order each repeat so no method always runs first (or right after another) on a
    machine whose load drifts.
    """
    needed = max(config.batch_sizes)
    if len(prompts) < needed:
        raise ValueError(f"batch size {needed} needs {needed} prompts, got {len(prompts)}")
    results: dict[str, dict[str, Any]] = {}
    bar = tqdm(
        total=len(config.batch_sizes) * config.repeats * len(config.methods),
        desc="bench",
        unit="run",
        disable=not progress,
    )
    for batch in config.batch_sizes:
        batch_prompts = list(prompts[:batch])
        probe = make_engine(1, 2)  # only to tokenise: the lengths size the real cache
        lens = [len(probe.encode(p, chat)) for p in batch_prompts]
        engine = make_engine(batch, required_max_len(lens, config))
        if config.warmup:  # lazy kernel initialisation and first-touch allocations, untimed
            for method in config.methods:
                run_once(engine, batch_prompts[:1], method, min(4, config.max_tokens), chat)
        runs = {m: MethodRuns() for m in config.methods}
        for repeat in range(config.repeats):
            shift = repeat % len(config.methods)
            for method in config.methods[shift:] + config.methods[:shift]:
                bar.set_postfix_str(f"B={batch} {method} #{repeat + 1}")
                result, cpu_seconds = run_once(engine, batch_prompts, method, config.max_tokens, chat)
                runs[method].results.append(result)
                runs[method].cpu_seconds.append(cpu_seconds)
                bar.update()
        results[str(batch)] = {**summarise(runs, batch), "prompt_tokens": lens}
        del engine
    bar.close()
    return results


def _prompt_lengths(results: dict[str, dict[str, Any]]) -> str:
    """Token counts of the largest batch's prompts as the model saw them (chat template included)."""
    lens = max((r["prompt_tokens"] for r in results.values()), key=len)
    return f"{min(lens)}-{max(lens)} prompt tokens each, chat template included ({sum(lens)} in the largest batch)"


# -- command line -----------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    """The ``specdec bench`` options; defaults reproduce the paper's setting at this model's scale."""
    p = argparse.ArgumentParser(
        prog="specdec bench",
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--target", default=DEFAULT_TARGET, help="preset, Hugging Face directory or .gguf file")
    p.add_argument("--batch-sizes", type=int_list, default=(1, 4, 8, 16), help="comma-separated")
    p.add_argument("--max-tokens", type=int, default=128, help="new tokens per request")
    p.add_argument("--num-draft-tokens", type=int, default=7, help="k: longest n-gram continuation copied")
    p.add_argument("--ngram", type=int, default=2, help="longest n-gram the drafter looks up (LLMA: 2)")
    p.add_argument("--min-ngram", type=int, default=2, help="shortest n-gram that counts as a hit (LLMA: 2)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per method and batch size (median)")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads (0 = torch's default). One thread is much steadier on a "
        "CPU shared with other jobs",
    )
    p.add_argument("--out-dir", type=Path, default=Path("benchmarks/results"))
    p.add_argument("--quick", action="store_true", help="smoke test: batch sizes 1,2, 16 tokens, 2 prompts")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--note", action="append", default=[], help="a line for the report's notes (repeatable)")
    return p


def _command_line(argv: Sequence[str] | None) -> str:
    """How this run was started, for the report (``--note`` text is left out: it is in the notes)."""
    if argv is None:
        script = sys.argv[0]
        words = ["python", script] if script.endswith(".py") else [Path(script).name]
        args = sys.argv[1:]
    else:
        words, args = ["specdec", "bench"], list(argv)
    kept, skip = [], False
    for arg in args:
        if skip:
            skip = False
        elif arg == "--note":
            skip = True
        elif not arg.startswith("--note="):
            kept.append(arg)
    return shlex.join([*words, *kept])


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark and write the JSON, markdown and plot; 1 if any output differs from ar."""
    args = build_parser().parse_args(argv)
    command = _command_line(argv)
    if args.quick:
        args.batch_sizes, args.max_tokens = (1, 2), 16
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    config = BenchConfig(
        batch_sizes=args.batch_sizes,
        max_tokens=args.max_tokens,
        num_draft_tokens=args.num_draft_tokens,
        ngram=args.ngram,
        min_ngram=args.min_ngram,
        repeats=args.repeats,
    )
    prompts = build_workload(2 if args.quick else max(config.batch_sizes))
    load_before = machine_info().get("load_average")
    start = time.perf_counter()
    target = load_model(args.target)
    results = run_benchmark(engine_factory(target, config), prompts, config, chat=True, progress=not args.no_progress)
    elapsed = time.perf_counter() - start
    info = machine_info()
    docs = collect_documents()
    meta = {
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": command,
        "target": target.name,
        "machine": info,
        "load_before": load_before,
        "load_after": info.get("load_average"),
        "elapsed_seconds": elapsed,
        "config": {k: getattr(config, k) for k in ("max_tokens", "num_draft_tokens", "ngram", "min_ngram", "repeats")},
        "workload": (
            f"{len(prompts)} chat prompts asking to summarise / list the points of Python "
            f"{platform.python_version()} standard-library docstrings ({MIN_DOC_CHARS}-{MAX_DOC_CHARS} "
            f"characters; first sources: {', '.join(name for name, _ in docs[: len(prompts)][:8])}"
            f"{', ...' if len(prompts) > 8 else ''}); {_prompt_lengths(results)}; "
            "batch size B uses the first B prompts."
        ),
        "notes": [*ems_notes(results), *args.note],
    }
    for path in write_results(results, meta, args.out_dir):
        print(f"wrote {path}")
    print("\n".join(throughput_table(results, None, "")))
    return 0 if all(r["identical_to_ar"] is not False for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())

"""Thread contention on the ONNX Runtime CPU path: the draft session's spinning and torch's threads.

What: SmolLM2-135M and its shipped draft exported to ONNX, one engine over the export (ORT on
all cores, as ``specdec serve`` runs it), 4 chat requests decoded together, 32 new tokens,
``ar`` and ``ems`` at fixed k = 2, greedy and sampled (T = 1, seeded). Four settings,
interleaved in one process and rotated between repeats (median kept):

* *draft spins*: the draft's ORT session with ORT's default spin-waiting workers, as before
  (``OrtBackend(spin=True)``), or without, as ``Engine.from_export`` now opens it;
* *torch threads*: torch's intra-op threads (2 = all cores, the default before; 1 = what a
  served or CLI engine over an export now sets), which run only the ops between ORT steps
  (sampling over the vocabulary, argmax, masks).

Why: profiling the served main job showed a target step after draft steps costing 55 ms where
the same step after a target step cost 32-40, and 1 ms argmax calls: the draft session's
workers spun on after each draft step and torch's OpenMP workers competed with ORT's for the
two cores. Greedy outputs are compared with ar's token for token (exit status 1 if any differs).

Run::

    python -m benchmarks.ort_contention            # about 3 minutes on a 2-core CPU (+1 min export once)

Writes ``<out-dir>/ort_contention.{json,md,png}`` (default ``benchmarks/results``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from benchmarks.draft_pair import DEFAULT_DRAFT
from specdec.bench.figures import figure
from specdec.bench.harness import machine_info, run_command, run_once, utc_stamp
from specdec.bench.report import write_report
from specdec.bench.workloads import CHAT_PROMPTS
from specdec.export.cli import export
from specdec.models.manifest import read_manifest
from specdec.runtime.backends.onnxruntime import OrtBackend
from specdec.runtime.config import EngineConfig
from specdec.runtime.drafters import ModelDrafter
from specdec.runtime.engine import Engine

DEFAULT_EXPORT = Path(__file__).parent / ".cache" / "ort-pair-export"
SETTINGS = ((True, 2), (False, 2), (True, 1), (False, 1))  # (draft spins, torch threads); first = before, last = now
RUNS = (("ar", 0), ("ems", 2))


def setting_name(setting: tuple[bool, int]) -> str:
    spins, threads = setting
    return f"draft {'spins' if spins else 'no spin'}, torch {threads} thread{'s' if threads > 1 else ''}"


def measure(
    engine: Engine, drafters: dict[bool, ModelDrafter], prompts: Sequence[str], max_tokens: int, repeats: int, bar: tqdm
) -> dict[str, Any]:
    """tokens/s of every (temperature, method, setting), and whether greedy ems equals greedy ar."""
    cells = [(t, run, s) for t in (0.0, 1.0) for run in RUNS for s in SETTINGS]
    times: dict[tuple, list[float]] = {c: [] for c in cells}
    tokens: dict[tuple, list[list[int]]] = {}

    def use(cell: tuple) -> str:
        _, (method, k), (spins, threads) = cell
        torch.set_num_threads(threads)
        engine.drafter = drafters[spins] if k else None
        engine.reconfigure(num_draft_tokens=k)
        return method

    for cell in cells:  # untimed warm-up of every setting
        run_once(engine, prompts[:1], use(cell), 4, True, cell[0])
    for repeat in range(repeats):
        shift = repeat % len(cells)
        for cell in cells[shift:] + cells[:shift]:
            result, _ = run_once(engine, prompts, use(cell), max_tokens, True, cell[0])
            generated = sum(len(o.token_ids) for o in result.outputs)
            times[cell].append(generated / result.run.wall_seconds)
            tokens.setdefault(cell, [o.token_ids for o in result.outputs])
            bar.update()
    out: dict[str, Any] = {}
    for (temperature, (method, k), setting), values in times.items():
        key = f"T={temperature:g} {method}{f' k={k}' if k else ''}"
        out.setdefault(key, {})[setting_name(setting)] = round(statistics.median(values), 2)
    greedy_ar = tokens[(0.0, RUNS[0], SETTINGS[0])]
    identical = all(tokens[(0.0, run, s)] == greedy_ar for run in RUNS for s in SETTINGS)
    return {"tokens_per_second": out, "greedy_identical_to_ar": identical}


def markdown(doc: dict[str, Any]) -> str:
    meta, tps = doc["meta"], doc["tokens_per_second"]
    names = [setting_name(s) for s in SETTINGS]
    lines = [
        "# Thread contention on the ONNX Runtime CPU path",
        "",
        f"- Date: {meta['date']}; command: `{meta['command']}` ({meta['elapsed_seconds']:.0f} s)",
        f"- Export: {meta['export']} (SmolLM2-135M + {meta['draft']}, ONNX Runtime on all cores); {meta['prompts']} "
        f"chat requests decoded together, {meta['max_tokens']} new tokens, sampled runs seeded",
        f"- Machine: {meta['machine']['processor']}, {meta['machine']['cpu_count']} cores; load average before "
        f"{meta['load_before']}, after {meta['load_after']}; median of {meta['repeats']} interleaved repeat(s)",
        "- Cells: tokens/s (prefill included); last column: the current setting over the old one",
        "",
        "| run | " + " | ".join(names) + " | now / before |",
        "|:---|" + "---:|" * (len(names) + 1),
    ]
    for key, row in tps.items():
        lines.append(
            f"| {key} | " + " | ".join(f"{row[n]:.1f}" for n in names) + f" | {row[names[-1]] / row[names[0]]:.2f}× |"
        )
    lines += [
        "",
        "## Notes",
        "",
        "- Greedy ems output was token-identical to greedy ar in every setting."
        if doc["greedy_identical_to_ar"]
        else "- GREEDY OUTPUTS DIFFER between settings or from ar.",
        *(f"- {n}" for n in meta["notes"]),
    ]
    return "\n".join(lines) + "\n"


def auto_notes(tps: dict[str, dict[str, float]]) -> list[str]:
    before, now = setting_name(SETTINGS[0]), setting_name(SETTINGS[-1])
    notes = []
    for temperature in ("0", "1"):
        ar, ems = tps[f"T={temperature} ar"], tps[f"T={temperature} ems k=2"]
        notes.append(
            f"T={temperature}: ems k=2 / ar was {ems[before] / ar[before]:.2f}× before and "
            f"{ems[now] / ar[now]:.2f}× now; ar itself {ar[now] / ar[before]:.2f}×, ems "
            f"{ems[now] / ems[before]:.2f}×."
        )
    return notes


def plot(doc: dict[str, Any], path: Path) -> None:
    tps = doc["tokens_per_second"]
    names = [setting_name(s) for s in SETTINGS]
    with figure(path, figsize=(10, 4.5), dpi=110) as (_, ax):
        width = 0.8 / len(names)
        for i, name in enumerate(names):
            ax.bar([j + i * width for j in range(len(tps))], [row[name] for row in tps.values()], width, label=name)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(tps))], list(tps))
        ax.set(ylabel="tokens/s", title="SmolLM2-135M + draft on ONNX Runtime (CPU): thread settings")
        ax.legend(fontsize=8)
        ax.grid(axis="y", alpha=0.3)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--export", type=Path, default=DEFAULT_EXPORT, help="ONNX export with a draft (made if missing)")
    p.add_argument("--draft", default=DEFAULT_DRAFT)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out-dir", type=Path, default=Path("benchmarks/results"))
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    command = run_command("benchmarks.ort_contention", argv)
    load_before, start = machine_info().get("load_average"), time.perf_counter()
    if not (args.export / "manifest.json").is_file():
        export("smollm2-135m", args.draft, args.export, force=True, max_batch=args.prompts, max_len=1024)
    manifest = read_manifest(args.export)
    engine = Engine.from_export(args.export, config=EngineConfig(max_batch=args.prompts, max_len=1024))
    graph = args.export / manifest["draft"]["graph"]
    drafters = {spins: ModelDrafter(OrtBackend(graph, spin=spins), args.prompts, 1024) for spins in (True, False)}
    prompts = [CHAT_PROMPTS[i % len(CHAT_PROMPTS)] for i in range(args.prompts)]
    bar = tqdm(
        total=2 * len(RUNS) * len(SETTINGS) * args.repeats, desc="settings", unit="run", disable=args.no_progress
    )
    result = measure(engine, drafters, prompts, args.max_tokens, args.repeats, bar)
    bar.close()
    info = machine_info()
    doc = {
        "meta": {
            "date": utc_stamp(),
            "command": command,
            "export": str(args.export),
            "draft": args.draft,
            "prompts": args.prompts,
            "max_tokens": args.max_tokens,
            "repeats": args.repeats,
            "machine": info,
            "load_before": load_before,
            "load_after": info.get("load_average"),
            "elapsed_seconds": time.perf_counter() - start,
            "notes": auto_notes(result["tokens_per_second"]),
        },
        **result,
    }
    print(write_report(doc, args.out_dir, "ort_contention", markdown, plot))
    return 0 if result["greedy_identical_to_ar"] else 1


if __name__ == "__main__":
    sys.exit(main())

"""Is adaptive ``ems`` ever slower than ``ar`` on an edge CPU? Paired runs, with the noise floor measured.

What: one export of SmolLM2-135M-Instruct (default int4, the edge export; the exports of
``benchmarks/edge_cpu.py``, made once and reused) decodes the edge benchmark's two workloads
(*chat*, 8 requests of kinds the draft was not distilled on, and *extractive*, 8 summarise / list
prompts over standard-library docstrings; 64 new tokens at most, greedy) with, at each batch size:

* ``ar``, the base;
* ``ar`` again (*ar, control*): identical work, so its ratio to the base is the noise floor;
* ``ems`` with the adaptive draft length over prompt lookup (*n-gram*), the distilled draft model
  (*draft*) and the *hybrid* (lookup where the context matches, the draft model elsewhere), priced
  by the export's ``--calibrate``, as ``edge_cpu.py`` runs them (``run_specdec``: an engine opened
  as ``specdec generate`` opens an export).

Why: ``edge_cpu.py`` runs each contestant once per repeat in its own process and keeps a median of
two, and speeds on this shared 2-core VM move by up to ±10 % between runs of identical work, so its
``ems``/``ar`` ratios (0.82-1.31) cannot tell a slower policy from noise. Here every repeat runs all
arms back to back in one process, the order rotated each repeat, and each ``ems`` arm's speed is
divided by the *same repeat's* ``ar`` speed (``specdec.bench.paired``): a geometric-mean ratio
with a 95 % Student-t interval over the repeats. An arm is *slower* only when the whole interval
is below 1; the control arm's interval shows how wide "within noise" is on the machine that day.
Every ``ems`` answer must also equal ``ar``'s, token for token (greedy exactness), and the report
says so per arm.

Run::

    python -m benchmarks.edge_cpu --skip llama,hf     # once, if benchmarks/.cache/edge has no exports
    python -m benchmarks.ems_vs_ar                    # int4, B = 1, 4, 8, 5 repeats: ~15 min on 2 cores

Writes ``benchmarks/results/ems_vs_ar.{json,md,png}``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

from benchmarks.edge_cpu import DEFAULT_EXPORT_DIR, PRECISION_METHODS, PRECISIONS, SPECDEC_METHODS
from benchmarks.edge_cpu.__main__ import build_parser
from benchmarks.edge_cpu.children import run_specdec
from benchmarks.edge_cpu.exports import ensure_exports, ensure_hf_dir
from benchmarks.edge_cpu.parent import workload_prompts
from specdec.bench.figures import figure

#: arm name -> drafter (None: ar); "ar, control" repeats the base arm to measure the noise floor
ARMS = {"ar": None, "ar, control": None, "ems n-gram": "ngram", "ems draft": "draft", "ems hybrid": "hybrid"}
BASE = "ar"
WORKLOADS = ("chat", "extractive", "mix")
#: the intervals' level; a verdict needs its Bonferroni-widened interval (over every comparison of the run) to exclude 1
LEVEL = 0.95

#: the edge exports whose ems this compares: those the edge benchmark speculates on (``PRECISION_METHODS``)
SPECULATING_PRECISIONS = tuple(
    p for p in PRECISIONS if any(m == "ems" for m, _, _ in PRECISION_METHODS.get(p, SPECDEC_METHODS))
)


def family_level(comparisons: int) -> float:
    """Bonferroni: each interval at this level, so that all verdicts of a run together err at most ``1 - LEVEL``."""
    return 1 - (1 - LEVEL) / comparisons


def _speeds(run: dict[str, Any]) -> dict[str, float]:
    """tokens/s per workload and over both (all tokens / all seconds)."""
    loads = run["workloads"]
    speeds = {name: w["tokens"] / w["seconds"] for name, w in loads.items()}
    speeds["mix"] = sum(w["tokens"] for w in loads.values()) / sum(w["seconds"] for w in loads.values())
    return speeds


def measure(
    export: Path,
    batches: list[int],
    repeats: int,
    common: dict[str, Any],
    ks: dict[str, int],
) -> dict[str, Any]:
    """Every (repeat, batch, arm) run, arms rotated per repeat; per-run speeds, drafted tokens, answers."""
    runs: dict[str, dict[str, list[Any]]] = {}
    names = list(ARMS)
    with tqdm(total=repeats * len(batches) * len(names), desc="runs", unit="run") as bar:
        for r in range(repeats):
            for b in batches if r % 2 == 0 else batches[::-1]:
                shift = r % len(names)
                for name in names[shift:] + names[:shift]:
                    drafter = ARMS[name]
                    spec = {
                        **common,
                        "export": str(export),
                        "batch": b,
                        "drafter": drafter,
                        "method": "ar" if drafter is None else "ems",
                        "k": ks.get(drafter or "", 4),
                    }
                    run = run_specdec(spec)
                    cell = runs.setdefault(f"{b}", {}).setdefault(name, [])
                    cell.append(
                        {
                            "repeat": r,
                            "speeds": _speeds(run),
                            "ids": {w: v["ids"] for w, v in run["workloads"].items()},
                            "draft_tokens": sum(v["draft_tokens"] for v in run["workloads"].values()),
                            "accepted": sum(v["accepted_draft_tokens"] for v in run["workloads"].values()),
                        }
                    )
                    bar.set_postfix_str(f"B={b} {name} {cell[-1]['speeds']['mix']:.1f} tok/s")
                    bar.update()
    return runs


def summarise(runs: dict[str, dict[str, list[Any]]], comparisons: int) -> dict[str, dict[str, Any]]:
    """Per batch and arm: median speeds, the paired ratio to ``ar`` per workload, exactness, drafting."""
    import statistics

    from specdec.bench.paired import paired_ratio

    family = family_level(comparisons)
    table: dict[str, dict[str, Any]] = {}
    for batch, arms in runs.items():
        base = sorted(arms[BASE], key=lambda x: x["repeat"])
        for name, cells in arms.items():
            cells = sorted(cells, key=lambda x: x["repeat"])
            row: dict[str, Any] = {
                "median_tokps": {w: statistics.median(c["speeds"][w] for c in cells) for w in WORKLOADS},
                "draft_tokens": sum(c["draft_tokens"] for c in cells) / len(cells),
                "accepted": sum(c["accepted"] for c in cells) / len(cells),
                "identical_to_ar": all(c["ids"] == b["ids"] for c, b in zip(cells, base, strict=True)),
            }
            if name != BASE:
                speeds = {w: ([c["speeds"][w] for c in cells], [b["speeds"][w] for b in base]) for w in WORKLOADS}
                row["ratio"] = {w: paired_ratio(*speeds[w]).as_dict() for w in WORKLOADS}
                widened = paired_ratio(*speeds["mix"], level=family)
                row["verdict"] = (
                    widened.verdict
                    if widened.verdict != "within noise"
                    else {
                        "faster": "within noise (faster at 95 % alone)",
                        "slower": "within noise (slower at 95 % alone)",
                    }.get(row["ratio"]["mix"]["verdict"], "within noise")
                )
            table[f"B={batch} {name}"] = {"batch": int(batch), "arm": name, **row}
    return table


def _ratio_cell(r: dict[str, Any] | None) -> str:
    if r is None:
        return "1 (base)"
    return f"{r['ratio']:.3f} [{r['low']:.3f}, {r['high']:.3f}]"


def markdown(doc: dict[str, Any]) -> str:
    meta, rows = doc["meta"], doc["rows"]
    lines = [
        "# Adaptive `ems` against `ar`, paired: faster, slower, or noise?",
        "",
        f"- Date: {meta['date']}; command: `{meta['command']}` ({meta['elapsed_seconds']:.0f} s)",
        f"- Export: `{meta['export']}` ({meta['export_command']})",
        f"- {meta['repeats']} repeats; each runs every arm back to back in one process (order rotated per repeat); "
        f"{meta['max_tokens']} new tokens at most, greedy, {meta['threads']} threads; "
        f"prompts: {meta['prompts']} chat + {meta['prompts']} extractive (`edge_cpu.py`'s workloads)",
        "- *ratio*: geometric mean over repeats of (arm tok/s) / (the same repeat's `ar` tok/s), with its 95 % "
        "Student-t interval (`specdec/bench/paired.py`). *ar, control* runs `ar`'s work again: its interval is the "
        "noise floor. *verdict* (mix): faster / slower only when the interval widened for all of the run's "
        f"{meta['comparisons']} comparisons (Bonferroni, level {meta['family_level']:.4f}) excludes 1, so that the "
        "run's verdicts together are wrong with at most 5 % probability; else within noise (noting where the 95 % "
        "interval alone excludes 1).",
        f"- Machine: {meta['machine'].get('processor', '?')}; load average before {meta['load_before']}, "
        f"after {meta['load_after']}",
        "",
        "| batch | arm | mix tok/s (median) | ratio chat | ratio extractive | ratio mix | verdict (mix) | "
        "draft tokens / accepted per run | answers = ar |",
        "|---:|:---|---:|:---|:---|:---|:---|:---|:---|",
    ]
    for row in rows.values():
        ratio = row.get("ratio")
        cells = [_ratio_cell(None if ratio is None else ratio[w]) for w in WORKLOADS]
        verdict = row.get("verdict", "base")
        drafted = "-" if ARMS[row["arm"]] is None else f"{row['draft_tokens']:.0f} / {row['accepted']:.0f}"
        lines.append(
            f"| {row['batch']} | {row['arm']} | {row['median_tokps']['mix']:.1f} | "
            + " | ".join(cells)
            + f" | {verdict} | {drafted} | {'yes' if row['identical_to_ar'] else '**no**'} |"
        )
    lines += ["", "## Reading", "", *[f"- {n}" for n in doc["notes"]], ""]
    return "\n".join(lines)


def notes(rows: dict[str, dict[str, Any]]) -> list[str]:
    """What the table says, generated from it."""
    out = []
    for verdict in ("slower", "faster", "within noise"):
        hit = [k for k, r in rows.items() if r["arm"].startswith("ems") and r["verdict"].startswith(verdict)]
        out.append(f"ems arms {verdict} (vs ar, mix): {', '.join(hit) if hit else 'none'}.")
    widths = [
        (r["ratio"]["mix"]["high"] - r["ratio"]["mix"]["low"]) / 2 for r in rows.values() if r["arm"] == "ar, control"
    ]
    if widths:
        out.append(
            f"The control's interval half-width on the mix: {min(widths):.3f}-{max(widths):.3f} "
            "(identical work: what this machine's noise allows)."
        )
    wrong = [k for k, r in rows.items() if not r["identical_to_ar"]]
    out.append("Every answer equals ar's." if not wrong else f"Answers that differ from ar's: {', '.join(wrong)}.")
    return out


def plot(doc: dict[str, Any], path: Path) -> None:
    """Mix ratio to ar with its interval, one marker per arm, grouped by batch size."""
    rows = [r for r in doc["rows"].values() if "ratio" in r]
    arms = [a for a in ARMS if a != BASE]
    batches = sorted({r["batch"] for r in rows})
    with figure(path, figsize=(8, 3.8)) as (_, ax):
        for i, arm in enumerate(arms):
            pts = [r for r in rows if r["arm"] == arm]
            xs = [batches.index(r["batch"]) + (i - (len(arms) - 1) / 2) * 0.15 for r in pts]
            ys = [r["ratio"]["mix"]["ratio"] for r in pts]
            err = [
                [y - r["ratio"]["mix"]["low"] for y, r in zip(ys, pts, strict=True)],
                [r["ratio"]["mix"]["high"] - y for y, r in zip(ys, pts, strict=True)],
            ]
            ax.errorbar(xs, ys, yerr=err, fmt="o", capsize=3, label=arm)
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xticks(range(len(batches)), [f"B={b}" for b in batches])
        ax.set_ylabel("tok/s ÷ same repeat's ar (mix)")
        ax.set_title(
            f"{doc['meta']['export_name']}: ems / ar, 95 % interval over {doc['meta']['repeats']} paired repeats",
            fontsize=9,
        )
        ax.legend(fontsize=8)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--precision", default="int4", choices=SPECULATING_PRECISIONS, help="which edge export")
    p.add_argument("--batch-sizes", default="1,4,8")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--prompts", type=int, default=8, help="prompts per workload")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--export-dir", type=Path, default=DEFAULT_EXPORT_DIR)
    p.add_argument("--out-dir", type=Path, default=Path("benchmarks/results"))
    p.add_argument("--stem", default="ems_vs_ar")
    args = p.parse_args(argv)
    if args.repeats < 2:
        p.error("--repeats must be at least 2: one pair has no spread to tell a difference from noise")

    from specdec.bench.harness import int_list, machine_info, run_command, utc_stamp
    from specdec.bench.report import write_report
    from specdec.models.loading import load_metadata

    command = run_command("benchmarks.ems_vs_ar", argv)
    load_before = machine_info().get("load_average")
    start = time.perf_counter()
    batches = list(int_list(args.batch_sizes))
    edge = build_parser().parse_args([])  # the edge benchmark's draft lengths, not a second copy
    ks = {"ngram": edge.ngram_k, "hybrid": edge.ngram_k, "draft": edge.draft_k}
    export = ensure_exports([args.precision], args.export_dir, ks["draft"], max(8, *batches))[args.precision]
    if "error" in export:
        print(f"error: {export['error']}", file=sys.stderr)
        return 2
    meta_model = load_metadata(ensure_hf_dir(args.export_dir))
    _, prompts, max_len = workload_prompts(args.prompts, meta_model.tokenizer, args.max_tokens)
    common = {
        "prompts": prompts,
        "max_tokens": args.max_tokens,
        "threads": args.threads,
        "max_len": max_len,
        "eos": sorted(meta_model.eos_token_ids),
    }
    runs = measure(Path(export["dir"]), batches, args.repeats, common, ks)
    comparisons = len(batches) * (len(ARMS) - 1)  # every arm but the base, at every batch size
    rows = summarise(runs, comparisons)
    info = machine_info()
    doc = {
        "meta": {
            "date": utc_stamp(),
            "command": command,
            "export": export["dir"],
            "export_name": args.precision,
            "export_command": f"`{export.get('command')}`, made {export.get('created')}",
            "repeats": args.repeats,
            "threads": args.threads,
            "max_tokens": args.max_tokens,
            "comparisons": comparisons,
            "family_level": family_level(comparisons),
            "prompts": args.prompts,
            "machine": info,
            "load_before": load_before,
            "load_after": info.get("load_average"),
            "elapsed_seconds": round(time.perf_counter() - start, 1),
        },
        "rows": rows,
        "notes": notes(rows),
        "runs": {
            b: {a: [{k: v for k, v in c.items() if k != "ids"} for c in cells] for a, cells in arms.items()}
            for b, arms in runs.items()
        },
    }
    print(write_report(doc, args.out_dir, args.stem, markdown, plot))
    return 0 if all(r["identical_to_ar"] for r in rows.values()) else 1


if __name__ == "__main__":
    sys.exit(main())

"""Which export the main job should serve: the candidate configurations through Triton, side by side.

The main job (``scripts/main.sh``) sends the demo mix (``specdec.runtime.prompts.DEFAULT_PROMPTS``: short
chat answers and requests that quote or rework their prompt) concurrently to ``specdec serve`` with
``method=ems`` and again with ``method=ar``. Which export is fastest for that depends on the machine:
the weights' format trades bytes read per step against arithmetic per row (``benchmarks/results/edge_cpu.md``),
and the drafter that pays depends on the mix. This script exports each candidate, serves it on loopback,
sends the main job's requests all at once and one at a time (interleaved ems / ar after a warm-up, medians
of ``--repeats``), checks that ems answers equal ar's token for token, and writes
``benchmarks/results/served_configs.{md,json,png}``; the main job serves the fastest exact one that serves DSBD
(``choose``: ems answers equal ar's, the draft model in its drafter, the highest ``estimates``).

    python -m benchmarks.served_configs            # ~20 min on 2 cores (9 exports, 9 servers)
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

from specdec.bench.figures import figure
from specdec.bench.harness import machine_info, run_command, utc_stamp
from specdec.runtime.prompts import DEFAULT_PROMPTS
from specdec.serving.client import Answer, run_concurrent
from specdec.serving.server import TritonServer, free_ports

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "benchmarks" / "results"
CACHE = ROOT / "benchmarks" / ".cache" / "served"
#: what every candidate shares with the main job's export
COMMON = [
    "--target",
    "smollm2-135m",
    "--draft",
    "smollm2-135m-draft",
    "--max-batch",
    "8",
    "--max-len",
    "2048",
    "--num-draft-tokens",
    "4",
    "--adaptive-draft",
    "--calibrate",
]
#: the quantized ones at their defaults (int8 activations, fp16 KV caches), as the main job serves them; each
#: quantized format with prompt lookup and with the hybrid drafter, the two that paid in
#: benchmarks/results/ems_vs_ar.md, and int4 and w8a8 (the integer GEMM export) with the draft model alone
CANDIDATES = {
    "fp32, n-gram": ["--drafter", "ngram"],
    "int4, n-gram": ["--quantize", "int4", "--drafter", "ngram"],
    "int4, hybrid": ["--quantize", "int4", "--drafter", "hybrid"],
    "int4, draft model": ["--quantize", "int4"],
    "int8, n-gram": ["--quantize", "int8", "--drafter", "ngram"],
    "int8, hybrid": ["--quantize", "int8", "--drafter", "hybrid"],
    "w8a8, n-gram": ["--quantize", "w8a8", "--drafter", "ngram"],
    "w8a8, hybrid": ["--quantize", "w8a8", "--drafter", "hybrid"],
    "w8a8, draft model": ["--quantize", "w8a8"],
}


def export(name: str, extra: list[str], reexport: bool) -> tuple[Path, list[str], float]:
    out = CACHE / name.replace(", ", "-").replace(" ", "-")
    command = ["specdec-export", *COMMON, *extra, "--out", str(out), "--force"]
    if (out / "manifest.json").is_file() and not reexport:
        return out, command, 0.0
    start = time.perf_counter()
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return out, command, time.perf_counter() - start


#: the drafters that hold the draft model (candidate names: "<graph>, <drafter>")
DRAFT_MODEL_DRAFTERS = {"hybrid", "draft model"}
#: the main job's two regimes: every request at once (throughput), and one at a time (latency)
CONCURRENCY = {"all at once": len(DEFAULT_PROMPTS), "one at a time": 1}


def measure(directory: Path, max_tokens: int, repeats: int) -> dict[str, Any]:
    """Median tokens/s of ems and ar over the demo mix in each regime; whether every ems answer equals ar's."""
    grpc, http, metrics = free_ports()
    server = TritonServer()
    server.start(directory / "triton_repo", grpc_port=grpc, http_port=http, metrics_port=metrics)
    try:
        server.wait_ready(600)
        prompts = list(DEFAULT_PROMPTS)
        params = {"max_tokens": max_tokens, "apply_chat_template": True}
        run_concurrent(server.grpc_url, prompts, len(prompts), method="ems", **params)  # warm-up, untimed
        out: dict[str, Any] = {"identical": True, "runs": {}}
        for regime, concurrency in CONCURRENCY.items():
            speeds: dict[str, list[float]] = {"ems": [], "ar": []}
            answers: dict[str, list[Any]] = {}
            for _ in range(repeats):
                for method in ("ems", "ar"):
                    got, wall = run_concurrent(server.grpc_url, prompts, concurrency, method=method, **params)
                    errors = [a for a in got if not isinstance(a, Answer)]
                    if errors:
                        raise RuntimeError(f"{directory}: {method} failed: {errors[0]}")
                    speeds[method].append(sum(len(a.output_ids) for a in got) / wall)
                    answers[method] = [a.output_ids for a in got]
            out[regime] = {f"{m}_tokens_per_second": statistics.median(v) for m, v in speeds.items()}
            out["runs"][regime] = speeds
            out["identical"] = out["identical"] and answers["ems"] == answers["ar"]
        return out
    finally:
        server.stop()


def graph_of(row: dict[str, Any]) -> str:
    """The graph a candidate serves: its name's part before the drafter (``"int4, hybrid"`` -> ``"int4"``)."""
    return row["name"].split(", ")[0]


def by_graph(rows: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """The candidates grouped by the graph they serve, in their order."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault(graph_of(r), []).append(r)
    return groups


def serves_dsbd(row: dict[str, Any]) -> bool:
    """Whether the candidate's drafter holds the draft model, which DSBD beam-samples its forests with (the main job
    asks for a DSBD answer; with prompt lookup alone the server refuses ``dsbd`` and serves only ``beam``)."""
    return row["name"].split(", ")[1] in DRAFT_MODEL_DRAFTERS


def estimates(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Each candidate's ems tokens/s as the rule compares them: its graph's ``ar`` speed, pooled over every candidate
    of that graph (geometric mean over candidates and regimes), times its own ems / ar ratio (geometric mean over
    regimes).

    Why not its own ems speed: ``ar`` runs the same graph whatever the drafter, yet between candidates (one server
    after another) it moved by up to a fifth here, more than the drafters differ; a ratio is measured on one server
    with ems and ar interleaved, so the drift between servers cancels in it, and pooling ``ar`` averages the rest.
    """
    ar = {
        graph: statistics.geometric_mean([r[g]["ar_tokens_per_second"] for r in group for g in CONCURRENCY])
        for graph, group in by_graph(rows).items()
    }
    return {
        r["name"]: ar[graph_of(r)]
        * statistics.geometric_mean([r[g]["ems_tokens_per_second"] / r[g]["ar_tokens_per_second"] for g in CONCURRENCY])
        for r in rows
    }


def choose(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The main job's export: the exact candidate (ems answers = ar's) that serves DSBD with the highest estimate."""
    score = estimates(rows)
    eligible = [r for r in rows if r["identical"] and serves_dsbd(r)]
    if not eligible:
        raise RuntimeError("no candidate is exact and serves DSBD")
    return max(eligible, key=lambda r: score[r["name"]])


def report(rows: list[dict[str, Any]], meta: dict[str, Any], out: Path) -> str:
    best, score = choose(rows), estimates(rows)
    regimes = list(CONCURRENCY)
    lines = [
        "# The main job's candidate exports, served through Triton",
        "",
        f"- Date: {meta['date']}; command: `{meta['command']}` ({meta['total_seconds']:.0f} s)",
        f"- Workload: the main job's demo mix, {meta['prompts']} prompts (chat template, greedy, at most "
        f"{meta['max_tokens']} new tokens), sent all at once and one at a time; ems and ar interleaved after a "
        f"warm-up, median of {meta['repeats']} repeats",
        f"- Every export: `specdec-export {' '.join(COMMON)}` plus the flags below",
        f"- Machine: {meta['machine']}; load average before {meta['load_before']}, after {meta['load_after']}",
        "- The main job serves the exact candidate that serves DSBD (its drafter holds the draft model) with "
        "the highest *estimate*: its graph's ar tok/s pooled over that graph's candidates, times its own ems / ar "
        "ratio (geometric means over the regimes; `estimates`, which says why)",
        "",
        "| export | extra flags | "
        + " | ".join(f"{r}: ems / ar tok/s (ratio)" for r in regimes)
        + " | ems = ar (token ids) | DSBD | estimate tok/s |",
        "|:---|:---|" + "---:|" * len(regimes) + ":---|:---|---:|",
    ]
    for r in rows:
        cells = [
            f"{r[g]['ems_tokens_per_second']:.1f} / {r[g]['ar_tokens_per_second']:.1f} "
            f"({r[g]['ems_tokens_per_second'] / r[g]['ar_tokens_per_second']:.2f}×)"
            for g in regimes
        ]
        lines.append(
            f"| {r['name']} | `{' '.join(r['flags']) or '-'}` | "
            + " | ".join(cells)
            + f" | {'yes' if r['identical'] else 'NO'} | {'yes' if serves_dsbd(r) else 'no'} | "
            f"{score[r['name']]:.1f} |"
        )
    spread = {graph: [r[regimes[0]]["ar_tokens_per_second"] for r in group] for graph, group in by_graph(rows).items()}
    lines += [
        "",
        f"The main job's export: **{best['name']}** (estimate {score[best['name']]:.1f} tok/s; measured ems "
        + ", ".join(f"{best[g]['ems_tokens_per_second']:.1f} tok/s {g}" for g in regimes)
        + "). The same "
        f"graph's ar, {regimes[0]}, across its candidates: "
        + "; ".join(f"{g} {min(v):.1f}-{max(v):.1f}" for g, v in spread.items() if len(v) > 1)
        + " tok/s (the drift between servers that the estimate pools).",
        "",
    ]
    text = "\n".join(lines)
    out.mkdir(parents=True, exist_ok=True)
    (out / "served_configs.md").write_text(text)
    (out / "served_configs.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    _plot(rows, out / "served_configs.png")
    return text


def _plot(rows: list[dict[str, Any]], path: Path) -> None:
    with figure(path, 1, len(CONCURRENCY), figsize=(11, 3.6)) as (_, axes):
        x = range(len(rows))
        for ax, regime in zip(axes, CONCURRENCY):
            ax.bar([i - 0.2 for i in x], [r[regime]["ar_tokens_per_second"] for r in rows], 0.4, label="ar")
            ax.bar(
                [i + 0.2 for i in x], [r[regime]["ems_tokens_per_second"] for r in rows], 0.4, label="ems (adaptive)"
            )
            ax.set_xticks(list(x), [r["name"] for r in rows], rotation=20, fontsize=8)
            ax.set_ylabel("tokens/s")
            ax.set_title(f"demo mix, {regime}", fontsize=9)
            ax.legend(fontsize=8)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3, help="interleaved repeats (the median is kept)")
    parser.add_argument("--max-tokens", type=int, default=96, help="new tokens per request at most (the main job's)")
    parser.add_argument("--reexport", action="store_true", help="export again even where a cached export exists")
    parser.add_argument("--out-dir", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    start = time.perf_counter()
    before = machine_info()
    rows = []
    for name, flags in tqdm(CANDIDATES.items(), desc="candidates", unit="export"):
        directory, command, seconds = export(name, flags, args.reexport)
        rows.append(
            {
                "name": name,
                "flags": flags,
                "export_command": shlex.join(command),
                "export_seconds": round(seconds, 1),
                **measure(directory, args.max_tokens, args.repeats),
            }
        )
    meta = {
        "date": utc_stamp(),
        "command": run_command("benchmarks.served_configs", argv),
        "total_seconds": time.perf_counter() - start,
        "prompts": len(DEFAULT_PROMPTS),
        "max_tokens": args.max_tokens,
        "repeats": args.repeats,
        "machine": f"{before['processor']}, {before['cpu_count']} cores",
        "load_before": before.get("load_average"),
        "load_after": machine_info().get("load_average"),
    }
    print(report(rows, meta, args.out_dir))
    return 0


if __name__ == "__main__":
    sys.exit(main())

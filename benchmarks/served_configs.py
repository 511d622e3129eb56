"""Which export the main job should serve: the candidate configurations through Triton, side by side.

The main job (``scripts/main.sh``) sends the demo mix (``specdec.runtime.prompts.DEFAULT_PROMPTS``: short
chat answers and requests that quote or rework their prompt) concurrently to ``specdec serve`` with
``method=ems`` and again with ``method=ar``. Which export is fastest for that depends on the machine:
the weights' format trades bytes read per step against arithmetic per row (``benchmarks/results/edge_cpu.md``),
and the drafter that pays depends on the mix. This script exports each candidate, serves it on loopback,
sends the main job's requests all at once and one at a time (interleaved ems / ar after a warm-up, medians
of ``--repeats``), checks that ems answers equal ar's token for token, and writes
``benchmarks/results/served_configs.{md,json,png}``; the main job serves the fastest exact one (by the
geometric mean of its ems tokens/s in the two regimes).

    python benchmarks/served_configs.py            # ~12 min on 2 cores (5 exports, 5 servers)
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

from specdec.bench.harness import machine_info
from specdec.runtime.prompts import DEFAULT_PROMPTS
from specdec.serving.client import Answer, run_concurrent
from specdec.serving.server import TritonServer, free_ports

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "benchmarks" / "results"
CACHE = ROOT / "benchmarks" / ".cache" / "served"
#: what every candidate shares with the main job's export
COMMON = ["--target", "smollm2-135m", "--draft", "smollm2-135m-draft", "--max-batch", "8", "--max-len", "2048",
          "--num-draft-tokens", "4", "--adaptive-draft", "--calibrate"]
#: the quantized ones over fp32 caches, as the main job serves them (fp16 caches cost steps up to a fifth in some
#: runs here: benchmarks/results/kv_cache_dtype.md, edge_cpu.md)
CANDIDATES = {
    "fp32, n-gram": ["--drafter", "ngram"],
    "int4, n-gram": ["--quantize", "int4", "--drafter", "ngram", "--kv-cache", "float32"],
    "int4, hybrid": ["--quantize", "int4", "--drafter", "hybrid", "--kv-cache", "float32"],
    "int4, draft model": ["--quantize", "int4", "--kv-cache", "float32"],
    "int8, n-gram": ["--quantize", "int8", "--drafter", "ngram", "--kv-cache", "float32"],
}


def export(name: str, extra: list[str], reexport: bool) -> tuple[Path, list[str], float]:
    out = CACHE / name.replace(", ", "-").replace(" ", "-")
    command = ["specdec-export", *COMMON, *extra, "--out", str(out), "--force"]
    if (out / "manifest.json").is_file() and not reexport:
        return out, command, 0.0
    start = time.perf_counter()
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return out, command, time.perf_counter() - start


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
        out["ems_score"] = statistics.geometric_mean([out[r]["ems_tokens_per_second"] for r in CONCURRENCY])
        return out
    finally:
        server.stop()


def report(rows: list[dict[str, Any]], meta: dict[str, Any], out: Path) -> str:
    best = max((r for r in rows if r["identical"]), key=lambda r: r["ems_score"])
    regimes = list(CONCURRENCY)
    lines = ["# The main job's candidate exports, served through Triton", "",
             f"- Date: {meta['date']}; command: `{meta['command']}` ({meta['total_seconds']:.0f} s)",
             f"- Workload: the main job's demo mix, {meta['prompts']} prompts (chat template, greedy, at most "
             f"{meta['max_tokens']} new tokens), sent all at once and one at a time; ems and ar interleaved after a "
             f"warm-up, median of {meta['repeats']} repeats",
             f"- Every export: `specdec-export {' '.join(COMMON)}` plus the flags below",
             f"- Machine: {meta['machine']}; load average before {meta['load_before']}, after {meta['load_after']}",
             "- The main job serves the fastest exact export by the geometric mean of its ems tokens/s in the two "
             "regimes", "",
             "| export | extra flags | " + " | ".join(f"{r}: ems / ar tok/s (ratio)" for r in regimes)
             + " | ems = ar (token ids) |",
             "|:---|:---|" + "---:|" * len(regimes) + ":---|"]
    for r in rows:
        cells = [f"{r[g]['ems_tokens_per_second']:.1f} / {r[g]['ar_tokens_per_second']:.1f} "
                 f"({r[g]['ems_tokens_per_second'] / r[g]['ar_tokens_per_second']:.2f}×)" for g in regimes]
        lines.append(f"| {r['name']} | `{' '.join(r['flags']) or '-'}` | " + " | ".join(cells)
                     + f" | {'yes' if r['identical'] else 'NO'} |")
    lines += ["", f"Fastest exact: **{best['name']}** (ems " + ", ".join(
        f"{best[g]['ems_tokens_per_second']:.1f} tok/s {g}" for g in regimes) + ").", ""]
    text = "\n".join(lines)
    out.mkdir(parents=True, exist_ok=True)
    (out / "served_configs.md").write_text(text)
    (out / "served_configs.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    _plot(rows, out / "served_configs.png")
    return text


def _plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(CONCURRENCY), figsize=(11, 3.6))
    x = range(len(rows))
    for ax, regime in zip(axes, CONCURRENCY):
        ax.bar([i - 0.2 for i in x], [r[regime]["ar_tokens_per_second"] for r in rows], 0.4, label="ar")
        ax.bar([i + 0.2 for i in x], [r[regime]["ems_tokens_per_second"] for r in rows], 0.4, label="ems (adaptive)")
        ax.set_xticks(list(x), [r["name"] for r in rows], rotation=20, fontsize=8)
        ax.set_ylabel("tokens/s")
        ax.set_title(f"demo mix, {regime}", fontsize=9)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


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
        rows.append({"name": name, "flags": flags, "export_command": shlex.join(command),
                     "export_seconds": round(seconds, 1), **measure(directory, args.max_tokens, args.repeats)})
    meta = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "command": shlex.join(["python", "benchmarks/served_configs.py", *(argv or sys.argv[1:])]),
            "total_seconds": time.perf_counter() - start, "prompts": len(DEFAULT_PROMPTS),
            "max_tokens": args.max_tokens, "repeats": args.repeats,
            "machine": f"{before['processor']}, {before['cpu_count']} cores",
            "load_before": before.get("load_average"), "load_after": machine_info().get("load_average")}
    print(report(rows, meta, args.out_dir))
    return 0


if __name__ == "__main__":
    sys.exit(main())

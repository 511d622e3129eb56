"""Which export the main job should serve: the candidate configurations through Triton, side by side.

The main job (``scripts/main.sh``) sends the demo mix (``specdec.runtime.prompts.DEFAULT_PROMPTS``: short
chat answers and requests that quote or rework their prompt) concurrently to ``specdec serve`` with
``method=ems`` and again with ``method=ar``. Which export is fastest for that depends on the machine:
the weights' format trades bytes read per step against arithmetic per row (``benchmarks/results/edge_cpu.md``),
and the drafter that pays depends on the mix. This script exports each candidate, serves it on loopback,
sends the main job's requests (interleaved ems / ar, medians of ``--repeats``), checks that ems answers
equal ar's token for token, and writes ``benchmarks/results/served_configs.{md,json,png}``; the main job
serves the fastest exact one.

    python benchmarks/served_configs.py            # ~15 min on 2 cores (5 exports, 5 servers)
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
CANDIDATES = {
    "fp32, n-gram": ["--drafter", "ngram"],
    "int4, n-gram": ["--quantize", "int4", "--drafter", "ngram"],
    "int4, hybrid": ["--quantize", "int4", "--drafter", "hybrid"],
    "int4, draft model": ["--quantize", "int4"],
    "int8, n-gram": ["--quantize", "int8", "--drafter", "ngram"],
}


def export(name: str, extra: list[str], reexport: bool) -> tuple[Path, list[str], float]:
    out = CACHE / name.replace(", ", "-").replace(" ", "-")
    command = ["specdec-export", *COMMON, *extra, "--out", str(out), "--force"]
    if (out / "manifest.json").is_file() and not reexport:
        return out, command, 0.0
    start = time.perf_counter()
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return out, command, time.perf_counter() - start


def measure(directory: Path, max_tokens: int, repeats: int) -> dict[str, Any]:
    """Median tokens/s of ems and ar over the demo mix; whether every ems answer equals ar's."""
    grpc, http, metrics = free_ports()
    server = TritonServer()
    server.start(directory / "triton_repo", grpc_port=grpc, http_port=http, metrics_port=metrics)
    try:
        server.wait_ready(600)
        prompts = list(DEFAULT_PROMPTS)
        params = {"max_tokens": max_tokens, "apply_chat_template": True}
        run_concurrent(server.grpc_url, prompts[:2], 2, method="ems", **params)  # warm-up, untimed
        speeds: dict[str, list[float]] = {"ems": [], "ar": []}
        answers: dict[str, list[Any]] = {}
        for _ in range(repeats):
            for method in ("ems", "ar"):
                got, wall = run_concurrent(server.grpc_url, prompts, len(prompts), method=method, **params)
                errors = [a for a in got if not isinstance(a, Answer)]
                if errors:
                    raise RuntimeError(f"{directory}: {method} failed: {errors[0]}")
                speeds[method].append(sum(len(a.output_ids) for a in got) / wall)
                answers[method] = [a.output_ids for a in got]
        return {"ems_tokens_per_second": statistics.median(speeds["ems"]),
                "ar_tokens_per_second": statistics.median(speeds["ar"]),
                "identical": answers["ems"] == answers["ar"], "runs": speeds}
    finally:
        server.stop()


def report(rows: list[dict[str, Any]], meta: dict[str, Any], out: Path) -> str:
    best = max((r for r in rows if r["identical"]), key=lambda r: r["ems_tokens_per_second"])
    lines = ["# The main job's candidate exports, served through Triton", "",
             f"- Date: {meta['date']}; command: `{meta['command']}` ({meta['total_seconds']:.0f} s)",
             f"- Workload: the main job's demo mix, {meta['prompts']} prompts sent concurrently (chat template, "
             f"greedy, at most {meta['max_tokens']} new tokens), ems then ar, "
             f"interleaved, median of {meta['repeats']} repeats",
             f"- Every export: `specdec-export {' '.join(COMMON)}` plus the flags below",
             f"- Machine: {meta['machine']}; load average before {meta['load_before']}, after {meta['load_after']}", "",
             "| export | extra flags | ems tok/s | ar tok/s | ems / ar | ems = ar (token ids) |",
             "|:---|:---|---:|---:|---:|:---|"]
    for r in rows:
        ratio = r["ems_tokens_per_second"] / r["ar_tokens_per_second"]
        lines.append(f"| {r['name']} | `{' '.join(r['flags']) or '-'}` | {r['ems_tokens_per_second']:.1f} | "
                     f"{r['ar_tokens_per_second']:.1f} | {ratio:.2f}× | {'yes' if r['identical'] else 'NO'} |")
    lines += ["", f"Fastest exact: **{best['name']}**, ems {best['ems_tokens_per_second']:.1f} tok/s "
              f"({best['ems_tokens_per_second'] / best['ar_tokens_per_second']:.2f}× its own ar).", ""]
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

    fig, ax = plt.subplots(figsize=(7, 3.5))
    x = range(len(rows))
    ax.bar([i - 0.2 for i in x], [r["ar_tokens_per_second"] for r in rows], 0.4, label="ar")
    ax.bar([i + 0.2 for i in x], [r["ems_tokens_per_second"] for r in rows], 0.4, label="ems (adaptive)")
    ax.set_xticks(list(x), [r["name"] for r in rows])
    ax.set_ylabel("tokens/s (6 concurrent requests)")
    ax.set_title("The main job's demo mix through Triton, per export")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=2, help="interleaved repeats (the median is kept)")
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

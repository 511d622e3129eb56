"""Scaling out on the engines operators run: 1 vs 2 engine instances in one server, 1 vs 2 replicas behind HAProxy.

What it measures, on one export (SmolLM2-135M) on this machine, greedy ``ems`` over gRPC, unary requests:

- **1 instance**: one ``tritonserver`` (under ``specdec serve``), one engine instance with all cores.
- **2 instances**: one server whose engine has ``instance_group { count: 2 }`` (``ServingOptions(instances=2)``),
  each instance on half the cores (``intra_op_threads``), each with its own decoding loops and KV slots.
- **2 replicas + balancer**: two ``specdec serve`` processes, each one instance on half the cores, behind
  ``haproxy`` (``specdec.deploy.balancer``), health-checked on Triton's readiness.

For each and for 1, 4 and 16 concurrent clients, N = max(4C, 16) requests (prompts round-robin from a fixed list,
``--max-tokens`` new tokens): requests/s, tokens/s, p50 and p99 latency; every answer is compared with the local
runtime's greedy answer (mismatches counted). Configurations run one after another (each needs its servers
started); the client counts inside each are interleaved over ``--repeats`` and the median is reported.

How to run it (from the repository root, on an otherwise idle machine; haproxy from Debian's package)::

    python -m benchmarks.scaling --export benchmarks/.cache/edge/fp32 [--repeats 2] [--max-tokens 32]

Results: ``benchmarks/results/scaling.{md,json,png}``.

Why: a deployment guide must say what instances and replicas buy and where they do not pay; on 2 cores the
answer is that they split the cores rather than add any, so the honest numbers are part of the guide.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from specdec.bench.figures import figure
from specdec.bench.harness import machine_info, run_command, utc_stamp
from specdec.bench.workloads import SHORT_PROMPTS
from specdec.deploy.balancer import Balancer, Replica
from specdec.models.manifest import read_manifest
from specdec.runtime.engine import Engine
from specdec.serving.client import SpecdecClient
from specdec.serving.repository import ServingOptions, write_repository
from specdec.serving.server import free_ports

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "benchmarks" / "results"
PROMPTS = SHORT_PROMPTS
CLIENTS = (1, 4, 16)


def _serve(repo: Path, log: Path) -> tuple[subprocess.Popen[str], str, int]:
    """``specdec serve`` on ``repo`` on free ports, ready: (process, gRPC address, HTTP port)."""
    grpc, http, metrics = free_ports()
    code = "import sys; from specdec.serving.serve import serve_main; sys.exit(serve_main(sys.argv[1:]))"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            code,
            str(repo),
            "--grpc-port",
            str(grpc),
            "--http-port",
            str(http),
            "--metrics-port",
            str(metrics),
            "--no-openai",  # Triton's endpoints are what this measures
            "--log-file",
            str(log),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("(Ctrl-C"):
            return proc, f"127.0.0.1:{grpc}", http
    raise SystemExit(f"specdec serve did not get ready: {proc.stderr.read() if proc.stderr else ''}")


@contextlib.contextmanager
def deployment(name: str, export: Path, work: Path) -> Iterator[str]:
    """The gRPC address of configuration ``name``, running for the block."""
    cores = os.cpu_count() or 2
    half = max(1, cores // 2)
    procs: list[subprocess.Popen[str]] = []
    try:
        if name == "1 instance":
            repo = write_repository(export, work / "one", ServingOptions())
            proc, url, _ = _serve(repo, work / "one.log")
            procs.append(proc)
            yield url
        elif name == "2 instances":
            repo = write_repository(export, work / "two", ServingOptions(instances=2, intra_op_threads=half))
            proc, url, _ = _serve(repo, work / "two.log")
            procs.append(proc)
            yield url
        else:
            repo = write_repository(export, work / "replica", ServingOptions(intra_op_threads=half))
            replicas = []
            for i in range(2):
                proc, url, http = _serve(repo, work / f"replica{i}.log")
                procs.append(proc)
                host, port = url.rsplit(":", 1)
                replicas.append(Replica(host, int(port), http))
            with Balancer(replicas, grpc_port=free_ports(1)[0]) as lb:
                time.sleep(2.0)  # both replicas pass their health checks (rise 2 at 0.5 s) before the load
                yield lb.grpc_url
    finally:
        for proc in procs:
            proc.send_signal(2)
        for proc in procs:
            proc.wait(300)


def run_load(url: str, clients: int, max_tokens: int, refs: dict[str, list[int]]) -> dict[str, Any]:
    n = max(4 * clients, 16)
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(n)]

    def one(prompt: str) -> tuple[float, int, bool]:
        begun = time.perf_counter()
        answer = SpecdecClient(url).generate(prompt, max_tokens=max_tokens, apply_chat_template=True)
        return time.perf_counter() - begun, len(answer.output_ids), answer.output_ids == refs[prompt]

    begun = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        results = list(pool.map(one, prompts))
    wall = time.perf_counter() - begun
    latencies = sorted(r[0] for r in results)
    return {
        "requests": n,
        "wall_s": wall,
        "requests_per_s": n / wall,
        "tokens_per_s": sum(r[1] for r in results) / wall,
        "p50_s": statistics.median(latencies),
        "p99_s": latencies[min(n - 1, round(0.99 * (n - 1)))],
        "mismatches": sum(not r[2] for r in results),
    }


def report(result: dict[str, Any], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "scaling.json").write_text(json.dumps(result, indent=2))
    lines = [
        "# Scaling: engine instances and replicas behind a balancer (SmolLM2-135M, this CPU)",
        "",
        f"- Date: {result['date']}",
        f"- Command: `{result['command']}`",
        f"- Machine: {result['machine']}",
        f"- Load average before / after: {result['load_before']} / {result['load_after']}",
        f"- Greedy `ems`, unary gRPC, {result['max_tokens']} new tokens at most, N = max(4C, 16) requests per "
        f"client count C; median of {result['repeats']} interleaved repeat(s)",
        "",
        "| configuration | clients | requests/s | tokens/s | p50 latency (s) | p99 latency (s) | vs 1 instance "
        "(tokens/s) | mismatches |",
        "|:---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    base = {row["clients"]: row["tokens_per_s"] for row in result["rows"] if row["config"] == "1 instance"}
    for row in result["rows"]:
        lines.append(
            f"| {row['config']} | {row['clients']} | {row['requests_per_s']:.2f} | "
            f"{row['tokens_per_s']:.1f} | {row['p50_s']:.2f} | {row['p99_s']:.2f} | "
            f"{row['tokens_per_s'] / base[row['clients']]:.2f}× | {row['mismatches']} |"
        )
    lines += [
        "",
        "## How to read this",
        "",
        f"- This machine has {os.cpu_count()} cores. One instance runs ONNX Runtime on all of them; two "
        "instances or two replicas each get half, so on this machine they split the cores rather than add "
        "any: what they can win is the overlap of one engine's Python work (scheduling, sampling, IPC) "
        "with the other's matrix work, and what they lose is the batching one engine does across all "
        "requests (two engines each batch half). On a node with cores or GPUs to spare, each instance or "
        "replica brings its own.",
        f"- Each engine has the export's {result['max_batch']} KV slots: past that many clients one instance "
        "queues the rest, while two instances or replicas hold twice as many, so at 16 clients the second "
        "engine's gain is its slots (in-flight batching over more sequences), not more compute.",
        "- The balancer adds one hop (HAProxy, HTTP/2 proxying on the same machine) to every call.",
        "- *mismatches*: answers that differ from the local runtime's greedy answer (must be 0).",
    ]
    (out / "scaling.md").write_text("\n".join(lines) + "\n")
    with figure(out / "scaling.png", 1, 2, figsize=(11, 4), dpi=110) as (fig, (ax1, ax2)):
        for config in result["configs"]:
            rows = [r for r in result["rows"] if r["config"] == config]
            ax1.plot([r["clients"] for r in rows], [r["tokens_per_s"] for r in rows], marker="o", label=config)
            ax2.plot([r["clients"] for r in rows], [r["p99_s"] for r in rows], marker="o", label=config)
        for ax, label in ((ax1, "tokens/s (aggregate)"), (ax2, "p99 latency (s)")):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("concurrent clients")
            ax.set_ylabel(label)
            ax.legend(fontsize=8)
        fig.suptitle("1 vs 2 engine instances vs 2 replicas behind HAProxy")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--export", type=Path, required=True, help="an export directory (specdec-export --out)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--out-dir", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    load_before = [round(x, 2) for x in os.getloadavg()]
    engine = Engine.from_export(args.export)
    refs = {
        p: o.token_ids
        for p, o in zip(
            PROMPTS,
            engine.generate([engine.request(p, chat=True, max_tokens=args.max_tokens) for p in PROMPTS], "ems").outputs,
        )
    }
    del engine
    configs = ["1 instance", "2 instances", "2 replicas + balancer"]
    rows = []
    with tempfile.TemporaryDirectory(prefix="specdec-scaling-") as tmp:
        for config in tqdm(configs, desc="configurations"):
            with deployment(config, args.export, Path(tmp)) as url:
                run_load(url, 2, args.max_tokens, refs)  # warm-up
                runs: dict[int, list[dict[str, Any]]] = {c: [] for c in CLIENTS}
                for _ in range(args.repeats):
                    for clients in CLIENTS:
                        runs[clients].append(run_load(url, clients, args.max_tokens, refs))
                for clients, measured in runs.items():
                    row = {k: statistics.median(m[k] for m in measured) for k in measured[0]}
                    row["mismatches"] = sum(m["mismatches"] for m in measured)
                    rows.append({"config": config, "clients": clients, **row})
    result = {
        "date": utc_stamp(),
        "command": run_command("benchmarks.scaling", argv),
        "machine": machine_info(),
        "load_before": load_before,
        "load_after": [round(x, 2) for x in os.getloadavg()],
        "max_tokens": args.max_tokens,
        "repeats": args.repeats,
        "configs": configs,
        "rows": rows,
        "max_batch": int(read_manifest(args.export, verify=False)["max_batch"]),
    }
    report(result, args.out_dir)
    print((args.out_dir / "scaling.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())

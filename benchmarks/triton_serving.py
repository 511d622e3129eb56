"""Speculative decoding served through a real Triton Inference Server: throughput and added latency.

What it measures, on SmolLM2-135M exported to ONNX (one ``tritonserver`` on free loopback ports,
greedy, chat template applied on the server, the served default draft length k):

1. **Throughput under concurrency.** For 1, 4 and 16 concurrent gRPC clients (``run_concurrent``,
   unary ``specdec`` model) and each method (``ems``, ``ar``), N = max(2C, 8) requests are sent,
   prompts taken round-robin from a fixed list of 32 chat prompts (half extractive, where prompt
   lookup drafting helps, half open questions). Recorded: wall time, requests/s, tokens/s, mean
   per-request latency, mean acceptance rate and mean ``mean_batch_size`` (how many sequences shared
   a request's ragged steps). Methods and concurrencies are interleaved within each repeat and the
   median over repeats is reported. Greedy ``ems`` must reproduce greedy ``ar`` token for token; the
   mismatches are counted (not asserted).
2. **Added latency of the server path.** With one client, for a few prompts and both methods, the
   server's latency (unary ``infer``; and first response + total over ``specdec_stream``) against the
   local runtime doing the same single request in this process (``served_engine`` over the same
   config parameters as the server's engine; timed from ``engine.request`` to the end of ``engine.generate``,
   i.e. tokenization, decoding and detokenization). Server and local alternate per prompt.

How to run it (from the repository root)::

    python -m benchmarks.triton_serving [--export DIR] [--reps 2] [--max-tokens 64]

Without ``--export`` it exports SmolLM2-135M (``--max-batch 16 --max-len 1024``, ~45 s) into
``benchmarks/.cache/serving-export`` the first time and reuses it afterwards (``--force-export``
rebuilds it, e.g. after the serving configs changed). ``--concurrency 1 4`` and ``--out-dir`` exist
for smoke runs. Results: ``benchmarks/results/triton_serving.{md,json,png}``.

Why: the README quotes these numbers for what serving costs and gains over the local runtime: does
in-flight batching through Triton scale with clients, does ``ems`` keep its lead over ``ar`` when
requests of different clients share steps, and how many milliseconds the gRPC + Python-backend
pipeline (preprocessing -> engine -> postprocessing over BLS) adds to one request.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from specdec.bench.figures import figure
from specdec.bench.harness import machine_info, run_command, utc_stamp
from specdec.runtime.engine import Engine
from specdec.serving.client import Answer, ClientError, SpecdecClient, run_concurrent
from specdec.serving.engine_model import served_engine
from specdec.serving.repository import REPOSITORY_DIR, read_parameters
from specdec.serving.server import TritonServer, free_ports

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_EXPORT = ROOT / "benchmarks" / ".cache" / "serving-export"
DEFAULT_OUT = ROOT / "benchmarks" / "results"
TARGET = "smollm2-135m"
METHODS = ("ems", "ar")
CONCURRENCY = (1, 4, 16)

# Answers that copy spans of the prompt: prompt-lookup drafting should be accepted often here.
EXTRACTIVE = (
    "Repeat exactly: The quick brown fox jumps over the lazy dog near the river bank at dawn.",
    "Copy the list exactly, one item per line: apples, bananas, cherries, dates, elderberries, figs, grapes.",
    "Repeat exactly: Speculative decoding drafts several tokens cheaply and verifies them with the target "
    "model in one step.",
    'Copy this JSON exactly: {"name": "Ada", "age": 36, "city": "London", "languages": ["English", "French"]}',
    "Copy the list exactly: Monday, Tuesday, Wednesday, Thursday, Friday, Saturday, Sunday.",
    "Repeat this sentence three times: Triton serves many clients at once.",
    "Copy the Python code exactly:\ndef add(a, b):\n    return a + b\n\ndef mul(a, b):\n    return a * b",
    "Extract the email addresses from this text: Contact alice@example.com or bob@example.org for details, "
    "or write to carol@example.net.",
    "Copy the numbers exactly: 3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4.",
    "Repeat exactly: To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer "
    "the slings and arrows of outrageous fortune.",
    "Copy the shopping list exactly: 2 eggs, 1 litre of milk, 500 g of flour, 200 g of sugar, 1 lemon, "
    "100 g of butter.",
    "Quote the first sentence of this text exactly: The Python standard library is very extensive. It "
    "contains built-in modules written in C that provide access to system functionality.",
    "Copy the table exactly:\n| id | name | score |\n| 1 | Ana | 91 |\n| 2 | Ben | 78 |\n| 3 | Cleo | 85 |",
    "Repeat exactly: Red, orange, yellow, green, blue, indigo and violet are the colours of the rainbow.",
    "Copy the steps exactly: 1. Open the box. 2. Remove the device. 3. Plug it in. 4. Press the power "
    "button. 5. Wait for the green light.",
    "Extract the dates from this text: The project started on 3 March 2021, the first release was on "
    "15 June 2022, and version 2 shipped on 1 February 2024.",
)
# Free-form answers: little to copy, so drafts are rarely accepted.
OPEN = (
    "What is the capital of France, and why is it famous?",
    "Explain in two sentences what a hash table is.",
    "Write a short poem about the sea.",
    "Why is the sky blue?",
    "Give three tips for learning a new language.",
    "What is the difference between a list and a tuple in Python?",
    "Describe how a bicycle works.",
    "Tell me a fun fact about octopuses.",
    "What causes the seasons on Earth?",
    "Suggest a name for a coffee shop and explain it.",
    "How do vaccines work?",
    "Write a haiku about autumn leaves.",
    "What is machine learning, in simple words?",
    "Give me an idea for a quick dinner.",
    "Why do cats purr?",
    "Explain what an operating system does.",
)
# alternating, so every round-robin prefix mixes both kinds
PROMPTS = tuple(p for pair in zip(EXTRACTIVE, OPEN) for p in pair)


def ensure_export(directory: Path | None, force: bool) -> Path:
    """The export to serve: ``directory`` as given, or the cached default (exported when missing)."""
    if directory is not None:
        return directory
    if DEFAULT_EXPORT.exists() and not force:
        return DEFAULT_EXPORT
    from specdec.export.cli import main as export_main

    DEFAULT_EXPORT.parent.mkdir(parents=True, exist_ok=True)
    argv = ["--target", TARGET, "--out", str(DEFAULT_EXPORT), "--max-batch", "16", "--max-len", "1024"]
    if export_main([*argv, "--force"] if force else argv) != 0:
        raise SystemExit(f"export into {DEFAULT_EXPORT} failed")
    return DEFAULT_EXPORT


def request_params(method: str, max_tokens: int) -> dict[str, Any]:
    """What every request sends (num_draft_tokens is left to the server's default)."""
    return {"method": method, "max_tokens": max_tokens, "apply_chat_template": True, "temperature": 0.0}


# --------------------------------------------------------------------------- 1. throughput


def throughput_run(url: str, concurrency: int, method: str, max_tokens: int) -> tuple[dict[str, Any], list]:
    """One measurement: N requests from ``concurrency`` clients; its numbers and each answer's token ids."""
    n = max(2 * concurrency, 8)
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(n)]
    answers, wall = run_concurrent(url, prompts, concurrency, False, **request_params(method, max_tokens))
    ok = [a for a in answers if isinstance(a, Answer)]
    tokens = sum(len(a.output_ids) for a in ok)
    drafts = sum(a.draft_tokens for a in ok)
    row = {
        "concurrency": concurrency,
        "method": method,
        "requests": n,
        "errors": n - len(ok),
        "tokens": tokens,
        "wall_seconds": wall,
        "requests_per_second": len(ok) / wall,
        "tokens_per_second": tokens / wall,
        "mean_latency_seconds": statistics.fmean(a.seconds for a in ok) if ok else float("nan"),
        "mean_acceptance_rate": statistics.fmean(a.acceptance_rate for a in ok) if ok else float("nan"),
        "pooled_acceptance_rate": sum(a.accepted_draft_tokens for a in ok) / drafts if drafts else 0.0,
        "mean_batch_size": statistics.fmean(a.mean_batch_size for a in ok) if ok else float("nan"),
        "error_messages": sorted({str(a) for a in answers if isinstance(a, ClientError)}),
    }
    return row, [a.output_ids if isinstance(a, Answer) else None for a in answers]


def throughput(
    url: str, concurrencies: Sequence[int], reps: int, max_tokens: int, bar: tqdm
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Every (rep, C, method) run, interleaved; plus the ems-vs-ar token-identity check."""
    rows: list[dict[str, Any]] = []
    compared = mismatched = 0
    mismatches: list[dict[str, Any]] = []
    for rep in range(reps):
        for c in concurrencies:
            ids: dict[str, list] = {}
            for method in METHODS:
                bar.set_postfix_str(f"rep {rep + 1}/{reps}, {c} client(s), {method}")
                row, ids[method] = throughput_run(url, c, method, max_tokens)
                rows.append({"rep": rep, **row})
                bar.update()
            for i, (ems, ar) in enumerate(zip(ids["ems"], ids["ar"])):
                if ems is None or ar is None:
                    continue
                compared += 1
                if ems != ar:
                    mismatched += 1
                    mismatches.append({"rep": rep, "concurrency": c, "prompt": i % len(PROMPTS)})
    return rows, {"compared": compared, "mismatched": mismatched, "mismatches": mismatches}


def medians(rows: list[dict[str, Any]], concurrencies: Sequence[int]) -> list[dict[str, Any]]:
    """Per (C, method): the median over repeats of every number."""
    keys = (
        "wall_seconds",
        "requests_per_second",
        "tokens_per_second",
        "mean_latency_seconds",
        "mean_acceptance_rate",
        "pooled_acceptance_rate",
        "mean_batch_size",
        "tokens",
    )
    out = []
    for c in concurrencies:
        for method in METHODS:
            mine = [r for r in rows if r["concurrency"] == c and r["method"] == method]
            med = {k: statistics.median(r[k] for r in mine) for k in keys}
            out.append(
                {
                    "concurrency": c,
                    "method": method,
                    "requests": mine[0]["requests"],
                    "reps": len(mine),
                    "errors": sum(r["errors"] for r in mine),
                    **med,
                }
            )
    return out


# --------------------------------------------------------------------------- 2. added latency


def local_once(engine: Engine, prompt: str, method: str, max_tokens: int) -> tuple[float, list[int]]:
    start = time.perf_counter()
    result = engine.generate([engine.request(prompt, chat=True, max_tokens=max_tokens)], method)
    seconds = time.perf_counter() - start
    out = result.outputs[0]
    if out.error:
        raise RuntimeError(f"local runtime refused the request: {out.error}")
    return seconds, list(out.token_ids)


def server_once(client: SpecdecClient, prompt: str, method: str, max_tokens: int) -> tuple[Answer, Answer]:
    params = request_params(method, max_tokens)
    return client.generate(prompt, **params), client.generate_stream(prompt, **params)


def added_latency(url: str, engine: Engine, n_prompts: int, max_tokens: int, bar: tqdm) -> list[dict[str, Any]]:
    """One client; per prompt and method, the server path and the local runtime, in alternating order."""
    client = SpecdecClient(url)
    rows = []
    try:
        for i in range(n_prompts):
            prompt = PROMPTS[i % len(PROMPTS)]
            for method in METHODS:
                bar.set_postfix_str(f"latency: prompt {i + 1}/{n_prompts}, {method}")
                if i % 2 == 0:
                    unary, stream = server_once(client, prompt, method, max_tokens)
                    local_s, local_ids = local_once(engine, prompt, method, max_tokens)
                else:
                    local_s, local_ids = local_once(engine, prompt, method, max_tokens)
                    unary, stream = server_once(client, prompt, method, max_tokens)
                rows.append(
                    {
                        "prompt": i,
                        "method": method,
                        "order": "server first" if i % 2 == 0 else "local first",
                        "tokens": len(unary.output_ids),
                        "local_ms": local_s * 1000,
                        "unary_ms": unary.seconds * 1000,
                        "stream_first_ms": stream.first_response_seconds * 1000,
                        "stream_total_ms": stream.seconds * 1000,
                        "stream_responses": stream.responses,
                        "identical_to_local": unary.output_ids == local_ids and stream.output_ids == local_ids,
                    }
                )
                bar.update()
    finally:
        client.close()
    return rows


def latency_summary(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    summary = {}
    for method in METHODS:
        mine = [r for r in rows if r["method"] == method]
        mean = {
            k: statistics.fmean(r[k] for r in mine)
            for k in ("local_ms", "unary_ms", "stream_first_ms", "stream_total_ms", "tokens")
        }
        summary[method] = {
            "prompts": len(mine),
            **mean,
            "added_unary_ms": mean["unary_ms"] - mean["local_ms"],
            "added_stream_ms": mean["stream_total_ms"] - mean["local_ms"],
            "unary_over_local": mean["unary_ms"] / mean["local_ms"],
            "stream_over_local": mean["stream_total_ms"] / mean["local_ms"],
            "identical_to_local": sum(r["identical_to_local"] for r in mine),
        }
    return summary


# --------------------------------------------------------------------------- reports


def markdown(doc: dict[str, Any]) -> str:
    cfg, table, same = doc["config"], doc["throughput"]["median"], doc["throughput"]["ems_vs_ar"]
    m = doc["machine"]
    lines = [
        "# Speculative decoding through Triton (SmolLM2-135M, CPU)",
        "",
        f"- Date: {doc['date']}  ",
        f"- Command: `{doc['command']}` (total {doc['total_seconds']:.0f} s)  ",
        f"- Machine: {m.get('processor')}, {m['cpu_count']} cores, {m.get('platform')}; "
        f"load average {m.get('load_average')} before, {doc['load_average_after']} after  ",
        f"- Server: {doc['server']['binary']} ({doc['server']['source']}); export `{cfg['export']}` "
        f"(max_batch {cfg['export_max_batch']}, max_len {cfg['export_max_len']}, ONNX Runtime, all cores)  ",
        f"- Requests: {len(PROMPTS)} chat prompts (half extractive, half open questions), round-robin; "
        f"greedy, max_tokens {cfg['max_tokens']}, num_draft_tokens = server default, unary `specdec` model; "
        "C clients send N = max(2C, 8) requests  ",
        f"- Timing: median of {cfg['reps']} interleaved repeat(s); latency includes the client's gRPC call",
        "",
        "## Throughput",
        "",
        "| clients | method | requests | requests/s | tokens/s | mean latency (s) | acceptance | mean batch | errors |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in table:
        lines.append(
            f"| {r['concurrency']} | {r['method']} | {r['requests']} | {r['requests_per_second']:.2f} | "
            f"{r['tokens_per_second']:.1f} | {r['mean_latency_seconds']:.2f} | "
            f"{r['mean_acceptance_rate']:.2f} | {r['mean_batch_size']:.2f} | {r['errors']} |"
        )
    lines += ["", "| clients | ems / ar tokens/s |", "|---:|---:|"]
    for c, ratio in doc["throughput"]["ems_over_ar"].items():
        lines.append(f"| {c} | {ratio:.2f}× |")
    lines += [
        "",
        f"ems vs ar outputs (greedy, same prompt): {same['compared'] - same['mismatched']} of "
        f"{same['compared']} answers token-identical, {same['mismatched']} mismatch(es).",
        "",
        "Acceptance is the mean of the per-request acceptance rates; mean batch is the mean of each "
        "request's `mean_batch_size` (sequences sharing its ragged steps). Served `ar` is EMS-SD with no "
        "drafts, sharing the engine's steps at one row per sequence.",
        "",
        "## Added latency of the server path (1 client)",
        "",
        "| method | prompts | tokens | local (ms) | server unary (ms) | added (ms) | unary / local | "
        "stream first response (ms) | stream total (ms) | stream added (ms) | identical to local |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for method, s in doc["latency"]["summary"].items():
        lines.append(
            f"| {method} | {s['prompts']} | {s['tokens']:.1f} | {s['local_ms']:.0f} | {s['unary_ms']:.0f} | "
            f"{s['added_unary_ms']:+.0f} | {s['unary_over_local']:.2f}× | {s['stream_first_ms']:.0f} | "
            f"{s['stream_total_ms']:.0f} | {s['added_stream_ms']:+.0f} | "
            f"{s['identical_to_local']}/{s['prompts']} |"
        )
    lines += [
        "",
        "Local: the served engine's twin in the benchmark process (`served_engine` over the same "
        "config parameters: threads, k, adaptive draft length and its prices), timed from "
        "`engine.request` to the end of `engine.generate` (tokenize, decode, detokenize; local `ar` "
        "runs the `ar` loop). Server and local alternate per prompt; means over prompts.",
    ]
    return "\n".join(lines) + "\n"


def plot(doc: dict[str, Any], path: Path) -> None:
    with figure(path, 1, 2, figsize=(11, 4)) as (fig, (left, right)):
        table = doc["throughput"]["median"]
        for method in METHODS:
            rows = [r for r in table if r["method"] == method]
            left.plot(
                [r["concurrency"] for r in rows], [r["tokens_per_second"] for r in rows], marker="o", label=method
            )
        cs = sorted({r["concurrency"] for r in table})
        left.set_xscale("log", base=2)
        left.set_xticks(cs, [str(c) for c in cs])
        left.set_xlabel("concurrent clients")
        left.set_ylabel("tokens/s")
        left.set_title("Throughput through Triton")
        left.legend()
        summary = doc["latency"]["summary"]
        width = 0.35
        for j, (key, label) in enumerate((("added_unary_ms", "unary"), ("added_stream_ms", "stream (total)"))):
            right.bar(
                [i + j * width for i in range(len(summary))], [s[key] for s in summary.values()], width, label=label
            )
        right.set_xticks([i + width / 2 for i in range(len(summary))], list(summary))
        right.axhline(0, color="black", linewidth=0.8)
        right.set_ylabel("server - local (ms per request)")
        right.set_title("Added latency of the server path (1 client)")
        right.legend()
        fig.suptitle(
            f"SmolLM2-135M, greedy, max_tokens {doc['config']['max_tokens']}, {doc['machine']['cpu_count']} CPU cores"
        )


# --------------------------------------------------------------------------- main


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--export",
        type=Path,
        help=f"export directory to serve (default: {DEFAULT_EXPORT}, exported there when missing)",
    )
    parser.add_argument("--force-export", action="store_true", help="re-export the default cached export")
    parser.add_argument("--reps", type=int, default=2, help="repeats of the throughput runs (median reported)")
    parser.add_argument("--max-tokens", type=int, default=64, help="new tokens per request at most")
    parser.add_argument(
        "--concurrency",
        type=int,
        nargs="+",
        default=list(CONCURRENCY),
        help="concurrent clients to measure (default: 1 4 16)",
    )
    parser.add_argument("--latency-prompts", type=int, default=6, help="prompts of the added-latency comparison")
    parser.add_argument("--out-dir", type=Path, default=DEFAULT_OUT, help="where triton_serving.* go")
    parser.add_argument("--ready-timeout", type=float, default=600.0, help="seconds to wait for the server")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    command = run_command("benchmarks.triton_serving", argv)
    machine = {**machine_info(), "cpu_count": os.cpu_count()}
    date = utc_stamp()
    export_dir = ensure_export(args.export, args.force_export).resolve()
    manifest = json.loads((export_dir / "manifest.json").read_text())
    server = TritonServer()
    grpc, http, metrics = free_ports()
    try:
        server.start(export_dir, grpc_port=grpc, http_port=http, metrics_port=metrics, exit_timeout_s=20)
        print(
            f"tritonserver starting ({server.install.source}); log: {server.log_file}",  # type: ignore[union-attr]
            file=sys.stderr,
            flush=True,
        )
        server.wait_ready(args.ready_timeout)
        url = server.grpc_url
        for method in METHODS:  # warm-up: first ONNX Runtime runs, gRPC channels, Python-backend threads
            run_concurrent(url, PROMPTS[:4], 4, False, **request_params(method, args.max_tokens))
        total = args.reps * len(args.concurrency) * len(METHODS) + args.latency_prompts * len(METHODS)
        with tqdm(total=total, desc="triton serving", unit="run") as bar:
            rows, same = throughput(url, args.concurrency, args.reps, args.max_tokens, bar)
            bar.set_postfix_str("loading the local engine")
            engine = served_engine(export_dir, read_parameters(export_dir / REPOSITORY_DIR))
            local_once(engine, PROMPTS[0], "ems", args.max_tokens)  # warm-up
            latency_rows = added_latency(url, engine, args.latency_prompts, args.max_tokens, bar)
        server_info = {"binary": str(server.install.binary), "source": server.install.source}  # type: ignore[union-attr]
    finally:
        code = server.stop()
        print(f"tritonserver stopped (exit code {code})", file=sys.stderr, flush=True)
    table = medians(rows, args.concurrency)
    tps = {(r["concurrency"], r["method"]): r["tokens_per_second"] for r in table}
    doc = {
        "date": date,
        "command": command,
        "machine": machine,
        "load_average_after": [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None,
        "total_seconds": time.perf_counter() - started,
        "server": {**server_info, "exit_code": code},
        "config": {
            "target": TARGET,
            "export": str(export_dir),
            "export_max_batch": manifest.get("max_batch"),
            "export_max_len": manifest.get("max_len"),
            "reps": args.reps,
            "max_tokens": args.max_tokens,
            "concurrency": args.concurrency,
            "latency_prompts": args.latency_prompts,
            "prompts": list(PROMPTS),
        },
        "throughput": {
            "median": table,
            "raw": rows,
            "ems_vs_ar": same,
            "ems_over_ar": {str(c): tps[(c, "ems")] / tps[(c, "ar")] for c in args.concurrency},
        },
        "latency": {"summary": latency_summary(latency_rows), "raw": latency_rows},
    }
    out = args.out_dir
    out.mkdir(parents=True, exist_ok=True)
    (out / "triton_serving.json").write_text(json.dumps(doc, indent=2) + "\n")
    text = markdown(doc)
    (out / "triton_serving.md").write_text(text)
    plot(doc, out / "triton_serving.png")
    print(text)
    print(f"wrote {out}/triton_serving.{{md,json,png}}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""How the served deployment behaves over time and under faults: a bounded soak (R17) and recovery (R1-R3).

What it runs, against a real ``specdec serve`` (the CLI, so its supervision restarts what dies) on free loopback
ports over an existing export, with tritonclient over gRPC:

1. **Recovery.** The cold start (process start to ready), then three faults, each followed by: how long until
   readiness is refused (HTTP), how long until it is ready again, and until the next request succeeds with the
   same greedy answer: the engine's stub SIGKILLed while idle, the engine's stub SIGKILLed under a stream, and
   tritonserver itself SIGKILLed. The issue's bar: detected within 1 s, serving again within cold start + 20 %.
2. **Limits.** One good request's latency alone, then beside a 4 MB prompt (refused by the entry point's size
   limit before anything is tokenized): how long the refusal took and how much the good request was delayed.
3. **Soak.** ``--requests`` (1,000) mixed requests from 8 client threads: greedy ``ems`` and ``ar``, unary and
   streamed, 8-32 new tokens, and every tenth cancelled by its client at a random point (before the first token
   or mid-stream). Every completed answer is compared with the local runtime's answer for the same prompt and
   length (greedy: one exact reference each). Recorded: unexpected errors, mixed-up outputs, the KV slots and
   queue after the run (must be back to 0), the /dev/shm regions and free bytes before and after, and the RSS
   of tritonserver and of each Python-backend stub after a warm-up (the first 10 %) and at the end: the growth
   per request.

How to run it (from the repository root, on an otherwise idle machine)::

    python -m benchmarks.reliability --export benchmarks/.cache/edge/fp32 [--requests 1000]

The export must hold a Triton repository (``specdec-export ... --out DIR`` writes one). Results:
``benchmarks/results/reliability.{md,json,png}``.

Why: the issue's acceptance asks for a soak with 0 unexpected errors, 0 mixed-up outputs, slots and shared
memory back to baseline and the RSS growth per request stated, and for recovery within cold start + 20 %; a test
on a 2-core machine shared with other jobs can check that recovery happens, not how fast, so the timing lives here.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from specdec.bench.figures import figure
from specdec.bench.harness import machine_info, run_command, utc_stamp
from specdec.bench.workloads import SHORT_PROMPTS
from specdec.models.manifest import read_manifest
from specdec.runtime.config import EngineConfig
from specdec.runtime.costs import DraftCosts
from specdec.runtime.engine import Engine
from specdec.serving.client import Answer, ClientError, SpecdecClient
from specdec.serving.processes import children, stub_pids
from specdec.serving.repository import MODELS, ServingOptions, write_repository
from specdec.serving.server import free_ports, http_ready

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "benchmarks" / "results"
PROMPTS = SHORT_PROMPTS[:12]
LENGTHS = (8, 16, 32)
SHM = Path("/dev/shm")


@dataclass
class Serve:
    """A running ``specdec serve`` and its addresses."""

    proc: subprocess.Popen[str]
    grpc: str
    http: str
    metrics: str
    started_s: float  # process start to its "ready" line

    def server_pid(self) -> int:
        (pid,) = [p for p in children(self.proc.pid) if "tritonserver" in _cmdline(p)]
        return pid


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def start_serve(repo: Path, log: Path) -> Serve:
    grpc, http, metrics = free_ports()
    code = "import sys; from specdec.serving.serve import serve_main; sys.exit(serve_main(sys.argv[1:]))"
    begun = time.monotonic()
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
            "--drain-timeout",
            "120",
            "--max-restarts",
            "10",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("(Ctrl-C"):
            return Serve(
                proc,
                f"127.0.0.1:{grpc}",
                f"http://127.0.0.1:{http}",
                f"http://127.0.0.1:{metrics}/metrics",
                time.monotonic() - begun,
            )
    raise SystemExit(f"specdec serve did not get ready: {proc.stderr.read() if proc.stderr else ''}")


def scrape(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url, timeout=30) as resp:
        text = resp.read().decode()
    return {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line and not line.startswith("#")
    }


def wait_for(condition: Any, timeout: float = 600.0, poll_s: float = 0.02) -> float:
    """Seconds until ``condition()`` holds (raises past ``timeout``)."""
    begun = time.monotonic()
    while not condition():
        if time.monotonic() - begun > timeout:
            raise TimeoutError("condition never held")
        time.sleep(poll_s)
    return time.monotonic() - begun


def references(export: Path) -> dict[tuple[str, int], list[int]]:
    engine = Engine.from_export(export, config=EngineConfig(threads=2))
    keys = [(p, n) for p in PROMPTS for n in LENGTHS]
    outputs = engine.generate([engine.request(p, chat=True, max_tokens=n) for p, n in keys], "ems").outputs
    return {key: out.token_ids for key, out in zip(keys, outputs)}


def recovery(serve: Serve, refs: dict[tuple[str, int], list[int]]) -> list[dict[str, Any]]:
    rows = []
    probe = (PROMPTS[0], LENGTHS[1])
    for name, busy, engine in (
        ("engine stub SIGKILL, idle", False, True),
        ("engine stub SIGKILL, under a stream", True, True),
        ("tritonserver SIGKILL", True, False),
    ):
        server = serve.server_pid()
        victim = stub_pids(server, "specdec_engine")[0] if engine else server
        stream = None
        if busy:
            stream = iter(SpecdecClient(serve.grpc).stream(PROMPTS[1], max_tokens=200, apply_chat_template=True))
            next(stream)
        killed = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        detected = wait_for(lambda: not http_ready(serve.http))
        stream_error = ""
        if stream is not None:
            try:
                for _ in stream:
                    pass
            except ClientError as exc:
                stream_error = exc.status or "in band"
        back = wait_for(lambda: http_ready(serve.http)) + detected
        answer = SpecdecClient(serve.grpc).generate(probe[0], max_tokens=probe[1], apply_chat_template=True)
        rows.append(
            {
                "fault": name,
                "not_ready_after_s": detected,
                "ready_again_after_s": back,
                "first_answer_after_s": time.monotonic() - killed,
                "stream_ended_with": stream_error,
                "same_answer": answer.output_ids == refs[probe],
                "vs_cold_start": back / serve.started_s,
            }
        )
    return rows


def limits(serve: Serve, refs: dict[tuple[str, int], list[int]]) -> dict[str, float]:
    good = (PROMPTS[2], LENGTHS[1])
    client = SpecdecClient(serve.grpc)

    def timed(prompt: str, n: int) -> tuple[float, Answer | ClientError]:
        begun = time.perf_counter()
        try:
            answer: Answer | ClientError = client.generate(prompt, max_tokens=n, apply_chat_template=True)
        except ClientError as exc:
            answer = exc
        return time.perf_counter() - begun, answer

    timed(*good)  # warm-up: ONNX Runtime's first runs of new shapes are slow, and this runs right after the start
    alone = min(timed(*good)[0] for _ in range(3))
    with ThreadPoolExecutor(2) as pool:
        huge = pool.submit(lambda: (time.perf_counter(), timed("x" * (4 << 20), 8)))
        beside = pool.submit(timed, *good)
        sent, (_, refused) = huge.result()
        refused_s = time.perf_counter() - sent
        beside_s, answer = beside.result()
    assert isinstance(refused, ClientError), refused
    assert isinstance(answer, Answer) and answer.output_ids == refs[good], (answer, refs[good])
    return {
        "good_alone_s": alone,
        "good_beside_4mb_s": beside_s,
        "refusal_s": refused_s,
        "refusal_status": refused.status or "",
    }


def soak(serve: Serve, refs: dict[tuple[str, int], list[int]], n: int, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    plan = [
        (
            rng.choice(PROMPTS),
            rng.choice(LENGTHS),
            rng.choice(("ems", "ar")),
            rng.random() < 0.5,
            rng.choice(("before", "mid")) if i % 10 == 9 else "",
        )
        for i in range(n)
    ]
    server = serve.server_pid()
    pids = {"tritonserver": server, **{f"stub {model}": stub_pids(server, model)[0] for model in MODELS}}
    shm_before = ({p.name for p in SHM.iterdir()}, os.statvfs(SHM).f_bavail * os.statvfs(SHM).f_frsize)
    outcome: Counter[str] = Counter()
    rss: dict[str, list[int]] = {name: [] for name in pids}
    lock, done = threading.Lock(), [0]
    warm = max(1, n // 10)

    def one(step: tuple[str, int, str, bool, str]) -> None:
        prompt, length, method, stream, cancel = step
        client = SpecdecClient(serve.grpc)
        try:
            if cancel:
                it = iter(client.stream(prompt, max_tokens=length, apply_chat_template=True, method=method))
                if cancel == "mid":
                    next(it)
                it.close()  # leaves the stream early: the client cancels it
                result = "cancelled"
            else:
                call = client.generate_stream if stream else client.generate
                answer = call(prompt, max_tokens=length, apply_chat_template=True, method=method)
                result = "exact" if answer.output_ids == refs[(prompt, length)] else "MIXED-UP"
        except (ClientError, StopIteration) as exc:
            result = "cancelled" if cancel else f"ERROR {exc}"
        with lock:
            outcome[result if not result.startswith("ERROR") else "unexpected error"] += 1
            done[0] += 1
            if done[0] in (warm, n):
                for name, pid in pids.items():
                    rss[name].append(_rss_kib(pid))

    begun = time.monotonic()
    with ThreadPoolExecutor(8) as pool:
        list(tqdm(pool.map(one, plan), total=n, desc="soak", unit="req"))
    seconds = time.monotonic() - begun
    wait_for(
        lambda: all(
            v == 0
            for k, v in scrape(serve.metrics).items()
            if k.split("{")[0]
            in (
                "specdec_kv_slots_used",
                "specdec_queued_requests",
                "specdec_active_sequences",
                "specdec_inflight_requests",
            )
        ),
        120,
    )
    after: dict[str, float] = {}
    for key, value in scrape(serve.metrics).items():  # summed over engine instances
        after[key.split("{")[0]] = after.get(key.split("{")[0], 0.0) + value
    shm_after = ({p.name for p in SHM.iterdir()}, os.statvfs(SHM).f_bavail * os.statvfs(SHM).f_frsize)
    growth = {name: (v[-1] - v[0]) * 1024 / max(1, n - warm) for name, v in rss.items() if len(v) == 2}
    return {
        "requests": n,
        "seconds": seconds,
        "outcomes": dict(outcome),
        "rss_kib": rss,
        "rss_growth_bytes_per_request": growth,
        "kv_slots_after": after.get("specdec_kv_slots_used", -1),
        "queued_after": after.get("specdec_queued_requests", -1),
        "shm_regions_added": sorted(shm_after[0] - shm_before[0]),
        "shm_free_bytes_change": shm_after[1] - shm_before[1],
    }


def report(result: dict[str, Any], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "reliability.json").write_text(json.dumps(result, indent=2))
    s = result["soak"]
    lines = [
        "# Reliability: recovery, limits and a bounded soak through a real Triton server",
        "",
        f"- Date: {result['date']}",
        f"- Command: `{result['command']}`",
        f"- Machine: {result['machine']}",
        f"- Load average before / after: {result['load_before']} / {result['load_after']}",
        f"- Cold start of `specdec serve` (process start to ready): **{result['cold_start_s']:.1f} s**",
        "",
        "## Recovery (R1-R3): `specdec serve` supervising one tritonserver",
        "",
        "| fault | not ready after | ready again after | ÷ cold start | next answer after | stream ended with |"
        " same answer |",
        "|:---|---:|---:|---:|---:|:---|:---|",
    ]
    for r in result["recovery"]:
        lines.append(
            f"| {r['fault']} | {r['not_ready_after_s']:.2f} s | {r['ready_again_after_s']:.1f} s | "
            f"{r['vs_cold_start']:.2f} | {r['first_answer_after_s']:.1f} s | {r['stream_ended_with'] or '–'} "
            f"| {r['same_answer']} |"
        )
    lim = result["limits"]
    lines += [
        "",
        "## Limits: a 4 MB prompt beside a good request",
        "",
        f"- good request alone: {lim['good_alone_s'] * 1000:.0f} ms; beside the 4 MB prompt: "
        f"{lim['good_beside_4mb_s'] * 1000:.0f} ms",
        f"- the 4 MB prompt refused after {lim['refusal_s'] * 1000:.0f} ms with {lim['refusal_status']}",
        "",
        f"## Soak (R17): {s['requests']} mixed requests, 8 clients, {s['seconds']:.0f} s",
        "",
        "| outcome | requests |",
        "|:---|---:|",
    ]
    lines += [f"| {k} | {v} |" for k, v in sorted(s["outcomes"].items())]
    lines += [
        "",
        "| process | RSS after warm-up (MiB) | RSS at the end (MiB) | growth per request (bytes) |",
        "|:---|---:|---:|---:|",
    ]
    for name, values in s["rss_kib"].items():
        lines.append(
            f"| {name} | {values[0] / 1024:.1f} | {values[-1] / 1024:.1f} | "
            f"{s['rss_growth_bytes_per_request'][name]:.0f} |"
        )
    lines += [
        "",
        f"- KV slots used after the soak: {s['kv_slots_after']:.0f}; queued: {s['queued_after']:.0f}",
        f"- /dev/shm regions added: {s['shm_regions_added'] or 'none'}; free bytes change: "
        f"{s['shm_free_bytes_change']}",
        "- *exact*: token ids equal the local runtime's greedy answer for the same prompt and length; "
        "*cancelled*: the client left the stream (before its first token or after it); *MIXED-UP* would be "
        "an answer that differs; *unexpected error* any error of a request that was not cancelled.",
        "- RSS is sampled after the first 10 % of the requests (warm-up: caches, allocator pools) and at the "
        "end; growth per request = the difference / the requests between. reliability.md's R17 bars: "
        "tritonserver <= 64 bytes per request on average, each stub < 50 MB in total.",
    ]
    (out / "reliability.md").write_text("\n".join(lines) + "\n")
    with figure(out / "reliability.png", 1, 2, figsize=(11, 4), dpi=110) as (_, (ax1, ax2)):
        names = [r["fault"] for r in result["recovery"]]
        ax1.barh(names, [r["ready_again_after_s"] for r in result["recovery"]], label="ready again")
        ax1.axvline(result["cold_start_s"] * 1.2, color="red", linestyle="--", label="cold start + 20 %")
        ax1.set_xlabel("seconds after the kill")
        ax1.legend(fontsize=8)
        ax1.set_title("recovery")
        procs = list(s["rss_kib"])
        ax2.bar(procs, [s["rss_growth_bytes_per_request"][p] for p in procs])
        ax2.set_ylabel("RSS growth per request (bytes)")
        ax2.set_title(f"soak: {s['requests']} requests")
        ax2.tick_params(axis="x", rotation=30, labelsize=7)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--export", type=Path, required=True, help="an export directory with its triton_repo")
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=17)
    parser.add_argument("--out-dir", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    load_before = [round(x, 2) for x in os.getloadavg()]
    refs = references(args.export)
    work = Path(tempfile.mkdtemp(prefix="specdec-reliability-"))
    log = work / "server.log"
    # a repository written by this code (an older export's own may lack outputs the models now send), with the
    # served defaults priced by the export's calibration
    calibration = read_manifest(args.export, verify=False).get("calibration")
    options = ServingOptions(adaptive_draft=True)
    if calibration:
        options = options.priced(DraftCosts(calibration["draft_cost"], calibration["verify_cost"], ()))
    serve = start_serve(write_repository(args.export, work / "triton_repo", options), log)
    try:
        result = {
            "date": utc_stamp(),
            "command": run_command("benchmarks.reliability", argv),
            "machine": machine_info(),
            "cold_start_s": serve.started_s,
            "load_before": load_before,
        }
        result["limits"] = limits(serve, refs)
        result["soak"] = soak(serve, refs, args.requests, args.seed)
        result["recovery"] = recovery(serve, refs)
    finally:
        serve.proc.send_signal(signal.SIGINT)
        serve.proc.wait(300)
        shutil.rmtree(work, ignore_errors=True)
    result["load_after"] = [round(x, 2) for x in os.getloadavg()]
    report(result, args.out_dir)
    print((args.out_dir / "reliability.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The load generator, NVIDIA's ``aiperf`` from PyPI, kept in a virtual environment of its own under ``.work/``
(its pins are not the project's, and it is no dependency of the package): installing it, writing the prompts
it sends, the ``aiperf profile`` command of one run, and reading the numbers back from its JSON export.

One ``aiperf profile`` run is one engine at one concurrency: ``--concurrency C`` keeps C requests in flight (the
next starts when one ends), ``--request-count`` bounds the run, the prompts come from a ``single_turn`` JSONL file
in file order (``--dataset-sampling-strategy sequential``: every engine gets the same requests), each with its
own output budget, streamed (TTFT and inter-token latency need the chunks), the token counts the server reports
(``usage``), and the engine's own body fields (specdec's ``method``, llama-server's ``cache_prompt``) through
``--extra-inputs``.

aiperf's inter-token latency of a request is ``(latency - TTFT) / (output tokens - 1)``: one number per request
whatever the chunking, so a speculative engine that streams several tokens in a chunk is measured as fairly as
one that streams a token per chunk; its p50 / p99 are over the requests of the run.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from benchmarks.peers.protocol import REPO

#: what this benchmark was written and smoke-tested against (the JSON export's schema 1.4)
AIPERF_PIN = "aiperf==0.13.0"
DEFAULT_VENV = REPO / ".work" / "loadgen" / "venv"
STAMP = ".installed"
#: the fields one row of the report takes from aiperf's ``profile_export_aiperf.json``
LATENCIES = {"ttft": "time_to_first_token", "itl": "inter_token_latency"}


def aiperf_bin(venv: Path) -> Path:
    return venv / "bin" / "aiperf"


def ensure_aiperf(venv: Path = DEFAULT_VENV, base_python: str | None = None) -> Path:
    """The ``aiperf`` executable of ``venv``, the venv created and ``AIPERF_PIN`` installed first when its stamp
    (``pip freeze`` of a finished install) is missing. Idempotent: ``rm -r`` the venv to redo it."""
    exe = aiperf_bin(venv)
    if (venv / STAMP).is_file() and exe.is_file():
        return exe
    python = base_python or shutil.which("python3") or sys.executable
    log = venv.parent / "install.log"
    print(f"installing {AIPERF_PIN} into {venv} (once; a few minutes; log: {log})", file=sys.stderr, flush=True)
    if venv.exists():
        shutil.rmtree(venv)
    venv.parent.mkdir(parents=True, exist_ok=True)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet"]
    with log.open("w", encoding="utf-8") as out:
        for step in ([python, "-m", "venv", str(venv)], [*pip, "--upgrade", "pip"], [*pip, AIPERF_PIN]):
            if subprocess.run(step, stdout=out, stderr=subprocess.STDOUT, check=False).returncode != 0:
                tail = log.read_text(encoding="utf-8", errors="replace")[-1500:]
                raise RuntimeError(f"installing aiperf failed at `{' '.join(step)}` (log: {log}):\n{tail}")
    freeze = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "freeze"], capture_output=True, text=True)
    (venv / STAMP).write_text(freeze.stdout, encoding="utf-8")
    return exe


def write_dataset(path: Path, prompts: Sequence[str], max_tokens: int) -> Path:
    """The prompts as aiperf's ``single_turn`` JSONL: one user turn each, each with the output budget."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps({"text": prompt, "output_length": max_tokens}) for prompt in prompts]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


#: requests/s that aiperf may start at most, far above what a concurrency level here needs (a CPU engine answers a
#: few per second): with ``--concurrency`` alone aiperf 0.13's rate loop polls for a free slot without sleeping
#: (``timing_manager`` at ~95 % of a core), and on 2 cores llama-server's spinning threads then collapse (151 s for
#: one 140-token answer); at this rate it looks every 10 ms instead, a new request starting at most that late
SLOT_POLL_RATE = 100


def profile_command(
    exe: Path,
    *,
    url: str,
    model: str,
    tokenizer: Path,
    dataset: Path,
    concurrency: int,
    requests: int,
    warmup: int,
    extra: Mapping[str, Any],
    artifacts: Path,
) -> list[str]:
    """The ``aiperf profile`` command of one engine at one concurrency.

    ``--use-legacy-max-tokens``: the budget goes as ``max_tokens``, the field every engine here reads (aiperf's
    default is ``max_completion_tokens``). One worker and one record processor, no polling of the server's
    ``/metrics`` nor of GPU telemetry: aiperf's own processes share the CPU with the engine under test, so it runs
    as little as keeps up with a CPU engine's pace. ``--request-rate SLOT_POLL_RATE`` beside ``--concurrency``: why,
    ``SLOT_POLL_RATE``.
    """
    cmd = [
        str(exe),
        "profile",
        "--model",
        model,
        "--url",
        url,
        "--endpoint-type",
        "chat",
        "--streaming",
        "--tokenizer",
        str(tokenizer),
        "--input-file",
        str(dataset),
        "--custom-dataset-type",
        "single_turn",
        "--dataset-sampling-strategy",
        "sequential",
        "--concurrency",
        str(concurrency),
        "--request-rate",
        str(SLOT_POLL_RATE),
        "--request-rate-mode",
        "constant",
        "--request-count",
        str(requests),
        "--use-legacy-max-tokens",
        "--use-server-token-count",
        "--extra-inputs",
        json.dumps(dict(extra), sort_keys=True),
        "--artifact-dir",
        str(artifacts),
        "--ui-type",
        "none",
        "--workers-max",
        "1",
        "--record-processors",
        "1",
        "--no-server-metrics",
        "--no-gpu-telemetry",
    ]
    return cmd + (["--warmup-request-count", str(warmup)] if warmup > 0 else [])


def aiperf_env() -> dict[str, str]:
    """aiperf's environment: ``HF_HUB_OFFLINE`` removed, because aiperf 0.13's offline mode looks a local
    tokenizer directory up as a Hub snapshot and fails; online mode loads a local directory without asking the
    Hub (its alias lookup skips local paths), so nothing leaves the machine either way."""
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    env["HF_HUB_DISABLE_TELEMETRY"] = "1"
    return env


def export_from_records(lines: Sequence[str]) -> dict[str, Any]:
    """An export holding only the error summary of aiperf's per-request records (``profile_export.jsonl``): what is
    left when every request of a run failed, where aiperf exits 1 and writes no JSON export."""
    counts: dict[tuple[Any, Any, str], int] = {}
    for line in lines:
        error = json.loads(line).get("error") if line.strip() else None
        if error:
            key = (error.get("code"), error.get("type"), str(error.get("message", "")))
            counts[key] = counts.get(key, 0) + 1
    summary = [{"error_details": {"code": c, "type": t, "message": m}, "count": n} for (c, t, m), n in counts.items()]
    return {"error_summary": summary, "is_complete": True, "was_cancelled": False}


def run_profile(cmd: Sequence[str], artifacts: Path, timeout_s: float) -> dict[str, Any]:
    """Run one ``aiperf profile`` and return its JSON export (or, when every request failed, the errors of its
    per-request records); its console output goes to ``artifacts``. Raises when aiperf left neither."""
    artifacts.mkdir(parents=True, exist_ok=True)
    log = artifacts / "aiperf.console.txt"
    with log.open("w", encoding="utf-8") as out:
        # its own session, so that a run past its time is ended with every service process aiperf started
        proc = subprocess.Popen(
            list(cmd), stdout=out, stderr=subprocess.STDOUT, env=aiperf_env(), start_new_session=True
        )
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise RuntimeError(f"aiperf did not finish within {timeout_s:.0f} s (console: {log})") from None
    export, records = artifacts / "profile_export_aiperf.json", artifacts / "profile_export.jsonl"
    if proc.returncode == 0 and export.is_file():
        return json.loads(export.read_text(encoding="utf-8"))
    if records.is_file():
        failed = export_from_records(records.read_text(encoding="utf-8").splitlines())
        if failed["error_summary"]:
            return failed
    tail = log.read_text(encoding="utf-8", errors="replace")[-1500:]
    raise RuntimeError(f"aiperf exited with {proc.returncode} (console: {log}):\n{tail}")


def _stat(export: Mapping[str, Any], name: str, key: str) -> float | None:
    value = (export.get(name) or {}).get(key)
    return None if value is None else float(value)


def summarize(export: Mapping[str, Any]) -> dict[str, Any]:
    """One run's numbers from aiperf's JSON export.

    ``tokens_per_s`` is aiperf's output token throughput: the output tokens of the successful requests (as the
    server counted them) over the run's duration, first request sent to last response received. A request that
    failed counts in ``errors`` (aiperf's error summary) and in none of the latencies. A run whose every request
    failed has no latency statistics: those are None.
    """
    errors = sum(int(e.get("count", 0)) for e in export.get("error_summary") or [])
    ok = int(_stat(export, "request_count", "avg") or 0)
    row: dict[str, Any] = {
        "requests": ok + errors,
        "errors": errors,
        "error_messages": sorted(
            {str((e.get("error_details") or {}).get("message", ""))[:200] for e in export.get("error_summary") or []}
        ),
        "tokens_per_s": _stat(export, "output_token_throughput", "avg"),
        "duration_s": _stat(export, "benchmark_duration", "avg"),
        "output_tokens_mean": _stat(export, "output_sequence_length", "avg"),
        "prompt_tokens_mean": _stat(export, "input_sequence_length", "avg"),
    }
    for short, name in LATENCIES.items():
        for p in ("p50", "p99"):
            row[f"{short}_{p}_ms"] = _stat(export, name, p)
    row["complete"] = bool(export.get("is_complete", True)) and not export.get("was_cancelled", False)
    return row


def version(exe: Path) -> str:
    out = subprocess.run([str(exe), "--version"], capture_output=True, text=True, env=aiperf_env(), check=False)
    return (out.stdout.strip().splitlines() or ["unknown"])[-1]

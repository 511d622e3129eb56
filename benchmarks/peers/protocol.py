"""How the benchmark process talks to a peer's process: a JSON spec file in, a JSON result file out.

Why files and a child process: each peer runs in a virtual environment of its own (its pins conflict with the
project's), so the benchmark (the project's venv) starts ``<peer venv>/bin/python -m benchmarks.peers.<runner>
--spec S --result R`` with the repository root on ``PYTHONPATH``. This module and the runners import only the
standard library and their own engine at the top, so they load in any of those environments.

A spec is ``{"task": "generate" | "score", ...}``; ``generate`` answers ``{"workloads": {name: {"tokens",
"seconds", "ttft", "ids", "texts", "prompt_ids"}}, "load_seconds", "versions"}`` and ``score`` answers
``{"forced": {name: {"picks", "margins"}}, "nll", "predicted"}`` (``check_result`` says what is missing). The
child adds its own peak RSS; a failure comes back as ``{"error": ...}`` with the tail of the child's log.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
#: what every ``generate`` workload and every ``score`` result must hold
GENERATE_KEYS = ("tokens", "seconds", "ttft", "ids", "texts", "prompt_ids")
SCORE_KEYS = ("forced", "nll", "predicted")


def peak_rss_mb(pid: int | str = "self") -> float:
    """A process's peak resident set (``VmHWM`` of /proc/<pid>/status), in MB; 0 where /proc is unreadable."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        pass
    return 0.0


def check_result(spec: dict[str, Any], result: dict[str, Any]) -> dict[str, Any]:
    """``result`` when it holds what ``spec``'s task promises; else an ``{"error": ...}`` naming the field."""
    if "error" in result:
        return result
    if spec["task"] == "generate":
        workloads = result.get("workloads")
        if not isinstance(workloads, dict) or set(workloads) != set(spec["prompts"]):
            return {"error": f"result.workloads: expected {sorted(spec['prompts'])}, got {sorted(workloads or {})}"}
        for name, w in workloads.items():
            missing = [k for k in GENERATE_KEYS if k not in w]
            if missing:
                return {"error": f"result.workloads.{name}: missing {', '.join(missing)}"}
            got, want = len(w["ids"]), len(spec["prompts"][name])
            if got != want:
                return {"error": f"result.workloads.{name}.ids: {got} answers for {want} prompts"}
    elif spec["task"] == "score":
        missing = [k for k in SCORE_KEYS if k not in result]
        if missing:
            return {"error": f"result: missing {', '.join(missing)}"}
        for name, pairs in spec["pairs"].items():
            picks = result["forced"].get(name, {}).get("picks")
            if picks is None or [len(p) for p in picks] != [len(a) for _, a in pairs]:
                return {"error": f"result.forced.{name}.picks: one pick per answer position expected"}
    else:
        return {"error": f"spec.task: unknown {spec['task']!r} (generate or score)"}
    return result


def run_peer(
    python: Path | str,
    module: str,
    spec: dict[str, Any],
    work: Path,
    name: str,
    timeout_s: float,
) -> dict[str, Any]:
    """Run ``python -m <module>`` (a runner such as ``benchmarks.peers.ortgenai``, under its peer venv's
    interpreter) on ``spec``; its result,
    checked, or ``{"error": ...}`` (a missing interpreter, a failed or timed-out child, a malformed result)."""
    if not Path(python).is_file():
        return {"error": f"not installed: {python} is missing (bash benchmarks/peers/install.sh)"}
    work.mkdir(parents=True, exist_ok=True)
    spec_path, result_path, log_path = (work / f"{name}.{ext}" for ext in ("spec.json", "result.json", "log"))
    spec_path.write_text(json.dumps(spec), encoding="utf-8")
    result_path.unlink(missing_ok=True)
    path = os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])
    env = {**os.environ, "PYTHONPATH": path, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    cmd = [str(python), "-m", module, "--spec", str(spec_path), "--result", str(result_path)]
    with log_path.open("w", encoding="utf-8") as log:
        try:
            rc: int | str = subprocess.run(
                cmd, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=timeout_s, check=False
            ).returncode
        except subprocess.TimeoutExpired:
            rc = f"timeout after {timeout_s:.0f} s"
    if rc == 0 and result_path.is_file():
        try:
            return check_result(spec, json.loads(result_path.read_text(encoding="utf-8")))
        except json.JSONDecodeError as exc:
            return {"error": f"result is not JSON: {exc} (log: {log_path})"}
    tail = log_path.read_text(encoding="utf-8", errors="replace").strip().splitlines()[-3:]
    why = rc if isinstance(rc, str) else f"killed by signal {-rc}" if rc < 0 else f"exit {rc}"
    return {"error": f"{why}: {' | '.join(tail) or 'no output'} (log: {log_path})"}


def child_main(tasks: dict[str, Callable[[dict[str, Any]], dict[str, Any]]], argv: Sequence[str] | None = None) -> int:
    """A runner's entry point: read the spec, run its task, write the result with this process's peak RSS."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--spec", type=Path, required=True)
    parser.add_argument("--result", type=Path, required=True)
    args = parser.parse_args(argv)
    spec = json.loads(args.spec.read_text(encoding="utf-8"))
    if spec.get("task") not in tasks:
        raise SystemExit(f"spec.task: {spec.get('task')!r} is not one of {sorted(tasks)}")
    result = tasks[spec["task"]](spec)
    result.setdefault("peak_rss_mb", peak_rss_mb())
    args.result.write_text(json.dumps(result), encoding="utf-8")
    return 0


def chunks(items: Sequence[Any], size: int) -> list[list[Any]]:
    """``items`` cut into batches of ``size`` (the last may be shorter)."""
    return [list(items[i : i + size]) for i in range(0, len(items), size)]


def answer(ids: Sequence[int], eos: Sequence[int]) -> list[int]:
    """An answer's tokens up to the first EOS, which is not counted (every engine stops there)."""
    out = []
    for t in ids:
        if int(t) in eos:
            break
        out.append(int(t))
    return out


def timed_workloads(
    spec: dict[str, Any],
    generate: Callable[[list[list[int]], int], tuple[list[list[int]], list[list[int]]]],
    decode: Callable[[list[int]], str],
) -> dict[str, Any]:
    """Every workload through ``generate(batch, max_new) -> (answers, prompt ids seen)``, batch by batch: the
    tokens, seconds and answers of the timed calls, and a separate one-token call per batch for the time to the
    first token (as the HF row measures it). A warm-up call comes first, untimed."""
    first = next(iter(spec["prompts"].values()))[0]
    generate([first], 4)
    out = {}
    for name, prompts in spec["prompts"].items():
        ttft, ids, seen, seconds = [], [], [], 0.0
        for batch in chunks(prompts, spec["batch"]):
            t0 = time.perf_counter()
            generate(batch, 1)
            ttft.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            answers, prompt_ids = generate(batch, spec["max_tokens"])
            texts = [decode(a) for a in answers]  # timed like the others' detokenisation
            seconds += time.perf_counter() - t0
            ids += answers
            seen += prompt_ids
            out.setdefault(name, {"texts": []})["texts"] += texts
        out[name].update(tokens=sum(map(len, ids)), seconds=seconds, ttft=ttft, ids=ids, prompt_ids=seen)
    return out

"""llama.cpp's own ``llama-server`` as a peer: built natively from the source the llama-cpp-python sdist vendors
(``install.sh``), started on a free 127.0.0.1 port, driven over HTTP, stopped afterwards.

Runs in the project's venv (it needs only the standard library and the binary): ``python -m
benchmarks.peers.llama_server --spec S --result R`` (``protocol``). A batch of B prompts is B concurrent
``/completion`` requests to a server with ``-np B`` slots, which it decodes together (continuous batching);
``spec["ngram"]`` adds its n-gram speculation (``--spec-type ngram-simple``). Prompts go in as token ids,
``cache_prompt`` off (every call prefills in full, as every other contestant does), greedy: temperature 0 and
every other sampler neutral. The server's report of the prompt tokens it evaluated is checked against the
ids sent; where they differ, the ids the server processed are read back with ``/tokenize``.

``score``: one request per position (``n_predict`` 1, the position's token forced with ``logit_bias`` so that
the prompt cache extends by exactly that token), ``n_probs`` 2 for the greedy choice and its margin (the
log-probabilities' difference is the logits' difference) and the forced token's log-probability from the raw
logits: the decode path generation takes, one token at a time.

Peak RSS is the server process's own (``VmHWM``), read before it is stopped.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from benchmarks.peers.fidelity import Top2, score_positions
from benchmarks.peers.protocol import answer, child_main, peak_rss_mb, timed_workloads

#: every sampler neutral: what is left is the greedy choice
GREEDY = {
    "temperature": 0.0,
    "top_k": 1,
    "top_p": 1.0,
    "min_p": 0.0,
    "typical_p": 1.0,
    "repeat_penalty": 1.0,
    "repeat_last_n": 0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "dry_multiplier": 0.0,
    "xtc_probability": 0.0,
    "mirostat": 0,
    "seed": 0,
}
READY_TIMEOUT_S = 180


def server_command(spec: dict[str, Any], port: int, slots: int) -> list[str]:
    """The ``llama-server`` command line of one run (the report records it); ``spec["extra_args"]``, if any, last."""
    cmd = [
        spec["server"],
        "-m",
        spec["gguf"],
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "-t",
        str(spec["threads"]),
        "-tb",
        str(spec["threads"]),
        "-np",
        str(slots),
        "-c",
        str(spec["max_len"] * slots),
        "--no-webui",
    ]
    if spec.get("ngram"):
        n, m = spec["ngram"]
        cmd += [
            "--spec-type",
            "ngram-simple",
            "--spec-ngram-simple-size-n",
            str(n),
            "--spec-ngram-simple-size-m",
            str(m),
        ]
    return cmd + [str(a) for a in spec.get("extra_args", [])]


def _post(port: int, path: str, body: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=600) as response:
        return json.loads(response.read())


@contextmanager
def running_server(spec: dict[str, Any], slots: int, log: Path) -> Iterator[tuple[int, subprocess.Popen]]:
    """A ready ``llama-server`` on a free port; stopped (and reaped) on exit, whatever happened."""
    from specdec.serving.server import free_ports

    port = free_ports(1)[0]
    with log.open("w", encoding="utf-8") as out:
        proc = subprocess.Popen(server_command(spec, port, slots), stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with {proc.returncode} before it was ready (log: {log})")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as response:
                    if response.status == 200:
                        break
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"llama-server not ready after {READY_TIMEOUT_S} s (log: {log})")
            time.sleep(0.2)
        yield port, proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def server_version(spec: dict[str, Any]) -> str:
    out = subprocess.run([spec["server"], "--version"], capture_output=True, text=True, check=False)
    return " ".join((out.stdout + out.stderr).split())


def generate(spec: dict[str, Any]) -> dict[str, Any]:
    """Greedy answers of every workload, a batch as concurrent requests to ``spec["batch"]`` slots."""
    log = Path(spec["work"]) / f"llama-server-{spec['name']}.log"
    start = time.perf_counter()
    with running_server(spec, spec["batch"], log) as (port, proc), ThreadPoolExecutor(spec["batch"]) as pool:
        load_seconds = time.perf_counter() - start
        eos = spec["eos"]
        drafted = accepted = 0

        def one(ids: list[int], max_new: int) -> tuple[list[int], list[int], dict[str, Any]]:
            body = {**GREEDY, "prompt": ids, "n_predict": max_new, "cache_prompt": False, "return_tokens": True}
            out = _post(port, "/completion", body)
            seen = ids
            if out.get("tokens_evaluated") != len(ids):
                seen = _post(port, "/tokenize", {"content": out.get("prompt", ""), "parse_special": True})["tokens"]
            return answer(out["tokens"], eos), seen, out.get("timings", {})

        def run(batch: list[list[int]], max_new: int) -> tuple[list[list[int]], list[list[int]]]:
            nonlocal drafted, accepted
            results = list(pool.map(lambda ids: one(ids, max_new), batch))
            for _, _, timings in results:
                drafted += int(timings.get("draft_n", 0))
                accepted += int(timings.get("draft_n_accepted", 0))
            return [r[0] for r in results], [r[1] for r in results]

        def decode(ids: list[int]) -> str:
            return _post(port, "/detokenize", {"tokens": ids})["content"]

        workloads = timed_workloads(spec, run, decode)
        rss = peak_rss_mb(proc.pid)
    return {
        "workloads": workloads,
        "load_seconds": load_seconds,
        "peak_rss_mb": rss,
        "draft_tokens": drafted,
        "accepted_draft_tokens": accepted,
        "versions": {"llama_server": server_version(spec)},
        "command": " ".join(server_command(spec, 0, spec["batch"])),
    }


def score(spec: dict[str, Any]) -> dict[str, Any]:
    """Forced rows and held-out NLL, one position per request on a one-slot server with the prompt cache on."""
    log = Path(spec["work"]) / f"llama-server-{spec['name']}.log"
    with running_server({**spec, "ngram": None}, 1, log) as (port, _):

        def at(prefix: list[int], target: int) -> tuple[Top2, float]:
            body = {
                **GREEDY,
                "prompt": prefix,
                "n_predict": 1,
                "n_probs": 2,
                "cache_prompt": True,
                "return_tokens": True,
                "logit_bias": [[target, 1000.0]],
            }
            probs = _post(port, "/completion", body)["completion_probabilities"][0]
            if probs["id"] != target:
                raise RuntimeError(f"forcing token {target} failed: the server sampled {probs['id']}")
            (first, second) = probs["top_logprobs"][:2]
            return (int(first["id"]), float(first["logprob"] - second["logprob"])), float(probs["logprob"])

        return score_positions(spec, at)


if __name__ == "__main__":
    sys.exit(child_main({"generate": generate, "score": score}))

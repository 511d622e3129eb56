"""Requests failing inside the engine, in bursts beside good ones, on one real ``tritonserver``: does it survive?

Each round sends ten requests the fault hook fails mid-decoding (``seed=FAULT_SEED``, the hook in this file) and
four good ones, all at once, and checks that every bad one ends INTERNAL, every good one is answered, and every
stub process of the server is still the one it started with. A run stops at its first bad round. What it found
(``benchmarks/results/fault_storm.md``): bursts of failures crashed a stub or tritonserver itself within a few
rounds, through races in the Python backend (a metric updated from two threads; arrays shared between a
request's objects and the backend's tensors).

    python -m benchmarks.fault_storm [--export DIR] [--runs 4] [--rounds 40] [--mode stream|unary|mixed]

Without ``--export`` it serves ``benchmarks.triton_serving``'s cached export. Each invocation appends its runs to
``results/fault_storm.json`` and redraws ``fault_storm.md`` and ``.png`` from every record there; ``--label`` names
the code under test (to compare a commit, run this file from a worktree of it with ``PYTHONPATH`` at that worktree
and ``--out`` at this tree's JSON).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

from specdec.bench.figures import figure

#: the seed that marks a request for the fault hook (greedy requests ignore their seed otherwise)
FAULT_SEED = 4242
MESSAGE = "injected fault for a storm"
PROMPTS = (
    "Write a short story about a lighthouse keeper.",
    "List ten facts about the ocean.",
    "Describe a busy market in the morning.",
    "Explain how rain forms.",
)
BAD_PER_ROUND = 10
ROUND_TIMEOUT_S = 60.0


def fail_marked(seq: Any, point: str) -> None:
    """The fault hook the served engine loads (``$SPECDEC_FAULT_HOOK``): a marked request fails at its
    verification after three tokens, mid-stream."""
    if point == "verify" and seq.request.sampling.seed == FAULT_SEED and seq.num_generated >= 3:
        raise RuntimeError(MESSAGE)


def _stubs(pid: int) -> set[int]:
    """The live processes under tritonserver (a crashed stub stays a zombie until Triton reaps it)."""
    import psutil

    live = set()
    for child in psutil.Process(pid).children(recursive=True):
        try:
            if child.status() != psutil.STATUS_ZOMBIE:
                live.add(child.pid)
        except psutil.NoSuchProcess:
            pass
    return live


def _ask(url: str, prompt: str, stream: bool, **params: Any) -> str:
    """``"ok"``, or the status a request ended with."""
    from specdec.serving.client import ClientError, SpecdecClient

    client = SpecdecClient(url)
    try:
        call = client.generate_stream if stream else client.generate
        call(prompt, max_tokens=24, apply_chat_template=True, **params)
        return "ok"
    except ClientError as exc:
        return str(exc.status)


def one_run(repository: Path, rounds: int, mode: str, progress: Any) -> dict[str, Any]:
    """Rounds until the first bad one; what ended it."""
    from specdec.serving.server import TritonServer, free_ports

    os.environ["SPECDEC_FAULT_HOOK"] = f"{Path(__file__).resolve()}:fail_marked"
    grpc, http, metrics = free_ports()
    server = TritonServer()
    server.start(repository, grpc_port=grpc, http_port=http, metrics_port=metrics, exit_timeout_s=30)
    survived, ended = 0, "all rounds passed"
    pool = ThreadPoolExecutor(BAD_PER_ROUND + len(PROMPTS))
    try:
        server.wait_ready(300)
        assert server.process is not None
        stubs = _stubs(server.process.pid)
        streamed = {"stream": lambda i: True, "unary": lambda i: False, "mixed": lambda i: i % 2 == 0}[mode]
        for _ in range(rounds):
            bad = [
                pool.submit(_ask, server.grpc_url, PROMPTS[i % len(PROMPTS)], streamed(i), seed=FAULT_SEED)
                for i in range(BAD_PER_ROUND)
            ]
            good = [pool.submit(_ask, server.grpc_url, p, i % 2 == 1) for i, p in enumerate(PROMPTS)]
            _, pending = wait(bad + good, timeout=ROUND_TIMEOUT_S)
            lost = stubs - _stubs(server.process.pid)
            if pending or lost or server.process.poll() is not None:
                ended = f"{len(pending)} requests unanswered in {ROUND_TIMEOUT_S:.0f} s, {len(lost)} stubs gone, " + (
                    f"tritonserver exit {server.process.poll()}" if server.process.poll() is not None else "server up"
                )
                break
            outcomes = [f.result() for f in bad], [f.result() for f in good]
            if set(outcomes[0]) != {"StatusCode.INTERNAL"} or set(outcomes[1]) != {"ok"}:
                ended = f"wrong outcomes: bad {sorted(set(outcomes[0]))}, good {sorted(set(outcomes[1]))}"
                break
            survived += 1
            progress.update(1)
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
        code = server.stop()
    return {"rounds": survived, "ended": ended, "stop_exit_code": code}


def report(records: list[dict[str, Any]], stem: Path) -> None:
    """``stem``.md (a row per run) and ``stem``.png (rounds survived per run, a group per record)."""
    lines = [
        "# Bursts of failing requests on one tritonserver",
        "",
        f"`python -m benchmarks.fault_storm` (each round: {BAD_PER_ROUND} requests"
        f" failed by the fault hook mid-decoding and {len(PROMPTS)} good ones at once, through both entry points; a"
        " run ends at its first round with an unanswered request, a wrong outcome or a stub gone).",
        "",
        "| code | mode | run | rounds passed | how the run ended | tritonserver stop |",
        "|:--|:--|--:|--:|:--|--:|",
    ]
    for record in records:
        for i, run in enumerate(record["runs"], 1):
            lines.append(
                f"| {record['label']} | {record['mode']} | {i} | {run['rounds']} / {record['rounds']} | {run['ended']} "
                f"| {run['stop_exit_code']} |"
            )
    lines += ["", *(f"- {r['label']} ({r['when']}): {r['note']}" for r in records if r.get("note"))]
    machine = records[-1]["machine"]
    lines += ["", f"Machine: {machine.get('processor', '?')}, {machine.get('cpu_count', '?')} cores.", ""]
    stem.with_suffix(".md").write_text("\n".join(lines))
    with figure(stem.with_suffix(".png"), figsize=(7, 3.2)) as (_, ax):
        x = 0
        for record in records:
            heights = [run["rounds"] for run in record["runs"]]
            ax.bar(range(x, x + len(heights)), heights, label=f"{record['label']} ({record['mode']})")
            x += len(heights) + 1
        ax.axhline(max(r["rounds"] for r in records), color="grey", lw=0.8, ls="--")
        ax.set_ylabel("rounds passed before a failure")
        ax.set_xticks([])
        ax.set_title("fault storm: each bar one server run")
        ax.legend(fontsize=8)


def main(argv: list[str] | None = None) -> int:
    from tqdm.auto import tqdm

    from benchmarks.triton_serving import ensure_export
    from specdec.bench.harness import machine_info, utc_stamp
    from specdec.serving.repository import REPOSITORY_DIR

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--export", type=Path, default=None)
    parser.add_argument("--runs", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--mode", choices=("stream", "unary", "mixed"), default="mixed")
    parser.add_argument("--label", default="HEAD", help="what code this is, for the report")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/fault_storm.json"))
    parser.add_argument("--note", default="", help="a line the report keeps under this record")
    args = parser.parse_args(argv)

    repository = ensure_export(args.export, force=False) / REPOSITORY_DIR
    runs = []
    with tqdm(total=args.runs * args.rounds, desc=f"fault storm ({args.label}, {args.mode})") as progress:
        for _ in range(args.runs):
            runs.append(one_run(repository, args.rounds, args.mode, progress))
            progress.update(args.rounds - runs[-1]["rounds"])
    record = {"label": args.label, "mode": args.mode, "rounds": args.rounds, "when": utc_stamp()}
    record |= {"machine": machine_info(), "runs": runs, "note": args.note}
    records = [*(json.loads(args.out.read_text()) if args.out.exists() else []), record]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(records, indent=2) + "\n")
    report(records, args.out.with_suffix(""))
    for run in runs:
        rounds = f"{run['rounds']}/{args.rounds} rounds"
        print(f"{args.label} {args.mode}: {rounds}; {run['ended']}; tritonserver stop {run['stop_exit_code']}")
    return 0 if all(run["rounds"] == args.rounds for run in runs) else 1


if __name__ == "__main__":
    sys.exit(main())

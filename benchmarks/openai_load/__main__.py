"""``python -m benchmarks.openai_load``: the command line, the order of the runs, and the run from installs to the
written report (``benchmarks.openai_load`` says what is measured and why)."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from benchmarks.openai_load import DEFAULT_EXPORT, DEFAULT_WORK
from benchmarks.openai_load import aiperf as loadgen
from benchmarks.openai_load.engines import (
    DEFAULT_LLAMA_SERVER,
    ENGINES,
    ensure_export,
    ensure_llama_server,
    llama_server,
    llama_spec,
    specdec_model_name,
    specdec_server,
)
from benchmarks.openai_load.report import fold, markdown, plot
from specdec.bench.harness import int_list, machine_info, run_command, utc_stamp
from specdec.bench.report import write_report
from specdec.bench.workloads import CHAT_PROMPTS, chat_workload

RESULTS = Path(__file__).resolve().parents[1] / "results"
LLAMA_MAX_LEN = 2048  # context per llama-server slot: the export's --max-len


@dataclass(frozen=True)
class Block:
    """What one server process serves before it is stopped: ``slots`` (llama-server's ``-np``; None for specdec,
    whose export has the slots of the highest concurrency) and its runs, (engine key, concurrency) in order."""

    repeat: int
    server: str
    slots: int | None
    runs: tuple[tuple[str, int], ...]


def plan(engines: Sequence[str], concurrencies: Sequence[int], repeats: int) -> list[Block]:
    """Every run of the benchmark, grouped by server process, in the order they run.

    Servers one at a time, their order flipped each repeat; llama-server a fresh process for each concurrency
    (``-np`` = the concurrency); specdec one process per repeat for both its rows, ``ar`` and ``ems`` alternating
    which goes first by concurrency and repeat.
    """
    servers = list(dict.fromkeys(ENGINES[e].server for e in engines))
    blocks = []
    for repeat in range(repeats):
        for server in servers if repeat % 2 == 0 else servers[::-1]:
            mine = [e for e in engines if ENGINES[e].server == server]
            if server == "llama-server":
                blocks += [Block(repeat, server, c, tuple((e, c) for e in mine)) for c in concurrencies]
                continue
            runs = []
            for i, c in enumerate(concurrencies):
                order = mine if (i + repeat) % 2 == 0 else mine[::-1]
                runs += [(e, c) for e in order]
            blocks.append(Block(repeat, server, None, tuple(runs)))
    return blocks


def requests_of(concurrency: int, per_slot: int, minimum: int) -> int:
    """Requests in one run: ``per_slot`` per slot, at least ``minimum`` (so that a p99 has requests behind it)."""
    return max(per_slot * concurrency, minimum)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.openai_load", description=__doc__)
    p.add_argument("--concurrency", type=int_list, default=(1, 4, 8, 16), help="requests in flight (default 1,4,8,16)")
    p.add_argument("--max-tokens", type=int, default=96, help="output budget per request (default 96)")
    p.add_argument("--prompts", type=int, default=len(CHAT_PROMPTS), help="distinct chat prompts, cycled in order")
    p.add_argument("--requests-per-slot", type=int, default=4, help="requests per run = this x concurrency ...")
    p.add_argument("--min-requests", type=int, default=16, help="... and at least this many (default 16)")
    p.add_argument("--no-warmup", action="store_true", help="no warm-up phase (default: one request per slot)")
    p.add_argument("--repeats", type=int, default=2, help="interleaved repeats; a row is their median (default 2)")
    p.add_argument("--engines", default=",".join(ENGINES), help=f"rows to run, of {','.join(ENGINES)}")
    p.add_argument("--threads", type=int, default=2, help="llama-server threads (default 2)")
    p.add_argument("--export", type=Path, default=DEFAULT_EXPORT, help="the main job's export (made when missing)")
    p.add_argument("--reexport", action="store_true", help="make the export again even if it exists")
    p.add_argument("--llama-server", type=Path, default=DEFAULT_LLAMA_SERVER, help="the llama-server binary")
    p.add_argument("--aiperf-venv", type=Path, default=loadgen.DEFAULT_VENV, help="aiperf's venv (made if missing)")
    p.add_argument("--install-only", action="store_true", help="install aiperf and llama-server, make the export")
    p.add_argument("--work-dir", type=Path, default=DEFAULT_WORK / "runs", help="aiperf artifacts and server logs")
    p.add_argument("--out-dir", type=Path, default=RESULTS)
    p.add_argument("--stem", default="openai_load")
    p.add_argument("--run-timeout", type=float, default=1800.0, help="seconds one aiperf run may take")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    args.engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    unknown = [e for e in args.engines if e not in ENGINES]
    if unknown or not args.engines:
        p.error(f"--engines: unknown {unknown}; expected some of {','.join(ENGINES)}")
    for name in ("max_tokens", "prompts", "requests_per_slot", "min_requests", "repeats", "threads"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    return args


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else []


@contextlib.contextmanager
def serving(block: Block, args: argparse.Namespace, llama: dict[str, Any] | None) -> Iterator[tuple[str, str]]:
    """The server of ``block``, ready: (base URL, command line)."""
    work = args.work_dir / (f"r{block.repeat}-{block.server}" + (f"-np{block.slots}" if block.slots else ""))
    if block.server == "llama-server":
        assert llama is not None and block.slots is not None
        with llama_server(llama, block.slots, work / "llama-server.log") as served:
            yield served
    else:
        with specdec_server(args.export, work) as served:
            yield served


def run_all(args: argparse.Namespace, exe: Path, model: str, llama: dict[str, Any] | None, meta: dict) -> list[dict]:
    """Every run of ``plan``: one aiperf profile each; a server that fails to start fails its block's runs."""
    dataset = loadgen.write_dataset(args.work_dir / "prompts.jsonl", chat_workload(args.prompts), args.max_tokens)
    tokenizer = args.export / "target"
    blocks = plan(args.engines, args.concurrency, args.repeats)
    runs: list[dict[str, Any]] = []
    bar = tqdm(total=sum(len(b.runs) for b in blocks), desc="openai load", unit="run", disable=args.no_progress)
    for block in blocks:
        try:
            with serving(block, args, llama) as (url, command):
                meta[f"{block.server.replace('-', '_')}_command"] = command
                for engine, c in block.runs:
                    bar.set_postfix_str(f"repeat {block.repeat} {engine} C={c}")
                    artifacts = args.work_dir / f"r{block.repeat}-{engine}-c{c}"
                    run: dict[str, Any] = {"engine": engine, "concurrency": c, "repeat": block.repeat}
                    cmd = loadgen.profile_command(
                        exe,
                        url=url,
                        model=model,
                        tokenizer=tokenizer,
                        dataset=dataset,
                        concurrency=c,
                        requests=requests_of(c, args.requests_per_slot, args.min_requests),
                        warmup=0 if args.no_warmup else c,
                        extra=ENGINES[engine].extra,
                        artifacts=artifacts,
                    )
                    run["aiperf_command"] = " ".join(cmd[1:])
                    try:
                        run.update(loadgen.summarize(loadgen.run_profile(cmd, artifacts, args.run_timeout)))
                    except (RuntimeError, OSError, ValueError) as exc:
                        run["error"] = str(exc)
                    runs.append(run)
                    bar.update(1)
        except (RuntimeError, OSError) as exc:
            done = {(r["engine"], r["concurrency"]) for r in runs if r["repeat"] == block.repeat}
            for engine, c in block.runs:
                if (engine, c) not in done:
                    runs.append({"engine": engine, "concurrency": c, "repeat": block.repeat, "error": str(exc)})
                    bar.update(1)
    bar.close()
    return runs


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    start = time.perf_counter()
    load_before = _load()
    exe = loadgen.ensure_aiperf(args.aiperf_venv)
    export = ensure_export(args.export, max(args.concurrency), args.reexport, DEFAULT_WORK / "export.log")
    llama = None
    if "llama-server" in args.engines:
        from benchmarks.peers.convert import shipped_gguf

        server = ensure_llama_server(args.llama_server)
        llama = llama_spec(server, shipped_gguf(), args.threads, LLAMA_MAX_LEN, specdec_model_name(args.export))
    if args.install_only:
        print(f"ready: {exe}, export {export['dir']}" + (f", {llama['server']}" if llama else ""))
        return 0
    model = specdec_model_name(args.export)
    meta: dict[str, Any] = {
        "date": utc_stamp(),
        "command": run_command("benchmarks.openai_load", argv),
        "stem": args.stem,
        "work_dir": str(args.work_dir),
        "export": export,
        "loadgen": f"aiperf {loadgen.version(exe)} (`{loadgen.AIPERF_PIN}` in its own venv), streaming chat "
        "completions, fixed concurrency, one worker process",
        "workload": f"{args.prompts} chat prompts (`CHAT_PROMPTS`), in order, cycled; {args.max_tokens} new tokens "
        f"at most, greedy; per run max({args.requests_per_slot} x concurrency, {args.min_requests}) requests"
        + ("" if args.no_warmup else " after one warm-up request per slot"),
        "order": f"{args.repeats} repeat(s), servers one at a time, their order flipped each repeat; "
        "llama-server restarted for each concurrency (-np = concurrency), specdec one server per repeat",
        "machine": machine_info(),
        "title": f"OpenAI-API chat load (aiperf), SmolLM2-135M, {args.max_tokens} tokens greedy, {utc_stamp()}",
        "load_before": load_before,
    }
    if llama:
        from benchmarks.peers.llama_server import server_version

        meta["llama_server_version"] = server_version(llama)
    runs = run_all(args, exe, model, llama, meta)
    meta.update(load_after=_load(), seconds=time.perf_counter() - start)
    doc = {
        "meta": meta,
        "labels": {k: e.label for k, e in ENGINES.items()},
        "rows": fold(runs, args.engines, args.concurrency),
        "runs": runs,
    }
    print(write_report(doc, args.out_dir, args.stem, markdown, plot))
    return 0 if all("error" not in r for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())

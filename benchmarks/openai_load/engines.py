"""The engines under load, each serving OpenAI's ``/v1/chat/completions`` on free 127.0.0.1 ports, ready before the
load generator starts and stopped by PID afterwards: llama.cpp's ``llama-server`` (``benchmarks.peers``: built by
``benchmarks/peers/install.sh``, started by ``llama_server.running_server``) and ``specdec serve`` with its OpenAI
frontend over the main job's export, made once into a cache directory with the command ``scripts/main.sh`` runs.
"""

from __future__ import annotations

import shlex
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.peers.protocol import REPO

MAIN_SH = REPO / "scripts" / "main.sh"
DEFAULT_LLAMA_SERVER = REPO / ".work" / "peers" / "llama.cpp" / "build" / "bin" / "llama-server"
SPECDEC_READY_S = 600.0  # the export's models load and warm up in tens of seconds; a loaded machine may need more
DRAIN_S = 120.0


@dataclass(frozen=True)
class Engine:
    """One row of the table: who serves, and what its requests add to the body (``--extra-inputs``)."""

    key: str
    label: str
    server: str  # "llama-server" or "specdec": the rows of one server share its process
    extra: dict[str, Any]


#: greedy everywhere; llama-server's prompt cache off, so that each request prefills in full as specdec's does
#: (the edge benchmark's rule); specdec's method is its extension field
ENGINES = {
    e.key: e
    for e in (
        Engine("llama-server", "llama-server Q4_1", "llama-server", {"temperature": 0, "cache_prompt": False}),
        Engine("specdec-ar", "specdec ar", "specdec", {"temperature": 0, "method": "ar"}),
        Engine("specdec-ems", "specdec ems", "specdec", {"temperature": 0, "method": "ems"}),
    )
}


# -- the main job's export -------------------------------------------------------------------------------------


def main_export_args(script: Path = MAIN_SH) -> list[str]:
    """The ``specdec-export`` arguments of the main job, read from ``scripts/main.sh`` (so the benchmark serves
    what the main job serves, whatever it becomes), without ``--out`` and ``--force``."""
    text = script.read_text(encoding="utf-8").replace("\\\n", " ")
    for line in text.splitlines():
        words = shlex.split(line, comments=True)
        if words and words[0] == "specdec-export":
            args, skip = [], False
            for word in words[1:]:
                if skip:
                    skip = False
                elif word == "--out":
                    skip = True
                elif word != "--force":
                    args.append(word)
            return args
    raise RuntimeError(f"{script}: no specdec-export command found")


def export_command(out: Path, max_batch: int, script: Path = MAIN_SH) -> list[str]:
    """The main job's export command into ``out``, with ``--max-batch`` raised to ``max_batch`` when it is lower
    (the KV slots of the highest concurrency: llama-server gets as many slots; the graphs are the same)."""
    args = main_export_args(script)
    if "--max-batch" in args:
        i = args.index("--max-batch")
        args[i + 1] = str(max(int(args[i + 1]), max_batch))
    else:
        args += ["--max-batch", str(max_batch)]
    return ["specdec-export", *args, "--out", str(out)]


def ensure_export(out: Path, max_batch: int, reexport: bool, log: Path) -> dict[str, Any]:
    """The export to serve: reused when ``out`` holds a manifest (and ``reexport`` is off), else made."""
    cmd = export_command(out, max_batch)
    if (out / "manifest.json").is_file() and not reexport:
        return {"dir": str(out), "command": shlex.join(cmd), "reused": True}
    argv = [*cmd[1:], "--force"] if out.exists() else cmd[1:]
    log.parent.mkdir(parents=True, exist_ok=True)
    print(f"exporting (once): {shlex.join(cmd)}  [log: {log}]", file=sys.stderr, flush=True)
    start = time.perf_counter()
    code = "import sys; from specdec.export.cli import main; sys.exit(main(sys.argv[1:]))"
    with log.open("w", encoding="utf-8") as f:
        proc = subprocess.run([sys.executable, "-c", code, *argv], stdout=f, stderr=subprocess.STDOUT, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"the export failed with {proc.returncode} (log: {log})")
    return {"dir": str(out), "command": shlex.join(cmd), "reused": False, "seconds": time.perf_counter() - start}


# -- llama-server ----------------------------------------------------------------------------------------------


def ensure_llama_server(path: Path) -> Path:
    """``path``, built by ``benchmarks/peers/install.sh llama.cpp`` first when it is the default and missing."""
    if path.is_file():
        return path
    if path != DEFAULT_LLAMA_SERVER:
        raise FileNotFoundError(f"--llama-server {path}: no such file")
    print("building llama-server (once; about 15 min on 2 cores)", file=sys.stderr, flush=True)
    subprocess.run(["bash", str(REPO / "benchmarks" / "peers" / "install.sh"), "llama.cpp"], cwd=REPO, check=True)
    return path


def llama_spec(server: Path, gguf: Path, threads: int, max_len: int, model: str) -> dict[str, Any]:
    """``llama_server.running_server``'s spec: continuous batching and the GGUF's chat template (jinja) spelled
    out though both are the defaults, the model served under the name the load generator sends."""
    return {
        "server": str(server),
        "gguf": str(gguf),
        "threads": threads,
        "max_len": max_len,
        "ngram": None,
        "extra_args": ["--cont-batching", "--jinja", "--alias", model],
    }


@contextmanager
def llama_server(spec: dict[str, Any], slots: int, log: Path) -> Iterator[tuple[str, str]]:
    """A ready ``llama-server`` with ``slots`` slots: (its base URL, its command line); stopped on exit."""
    from benchmarks.peers.llama_server import running_server, server_command

    log.parent.mkdir(parents=True, exist_ok=True)
    with running_server(spec, slots, log) as (port, _proc):
        yield f"http://127.0.0.1:{port}", shlex.join(server_command(spec, port, slots))


# -- specdec serve ---------------------------------------------------------------------------------------------


def specdec_command(export: Path, ports: Sequence[int], log: Path) -> list[str]:
    grpc, http, metrics, api = ports
    return [
        *("specdec", "serve", str(export)),
        *("--grpc-port", str(grpc), "--http-port", str(http), "--metrics-port", str(metrics)),
        *("--openai-port", str(api), "--log-file", str(log), "--ready-timeout", str(int(SPECDEC_READY_S))),
    ]


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health/ready", timeout=5) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


@contextmanager
def specdec_server(export: Path, work: Path) -> Iterator[tuple[str, str]]:
    """A ready ``specdec serve`` (Triton and its OpenAI frontend): (the frontend's base URL, the command line).
    Stopped on exit by SIGINT to its PID (the drain: requests in flight finish, then every child exits)."""
    from specdec.serving.server import free_ports

    work.mkdir(parents=True, exist_ok=True)
    ports = free_ports(4)
    cmd = specdec_command(export, ports, work / "triton.log")
    code = "import sys; from specdec.cli import main; sys.exit(main(sys.argv[1:]))"
    with (work / "specdec-serve.log").open("w", encoding="utf-8") as out:
        proc = subprocess.Popen([sys.executable, "-c", code, *cmd[1:]], stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{ports[3]}"
    try:
        deadline = time.monotonic() + SPECDEC_READY_S
        while not _ready(url):
            if proc.poll() is not None:
                raise RuntimeError(f"specdec serve exited with {proc.returncode} before it was ready (log: {work})")
            if time.monotonic() > deadline:
                raise RuntimeError(f"specdec serve not ready after {SPECDEC_READY_S:.0f} s (log: {work})")
            time.sleep(0.5)
        yield url, shlex.join(cmd)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=DRAIN_S)
            except subprocess.TimeoutExpired:
                proc.send_signal(signal.SIGINT)  # the second signal ends what is left of the drain
                try:
                    proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


def specdec_model_name(export: Path) -> str:
    from specdec.serving.openai.process import model_name

    return model_name(export)

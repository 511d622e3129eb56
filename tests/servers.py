"""Helpers of the tests that start a real tritonserver: free loopback ports, leftover processes."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from specdec.serving.server import free_ports

__all__ = ["SPECDEC_SERVE", "ask", "eventually", "free_ports", "needs_tritonserver", "processes_mentioning", "samples"]


#: ``specdec serve`` as a child process, as an operator runs it (its own signals, output and exit code); its
#: arguments follow
SPECDEC_SERVE = (
    sys.executable,
    "-c",
    "import sys; from specdec.serving.serve import serve_main; sys.exit(serve_main(sys.argv[1:]))",
)


#: each phase's report of the test that runs now (``conftest.pytest_runtest_makereport``): what ``failed`` reads
REPORTS = pytest.StashKey[dict[str, pytest.TestReport]]()


def failed(request: pytest.FixtureRequest) -> bool:
    """In a fixture's teardown: whether the test itself failed, so the fixture can print what explains it (a server's
    own output), which pytest shows with the failure."""
    report = request.node.stash.get(REPORTS, {}).get("call")
    return report is not None and report.failed


def eventually(condition: Callable[[], bool], timeout: float = 120.0, poll_s: float = 0.1) -> bool:
    """Whether ``condition`` holds within ``timeout`` s, polled: what a fixed sleep would only hope for, e.g. what
    a process's end makes true a moment later (SIGKILLed stubs leaving /proc, their sockets closing), which a check
    made at once would race. The deadline is generous because a loaded machine is slow; the answer comes as soon as
    the condition holds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() >= deadline:
            return False
        time.sleep(poll_s)
    return True


def processes_mentioning(text: str) -> list[int]:
    """PIDs whose command line contains ``text`` (the server and its Python-backend stubs name the repo)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmdline:
            pids.append(int(entry.name))
    return pids


def samples(metrics_url: str, prefix: str = "", per_instance: bool = False) -> dict[str, float]:
    """The Prometheus samples of a server's metrics endpoint whose names start with ``prefix``, keyed by
    ``name{labels}``: what the tests compare before and after (counters that must move by exactly N).

    The engine's series carry an ``instance`` label (one per engine instance); unless ``per_instance``, they are
    summed over it, so ``specdec_requests_total{outcome="failed"}`` is the server's total whatever its instances.
    """
    import re
    import urllib.request

    with urllib.request.urlopen(metrics_url, timeout=60) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith(prefix) or line.startswith("#"):
            continue
        key, value = line.rsplit(" ", 1)
        if not per_instance:
            key = re.sub(r'instance="[^"]*",?', "", key).replace(",}", "}").replace("{}", "")
        out[key] = out.get(key, 0.0) + float(value)
    return out


def needs_tritonserver() -> None:
    """Skip the calling test module (at import) where no tritonserver or no tritonclient[grpc] is installed."""
    import pytest

    from specdec.serving.install import TritonNotFoundError, find_tritonserver

    try:
        find_tritonserver()
    except TritonNotFoundError as exc:  # pragma: no cover - depends on the machine
        pytest.skip(f"no tritonserver available: {exc}", allow_module_level=True)
    pytest.importorskip("tritonclient.grpc", reason="tritonclient[grpc] (the `serve` extra) not installed")


def ask(url: str, prompt: str, stream: bool = False, max_tokens: int = 24, **params: object) -> Any:
    """One chat request to a server, unary or streamed: its ``Answer``, or the ``ClientError`` it ended with (so a
    test that sends many can check each one's outcome)."""
    from specdec.serving.client import ClientError, SpecdecClient

    client = SpecdecClient(url)
    try:
        call = client.generate_stream if stream else client.generate
        return call(prompt, max_tokens=max_tokens, apply_chat_template=True, **params)
    except ClientError as exc:
        return exc

"""Helpers of the tests that start a real tritonserver: free loopback ports, leftover processes."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

from specdec.serving.server import free_ports

__all__ = ["eventually", "free_ports", "processes_mentioning"]


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

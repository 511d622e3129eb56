"""Helpers of the tests that start a real tritonserver: free loopback ports, leftover processes."""

from __future__ import annotations

import os
from pathlib import Path

from specdec.serving.server import free_ports

__all__ = ["free_ports", "processes_mentioning"]


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

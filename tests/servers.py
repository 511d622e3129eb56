"""Helpers of the tests that start a real tritonserver: free loopback ports, leftover processes."""

from __future__ import annotations

import os
import socket
from pathlib import Path


def free_ports(n: int = 3) -> list[int]:
    """n distinct free loopback ports (all bound at once so the kernel cannot hand out one twice)."""
    socks = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


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

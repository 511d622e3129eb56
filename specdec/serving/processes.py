"""The processes of a server, seen from outside: which are alive, which stub serves which model (psutil).

A supervisor needs three answers about the process tree tritonserver grows: is a process alive (a zombie, killed
and not yet reaped, is not), which children a process has, and which model each Python-backend stub serves. A
stub's command line names its model's ``model.py`` (``<repository>/<model>/1/model.py``) as its first argument, so
the model is that path's grandparent directory: exact, where matching a name inside the whole command line could
also match a directory of the same name on the way to it.
"""

from __future__ import annotations

from pathlib import Path


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, killed but not yet reaped by its parent, does not)."""
    import psutil

    try:
        return psutil.Process(pid).status() not in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False


def stopped(pid: int) -> bool:
    """Whether ``pid`` is stopped (SIGSTOP, a debugger): alive, but it runs nothing."""
    import psutil

    try:
        return psutil.Process(pid).status() in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP)
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False


def children(parent: int) -> dict[int, list[str]]:
    """The processes whose parent is ``parent``, with their command lines."""
    import psutil

    found = {}
    try:
        kids = psutil.Process(parent).children()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return {}
    for kid in kids:
        try:
            found[kid.pid] = kid.cmdline()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def stub_models(server_pid: int) -> dict[int, str]:
    """The Python-backend stubs tritonserver ``server_pid`` started, each with the model it serves."""
    models = {}
    for pid, cmdline in children(server_pid).items():
        if len(cmdline) > 1 and cmdline[1].endswith("model.py"):
            models[pid] = Path(cmdline[1]).parent.parent.name
    return models


def stub_pids(server_pid: int, model: str) -> list[int]:
    """The stubs of ``model`` (one per instance) that tritonserver ``server_pid`` started."""
    return sorted(pid for pid, name in stub_models(server_pid).items() if name == model)

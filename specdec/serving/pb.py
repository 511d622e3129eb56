"""Triton's Python-backend utilities (``triton_python_backend_utils``), reached through one handle.

Inside a Triton stub the real module is importable; elsewhere it is not, and a test installs a stand-in with
``use`` to build and run every model of the repository without a server. The serving modules read ``pb.utils``
when they run, never an import of their own, so one call swaps all of them.
"""

from __future__ import annotations

from typing import Any

try:  # only inside Triton's Python-backend stub
    import triton_python_backend_utils as _backend
except ImportError:  # pragma: no cover - imported for documentation, by the CLI, or in tests without Triton
    _backend = None

#: the utilities module the models call: Triton's, or a test's stand-in
utils: Any = _backend


def use(module: Any) -> Any:
    """Make ``module`` the utilities every model calls; returns the one it replaces (a test restores it)."""
    global utils
    previous, utils = utils, module
    return previous

"""What a running Python-backend stub offers for diagnosis: its threads' stacks on a signal, and the fault hook.

Split from ``triton_models`` (the models themselves) because neither is serving: one is for the operator who
must see why a model will not unload, the other for the tests that inject a failure tied to one request.
"""

from __future__ import annotations

import faulthandler
import importlib
import importlib.util
import logging
import os
import signal
import sys
from typing import Any

log = logging.getLogger(__name__)

FAULT_HOOK_ENV = "SPECDEC_FAULT_HOOK"


def dump_threads_on_sigusr1() -> None:
    """``kill -USR1 <stub pid>`` writes the stack of every Python thread of that stub to the server log.

    Why: each model runs in its own stub process, out of reach of a debugger on a server, and a
    request thread that never returns shows only as a model that will not unload. The signal
    would otherwise kill the stub; with this it is harmless and the stub keeps serving.
    """
    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)


def fault_hook() -> Any:
    """The test hook ``$SPECDEC_FAULT_HOOK`` names (``module:function`` or ``path/file.py:function``), called at each
    sequence's step points.

    Only tests set it (the isolation tests inject a failure tied to one request through it); it is read from
    the server's environment, which only the operator controls, and its use is logged loudly.
    """
    spec = os.environ.get(FAULT_HOOK_ENV, "").strip()
    if not spec:
        return None
    module, _, name = spec.rpartition(":")
    log.warning("fault injection is on (%s=%s): for tests only", FAULT_HOOK_ENV, spec)
    if module.endswith(".py"):  # a file: the stub's sys.path is its own, not the test's
        loaded = importlib.util.spec_from_file_location("specdec_fault_hook", module)
        assert loaded is not None and loaded.loader is not None, spec
        code = importlib.util.module_from_spec(loaded)
        loaded.loader.exec_module(code)
        return getattr(code, name)
    return getattr(importlib.import_module(module), name)

"""The Triton side of one request: its response sender, safe across threads, and its error responses.

Shared by the entry points and the engine model of ``specdec.serving.triton_models``.
"""

from __future__ import annotations

import json
import threading
from typing import Any

from specdec.serving.control import INTERNAL_KEY_PARAMETER, internal_key

try:  # only inside Triton's Python-backend stub
    import triton_python_backend_utils as pb_utils
except ImportError:  # pragma: no cover - imported for documentation or tests without Triton
    pb_utils = None


def error_response(message: str, invalid: bool = True, code: str | int | None = None) -> Any:
    """An error response; bad input is INVALID_ARG (gRPC INVALID_ARGUMENT), the rest INTERNAL unless ``code`` says.

    ``code``: a ``pb_utils.TritonError`` code name (``"UNAVAILABLE"``: draining or aborted; ``"CANCELLED"``)
    or the code an inner model's error carried, so a client sees the status the failure really has.
    """
    if code is None:
        code = "INVALID_ARG" if invalid else "INTERNAL"
    value = getattr(pb_utils.TritonError, code, None) if isinstance(code, str) else code
    error = pb_utils.TritonError(message) if value is None else pb_utils.TritonError(message, value)
    return pb_utils.InferenceResponse(output_tensors=[], error=error)


class ModelError(Exception):
    """An inner model's (BLS) error, with its Triton error code kept for the client's answer."""

    def __init__(self, message: str, code: int | None) -> None:
        super().__init__(message)
        self.code = code


def raise_model_error(error: Any) -> None:
    code = error.code() if callable(getattr(error, "code", None)) else None
    raise ModelError(error.message(), code)


class Client:
    """A Triton request and its response sender, safe to poll for cancellation from another thread.

    Asking a request whether it was cancelled after its final response has been sent reads freed
    memory in the server (tritonserver 2.51 dies with SIGSEGV in ``ResponseFactoryIsCancelled``).
    The final send and the poll therefore exclude each other, and nothing is polled after it.
    """

    def __init__(self, request: Any, sender: Any) -> None:
        self.request, self.sender = request, sender
        self._lock = threading.Lock()
        self._done = False

    @property
    def done(self) -> bool:
        return self._done

    def is_cancelled(self) -> bool:
        with self._lock:
            if self._done:
                return False
            try:
                return bool(self.request.is_cancelled())
            except Exception:
                return True

    def send(self, response: Any = None, final: bool = False) -> bool:
        """Send unless the final response already went (an aborted request's thread may still answer); sent?"""
        with self._lock:
            if self._done:
                return False
            self._done = final
            flags = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL if final else 0
            if response is None:
                self.sender.send(flags=flags)
            else:
                self.sender.send(response, flags=flags)
            return True


def internal_parameters() -> dict[str, str]:
    """The request parameters an entry point's BLS call carries so the internal model accepts it."""
    key = internal_key()
    return {INTERNAL_KEY_PARAMETER: key} if key else {}


def from_entry_point(request: Any) -> bool:
    """Whether ``request`` comes from specdec's own entry points (it carries this server's internal key).

    A server started without ``specdec serve`` has no key, and its internal models accept every request.
    """
    key = internal_key()
    if key is None:
        return True
    try:
        params = json.loads(request.parameters() or "{}")
    except (ValueError, TypeError, AttributeError):
        return False
    return isinstance(params, dict) and params.get(INTERNAL_KEY_PARAMETER) == key


def internal_only(model: str) -> Any:
    """The error a client gets for calling an internal model directly."""
    return error_response(
        f"{model} is internal to the specdec deployment: send requests to the 'specdec' or 'specdec_stream' model"
    )

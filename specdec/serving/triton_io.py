"""The Triton side of one request: its inputs, its response sender (safe across threads), its error responses,
and what a model reads of its own configuration.

Shared by every Python model of the repository (``text_models``, ``engine_model``, ``entry_points``).
"""

from __future__ import annotations

import gc
import json
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from specdec.serving import pb
from specdec.serving.control import INTERNAL_KEY_PARAMETER, internal_key
from specdec.serving.protocol import TensorSpec


def error_response(message: str, invalid: bool = True, code: str | int | None = None) -> Any:
    """An error response; bad input is INVALID_ARG (gRPC INVALID_ARGUMENT), the rest INTERNAL unless ``code`` says.

    ``code``: a ``pb.utils.TritonError`` code name (``"UNAVAILABLE"``: draining or aborted; ``"CANCELLED"``)
    or the code an inner model's error carried, so a client sees the status the failure really has.
    """
    if code is None:
        code = "INVALID_ARG" if invalid else "INTERNAL"
    value = getattr(pb.utils.TritonError, code, None) if isinstance(code, str) else code
    error = pb.utils.TritonError(message) if value is None else pb.utils.TritonError(message, value)
    return pb.utils.InferenceResponse(output_tensors=[], error=error)


def code_name(code: str | int | None) -> str:
    """The name of a Triton error code (an inner model's error carries a number); INTERNAL when unknown."""
    if isinstance(code, str):
        return code
    names = {v: k for k, v in vars(pb.utils.TritonError).items() if k.isupper() and isinstance(v, int)}
    return names.get(code, "INTERNAL") if code is not None else "INTERNAL"


class ModelError(Exception):
    """An inner model's (BLS) error, with its Triton error code kept for the client's answer."""

    def __init__(self, message: str, code: str | int | None) -> None:
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
        #: called once, when the final response has gone
        self.on_final: Callable[[], None] | None = None

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
            flags = pb.utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL if final else 0
            try:
                if response is None:
                    self.sender.send(flags=flags)
                else:
                    self.sender.send(response, flags=flags)
            finally:
                if final and self.on_final is not None:
                    self.on_final()
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


def read_inputs(request: Any, specs: tuple[TensorSpec, ...]) -> dict[str, np.ndarray]:
    """The inputs of ``specs`` the client sent, as numpy arrays of this model's own (copies)."""
    found = {}
    for spec in specs:
        tensor = pb.utils.get_input_tensor_by_name(request, spec.name)
        if tensor is not None:
            found[spec.name] = np.array(tensor.as_numpy(), copy=True)  # owned (``bls_tensors``)
    return found


def response(tensors: Mapping[str, np.ndarray]) -> Any:
    """An inference response holding ``tensors``."""
    return pb.utils.InferenceResponse([pb.utils.Tensor(name, value) for name, value in tensors.items()])


def model_parameters(args: Mapping[str, str]) -> dict[str, str]:
    """The ``parameters`` block of the model's config.pbtxt as plain strings."""
    config = json.loads(args["model_config"])
    return {k: v.get("string_value", "") for k, v in config.get("parameters", {}).items()}


T = TypeVar("T")
D = TypeVar("D")


def parameter(params: Mapping[str, str], name: str, convert: Callable[[str], T], default: D) -> T | D:
    """A config parameter converted (``int``, ``float``); empty or absent means ``default``."""
    text = params.get(name, "").strip()
    return convert(text) if text else default


def export_dir(args: Mapping[str, str]) -> Path:
    """The export directory named (relative to the repository root) by the ``export_dir`` parameter."""
    model_dir = Path(args["model_repository"])  # .../<repository>/<model>
    return (model_dir.parent / model_parameters(args).get("export_dir", "..")).resolve()


def load_tokenizer(args: Mapping[str, str]) -> Any:
    from specdec.models.export_meta import load_export_metadata

    return load_export_metadata(export_dir(args), "target").tokenizer


def bls_tensors(inputs: Mapping[str, np.ndarray]) -> list[Any]:
    """The tensors of a BLS call, each made from its own copy of the array.

    Why copies, here and in ``read_inputs``: with ten requests failing at once beside good streams, the
    ``specdec_stream`` stub died freeing an object array of a request's inputs (``double free or corruption``; the
    core's stack ends in ``_choice``'s frame). With no array shared between a request's Python objects and the
    Python backend's tensors it did not happen again (``benchmarks/results/fault_storm.md``).
    """
    return [pb.utils.Tensor(name, np.array(value, copy=True)) for name, value in inputs.items()]


def release_senders() -> None:
    """Destroy every response sender that nothing uses any more, before the stub shuts down.

    Why: Triton deletes a decoupled request's response factory only when its Python sender
    object is destroyed, and the factory holds the model, so one sender still alive when the stub
    finalizes keeps the model from unloading and ``tritonserver`` fails its exit timeout (seen
    intermittently for ``specdec_stream``: the watcher's loop variable held the last client).
    Pollers keep no client past a poll; this collects senders only reachable from cycles.
    """
    gc.collect()

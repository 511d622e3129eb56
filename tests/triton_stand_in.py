"""A small stand-in for Triton's Python-backend utilities (``triton_python_backend_utils``) and for the server
that routes BLS calls between models, so a test builds every model of the repository and runs requests through
them in one process, without a server (the real-server tests stay in tests/test_serving.py and beside it).

It keeps what the models rely on: tensors by name, responses and their senders (the final flag; nothing may follow
it), errors with Triton's codes, BLS requests to another model (decoupled ones stream their responses), request
cancellation, custom metric families. ``install()`` makes it the utilities ``specdec.serving.pb`` hands out.
"""

from __future__ import annotations

import json
import queue
import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, ClassVar

import numpy as np

from specdec.serving import pb

TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1


class TritonError(Exception):
    UNKNOWN, INTERNAL, NOT_FOUND, INVALID_ARG, UNAVAILABLE, UNSUPPORTED, ALREADY_EXISTS, CANCELLED = range(8)

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self._message, self._code = message, code

    def message(self) -> str:
        return self._message

    def code(self) -> int:
        return self._code


class Tensor:
    def __init__(self, name: str, value: np.ndarray) -> None:
        self._name, self._value = name, np.asarray(value)

    def name(self) -> str:
        return self._name

    def as_numpy(self) -> np.ndarray:
        return self._value


class InferenceResponse:
    def __init__(self, output_tensors: Sequence[Tensor] = (), error: TritonError | None = None) -> None:
        self._tensors, self._error = list(output_tensors), error

    def output_tensors(self) -> list[Tensor]:
        return self._tensors

    def has_error(self) -> bool:
        return self._error is not None

    def error(self) -> TritonError | None:
        return self._error

    def outputs(self) -> dict[str, np.ndarray]:
        return {t.name(): t.as_numpy() for t in self._tensors}


class ResponseSender:
    """Collects a request's responses; a response after the final one is an error, as in Triton."""

    def __init__(self) -> None:
        self.responses: queue.Queue[tuple[InferenceResponse | None, bool]] = queue.Queue()
        self.closed = threading.Event()

    def send(self, response: InferenceResponse | None = None, flags: int = 0) -> None:
        if self.closed.is_set():
            raise TritonError("a response was sent after the final one")
        final = bool(flags & TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        if final:
            self.closed.set()
        self.responses.put((response, final))

    def stream(self, timeout_s: float = 120.0) -> Iterator[InferenceResponse]:
        """The responses as they come, until the final flag (an empty final flag yields nothing)."""
        while True:
            response, final = self.responses.get(timeout=timeout_s)
            if response is not None:
                yield response
            if final:
                return


class InferenceRequest:
    """A request to a model: from a client (``send_to``) or from another model over BLS (``exec``)."""

    server: StandInServer | None = None  # where BLS requests go (``install``)

    def __init__(
        self,
        model_name: str = "",
        inputs: Sequence[Tensor] = (),
        requested_output_names: Sequence[str] = (),
        request_id: str = "",
        parameters: Mapping[str, str] | None = None,
    ) -> None:
        self.model_name, self.inputs = model_name, {t.name(): t for t in inputs}
        self._id, self._parameters = request_id, dict(parameters or {})
        self.sender = ResponseSender()
        self.cancelled = threading.Event()

    def request_id(self) -> str:
        return self._id

    def parameters(self) -> str:
        return json.dumps(self._parameters)

    def get_response_sender(self) -> ResponseSender:
        return self.sender

    def is_cancelled(self) -> bool:
        return self.cancelled.is_set()

    def exec(self, decoupled: bool = False) -> Any:
        assert self.server is not None, "install() a stand-in server first"
        responses = self.server.send(self)
        return responses if decoupled else next(iter(responses))


def get_input_tensor_by_name(request: InferenceRequest, name: str) -> Tensor | None:
    return request.inputs.get(name)


class MetricFamily:
    """As Triton's: a family asked for by a name already registered is that family, and a metric of labels it
    holds is that metric, value and all (what a reloaded model meets: its predecessor's counters)."""

    COUNTER, GAUGE = "counter", "gauge"
    families: ClassVar[dict[str, dict[tuple[tuple[str, str], ...], Metric]]] = {}

    def __init__(self, name: str, description: str, kind: str) -> None:
        self.name, self.kind = name, kind
        self.metrics = MetricFamily.families.setdefault(name, {})

    def Metric(self, labels: Mapping[str, str]) -> Metric:
        return self.metrics.setdefault(tuple(sorted(labels.items())), Metric(dict(labels)))


class Metric:
    def __init__(self, labels: dict[str, str]) -> None:
        self.labels, self._value = labels, 0.0

    def increment(self, by: float) -> None:
        self._value += by

    def set(self, value: float) -> None:
        self._value = value

    def value(self) -> float:
        return self._value


class StandInServer:
    """Model instances by name; a request is executed as Triton would, its responses streamed back."""

    def __init__(self) -> None:
        self.models: dict[str, Any] = {}

    def send(self, request: InferenceRequest) -> Iterator[InferenceResponse]:
        model = self.models[request.model_name]
        out = model.execute([request])
        if out is not None:  # a non-decoupled model answers from execute, one response per request
            (response,) = out
            request.sender.send(response, TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return request.sender.stream()


def install(server: StandInServer | None = None) -> Any:
    """Make this module the utilities every serving model calls, routing BLS calls to ``server``; returns what
    it replaced (a test restores it with ``pb.use``)."""
    import sys

    module = sys.modules[__name__]
    InferenceRequest.server = server or StandInServer()
    return pb.use(module)


def model_args(model: str, repository: str, parameters: Mapping[str, object], instance: str = "") -> dict[str, str]:
    """The ``args`` Triton passes a model's ``initialize``."""
    config = {"parameters": {k: {"string_value": str(v)} for k, v in parameters.items()}}
    return {
        "model_config": json.dumps(config),
        "model_repository": f"{repository}/{model}",
        "model_name": model,
        "model_instance_name": instance or f"{model}_0",
    }

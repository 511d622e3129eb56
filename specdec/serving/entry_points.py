"""``specdec`` (unary) and ``specdec_stream`` (decoupled): the models clients call.

Each request runs preprocessing → specdec_engine (streaming its responses) → postprocessing per response, over
BLS from a worker thread of its own, so one instance serves any number of concurrent requests. A request for ``n``
choices runs ``n`` such pipelines, each on its own engine request (choice i samples with ``seed + i``), and every
response says its choice (``index``); the request ends when its last choice does.

What an entry point refuses, it refuses at once and before anything is tokenized: new requests while the server
drains (UNAVAILABLE, so a client retries on another replica), requests past its capacity (UNAVAILABLE), sizes
past its limits and malformed prompts (INVALID_ARGUMENT). A watcher polls the clients; one that went away is
cancelled in the engine (``Control.cancel``: Triton 2.51 passes a cancellation on through no BLS call), and when
the launcher aborts a drain every request still here ends with UNAVAILABLE.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import numpy as np

from specdec.runtime.sampling import InvalidRequestError
from specdec.serving import pb
from specdec.serving.control import Control
from specdec.serving.diagnostics import dump_threads_on_sigusr1
from specdec.serving.heartbeat import Heartbeat
from specdec.serving.inputs import Limits, parse_choices, parse_flag, parse_prompt, scalar
from specdec.serving.protocol import (
    ABORTED,
    CLIENT_INPUTS,
    DRAINING,
    ENGINE_MODEL,
    ENGINE_OUTPUTS,
    INDEX,
    INPUT_IDS,
    OVERLOADED,
    PARAMETER,
    POSTPROCESSING_MODEL,
    PREPROCESSING_INPUTS,
    PREPROCESSING_MODEL,
    PROMPT_IDS,
    RESETTING,
    STREAM,
    STREAM_NEEDS_DECOUPLED,
    TEXT_OUTPUTS,
    N,
    TensorSpec,
    array,
    coded,
)
from specdec.serving.responses import engine_error, parse_engine_response
from specdec.serving.triton_io import (
    Client,
    ModelError,
    bls_tensors,
    code_name,
    error_response,
    internal_parameters,
    model_parameters,
    parameter,
    raise_model_error,
    read_inputs,
    release_senders,
    response,
)
from specdec.serving.triton_metrics import InflightGauge, RefusalCounter, release_metrics

log = logging.getLogger(__name__)
#: how often the watcher looks at the clients and the launcher's abort flag
WATCH_POLL_S = 0.1
SEED = PARAMETER["seed"]
#: how Triton answers a call to a model whose stub died
STUB_UNHEALTHY = "is not healthy"


def refusal_reason(message: str, code: str) -> str:
    """Why a request was answered with an error, as ``specdec_refused_requests_total`` counts it."""
    if code == "INVALID_ARG":
        return "invalid"
    for prefix, reason in ((OVERLOADED, "overloaded"), (DRAINING, "draining"), (ABORTED, "aborted")):
        if message.startswith(prefix):
            return reason
    return "unavailable" if code == "UNAVAILABLE" else "internal"


class _Request:
    """One client request in flight: its choices' engine ids, and whose response is the last (``final``)."""

    def __init__(self, client: Client, choices: int) -> None:
        self.client = client
        self.engine_ids = [uuid.uuid4().hex for _ in range(choices)]
        self._open = choices
        self._lock = threading.Lock()

    def close_choice(self) -> bool:
        """One choice ended; whether it was the last (its response is the request's final one)."""
        with self._lock:
            self._open -= 1
            return self._open == 0


class _EntryPoint:
    """What ``specdec`` and ``specdec_stream`` share: admission, limits, the pipeline per choice, cancellation."""

    streaming = False

    def initialize(self, args: dict[str, str]) -> None:
        dump_threads_on_sigusr1()
        params = model_parameters(args)
        concurrency = parameter(params, "max_concurrency", int, 64)
        self._slots = threading.BoundedSemaphore(concurrency)
        self._capacity = concurrency + parameter(params, "max_queue", int, 256)  # running + waiting for a slot
        self._limits = Limits(
            **{name: parameter(params, name, int, default) for name, default in vars(Limits()).items()}
        )
        self._thread_name = f"specdec-{'stream' if self.streaming else 'unary'}"
        self._active: dict[str, Client] = {}  # engine request id -> client
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self._control = Control.from_env()
        # admitted and not yet answered, waiting for a slot included: what `specdec serve` drains
        self._inflight = InflightGauge(args.get("model_name", self._thread_name))
        self._refusals = RefusalCounter(args.get("model_name", self._thread_name))
        self._watcher = threading.Thread(target=self._watch, name="specdec-cancel", daemon=True)
        self._watcher.start()
        self.heartbeat = Heartbeat(self._control.directory, args.get("model_name", self._thread_name)).start()

    # -- admission ------------------------------------------------------------------------------------------------
    def execute(self, requests: list[Any]) -> None:
        for request in requests:
            client = Client(request, request.get_response_sender())
            if self._control.draining():  # refused at once, so a client retries elsewhere while the rest finish
                client.send(self._error(DRAINING, "UNAVAILABLE"), final=True)
                continue
            if self._control.resetting():  # a stub is being replaced: nothing admitted can be answered meanwhile
                client.send(self._error(RESETTING, "UNAVAILABLE"), final=True)
                continue
            if self._inflight.value >= self._capacity:  # back-pressure: no unbounded queue of waiting threads
                message = f"{OVERLOADED} ({self._inflight.value} requests in flight): retry later"
                client.send(self._error(message, "UNAVAILABLE"), final=True)
                continue
            # counted here, not in the thread, so a drain that reads 0 has really seen this request; and uncounted
            # when its answer goes, not when its thread ends (one blocked on a stub that died is answered anyway)
            self._count(+1)
            client.on_final = lambda: self._count(-1)
            # daemon threads: a request thread that never returns must not keep the stub alive past unload
            threading.Thread(target=self._answer_in_slot, args=(client,), name=self._thread_name, daemon=True).start()
        return None

    def _error(self, message: str, code: str) -> Any:
        """An error response with Triton code ``code``, counted by its reason; a stream's message is led by its
        gRPC status (``protocol.coded``), the only way a stream client learns it."""
        self._refusals.count(refusal_reason(message, code))
        return error_response(coded(message, code) if self.streaming else message, code=code)

    def _count(self, delta: int) -> None:
        with self._lock:
            self._inflight.set(self._inflight.value + delta)

    def _answer_in_slot(self, client: Client) -> None:
        """At most ``max_concurrency`` requests run the pipeline at once; the rest wait their turn."""
        with self._slots:
            if self._closing.is_set() or self._control.aborting() or self._control.resetting():
                client.send(self._error(ABORTED, "UNAVAILABLE"), final=True)
                return
            self._answer(client)

    def checked(self, inputs: dict[str, np.ndarray]) -> tuple[bool, int]:
        """Whether to stream and how many choices, once sizes and the prompt passed their checks (before any
        model is called); the stream flag the engine reads is set in ``inputs``."""
        self._limits.check(inputs)  # sizes first, before anything is decoded or tokenized
        parse_prompt(inputs)
        value = parse_flag(inputs, STREAM.name)
        stream = self.streaming if value is None else value
        if stream and not self.streaming:
            raise InvalidRequestError(STREAM_NEEDS_DECOUPLED)
        inputs[STREAM.name] = array(STREAM, stream)
        return stream, parse_choices(inputs, self.streaming)

    # -- one request ----------------------------------------------------------------------------------------------
    def _answer(self, client: Client) -> None:
        try:
            inputs = read_inputs(client.request, CLIENT_INPUTS)
            stream, choices = self.checked(inputs)
        except InvalidRequestError as exc:
            client.send(self._error(str(exc), "INVALID_ARG"), final=True)
            return
        request = _Request(client, choices)
        with self._lock:
            self._active.update((engine_id, client) for engine_id in request.engine_ids)
        try:
            prompt = self._prompt_ids(inputs)
            threads = [
                threading.Thread(target=self._choice, args=(request, i, prompt, inputs, stream), daemon=True)
                for i in range(1, choices)
            ]
            for thread in threads:
                thread.start()
            self._choice(request, 0, prompt, inputs, stream)
            for thread in threads:
                thread.join()
        except Exception as exc:
            self._fail(client, exc)
        finally:
            with self._lock:
                for engine_id in request.engine_ids:
                    self._active.pop(engine_id, None)
            for engine_id in request.engine_ids:
                self._control.forget_cancel(engine_id)

    def _choice(
        self, request: _Request, index: int, prompt: dict[str, np.ndarray], inputs: dict[str, np.ndarray], stream: bool
    ) -> None:
        """Choice ``index``: its engine request, each response post-processed and sent with its index; a failure
        ends the whole request with its code."""
        client = request.client
        try:
            params = {k: v for k, v in inputs.items() if k not in (*(s.name for s in PREPROCESSING_INPUTS), N.name)}
            params.pop(PROMPT_IDS.name, None)
            seed = scalar(inputs, SEED)
            if index and seed is not None:
                params[SEED.name] = array(SEED, int(seed) + index)
            answered = False
            for tensors, finished in self._pipeline(prompt, params, request.engine_ids[index]):
                tensors[INDEX.name] = array(INDEX, index)
                last = finished and request.close_choice()
                if stream or last:
                    client.send(response(tensors), final=last)
                answered = answered or finished
            if not answered:
                raise RuntimeError("the engine ended the request without an answer")
        except Exception as exc:
            self._fail(client, exc)
            for engine_id in request.engine_ids:  # the request is over: its other choices stop at their next step
                self._control.cancel(engine_id)

    def _fail(self, client: Client, exc: Exception) -> None:
        """End the client's request with ``exc``'s code (a no-op if it already ended); never a traceback to it.

        A model whose stub died answers its callers with Triton's "not healthy": a fault of the server, which the
        launcher is about to repair (``RESET``), so UNAVAILABLE: the client may retry.
        """
        if client.done:
            return
        if isinstance(exc, InvalidRequestError):
            client.send(self._error(str(exc), "INVALID_ARG"), final=True)
        elif isinstance(exc, ModelError) and (STUB_UNHEALTHY in str(exc) or self._control.resetting()):
            client.send(self._error(f"{RESETTING} ({exc})", "UNAVAILABLE"), final=True)
        elif isinstance(exc, ModelError):
            client.send(self._error(str(exc), code_name(exc.code)), final=True)
        else:  # the traceback goes to the log only
            log.exception("request failed", exc_info=exc)
            client.send(self._error(f"internal error: {type(exc).__name__}: {exc}", "INTERNAL"), final=True)

    def _prompt_ids(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The engine's ``input_ids``: the client's token ids, or what preprocessing makes of its text."""
        if PROMPT_IDS.name in inputs:
            return {INPUT_IDS.name: np.asarray(inputs[PROMPT_IDS.name], dtype=np.int32).reshape(-1)}
        prompt = {k: v for k, v in inputs.items() if k in {s.name for s in PREPROCESSING_INPUTS}}
        return _bls(PREPROCESSING_MODEL, prompt, (INPUT_IDS,))

    def _pipeline(
        self, prompt: dict[str, np.ndarray], params: dict[str, np.ndarray], engine_id: str
    ) -> Iterator[tuple[dict[str, np.ndarray], bool]]:
        """Yield (client tensors, finished) per engine response."""
        engine = pb.utils.InferenceRequest(
            model_name=ENGINE_MODEL,
            request_id=engine_id,
            requested_output_names=[s.name for s in ENGINE_OUTPUTS],
            inputs=bls_tensors({**prompt, **params}),
            parameters=internal_parameters(),
        )
        answers = engine.exec(decoupled=True)
        ended = False
        try:
            for answer in answers:
                if answer.has_error():
                    raise_model_error(answer.error())
                if not answer.output_tensors():
                    continue  # the empty final flag
                outputs = {t.name(): t.as_numpy() for t in answer.output_tensors()}
                message, code = engine_error(outputs)
                if message:  # in band, with its code (``responses.engine_failure``)
                    raise ModelError(message, code)
                yield _bls(POSTPROCESSING_MODEL, outputs, TEXT_OUTPUTS), parse_engine_response(outputs).finished
            ended = True
        finally:
            if not ended:
                self._control.cancel(engine_id)
                _read_to_the_end(answers)

    # -- cancellation and abort -----------------------------------------------------------------------------------
    def _watch(self) -> None:
        cancelled: set[str] = set()
        while not self._closing.wait(WATCH_POLL_S):
            if self._control.aborting():
                self._abort_all(ABORTED)
            elif self._control.resetting():
                self._abort_all(RESETTING)
            self._poll_clients(cancelled)

    def _abort_all(self, why: str) -> None:
        """The drain ran out (a second signal, or its timeout), or a stub failed: every request still here ends
        now, UNAVAILABLE.

        The engine is told too, so its slots free at the next step; the request threads' later answers are
        dropped by ``Client.send``.
        """
        with self._lock:
            active = [(engine_id, client) for engine_id, client in self._active.items() if not client.done]
        for engine_id, client in active:
            if not client.done:
                client.send(self._error(why, "UNAVAILABLE"), final=True)
            self._control.cancel(engine_id)

    def _poll_clients(self, cancelled: set[str]) -> None:
        """Tell the engine about clients gone since the last poll (``cancelled``: already told).

        A frame of its own per poll: a loop variable left in the watcher's frame would keep the
        last client (and its response sender) alive while the server idles (``release_senders``).
        """
        with self._lock:
            active = list(self._active.items())
        for engine_id, client in active:
            if engine_id in cancelled or not client.is_cancelled():
                continue
            cancelled.add(engine_id)
            self._control.cancel(engine_id)
        cancelled &= {engine_id for engine_id, _ in active}

    def finalize(self) -> None:
        """Stop the watcher and let running requests end (a few seconds at most) before the stub goes."""
        self.heartbeat.exit_if_orphaned()
        self._closing.set()
        self._watcher.join(5)
        deadline = time.monotonic() + 5
        while self._active and time.monotonic() < deadline:
            time.sleep(WATCH_POLL_S)
        release_senders()
        release_metrics()
        self.heartbeat.stop()


def _read_to_the_end(answers: Any) -> None:
    """Take a decoupled BLS call's answers up to its final flag, here, before the iterator is dropped.

    An iterator dropped unfinished waits for that flag in its C++ destructor, with the GIL released in the middle
    of a deallocation (python_backend's ``ResponseIterator``), wherever the last reference goes: a failed request's
    traceback. The engine answers a cancelled request at its next step, so this returns promptly.
    """
    while True:
        try:
            next(answers)
        except StopIteration:
            return


def _bls(model: str, inputs: dict[str, np.ndarray], outputs: tuple[TensorSpec, ...]) -> dict[str, np.ndarray]:
    """Call a non-decoupled model; its output tensors as numpy, or its error (with its code) as ``ModelError``."""
    request = pb.utils.InferenceRequest(
        model_name=model,
        requested_output_names=[s.name for s in outputs],
        inputs=bls_tensors(inputs),
        parameters=internal_parameters(),
    )
    answer = request.exec()
    if answer.has_error():
        raise_model_error(answer.error())
    return {t.name(): t.as_numpy() for t in answer.output_tensors()}


class UnaryModel(_EntryPoint):
    """``specdec``: one complete response per ``infer``."""


class StreamModel(_EntryPoint):
    """``specdec_stream`` (decoupled): a partial response per engine step, the last one flagged final."""

    streaming = True

"""The Python-backend models of the repository; each ``model.py`` there imports one class from here.

Thin adapters: tensors in, ``specdec.serving.protocol`` validates, ``EngineService`` decodes,
``specdec.runtime.text`` decides the text. Nothing here decodes or samples.

- ``Preprocessing``: ``text_input`` → ``input_ids`` (tokenizer, optional chat template).
- ``EngineModel`` (decoupled, one instance): owns the ``EngineService``s — the draft and
  target sessions and the long-lived loops that admit requests between ragged steps. Every
  ``ems``/``ar`` request, from either entry point, lands in one batch (``ar`` requests are
  EMS-SD requests with no drafts, sharing the same steps at one row each); every
  ``dsbd``/``beam`` request lands in the beam loop's batch (``beam`` = DSBD with no draft
  layers), which runs beside it over the same weights with its own KV caches.
- ``Postprocessing``: stateless incremental detokenizer. Engine responses carry all ids so far
  and how many earlier responses covered; the text delta is computed from ids alone, so the
  engine asks its service for no text and never detokenizes on its decoding thread.
- ``StreamModel`` (``specdec_stream``, decoupled) and ``UnaryModel`` (``specdec``): the entry
  points. Both run preprocessing → engine → postprocessing over BLS from a worker thread, so
  one instance serves any number of concurrent requests, and both watch their clients so a
  cancelled or disconnected request stops decoding at the next step.
"""

from __future__ import annotations

import gc
import itertools
import json
import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from specdec.runtime.drafters import ForestDrafter
from specdec.runtime.methods import DEFAULT_METHOD, beam_method, get_method
from specdec.runtime.request import Request, RequestMetrics
from specdec.runtime.sampling import InvalidRequestError
from specdec.runtime.text import decode_tokens, encode_text, text_delta
from specdec.serving import protocol
from specdec.serving.control import Control
from specdec.serving.diagnostics import dump_threads_on_sigusr1, fault_hook
from specdec.serving.service import EngineService, ServiceStoppedError, StreamEvent, outcome_of
from specdec.serving.triton_io import (
    Client,
    ModelError,
    error_response,
    from_entry_point,
    internal_only,
    internal_parameters,
    raise_model_error,
)
from specdec.serving.triton_metrics import EngineMetrics, InflightGauge

if TYPE_CHECKING:
    from specdec.runtime.engine import Engine

try:  # only inside Triton's Python-backend stub
    import triton_python_backend_utils as pb_utils
except ImportError:  # pragma: no cover - imported for documentation or tests without Triton
    pb_utils = None

log = logging.getLogger(__name__)

CANCEL_POLL_S = 0.1
DRAINING = "the server is draining (shutting down) and admits no new requests: retry on another replica"
ABORTED = "the server is shutting down: this request was aborted before it finished"


def _parameters(args: dict[str, str]) -> dict[str, str]:
    """The ``parameters`` block of the model's config.pbtxt as plain strings."""
    config = json.loads(args["model_config"])
    return {k: v.get("string_value", "") for k, v in config.get("parameters", {}).items()}


def _export_dir(args: dict[str, str]) -> Path:
    """The export directory named (relative to the repository root) by the ``export_dir`` parameter."""
    model_dir = Path(args["model_repository"])  # .../<repository>/<model>
    return (model_dir.parent / _parameters(args).get("export_dir", "..")).resolve()


def _load_tokenizer(args: dict[str, str]) -> Any:
    from specdec.models.export_meta import load_export_metadata

    return load_export_metadata(_export_dir(args), "target").tokenizer


def _read(request: Any, specs: tuple[protocol.TensorSpec, ...]) -> dict[str, np.ndarray]:
    """The inputs of ``specs`` the client sent, as numpy arrays."""
    found = {}
    for spec in specs:
        tensor = pb_utils.get_input_tensor_by_name(request, spec.name)
        if tensor is not None:
            found[spec.name] = tensor.as_numpy()
    return found


class Preprocessing:
    """``text_input`` → ``input_ids``."""

    def initialize(self, args: dict[str, str]) -> None:
        dump_threads_on_sigusr1()
        self.tokenizer = _load_tokenizer(args)

    def execute(self, requests: list[Any]) -> list[Any]:
        responses = []
        for request in requests:
            if not from_entry_point(request):
                responses.append(internal_only(protocol.PREPROCESSING_MODEL))
                continue
            try:
                text, chat = protocol.parse_prompt(_read(request, (protocol.TEXT_INPUT, protocol.APPLY_CHAT_TEMPLATE)))
                ids = encode_text(self.tokenizer, text, chat)
                if not ids:
                    raise InvalidRequestError("input 'text_input' tokenizes to nothing")
                responses.append(
                    pb_utils.InferenceResponse(
                        [pb_utils.Tensor(protocol.INPUT_IDS.name, protocol.array(protocol.INPUT_IDS, ids))]
                    )
                )
            except InvalidRequestError as exc:
                responses.append(error_response(str(exc)))
        return responses


class Postprocessing:
    """Engine response → ``text_output`` (a delta when streaming) + the new ids + metrics."""

    def initialize(self, args: dict[str, str]) -> None:
        dump_threads_on_sigusr1()
        self.tokenizer = _load_tokenizer(args)

    def _decode(self, ids: Any) -> str:
        return decode_tokens(self.tokenizer, ids)

    def execute(self, requests: list[Any]) -> list[Any]:
        responses = []
        for request in requests:
            if not from_entry_point(request):
                responses.append(internal_only(protocol.POSTPROCESSING_MODEL))
                continue
            try:
                inputs = _read(request, protocol.ENGINE_OUTPUTS)
                engine = protocol.parse_engine_response(inputs, vocab_size=len(self.tokenizer))
                delta = text_delta(self._decode, engine.output_ids, engine.sent_tokens, engine.finished, engine.stops)
                outputs = protocol.client_response(delta, inputs, engine)
                responses.append(pb_utils.InferenceResponse([pb_utils.Tensor(k, v) for k, v in outputs.items()]))
            except InvalidRequestError as exc:
                responses.append(error_response(str(exc)))
            except Exception as exc:  # the traceback (server paths) goes to the log, not to the client
                log.exception("postprocessing failed")
                responses.append(error_response(f"postprocessing failed: {type(exc).__name__}", invalid=False))
        return responses


@dataclass(eq=False)
class _Stream:
    """One engine request's Triton side: where its responses go and what they already covered."""

    client: Client
    stream: bool
    stops: tuple[str, ...]
    ids: list[int] = field(default_factory=list)
    sent: int = 0


def _param(params: Mapping[str, str], name: str, convert: Callable[[str], Any], default: Any = None) -> Any:
    """A config parameter converted (``int``, ``float``); empty or absent means ``default``."""
    text = params.get(name, "").strip()
    return convert(text) if text else default


def served_engine(export_dir: Path, params: Mapping[str, str], device_id: int = 0) -> Engine:
    """The engine ``specdec_engine`` serves, from its config parameters (also a benchmark's local twin of it).

    Empty parameters mean the defaults; ``max_batch`` and ``intra_op_threads`` 0 mean "as exported" and
    "all cores". An ONNX Runtime export on the CPU runs without torch (the loops are numpy); where a
    backend brings torch (TensorRT's device caches) it runs on one thread, since its threads would
    contend with the backend's (``benchmarks/results/ort_contention.md``).
    """
    from specdec.runtime.draft_length import DraftLength, parse_prices
    from specdec.runtime.engine import Engine

    def number(name: str, default: int | None = None) -> int | None:
        return _param(params, name, int, default)

    def cost(name: str, default: float | None = None) -> float | None:
        """An adaptive draft cost (0 is a price: a GPU's verified row)."""
        return _param(params, name, float, default)

    return Engine.from_export(
        export_dir,
        max_batch=number("max_batch") or None,
        threads=number("intra_op_threads") or None,
        num_draft_tokens=number("num_draft_tokens", 4),
        drafter=params.get("drafter") or None,
        torch_threads=1,
        draft_length=DraftLength(
            verify_cost=cost("verify_cost", DraftLength.verify_cost),
            draft_cost=cost("draft_cost"),
            verify_by_batch=parse_prices(params.get("verify_cost_by_batch", "")),
            draft_by_batch=parse_prices(params.get("draft_cost_by_batch", "")),
        )
        if number("adaptive_draft", 0)
        else None,
        device_id=device_id,
    )


class EngineModel:
    """The decoupled engine: one ``EngineService`` for every request of both entry points."""

    def initialize(self, args: dict[str, str]) -> None:
        dump_threads_on_sigusr1()
        params = _parameters(args)
        # each instance on its own device: Triton's KIND_GPU instance groups name it (KIND_CPU: 0, the host)
        device = int(args.get("model_instance_device_id") or 0) if args.get("model_instance_kind") == "GPU" else 0
        self.engine = served_engine(_export_dir(args), params, device_id=device)
        self.engine.fault_hook = fault_hook()
        self.engine.prefill_budget = _param(params, "prefill_budget", int, 0) or None
        self.default_max_tokens = _param(params, "default_max_tokens", int, 0) or 64
        self.service = EngineService(self.engine, DEFAULT_METHOD).start()
        # beam requests run in a second loop over the same weights (its own caches): the speculative beam method
        # where the drafter can beam-sample forests (the draft model, alone or in the hybrid drafter), target-only
        # beam decoding otherwise
        self.has_draft_model = isinstance(self.engine.drafter, ForestDrafter)
        self.beam_service = EngineService(self.engine.sibling(), beam_method(self.has_draft_model)).start()
        self._ids = itertools.count()
        self._streams: dict[str, _Stream] = {}
        self._external: dict[str, str] = {}  # Triton request id (set by the entry points) -> engine request id
        self._lock = threading.Lock()
        self._outbox: queue.Queue[tuple[_Stream, StreamEvent] | None] = queue.Queue()
        self._closing = threading.Event()
        self._control = Control.from_env()
        self.metrics = EngineMetrics(args.get("model_instance_name", protocol.ENGINE_MODEL))
        # responses leave from their own thread so the decoding loop never waits on Triton's IPC
        self._sender = threading.Thread(target=self._send_loop, name="specdec-send", daemon=True)
        self._watcher = threading.Thread(target=self._watch, name="specdec-watch", daemon=True)
        self._sender.start()
        self._watcher.start()

    def execute(self, requests: list[Any]) -> None:
        for request in requests:
            client = Client(request, request.get_response_sender())
            if not from_entry_point(request):  # raw token ids and cancels of any id stay with the entry points
                client.send(internal_only(protocol.ENGINE_MODEL), final=True)
                continue
            cancel = pb_utils.get_input_tensor_by_name(request, protocol.CANCEL_REQUEST_ID.name)
            if cancel is not None:
                self._cancel_external(cancel.as_numpy(), client)
                continue
            try:
                inputs = _read(request, (protocol.INPUT_IDS, *protocol.PARAMETERS))
                gen = protocol.parse_generation(
                    inputs, max_len=self.engine.max_len, default_max_tokens=self.default_max_tokens
                )
                request_id = f"{request.request_id() or 'triton'}#{next(self._ids)}"
                method = get_method(gen.method)
                if method.needs_draft_model and not self.has_draft_model:
                    raise InvalidRequestError(
                        f"method {method.name!r} needs a draft model and this deployment has "
                        f"none (export with --draft); use {self.beam_service.method.name!r} "
                        "for beam decoding without one"
                    )
                req = Request(
                    tuple(protocol.parse_input_ids(inputs)),
                    gen.max_tokens,
                    gen.sampling,
                    gen.num_draft_tokens,
                    gen.stop,
                    request_id=request_id,
                    beam=gen.beam,
                )
                service = self.beam_service if method.beams else self.service
                stream = _Stream(client, gen.stream, gen.stop)
                with self._lock:
                    self._streams[request_id] = stream
                    if request.request_id():
                        self._external[request.request_id()] = request_id
                try:
                    # no text: postprocessing re-decodes it from the ids, off the decoding thread
                    service.submit(
                        req, lambda event, s=stream: self._outbox.put((s, event)), text=False, timeout_s=gen.timeout_s
                    )
                except Exception:
                    with self._lock:
                        self._streams.pop(request_id, None)
                    raise
            except (InvalidRequestError, ServiceStoppedError) as exc:
                client.send(error_response(str(exc)), final=True)
        return None

    def _cancel_external(self, value: np.ndarray, client: Client) -> None:
        """A control request from an entry point whose client went away: cancel that engine request."""
        external = protocol.parse_text(value, protocol.CANCEL_REQUEST_ID.name)
        with self._lock:
            request_id = self._external.get(external)
        if request_id is not None:
            self._cancel(request_id)
        client.send(final=True)

    def _take_cancels(self) -> None:
        """The entry points' cancels (``Control.cancel``) of requests this instance holds."""
        wanted = self._control.cancels()
        if not wanted:
            return
        with self._lock:
            mine = [(external, self._external[external]) for external in wanted if external in self._external]
        for external, request_id in mine:
            self._cancel(request_id)
            self._control.forget_cancel(external)

    def _cancel(self, request_id: str) -> None:
        """Cancel in whichever loop holds the request (the other one does not know it: a no-op)."""
        if not self.service.cancel(request_id):
            self.beam_service.cancel(request_id)

    def _send_loop(self) -> None:
        while (item := self._outbox.get()) is not None:
            stream, event = item
            try:
                self._send(stream, event)
            except Exception:  # a vanished client must not stop the others' responses
                log.exception("could not send a response for %s", event.request_id)

    def _send(self, stream: _Stream, event: StreamEvent) -> None:
        if not event.finished:
            stream.ids.extend(event.new_token_ids)
            if stream.stream and event.metrics is not None:
                self._respond(stream, event.metrics, "", finished=False)
            return
        with self._lock:
            self._streams.pop(event.request_id, None)
            external = stream.client.request.request_id()
            if external and self._external.get(external) == event.request_id:
                del self._external[external]
        output = event.output
        assert output is not None
        self.metrics.request_done(outcome_of(output), output.metrics)
        if not output.error:
            stream.ids = list(output.token_ids)
        self._respond(stream, output.metrics, output.finish_reason or "", finished=True, error=output.error or "")

    def _respond(
        self, stream: _Stream, metrics: RequestMetrics, finish_reason: str, finished: bool, error: str = ""
    ) -> None:
        outputs = protocol.engine_response(
            stream.ids, stream.sent, finished, stream.stops, finish_reason, metrics, error
        )
        tensors = [pb_utils.Tensor(name, value) for name, value in outputs.items()]
        stream.client.send(pb_utils.InferenceResponse(tensors), final=finished)
        stream.sent = len(stream.ids)

    def _watch(self) -> None:
        """Cancel requests whose client went away or whose deadline passed; publish the step metrics."""
        while not self._closing.wait(CANCEL_POLL_S):
            self._poll_clients()
            self._take_cancels()
            for service in (self.service, self.beam_service):
                service.expire()
            try:
                self.metrics.update(self.service, self.beam_service)
            except Exception:
                log.exception("could not update metrics")

    def _poll_clients(self) -> None:
        """One look at every client, in a frame of its own: see ``_release_senders``."""
        with self._lock:
            streams = list(self._streams.items())
        for request_id, stream in streams:
            if stream.client.is_cancelled():
                self._cancel(request_id)

    def finalize(self) -> None:
        self._closing.set()
        self.service.stop(drain=False, timeout=10)
        self.beam_service.stop(drain=False, timeout=10)
        self._outbox.put(None)
        self._sender.join(5)
        self._watcher.join(5)
        _release_senders()


class _EntryPoint:
    """What ``specdec`` and ``specdec_stream`` share: the pipeline over BLS, one thread per request, cancellation.

    Each request runs preprocessing -> specdec_engine (streaming its responses) -> postprocessing per
    response. A watcher polls the client requests; when one is cancelled (client gone), it tells the
    engine by a ``cancel_request_id`` request, because Triton 2.51 passes cancellation on neither
    through ensembles nor through BLS calls.
    """

    streaming = False

    def initialize(self, args: dict[str, str]) -> None:
        dump_threads_on_sigusr1()
        params = _parameters(args)
        concurrency = _param(params, "max_concurrency", int, 64)
        self._slots = threading.BoundedSemaphore(concurrency)
        self._capacity = concurrency + _param(params, "max_queue", int, 256)  # running + waiting for a slot
        self._limits = protocol.Limits(
            **{name: _param(params, name, int, default) for name, default in vars(protocol.Limits()).items()}
        )
        self._thread_name = f"specdec-{'stream' if self.streaming else 'unary'}"
        self._active: dict[str, Client] = {}  # engine request id -> client
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self._control = Control.from_env()
        # admitted and not yet answered, waiting for a slot included: what `specdec serve` drains
        self._inflight = InflightGauge(args.get("model_name", self._thread_name))
        self._watcher = threading.Thread(target=self._watch, name="specdec-cancel", daemon=True)
        self._watcher.start()

    def execute(self, requests: list[Any]) -> None:
        for request in requests:
            client = Client(request, request.get_response_sender())
            if self._control.draining():  # refused at once, so a client retries elsewhere while the rest finish
                client.send(error_response(DRAINING, code="UNAVAILABLE"), final=True)
                continue
            if self._inflight.value >= self._capacity:  # back-pressure: no unbounded queue of waiting threads
                client.send(
                    error_response(
                        f"the server is overloaded ({self._inflight.value} requests in flight): retry later",
                        code="UNAVAILABLE",
                    ),
                    final=True,
                )
                continue
            self._count(+1)  # here, not in the thread: a drain that reads 0 has really seen this request
            # daemon threads: a request thread that never returns must not keep the stub alive past unload
            threading.Thread(target=self._answer_in_slot, args=(client,), name=self._thread_name, daemon=True).start()
        return None

    def _count(self, delta: int) -> None:
        with self._lock:
            self._inflight.set(self._inflight.value + delta)

    def _answer_in_slot(self, client: Client) -> None:
        """At most ``max_concurrency`` requests run the pipeline at once; the rest wait their turn."""
        try:
            with self._slots:
                if self._closing.is_set() or self._control.aborting():
                    client.send(error_response(ABORTED, code="UNAVAILABLE"), final=True)
                    return
                self._answer(client)
        finally:
            self._count(-1)

    def _answer(self, client: Client) -> None:
        engine_id = uuid.uuid4().hex
        with self._lock:
            self._active[engine_id] = client
        try:
            inputs = _read(client.request, protocol.CLIENT_INPUTS)
            stream = self._stream_flag(inputs)
            answered = False
            for tensors, finished in self._pipeline(inputs, stream, engine_id):
                if stream or finished:
                    client.send(pb_utils.InferenceResponse(tensors), final=finished)
                    answered = answered or finished
            if not answered:
                raise RuntimeError("the engine ended the request without an answer")
        except InvalidRequestError as exc:
            client.send(error_response(str(exc)), final=True)
        except ModelError as exc:
            client.send(error_response(str(exc), code=exc.code), final=True)
        except Exception as exc:  # never leave a client without an answer; the traceback goes to the log only
            log.exception("request failed")
            client.send(error_response(f"internal error: {type(exc).__name__}: {exc}", invalid=False), final=True)
        finally:
            with self._lock:
                self._active.pop(engine_id, None)
            self._control.forget_cancel(engine_id)

    def _stream_flag(self, inputs: dict[str, np.ndarray]) -> bool:
        self._limits.check(inputs)  # sizes first, before anything is decoded or tokenized
        protocol.parse_prompt(inputs)  # the cheap checks first, before any model is called
        value = protocol.parse_flag(inputs, protocol.STREAM.name)
        stream = self.streaming if value is None else value
        if stream and not self.streaming:
            raise InvalidRequestError(protocol.STREAM_NEEDS_DECOUPLED)
        inputs[protocol.STREAM.name] = protocol.array(protocol.STREAM, stream)
        return stream

    def _pipeline(self, inputs: dict[str, np.ndarray], stream: bool, engine_id: str) -> Any:
        """Yield (client tensors, finished) per engine response."""
        prompt = {k: v for k, v in inputs.items() if k in (protocol.TEXT_INPUT.name, protocol.APPLY_CHAT_TEMPLATE.name)}
        (pre,) = _bls(protocol.PREPROCESSING_MODEL, prompt, (protocol.INPUT_IDS,))
        params = {k: v for k, v in inputs.items() if k not in prompt}
        engine = pb_utils.InferenceRequest(
            model_name=protocol.ENGINE_MODEL,
            request_id=engine_id,
            requested_output_names=[s.name for s in protocol.ENGINE_OUTPUTS],
            inputs=[pb_utils.Tensor(k, v) for k, v in {**pre, **params}.items()],
            parameters=internal_parameters(),
        )
        for response in engine.exec(decoupled=True):
            if response.has_error():
                raise_model_error(response.error())
            if not response.output_tensors():
                continue  # the empty final flag
            outputs = {t.name(): t.as_numpy() for t in response.output_tensors()}
            failure = protocol.engine_error(outputs)
            if failure:  # in band (protocol.ENGINE_ERROR): it failed inside the engine, INTERNAL
                raise ModelError(failure, getattr(pb_utils.TritonError, "INTERNAL", None))
            (post,) = _bls(protocol.POSTPROCESSING_MODEL, outputs, protocol.CLIENT_OUTPUTS)
            yield [pb_utils.Tensor(k, v) for k, v in post.items()], protocol.parse_engine_response(outputs).finished

    def _watch(self) -> None:
        cancelled: set[str] = set()
        while not self._closing.wait(CANCEL_POLL_S):
            if self._control.aborting():
                self._abort_all()
            self._poll_clients(cancelled)

    def _abort_all(self) -> None:
        """The drain ran out (a second signal, or its timeout): every request still here ends now, UNAVAILABLE.

        The engine is told too, so its slots free at the next step; the request threads' later answers are
        dropped by ``Client.send``.
        """
        with self._lock:
            active = [(engine_id, client) for engine_id, client in self._active.items() if not client.done]
        for engine_id, client in active:
            if client.send(error_response(ABORTED, code="UNAVAILABLE"), final=True):
                self._cancel_in_engine(engine_id)

    def _poll_clients(self, cancelled: set[str]) -> None:
        """Tell the engine about clients gone since the last poll (``cancelled``: already told).

        A frame of its own per poll: a loop variable left in the watcher's frame would keep the
        last client (and its response sender) alive while the server idles; see ``_release_senders``.
        """
        with self._lock:
            active = list(self._active.items())
        for engine_id, client in active:
            if engine_id in cancelled or not client.is_cancelled():
                continue
            cancelled.add(engine_id)
            self._cancel_in_engine(engine_id)
        cancelled &= {engine_id for engine_id, _ in active}

    def _cancel_in_engine(self, engine_id: str) -> None:
        """Tell the engine instance that holds ``engine_id`` to cancel it: a cancel file every instance looks
        for (``Control.cancel``), or without a control directory a control request to the one instance."""
        if self._control.cancel(engine_id):
            return
        try:
            cancel = pb_utils.InferenceRequest(
                model_name=protocol.ENGINE_MODEL,
                requested_output_names=[],
                parameters=internal_parameters(),
                inputs=[pb_utils.Tensor(protocol.CANCEL_REQUEST_ID.name, protocol.as_bytes(engine_id))],
            )
            for _ in cancel.exec(decoupled=True):
                pass
        except Exception:
            log.exception("could not cancel %s", engine_id)

    def finalize(self) -> None:
        """Stop the watcher and let running requests end (a few seconds at most) before the stub goes."""
        self._closing.set()
        self._watcher.join(5)
        deadline = time.monotonic() + 5
        while self._active and time.monotonic() < deadline:
            time.sleep(CANCEL_POLL_S)
        _release_senders()


def _release_senders() -> None:
    """Destroy every response sender that nothing uses any more, before the stub shuts down.

    Why: Triton deletes a decoupled request's response factory only when its Python sender
    object is destroyed, and the factory holds the model, so one sender still alive when the stub
    finalizes keeps the model from unloading and ``tritonserver`` fails its exit timeout (seen
    intermittently for ``specdec_stream``: the watcher's loop variable held the last client).
    Pollers keep no client past a poll; this collects senders only reachable from cycles.
    """
    gc.collect()


def _bls(model: str, inputs: dict[str, np.ndarray], outputs: tuple[protocol.TensorSpec, ...]) -> tuple[dict, ...]:
    """Call a non-decoupled model; its output tensors as numpy, or its error (with its code) as ``ModelError``."""
    request = pb_utils.InferenceRequest(
        model_name=model,
        requested_output_names=[s.name for s in outputs],
        inputs=[pb_utils.Tensor(k, v) for k, v in inputs.items()],
        parameters=internal_parameters(),
    )
    response = request.exec()
    if response.has_error():
        raise_model_error(response.error())
    return ({t.name(): t.as_numpy() for t in response.output_tensors()},)


class UnaryModel(_EntryPoint):
    """``specdec``: one complete response per ``infer``."""


class StreamModel(_EntryPoint):
    """``specdec_stream`` (decoupled): a partial response per engine step, the last one flagged final."""

    streaming = True

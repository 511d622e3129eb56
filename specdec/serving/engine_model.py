"""``specdec_engine``: the one engine of a deployment instance, decoupled, fed only by the entry points.

It owns the ``EngineService``s: the draft and target sessions and the long-lived loops that admit requests
between ragged steps. Every ``ems``/``ar`` request lands in one batch (``ar`` requests are EMS-SD requests with no
drafts, sharing the same steps at one row each); every ``dsbd``/``beam`` request lands in the beam loop's batch
(``beam`` = DSBD with no draft layers), which runs beside it over the same weights with its own KV caches.

Each response carries every id of its answer so far (postprocessing turns ids into text, off this process's
decoding thread) and the log-probabilities of the ids it adds; a refusal or a failure travels in band with its
code (``responses.engine_failure``), so the client sees INVALID_ARGUMENT for what it sent wrong.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from specdec.runtime.config import DEFAULT_NUM_DRAFT_TOKENS, DrafterKind, EngineConfig
from specdec.runtime.drafters import ForestDrafter
from specdec.runtime.logprobs import TokenLogprob
from specdec.runtime.methods import DEFAULT_METHOD, beam_method, get_method
from specdec.runtime.request import RequestMetrics
from specdec.runtime.sampling import InvalidRequestError
from specdec.serving.control import Control
from specdec.serving.diagnostics import dump_threads_on_sigusr1, fault_hook
from specdec.serving.heartbeat import Heartbeat
from specdec.serving.inputs import Generation, parse_generation, parse_input_ids
from specdec.serving.protocol import ENGINE_MODEL, INPUT_IDS, PARAMETERS
from specdec.serving.responses import INTERNAL, INVALID, UNAVAILABLE, engine_failure, engine_response
from specdec.serving.service import EngineService, ServiceStoppedError, StreamEvent, outcome_of
from specdec.serving.triton_io import (
    Client,
    export_dir,
    from_entry_point,
    internal_only,
    model_parameters,
    parameter,
    read_inputs,
    release_senders,
    response,
)
from specdec.serving.triton_metrics import EngineMetrics, release_metrics

if TYPE_CHECKING:
    from specdec.runtime.engine import Engine

log = logging.getLogger(__name__)
#: how often the watcher looks for cancels and deadlines, and publishes the metrics
WATCH_POLL_S = 0.1


def served_config(params: Mapping[str, str], device_id: int = 0) -> EngineConfig:
    """The engine settings ``specdec_engine``'s config parameters ask for (``ServingOptions`` wrote them).

    Empty parameters mean the defaults; ``max_batch`` and ``intra_op_threads`` 0 mean "as exported" and "all
    cores", ``prefill_budget`` 0 whole prompts. Torch (where a backend brings it: TensorRT's device caches) runs on
    one thread, since its threads would contend with the backend's (``benchmarks/results/ort_contention.md``).
    """
    from specdec.runtime.draft_length import DraftLength, parse_prices

    def number(name: str, default: int | None = None) -> int | None:
        return parameter(params, name, int, default)

    def cost(name: str, default: float | None = None) -> float | None:
        """An adaptive draft cost (0 is a price: a GPU's verified row)."""
        return parameter(params, name, float, default)

    adaptive = DraftLength(
        verify_cost=parameter(params, "verify_cost", float, DraftLength.verify_cost),
        draft_cost=cost("draft_cost"),
        verify_by_batch=parse_prices(params.get("verify_cost_by_batch", "")),
        draft_by_batch=parse_prices(params.get("draft_cost_by_batch", "")),
    )
    return EngineConfig(
        max_batch=number("max_batch") or None,
        threads=number("intra_op_threads") or None,
        num_draft_tokens=parameter(params, "num_draft_tokens", int, DEFAULT_NUM_DRAFT_TOKENS),
        drafter=DrafterKind.parse(params.get("drafter") or None),
        torch_threads=1,
        draft_length=adaptive if number("adaptive_draft", 0) else None,
        prefill_budget=number("prefill_budget") or None,
        device_id=device_id,
    )


def served_engine(export: Path, params: Mapping[str, str], device_id: int = 0) -> Engine:
    """The engine ``specdec_engine`` serves (also a benchmark's local twin of it)."""
    from specdec.runtime.engine import Engine

    engine = Engine.from_export(export, served_config(params, device_id))
    engine.fault_hook = fault_hook()
    return engine


@dataclass(eq=False)
class _Stream:
    """One engine request's Triton side: where its responses go and what they already covered."""

    client: Client
    generation: Generation
    ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    sent: int = 0


class EngineModel:
    """The decoupled engine: one ``EngineService`` per loop for every request of both entry points."""

    def initialize(self, args: dict[str, str]) -> None:
        dump_threads_on_sigusr1()
        params = model_parameters(args)
        # each instance on its own device: Triton's KIND_GPU instance groups name it (KIND_CPU: 0, the host)
        device = int(args.get("model_instance_device_id") or 0) if args.get("model_instance_kind") == "GPU" else 0
        self.engine = served_engine(export_dir(args), params, device_id=device)
        self.default_max_tokens = parameter(params, "default_max_tokens", int, 0) or 64
        self.max_request_rows = parameter(params, "max_request_rows", int, 0) or None
        self.service = EngineService(self.engine, DEFAULT_METHOD).start()
        # beam requests run in a second loop over the same weights (its own caches): the speculative beam method
        # where the drafter can beam-sample forests (the draft model, alone or in the hybrid drafter), target-only
        # beam decoding otherwise
        self.has_draft_model = isinstance(self.engine.drafter, ForestDrafter)
        self.beam_service = EngineService(self.engine.sibling(), beam_method(self.has_draft_model)).start()
        self._ids = itertools.count()
        self._streams: dict[str, _Stream] = {}
        self._external: dict[str, str] = {}  # Triton request id (the entry point's engine id) -> engine request id
        self._lock = threading.Lock()
        self._outbox: queue.Queue[tuple[_Stream, StreamEvent] | None] = queue.Queue()
        self._closing = threading.Event()
        self._control = Control.from_env()
        self.metrics = EngineMetrics(args.get("model_instance_name", ENGINE_MODEL))
        # responses leave from their own thread so the decoding loop never waits on Triton's IPC
        self._sender = threading.Thread(target=self._send_loop, name="specdec-send", daemon=True)
        self._watcher = threading.Thread(target=self._watch, name="specdec-watch", daemon=True)
        self._sender.start()
        self._watcher.start()
        self.heartbeat = Heartbeat(self._control.directory, args.get("model_name", ENGINE_MODEL), self._progress)
        self.heartbeat.start()

    def _progress(self) -> dict[str, Any]:
        """The heartbeat's report of the decoding loops: the oldest step in progress (a wedge shows there first)
        with its rows, and the pace of the ems loop (the beam loop's when it alone has run)."""
        states = [service.progress() for service in (self.service, self.beam_service)]
        busy = [(since, rows) for since, rows, _ in states if since is not None]
        since, rows = min(busy) if busy else (None, 0)
        pace = next((p for _, _, p in states if p is not None), None)
        return {"busy_since": since, "rows": rows, "row_seconds": pace}

    def execute(self, requests: list[Any]) -> None:
        for request in requests:
            client = Client(request, request.get_response_sender())
            if not from_entry_point(request):  # raw token ids stay with the entry points
                client.send(internal_only(ENGINE_MODEL), final=True)
                continue
            try:
                self._submit(request, client)
            except InvalidRequestError as exc:
                client.send(response(engine_failure(str(exc), INVALID)), final=True)
            except ServiceStoppedError as exc:
                client.send(response(engine_failure(str(exc), UNAVAILABLE)), final=True)
            except Exception as exc:  # never a request without an answer; the traceback goes to the log only
                log.exception("could not submit a request")
                client.send(response(engine_failure(f"internal error: {type(exc).__name__}", INTERNAL)), final=True)
        return None

    def _submit(self, request: Any, client: Client) -> None:
        inputs = read_inputs(request, (INPUT_IDS, *PARAMETERS))
        gen = parse_generation(inputs, max_len=self.engine.max_len, default_max_tokens=self.default_max_tokens)
        method = get_method(gen.method)
        if method.needs_draft_model and not self.has_draft_model:
            raise InvalidRequestError(
                f"method {method.name!r} needs a draft model and this deployment has none (export with --draft); "
                f"use {self.beam_service.method.name!r} for beam decoding without one"
            )
        rows = gen.step_rows(self.engine.config.num_draft_tokens)
        if self.max_request_rows is not None and rows > self.max_request_rows:
            raise InvalidRequestError(
                f"this request may add {rows} rows to every step it takes part in (beam_width x (1 + "
                f"num_draft_tokens x beam_width), or 1 + num_draft_tokens), more than this server allows one request "
                f"({self.max_request_rows}): lower beam_width or num_draft_tokens"
            )
        request_id = f"{request.request_id() or 'triton'}#{next(self._ids)}"
        req = gen.request(parse_input_ids(inputs), request_id)
        service = self.beam_service if method.beams else self.service
        stream = _Stream(client, gen)
        with self._lock:
            self._streams[request_id] = stream
            if request.request_id():
                self._external[request.request_id()] = request_id
        try:
            # no text: postprocessing re-decodes it from the ids, off the decoding thread
            service.submit(req, lambda event: self._outbox.put((stream, event)), text=False, timeout_s=gen.timeout_s)
        except Exception:
            with self._lock:
                self._streams.pop(request_id, None)
                self._external.pop(request.request_id() or "", None)
            raise

    def _take_cancels(self) -> None:
        """The entry points' cancels (``Control.cancel``) of requests this instance holds."""
        wanted = self._control.cancels()
        if not wanted:
            return
        with self._lock:
            mine = [(external, self._external[external]) for external in wanted if external in self._external]
        for external, request_id in mine:
            if not self.service.cancel(request_id):  # whichever loop holds it (the other one does not know it)
                self.beam_service.cancel(request_id)
            self._control.forget_cancel(external)

    def _send_loop(self) -> None:
        while (item := self._outbox.get()) is not None:
            stream, event = item
            try:
                self._send(stream, event)
            except Exception:  # a vanished client must not stop the others' responses
                log.exception("could not send a response for %s", event.request_id)

    def _send(self, stream: _Stream, event: StreamEvent) -> None:
        stream.logprobs.extend(event.new_logprobs)
        if not event.finished:
            stream.ids.extend(event.new_token_ids)
            if stream.generation.stream and event.metrics is not None:
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
        gen = stream.generation
        outputs = engine_response(
            stream.ids,
            stream.sent,
            finished,
            gen.stop,
            finish_reason,
            metrics,
            stop_ids=gen.stop_token_ids,
            logprobs=stream.logprobs[stream.sent : len(stream.ids)],
            error=error,
            error_code=INTERNAL,
        )
        stream.client.send(response(outputs), final=finished)
        stream.sent = len(stream.ids)

    def _watch(self) -> None:
        """Cancel the requests the entry points gave up on or whose deadline passed; publish the step metrics."""
        while not self._closing.wait(WATCH_POLL_S):
            self._take_cancels()
            for service in (self.service, self.beam_service):
                service.expire()
            try:
                self.metrics.update(self.service, self.beam_service)
            except Exception:
                log.exception("could not update metrics")

    def finalize(self) -> None:
        self.heartbeat.exit_if_orphaned()
        self._closing.set()
        self.service.stop(drain=False, timeout=10)
        self.beam_service.stop(drain=False, timeout=10)
        self._outbox.put(None)
        self._sender.join(5)
        self._watcher.join(5)
        release_senders()
        release_metrics()
        self.heartbeat.stop()

"""The serving core: one long-lived decoding loop in a background thread, fed by many callers.

A Triton Python-backend model (or any other transport) wraps ``EngineService``: request
threads call ``submit`` and receive ``StreamEvent``s through a callback while a single
loop thread admits requests between steps (in-flight batching into one ragged target
call) and streams each sequence's tokens back as they are accepted.

One service runs one decoding loop over one KV cache. ``ar`` is ``ems`` with no drafts and
``beam`` is ``dsbd`` with no draft layers, so two services (``ems`` and ``dsbd``, the second
over ``Engine.sibling()``: same weights, its own caches) serve every method; a router in
front of them chooses by the request's ``method`` field.

Event contract, per request: zero or more events with ``finished=False`` carrying new
tokens, then exactly one event with ``finished=True`` carrying the final ``RequestOutput``
(or ``error``); nothing follows it. Events of one request are delivered in order from
the loop thread (or, for a request cancelled while still queued, from the cancelling
thread), so callbacks must be quick and must not block on the service.

Text is computed only for callers that ask for it (``submit(..., text=True)``, the default):
streaming text means detokenizing the whole answer at every event on the loop thread, which
delays every sequence's next step. A caller that works from token ids (the Triton engine
model, whose postprocessing re-decodes from ids) submits with ``text=False`` and gets the same
tokens, events and metrics with ``text_delta`` empty and ``output.text`` None.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from specdec.runtime.context import DecodeContext, LoopHooks
from specdec.runtime.engine import Engine
from specdec.runtime.logprobs import TokenLogprob
from specdec.runtime.methods import DEFAULT_METHOD, get_method
from specdec.runtime.metrics import StepRecord
from specdec.runtime.request import CANCELLED, TIMEOUT, Request, RequestMetrics, RequestOutput, SeqState
from specdec.runtime.sampling import InvalidRequestError
from specdec.runtime.scheduler import Scheduler
from specdec.runtime.text import streamable

log = logging.getLogger(__name__)


class ServiceStoppedError(RuntimeError):
    """The service is stopping or stopped: it accepts no new requests."""


@dataclass
class StreamEvent:
    """One piece of a request's stream; the last one has ``finished=True`` and ``output`` set."""

    request_id: str
    new_token_ids: list[int]
    text_delta: str = ""  # always empty for a request submitted with text=False
    finished: bool = False
    output: RequestOutput | None = None
    error: str | None = None
    metrics: RequestMetrics | None = None  # a snapshot at this event (the final one's is output.metrics)
    #: with the request's ``logprobs``: one per token of ``new_token_ids``
    new_logprobs: list[TokenLogprob] = dataclasses.field(default_factory=list)


@dataclass
class ServiceStats:
    """Counters since the service was created (steps: target calls of every loop run)."""

    submitted: int
    finished: int
    cancelled: int
    failed: int
    timed_out: int
    steps: int
    mean_batch_size: float
    active: int  # requests admitted and decoding now
    kv_slots: int  # target KV slots held now: one per ems/ar sequence, one per live beam of a beam request
    queued: int  # requests waiting for a slot
    loop_restarts: int


class RequestHandle:
    """The caller's view of a submitted request: wait for it, or cancel it."""

    def __init__(
        self, service: EngineService, request: Request, on_event: Callable[[StreamEvent], None], text: bool = True
    ) -> None:
        self.request = request
        self._service = service
        self._on_event = on_event
        self._done = threading.Event()
        self.output: RequestOutput | None = None
        #: whether this request's events and output carry text (the caller asked, and the engine can decode)
        self.wants_text = text and service.engine.tokenizer is not None
        # streaming state, touched only by the thread that emits this request's events
        self._streamed = 0  # output tokens already sent
        self._text_sent = ""
        self._final_sent = False
        #: the ``EngineService.clock`` time past which the server ends the request ``TIMEOUT`` (None: no deadline)
        self.deadline: float | None = None

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def result(self, timeout: float | None = None) -> RequestOutput:
        """Block until the final event; raises ``TimeoutError`` if it does not come in time."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"request {self.request_id!r} did not finish within {timeout} s")
        assert self.output is not None
        return self.output

    def cancel(self) -> bool:
        return self._service.cancel(self.request_id)


class EngineService:
    """Runs ``method`` forever over ``engine`` in a daemon thread; ``submit`` from any thread.

    The engine (its cache and drafter) belongs to the service while it runs: do not call
    ``engine.generate`` concurrently.
    """

    def __init__(
        self, engine: Engine, method: str = DEFAULT_METHOD, clock: Callable[[], float] = time.monotonic
    ) -> None:
        #: the time deadlines count in (a test passes its own, to pass a deadline without sleeping)
        self.clock = clock
        self.engine, self.method = engine, get_method(method)
        self._lock = threading.RLock()
        self._handles: dict[str, RequestHandle] = {}  # submitted, no final event yet
        self._live: dict[str, SeqState] = {}  # admitted into the current loop run
        self._cancelled: dict[str, str] = {}  # request id -> the finish reason it ends with (CANCELLED, TIMEOUT)
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._ctx: DecodeContext | None = None
        self._counts = {"submitted": 0, "finished": 0, "cancelled": 0, "failed": 0, TIMEOUT: 0, "restarts": 0}
        self._steps_done = 0
        self._batch_sum = 0
        self._row_seconds: float | None = None
        self.scheduler = Scheduler(engine.max_batch, on_admit=self._admitted)

    # -- lifecycle ----------------------------------------------------------------------
    def start(self) -> EngineService:
        """Start the loop thread (requests submitted before this wait in the queue)."""
        with self._lock:
            if self._stopping:
                raise ServiceStoppedError("service was stopped: create a new one")
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve, name=f"specdec-{self.method.name}", daemon=True)
                self._thread.start()
        return self

    def stop(self, drain: bool = True, timeout: float | None = 30.0) -> bool:
        """Refuse new requests; finish (``drain``) or cancel what is in flight; True if the loop ended.

        With ``drain=False`` queued requests get their final "cancelled" event at once and
        live ones at the next step boundary.
        """
        with self._lock:
            self._stopping = True
            self.scheduler.close()
            in_flight = [] if drain else list(self._handles)
            thread = self._thread
        for request_id in in_flight:  # outside the lock: cancelling a queued request calls back
            self.cancel(request_id)
        if thread is None:
            for request in self.scheduler.drain():  # never started: nothing will serve these
                self._finish_unadmitted(request, CANCELLED)
            return True
        thread.join(timeout)
        return not thread.is_alive()

    def __enter__(self) -> EngineService:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop(drain=exc[0] is None)

    # -- requests -----------------------------------------------------------------------
    def submit(
        self,
        request: Request,
        on_event: Callable[[StreamEvent], None],
        *,
        text: bool = True,
        timeout_s: float | None = None,
    ) -> RequestHandle:
        """Queue ``request``; its events go to ``on_event``. Bad requests raise here, queue nothing.

        ``text=False``: the events carry no text and the output's ``text`` is None, and the loop
        never detokenizes for this request (see the module docstring).
        ``timeout_s``: a server-side deadline from now; past it the request ends ``TIMEOUT`` with what it has
        streamed, and its slot is freed at the next step boundary (queued, at the next ``expire``).
        """
        self.engine.check(request)
        if timeout_s is not None and not timeout_s > 0:
            raise InvalidRequestError(f"a request's timeout must be > 0 s, got {timeout_s}")
        with self._lock:
            if self._stopping:
                raise ServiceStoppedError("service is stopping: it accepts no new requests")
            if request.request_id in self._handles:
                raise InvalidRequestError(f"request_id {request.request_id!r} is already in flight")
            handle = RequestHandle(self, request, on_event, text)
            handle.deadline = None if timeout_s is None else self.clock() + timeout_s
            self._handles[request.request_id] = handle
            self._counts["submitted"] += 1
            self.scheduler.submit(request)
        return handle

    def generate(self, request: Request, timeout: float | None = None, *, text: bool = True) -> RequestOutput:
        """Submit and wait: the blocking form for callers that do not stream."""
        return self.submit(request, lambda event: None, text=text).result(timeout)

    def cancel(self, request_id: str, reason: str = CANCELLED) -> bool:
        """Best effort: True if the request was still running and will end with ``reason``.

        A queued request ends now; a live one ends at the next step boundary (its slot is
        freed by the loop's normal retirement). A request that finishes naturally in that
        same step keeps its natural ending.
        """
        with self._lock:
            if request_id not in self._handles:
                return False
            request = self.scheduler.remove(request_id)
            if request is None:
                self._cancelled.setdefault(request_id, reason)
                return True
        self._finish_unadmitted(request, reason)
        return True

    def expire(self) -> list[str]:
        """End every request past its deadline (``TIMEOUT``); the ids it ended.

        A live request is also caught by the loop itself at its next step (``_ends_now``); a queued one holds no
        step, so whoever owns the service calls this now and then (the Triton engine's watcher, every poll).
        """
        now = self.clock()
        with self._lock:
            late = [
                rid
                for rid, h in self._handles.items()
                if h.deadline is not None and now >= h.deadline and rid not in self._cancelled
            ]
        return [rid for rid in late if self.cancel(rid, TIMEOUT)]

    def _ends_now(self, seq: SeqState) -> bool:
        """The loop's ``is_cancelled``: a caller's cancel, or a deadline that passed (checked at every step)."""
        request_id = seq.request.request_id
        with self._lock:
            if request_id in self._cancelled:
                return True
            handle = self._handles.get(request_id)
            if handle is None or handle.deadline is None or self.clock() < handle.deadline:
                return False
            self._cancelled[request_id] = TIMEOUT
            return True

    def progress(self) -> tuple[float | None, int, float | None]:
        """(since when the loop has been inside its current target step, that step's rows, the seconds a row took
        over the latest steps): what the engine's heartbeat reports (``serving.heartbeat``)."""
        ctx = self._ctx
        if ctx is None:
            return None, 0, None
        step = ctx.current_step
        recent = list(ctx.run.steps[-32:])
        rows = sum(r.rows for r in recent)
        pace = sum(r.seconds for r in recent) / rows if rows else self._row_seconds
        return (None, 0, pace) if step is None else (step[0], step[1], pace)

    def stats(self) -> ServiceStats:
        with self._lock:
            steps, batch_sum, kv_slots = self._steps_done, self._batch_sum, 0
            if self._ctx is not None:
                kv_slots = self._ctx.kv.num_slots - self._ctx.kv.num_free
                for record in list(self._ctx.run.steps):
                    steps, batch_sum = steps + 1, batch_sum + record.batch_size
            return ServiceStats(
                submitted=self._counts["submitted"],
                finished=self._counts["finished"],
                cancelled=self._counts["cancelled"],
                failed=self._counts["failed"],
                timed_out=self._counts[TIMEOUT],
                steps=steps,
                mean_batch_size=batch_sum / steps if steps else 0.0,
                active=len(self._live),
                kv_slots=kv_slots,
                queued=self.scheduler.pending(),
                loop_restarts=self._counts["restarts"],
            )

    # -- the loop thread ----------------------------------------------------------------
    def _serve(self) -> None:
        """Run the loop; if it raises, fail the sequences it held and start it again, fresh."""
        while True:
            try:
                hooks = LoopHooks(
                    on_tokens=self._on_tokens,
                    on_finish=self._on_finish,
                    keep_running=lambda: not self._stopping,
                    is_cancelled=self._ends_now,
                )
                ctx = self.engine.context(self.scheduler, hooks)
            except Exception:  # cannot even build a loop: refuse the queue rather than hang its callers
                log.exception("could not start decoding loop %r; failing queued requests", self.method.name)
                for request in self.scheduler.drain():
                    self._finish_unadmitted(request, None, "decoding loop could not start")
                if self._stopping:
                    return
                self.scheduler.wait_for_work(timeout=1.0)
                continue
            with self._lock:
                self._ctx = ctx
            try:
                self.method.loop(ctx)
            except Exception as exc:  # a server must outlive one bad step
                log.exception(
                    "decoding loop %r failed; failing its in-flight requests and restarting", self.method.name
                )
                self._fail_live(f"decoding loop failed: {type(exc).__name__}: {exc}")
                with self._lock:
                    self._counts["restarts"] += 1
                continue
            finally:
                with self._lock:
                    self._fold_steps(ctx.run.steps)
                    self._ctx = None
            return

    def _fold_steps(self, steps: list[StepRecord]) -> None:
        """Move completed step records into totals so a long-lived run does not grow without bound."""
        n = len(steps)
        self._steps_done += n
        self._batch_sum += sum(record.batch_size for record in steps[:n])
        rows = sum(record.rows for record in steps[:n])
        if rows:  # the pace the heartbeat reports once a run's records are folded away
            self._row_seconds = sum(record.seconds for record in steps[:n]) / rows
        del steps[:n]

    def _admitted(self, seqs: list[SeqState]) -> None:
        with self._lock:
            for seq in seqs:
                self._live[seq.request.request_id] = seq
            if self._ctx is not None:  # a step boundary: every record so far is complete
                self._fold_steps(self._ctx.run.steps)

    def _on_tokens(self, seq: SeqState, tokens: list[int]) -> None:
        request_id = seq.request.request_id
        with self._lock:
            handle = self._handles.get(request_id)
            cancelled = request_id in self._cancelled
        if handle is None:
            return
        if seq.finished:
            return  # these tokens go out with the final event, once the final text is known
        if cancelled:
            return  # nothing more goes out: the loop retires it (CANCELLED) at the end of this step
        text_delta = ""
        if handle.wants_text:
            safe = streamable(self.engine.decode(seq.output_ids), seq.request.stop)
            if safe.startswith(handle._text_sent):
                text_delta, handle._text_sent = safe[len(handle._text_sent) :], safe
        handle._streamed = seq.num_generated
        event = StreamEvent(request_id, list(tokens), text_delta, metrics=dataclasses.replace(seq.metrics))
        if seq.request.logprobs is not None:
            event.new_logprobs = seq.logprobs[seq.num_generated - len(tokens) : seq.num_generated]
        self._deliver(handle, event)

    def _on_finish(self, seq: SeqState) -> None:
        request_id = seq.request.request_id
        with self._lock:
            self._live.pop(request_id, None)
            handle = self._handles.get(request_id)
        if handle is None:
            return
        if seq.finish_reason == CANCELLED or seq.error is not None:
            tokens = seq.output_ids[: handle._streamed]  # what the caller saw; the rest was never sent
            text = self.engine.decode(tokens) if handle.wants_text else None
            metrics = dataclasses.replace(seq.metrics, generated_tokens=len(tokens))
            with self._lock:
                reason = None if seq.error is not None else self._cancelled.get(request_id, CANCELLED)
            output = RequestOutput(
                request_id,
                list(seq.request.prompt_ids),
                tokens,
                text,
                reason,
                metrics,
                error=seq.error,
                logprobs=seq.logprobs[: len(tokens)],
            )
            new_tokens: list[int] = []
        else:
            new_tokens = seq.output_ids[handle._streamed :]
            output = self.engine.output(seq, text=handle.wants_text)
        self._finish(handle, output, new_tokens, output.logprobs[handle._streamed :])

    def _finish(
        self,
        handle: RequestHandle,
        output: RequestOutput,
        new_tokens: list[int],
        new_logprobs: list[TokenLogprob] | None = None,
    ) -> None:
        """Send the one final event and forget the request."""
        with self._lock:
            if handle._final_sent:
                return
            handle._final_sent = True
            self._handles.pop(handle.request_id, None)
            self._cancelled.pop(handle.request_id, None)
            self._counts[outcome_of(output)] += 1
        text_delta = ""
        if output.text is not None:
            if output.text.startswith(handle._text_sent):
                text_delta = output.text[len(handle._text_sent) :]
            else:  # the tokenizer re-spelled text already sent: nothing sound to add
                log.warning("request %r: final text does not extend the streamed text", handle.request_id)
        handle.output = output
        event = StreamEvent(handle.request_id, new_tokens, text_delta, True, output, output.error, output.metrics)
        event.new_logprobs = list(new_logprobs or [])
        self._deliver(handle, event)
        handle._done.set()

    def _finish_unadmitted(self, request: Request, reason: str | None, error: str | None = None) -> None:
        with self._lock:
            handle = self._handles.get(request.request_id)
        if handle is None:
            return
        metrics = RequestMetrics(prompt_tokens=len(request.prompt_ids))
        text = "" if handle.wants_text else None
        output = RequestOutput(request.request_id, list(request.prompt_ids), [], text, reason, metrics, error)
        self._finish(handle, output, [])

    def _fail_live(self, error: str) -> None:
        """After a loop crash: one error event per sequence that held a slot (queued ones stay queued)."""
        with self._lock:
            live, self._live = list(self._live.values()), {}
        for seq in live:
            handle = self._handles.get(seq.request.request_id)
            if handle is None:
                continue
            tokens = seq.output_ids[: handle._streamed]
            text = self.engine.decode(tokens) if handle.wants_text else None
            output = RequestOutput(
                seq.request.request_id, list(seq.request.prompt_ids), tokens, text, None, seq.metrics, error=error
            )
            self._finish(handle, output, [])

    def _deliver(self, handle: RequestHandle, event: StreamEvent) -> None:
        """Call the caller's callback; its exceptions are logged, never allowed to stop the loop."""
        try:
            handle._on_event(event)
        except Exception:  # one caller's bug must not fail the others
            log.exception("on_event callback of request %r raised", handle.request_id)


#: how a request ended, as the counters (``ServiceStats``, ``specdec_requests_total{outcome}``) name it
OUTCOMES = ("finished", CANCELLED, TIMEOUT, "failed")


def outcome_of(output: RequestOutput) -> str:
    """The one of ``OUTCOMES`` that ``output`` counts as."""
    if output.error:
        return "failed"
    return output.finish_reason if output.finish_reason in (CANCELLED, TIMEOUT) else "finished"


def describe(stats: ServiceStats) -> dict[str, Any]:
    """``stats`` as a plain dict (for a metrics endpoint or a log line)."""
    return dataclasses.asdict(stats)

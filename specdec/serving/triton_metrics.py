"""specdec's custom Prometheus metrics on Triton's metrics endpoint (the Python backend's ``MetricFamily``).

Only inside a Python-backend stub: the families live in Triton's registry, next to its own
``nv_inference_*`` metrics, so one scrape of the metrics port shows both.
"""

from __future__ import annotations

import gc
import threading
from typing import TYPE_CHECKING, Any

from specdec.runtime.request import RequestMetrics
from specdec.serving import pb
from specdec.serving.control import INFLIGHT_METRIC
from specdec.serving.service import OUTCOMES

if TYPE_CHECKING:
    from specdec.serving.service import EngineService


#: one update of any metric at a time in this stub (``Metric``)
_UPDATE_LOCK = threading.Lock()
#: every metric this stub made, so ``release_metrics`` can let them go before the stub ends
_MADE: list[Metric] = []


class Metric:
    """A metric of a Triton ``MetricFamily`` that any thread may update.

    Why the lock: the Python backend's metric writes its request into shared memory that the metric object owns,
    then waits for the server with the GIL released. Two threads updating one metric at once (ten requests refused
    together, each counting its refusal) freed each other's request under the server's feet: the stub's heap and
    tritonserver's reading of it were corrupted (SIGSEGV or ``std::length_error`` in ``libtriton_python``, found by
    ``tests/test_lifecycle.py``'s fault test). Updates are a few per request, so one lock per process costs nothing.
    """

    def __init__(self, family: Any, labels: dict[str, str]) -> None:
        self._family = family  # a family must outlive its metrics
        with _UPDATE_LOCK:
            self._metric = family.Metric(labels=labels)
            _MADE.append(self)

    def increment(self, value: float) -> None:
        with _UPDATE_LOCK:
            self._metric.increment(value)

    def set(self, value: float) -> None:
        with _UPDATE_LOCK:
            self._metric.set(value)

    def value(self) -> float:
        with _UPDATE_LOCK:
            return float(self._metric.value())

    def _release(self) -> None:
        """Let the Triton metric go (the caller holds ``_UPDATE_LOCK``); later updates go nowhere."""
        self._metric, self._family = _Dropped(), None


def release_metrics() -> None:
    """Let every metric of this stub go, from its model's ``finalize``, while the stub can still tell the server.

    Why: a metric (or family) that lives until the interpreter ends is deleted after the stub has closed its shared
    memory, and the stub dies with SIGSEGV in ``Metric::Clear`` on its way out (every model with metrics, at every
    unload or shutdown: four cores per server stop). Later updates are dropped.
    """
    with _UPDATE_LOCK:
        for metric in _MADE:
            metric._release()
        _MADE.clear()
    gc.collect()


class _Dropped:
    """A released metric: updates after ``release_metrics`` (a request thread still ending) go nowhere."""

    def increment(self, value: float) -> None:
        return None

    def set(self, value: float) -> None:
        return None

    def value(self) -> float:
        return 0.0


class EngineMetrics:
    """The engine model's metrics (counters since the model loaded), labelled with the engine instance.

    Why the ``instance`` label: with several engine instances (``--instances``) each stub process publishes its
    own series in the same families, so a scrape shows how the requests spread; a dashboard sums over it.
    """

    def __init__(self, instance: str) -> None:
        self.labels = {"instance": instance}

        def family(name: str, kind: Any, description: str) -> Any:
            return pb.utils.MetricFamily(name=name, description=description, kind=kind)

        def metric(name: str, kind: Any, description: str) -> Metric:
            return Metric(family(name, kind, description), self.labels)

        counter, gauge = pb.utils.MetricFamily.COUNTER, pb.utils.MetricFamily.GAUGE
        requests = family("specdec_requests_total", counter, "requests answered, by outcome")
        self.outcome = {o: Metric(requests, {**self.labels, "outcome": o}) for o in OUTCOMES}
        self.tokens = metric("specdec_generated_tokens_total", counter, "tokens generated")
        self.drafts = metric("specdec_draft_tokens_total", counter, "draft tokens verified")
        self.accepted = metric("specdec_accepted_draft_tokens_total", counter, "draft tokens accepted")
        self.steps = metric("specdec_target_steps_total", counter, "ragged target steps")
        self.step_sequences = metric(
            "specdec_step_sequences_total", counter, "sequences verified, summed over steps (/ steps = mean batch)"
        )
        self.active = metric(
            "specdec_active_sequences", gauge, "requests decoding (holding KV slots: one, or one per beam)"
        )
        self.kv_slots = metric(
            "specdec_kv_slots_used", gauge, "target KV slots held (one per ems/ar sequence, one per live beam)"
        )
        self.queued = metric("specdec_queued_requests", gauge, "requests waiting for a KV slot")
        self._steps = self._sequences = 0

    def request_done(self, outcome: str, metrics: RequestMetrics) -> None:
        self.outcome[outcome].increment(1)
        self.tokens.increment(metrics.generated_tokens)
        self.drafts.increment(metrics.draft_tokens)
        self.accepted.increment(metrics.accepted_draft_tokens)

    def update(self, *services: EngineService) -> None:
        """Publish the totals of every decoding loop (EMS-SD's and the beam loop)."""
        all_stats = [service.stats() for service in services]
        steps = sum(s.steps for s in all_stats)
        sequences = sum(round(s.mean_batch_size * s.steps) for s in all_stats)
        self.steps.increment(steps - self._steps)
        self.step_sequences.increment(sequences - self._sequences)
        self._steps, self._sequences = steps, sequences
        self.active.set(sum(s.active for s in all_stats))
        self.kv_slots.set(sum(s.kv_slots for s in all_stats))
        self.queued.set(sum(s.queued for s in all_stats))


class InflightGauge:
    """An entry point's requests admitted and not yet answered (``specdec serve`` drains until it reads 0).

    Both entry points register the same family (same name, help and kind, which Triton's registry merges),
    each with its own ``model`` label.
    """

    def __init__(self, model: str) -> None:
        self.value = 0
        self._metric: Metric | None = None
        if pb.utils is not None:  # outside a stub (the watcher tests) it only counts
            family = pb.utils.MetricFamily(
                name=INFLIGHT_METRIC,
                kind=pb.utils.MetricFamily.GAUGE,
                description="requests an entry point admitted and has not answered",
            )
            self._metric = Metric(family, {"model": model})

    def set(self, value: int) -> None:
        self.value = value
        if self._metric is not None:
            self._metric.set(value)


#: why an entry point refused a request, as ``specdec_refused_requests_total{reason}`` counts it
REFUSALS = ("invalid", "overloaded", "draining", "aborted", "unavailable", "internal")


class RefusalCounter:
    """Requests an entry point answered with an error, by why (``REFUSALS``): a client's bad input, no capacity,
    a drain, an abort, a failed stub being replaced, a failure of the server's own."""

    def __init__(self, model: str) -> None:
        family = pb.utils.MetricFamily(
            name="specdec_refused_requests_total",
            kind=pb.utils.MetricFamily.COUNTER,
            description="requests answered with an error, by reason",
        )
        self.reasons = {r: Metric(family, {"model": model, "reason": r}) for r in REFUSALS}

    def count(self, reason: str) -> None:
        self.reasons[reason].increment(1)


class SupervisionCounters:
    """What the launcher did to keep the server up (its ``Control.record``), on the metrics port: it has none."""

    def __init__(self, counts: dict[str, int]) -> None:
        counter = pb.utils.MetricFamily.COUNTER
        families = [
            pb.utils.MetricFamily(name=f"specdec_server_{name}_total", kind=counter, description=description)
            for name, description in (
                ("restarts", "tritonserver restarts by specdec serve (a dead engine or server)"),
                ("reloads", "models reloaded by specdec serve (a dead or frozen stub)"),
            )
        ]
        self._metrics = [Metric(family, {}) for family in families]  # a metric lives while referenced
        # brought up to the launcher's count, not incremented by it: Triton hands a family of a name it holds
        # already to whoever asks for it again, and a reloaded gate finds its predecessor's counter still there
        # (tests/test_supervision.py counted the reloads twice over before)
        for metric, name in zip(self._metrics, ("restarts", "reloads")):
            metric.increment(max(0.0, counts.get(name, 0) - metric.value()))

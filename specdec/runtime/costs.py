"""What a draft token and a verified row cost on the backends at hand, in one-row target steps.

Why: speculation pays when its accepted tokens cover k draft steps plus the extra rows of the
verification, and both prices depend on the machine: on a CPU a verified row costs a visible
share of a step (``benchmarks/results/draft_pair.md``); on a GPU, where a decode step is bound by
reading the weights, it costs close to nothing. The adaptive draft length
(``specdec.runtime.draft_length``) chooses k from these two prices, so a deployment that
measures them on its own hardware (``specdec-export --adaptive-draft --calibrate``) drafts as
far as it pays there instead of as far as it paid here.

How: ``loop_costs`` (what ``calibrate`` prices from) times steps in the order decoding loops
run them: one-row target steps back to back, as a loop without drafts runs, against k draft
steps followed by the target verifying them, as EMS-SD runs. The order matters: a step after
another session's steps can cost far more than the same step after its own (below), and a price
that leaves that out makes the policy draft where it does not pay. ``step_costs`` times each
shape on its own (interleaved, rotated, medians), for the benchmark that breaks a step's cost
down (``python -m benchmarks.draft_pair``). Every timed step writes its K/V at the same positions, so
repetitions have the same shape; token values do not change a step's cost, so the cached
windows are a fixed pattern of ids.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from specdec.runtime.backends.base import Backend, KVStorage
from specdec.runtime.draft_length import DRAFT_BY_BATCH, VERIFY_BY_BATCH, BatchPrices, batch_prices
from specdec.runtime.drafters import ModelDrafter
from specdec.runtime.packed import PackedBatch, SeqWork, pack

if TYPE_CHECKING:
    from specdec.runtime.engine import Engine


def _timed_step(backend: Backend, batch: PackedBatch, cache: KVStorage) -> float:
    """Milliseconds of one ragged step (the batch is packed beforehand, outside the timing)."""
    start = time.perf_counter()
    backend.step(batch, cache)
    return (time.perf_counter() - start) * 1000


def _decode_shape(
    target: Backend, draft: Backend | None, batch: int, context: int, rows: int, stream: Sequence[int] | None = None
) -> tuple[list[int], PackedBatch, dict[str, KVStorage]]:
    """The fixed decode shape every timing runs: ``batch`` sequences with ``context`` cached tokens each.

    Returns each sequence's next token, the one-row step over them, and a prefilled cache per backend
    ("draft", "target") with room for ``rows`` more positions. ``stream``: the tokens the caches are cut
    from (default: ids spread over the vocabulary, since a step costs the same whatever the ids).
    """
    tokens = list(stream) if stream else [(7919 * i) % target.vocab_size for i in range((batch + 1) * context)]
    windows = [[tokens[(b * context + i) % len(tokens)] for i in range(context)] for b in range(batch)]
    nxt = [tokens[((b + 1) * context) % len(tokens)] for b in range(batch)]
    caches: dict[str, KVStorage] = {}
    for name, backend in (("draft", draft), ("target", target)):
        if backend is not None:
            caches[name] = backend.allocate_cache(batch, context + rows)
            backend.step(pack([SeqWork(b, 0, w, logits="last") for b, w in enumerate(windows)]), caches[name])
    return nxt, pack([SeqWork(b, context, [t], logits="last") for b, t in enumerate(nxt)]), caches


def step_costs(
    target: Backend,
    draft: Backend | None,
    batch: int,
    *,
    context: int = 200,
    ks: Sequence[int] = (2, 4, 6),
    steps: int = 20,
    stream: Sequence[int] | None = None,
) -> dict[str, Any]:
    """ms per step of the draft and of the target at one decode shape, and of the target verifying k drafts.

    ``stream``: the tokens the sequences' caches are cut from (default: a fixed pattern of
    ids). Returns the medians, their ratios, the break-even accepted length of a model draft
    and of a free one (prompt lookup) for every k, and the samples.
    """
    if batch < 1 or context < 1 or steps < 1 or not ks or min(ks) < 1:
        raise ValueError(f"need batch, context, steps and every k >= 1, got {batch}, {context}, {steps}, {list(ks)}")
    nxt, one, caches = _decode_shape(target, draft, batch, context, max(ks) + 1, stream)
    shapes: dict[str, tuple[Backend, PackedBatch, KVStorage]] = {
        name: (backend, one, caches[name])
        for name, backend in (("draft", draft), ("target", target))
        if backend is not None  # exactly the backends _decode_shape made a cache for
    }
    for k in ks:  # verification: the last token + k drafts, logits on all k + 1 rows
        shapes[f"verify{k}"] = (
            target,
            pack([SeqWork(b, context, [t] * (k + 1)) for b, t in enumerate(nxt)]),
            shapes["target"][2],
        )
    names = list(shapes)
    for name in names:  # first touch of each shape, untimed
        _timed_step(*shapes[name])
    gc.collect()
    times: dict[str, list[float]] = {name: [] for name in names}
    for i in range(steps):
        shift = i % len(names)
        for name in names[shift:] + names[:shift]:
            times[name].append(_timed_step(*shapes[name]))
    ms = {name: statistics.median(values) for name, values in times.items()}
    t = ms["target"]
    d = ms.get("draft")
    record: dict[str, Any] = {
        "batch_size": batch,
        "context": context,
        "steps": steps,
        "draft_ms": None if d is None else round(d, 3),
        "target_ms": round(t, 3),
        "draft_over_target": None if d is None else round(d / t, 4),
        "verify_ms": {str(k): round(ms[f"verify{k}"], 3) for k in ks},
        "verify_over_target": {str(k): round(ms[f"verify{k}"] / t, 3) for k in ks},
        # a speculative step costs k draft steps (the n-gram lookup: ~0) + one verification
        "break_even_accepted_length": {
            "ngram": {str(k): round(ms[f"verify{k}"] / t, 3) for k in ks},
        },
        "samples_ms": {name: [round(x, 3) for x in values] for name, values in times.items()},
    }
    if d is not None:
        record["break_even_accepted_length"]["draft"] = {str(k): round((k * d + ms[f"verify{k}"]) / t, 3) for k in ks}
    return record


def loop_costs(
    target: Backend, draft: Backend | None, batch: int, *, k: int = 4, context: int = 128, steps: int = 10
) -> dict[str, Any]:
    """ms of a target step as a loop without drafts runs it, and of a speculative step as EMS-SD runs it.

    A loop that does not draft runs one-row target steps back to back; a speculative step is k
    one-row draft steps, then the target verifying k drafts (k + 1 rows per sequence). The two
    are timed in those sequences, not as isolated shapes, because what one step costs depends on
    what ran just before: on the CI machine an ONNX Runtime target step after draft steps took
    far longer than the same step after another target step (idle worker threads of the other
    session still spinning, caches holding the other model's weights). ``plain_ms``: the second
    of two back-to-back one-row steps; ``spec_ms``: a whole speculative step, with its parts
    ``draft_ms`` (per draft step) and ``verify_ms``. Medians of ``steps`` rounds.
    """
    if batch < 1 or context < 1 or steps < 1 or k < 1:
        raise ValueError(f"need batch, context, steps and k >= 1, got {batch}, {context}, {steps}, {k}")
    nxt, one, caches = _decode_shape(target, draft, batch, context, k + 1)
    verify = pack([SeqWork(b, context, [t] * (k + 1)) for b, t in enumerate(nxt)])

    def speculative() -> tuple[float, list[float], float]:
        drafts = [_timed_step(draft, one, caches["draft"]) for _ in range(k)] if draft is not None else []
        return sum(drafts) + (v := _timed_step(target, verify, caches["target"])), drafts, v

    speculative()  # first touch of every shape, untimed
    _timed_step(target, one, caches["target"])
    gc.collect()
    plain, spec, draft_ms, verify_ms = [], [], [], []
    for _ in range(steps):
        _timed_step(target, one, caches["target"])  # the step before a plain one is a plain one
        plain.append(_timed_step(target, one, caches["target"]))
        total, drafts, v = speculative()
        spec.append(total)
        draft_ms.extend(drafts)
        verify_ms.append(v)
    return {
        "batch_size": batch,
        "context": context,
        "k": k,
        "steps": steps,
        "plain_ms": round(statistics.median(plain), 3),
        "spec_ms": round(statistics.median(spec), 3),
        "draft_ms": round(statistics.median(draft_ms), 3) if draft_ms else None,
        "verify_ms": round(statistics.median(verify_ms), 3),
    }


@dataclass(frozen=True)
class DraftCosts:
    """The two prices of the adaptive draft length, measured, with the step timings behind them.

    ``draft_cost``: one draft step over one plain target step (None: no draft model was measured).
    ``verify_cost``: the rest of what one more draft token adds to a speculative step, in plain
    target steps: its verified row and whatever the draft steps cost the target's step after them.
    ``verify_by_batch`` / ``draft_by_batch``: the same per measured batch size (``draft_length``
    prices greedy sequences by them).
    """

    draft_cost: float | None
    verify_cost: float
    records: tuple[dict[str, Any], ...]
    verify_by_batch: BatchPrices = ()
    draft_by_batch: BatchPrices = ()

    def as_dict(self) -> dict[str, Any]:
        """JSON form, as an export's manifest keeps it."""
        return {
            "draft_cost": self.draft_cost,
            "verify_cost": self.verify_cost,
            VERIFY_BY_BATCH: [list(p) for p in self.verify_by_batch],
            DRAFT_BY_BATCH: [list(p) for p in self.draft_by_batch],
            "batch_sizes": [r["batch_size"] for r in self.records],
            "k": self.records[0]["k"] if self.records else None,
            "context": self.records[0]["context"] if self.records else None,
            **{key: [r[key] for r in self.records] for key in ("plain_ms", "spec_ms", "draft_ms", "verify_ms")},
        }


def draft_costs(records: Sequence[dict[str, Any]]) -> DraftCosts:
    """The prices from ``loop_costs`` records: per batch size, and their medians over the batch sizes.

    Per record, one draft token adds (spec / plain − 1) / k plain steps; draft_cost is the draft
    step's share (draft / plain) and verify_cost the rest, floored at 0 (timing noise). The medians
    are the batch-independent prices a sampled sequence is charged (its choice must not depend on
    batch-mates: a seeded request gives the same output in any batch); greedy sequences are charged
    the price at their step's batch size.
    """
    if not records:
        raise ValueError("no step-cost records to price from")
    verify: dict[int, float] = {}
    draft: dict[int, float] = {}
    for r in records:
        per_draft = (r["spec_ms"] / r["plain_ms"] - 1.0) / r["k"]
        share = 0.0 if r["draft_ms"] is None else r["draft_ms"] / r["plain_ms"]
        verify[r["batch_size"]] = round(max(0.0, per_draft - share), 4)
        if r["draft_ms"] is not None:
            draft[r["batch_size"]] = round(share, 4)
    return DraftCosts(
        round(statistics.median(draft.values()), 4) if draft else None,
        round(statistics.median(verify.values()), 4),
        tuple(records),
        verify_by_batch=batch_prices(verify.items()),
        draft_by_batch=batch_prices(draft.items()),
    )


def calibrate(
    target: Backend,
    draft: Backend | None,
    *,
    batch_sizes: Sequence[int] = (1, 4, 8),
    k: int = 4,
    context: int = 128,
    steps: int = 10,
) -> DraftCosts:
    """Measure the draft and verification prices of these backends (seconds for SmolLM2 on a CPU)."""
    return draft_costs([loop_costs(target, draft, b, context=context, k=k, steps=steps) for b in batch_sizes])


def calibrate_engine(
    engine: Engine, *, batch_sizes: Sequence[int] = (1, 4, 8), k: int = 4, context: int = 256, steps: int = 10
) -> DraftCosts:
    """``calibrate`` on an engine's own target and draft backends (prompt lookup: no draft step to time).

    Batch sizes above the engine's ``max_batch`` are dropped, since a deployment never runs them.
    ``context``: the cached tokens of each timed sequence, at most what the engine's ``max_len`` holds.
    Why 256 by default, the middle of the edge benchmark's contexts (50 to 420 tokens): a draft step's
    share of a target step grows with the context (attention is a larger part of a small model's step),
    so prices timed at 128 cached tokens made the draft model look cheaper than it is on answers to long
    prompts; the calibration's timings are kept in the export's manifest.
    """
    context = max(1, min(context, engine.max_len - k - 2))
    sizes = sorted({min(b, engine.max_batch) for b in batch_sizes})
    drafter = engine.drafter
    draft = drafter.backend if isinstance(drafter, ModelDrafter) else None
    return calibrate(engine.target, draft, batch_sizes=sizes, k=k, context=context, steps=steps)

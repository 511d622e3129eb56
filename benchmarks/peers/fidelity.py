"""How far a model's arithmetic is from fp32's: teacher-forced next-token choices and held-out perplexity.

Every row of the edge benchmark is judged three ways against the fp32 reference (specdec's fp32 export,
greedy): identical answers (``benchmarks.edge_cpu.summary.agreement``), the next-token agreement along the
reference's own answers (each position judged on the reference's context, so one near-tie flips one
position, not the rest of an answer), and the perplexity of held-out text (``specdec.bench.workloads.
held_out_documents``, the text ``benchmarks.quantize_quality`` scores). The arithmetic lives here once: the
peers' children (numpy only) and the specdec child both call it.

``score_logits``: engines that return the logits of every position of a sequence in one call (ONNX Runtime
GenAI, OpenVINO); ``score_positions``: engines asked one position at a time (llama-server: the top two
log-probabilities and the log-probability of a given token, ``benchmarks.peers.llama_server``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

#: (token, margin over the runner-up) of one position
Top2 = tuple[int, float]


def top2(logits: Any) -> list[Top2]:
    """Each row's greedy token and its margin over the runner-up (logits; log-probabilities give the same
    difference), the distance a rounding must cover to flip that choice."""
    import numpy as np

    rows = np.asarray(logits, dtype=np.float64)
    best = rows.argmax(axis=1)
    second = np.partition(rows, -2, axis=1)[:, -2]
    return [(int(b), float(rows[i, b] - second[i])) for i, b in enumerate(best)]


def nll(logits: Any, targets: Sequence[int]) -> float:
    """The summed negative log-likelihood of ``targets`` under the rows of ``logits`` (float64 log-softmax)."""
    import numpy as np

    rows = np.asarray(logits, dtype=np.float64)
    peak = rows.max(axis=1, keepdims=True)
    log_z = peak[:, 0] + np.log(np.exp(rows - peak).sum(axis=1))
    return float((log_z - rows[np.arange(len(targets)), np.asarray(targets)]).sum())


def perplexity(total_nll: float, predicted: int) -> float | None:
    """exp of the mean negative log-likelihood per predicted token (None with nothing predicted)."""
    return math.exp(total_nll / predicted) if predicted else None


def forced_counts(picks: Sequence[Sequence[int]], answers: Sequence[Sequence[int]]) -> dict[str, int]:
    """Positions of the reference answers and how many of them the model's greedy choice repeats."""
    if [len(p) for p in picks] != [len(a) for a in answers]:
        raise ValueError("picks: one pick per answer position expected")
    agree = sum(int(p == a) for row, ans in zip(picks, answers) for p, a in zip(row, ans))
    return {"positions": sum(map(len, answers)), "agree": agree}


def forced_rows(
    pairs: Sequence[tuple[list[int], list[int]]], top_rows: Callable[[list[int], int], list[Top2]]
) -> dict[str, Any]:
    """The model's choice and margin at every position of the reference answers, given the reference's prompt
    and answer so far (``top_rows(tokens, first)``: ``top2`` of every row from ``first`` on, after reading
    ``tokens``), with the counts of ``forced_counts``."""
    picks: list[list[int]] = []
    margins: list[list[float]] = []
    for prompt, answer in pairs:
        rows = top_rows(prompt + answer[:-1], len(prompt) - 1) if answer else []
        picks.append([token for token, _ in rows])
        margins.append([round(margin, 4) for _, margin in rows])
    return {**forced_counts(picks, [a for _, a in pairs]), "picks": picks, "margins": margins}


def score_logits(spec: dict[str, Any], logits_of: Callable[[list[int]], Any]) -> dict[str, Any]:
    """``score`` for an engine that gives every position's logits of a sequence (``logits_of(tokens)``, one row
    per token): the forced rows of every workload and the held-out documents' summed NLL."""

    def top_rows(tokens: list[int], first: int) -> list[Top2]:
        return top2(logits_of(tokens)[first:])

    forced = {name: forced_rows(pairs, top_rows) for name, pairs in spec["pairs"].items()}
    total = sum(nll(logits_of(doc)[:-1], doc[1:]) for doc in spec["documents"])
    return {"forced": forced, "nll": total, "predicted": sum(len(d) - 1 for d in spec["documents"])}


def score_positions(spec: dict[str, Any], at: Callable[[list[int], int], tuple[Top2, float]]) -> dict[str, Any]:
    """``score`` for an engine asked one position at a time: ``at(prefix, target)`` gives the greedy choice
    and its margin after ``prefix``, and the log-probability of ``target`` there."""

    forced = {}
    for name, pairs in spec["pairs"].items():
        rows = [[at(prompt + answer[:j], answer[j])[0] for j in range(len(answer))] for prompt, answer in pairs]
        picks = [[token for token, _ in row] for row in rows]
        margins = [[round(margin, 4) for _, margin in row] for row in rows]
        forced[name] = {**forced_counts(picks, [a for _, a in pairs]), "picks": picks, "margins": margins}
    total = 0.0
    for doc in spec["documents"]:
        total -= sum(at(doc[:i], doc[i])[1] for i in range(1, len(doc)))
    return {"forced": forced, "nll": total, "predicted": sum(len(d) - 1 for d in spec["documents"])}

"""The edge benchmark's matched-fidelity comparison (``benchmarks/edge_cpu/matched.py``) on made-up rows."""

from __future__ import annotations

from typing import Any

from benchmarks.edge_cpu.matched import matched, matched_table


def _row(kind: str, model: str, tps: tuple[float, float], method: str | None = None, exact: bool = True) -> dict:
    row: dict[str, Any] = {"kind": kind, "batch": 1, "model": model, "method": method}
    row["tokens_per_second"] = {"chat": tps[0], "extractive": tps[1]}
    if method == "ems":
        same = {"identical": 1.0 if exact else 0.5}
        row["identical_to_own_ar"] = {"chat": same, "extractive": same}
    return row


def _forced(chat: float, extractive: float) -> dict:
    return {"chat": {"rate": chat}, "extractive": {"rate": extractive}}


RESULTS = {
    "peer B=1": _row("peer", "peer int4", (100.0, 100.0)),
    "specdec int4 ar B=1": _row("specdec", "specdec int4", (90.0, 80.0), "ar"),
    "specdec int4 ems B=1": _row("specdec", "specdec int4", (120.0, 70.0), "ems"),
    "specdec w8a8 ar B=1": _row("specdec", "specdec w8a8", (500.0, 500.0), "ar"),  # less faithful than the peer
    "specdec int4 ems broken B=1": _row("specdec", "specdec int4", (900.0, 900.0), "ems", exact=False),
}
FORCED = {"peer int4": _forced(0.90, 0.90), "specdec int4": _forced(0.97, 0.95), "specdec w8a8": _forced(0.95, 0.89)}


def test_a_peer_row_meets_the_fastest_exact_row_at_least_as_faithful_on_each_workload() -> None:
    (entry,) = matched(RESULTS, FORCED)
    best = entry["best"]
    # w8a8 is faster but less faithful on extractive; the inexact ems row never qualifies
    assert best["any", "chat"] == {"row": "specdec int4 ems B=1", "ratio": 1.2}
    assert best["any", "extractive"] == {"row": "specdec int4 ar B=1", "ratio": 0.8}
    assert best["ar", "chat"] == {"row": "specdec int4 ar B=1", "ratio": 0.9}


def test_without_a_faithful_enough_row_the_table_says_so() -> None:
    forced = {**FORCED, "peer int4": _forced(0.99, 0.99)}
    (entry,) = matched(RESULTS, forced)
    assert all(v is None for v in entry["best"].values())
    assert "no qualifying row" in "\n".join(matched_table(RESULTS, forced))

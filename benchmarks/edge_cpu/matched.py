"""Each peer row against specdec's fastest row that is at least as faithful: the comparison at matched fidelity.

Why: a peer can be fast partly because it gives up fidelity (its int4 is a second rounding of the GGUF's
weights), so speed is compared only between rows that agree with fp32 at least as often. Fidelity is the
teacher-forced next-token agreement with the fp32 reference along its answers (``parent.forced_agreement``),
per model. A specdec row *qualifies* for a peer row when it runs at the same batch size, its model agrees with
the reference at least as often as the peer's on both workloads, and it is exact: an ``ar`` row, or an ``ems``
row whose every greedy answer equals its own ``ar``'s (``identical_to_own_ar``).
"""

from __future__ import annotations

from typing import Any

from benchmarks.edge_cpu import WORKLOADS

#: the issue's bars for plain decoding: specdec ``ar`` at matched fidelity over these peer rows
AR_BARS = {"ORT GenAI int4 B=1": 0.9, "OpenVINO int4 continuous batching B=8": 0.9}


def _rates(forced: dict[str, dict[str, Any]], model: str | None) -> dict[str, float] | None:
    row = forced.get(model or "")
    if not row or "error" in row:
        return None
    return {w: row[w]["rate"] for w in WORKLOADS}


def _exact(row: dict[str, Any]) -> bool:
    if row.get("method") == "ar":
        return True
    own = row.get("identical_to_own_ar") or {}
    return all(own.get(w) and own[w]["identical"] == 1.0 for w in WORKLOADS)


def qualifying(
    results: dict[str, dict[str, Any]], forced: dict[str, dict[str, Any]], peer: dict[str, Any], ar_only: bool
) -> list[str]:
    """The specdec rows that qualify for ``peer`` (module docstring); only ``ar`` ones when ``ar_only``."""
    want = _rates(forced, peer.get("model"))
    if want is None:
        return []
    out = []
    for key, row in results.items():
        rates = _rates(forced, row.get("model"))
        if row["kind"] != "specdec" or "error" in row or row["batch"] != peer["batch"] or rates is None:
            continue
        if ar_only and row.get("method") != "ar":
            continue
        if _exact(row) and all(rates[w] >= want[w] for w in WORKLOADS):
            out.append(key)
    return out


def matched(results: dict[str, dict[str, Any]], forced: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Per peer row: its fidelity, and per workload the fastest qualifying specdec row (any exact one, and ``ar``
    alone) with its ratio of tokens/s over the peer's."""
    lines = []
    for key, peer in results.items():
        if peer["kind"] != "peer" or "error" in peer:
            continue
        entry: dict[str, Any] = {"peer": key, "fidelity": _rates(forced, peer.get("model")), "best": {}}
        for label, ar_only in (("any", False), ("ar", True)):
            rows = qualifying(results, forced, peer, ar_only)
            for w in WORKLOADS:
                theirs = peer["tokens_per_second"][w]
                if not rows or not theirs:
                    entry["best"][label, w] = None
                    continue
                best = max(rows, key=lambda k: results[k]["tokens_per_second"][w] or 0)
                ours = results[best]["tokens_per_second"][w] or 0
                entry["best"][label, w] = {"row": best, "ratio": round(ours / theirs, 3)}
        lines.append(entry)
    return lines


def _cell(best: dict[str, Any] | None) -> str:
    return "no qualifying row" if best is None else f"{best['ratio']:.2f}× ({best['row']})"


def matched_table(results: dict[str, dict[str, Any]], forced: dict[str, dict[str, Any]]) -> list[str]:
    """The markdown of ``matched`` and the ``ar`` bars' verdicts (nothing without forced agreement)."""
    entries = matched(results, forced)
    if not entries:
        return []
    lines = [
        "### At matched fidelity: each peer row against specdec's fastest exact row at least as faithful",
        "",
        "A specdec row qualifies for a peer row at the same batch size when its model's teacher-forced agreement "
        "with the fp32 reference (table above) is at least the peer's on both workloads and it is exact (`ar`, or "
        "`ems` whose every greedy answer equals its own `ar`'s). Cells: specdec's tokens/s over the peer's "
        "(`benchmarks/edge_cpu/matched.py`).",
        "",
        "| peer row | its agreement, chat / extr. | best exact, chat | best exact, extractive | best `ar`, chat "
        "| best `ar`, extractive |",
        "|:---|---:|:---|:---|:---|:---|",
    ]
    for e in entries:
        fid = e["fidelity"]
        fid_cell = "–" if fid is None else " / ".join(f"{fid[w]:.1%}" for w in WORKLOADS)
        cells = [_cell(e["best"][label, w]) for label in ("any", "ar") for w in WORKLOADS]
        lines.append(f"| {e['peer']} | {fid_cell} | " + " | ".join(cells) + " |")
    lines.append("")
    for peer, bar in AR_BARS.items():
        entry = next((e for e in entries if e["peer"] == peer), None)
        if entry is None:
            continue
        got = [entry["best"]["ar", w] for w in WORKLOADS]
        verdict = ", ".join(f"{w} " + ("–" if g is None else f"{g['ratio']:.2f}×") for w, g in zip(WORKLOADS, got))
        held = all(g is not None and g["ratio"] >= bar for g in got)
        lines.append(
            f"- specdec `ar` over {peer} at matched fidelity: {verdict} (bar {bar}×: {'met' if held else 'not met'})."
        )
    lines.append("")
    return lines

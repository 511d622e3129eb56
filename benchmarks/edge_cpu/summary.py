"""Each contestant over its repeats, its ratios to the baseline, and the notes stated from the table's numbers."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from benchmarks.edge_cpu import WORKLOADS
from benchmarks.edge_cpu.contestants import Contestant
from benchmarks.edge_cpu.report import identical_cell
from benchmarks.peers.catalog import MODELS

# -- aggregation -----------------------------------------------------------------------------


def _median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def _prefix_share(got: Sequence[Any], want: Sequence[Any]) -> float:
    """The share of the reference answer repeated before the first difference (1.0 when identical)."""
    if not want:
        return 1.0 if not got else 0.0
    same = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    return same / len(want)


def agreement(run: dict[str, Any], reference: dict[str, Any] | None) -> dict[str, float] | None:
    """Identical answers and mean common-prefix share against the reference, by token ids (every contestant
    runs the same tokenizer's ids)."""
    if reference is None:
        return None
    pairs = list(zip(run["ids"], reference["ids"]))
    return {
        "identical": sum(a == b for a, b in pairs) / len(pairs),
        "prefix": statistics.mean(_prefix_share(a, b) for a, b in pairs),
    }


def prompt_ids_differ(runs: list[dict[str, Any]], prompts: dict[str, list[list[int]]]) -> int:
    """How many prompts, over every run of a contestant, the engine reports having seen as other token ids than
    the ones it was given (0: every engine decoded the same prompts; a template or tokenizer difference would
    otherwise look like speed)."""
    return sum(
        int(seen != want)
        for run in runs
        for name, want_ids in prompts.items()
        for seen, want in zip(run["workloads"][name]["prompt_ids"], want_ids, strict=True)
    )


def summarise(
    contestant: Contestant,
    runs: list[dict[str, Any]],
    reference: dict[str, Any] | None,
    own_plain: dict[str, Any] | None = None,
    prompts: dict[str, list[list[int]]] | None = None,
) -> dict[str, Any]:
    """One contestant over its repeats: median tokens/s per workload and mixed, TTFT, peak RSS, agreement with
    the reference, with its own row without speculation (``own_plain``), and whether it saw ``prompts``."""
    good = [r for r in runs if "error" not in r]
    row: dict[str, Any] = {
        "label": contestant.label,
        "batch": contestant.batch,
        "kind": contestant.kind,
        "repeats": len(good),
        "model": model_label(contestant),
        "method": contestant.method,
    }
    if not good:
        row["error"] = runs[0]["error"] if runs else "not run"
        return row
    tps: dict[str, float | None] = {}
    for name in WORKLOADS:
        tps[name] = _median([r["workloads"][name]["tokens"] / r["workloads"][name]["seconds"] for r in good])
    tps["mix"] = _median(
        [
            sum(w["tokens"] for w in r["workloads"].values()) / sum(w["seconds"] for w in r["workloads"].values())
            for r in good
        ]
    )
    row["tokens_per_second"] = {k: None if v is None else round(v, 2) for k, v in tps.items()}
    row["ttft_ms"] = {
        name: round(1000 * statistics.median([t for r in good for t in r["workloads"][name]["ttft"]]), 1)
        for name in WORKLOADS
    }
    row["peak_rss_mb"] = max(r["peak_rss_mb"] for r in good)
    row["load_seconds"] = round(statistics.median(r["load_seconds"] for r in good), 2)
    row["tokens"] = {name: good[0]["workloads"][name]["tokens"] for name in WORKLOADS}
    row["agreement"] = {
        name: agreement(good[0]["workloads"][name], reference and reference[name]) for name in WORKLOADS
    }
    if prompts is not None:
        row["prompt_ids_differ"] = prompt_ids_differ(good, prompts)
    if contestant.plain_key:
        # greedy speculation must answer what the same model answers without it: the exactness check
        row["identical_to_own_ar"] = {
            name: agreement(good[0]["workloads"][name], own_plain and own_plain[name]) for name in WORKLOADS
        }
    if contestant.method == "ems":
        drafted = sum(good[0]["workloads"][n]["draft_tokens"] for n in WORKLOADS)
        accepted = sum(good[0]["workloads"][n]["accepted_draft_tokens"] for n in WORKLOADS)
        row["acceptance_rate"] = round(accepted / drafted, 3) if drafted else None
        row["draft_length"] = good[0].get("draft_length")
    elif good[0].get("draft_tokens"):  # llama-server's n-gram speculation reports its drafts
        row["acceptance_rate"] = round(good[0]["accepted_draft_tokens"] / good[0]["draft_tokens"], 3)
    if "command" in good[0]:
        row["command"] = good[0]["command"]
    row["versions"] = good[0].get("versions", {})
    row["answers"] = {name: good[0]["workloads"][name]["texts"] for name in WORKLOADS}
    return row


def model_label(contestant: Contestant) -> str | None:
    """The label its model's teacher-forced agreement is filed under (``parent.scorers``), None for HF."""
    if contestant.kind == "specdec":
        return f"specdec {contestant.precision}"
    return MODELS[contestant.peer.model].label if contestant.peer is not None else None


def add_ratios(rows: dict[str, dict[str, Any]], baseline_key: str) -> None:
    """Each row's tokens/s over llama-server batch 1's, per workload (None where either is missing)."""
    base = rows.get(baseline_key, {}).get("tokens_per_second")
    for row in rows.values():
        tps = row.get("tokens_per_second")
        row["over_llama"] = {
            k: round(tps[k] / base[k], 3) if tps and base and tps[k] and base[k] else None for k in (*WORKLOADS, "mix")
        }


def load_notes(load_before: Sequence[float] | None, info: dict[str, Any], threads: int) -> list[str]:
    """A warning when other jobs held the CPU: it stretches every number, and threads that spin-wait most.

    Measured here: with one of 2 cores busy, llama.cpp's 2 OpenMP threads fell from 17 to 0.4 tokens/s and
    ONNX Runtime on 2 threads ran at half its 1-thread speed, while torch lost far less.
    """
    if not load_before or load_before[0] < 0.5:
        return []
    return [
        f"OTHER JOBS SHARED THE CPU: load average {load_before[0]} before this run started, on "
        f"{info.get('cpu_count')} cores, with {threads} threads per contestant. Runtimes whose threads spin-wait "
        "for each other (llama.cpp's OpenMP, ONNX Runtime) lose far more than the others when one of their "
        "threads is descheduled, so these ratios say little; compare runs made on an idle machine."
    ]


def auto_notes(rows: dict[str, dict[str, Any]], baseline_key: str) -> list[str]:
    """What the table says, stated from its own numbers."""
    notes = []
    ok = {k: r for k, r in rows.items() if "error" not in r}
    base = ok.get(baseline_key)
    if base:
        fastest = max(ok, key=lambda k: ok[k]["tokens_per_second"]["mix"])
        ones = {k: r for k, r in ok.items() if r["batch"] == 1 and r["kind"] == "specdec"}
        notes.append(
            f"llama-server Q4_1 batch 1: {base['tokens_per_second']['mix']:.1f} tokens/s on the mix. Fastest: "
            f"{fastest} at {ok[fastest]['tokens_per_second']['mix']:.1f} tokens/s "
            f"({ok[fastest]['over_llama']['mix']:.2f}× llama-server batch 1)."
        )
        notes += peer_notes(ok)
        if ones:
            best = max(ones, key=lambda k: ones[k]["tokens_per_second"]["mix"])
            notes.append(
                f"Fastest specdec contestant at batch 1 (one stream): {best}, "
                f"{ones[best]['over_llama']['mix']:.2f}× llama-server batch 1 on the mix "
                f"({ones[best]['over_llama']['chat']:.2f}× on chat, "
                f"{ones[best]['over_llama']['extractive']:.2f}× on extractive)."
            )
        acceptance = acceptance_note(ok, base)
        if acceptance:
            notes.append(acceptance)
        beating = [
            k
            for k, r in ok.items()
            if r["kind"] == "specdec" and r["over_llama"]["mix"] and r["over_llama"]["mix"] > 1.0
        ]
        notes.append(
            f"{len(beating)} of {sum(r['kind'] == 'specdec' for r in ok.values())} specdec contestants "
            "beat llama-server batch 1 on the mix" + (f" ({', '.join(beating)})." if beating else ".")
        )
    differ = [
        k
        for k, r in ok.items()
        if r["kind"] == "specdec"
        and r.get("agreement", {}).get("chat")
        and any(r["agreement"][n]["identical"] < 1.0 for n in WORKLOADS)
    ]
    if differ:
        notes.append(
            "specdec answers that differ from fp32 ar at batch 1 on some prompt: "
            + ", ".join(differ)
            + ". int8 and int4 run int8 activations (their weights are the GGUF's own blocks), w8a8 "
            "also rounds its weights again and int4-rtn rounds them to int4 again, so their logits differ from "
            "fp32's and some greedy answers part from fp32's, as the peers' do."
        )
    inexact = [
        k
        for k, r in ok.items()
        if r["kind"] == "specdec"
        and r.get("identical_to_own_ar", {}).get("chat")
        and any(r["identical_to_own_ar"][n]["identical"] < 1.0 for n in WORKLOADS)
    ]
    checked = [k for k, r in ok.items() if r["kind"] == "specdec" and r.get("identical_to_own_ar", {}).get("chat")]
    unseen = [f"{k} ({r['prompt_ids_differ']})" for k, r in ok.items() if r.get("prompt_ids_differ")]
    notes.append(
        "PROMPT IDS DIFFER from the ones given (prompts, over all repeats): " + ", ".join(unseen) + "."
        if unseen
        else "Every contestant reports having decoded exactly the prompt token ids it was given (specdec's chat "
        "template, applied once)."
    )
    if inexact:
        notes.append(
            "GREEDY EMS DIFFERS from ar of the same export and batch on some prompt: "
            + ", ".join(
                f"{k} ({identical_cell(ok[k]['identical_to_own_ar'])} identical, chat / extractive)" for k in inexact
            )
            + ". Greedy speculation is exact when a verification step computes the logits a one-row step does "
            "(tests/test_batch_invariance.py checks it bitwise): a kernel whose rounding depends on the number of rows "
            "breaks that."
        )
    elif checked:
        notes.append(f"Every greedy ems answer ({len(checked)} contestants) equals ar's of the same export and batch.")
    errors: dict[str, list[str]] = {}
    for key, r in rows.items():
        if "error" in r:
            errors.setdefault(r["error"], []).append(key)
    notes += [f"{', '.join(keys)}: {error}" for error, keys in errors.items()]
    return notes


def peer_notes(ok: dict[str, dict[str, Any]]) -> list[str]:
    """The best peer and the best specdec row at batch 1 and at the largest batch, and the peers' speculation
    against their own plain decoding (which a greedy speculation must repeat)."""
    notes = []
    for batch in sorted({1, max(r["batch"] for r in ok.values())}):
        best = {}
        for kind in ("peer", "specdec"):
            rows = {k: r for k, r in ok.items() if r["kind"] == kind and r["batch"] == batch}
            if rows:
                best[kind] = max(rows, key=lambda k: rows[k]["tokens_per_second"]["mix"] or 0)
        if len(best) == 2:
            p, s = (ok[best[k]]["tokens_per_second"]["mix"] for k in ("peer", "specdec"))
            notes.append(
                f"Batch {batch}: best peer {best['peer']} {p:.1f} tokens/s, best specdec {best['specdec']} "
                f"{s:.1f} ({s / p:.2f}×)."
            )
    for k, r in ok.items():
        own = r.get("identical_to_own_ar", {})
        if r["kind"] == "peer" and own.get("chat"):
            notes.append(
                f"{k}: {identical_cell(own)} of its answers (chat / extractive) equal the same model's "
                "without speculation."
            )
    return notes


def acceptance_note(ok: dict[str, dict[str, Any]], base: dict[str, Any]) -> str | None:
    """Issue 21's four speed and memory lines, from this run's rows (None without the int4 and batch-8 rows)."""
    int4 = ok.get("specdec int4 ar B=1")
    eights = {k: r for k, r in ok.items() if r["kind"] == "specdec" and r["batch"] == 8}
    ones = {k: r for k, r in ok.items() if r["kind"] == "specdec" and r["batch"] == 1}
    if int4 is None or not eights or not base.get("peak_rss_mb"):
        return None
    best1 = max(ones, key=lambda k: ones[k]["over_llama"]["mix"] or 0)
    best8 = max(eights, key=lambda k: eights[k]["over_llama"]["mix"] or 0)
    rss = int4["peak_rss_mb"]
    return (
        f"Acceptance lines (mix, ratios to llama-server batch 1): int4 ar B=1 {int4['over_llama']['mix']:.2f}x "
        f"(>= 0.8); best B=1 {ones[best1]['over_llama']['mix']:.2f}x, {best1} (>= 1.2); best B=8 "
        f"{eights[best8]['over_llama']['mix']:.2f}x, {best8} (>= 3); int4 peak RSS at B=1 {rss:.0f} MB, "
        f"{rss / base['peak_rss_mb']:.2f}x llama-server's {base['peak_rss_mb']:.0f} MB (<= 2)."
    )

"""The parent's runs: every contestant interleaved over repeats, the forced agreement, the reference answers."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from benchmarks.edge_cpu import CHAT_PROMPTS, REFERENCE_GRAPH, WORKLOADS
from benchmarks.edge_cpu.children import run_child
from benchmarks.edge_cpu.contestants import Contestant
from benchmarks.edge_cpu.forced import miss_margins
from benchmarks.edge_cpu.summary import summarise


def run_interleaved(
    plan: Sequence[Contestant],
    common: dict[str, Any],
    repeats: int,
    exports: dict[str, dict[str, Any]],
    args: argparse.Namespace,
) -> dict[str, list[dict[str, Any]]]:
    """Every contestant once per repeat, each in its own process, the order rotated between repeats."""
    runs: dict[str, list[dict[str, Any]]] = {c.key: [] for c in plan}
    work = args.export_dir / "runs"
    with tqdm(total=len(plan) * repeats, desc="contestants", unit="run") as bar:
        for repeat in range(repeats):
            shift = repeat % max(1, len(plan))
            for c in [*plan[shift:], *plan[:shift]]:
                bar.set_postfix_str(f"{c.key} #{repeat + 1}")
                spec = {
                    **common,
                    "kind": c.kind,
                    "batch": c.batch,
                    "method": c.method,
                    "drafter": c.drafter,
                    "lookup": c.lookup,
                    "kv_cache": c.kv_cache,
                    "k": args.ngram_k if c.drafter in ("ngram", "hybrid") else args.draft_k,
                    "export": exports.get(c.precision or "", {}).get("dir"),
                }
                slug = "".join(ch if ch.isalnum() else "_" for ch in c.key)
                runs[c.key].append(run_child(spec, work, slug))
                bar.update()
    return runs


def forced_agreement(
    common: dict[str, Any], reference: dict[str, Any], exports: dict[str, dict[str, Any]], with_llama: bool, work: Path
) -> dict[str, dict[str, Any]]:
    """Next-token agreement of llama.cpp and each quantized export with the reference along its answers.

    Why beside the answers' agreement: a greedy answer that parts from the reference after a near-tie then
    continues from a different context, so "identical answers" counts one flip as a whole answer lost; here
    every position is judged on the reference's own context, which says how often the weights and the
    arithmetic choose differently, and compares llama.cpp's rounding with specdec's on the same footing.
    """
    pairs = {
        name: [[p, a] for p, a in zip(common["prompts"][name], reference[name]["ids"], strict=True)]
        for name in WORKLOADS
    }
    models = ([("llama.cpp Q4_1", {"model": "llama"})] if with_llama else []) + [
        (f"specdec {precision}", {"model": "specdec", "export": info["dir"]})
        for precision, info in exports.items()
        if "dir" in info
    ]
    out: dict[str, dict[str, Any]] = {}
    for label, extra in tqdm(models, desc="next-token agreement", unit="model"):
        spec = {**common, **extra, "kind": "forced", "pairs": pairs}
        result = run_child(spec, work, "forced_" + "".join(ch if ch.isalnum() else "_" for ch in label))
        out[label] = (
            result
            if "error" in result
            else {
                name: {**w, "rate": w["agree"] / w["positions"] if w["positions"] else None}
                for name, w in result["workloads"].items()
            }
        )
    own = out.get(REFERENCE_GRAPH)
    judged = [row for row in out.values() if "error" not in row]
    if own is not None and "error" not in own:
        for row in judged:
            for name in WORKLOADS:
                row[name]["near_ties"] = miss_margins(row[name], own[name], reference[name]["ids"])
    for row in judged:  # the per-position lists served the margins; the report keeps their summary
        for w in row.values():
            w.pop("picks", None)
            w.pop("margins", None)
    return out


def collect(
    rows: Sequence[Contestant],
    runs: dict[str, list[dict[str, Any]]],
    unavailable: dict[str, str],
) -> tuple[dict[str, dict[str, Any]], dict[str, Any] | None]:
    """Each contestant's summary, and the reference answers (specdec fp32 ar at batch 1) they are compared with."""

    def first_good(key: str) -> dict[str, Any] | None:
        run = next((r for r in runs.get(key, []) if "error" not in r), None)
        return None if run is None else run["workloads"]

    reference = first_good("specdec fp32 ar B=1")
    results = {}
    for c in rows:
        if c.key in unavailable:
            results[c.key] = {"label": c.label, "batch": c.batch, "kind": c.kind, "error": unavailable[c.key]}
        else:
            own_ar = first_good(f"specdec {c.precision} ar B={c.batch}") if c.method == "ems" else None
            results[c.key] = summarise(c, runs[c.key], reference, own_ar)
    return results, reference


def workload_prompts(
    n_prompts: int,
    tokenizer: Any,
    max_tokens: int,
) -> tuple[dict[str, list[str]], dict[str, list[list[int]]], int]:
    """The two workloads' texts, their chat-templated token ids, and the cache length they need."""
    from specdec.bench.workloads import build_workload
    from specdec.runtime.text import encode_text

    texts = {
        "chat": [CHAT_PROMPTS[i % len(CHAT_PROMPTS)] for i in range(n_prompts)],
        "extractive": build_workload(n_prompts),
    }
    prompts = {name: [encode_text(tokenizer, t, chat=True) for t in ps] for name, ps in texts.items()}
    max_len = -(-(max(len(ids) for ps in prompts.values() for ids in ps) + max_tokens + 16) // 64) * 64
    return texts, prompts, max_len

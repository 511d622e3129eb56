"""The parent's runs: every contestant interleaved over repeats, each in its own process (a peer under its own
venv's interpreter), the forced agreement and perplexity of every model, the reference answers."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from benchmarks.edge_cpu import CHAT_PROMPTS, CHILD_TIMEOUT_S, REFERENCE_GRAPH, WORKLOADS
from benchmarks.edge_cpu.children import run_child
from benchmarks.edge_cpu.contestants import Contestant
from benchmarks.edge_cpu.forced import miss_margins
from benchmarks.edge_cpu.summary import summarise
from benchmarks.peers.catalog import MODELS, model_spec, python_of, row_spec
from benchmarks.peers.fidelity import perplexity
from benchmarks.peers.protocol import run_peer

#: the runner module of each peer (``benchmarks.peers.<runner>``)
PEER_RUNNERS = {"llama.cpp": "llama_server", "ortgenai": "ortgenai", "openvino": "openvino"}


def _slug(text: str) -> str:
    return "".join(ch if ch.isalnum() else "_" for ch in text)


def contestant_spec(
    c: Contestant, common: dict[str, Any], exports: dict[str, dict[str, Any]], args: argparse.Namespace
) -> dict[str, Any]:
    """What one contestant's child is given: the shared prompts, budget and threads, and its own settings."""
    if c.peer is not None:
        spec = row_spec(c.peer, args.peers_dir, args.venvs, args.threads)
        return {**common, **spec, "work": str((args.export_dir / "runs").resolve()), "name": _slug(c.key)}
    return {
        **common,
        "task": "generate",
        "kind": c.kind,
        "batch": c.batch,
        "method": c.method,
        "drafter": c.drafter,
        "lookup": c.lookup,
        "kv_cache": c.kv_cache,
        "k": args.ngram_k if c.drafter in ("ngram", "hybrid") else args.draft_k,
        "export": exports.get(c.precision or "", {}).get("dir"),
    }


def run_one(spec: dict[str, Any], c: Contestant, args: argparse.Namespace) -> dict[str, Any]:
    """One run of one contestant in its own process: a peer under its own venv's interpreter."""
    work = args.export_dir / "runs"
    if c.peer is None:
        return run_child(spec, work, _slug(c.key))
    peer = MODELS[c.peer.model].peer
    python = python_of(peer, args.venvs)
    return run_peer(python, f"benchmarks.peers.{PEER_RUNNERS[peer]}", spec, work, _slug(c.key), CHILD_TIMEOUT_S)


def run_interleaved(
    plan: Sequence[Contestant],
    common: dict[str, Any],
    repeats: int,
    exports: dict[str, dict[str, Any]],
    args: argparse.Namespace,
) -> dict[str, list[dict[str, Any]]]:
    """Every contestant once per repeat, each in its own process, the order rotated between repeats."""
    runs: dict[str, list[dict[str, Any]]] = {c.key: [] for c in plan}
    with tqdm(total=len(plan) * repeats, desc="contestants", unit="run") as bar:
        for repeat in range(repeats):
            shift = repeat % max(1, len(plan))
            for c in [*plan[shift:], *plan[:shift]]:
                bar.set_postfix_str(f"{c.key} #{repeat + 1}")
                runs[c.key].append(run_one(contestant_spec(c, common, exports, args), c, args))
                bar.update()
    return runs


def scorers(
    exports: dict[str, dict[str, Any]], peer_models: Sequence[str], args: argparse.Namespace
) -> list[tuple[str, Path | str, str, dict[str, Any]]]:
    """Who is scored along the reference's answers: (label, interpreter, module, spec) of each specdec export
    that exists and of each peer model the table runs."""
    out: list[tuple[str, Path | str, str, dict[str, Any]]] = [
        (f"specdec {precision}", sys.executable, "benchmarks.edge_cpu.children", {"export": info["dir"]})
        for precision, info in exports.items()
        if "dir" in info
    ]
    for name in peer_models:
        model = MODELS[name]
        spec = {
            **model_spec(model, args.peers_dir, args.venvs, args.threads),
            "work": str((args.export_dir / "runs").resolve()),
        }
        module = f"benchmarks.peers.{PEER_RUNNERS[model.peer]}"
        out.append((model.label, python_of(model.peer, args.venvs), module, {**spec, "name": f"score_{name}"}))
    return out


def forced_agreement(
    common: dict[str, Any],
    reference: dict[str, Any],
    models: Sequence[tuple[str, Path | str, str, dict[str, Any]]],
    documents: list[list[int]],
    work: Path,
) -> dict[str, dict[str, Any]]:
    """Next-token agreement of each model with the reference along its answers, and its held-out perplexity.

    Why beside the answers' agreement: a greedy answer that parts from the reference after a near-tie then
    continues from a different context, so "identical answers" counts one flip as a whole answer lost; here
    every position is judged on the reference's own context, which says how often the weights and the
    arithmetic choose differently, and compares every engine's rounding with specdec's on the same footing.
    The perplexity of held-out text (``specdec.bench.workloads.held_out_documents``) says the same of text no
    model wrote.
    """
    pairs = {
        name: [[p, a] for p, a in zip(common["prompts"][name], reference[name]["ids"], strict=True)]
        for name in WORKLOADS
    }
    longest = max(len(d) for d in documents) if documents else 0
    max_len = max(common["max_len"], -(-(longest + 16) // 64) * 64)
    out: dict[str, dict[str, Any]] = {}
    for label, python, module, extra in tqdm(models, desc="next-token agreement", unit="model"):
        spec = {**common, **extra, "task": "score", "pairs": pairs, "documents": documents, "max_len": max_len}
        result = run_peer(python, module, spec, work, "forced_" + _slug(label), CHILD_TIMEOUT_S)
        if "error" in result:
            out[label] = result
            continue
        out[label] = {
            name: {**w, "rate": w["agree"] / w["positions"] if w["positions"] else None}
            for name, w in result["forced"].items()
        }
        out[label]["perplexity"] = perplexity(result["nll"], result["predicted"])
    own = out.get(REFERENCE_GRAPH)
    judged = [row for row in out.values() if "error" not in row]
    if own is not None and "error" not in own:
        for row in judged:
            for name in WORKLOADS:
                row[name]["near_ties"] = miss_margins(row[name], own[name], reference[name]["ids"])
    for row in judged:  # the per-position lists served the margins; the report keeps their summary
        for name in WORKLOADS:
            row[name].pop("picks", None)
            row[name].pop("margins", None)
    return out


def collect(
    rows: Sequence[Contestant],
    runs: dict[str, list[dict[str, Any]]],
    unavailable: dict[str, str],
    prompts: dict[str, list[list[int]]],
) -> tuple[dict[str, dict[str, Any]], dict[str, Any] | None]:
    """Each contestant's summary, and the reference answers (specdec fp32 ar at batch 1) they are compared with;
    ``prompts``: the token ids every contestant was given, which each must report having seen."""

    def first_good(key: str) -> dict[str, Any] | None:
        run = next((r for r in runs.get(key, []) if "error" not in r), None)
        return None if run is None else run["workloads"]

    reference = first_good("specdec fp32 ar B=1")
    results = {}
    for c in rows:
        if c.key in unavailable:
            results[c.key] = {"label": c.label, "batch": c.batch, "kind": c.kind, "error": unavailable[c.key]}
        else:
            own_plain = first_good(c.plain_key) if c.plain_key else None
            results[c.key] = summarise(c, runs[c.key], reference, own_plain, prompts)
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

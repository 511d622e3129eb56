"""``python -m benchmarks.edge_cpu``: the command line and the run from exports to the written report."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import benchmarks.edge_cpu as package
from benchmarks.edge_cpu import BASELINE, DEFAULT_EXPORT_DIR, PRECISIONS, SKIP_NAMES
from benchmarks.edge_cpu.contestants import contestants
from benchmarks.edge_cpu.exports import ensure_exports, ensure_hf_dir
from benchmarks.edge_cpu.parent import collect, forced_agreement, run_interleaved, scorers, workload_prompts
from benchmarks.edge_cpu.report import markdown_report, plot
from benchmarks.edge_cpu.summary import add_ratios, auto_notes, load_notes
from benchmarks.peers.catalog import (
    DEFAULT_PEERS_DIR,
    DEFAULT_VENVS,
    LLAMA_NGRAM,
    OPENVINO_FAITHFUL,
    OPENVINO_LOOKUP,
    PEERS,
)
from benchmarks.peers.convert import ensure_models, shipped_gguf
from specdec.bench.harness import int_list, machine_info, run_command, utc_stamp


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.edge_cpu",
        description=package.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="a check, not a measurement: 2 prompts per workload, 16 tokens, 1 repeat, batch 1 only; "
        "writes edge_cpu_quick.*",
    )
    p.add_argument("--repeats", type=int, default=2, help="interleaved repeats (the median is kept)")
    p.add_argument("--max-tokens", type=int, default=96, help="new tokens at most per request")
    p.add_argument("--prompts", type=int, default=8, help="prompts per workload")
    p.add_argument("--batch-sizes", type=int_list, default=(1, 4, 8), help="batch sizes (HF: 1 and 8 of them)")
    p.add_argument("--threads", type=int, default=2, help="threads of every contestant")
    p.add_argument("--ngram-k", type=int, default=6, help="most draft tokens of ems with the n-gram drafter")
    p.add_argument("--draft-k", type=int, default=4, help="most draft tokens of ems with the draft model")
    p.add_argument("--lookup-tokens", type=int, default=10, help="HF prompt_lookup_num_tokens")
    p.add_argument(
        "--peers",
        default=",".join(PEERS),
        help=f"comma-separated peers to run beside specdec, of {', '.join(PEERS)}; 'none' for none",
    )
    p.add_argument("--documents", type=int, default=None, help="held-out documents for perplexity (default: all)")
    p.add_argument(
        "--export-dir",
        type=Path,
        default=DEFAULT_EXPORT_DIR,
        help=f"where the exports are made once and reused ({', '.join(f'{p}/' for p in PRECISIONS)}, hf/)",
    )
    p.add_argument("--peers-dir", type=Path, default=DEFAULT_PEERS_DIR, help="where the peers' models are made")
    p.add_argument("--venvs", type=Path, default=DEFAULT_VENVS, help="the peers' venvs (install.sh)")
    p.add_argument(
        "--reexport",
        action="store_true",
        help="export again even where --export-dir holds an export (after the exporter changed)",
    )
    p.add_argument("--skip", default="", help=f"comma-separated, any of: {', '.join(SKIP_NAMES)}")
    p.add_argument("--out-dir", type=Path, default=Path("benchmarks/results"))
    return p


def _peers(parser: argparse.ArgumentParser, text: str) -> tuple[str, ...]:
    wanted = tuple(s.strip() for s in text.split(",") if s.strip() and s.strip() != "none")
    unknown = sorted(set(wanted) - set(PEERS))
    if unknown:
        parser.error(f"--peers: unknown {', '.join(unknown)} (known: {', '.join(PEERS)}, none)")
    return wanted


def main(argv: Sequence[str] | None = None) -> int:
    """Make or reuse the exports and the peers' models, run every contestant interleaved in subprocesses, score
    every model along the reference's answers, write the report."""
    from specdec.bench.report import write_report
    from specdec.bench.workloads import held_out_documents
    from specdec.models.loading import load_metadata

    parser = build_parser()
    args = parser.parse_args(argv)
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    if skip - set(SKIP_NAMES):
        parser.error(f"--skip: unknown {', '.join(sorted(skip - set(SKIP_NAMES)))} (known: {', '.join(SKIP_NAMES)})")
    peers = _peers(parser, args.peers)
    quick = args.quick
    n_prompts, max_tokens, repeats = (2, 16, 1) if quick else (args.prompts, args.max_tokens, args.repeats)
    batches = (1,) if quick else args.batch_sizes
    if max(batches) > n_prompts:  # each workload is cut into batches: a batch of B needs B prompts
        parser.error(
            f"--batch-sizes {max(batches)} needs --prompts {max(batches)} or more: with {n_prompts} prompts "
            f"per workload a 'batch of {max(batches)}' would decode only {n_prompts} sequences"
        )
    load_before = machine_info().get("load_average")
    start = time.perf_counter()

    rows = [c for c in contestants(batches, peers) if not skip & set(c.tags)]
    precisions = [p for p in PRECISIONS if any(c.precision == p for c in rows)]
    exports = ensure_exports(precisions, args.export_dir, args.draft_k, max(8, *batches), args.reexport)
    hf_dir = ensure_hf_dir(args.export_dir)
    peer_models = sorted({c.peer.model for c in rows if c.peer is not None})
    made = ensure_models(peer_models, args.peers_dir, args.venvs, hf_dir)
    meta_model = load_metadata(hf_dir)  # config and tokenizer, no weights
    texts, prompts, max_len = workload_prompts(n_prompts, meta_model.tokenizer, max_tokens)
    documents = held_out_documents(meta_model.tokenizer)[: args.documents]
    common = {
        "prompts": prompts,
        "max_tokens": max_tokens,
        "threads": args.threads,
        "max_len": max_len,
        "eos": sorted(meta_model.eos_token_ids),
        "hf_dir": str(hf_dir),
        "lookup_tokens": args.lookup_tokens,
    }
    unavailable = {
        c.key: exports[c.precision]["error"] for c in rows if c.kind == "specdec" and "error" in exports[c.precision]
    }
    unavailable.update({c.key: made[c.peer.model]["error"] for c in rows if c.peer and "error" in made[c.peer.model]})
    runs = run_interleaved([c for c in rows if c.key not in unavailable], common, repeats, exports, args)
    results, reference = collect(rows, runs, unavailable, prompts)
    scored = [name for name in peer_models if "error" not in made[name]]
    forced = (
        {}
        if reference is None
        else forced_agreement(common, reference, scorers(exports, scored, args), documents, args.export_dir / "runs")
    )
    add_ratios(results, BASELINE)
    info = machine_info()
    notes = [*load_notes(load_before, info, args.threads), *auto_notes(results, BASELINE)]
    if reference is None:
        notes.append("No agreement column: specdec fp32 ar at batch 1 (the reference) did not run.")
    if quick:
        notes.append("A --quick check (2 prompts, 16 tokens, 1 repeat, batch 1): not a measurement.")
    config = {
        "max_tokens": max_tokens,
        "prompts": n_prompts,
        "repeats": repeats,
        "batch_sizes": batches,
        "threads": args.threads,
        "ngram_k": args.ngram_k,
        "draft_k": args.draft_k,
        "lookup_tokens": args.lookup_tokens,
        "max_len": max_len,
        "skip": sorted(skip),
        "peers": peers,
        "documents": len(documents),
        "llama_ngram": LLAMA_NGRAM,
        "openvino_lookup": OPENVINO_LOOKUP,
        "openvino_faithful": OPENVINO_FAITHFUL,
        "quick": quick,
    }
    meta = {
        "date": utc_stamp(),
        "command": run_command("benchmarks.edge_cpu", argv),
        "gguf": str(shipped_gguf()),
        "machine": info,
        "load_before": load_before,
        "load_after": info.get("load_average"),
        "versions": versions_of(results),
        "elapsed_seconds": round(time.perf_counter() - start, 1),
        "config": config,
        "exports": exports,
        "peer_models": made,
        "prompt_tokens": {n: (min(map(len, ps)), max(map(len, ps))) for n, ps in prompts.items()},
        "prompt_texts": texts,
        "baseline": BASELINE,
        "notes": notes,
    }
    doc = {"meta": meta, "results": results, "next_token_agreement": forced}
    text = write_report(doc, args.out_dir, "edge_cpu_quick" if quick else "edge_cpu", markdown_report, plot)
    print(text)
    failed = [k for k, r in results.items() if "error" in r and k not in unavailable]
    return 1 if failed else 0


def versions_of(results: dict[str, dict[str, Any]]) -> dict[str, str]:
    """Every library version the rows report, merged."""
    versions: dict[str, str] = {}
    for r in results.values():
        versions.update(r.get("versions", {}))
    return versions


if __name__ == "__main__":
    sys.exit(main())

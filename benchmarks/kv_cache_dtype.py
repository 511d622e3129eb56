"""fp16 vs fp32 KV caches on the SmolLM2 exports: what the logits, the greedy argmax and the step times do.

Why this benchmark: a quantized export serves fp16 caches by default (``--kv-cache``), and the claim
behind that default is that fp16 rounding of K and V changes nothing that matters next to the graph's
own rounding (int8 activations) and costs no time. Measured per export (fp32 and int4) and cache type,
over real text (a standard-library source file, teacher-forced: a 300-token prefill, then 50 one-token
decode steps): the largest logit change against the same graph's fp32 caches, and the share of
positions whose argmax equals the fp32 export's with fp32 caches. Step times: 1 x 1, 8 x 1 and 8 x 5
rows at context 300 in cache buffers of 320 and 2,048 positions per slot, in blocks of back-to-back
steps, the cache types and shapes interleaved, medians.

    python -m benchmarks.edge_cpu ...   # makes the exports under benchmarks/.cache/edge
    python -m benchmarks.kv_cache_dtype

Results: ``benchmarks/results/kv_cache_dtype.{md,json,png}``.
"""

from __future__ import annotations

import argparse
import inspect
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from specdec.bench.harness import run_command, utc_stamp
from specdec.bench.report import step_bars, write_report
from specdec.bench.steps import BLOCK, interleaved_step_ms
from specdec.models.export_meta import load_export_metadata
from specdec.runtime.backends.onnxruntime import OrtBackend
from specdec.runtime.packed import SeqWork, pack

HERE = Path(__file__).resolve().parent
DTYPES = ("float32", "float16")
SHAPES = ((1, 1), (8, 1), (8, 5))  # (sequences, rows each)
CONTEXT = 300
#: cache buffer lengths (positions per slot) the steps run over: just room for the context, and the export default.
#: Why both: ORT's fp16 attention costs more with a longer buffer at the same context
BUFFERS = (CONTEXT + 20, 2048)


def teacher_forced(graph: Path, cache_dtype: str, ids: list[int], threads: int) -> np.ndarray:
    """Logits of every position: a ``CONTEXT``-token prefill, then one decode step per remaining token."""
    backend = OrtBackend(graph, intra_op_threads=threads, cache_dtype=cache_dtype)
    cache = backend.allocate_cache(1, len(ids) + 8)
    rows = [backend.step(pack([SeqWork(0, 0, ids[:CONTEXT])]), cache)]
    rows += [backend.step(pack([SeqWork(0, i, [ids[i]])]), cache) for i in range(CONTEXT, len(ids))]
    return np.concatenate(rows)


def step_times(graph: Path, rounds: int, threads: int) -> dict[str, dict[str, float]]:
    """Median ms per shape, buffer length and cache type (keys ``"8x1@2048"``), all interleaved (rotated each round)."""
    backends = {d: OrtBackend(graph, intra_op_threads=threads, cache_dtype=d) for d in DTYPES}
    work: dict[tuple[str, str], tuple[OrtBackend, Any, Any]] = {}
    for dtype, backend in backends.items():
        tokens = [(7919 * i) % backend.vocab_size for i in range(8 * CONTEXT)]
        for buffer in BUFFERS:
            cache = backend.allocate_cache(8, buffer)
            backend.step(
                pack([SeqWork(s, 0, tokens[s * CONTEXT : (s + 1) * CONTEXT], logits="none") for s in range(8)]), cache
            )
            for seqs, rows in SHAPES:
                batch = pack([SeqWork(s, CONTEXT, tokens[:rows]) for s in range(seqs)])
                work[dtype, f"{seqs}x{rows}@{buffer}"] = (backend, batch, cache)
    medians = interleaved_step_ms(work, rounds, desc=f"{graph.parent.parent.name} steps")
    return {d: {shape: ms for (dd, shape), ms in medians.items() if dd == d} for d in DTYPES}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fp32", type=Path, default=HERE / ".cache/edge/fp32", help="an fp32 export")
    parser.add_argument("--int4", type=Path, default=HERE / ".cache/edge/int4", help="a --quantize int4 export")
    parser.add_argument("--tokens", type=int, default=350, help="teacher-forced positions (the first 300 prefilled)")
    parser.add_argument("--rounds", type=int, default=25)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out-dir", type=Path, default=HERE / "results")
    args = parser.parse_args(argv)
    if args.tokens <= CONTEXT:
        parser.error(f"--tokens must exceed the {CONTEXT}-token prefill")
    started = time.time()
    meta = load_export_metadata(args.fp32, "target")
    ids = meta.tokenizer(inspect.getsource(inspect))["input_ids"][: args.tokens]
    exports = {"fp32": args.fp32, "int4": args.int4}
    logits = {
        (name, d): teacher_forced(path / "target" / "model.onnx", d, ids, args.threads)
        for name, path in tqdm(exports.items(), desc="teacher forcing")
        for d in DTYPES
    }
    reference = logits["fp32", "float32"].argmax(1)
    quality = [
        {
            "export": name,
            "cache": d,
            "max_abs_logit_change_vs_fp32_cache": round(float(np.abs(got - logits[name, "float32"]).max()), 4),
            "argmax_agreement_with_fp32_export": round(float((got.argmax(1) == reference).mean()), 4),
        }
        for (name, d), got in logits.items()
    ]
    times = {
        name: step_times(path / "target" / "model.onnx", args.rounds, args.threads) for name, path in exports.items()
    }
    b = OrtBackend(args.int4 / "target" / "model.onnx")
    width = 2 * b.num_layers * int(b.num_kv_heads) * int(b.head_dim)  # K and V values per token, all layers
    per_token_kib = {d: width * np.dtype(d).itemsize / 1024 for d in DTYPES}
    doc = {
        "date": utc_stamp(),
        "command": run_command("benchmarks.kv_cache_dtype", argv),
        "threads": args.threads,
        "rounds": args.rounds,
        "positions": len(ids),
        "quality": quality,
        "step_ms": times,
        "kv_kib_per_token": per_token_kib,
        "seconds": round(time.time() - started, 1),
    }
    print(write_report(doc, args.out_dir, "kv_cache_dtype", markdown, draw))
    return 0


def markdown(doc: dict[str, Any]) -> str:
    """The report: agreement and logit changes per export and cache type, then the step times."""
    kib = doc["kv_kib_per_token"]
    lines = [
        "# KV-cache type: fp16 vs fp32 caches on the SmolLM2 exports",
        "",
        f"- Date: {doc['date']}; command: `{doc['command']}` ({doc['seconds']} s); {doc['threads']} threads",
        f"- Text: `inspect.py`'s source, {doc['positions']} tokens teacher-forced ({CONTEXT} prefilled, then one "
        "per step)",
        f"- K+V per token: {kib['float32']:.1f} KiB fp32, {kib['float16']:.1f} KiB fp16",
        "",
        "| export | caches | max logit change vs the same graph's fp32 caches | argmax = fp32 export's (fp32 caches) |",
        "|:---|:---|---:|---:|",
    ]
    lines += [
        f"| {q['export']} | {q['cache']} | {q['max_abs_logit_change_vs_fp32_cache']} | "
        f"{100 * q['argmax_agreement_with_fp32_export']:.1f}% |"
        for q in doc["quality"]
    ]
    columns = [f"{s}x{n}@{b}" for b in BUFFERS for s, n in SHAPES]
    lines += [
        "",
        f"Step times (ms; context {CONTEXT} in a cache buffer of {' or '.join(map(str, BUFFERS))} positions "
        f"per slot; median over {doc['rounds']} interleaved rounds of {BLOCK} back-to-back steps, the first "
        "untimed):",
        "",
        "| export | caches | "
        + " | ".join(c.replace("x", " x ").replace("@", " rows, buffer ") for c in columns)
        + " |",
        "|:---|:---|" + "---:|" * len(columns),
    ]
    lines += [
        f"| {name} | {d} | " + " | ".join(str(per[d][c]) for c in columns) + " |"
        for name, per in doc["step_ms"].items()
        for d in DTYPES
    ]
    return "\n".join(lines) + "\n"


def draw(doc: dict[str, Any], path: Path) -> None:
    """Step time per shape, one bar per export and cache type."""
    columns = [f"{s}x{n}@{b}" for b in BUFFERS for s, n in SHAPES]
    series = {
        f"{name}, {d} caches": [doc["step_ms"][name][d][c] for c in columns] for name in doc["step_ms"] for d in DTYPES
    }
    step_bars(
        path,
        [c.replace("@", "\nbuffer ") for c in columns],
        series,
        f"SmolLM2 step time by KV-cache type (context {CONTEXT})",
    )


if __name__ == "__main__":
    sys.exit(main())

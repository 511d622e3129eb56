"""How closely ONNX graphs follow the fp32 model: teacher-forced next-token agreement and held-out perplexity.

Why: a faster graph form (a lowering, a quantization option) may only ship where it gives up no
fidelity against the fp32 model (the dequantized GGUF the torch backend runs). This scores each graph
the way the edge benchmark scores an export (``benchmarks/edge_cpu/forced.py``), cheaply enough to
compare candidate forms before one is chosen:

* **chat**: 16 held-out chat prompts (``benchmarks.quantize_quality.CHAT_PROMPTS``) in the chat
  template, the fp32 model's greedy answer (64 tokens); each graph reads prompt + answer in one step
  and picks its next token at every answer position: the share equal to the fp32 model's pick;
* **documents**: the held-out documents (``specdec.bench.workloads.held_out_documents``, 256 tokens
  each): the share of positions whose argmax equals the fp32 model's, and the perplexity;
* at the positions where a graph picks another token, the fp32 model's own margin (its lead over
  the runner-up): small margins are near-ties that any rounding can flip.

Run::

    python -m benchmarks.graph_fidelity --graph int4=exports/int4/target/model.onnx \\
        --graph w8a8=exports/w8a8/target/model.onnx --stem graph_fidelity

Writes ``benchmarks/results/<stem>.{json,md}``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from benchmarks.quantize_quality import CHAT_PROMPTS, MAX_NEW, PPL_TOKENS
from specdec.bench.harness import machine_info, run_command
from specdec.bench.workloads import held_out_documents
from specdec.models.loading import load_model
from specdec.runtime.backends.onnxruntime import OrtBackend
from specdec.runtime.backends.torch_backend import TorchBackend
from specdec.runtime.packed import SeqWork, pack


def sequence_logits(backend: Any, ids: list[int]) -> np.ndarray:
    """Every position's logits of ``ids`` read in one step (float64)."""
    cache = backend.allocate_cache(1, len(ids) + 8)
    return np.asarray(backend.step(pack([SeqWork(0, 0, ids)]), cache), dtype=np.float64)


def chat_sequences(model: Any, reference: TorchBackend) -> list[tuple[list[int], int]]:
    """(prompt + the fp32 model's greedy answer, the prompt's length) of every chat prompt."""
    out = []
    for prompt in CHAT_PROMPTS:
        ids = model.tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True
        )
        ids = [int(i) for i in (ids["input_ids"] if isinstance(ids, Mapping) else ids)]
        start = len(ids)
        cache = reference.allocate_cache(1, start + MAX_NEW + 8)
        logits = reference.step(pack([SeqWork(0, 0, ids, logits="last")]), cache)
        for _ in range(MAX_NEW):
            token = int(np.argmax(logits[-1]))
            ids.append(token)
            if token in model.eos_token_ids:
                break
            logits = reference.step(pack([SeqWork(0, len(ids) - 1, [token])]), cache)
        out.append((ids, start))
    return out


def score(logits: np.ndarray, want: np.ndarray, margins: np.ndarray) -> dict[str, Any]:
    """Agreement of ``logits``' argmax with ``want`` and the reference ``margins`` where they differ."""
    picks = logits.argmax(axis=1)
    missed = margins[picks != want]
    return {
        "positions": int(want.size),
        "agree": int((picks == want).sum()),
        "rate": float((picks == want).mean()),
        "miss_margin_median": float(np.median(missed)) if missed.size else None,
        "miss_margin_max": float(missed.max()) if missed.size else None,
    }


def nll(logits: np.ndarray, ids: list[int]) -> float:
    """The negative log-likelihood of ``ids[1:]`` under ``logits`` (one row per position before it)."""
    z = logits - logits.max(axis=1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
    return -float(logp[np.arange(len(ids) - 1), ids[1:]].sum())


def margins_of(logits: np.ndarray) -> np.ndarray:
    top = np.sort(logits, axis=1)[:, -2:]
    return top[:, 1] - top[:, 0]


def evaluate(graphs: dict[str, Path], cache_dtype: str | None, threads: int) -> dict[str, Any]:
    """Every graph's chat and document scores against the fp32 torch model."""
    torch.set_num_threads(threads)
    model = load_model("smollm2-135m")
    reference = TorchBackend(model)
    chats = chat_sequences(model, reference)
    documents = held_out_documents(model.tokenizer, PPL_TOKENS)
    ref_chat = [sequence_logits(reference, ids)[start - 1 : -1] for ids, start in chats]
    ref_docs = [sequence_logits(reference, ids)[:-1] for ids in documents]
    want_chat = np.concatenate([ids[start:] for ids, start in chats])
    want_docs = np.concatenate([r.argmax(axis=1) for r in ref_docs])
    chat_margins, doc_margins = margins_of(np.concatenate(ref_chat)), margins_of(np.concatenate(ref_docs))
    results: dict[str, Any] = {}
    for name in tqdm(["fp32 (torch)", *graphs], desc="graphs"):
        backend = (
            reference
            if name not in graphs
            else OrtBackend(graphs[name], intra_op_threads=threads, cache_dtype=cache_dtype)
        )
        chat = np.concatenate([sequence_logits(backend, ids)[start - 1 : -1] for ids, start in chats])
        docs = [sequence_logits(backend, ids)[:-1] for ids in documents]
        total = sum(nll(d, ids) for d, ids in zip(docs, documents, strict=True))
        results[name] = {
            "chat": score(chat, want_chat, chat_margins),
            "documents": score(np.concatenate(docs), want_docs, doc_margins),
            "perplexity": math.exp(total / sum(len(ids) - 1 for ids in documents)),
        }
    return results


def markdown(doc: dict[str, Any]) -> str:
    lines = [
        "# Teacher-forced agreement with the fp32 model",
        "",
        f"SmolLM2-135M-Instruct; each graph on ONNX Runtime {doc['onnxruntime']} (caches {doc['cache_dtype']}), "
        "scored against the fp32 torch model (the dequantized GGUF): *chat*, along its greedy answers to 16 "
        "held-out chat prompts; *documents*, its argmax on the held-out documents. Miss margins: the fp32 "
        f"model's lead over its runner-up where a graph picks another token. Command: `{doc['command']}`; "
        f"{doc['date']}.",
        "",
        "| graph | chat agreement | documents agreement | perplexity | chat miss margin median / max | documents miss "
        "margin median / max |",
        "|---|---:|---:|---:|---:|---:|",
    ]

    def margin(s: dict[str, Any]) -> str:
        if s["miss_margin_median"] is None:
            return "–"
        return f"{s['miss_margin_median']:.2f} / {s['miss_margin_max']:.2f}"

    for name, r in doc["graphs"].items():
        c, d = r["chat"], r["documents"]
        lines.append(
            f"| {name} | {100 * c['rate']:.1f}% ({c['agree']}/{c['positions']}) | {100 * d['rate']:.1f}% "
            f"({d['agree']}/{d['positions']}) | {r['perplexity']:.3f} | {margin(c)} | {margin(d)} |"
        )
    for name, path in doc["paths"].items():
        lines.append(f"\n`{name}`: `{path}`")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--graph", action="append", required=True, help="NAME=PATH of a target graph (repeatable)")
    parser.add_argument("--cache-dtype", default="float16", help="the caches' type (float16: the quantized exports')")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--stem", default="graph_fidelity")
    parser.add_argument("--out-dir", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args(argv)
    graphs = {}
    for item in args.graph:
        name, sep, path = item.partition("=")
        if not sep or not Path(path).is_file():
            parser.error(f"--graph {item!r}: expected NAME=PATH of an existing graph")
        graphs[name] = Path(path)
    import onnxruntime as ort

    doc = {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "command": run_command("benchmarks.graph_fidelity", argv),
        "machine": machine_info(),
        "onnxruntime": ort.__version__,
        "cache_dtype": args.cache_dtype,
        "paths": {k: str(v) for k, v in graphs.items()},
        "graphs": evaluate(graphs, args.cache_dtype, args.threads),
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / f"{args.stem}.json").write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    text = markdown(doc)
    (args.out_dir / f"{args.stem}.md").write_text(text, encoding="utf-8")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

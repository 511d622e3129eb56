"""One ragged step over the whole cache against the same work split over views of the slots it writes.

What: for one export's target graph on ONNX Runtime (default: the edge benchmark's w8a8 export), each case's work
(prefills of several lengths, alone or beside decoding slots) runs two ways, interleaved over rounds:

* *one step*: every sequence in one ragged step over the cache's ``slots`` slots (``ort_fuse.OWN_SLOT_ROWS`` lifted,
  so the backend does not split it itself);
* *split*: each chunk in a step of its own over the view of its own slot (``HostKVStorage.slots``, the same
  memory), the decoding sequences together in one step over the whole cache: what ``OrtBackend`` does with chunks of
  at least ``OWN_SLOT_ROWS`` rows (``ort_fuse.own_slot_chunks``), here for every chunk, to show where it loses.

Both must give the same logits bit for bit and the same cached rows (checked per case); the report is the median
wall time of each and their ratio.

Why: ONNX Runtime's GroupQueryAttention pads every slot of a step to the step's widest chunk and attends over each
slot's past, so a long chunk makes every other slot of the cache compute that many query rows too (a 256-token
prefill beside 7 idle slots took 164 ms against 118 ms alone, w8a8, this stop's scratch run). Splitting pays one
step's fixed cost per chunk instead. Which wins depends on the chunks' lengths, so this measures it before a policy
chooses.

Run::

    python -m benchmarks.slot_views                 # writes benchmarks/results/slot_views.{json,md,png}
"""

from __future__ import annotations

import argparse
import datetime as dt
import statistics
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from benchmarks.step_profile import served_cache_dtype, variant
from specdec.bench.figures import figure
from specdec.bench.harness import machine_info, run_command
from specdec.bench.report import write_report
from specdec.runtime.backends import ort_fuse
from specdec.runtime.packed import SeqWork, pack

#: (name, prompt lengths to prefill, decoding slots beside them (context 300 each), cache slots)
CASES = (
    ("8 prefills of 160-359 tokens (the edge extractive batch)", (160, 200, 240, 280, 320, 359, 180, 300), 0, 8),
    ("8 prefills of 256 tokens", (256,) * 8, 0, 8),
    ("8 prefills of 64 tokens", (64,) * 8, 0, 8),
    ("4 prefills of 60-359 tokens", (60, 120, 250, 359), 0, 4),
    ("2 prefills (200, 300) in a cache of 8 slots", (200, 300), 0, 8),
    ("one 256-token prefill in a cache of 8 slots", (256,), 0, 8),
    ("a 256-token chunk beside 7 decoding slots", (256,), 7, 8),
    ("a 128-token chunk beside 7 decoding slots", (128,), 7, 8),
)
CONTEXT = 300


@contextmanager
def whole_steps() -> Iterator[None]:
    """The backend runs every step whole, as before ``own_slot_chunks``."""
    saved, ort_fuse.OWN_SLOT_ROWS = ort_fuse.OWN_SLOT_ROWS, sys.maxsize
    try:
        yield
    finally:
        ort_fuse.OWN_SLOT_ROWS = saved


def run_case(backend: Any, prompts: tuple[int, ...], decoders: int, slots: int, rounds: int) -> dict[str, Any]:
    """Median ms of the case's work as one step and split, and whether both left the same bits."""
    rng = np.random.default_rng(0)
    ids = [rng.integers(0, backend.vocab_size, n).tolist() for n in prompts]
    first = slots - decoders  # the decoding sequences sit in the last slots

    def fresh() -> Any:
        cache = backend.allocate_cache(slots, 1024)
        for s in range(first, slots):
            backend.step(pack([SeqWork(s, 0, list(range(1, CONTEXT + 1)), logits="last")]), cache)
        return cache

    decoding = [SeqWork(s, CONTEXT, [5]) for s in range(first, slots)]
    chunks = [SeqWork(s, 0, tokens, logits="last") for s, tokens in enumerate(ids)]

    def one(cache: Any) -> np.ndarray:
        with whole_steps():
            return backend.step(pack(chunks + decoding), cache)

    def split(cache: Any) -> np.ndarray:
        out = [backend.step(pack([replace(w, slot_id=0)]), cache.slots(w.slot_id, 1)) for w in chunks]
        if decoding:
            out.append(backend.step(pack(decoding), cache))
        return np.concatenate(out)

    caches = {"one": fresh(), "split": fresh()}
    same_logits = bool(np.array_equal(one(caches["one"]), split(caches["split"])))
    written = [(s, len(tokens)) for s, tokens in enumerate(ids)] + [(s, CONTEXT + 1) for s in range(first, slots)]
    same_cache = all(
        np.array_equal(a[s, :, :n], b[s, :, :n])
        for a, b in zip(caches["one"].k + caches["one"].v, caches["split"].k + caches["split"].v, strict=True)
        for s, n in written
    )
    ms: dict[str, list[float]] = {"one": [], "split": []}
    for r in range(rounds):
        for name in ("one", "split") if r % 2 == 0 else ("split", "one"):
            cache = caches[name]  # each run rewrites the same positions: the shapes repeat
            start = time.perf_counter()
            (one if name == "one" else split)(cache)
            ms[name].append((time.perf_counter() - start) * 1e3)
    median = {k: statistics.median(v) for k, v in ms.items()}
    return {
        "ms": ms,
        "median_ms": median,
        "speedup": median["one"] / median["split"],
        "bits_equal": same_logits and same_cache,
    }


def markdown(doc: dict[str, Any]) -> str:
    lines = [
        "# One step over the whole cache, or each long chunk over its own slot's view",
        "",
        f"Target graph `{doc['graph']}` on ONNX Runtime {doc['onnxruntime']} ({doc['threads']} threads, caches "
        f"{doc['cache_dtype']}), lowered as `OrtBackend` serves it. Median of {doc['rounds']} interleaved rounds. "
        f"Command: `{doc['command']}`; {doc['date']}; {doc['machine'].get('processor')}, load average at start "
        f"{doc['machine'].get('load_average')}.",
        "",
        "*split*: each prefill chunk a step of its own over the view of its own slot (`HostKVStorage.slots`), the "
        f"decoding slots (context {CONTEXT}) one step together over the whole cache (`benchmarks/slot_views.py`).",
        "",
        "| case | one step, ms | split, ms | one / split | same bits |",
        "|---|---:|---:|---:|:---|",
    ]
    for name, row in doc["cases"].items():
        m, same = row["median_ms"], "yes" if row["bits_equal"] else "NO"
        lines.append(f"| {name} | {m['one']:.0f} | {m['split']:.0f} | {row['speedup']:.2f}x | {same} |")
    return "\n".join(lines) + "\n"


def plot(doc: dict[str, Any], path: Path) -> None:
    names = list(doc["cases"])
    with figure(path, figsize=(9, 4.5)) as (_, ax):
        ax.barh(range(len(names)), [doc["cases"][n]["speedup"] for n in names], color="tab:blue")
        ax.axvline(1.0, color="black", linewidth=0.8)
        ax.set_yticks(range(len(names)), names, fontsize=8)
        ax.invert_yaxis()
        ax.set_xlabel("one step's time / split's time (>1: split is faster)")
        ax.set_title("Long chunks over their own slot's view")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--export", type=Path, default=Path("benchmarks/.cache/edge/w8a8"))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--stem", default="slot_views")
    parser.add_argument("--out-dir", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args(argv)
    graph = args.export / "target" / "model.onnx"
    if not graph.is_file():
        parser.error(f"{graph} is missing: make the edge exports first (python -m benchmarks.edge_cpu)")
    import onnxruntime as ort

    cache_dtype = served_cache_dtype(graph) or "float32"
    backend = variant(graph, cache_dtype).open(intra_op_threads=args.threads)
    doc: dict[str, Any] = {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "command": run_command("benchmarks.slot_views", argv),
        "machine": machine_info(),
        "onnxruntime": ort.__version__,
        "graph": str(graph),
        "cache_dtype": cache_dtype,
        "threads": args.threads,
        "rounds": args.rounds,
        "cases": {},
    }
    for name, prompts, decoders, slots in tqdm(CASES, desc="cases", unit="case"):
        doc["cases"][name] = run_case(backend, prompts, decoders, slots, args.rounds)
    print(write_report(doc, args.out_dir, args.stem, markdown, plot))
    return 0 if all(row["bits_equal"] for row in doc["cases"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())

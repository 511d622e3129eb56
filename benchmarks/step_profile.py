"""Where one ONNX Runtime target step spends its time, per operator, before and after ``ort_fuse``.

What: SmolLM2-135M-Instruct exported with ``specdec-export`` (fp32 by default), run by ``OrtBackend``
with 2 intra-op threads over a cache of max(16, B) slots x 1024 positions, context about 200, on the
steps of each batch size B of ``--batches`` (default 1 and 8) and kind of ``--kinds``:

* ``B=b decode``: b sequences, one row each (past 190, 193, ...);
* ``B=b verify bx5``: b sequences, a chain of 5 rows each, logits for all rows;
* ``B=b prefill``: b prompts of 160-359 tokens (edge_cpu's extractive range) into fresh slots, logits
  for each last row (``--prefill`` adds this kind to the default ones).

Beside each step's time, its *floor* (``benchmarks/step_floor.py``): the bytes it must move and the
operations it must do, priced at this CPU's measured bandwidth and throughput
(``benchmarks/results/machine_floor.json``, ``python -m benchmarks.machine_floor``), and the nodes it
runs times ORT's measured cost per node.

Why: to see which operators dominate a step, and whether a lowering removed them without
changing the logits.

Two graph variants in the same process: *before* is the exported graph as ORT inlines it
(``OrtBackend(fuse=False)``: the RaggedTreeAttention function body, the exporter's RMSNorm and
RoPE ops), *after* the load-time lowering (``fuse=True``: GroupQueryAttention, fused RMSNorm /
skip-RMSNorm, RotaryEmbedding; ``specdec/runtime/backends/ort_fuse.py``).

How: (1) wall time per ``OrtBackend.step`` with the profiler off, the variants interleaved and
alternated for ``--rounds`` rounds of ``--steps`` steps per shape, median kept (the machine is
shared, so any single run is noisy); (2) a second pair of sessions with ORT's profiler
(``SessionOptions.enable_profiling``) run the same steps, interleaved too, and every node's
kernel time is summed per op type and per node and divided by the steps. The profiler's
per-node timestamps add overhead of their own, so the ``model_run`` totals are above the wall
times of (1); shares are read from (2), speed from (1). Before timing, each variant's logits
are compared with the torch reference on the same three steps after the same prefill.

Two exports can be compared the same way instead, each lowered as ``OrtBackend`` serves it
(``--before GRAPH --after GRAPH``): e.g. the int4 graph as it shipped with fp32 activations
(``specdec-export --quantize int4 --quantize-activations fp32``) against the int8-activation,
batch-invariant one (``--quantize int4``), written to ``--stem`` (``step_profile_int4``). A graph may
name the ``ort_fuse`` rewrites it runs with (``GRAPH@attention,rmsnorm``; ``GRAPH@none``: unfused), so
two lowerings of one export compare the same way, or be a lowering another specdec version saved
(``lowered:DIR``, ``benchmarks/prelowered.py``). ``--after`` alone profiles one graph. The caches are of
the type the export serves (its manifest's ``kv_cache_dtype``) unless ``--cache-dtype`` says otherwise.

Run::

    python -m benchmarks.step_profile            # ~6 minutes on a 2-core CPU (+1 min export once)
    python -m benchmarks.step_profile --graph deploy/target/model.onnx --rounds 3
    python -m benchmarks.step_profile --before int4-fp32act/target/model.onnx --after int4/target/model.onnx \
        --stem step_profile_int4
    python -m benchmarks.step_profile --before benchmarks/.cache/edge/int4/target/model.onnx \
        --after benchmarks/.cache/edge/int8/target/model.onnx --stem step_profile_edge --prefill --rounds 3 --steps 3
    python -m benchmarks.step_profile --after int4/target/model.onnx --batches 1,4,8,16 --prefill \
        --stem step_profile_int4_floor

Writes ``<out-dir>/<stem>.{json,md,png}`` (default ``benchmarks/results/step_profile``).
"""

from __future__ import annotations

import argparse
import bisect
import datetime as dt
import json
import statistics
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import torch

from benchmarks import machine_floor
from benchmarks.prelowered import REPORT, pre_lowered
from benchmarks.step_floor import describe, floor_ms, graph_cost
from specdec.bench.figures import figure
from specdec.bench.harness import int_list, machine_info, run_command
from specdec.bench.report import write_report
from specdec.export.onnx import export_onnx
from specdec.models.loading import load_model
from specdec.runtime.backends.base import KVStorage
from specdec.runtime.backends.onnxruntime import OrtBackend
from specdec.runtime.backends.torch_backend import TorchBackend
from specdec.runtime.packed import PackedBatch, SeqWork, pack

DEFAULT_GRAPH = Path(__file__).parent / ".cache" / "step-profile" / "model.onnx"
MACHINE = Path(__file__).parent / "results" / "machine_floor.json"
#: what the report says the variants are, by mode
DESCRIPTIONS = {
    "fuse": (
        "SmolLM2-135M-Instruct, fp32. *before*: the exported graph as ORT inlines it (`OrtBackend(fuse=False)`); "
        "*after*: `ort_fuse`'s lowering (GroupQueryAttention, SimplifiedLayerNormalization / "
        "SkipSimplifiedLayerNormalization, RotaryEmbedding)"
    ),
    "graphs": (
        "SmolLM2-135M-Instruct, two exports or lowerings, each lowered by `ort_fuse` as `OrtBackend` serves it "
        "(`@` names the rewrites run). *before*: `{before}`; *after*: `{after}`"
    ),
    "one": "SmolLM2-135M-Instruct, one export lowered by `ort_fuse` as `OrtBackend` serves it: `{after}`",
}


@dataclass(frozen=True)
class Variant:
    """A graph as one column of the profile runs it: ``OrtBackend(graph, fuse=fuse, cache_dtype=cache_dtype)``, or a
    lowering saved by another specdec version (``lowered``: ``benchmarks.prelowered``; ``graph`` is its source)."""

    graph: Path
    fuse: bool | list[str] = True
    cache_dtype: str | None = None
    lowered: Path | None = None

    def open(self, **options: Any) -> OrtBackend:
        if self.lowered is not None:
            return pre_lowered(self.lowered, **options)
        return OrtBackend(self.graph, fuse=self.fuse, cache_dtype=self.cache_dtype, **options)


MAX_LEN, CONTEXT, MIN_SLOTS = 1024, 200, 16
KINDS = ("decode", "verify", "prefill")
PREFILL = [160, 200, 240, 280, 300, 320, 340, 359]  # prompt lengths of a prefill (cycled): edge_cpu's extractive range
CHAIN = 5  # rows of a verification chain (the last token + 4 drafts)


def past(seq: int) -> int:
    """The committed length of slot ``seq`` in the decode and verify steps (190, 193, ...)."""
    return CONTEXT - 10 + 3 * seq


def slots_for(batches: list[int]) -> int:
    return max(MIN_SLOTS, *batches)


def shapes(batches: list[int], kinds: list[str]) -> dict[str, tuple[PackedBatch, str]]:
    """The steps profiled, by name, with their kind (token ids are arbitrary: the cost does not depend on them).

    A prefill writes fresh prompts into slots 0..b-1 from position 0 (the decode steps' committed rows are
    overwritten, which changes no cost; every variant and the reference run the same steps in the same order).
    """
    rng = np.random.default_rng(1)
    steps: dict[str, tuple[PackedBatch, str]] = {}
    for b in batches:
        for kind in kinds:
            if kind == "decode":
                steps[f"B={b} decode"] = (pack([SeqWork(s, past(s), [100 + s]) for s in range(b)]), kind)
            elif kind == "verify":
                work = [SeqWork(s, past(s), [100 + s + j for j in range(CHAIN)]) for s in range(b)]
                steps[f"B={b} verify {b}x{CHAIN}"] = (pack(work), kind)
            else:
                lengths = [PREFILL[s % len(PREFILL)] for s in range(b)]
                work = [SeqWork(s, 0, rng.integers(0, 49152, n).tolist(), logits="last") for s, n in enumerate(lengths)]
                steps[f"B={b} prefill {min(lengths)}-{max(lengths)}"] = (pack(work), kind)
    return steps


def prefilled_cache(backend: OrtBackend | TorchBackend, slots: int) -> KVStorage:
    """A cache whose slots hold the K/V of ``past(s)`` prompt tokens (the same tokens for every backend)."""
    cache = backend.allocate_cache(slots, MAX_LEN)
    g = np.random.default_rng(0)
    for s in range(slots):
        backend.step(pack([SeqWork(s, 0, g.integers(0, 49152, past(s)).tolist(), logits="last")]), cache)
    return cache


def check_exact(backends: dict[str, OrtBackend], steps: dict[str, PackedBatch], slots: int) -> dict[str, float]:
    """max |logit - torch reference| of each variant on the profiled steps, after the same prefill."""
    ref = TorchBackend(load_model("smollm2-135m"))
    ref_cache = prefilled_cache(ref, slots)
    want = {name: ref.step(batch, ref_cache) for name, batch in steps.items()}
    errors: dict[str, float] = {}
    for variant, backend in backends.items():
        cache = prefilled_cache(backend, slots)
        errors[variant] = max(
            float(np.abs(want[name] - backend.step(batch, cache)).max()) for name, batch in steps.items()
        )
    return errors


def steps_of(kind: str, n: int) -> int:
    """Timed steps per round of a step kind: a prefill takes seconds, so one."""
    return 1 if kind == "prefill" else n


def time_steps(
    backends: dict[str, OrtBackend],
    steps: dict[str, tuple[PackedBatch, str]],
    caches: dict[str, KVStorage],
    rounds: int,
    n: int,
) -> dict[str, dict[str, list[float]]]:
    """ms per step for every (shape, variant), ``rounds`` interleaved samples each (order alternates)."""
    samples: dict[str, dict[str, list[float]]] = {s: {v: [] for v in backends} for s in steps}
    names = list(backends)
    for r in range(rounds):
        for shape, (batch, kind) in steps.items():
            for variant in names if r % 2 == 0 else names[::-1]:
                backend, cache = backends[variant], caches[variant]
                backend.step(batch, cache)  # warm this shape
                count = steps_of(kind, n)
                start = time.perf_counter()
                for _ in range(count):
                    backend.step(batch, cache)
                samples[shape][variant].append((time.perf_counter() - start) / count * 1e3)
        print(
            f"  round {r + 1}/{rounds}: "
            + ", ".join(f"{s} {'/'.join(f'{samples[s][v][-1]:.1f}' for v in names)}" for s in steps),
            flush=True,
        )
    return samples


#: nodes whose profiled time includes the nodes of their subgraphs (the fused attention's layout ``If``)
CONTROL_FLOW = frozenset({"If", "Loop", "Scan"})


def own_durations(kernels: list[dict[str, Any]]) -> list[float]:
    """Each kernel event's own duration: a control-flow node's minus the nodes that ran inside its window.

    Why: ORT's profiler times an ``If`` from entering to leaving its branch, and times the branch's nodes
    too, so summing both counts the branch twice (the lowering's per-layer ``If`` holds the attention: the
    B=8 prefill's GroupQueryAttention time appeared again as the ``If``'s). Steps run their nodes one after
    another (ORT's sequential execution), so the events inside an ``If``'s window are its branch's.
    """
    order = sorted(range(len(kernels)), key=lambda i: kernels[i]["ts"])
    starts = [kernels[i]["ts"] for i in order]
    own = [float(e["dur"]) for e in kernels]
    for i, e in enumerate(kernels):
        if e["args"].get("op_name") not in CONTROL_FLOW:
            continue
        end = e["ts"] + e["dur"]
        inner = (order[j] for j in range(bisect.bisect_left(starts, e["ts"]), bisect.bisect_right(starts, end)))
        own[i] -= sum(
            kernels[j]["dur"]
            for j in inner
            if j != i
            and kernels[j]["ts"] + kernels[j]["dur"] <= end
            and kernels[j]["args"].get("op_name") not in CONTROL_FLOW
        )
    return own


def profile_steps(
    variants: dict[str, Variant],
    steps: dict[str, tuple[PackedBatch, str]],
    n: int,
    threads: int,
    slots: int,
    prefix: Path,
) -> dict[str, dict[str, Any]]:
    """Per-op and per-node kernel ms per step of each (shape, variant), from ORT's profiler."""
    backends = {v: var.open(intra_op_threads=threads, profile_prefix=str(prefix / v)) for v, var in variants.items()}
    caches = {v: prefilled_cache(b, slots) for v, b in backends.items()}
    windows: dict[str, list[tuple[str, int, int]]] = {v: [] for v in backends}  # (shape, first timed run, runs)
    runs = dict.fromkeys(backends, 0)
    for shape, (batch, kind) in steps.items():
        count, warm = steps_of(kind, n), 1 if kind == "prefill" else 3
        for variant, backend in backends.items():
            for _ in range(warm):  # warm-up runs, not counted
                backend.step(batch, caches[variant])
            windows[variant].append((shape, runs[variant] + warm, count))
            for _ in range(count):
                backend.step(batch, caches[variant])
            runs[variant] += warm + count
    out: dict[str, dict[str, Any]] = {s: {} for s in steps}
    for variant, backend in backends.items():
        events = json.loads(Path(backend.session.end_profiling()).read_text())
        model_runs = [e for e in events if e.get("name") == "model_run"][slots:]  # after the prefills
        kernels = [e for e in events if e.get("cat") == "Node" and e.get("name", "").endswith("_kernel_time")]
        own = own_durations(kernels)
        for shape, first, count in windows[variant]:
            chosen = model_runs[first : first + count]
            lo, hi = chosen[0]["ts"], chosen[-1]["ts"] + chosen[-1]["dur"]
            by_op: Counter[str] = Counter()
            by_node: Counter[str] = Counter()
            nodes = set()
            for e, dur in zip(kernels, own, strict=True):
                if lo <= e["ts"] <= hi:
                    op = e["args"].get("op_name", "?")
                    by_op[op] += dur
                    by_node[f"{e['name'][: -len('_kernel_time')]} ({op})"] += dur
                    nodes.add(e["name"])
            out[shape][variant] = {
                "model_run_ms": statistics.mean(r["dur"] for r in chosen) / 1e3,
                "kernel_ms": sum(by_op.values()) / count / 1e3,
                "nodes_run": len(nodes),
                "by_op_ms": {op: d / count / 1e3 for op, d in by_op.most_common()},
                "top_nodes_ms": {k: d / count / 1e3 for k, d in by_node.most_common(8)},
            }
    return out


def floors(
    variants: dict[str, Variant], steps: dict[str, tuple[PackedBatch, str]], cache_bytes: dict[str, int], rates: dict
) -> tuple[dict[str, dict[str, dict[str, float]]], dict[str, str]]:
    """Each (shape, variant)'s floor (``step_floor``) and each variant's linears in one line."""
    costs = {v: graph_cost(var.graph) for v, var in variants.items()}
    out = {
        shape: {
            v: {**c.step(batch, cache_bytes[v]), **floor_ms(c.step(batch, cache_bytes[v]), rates)}
            for v, c in costs.items()
        }
        for shape, (batch, _) in steps.items()
    }
    return out, {v: describe(c.linears) for v, c in costs.items()}


def machine_rates(path: Path, threads: int) -> tuple[dict[str, float], dict[str, Any]]:
    """The floor's rates: from ``path`` (``benchmarks.machine_floor``'s JSON), measured now when it is absent."""
    doc = json.loads(path.read_text()) if path.is_file() else machine_floor.measure(threads, 5)
    return machine_floor.floor_constants(doc), doc


def _ms(x: float) -> str:
    return f"{x:.1f}" if x >= 1 else f"{x:.2f}"


def summary_table(doc: dict[str, Any]) -> list[str]:
    """One row per step: each variant's wall ms, nodes run and floor; with two, the speed-up."""
    names = doc["variants"]
    per_node = doc["rates"]["per_node_s"] * 1e3
    head = "| step |" + "".join(f" {v} ms (wall) | {v} nodes run |" for v in names)
    head += " floor ms (memory / compute) | nodes x per-node ms |" + (" speed-up |" if len(names) == 2 else "")
    lines = [head, "|---|" + "---:|" * (2 * len(names) + 2 + (len(names) == 2))]
    for shape, row in doc["shapes"].items():
        last = names[-1]
        fl = row["floor"][last]
        cells = "".join(f" {_ms(row['wall_ms'][v])} | {row['profile'][v]['nodes_run']} |" for v in names)
        cells += (
            f" {_ms(fl['floor_ms'])} ({_ms(fl['memory_ms'])} / {_ms(fl['compute_ms'])}) |"
            f" {_ms(row['profile'][last]['nodes_run'] * per_node)} |"
        )
        if len(names) == 2:
            cells += f" {row['wall_ms'][names[0]] / row['wall_ms'][names[1]]:.2f}x |"
        lines.append(f"| {shape} |{cells}")
    return lines


def op_table(doc: dict[str, Any], shape: str, row: dict[str, Any]) -> list[str]:
    """The step's kernel time per op type, each variant's ms and share."""
    names = doc["variants"]
    profs = [row["profile"][v] for v in names]
    ops = list(dict.fromkeys(op for p in profs for op in p["by_op_ms"]))
    ops.sort(key=lambda op: -max(p["by_op_ms"].get(op, 0.0) for p in profs))
    lines = [
        "",
        f"## {shape}",
        "",
        "| op type |" + "".join(f" {v} ms/step | {v} share |" for v in names),
        "|---|" + "---:|---:|" * len(names),
    ]
    for op in ops[:18]:
        cells = []
        for p in profs:
            ms = p["by_op_ms"].get(op)
            cells.append(" – | – |" if ms is None else f" {ms:.2f} | {100 * ms / p['kernel_ms']:.1f}% |")
        lines.append(f"| {op} |" + "".join(cells))
    rest = ops[18:]
    if rest:
        cells = "".join(
            f" {sum(p['by_op_ms'].get(op, 0.0) for op in rest):.2f} | "
            f"{100 * sum(p['by_op_ms'].get(op, 0.0) for op in rest) / p['kernel_ms']:.1f}% |"
            for p in profs
        )
        lines.append(f"| {len(rest)} other op types |{cells}")
    lines.append("| **kernels, total** |" + "".join(f" **{p['kernel_ms']:.2f}** | 100% |" for p in profs))
    lines.append("| profiled `model_run` |" + "".join(f" {p['model_run_ms']:.2f} | |" for p in profs))
    lines.append("| wall, profiler off (median) |" + "".join(f" {row['wall_ms'][v]:.2f} | |" for v in names))
    fl = row["floor"][names[-1]]
    lines += [
        "",
        f"Floor ({names[-1]}): {fl['bytes'] / 1e6:.1f} MB moved ({fl['weight_bytes'] / 1e6:.1f} weights, "
        f"{fl['kv_bytes'] / 1e6:.1f} KV), {fl['int8_ops'] / 1e9:.2f} G int8 ops, {fl['fp32_ops'] / 1e9:.2f} G fp32 "
        f"ops: {_ms(fl['floor_ms'])} ms. Slowest nodes ({names[-1]}): "
        + ", ".join(f"`{k}` {v:.2f} ms" for k, v in list(profs[-1]["top_nodes_ms"].items())[:5])
        + ".",
    ]
    return lines


def markdown(doc: dict[str, Any]) -> str:
    rates = doc["rates"]
    lines = [
        f"# One ONNX Runtime target step per operator: {doc['title']}",
        "",
        f"{doc['description']}. ORT {doc['onnxruntime']}, {doc['threads']} intra-op threads, cache "
        f"{doc['cache']['slots']} slots x {MAX_LEN}, context ~{CONTEXT}. "
        f"Command: `{doc['command']}`. Machine: {doc['machine'].get('processor')}, "
        f"load average at start {doc['machine'].get('load_average')} (shared machine: other users' jobs ran "
        "during the measurement, so read medians, not single numbers).",
        "",
        "Wall time: median over interleaved rounds of `OrtBackend.step` with the profiler off. Kernel "
        "time: the profiler's sum over nodes, an `If` counted without the nodes of its branch, which are "
        "counted themselves (its own overhead makes `model_run` longer than the wall time).",
        "",
        f"Floor (`benchmarks/step_floor.py`): the step's bytes at {rates['bytes_per_s'] / 1e9:.1f} GB/s, its int8 "
        f"operations at {rates['int8_ops_per_s'] / 1e9:.0f} GOP/s and fp32 ones at "
        f"{rates['fp32_flops_per_s'] / 1e9:.0f} GFLOP/s, the larger of the two; nodes at "
        f"{rates['per_node_s'] * 1e6:.2f} µs each (`benchmarks/results/machine_floor.md`, "
        f"{doc['machine_floor_date']}). Linears: " + "; ".join(f"{v}: {d}" for v, d in doc["linears"].items()) + ".",
        "",
        "Logit error vs the torch reference on these steps: "
        + ", ".join(f"{v} {e:.2e}" for v, e in doc["max_abs_logit_error"].items())
        + ".",
        "",
        *summary_table(doc),
    ]
    for shape, row in doc["shapes"].items():
        lines += op_table(doc, shape, row)
    return "\n".join(lines) + "\n"


def variant(spec: Path, cache_dtype: str) -> Variant:
    """``GRAPH`` (every rewrite), ``GRAPH@a,b`` (these ``ort_fuse`` rewrites), ``GRAPH@none`` (unfused) or
    ``lowered:DIR`` (a saved lowering, ``benchmarks.prelowered``). ``cache_dtype`` "manifest": the served caches'
    type, from the export's manifest beside the graph's folder."""
    text = str(spec)
    if text.startswith("lowered:"):
        directory = Path(text.removeprefix("lowered:"))
        source = json.loads((directory / REPORT).read_text())["source"]
        return Variant(Path(source), lowered=directory)
    path, _, rewrites = text.rpartition("@") if "@" in text else (text, "", "")
    fuse: bool | list[str] = True if not rewrites else [] if rewrites == "none" else rewrites.split(",")
    return Variant(Path(path), fuse, served_cache_dtype(Path(path)) if cache_dtype == "manifest" else cache_dtype)


def served_cache_dtype(graph: Path) -> str | None:
    """The ``kv_cache_dtype`` of the export a graph belongs to (``<export>/<model>/model.onnx``), None if unknown."""
    manifest = graph.parent.parent / "manifest.json"
    if not manifest.is_file():
        return None
    return json.loads(manifest.read_text()).get("kv_cache_dtype")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--graph",
        type=Path,
        default=None,
        help=f"an exported target graph, unfused against fused (default: export smollm2-135m to {DEFAULT_GRAPH})",
    )
    parser.add_argument("--before", type=Path, help="compare two graphs instead: the first, GRAPH[@rewrites]")
    parser.add_argument("--after", type=Path, help="the second graph of --before, or alone: the one graph profiled")
    parser.add_argument("--stem", default="step_profile", help="file names of the results")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds (median kept)")
    parser.add_argument("--steps", type=int, default=8, help="steps per shape per round and in the profile")
    parser.add_argument("--batches", type=int_list, default=(1, 8), help="batch sizes, e.g. 1,4,8,16")
    parser.add_argument("--kinds", default="decode,verify", help=f"step kinds among {','.join(KINDS)}")
    parser.add_argument("--prefill", action="store_true", help="add the prefill kind (seconds a step on 2 cores)")
    parser.add_argument("--machine", type=Path, default=MACHINE, help="benchmarks.machine_floor's JSON (the rates)")
    parser.add_argument(
        "--cache-dtype",
        default="manifest",
        help="the caches' type: float32, float16, or manifest (the export's served kv_cache_dtype, the default)",
    )
    parser.add_argument("--out-dir", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args(argv)
    kinds = [k for k in args.kinds.split(",") if k] + (["prefill"] if args.prefill else [])
    if set(kinds) - set(KINDS):
        parser.error(f"--kinds: unknown {sorted(set(kinds) - set(KINDS))}; choose among {', '.join(KINDS)}")
    if args.before is not None and args.after is None:
        parser.error("--before needs --after")
    torch.set_num_threads(1)  # only the reference runs in torch
    if args.after is not None:
        variants: dict[str, Variant] = {"after": variant(args.after, args.cache_dtype)}
        if args.before is not None:
            variants = {"before": variant(args.before, args.cache_dtype), **variants}
        mode = "graphs" if args.before is not None else "one"
        title = "before / after" if args.before is not None else "per operator, against the floor"
    else:
        graph = args.graph or DEFAULT_GRAPH
        if not graph.is_file():
            print(f"exporting smollm2-135m to {graph} ...", flush=True)
            export_onnx(load_model("smollm2-135m"), graph)
        variants = {"before": Variant(graph, False), "after": Variant(graph, True)}
        mode, title = "fuse", "before / after `ort_fuse`"
    batches = sorted(set(args.batches))
    slots = slots_for(batches)
    steps = shapes(batches, list(dict.fromkeys(kinds)))
    rates, machine_doc = machine_rates(args.machine, args.threads)
    backends = {v: var.open(intra_op_threads=args.threads) for v, var in variants.items()}
    print("fused:", {v: b.fuse_report for v, b in backends.items()}, flush=True)
    errors = check_exact(backends, {name: batch for name, (batch, _) in steps.items()}, slots)
    print("max |logit error| vs torch:", errors, flush=True)
    caches = {v: prefilled_cache(b, slots) for v, b in backends.items()}
    cache_bytes = {v: int(np.dtype(b.np_dtype).itemsize) for v, b in backends.items()}
    wall = time_steps(backends, steps, caches, args.rounds, args.steps)
    del backends, caches
    with tempfile.TemporaryDirectory() as tmp:
        profile = profile_steps(variants, steps, args.steps, args.threads, slots, Path(tmp))
    floor, linears = floors(variants, steps, cache_bytes, rates)
    doc = {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "command": run_command("benchmarks.step_profile", argv),
        "title": title,
        "description": DESCRIPTIONS[mode].format(before=args.before, after=args.after),
        "variants": list(variants),
        "machine": machine_info(),
        "machine_floor_date": machine_doc.get("date"),
        "rates": rates,
        "linears": linears,
        "onnxruntime": ort.__version__,
        "threads": args.threads,
        "cache": {"slots": slots, "max_len": MAX_LEN, "context": CONTEXT, "bytes": cache_bytes},
        "max_abs_logit_error": errors,
        "shapes": {
            s: {
                "rows": steps[s][0].num_tokens,
                "seqs": steps[s][0].num_seqs,
                "kind": steps[s][1],
                "wall_ms": {v: statistics.median(x) for v, x in wall[s].items()},
                "wall_ms_samples": wall[s],
                "profile": profile[s],
                "floor": floor[s],
            }
            for s in steps
        },
    }
    print(write_report(doc, args.out_dir, args.stem, markdown, plot))
    return 0


def plot(doc: dict[str, Any], path: Path) -> None:
    """Wall ms per step of each variant, and the floor, one group of bars per shape (the summary table)."""
    names = list(doc["shapes"])
    series = [(v, [doc["shapes"][n]["wall_ms"][v] for n in names]) for v in doc["variants"]]
    series.append(("floor", [doc["shapes"][n]["floor"][doc["variants"][-1]]["floor_ms"] for n in names]))
    colors = {"before": "tab:gray", "after": "tab:blue", "floor": "tab:green"}
    width = 0.8 / len(series)
    with figure(path, figsize=(max(7, 1.1 * len(names)), 3.8)) as (_, ax):
        for i, (label, values) in enumerate(series):
            offset = (i - (len(series) - 1) / 2) * width
            bars = ax.bar(
                [j + offset for j in range(len(names))], values, width=width, label=label, color=colors[label]
            )
            ax.bar_label(bars, fmt="%.1f", fontsize=7)
        ax.set_xticks(range(len(names)), names, fontsize=7, rotation=20)
        walls = [w for _, values in series for w in values]
        if max(walls) > 20 * min(walls):  # a prefill beside decode steps: keep the small bars readable
            ax.set_yscale("log")
        ax.set_ylabel("ms per target step (median)")
        ax.set_title(
            f"SmolLM2-135M on ONNX Runtime {doc['onnxruntime']}, {doc['threads']} threads: {doc['title']}", fontsize=9
        )
        ax.legend()


if __name__ == "__main__":
    sys.exit(main())

"""Where one ONNX Runtime target step spends its time, per operator, before and after ``ort_fuse``.

What: SmolLM2-135M-Instruct exported with ``specdec-export`` (fp32), run by ``OrtBackend`` with 2
intra-op threads on three steps over a cache of 16 slots x 1024 positions, context about 200:

* ``B=1 decode``: one sequence, one row (past 199);
* ``B=8 decode``: eight sequences, one row each (past 190..211);
* ``B=8 verify 8x5``: eight sequences, a chain of 5 rows each, logits for all 40 rows.

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
batch-invariant one (``--quantize int4``), written to ``--stem`` (``step_profile_int4``).

Run::

    python -m benchmarks.step_profile            # ~6 minutes on a 2-core CPU (+1 min export once)
    python -m benchmarks.step_profile --graph deploy/target/model.onnx --rounds 3
    python -m benchmarks.step_profile --before int4-fp32act/target/model.onnx --after int4/target/model.onnx \
        --stem step_profile_int4
    python -m benchmarks.step_profile --before benchmarks/.cache/edge/int4/target/model.onnx \
        --after benchmarks/.cache/edge/int8/target/model.onnx --stem step_profile_edge --prefill --rounds 3 --steps 3

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
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import torch

from specdec.bench.harness import machine_info, run_command
from specdec.export.onnx import export_onnx
from specdec.models.loading import load_model
from specdec.runtime.backends.base import KVStorage
from specdec.runtime.backends.onnxruntime import OrtBackend
from specdec.runtime.backends.torch_backend import TorchBackend
from specdec.runtime.packed import PackedBatch, SeqWork, pack

DEFAULT_GRAPH = Path(__file__).parent / ".cache" / "step-profile" / "model.onnx"
#: what the report says the two variants are, by mode
DESCRIPTIONS = {
    "fuse": (
        "SmolLM2-135M-Instruct, fp32. *before*: the exported graph as ORT inlines it (`OrtBackend(fuse=False)`); "
        "*after*: `ort_fuse`'s lowering (GroupQueryAttention, SimplifiedLayerNormalization / "
        "SkipSimplifiedLayerNormalization, RotaryEmbedding)"
    ),
    "graphs": (
        "SmolLM2-135M-Instruct, two exports, each lowered by `ort_fuse` as `OrtBackend` serves it. *before*: "
        "`{before}`; *after*: `{after}`"
    ),
}
Variant = tuple[Path, bool]  # (graph, OrtBackend(fuse=...))
SLOTS, MAX_LEN, CONTEXT = 16, 1024, 200


PAST = [CONTEXT - 10 + 3 * s for s in range(8)]  # committed length of slots 0..7


PREFILL = [160, 200, 240, 280, 300, 320, 340, 359]  # prompt lengths of the B=8 prefill: edge_cpu's extractive range


def shapes(prefill: bool = False) -> dict[str, PackedBatch]:
    """The steps profiled (token ids are arbitrary: the cost does not depend on them); ``prefill`` adds one
    prefill of 8 prompts (``PREFILL``, 2,199 rows, into the idle slots 8..15), the step that bounds a batch of
    long prompts (``benchmarks/results/edge_cpu.md``: TTFT 2.5 s at batch 8)."""
    steps = {
        "B=1 decode": pack([SeqWork(3, PAST[3], [42])]),
        "B=8 decode": pack([SeqWork(s, PAST[s], [100 + s]) for s in range(8)]),
        "B=8 verify 8x5": pack([SeqWork(s, PAST[s], [100 + s + j for j in range(5)]) for s in range(8)]),
    }
    if prefill:
        rng = np.random.default_rng(1)
        steps["B=8 prefill 160-359"] = pack(
            [SeqWork(8 + s, 0, rng.integers(0, 49152, n).tolist(), logits="last") for s, n in enumerate(PREFILL)]
        )
    return steps


def prefilled_cache(backend: OrtBackend | TorchBackend) -> KVStorage:
    """A cache whose slots 0..7 hold the K/V of ``PAST[s]`` prompt tokens (the same tokens for every backend)."""
    cache = backend.allocate_cache(SLOTS, MAX_LEN)
    g = np.random.default_rng(0)
    prompts = [g.integers(0, 49152, n).tolist() for n in PAST]
    for s, tokens in enumerate(prompts):
        backend.step(pack([SeqWork(s, 0, tokens, logits="last")]), cache)
    return cache


def check_exact(backends: dict[str, OrtBackend], steps: dict[str, PackedBatch]) -> dict[str, float]:
    """max |logit - torch reference| of each variant on the profiled steps, after the same prefill."""
    ref = TorchBackend(load_model("smollm2-135m"))
    ref_cache = prefilled_cache(ref)
    want = {name: ref.step(batch, ref_cache) for name, batch in steps.items()}
    errors: dict[str, float] = {}
    for variant, backend in backends.items():
        cache = prefilled_cache(backend)
        errors[variant] = max(
            float(np.abs(want[name] - backend.step(batch, cache)).max()) for name, batch in steps.items()
        )
    return errors


def time_steps(
    backends: dict[str, OrtBackend], steps: dict[str, PackedBatch], caches: dict[str, KVStorage], rounds: int, n: int
) -> dict[str, dict[str, list[float]]]:
    """ms per step for every (shape, variant), ``rounds`` interleaved samples each (order alternates)."""
    samples: dict[str, dict[str, list[float]]] = {s: {v: [] for v in backends} for s in steps}
    names = list(backends)
    for r in range(rounds):
        for shape, batch in steps.items():
            for variant in names if r % 2 == 0 else names[::-1]:
                backend, cache = backends[variant], caches[variant]
                backend.step(batch, cache)  # warm this shape
                start = time.perf_counter()
                for _ in range(n):
                    backend.step(batch, cache)
                samples[shape][variant].append((time.perf_counter() - start) / n * 1e3)
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
    variants: dict[str, Variant], steps: dict[str, PackedBatch], n: int, threads: int, prefix: Path
) -> dict[str, dict[str, Any]]:
    """Per-op and per-node kernel ms per step of each (shape, variant), from ORT's profiler."""
    backends = {
        v: OrtBackend(graph, fuse=f, intra_op_threads=threads, profile_prefix=str(prefix / v))
        for v, (graph, f) in variants.items()
    }
    caches = {v: prefilled_cache(b) for v, b in backends.items()}
    windows: dict[str, list[tuple[str, int]]] = {v: [] for v in backends}  # (shape, index of its first timed run)
    runs = dict.fromkeys(backends, 0)
    for shape, batch in steps.items():
        for variant, backend in backends.items():
            for _ in range(3):  # warm-up runs, not counted
                backend.step(batch, caches[variant])
            windows[variant].append((shape, runs[variant] + 3))
            for _ in range(n):
                backend.step(batch, caches[variant])
            runs[variant] += 3 + n
    out: dict[str, dict[str, Any]] = {s: {} for s in steps}
    for variant, backend in backends.items():
        events = json.loads(Path(backend.session.end_profiling()).read_text())
        model_runs = [e for e in events if e.get("name") == "model_run"][len(PAST) :]  # after the prefills
        kernels = [e for e in events if e.get("cat") == "Node" and e.get("name", "").endswith("_kernel_time")]
        own = own_durations(kernels)
        for shape, first in windows[variant]:
            chosen = model_runs[first : first + n]
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
                "kernel_ms": sum(by_op.values()) / n / 1e3,
                "nodes_run": len(nodes),
                "by_op_ms": {op: d / n / 1e3 for op, d in by_op.most_common()},
                "top_nodes_ms": {k: d / n / 1e3 for k, d in by_node.most_common(8)},
            }
    return out


def markdown(doc: dict[str, Any]) -> str:
    lines = [
        f"# One ONNX Runtime target step per operator: {doc['title']}",
        "",
        f"{doc['description']}. ORT {doc['onnxruntime']}, {doc['threads']} intra-op threads, cache "
        f"{SLOTS} slots x {MAX_LEN}, context ~{CONTEXT}. "
        f"Command: `{doc['command']}`. Machine: {doc['machine'].get('processor')}, "
        f"load average at start {doc['machine'].get('load_average')} (shared machine: other users' jobs ran "
        "during the measurement, so read medians, not single numbers).",
        "",
        "Wall time: median over interleaved rounds of `OrtBackend.step` with the profiler off. Kernel "
        "time: the profiler's sum over nodes, an `If` counted without the nodes of its branch, which are "
        "counted themselves (its own overhead makes `model_run` longer than the wall time).",
        "",
        "Logit error vs the torch reference on these steps: "
        + ", ".join(f"{v} {e:.2e}" for v, e in doc["max_abs_logit_error"].items())
        + ".",
        "",
        "| step | before ms (wall) | after ms (wall) | speed-up | before nodes run | after nodes run |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for shape, row in doc["shapes"].items():
        b, a = row["wall_ms"]["before"], row["wall_ms"]["after"]
        lines.append(
            f"| {shape} | {b:.1f} | {a:.1f} | {b / a:.2f}x | {row['profile']['before']['nodes_run']} | "
            f"{row['profile']['after']['nodes_run']} |"
        )
    for shape, row in doc["shapes"].items():
        before, after = row["profile"]["before"], row["profile"]["after"]
        ops = list(dict.fromkeys([*before["by_op_ms"], *after["by_op_ms"]]))
        ops.sort(key=lambda op: -max(before["by_op_ms"].get(op, 0.0), after["by_op_ms"].get(op, 0.0)))
        lines += [
            "",
            f"## {shape}",
            "",
            "| op type | before ms/step | before share | after ms/step | after share |",
            "|---|---:|---:|---:|---:|",
        ]
        for op in ops[:18]:
            cells = []
            for prof in (before, after):
                ms = prof["by_op_ms"].get(op)
                cells.append("–|–" if ms is None else f"{ms:.2f}|{100 * ms / prof['kernel_ms']:.1f}%")
            lines.append(f"| {op} | " + " | ".join(c.replace("|", " | ") for c in cells) + " |")
        rest = ops[18:]
        if rest:
            cells = [
                f"{sum(p['by_op_ms'].get(op, 0.0) for op in rest):.2f} | "
                f"{100 * sum(p['by_op_ms'].get(op, 0.0) for op in rest) / p['kernel_ms']:.1f}%"
                for p in (before, after)
            ]
            lines.append(f"| {len(rest)} other op types | {cells[0]} | {cells[1]} |")
        lines.append(
            f"| **kernels, total** | **{before['kernel_ms']:.2f}** | 100% | **{after['kernel_ms']:.2f}** | 100% |"
        )
        lines.append(f"| profiled `model_run` | {before['model_run_ms']:.2f} | | {after['model_run_ms']:.2f} | |")
        lines.append(
            f"| wall, profiler off (median) | {row['wall_ms']['before']:.2f} | | {row['wall_ms']['after']:.2f} | |"
        )
        lines += [
            "",
            "Slowest nodes after: "
            + ", ".join(f"`{k}` {v:.2f} ms" for k, v in list(after["top_nodes_ms"].items())[:5])
            + ".",
        ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--graph",
        type=Path,
        default=None,
        help=f"an exported target graph (default: export smollm2-135m to {DEFAULT_GRAPH})",
    )
    parser.add_argument("--before", type=Path, help="compare two exported graphs instead: the first (with --after)")
    parser.add_argument("--after", type=Path, help="the second graph of --before")
    parser.add_argument("--stem", default="step_profile", help="file names of the results")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds (median kept)")
    parser.add_argument("--steps", type=int, default=8, help="steps per shape per round and in the profile")
    parser.add_argument("--out-dir", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument(
        "--prefill",
        action="store_true",
        help="also profile a prefill of 8 prompts of 160-359 tokens (2.5 s a step on 2 cores)",
    )
    args = parser.parse_args(argv)
    if (args.before is None) != (args.after is None):
        parser.error("--before and --after go together")
    torch.set_num_threads(1)  # only the reference runs in torch
    if args.before is not None:
        variants: dict[str, Variant] = {"before": (args.before, True), "after": (args.after, True)}
        mode, title = "graphs", "before / after"
    else:
        graph = args.graph or DEFAULT_GRAPH
        if not graph.is_file():
            print(f"exporting smollm2-135m to {graph} ...", flush=True)
            export_onnx(load_model("smollm2-135m"), graph)
        variants, mode, title = {"before": (graph, False), "after": (graph, True)}, "fuse", "before / after `ort_fuse`"
    steps = shapes(args.prefill)
    backends = {v: OrtBackend(graph, fuse=f, intra_op_threads=args.threads) for v, (graph, f) in variants.items()}
    print("fused:", {v: b.fuse_report for v, b in backends.items()}, flush=True)
    errors = check_exact(backends, steps)
    print("max |logit error| vs torch:", errors, flush=True)
    caches = {v: prefilled_cache(b) for v, b in backends.items()}
    wall = time_steps(backends, steps, caches, args.rounds, args.steps)
    del backends, caches
    with tempfile.TemporaryDirectory() as tmp:
        profile = profile_steps(variants, steps, args.steps, args.threads, Path(tmp))
    doc = {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "command": run_command("benchmarks.step_profile", argv),
        "title": title,
        "description": DESCRIPTIONS[mode].format(before=args.before, after=args.after),
        "machine": machine_info(),
        "onnxruntime": ort.__version__,
        "threads": args.threads,
        "cache": {"slots": SLOTS, "max_len": MAX_LEN, "context": CONTEXT},
        "max_abs_logit_error": errors,
        "shapes": {
            s: {
                "rows": steps[s].num_tokens,
                "seqs": steps[s].num_seqs,
                "wall_ms": {v: statistics.median(x) for v, x in wall[s].items()},
                "wall_ms_samples": wall[s],
                "profile": profile[s],
            }
            for s in steps
        },
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / f"{args.stem}.json").write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    text = markdown(doc)
    (args.out_dir / f"{args.stem}.md").write_text(text, encoding="utf-8")
    plot(doc, args.out_dir / f"{args.stem}.png")
    print(text)
    return 0


def plot(doc: dict[str, Any], path: Path) -> None:
    """Wall ms per step before / after the lowering, one pair of bars per shape (the table's first rows)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(doc["shapes"])
    fig, ax = plt.subplots(figsize=(7, 3.6))
    for offset, variant, color in ((-0.2, "before", "tab:gray"), (0.2, "after", "tab:blue")):
        values = [doc["shapes"][n]["wall_ms"][variant] for n in names]
        bars = ax.bar([i + offset for i in range(len(names))], values, width=0.4, label=variant, color=color)
        ax.bar_label(bars, fmt="%.1f", fontsize=8)
    ax.set_xticks(range(len(names)), names, fontsize=8)
    walls = [w for n in names for w in doc["shapes"][n]["wall_ms"].values()]
    if max(walls) > 20 * min(walls):  # a prefill beside decode steps: keep the small bars readable
        ax.set_yscale("log")
    ax.set_ylabel("ms per target step (median)")
    ax.set_title(
        f"SmolLM2-135M on ONNX Runtime {doc['onnxruntime']}, {doc['threads']} threads: {doc['title']}", fontsize=9
    )
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())

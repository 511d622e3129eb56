"""The ONNX Runtime lowering of an earlier specdec (a git ref) against this one's, on the same export: bits and speed.

What: ``ort_fuse.fuse_model`` of ``--ref`` (its ``specdec`` package taken with ``git archive``, run in a
subprocess) and of the working tree lower the same graph; both lowerings open as ``OrtBackend`` sessions in one
process over one cache (2 intra-op threads, prefilled once), and each step shape of ``--shapes`` runs on both:
its logits must be bitwise equal, then it is timed ``--rounds`` times per lowering, the two alternating with a
pause between them (the idle session's workers stop spinning), and the median kept.

Why: a lowering that moves work between nodes must keep every row's bits (greedy ``ems`` = ``ar`` rests on
them) and should be measured against the one it replaces on the same machine in the same minute; this CPU's
run-to-run noise between processes is larger than the few percent such a change makes.

Run::

    python -m benchmarks.lowering_ab --export benchmarks/.cache/edge/int4-rtn --ref df51369 --stem attention_if

Writes ``<out-dir>/<stem>.{json,md,png}`` (default ``benchmarks/results``).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from specdec.bench.harness import machine_info, run_command, utc_stamp
from specdec.bench.report import step_bars, write_report

#: step shapes: ``sequences x rows`` (decode 1, chains more) or ``prefill N`` (one fresh prompt of N tokens), then
#: ``/slots`` of the cache (default: one per sequence, as an engine opened for that batch has; a server has more)
SHAPES = ("1x1", "1x1/8", "1x7", "4x1", "4x1/8", "8x1", "8x5", "prefill 150", "prefill 150/8")
PAST = 100  # tokens each sequence holds before the timed step
_LOWER = """
import sys, onnx
from specdec.runtime.backends import ort_fuse
proto = onnx.load(sys.argv[1], load_external_data=False)
ort_fuse.fuse_model(proto, ort_fuse.REWRITES)
onnx.save(proto, sys.argv[2])
"""


def lower(graph: Path, out: Path, package_root: Path | None) -> None:
    """``graph`` lowered by the specdec under ``package_root`` (None: this one), saved beside it as ``out``."""
    env = None if package_root is None else {"PYTHONPATH": str(package_root), "PATH": ""}
    subprocess.run([sys.executable, "-c", _LOWER, str(graph), str(out)], check=True, env=env, cwd=package_root)


def step_of(shape: str, past: int, rng: np.random.Generator) -> tuple[Any, int]:
    """The packed step of ``shape`` and the slots of its cache."""
    from specdec.runtime.packed import SeqWork, pack

    kind, _, slots = shape.partition("/")
    if kind.startswith("prefill"):
        step = pack([SeqWork(0, 0, rng.integers(100, 1000, int(kind.split()[1])).tolist(), logits="last")])
    else:
        seqs, rows = (int(x) for x in kind.split("x"))
        step = pack([SeqWork(s, past, [123] * rows, logits="all") for s in range(seqs)])
    return step, int(slots or step.num_seqs)


def measure(graph: Path, ref: str, shapes: list[str], rounds: int, steps: int) -> dict[str, Any]:
    """Per shape: whether both lowerings give the same logits, and their median ms per step."""
    from specdec.runtime.backends.onnxruntime import OrtBackend
    from specdec.runtime.packed import SeqWork, pack

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        archive = subprocess.run(["git", "archive", ref, "specdec"], check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(root)], input=archive, check=True)
        lowered = {"before": graph.with_name(f".lowered_{ref}.onnx"), "after": graph.with_name(".lowered_now.onnx")}
        try:
            lower(graph, lowered["before"], root)
            lower(graph, lowered["after"], None)
            backends = {k: OrtBackend(p, intra_op_threads=2, fuse=False) for k, p in lowered.items()}
        finally:
            for p in lowered.values():
                p.unlink(missing_ok=True)
    rng = np.random.default_rng(0)
    rows: dict[str, Any] = {}
    for shape in tqdm(shapes, desc="shapes", unit="shape"):
        step, slots = step_of(shape, PAST, rng)
        cache = backends["before"].allocate_cache(slots, PAST + 256)
        for slot in range(slots):  # every slot holds a sequence, the step's and the others (idle in it)
            backends["before"].step(pack([SeqWork(slot, 0, rng.integers(100, 1000, PAST).tolist())]), cache)
        n = max(1, steps // 5) if shape.startswith("prefill") else steps  # a prefill is ~25 decoding steps
        same = np.array_equal(backends["before"].step(step, cache), backends["after"].step(step, cache))
        times: dict[str, list[float]] = {k: [] for k in backends}
        for r in range(rounds):
            for name in ("before", "after") if r % 2 == 0 else ("after", "before"):
                time.sleep(0.2)
                backends[name].step(step, cache)
                start = time.perf_counter()
                for _ in range(n):
                    backends[name].step(step, cache)
                times[name].append((time.perf_counter() - start) / n * 1e3)
        ms = {k: statistics.median(v) for k, v in times.items()}
        ratio = ms["after"] / ms["before"]
        rows[shape] = {"bitwise_equal": bool(same), "steps": n, "ms": ms, "after_over_before": ratio}
    return rows


def markdown(doc: dict[str, Any]) -> str:
    lines = [
        f"# The ONNX Runtime lowering at {doc['ref']} against the working tree's, on {doc['export']}",
        "",
        f"{doc['date']}, `{doc['command']}`; machine: {doc['machine']}. One process, 2 intra-op threads, a cache "
        f"per step shape (`/slots`: its slots, else one per sequence; every slot holds {doc['past']} tokens before "
        f"the step), the median of {doc['rounds']} alternating rounds of *steps* steps per lowering.",
        "",
        "| step (sequences x rows / slots) | steps | before, ms | after, ms | after / before | logits bitwise equal |",
        "|:---|---:|---:|---:|---:|:---|",
    ]
    for shape, row in doc["rows"].items():
        lines.append(
            f"| {shape} | {row['steps']} | {row['ms']['before']:.2f} | {row['ms']['after']:.2f} "
            f"| {row['after_over_before']:.3f} "
            f"| {'yes' if row['bitwise_equal'] else '**no**'} |"
        )
    return "\n".join(lines) + "\n"


def draw(doc: dict[str, Any], path: Path) -> None:
    shapes = list(doc["rows"])
    series = {k: [doc["rows"][s]["ms"][k] for s in shapes] for k in ("before", "after")}
    step_bars(path, shapes, series, f"lowering at {doc['ref']} (before) vs working tree (after)")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--export", type=Path, required=True, help="a specdec-export directory (its target graph)")
    p.add_argument("--ref", required=True, help="the git ref whose lowering is 'before'")
    p.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, default {','.join(SHAPES)}")
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--steps", type=int, default=40, help="timed steps per round (a prefill: a fifth of them)")
    p.add_argument("--stem", default="lowering_ab")
    p.add_argument("--out-dir", type=Path, default=Path("benchmarks/results"))
    args = p.parse_args(argv)
    shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    rows = measure(args.export / "target" / "model.onnx", args.ref, shapes, args.rounds, args.steps)
    doc = {
        "ref": args.ref,
        "export": str(args.export),
        "date": utc_stamp(),
        "command": run_command("benchmarks.lowering_ab", argv),
        "machine": machine_info(),
        "past": PAST,
        "rounds": args.rounds,
        "rows": rows,
    }
    print(write_report(doc, args.out_dir, args.stem, markdown, draw))


if __name__ == "__main__":
    main()

"""MatMulNBits by block size: the int4 linears' time per step, and whether one row is multiplied as several are.

What: ONNX Runtime's ``MatMulNBits`` at int8 activations (``accuracy_level`` 4, what an int4 export ships), one
single-node session per linear shape of SmolLM2-135M (q|k|v, o, gate|up, down and the LM head; random weights, since
the time does not depend on them) and per block size, timed at several row counts (interleaved over rounds, the
median kept) and summed over the model's 30 layers and its head: the linears' share of one step. Beside the time,
the row check: is row 0 of an M-row product bitwise the one-row product of that row, for every M measured?

Why: a wider block carries fewer scales and MLAS's kernels run it faster, but greedy ``ems`` equals ``ar`` only on a
batch-invariant graph (``docs/exactness.md``), and MLAS multiplies rows of wide blocks in pairs and an odd last row
alone, with another kernel, so the backend runs every step of such a graph on an even row count (``OrtBackend``'s
``row_floor``). This
is what ``--quantize-block-size`` is chosen by (``docs/export.md``, Quantization) and what
``onnxruntime.ROW_INVARIANT_BLOCK`` records.

Run::

    python -m benchmarks.block_sizes       # writes benchmarks/results/block_sizes.{json,md,png}
"""

from __future__ import annotations

import argparse
import datetime as dt
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from specdec.bench.figures import figure
from specdec.bench.harness import int_list, machine_info, run_command
from specdec.bench.report import write_report
from specdec.export.quantization.blocks import BlockQuant
from specdec.export.quantization.nbits import INT8_ACTIVATIONS, matmul_nbits
from specdec.export.quantization.rewrite import one_linear

#: SmolLM2-135M's linears (name, N outputs, K inputs, how many per step): hidden 576, 9 + 2 * 3 heads of 64,
#: intermediate 1536, 30 layers, vocabulary 49152 (the head multiplies only the rows that need logits)
SHAPES = (
    ("q|k|v", 960, 576, 30),
    ("o", 576, 576, 30),
    ("gate|up", 3072, 576, 30),
    ("down", 576, 1536, 30),
    ("head", 49152, 576, 1),
)


def session(n: int, k: int, block_size: int, threads: int, rng: np.random.Generator) -> Any:
    """One MatMulNBits node of random 4-bit blocks (asymmetric, as the int4 exports' RTN and calibrated ones)."""
    import onnxruntime as ort

    k_blocks = -(-k // block_size)
    block = BlockQuant(
        4,
        rng.integers(0, 16, (n, k_blocks, block_size), dtype=np.uint8),
        (rng.random((n, k_blocks), dtype=np.float32) * 0.01 + 1e-3),
        rng.integers(0, 16, (n, k_blocks), dtype=np.uint8),
        None,
        k,
        "random",
    )
    model = one_linear(k, n, lambda g, node: matmul_nbits(g, node, block, [], INT8_ACTIVATIONS))
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    # many sessions share the cores: idle workers that spin would hold them from the one being timed
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def row_checks(sess: Any, k: int, rows: list[int], rng: np.random.Generator) -> dict[str, bool]:
    """Each row of a product against the same row multiplied in a pair with itself: whether every row of every even
    row count matches it (what the backend's even steps rest on), and whether a lone row does."""
    x = rng.standard_normal((max(rows) + 1, k)).astype(np.float32)
    paired = np.stack([sess.run(None, {"x": x[[r, r]]})[0][0] for r in range(len(x))])
    even = [m + m % 2 for m in rows]
    return {
        "even_counts_alike": all(np.array_equal(sess.run(None, {"x": x[:m]})[0], paired[:m]) for m in even),
        "lone_row_alike": bool(np.array_equal(sess.run(None, {"x": x[:1]})[0][0], paired[0])),
    }


def measure(block_sizes: list[int], rows: list[int], rounds: int, threads: int) -> dict[str, Any]:
    """Per block size: the linears' ms per step at each row count (median over rounds), and the row check."""
    rng = np.random.default_rng(0)
    sessions = {(b, name): session(n, k, b, threads, rng) for b in block_sizes for name, n, k, _ in SHAPES}
    inputs = {(name, m): rng.standard_normal((m, k)).astype(np.float32) for name, _, k, _ in SHAPES for m in rows}
    samples: dict[tuple[int, str, int], list[float]] = {
        (b, name, m): [] for b in block_sizes for name, *_ in SHAPES for m in rows
    }
    with tqdm(total=rounds * len(samples), desc="MatMulNBits", unit="timing") as bar:
        for _ in range(rounds):
            for b, name, m in samples:
                sess, x = sessions[b, name], {"x": inputs[name, m]}
                sess.run(None, x)
                repeats = 20 if name == "head" else 100
                start = time.perf_counter()
                for _ in range(repeats):
                    sess.run(None, x)
                samples[b, name, m].append((time.perf_counter() - start) / repeats * 1e3)
                bar.update()
    out: dict[str, Any] = {}
    for b in block_sizes:
        per_shape = {name: {str(m): statistics.median(samples[b, name, m]) for m in rows} for name, *_ in SHAPES}
        out[str(b)] = {  # keys as JSON has them: the block size and the rows as strings
            "ms_per_step": {str(m): sum(per_shape[name][str(m)] * count for name, _, _, count in SHAPES) for m in rows},
            "ms_per_shape": per_shape,
            **{
                check: all(found[check] for found in checks)
                for checks in [[row_checks(sessions[b, name], k, rows, rng) for name, _, k, _ in SHAPES]]
                for check in ("even_counts_alike", "lone_row_alike")
            },
        }
    return out


def markdown(doc: dict[str, Any]) -> str:
    rows = doc["rows"]
    base = doc["results"]["32"]["ms_per_step"] if "32" in doc["results"] else None
    lines = [
        "# MatMulNBits by block size (int4, int8 activations)",
        "",
        f"{doc['date']}, `{doc['command']}`; ONNX Runtime {doc['onnxruntime']}, {doc['threads']} threads, "
        f"median of {doc['rounds']} interleaved rounds; machine: {doc['machine']}.",
        "",
        "The int4 linears of one SmolLM2-135M step (30 layers' q|k|v, o, gate|up and down, and the head), ms per step "
        "by rows multiplied; in brackets, the time relative to blocks of 32. The row checks compare each row of a "
        "product with the same row multiplied in a pair with itself: *even counts* whether every row of products of "
        "2 to 16 rows matches it, *a lone row* whether a one-row product does.",
        "",
        "| block size | "
        + " | ".join(f"{m} row{'s' * (m > 1)}" for m in rows)
        + " | even counts alike | a lone row alike |",
        "|---:|" + "---:|" * len(rows) + ":---|:---|",
    ]
    for b, result in doc["results"].items():
        cells = []
        for m in rows:
            ms = result["ms_per_step"][str(m)]
            cells.append(f"{ms:.2f}" + ("" if base is None else f" ({ms / base[str(m)]:.2f})"))
        yes = {True: "yes", False: "**no**"}
        checks = f"{yes[result['even_counts_alike']]} | {yes[result['lone_row_alike']]}"
        lines.append(f"| {b} | " + " | ".join(cells) + f" | {checks} |")
    lines += [
        "",
        "Reading: where a lone row is not multiplied as paired rows are, MLAS runs rows in pairs and the odd last row "
        "of a product alone, so a row's bits would depend on how many rows share its step. `OrtBackend` runs every "
        "step of such a graph on an even row count (its `row_floor`: an odd step gets one more row) and greedy `ems` "
        "still equals `ar`; what that costs a one-stream decoding step is the 2-row column against the 1-row one.",
        "",
    ]
    return "\n".join(lines)


def plot(doc: dict[str, Any], path: Path) -> None:
    with figure(path, figsize=(7, 4)) as (_, ax):
        for b, result in doc["results"].items():
            label = f"blocks of {b}" + ("" if result["lone_row_alike"] else " (a lone row differs)")
            ax.plot(doc["rows"], [result["ms_per_step"][str(m)] for m in doc["rows"]], "o-", label=label)
        ax.set_xlabel("rows multiplied")
        ax.set_ylabel("ms per step (int4 linears)")
        ax.set_title("MatMulNBits int4 by block size, SmolLM2-135M")
        ax.legend(fontsize=8)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--block-sizes", type=int_list, default=[16, 32, 64, 128])
    parser.add_argument("--rows", type=int_list, default=[1, 2, 5, 8, 16])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--stem", default="block_sizes")
    parser.add_argument("--out-dir", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args(argv)
    import onnxruntime as ort

    doc = {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "command": run_command("benchmarks.block_sizes", argv),
        "machine": machine_info(),
        "onnxruntime": ort.__version__,
        "threads": args.threads,
        "rounds": args.rounds,
        "rows": args.rows,
        "results": measure(args.block_sizes, args.rows, args.rounds, args.threads),
    }
    print(write_report(doc, args.out_dir, args.stem, markdown, plot))
    return 0


if __name__ == "__main__":
    sys.exit(main())

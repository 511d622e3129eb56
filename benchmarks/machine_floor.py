"""What this CPU can do at most: memory bandwidth, integer (VNNI) and fp32 GEMM throughput, and ORT's cost per node.

Why: a step profile says where a step's time goes; these numbers say how far each part is from the
machine's limit (``benchmarks/step_profile.py`` prices every step's bytes and operations at them:
its *floor*). Each is measured the way a step meets it, on ONNX Runtime with the step's threads:

* **read bandwidth** (GB/s): numpy sums over a float32 buffer of 8, 64 and 256 MiB split over the
  threads (the weights of a SmolLM2 step are ~70-150 MB; smaller working sets stay in cache), one
  thread alone beside it, and what a one-row ``MatMulNBits`` over ~41 MiB of weights reads;
* **int8 GEMM** (GOP/s, one op = a multiply or an add): ``MatMulInteger`` u8 x s8 (MLAS QGEMM:
  VNNI where the CPU has it) at 512 x 2048 x 2048, what a w8a8 prefill runs;
* **int4 blocks** (GOP/s): ``MatMulNBits`` 4-bit, block 32, ``accuracy_level`` 4 (int8 activation
  blocks) at 512 rows, what an int4 prefill runs;
* **fp32 GEMM** (GFLOP/s): ``MatMul`` 512 x 2048 x 2048 with a constant (prepacked) weight;
* **per node** (µs): a chain of 400 ``Add`` nodes on one 576-wide row, minus nothing: what ORT
  spends per kernel launch when the kernel itself does almost nothing.

Every number is the fastest of ``--repeats`` timed runs after a warm-up (a ceiling: on a shared
machine the median moves with other jobs). Read them as what a step could get at best here, not as a
specification.

Run::

    python -m benchmarks.machine_floor                      # ~1 minute
    python -m benchmarks.machine_floor --threads 2 --repeats 9

Writes ``benchmarks/results/machine_floor.{json,md}``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from specdec.bench.harness import machine_info, run_command
from specdec.runtime.backends.onnx_edit import MS_DOMAIN
from specdec.runtime.backends.onnxruntime import has_vnni

MIB = 1 << 20
GEMM_M, GEMM_K, GEMM_N = 512, 2048, 2048
DECODE_N = 32768  # the one-row MatMulNBits reads ~41 MiB of weights: more than any cache level holds alone


#: how the timed runs of one measurement are summarised: the fastest (what the machine does at most, other jobs
#: aside: the floor's rates) or the median (what a step typically met meanwhile)
STATISTIC: dict[str, Callable[[list[float]], float]] = {"best": min, "median": statistics.median}
_summary = STATISTIC["best"]


def _best_seconds(run: Callable[[], object], repeats: int) -> float:
    """``repeats`` timed runs after a warm-up, summarised by the current statistic (``measure``)."""
    run()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        samples.append(time.perf_counter() - start)
    return _summary(samples)


def _session(graph: Any, threads: int) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 20), helper.make_opsetid(MS_DOMAIN, 1)], ir_version=10
    )
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def read_bandwidth(mib: int, threads: int, repeats: int) -> dict[str, float]:
    """GB/s of numpy sums over ``mib`` MiB of float32, split over ``threads`` threads (numpy's reductions release
    the GIL), and of one thread alone."""
    from concurrent.futures import ThreadPoolExecutor

    data = np.random.default_rng(0).standard_normal(mib * MIB // 4, dtype=np.float32)
    parts = np.array_split(data, threads)
    with ThreadPoolExecutor(threads) as pool:
        split_s = _best_seconds(lambda: list(pool.map(np.sum, parts)), repeats)
    one_s = _best_seconds(data.sum, repeats)
    return {"mib": mib, "gb_s": data.nbytes / split_s / 1e9, "one_thread_gb_s": data.nbytes / one_s / 1e9}


def int8_gemm(threads: int, repeats: int) -> float:
    """GOP/s of MatMulInteger u8 x s8 (constant weight) at GEMM_M x GEMM_K x GEMM_N."""
    rng = np.random.default_rng(1)
    b = rng.integers(-127, 128, (GEMM_K, GEMM_N), dtype=np.int8)
    graph = helper.make_graph(
        [helper.make_node("MatMulInteger", ["a", "b", "zp"], ["y"])],
        "qgemm",
        [helper.make_tensor_value_info("a", TensorProto.UINT8, ["M", GEMM_K])],
        [helper.make_tensor_value_info("y", TensorProto.INT32, ["M", GEMM_N])],
        [numpy_helper.from_array(b, "b"), numpy_helper.from_array(np.uint8(128), "zp")],
    )
    sess = _session(graph, threads)
    a = rng.integers(0, 256, (GEMM_M, GEMM_K), dtype=np.uint8)
    seconds = _best_seconds(lambda: sess.run(None, {"a": a}), repeats)
    return 2 * GEMM_M * GEMM_K * GEMM_N / seconds / 1e9


def fp32_gemm(threads: int, repeats: int) -> float:
    """GFLOP/s of MatMul fp32 (constant, prepacked weight) at GEMM_M x GEMM_K x GEMM_N."""
    rng = np.random.default_rng(2)
    b = rng.standard_normal((GEMM_K, GEMM_N), dtype=np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["a", "b"], ["y"])],
        "sgemm",
        [helper.make_tensor_value_info("a", TensorProto.FLOAT, ["M", GEMM_K])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["M", GEMM_N])],
        [numpy_helper.from_array(b, "b")],
    )
    sess = _session(graph, threads)
    a = rng.standard_normal((GEMM_M, GEMM_K), dtype=np.float32)
    seconds = _best_seconds(lambda: sess.run(None, {"a": a}), repeats)
    return 2 * GEMM_M * GEMM_K * GEMM_N / seconds / 1e9


def nbits_gemm(rows: int, threads: int, repeats: int, n: int = GEMM_N) -> dict[str, float]:
    """MatMulNBits 4-bit (block 32, uint8 zero points, level 4) at ``rows`` x GEMM_K x ``n``: GOP/s and GB/s of
    its weight bytes (codes + scales + zero points)."""
    rng = np.random.default_rng(3)
    blocks = GEMM_K // 32
    codes = rng.integers(0, 256, (n, blocks, 16), dtype=np.uint8)
    scales = rng.random((n * blocks,), dtype=np.float32) * 0.01
    zps = rng.integers(0, 256, (n * ((blocks + 1) // 2),), dtype=np.uint8)
    node = helper.make_node(
        "MatMulNBits",
        ["a", "w", "s", "z"],
        ["y"],
        domain=MS_DOMAIN,
        K=GEMM_K,
        N=n,
        bits=4,
        block_size=32,
        accuracy_level=4,
    )
    graph = helper.make_graph(
        [node],
        "nbits",
        [helper.make_tensor_value_info("a", TensorProto.FLOAT, ["M", GEMM_K])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["M", n])],
        [numpy_helper.from_array(x, name) for x, name in ((codes, "w"), (scales, "s"), (zps, "z"))],
    )
    sess = _session(graph, threads)
    a = rng.standard_normal((rows, GEMM_K), dtype=np.float32)
    seconds = _best_seconds(lambda: sess.run(None, {"a": a}), repeats)
    weight_bytes = codes.nbytes + scales.nbytes + zps.nbytes
    return {
        "rows": rows,
        "n": n,
        "weight_mib": weight_bytes / MIB,
        "gop_s": 2 * rows * GEMM_K * n / seconds / 1e9,
        "weight_gb_s": weight_bytes / seconds / 1e9,
    }


def per_node_us(threads: int, repeats: int, nodes: int = 400) -> float:
    """µs per node of a chain of ``nodes`` Add nodes on one [1, 576] row (the launch cost of a trivial kernel)."""
    one = numpy_helper.from_array(np.ones((1, 576), np.float32), "one")
    chain = [helper.make_node("Add", ["x" if i == 0 else f"t{i}", "one"], [f"t{i + 1}"]) for i in range(nodes)]
    graph = helper.make_graph(
        chain,
        "chain",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 576])],
        [helper.make_tensor_value_info(f"t{nodes}", TensorProto.FLOAT, [1, 576])],
        [one],
    )
    options_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # keep every node (no constant folding of the chain)
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.graph_optimization_level = options_level
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)], ir_version=10)
    sess = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    x = np.zeros((1, 576), np.float32)
    return _best_seconds(lambda: sess.run(None, {"x": x}), repeats) / nodes * 1e6


def measure(threads: int, repeats: int, statistic: str = "best") -> dict[str, Any]:
    """Every number of the module docstring, its runs summarised by ``statistic`` (``STATISTIC``)."""
    global _summary
    _summary = STATISTIC[statistic]
    bandwidth = [read_bandwidth(mib, threads, repeats) for mib in (8, 64, 256)]
    return {
        "statistic": statistic,
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(),
        "onnxruntime": ort.__version__,
        "vnni": has_vnni(),
        "threads": threads,
        "repeats": repeats,
        "read_bandwidth": bandwidth,
        "int8_gemm_gop_s": int8_gemm(threads, repeats),
        "fp32_gemm_gflop_s": fp32_gemm(threads, repeats),
        "nbits_prefill": nbits_gemm(GEMM_M, threads, repeats),
        "nbits_decode": nbits_gemm(1, threads, repeats, DECODE_N),
        "per_node_us": per_node_us(threads, repeats),
    }


def floor_constants(doc: dict[str, Any]) -> dict[str, float]:
    """The rates a step's floor is priced at: the best ORT read bandwidth over working sets of 64 MiB and more
    (bytes/s), int8 GEMM ops/s and fp32 FLOP/s."""
    big = [b["gb_s"] for b in doc["read_bandwidth"] if b["mib"] >= 64] + [doc["nbits_decode"]["weight_gb_s"]]
    return {
        "bytes_per_s": max(big) * 1e9,
        "int8_ops_per_s": doc["int8_gemm_gop_s"] * 1e9,
        "fp32_flops_per_s": doc["fp32_gemm_gflop_s"] * 1e9,
        "per_node_s": doc["per_node_us"] * 1e-6,
    }


def markdown(doc: dict[str, Any], command: str) -> str:
    """The table: each number at its best (the floor's) and its median over the same kind of runs
    (``doc["median"]``, a second pass)."""
    m = doc["machine"]
    med = doc.get("median", doc)
    rows = []
    for b, bm in zip(doc["read_bandwidth"], med["read_bandwidth"], strict=True):
        rows.append(
            (
                f"read bandwidth, numpy sums over {b['mib']} MiB float32 on {doc['threads']} threads (1 thread)",
                f"{b['gb_s']:.1f} GB/s ({b['one_thread_gb_s']:.1f})",
                f"{bm['gb_s']:.1f} GB/s ({bm['one_thread_gb_s']:.1f})",
            )
        )
    rows += [
        (
            f"int8 GEMM, MatMulInteger u8 x s8, {GEMM_M}x{GEMM_K}x{GEMM_N}",
            f"{doc['int8_gemm_gop_s']:.0f} GOP/s",
            f"{med['int8_gemm_gop_s']:.0f} GOP/s",
        ),
        (
            f"int4 blocks, MatMulNBits level 4, {GEMM_M} rows",
            f"{doc['nbits_prefill']['gop_s']:.0f} GOP/s",
            f"{med['nbits_prefill']['gop_s']:.0f} GOP/s",
        ),
        (
            f"int4 blocks, MatMulNBits level 4, 1 row x {GEMM_K} x {DECODE_N} "
            f"({doc['nbits_decode']['weight_mib']:.0f} MiB of weights read)",
            f"{doc['nbits_decode']['weight_gb_s']:.1f} GB/s",
            f"{med['nbits_decode']['weight_gb_s']:.1f} GB/s",
        ),
        (
            f"fp32 GEMM, MatMul (prepacked), {GEMM_M}x{GEMM_K}x{GEMM_N}",
            f"{doc['fp32_gemm_gflop_s']:.0f} GFLOP/s",
            f"{med['fp32_gemm_gflop_s']:.0f} GFLOP/s",
        ),
        (
            "ORT per node, a chain of trivial Adds on one row",
            f"{doc['per_node_us']:.2f} µs",
            f"{med['per_node_us']:.2f} µs",
        ),
    ]
    lines = [
        "# What this CPU can do at most (the floor a step is priced at)",
        "",
        f"{m.get('processor')}, {m.get('cpu_count')} CPUs, VNNI: {doc['vnni']}; ONNX Runtime {doc['onnxruntime']}, "
        f"{doc['threads']} intra-op threads; the best of {doc['repeats']} runs, and the median of another "
        f"{doc['repeats']}. Load average at start {m.get('load_average')} (a shared machine: other jobs ran "
        f"meanwhile, which is why best and median differ). Command: `{command}`. {doc['date']}.",
        "",
        "| what | best | median |",
        "|---|---:|---:|",
        *(f"| {what} | {best} | {median} |" for what, best, median in rows),
        "",
        "A step's floor (`benchmarks/step_profile.py`) prices its bytes at the best read bandwidth of 64 MiB "
        "and more (numpy's or the one-row MatMulNBits'), its integer operations at the int8 GEMM rate (fp32 "
        "ones at the fp32 rate), and is the larger of the two; the per-node cost times the nodes a step runs "
        "is what the graph's size adds on top. Best-case rates make it a bound no step beats here; a step "
        "measured at the median of a loaded machine sits above it by that much more.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out-dir", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args(argv)
    doc = measure(args.threads, args.repeats)
    doc["median"] = measure(args.threads, args.repeats, "median")
    command = run_command("benchmarks.machine_floor", argv)
    doc["command"] = command
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "machine_floor.json").write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    text = markdown(doc, command)
    (args.out_dir / "machine_floor.md").write_text(text, encoding="utf-8")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

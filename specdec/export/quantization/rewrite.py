"""The graph rewrite every quantization strategy shares: find the linear layers and the embedding lookup, replace them.

The rewrite matches every graph weight row for row against the source tensors (exact fp32
equality), so it needs no knowledge of how the exporter fused projections (q|k|v and gate|up are
one weight each): a node holds runs of consecutive source rows, which it records on itself
(``sources.ROWS_KEY``, read back by ``nbits.graph_weights``). What replaces a node is the strategy's
(``strategies``); a Gemm/MatMul by a constant weight that matches no source tensor is an error (no
linear layer is left in fp32 unnoticed), and so is a source tensor no node uses.
"""

from __future__ import annotations

import hashlib
import os
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from specdec.export.quantization.blocks import BLOCK_SIZE, QuantizeError
from specdec.export.quantization.nbits import gather_block_quantized, gathers
from specdec.export.quantization.sources import Runs
from specdec.export.quantization.strategies import Plan, QuantizationStrategy
from specdec.runtime.backends.onnx_edit import GraphEditor


def _digest(row: np.ndarray) -> bytes:
    return hashlib.blake2b(np.ascontiguousarray(row).tobytes(), digest_size=16).digest()


class RowIndex:
    """Finds each graph weight row among the source tensors' rows (fp32 bytes equal)."""

    def __init__(self, reference: Mapping[str, np.ndarray]) -> None:
        self.reference = reference
        self.rows: dict[str, list[bytes]] = {name: [_digest(r) for r in w] for name, w in reference.items()}
        self.where: dict[bytes, list[tuple[str, int]]] = {}
        for name, digests in self.rows.items():
            for i, d in enumerate(digests):
                self.where.setdefault(d, []).append((name, i))

    def runs(self, weight: np.ndarray) -> Runs | None:
        """``weight`` as runs ``(source, start, stop)`` of consecutive source rows, or None if a row is unknown."""
        digests = [_digest(r) for r in weight]
        runs: Runs = []
        i = 0
        while i < len(digests):
            best: tuple[str, int, int] | None = None
            for name, start in self.where.get(digests[i], ()):
                source = self.rows[name]
                n = 0
                while i + n < len(digests) and start + n < len(source) and source[start + n] == digests[i + n]:
                    n += 1
                if best is None or n > best[2] - best[1]:
                    best = (name, start, start + n)
            if best is None:
                return None
            runs.append(best)
            i += best[2] - best[1]
        stacked = np.concatenate([self.reference[n][a:b] for n, a, b in runs])
        return runs if np.array_equal(stacked, weight) else None


def linear_weight(g: GraphEditor, node: Any) -> tuple[str, bool] | None:
    """(initializer name, whether it is stored [N, K]) of a Gemm/MatMul by a constant 2-D weight, else None."""
    if node.op_type not in ("Gemm", "MatMul") or len(node.input) < 2 or node.input[1] not in g.consts:
        return None
    if len(g.consts[node.input[1]].dims) != 2:
        return None
    if node.op_type == "MatMul":
        return node.input[1], False
    attrs = g.attrs(node)
    if attrs.get("transA", 0) or attrs.get("alpha", 1.0) != 1.0 or attrs.get("beta", 1.0) != 1.0:
        return None
    return node.input[1], bool(attrs.get("transB", 0))


@dataclass(frozen=True)
class Rewritten:
    """What ``rewrite_graph`` did: the manifest's summary of the graph, and the fp32 weights the new nodes compute
    where the plan could not tell them (``Linear.computed``), by source tensor."""

    summary: dict
    computed: dict[str, np.ndarray]


def rewrite_graph(path: str | os.PathLike, strategy: QuantizationStrategy, plan: Plan) -> Rewritten:
    """Rewrite the graph at ``path`` in place: every linear layer as ``strategy`` makes it, the embedding lookup a
    GatherBlockQuantized where ``plan`` has the table in blocks."""
    import onnx

    out = Path(path)
    proto = onnx.load(str(out))
    g = GraphEditor(proto, "quantize")
    index = RowIndex({**plan.reference, **plan.kept})
    computed: dict[str, np.ndarray] = {}
    used: set[str] = set()
    formats: Counter = Counter()
    gathered: str | None = None
    for node in list(g.graph.node):
        if plan.embedding is not None and plan.table is not None and gathered is None and gathers(g, node, plan.table):
            with g.in_place_of(node):
                gather_block_quantized(g, node, plan.embedding)
            gathered = plan.embedding.source
            continue
        found = linear_weight(g, node)
        if found is None:
            continue
        name, rows_first = found
        weight = g.array(name) if rows_first else g.array(name).T
        runs = index.runs(np.ascontiguousarray(weight, dtype=np.float32))
        if runs is None:
            raise QuantizeError(
                f"{out}: {node.op_type} {node.name!r} multiplies by {name}, which matches no "
                "linear weight of the model: not leaving it in fp32 unnoticed"
            )
        if all(n in plan.kept for n, _, _ in runs):
            continue  # left in fp32 on purpose (``WeightBlocks.fp32_tensors``)
        with g.in_place_of(node):
            linear = strategy.linear(g, node, weight, runs, plan)
        used.update(n for n, _, _ in runs)
        formats[linear.source_format] += 1
        if linear.computed is not None:
            at = 0
            for source, start, stop in runs:
                rows = computed.setdefault(source, np.zeros_like(plan.reference[source]))
                rows[start:stop] = linear.computed[at : at + stop - start]
                at += stop - start
    unused = [n for n in [*plan.blocks, *plan.integer] if n not in used]
    if unused:
        raise QuantizeError(f"{out}: no linear node of the graph uses {unused}")
    g.commit(sort=False)
    finished = GraphEditor(proto, "quantize")
    extra = strategy.finish(finished)
    finished.commit(sort=False)
    data = out.with_name(out.name + ".data")
    if data.exists():
        data.unlink()
    onnx.save_model(
        proto,
        str(out),
        save_as_external_data=True,
        all_tensors_to_one_file=True,
        location=data.name,
        size_threshold=1024,
    )
    if plan.embedding is not None and gathered is None:
        raise QuantizeError(f"{out}: no gather reads the embedding table")
    summary = {
        "linear_layers": sum(formats.values()),
        "formats": dict(sorted(formats.items())),
        "embedding": "fp32" if gathered is None or plan.embedding is None else f"{plan.embedding.bits}-bit {gathered}",
        "block_size": sorted({block.block_size for block in plan.blocks.values()}) or [BLOCK_SIZE],
        "accuracy_level": strategy.accuracy_level,
        "graph_bytes": out.stat().st_size + (data.stat().st_size if data.exists() else 0),
        **extra,
    }
    return Rewritten(summary, computed)


def one_linear(columns: int, rows: int, emit: Callable[[GraphEditor, Any], object], bias: Any = None) -> Any:
    """``y = x @ W^T (+ bias)`` over rows ``x [T, columns]`` as a model whose Gemm ``emit(g, gemm)`` replaced: one
    quantized layer alone, as the kernel tests and timings run it."""
    from onnx import TensorProto, helper, numpy_helper

    gemm = helper.make_node("Gemm", ["x", "w", *(["b"] if bias is not None else [])], ["y"], name="lin", transB=1)
    graph = helper.make_graph(
        [gemm],
        "one_linear",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["T", columns])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["T", rows])],
        [] if bias is None else [numpy_helper.from_array(np.asarray(bias, np.float32), "b")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])
    g = GraphEditor(model, "one_linear")
    gemm = model.graph.node[0]  # the graph's copy
    with g.in_place_of(gemm):
        emit(g, gemm)
    g.commit(sort=False)
    return model

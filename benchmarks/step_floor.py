"""The physical floor of one ragged step of an exported graph: the bytes it must move and the operations it must do.

Why: a step profile says where the time goes, not how much of it is necessary. A step must at least
read every weight once (the LM head and the offsets too, only for the rows that need them it
multiplies, but the whole weight is read), read each sequence's cached K/V once and do every
multiply-add of its linears and its attention. Priced at this machine's measured bandwidth and
throughput (``benchmarks/machine_floor.py``), that is a time no implementation on this CPU beats:

* ``bytes``: all weight bytes of the linear layers (codes, scales, zero points, offsets; the head's),
  the embedding rows gathered, and per sequence ``(past + n)`` cached K and V rows of every layer;
* ``int8_ops`` / ``fp32_ops``: 2 x the multiply-adds of every linear for its rows (the head for the logit
  rows only), integer where the kernel multiplies int8 activations (MatMulNBits at ``accuracy_level`` 4,
  MatMulInteger), fp32 where it does not (Gemm/MatMul, MatMulNBits at level 0); attention's ``QK^T`` and
  ``PV`` for each query row over its visible keys, in fp32;
* the floor is ``max(bytes / bandwidth, int8_ops / int8 rate + fp32_ops / fp32 rate)``.

Read from the graph's own nodes and initializer shapes (no weights loaded), so it prices what the
export holds, whichever quantization it took.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx

from specdec.runtime.graph_io import CACHE_INPUT
from specdec.runtime.packed import PackedBatch

_BYTES = {onnx.TensorProto.FLOAT: 4, onnx.TensorProto.FLOAT16: 2, onnx.TensorProto.INT8: 1, onnx.TensorProto.UINT8: 1}


@dataclass(frozen=True)
class Linear:
    """One linear layer of the graph as the floor sees it."""

    name: str
    weight_bytes: int
    macs_per_row: int
    integer: bool  # multiplies int8 activations
    head: bool  # the LM head: runs on the logit rows only


@dataclass(frozen=True)
class GraphCost:
    """What a graph's steps cost per row and per cached position."""

    linears: tuple[Linear, ...]
    embedding_row_bytes: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int

    def step(self, batch: PackedBatch, cache_bytes: int) -> dict[str, float]:
        """Bytes, int8 ops and fp32 ops of one step of ``batch`` over caches of ``cache_bytes`` per element."""
        rows, logit_rows = batch.num_tokens, int(batch.logits_indices.shape[0])
        weight = sum(lin.weight_bytes for lin in self.linears)
        int8 = fp32 = 0.0
        for lin in self.linears:
            ops = 2.0 * lin.macs_per_row * (logit_rows if lin.head else rows)
            int8, fp32 = (int8 + ops, fp32) if lin.integer else (int8, fp32 + ops)
        new = np.diff(batch.cu_seqlens.astype(np.int64))
        past = batch.past_lens.astype(np.int64)
        kv_rows = float((past + new).sum())
        kv = kv_rows * self.layers * self.kv_heads * self.head_dim * 2 * cache_bytes
        # each new row j of a sequence sees its past and at most j + 1 new rows (a chain; a tree sees fewer)
        visible = float(sum(n * p + n * (n + 1) / 2 for p, n in zip(past.tolist(), new.tolist())))
        attention = 2.0 * 2 * visible * self.heads * self.head_dim * self.layers
        return {
            "weight_bytes": float(weight),
            "kv_bytes": kv,
            "embedding_bytes": float(rows * self.embedding_row_bytes),
            "bytes": weight + kv + rows * self.embedding_row_bytes,
            "int8_ops": int8,
            "fp32_ops": fp32 + attention,
        }


def _size(init: onnx.TensorProto) -> int:
    return int(np.prod(init.dims, dtype=np.int64)) * _BYTES.get(init.data_type, 4)


def _width(node: onnx.NodeProto, inits: dict[str, onnx.TensorProto]) -> tuple[int, int] | None:
    """(K, N) of a linear node by a constant weight, None for any other node."""
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    if node.op_type == "MatMulNBits":
        return int(attrs["K"]), int(attrs["N"])
    if node.op_type in ("MatMulInteger", "MatMulIntegerToFloat", "Gemm", "MatMul") and len(node.input) > 1:
        weight = inits.get(node.input[1])
        if weight is None or len(weight.dims) != 2:
            return None
        k, n = (int(d) for d in weight.dims)
        return (n, k) if attrs.get("transB", 0) else (k, n)
    return None


def graph_cost(path: str | Path) -> GraphCost:
    """The linears, embedding and attention shape of the exported graph at ``path``.

    The LM head is the last linear whose output is as wide as the graph's logits.
    """
    model = onnx.load(str(path), load_external_data=False)
    inits = {i.name: i for i in model.graph.initializer}
    logits = next(o for o in model.graph.output if o.name == "logits")
    logit_width = logits.type.tensor_type.shape.dim[-1].dim_value
    found = [(node, _width(node, inits)) for node in model.graph.node]
    linears_found = [(node, kn) for node, kn in found if kn is not None]
    heads = [node.name for node, (_, n) in linears_found if n == logit_width]
    linears: list[Linear] = []
    for node, (k, n) in linears_found:
        weight = sum(_size(inits[name]) for name in node.input[1:] if name in inits)
        integer = node.op_type != "MatMulNBits" or _level(node) == 4
        integer = integer and node.op_type not in ("Gemm", "MatMul")
        linears.append(Linear(node.name, weight, k * n, integer, bool(heads) and node.name == heads[-1]))
    embedding_row = 0
    for node in model.graph.node:
        if node.op_type == "GatherBlockQuantized":
            data, scales = inits[node.input[0]], inits[node.input[2]]
            embedding_row = (_size(data) + _size(scales)) // int(data.dims[0])
        elif node.op_type in ("Gather", "GatherND") and node.input and node.input[0] in inits:
            table = inits[node.input[0]]
            if len(table.dims) == 2 and table.dims[0] > 1000:
                embedding_row = _size(table) // int(table.dims[0])
    cache = next(i for i in model.graph.input if i.name == CACHE_INPUT.format(layer=0, kind="key"))
    layers = sum(1 for i in model.graph.input if i.name.endswith(".key") and i.name.startswith("past_key_values."))
    _, kv_heads, _, head_dim = (d.dim_value for d in cache.type.tensor_type.shape.dim)
    heads_attr = next(
        int(onnx.helper.get_attribute_value(a))
        for node in model.graph.node
        if node.op_type == "RaggedTreeAttention"
        for a in node.attribute
        if a.name == "num_heads"
    )
    return GraphCost(tuple(linears), embedding_row, layers, heads_attr, int(kv_heads), int(head_dim))


def _level(node: onnx.NodeProto) -> int:
    return next((int(onnx.helper.get_attribute_value(a)) for a in node.attribute if a.name == "accuracy_level"), 0)


def floor_ms(cost: dict[str, float], rates: dict[str, float]) -> dict[str, float]:
    """The floor of a step's ``cost`` at ``rates`` (``machine_floor.floor_constants``), in ms, and its two parts."""
    memory = cost["bytes"] / rates["bytes_per_s"] * 1e3
    compute = (cost["int8_ops"] / rates["int8_ops_per_s"] + cost["fp32_ops"] / rates["fp32_flops_per_s"]) * 1e3
    return {"floor_ms": max(memory, compute), "memory_ms": memory, "compute_ms": compute}


def describe(costs: Sequence[Linear]) -> str:
    """One line: how many linears, their weight MB, how many multiply int8 activations."""
    weight = sum(lin.weight_bytes for lin in costs) / 1e6
    integer = sum(lin.integer for lin in costs)
    return f"{len(costs)} linears ({integer} on int8 activations), {weight:.1f} MB of weights"

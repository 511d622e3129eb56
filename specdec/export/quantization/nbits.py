"""Weight blocks in ONNX Runtime's contrib ops: a linear layer as ``MatMulNBits``, a table as ``GatherBlockQuantized``.

Why ``MatMulNBits``: it is the form ONNX Runtime's CPU kernels (MLAS ``SQNBitGemm``) run from the
packed blocks, so a decode step reads 4 or 8 bits per weight instead of 32. Why the embedding too:
the fp32 table of a large vocabulary outweighs all the 4-bit projections of a small model together,
and ``GatherBlockQuantized`` computes ``scale * (code - zero_point)`` in fp32, the arithmetic of
``BlockQuant.dequantize``, so a Q8_0 table gathers exactly the values the fp32 one held.

``accuracy_level`` 4 (int8 activation blocks) is what a graph ships with by default: MLAS's int8
kernels are the fast ones at every row count, and they are row-independent (a row's product is
bitwise the same alone or beside other rows), as are the prepacked fp32 ``Gemm`` of the Q4_1 offsets
and the per-row norms; so a row's logits do not depend on its step and greedy ``ems`` equals greedy
``ar`` on the same graph bit for bit (``tests/test_batch_invariance.py``). What rounding activations
costs is quality against the fp32 export. Level 0 (fp32 activations) computes the stored weights
exactly, but MLAS multiplies one row with a GEMV and several by unpacking the weights to an fp32
GEMM, whose sums round differently (``test_fp32_activations_are_not_batch_invariant``), and it has
no fp32-activation kernel for 8-bit weights (``WeightBlocks.fp32_tensors`` keeps those fp32). A
graph is checked at level 0, where it computes its stored weights exactly, so the check tests the
graph, not the rounding. Row independence at level 4 holds for blocks of up to 32
(``onnxruntime.ROW_INVARIANT_BLOCK``): for wider blocks MLAS multiplies a lone row with another kernel than
several rows (faster, and its sums round differently), so ``OrtBackend`` runs no one-row step on such a graph
(its ``row_floor``) and it stays batch-invariant (``benchmarks/results/block_sizes.md``). Measured:
``benchmarks/results/quantize.md``, ``benchmarks/results/quantization_choices.md``.

Q4_1's offsets ``m'`` run beside the op, a ``ReduceSum`` over each 32-input block and an fp32
product with 1/32 of the weight's columns; why not the op's float zero points ``-m/d``: ONNX
Runtime's CPU kernel does not pre-pack such a weight and de-quantizes it to fp32 on every call.
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

from specdec.export.quantization.blocks import (
    BlockQuant,
    QuantizeError,
    pack_codes,
    pack_zero_points,
    unpack_codes,
    unpack_zero_points,
)
from specdec.export.quantization.sources import FORMAT_KEY, ROWS_KEY, Runs, node_metadata
from specdec.runtime.backends.onnx_edit import MS_DOMAIN, GraphEditor

#: MatMulNBits ``accuracy_level``: fp32 activations (the stored weights computed exactly: the level a graph is
#: checked at) and int8 activation blocks (fast and row-independent: what a graph ships with by default)
FP32_ACTIVATIONS, INT8_ACTIVATIONS = 0, 4
CHECK_LEVEL = FP32_ACTIVATIONS
#: ``--quantize-activations`` choices
ACTIVATIONS = {"fp32": FP32_ACTIVATIONS, "int8": INT8_ACTIVATIONS}
OFFSETS_KEY = "specdec.quantize.offsets"  # metadata: the initializer of a node's Q4_1 offsets (``graph_weights``)


def matmul_nbits(g: GraphEditor, node: Any, block: BlockQuant, runs: Runs, accuracy_level: int) -> None:
    """Emit the MatMulNBits node (and the Q4_1 offset correction) computing the linear ``node`` from ``block``."""
    base = node.name or node.output[0]
    n = block.scales.shape[0]
    qweight = g.initializer(pack_codes(block.codes, block.bits), f"{base}.qweight")
    scales = g.initializer(block.scales.astype(np.float32), f"{base}.scales")
    inputs = [node.input[0], qweight, scales, "", "", ""]
    if block.zero_points is not None:
        inputs[3] = g.initializer(pack_zero_points(block.zero_points, block.bits), f"{base}.zero_points")
    if node.op_type == "Gemm" and len(node.input) > 2 and node.input[2]:
        inputs[5] = node.input[2]  # a bias [N]
    while inputs[-1] == "":
        inputs.pop()
    output = node.output[0] if block.offsets is None else f"{base}.nbits"
    meta = node_metadata(runs, block.source)
    if block.offsets is not None:
        meta[OFFSETS_KEY] = f"{base}.offsets"
    g.add(
        "MatMulNBits",
        *inputs,
        outputs=[output],
        name=f"{base}.nbits",
        domain=MS_DOMAIN,
        metadata=meta,
        K=block.columns,
        N=n,
        bits=block.bits,
        block_size=block.block_size,
        accuracy_level=accuracy_level,
    )
    if block.offsets is not None:
        _add_offsets(g, node, block, base, output)


def _add_offsets(g: GraphEditor, node: Any, block: BlockQuant, base: str, product: str) -> None:
    """``node``'s output = ``product`` + (the sums of each block of its input) @ offsets^T."""
    k_blocks = block.scales.shape[1]
    if block.columns != k_blocks * block.block_size:
        raise QuantizeError(f"{base}: block offsets need whole blocks of inputs")
    g.initializer(np.array([-1, k_blocks, block.block_size], np.int64), f"{base}.block_shape")
    g.initializer(np.array([-1], np.int64), f"{base}.block_axis")
    assert block.offsets is not None  # the caller's condition
    g.initializer(np.ascontiguousarray(block.offsets.T, np.float32), f"{base}.offsets")

    def add(op: str, *inputs: str, suffix: str, out: str | None = None, **attrs: Any) -> str:
        return g.add(op, *inputs, outputs=[out or f"{base}.{suffix}"], name=f"{base}.{suffix}", **attrs)

    sums = add(
        "ReduceSum",
        add("Reshape", node.input[0], f"{base}.block_shape", suffix="blocks"),
        f"{base}.block_axis",
        suffix="block_sums",
        keepdims=0,
    )
    if node.op_type == "Gemm":  # 2-D rows: one Gemm adds the offsets to the product (fewest kernel calls)
        add("Gemm", sums, f"{base}.offsets", product, suffix="add_offsets", out=node.output[0])
        return
    rows = add("MatMul", sums, f"{base}.offsets", suffix="offset_rows")  # a MatMul's input may have leading dims
    offset = add("Reshape", rows, add("Shape", product, suffix="shape"), suffix="offset")
    add("Add", product, offset, suffix="add_offsets", out=node.output[0])


def gathers(g: GraphEditor, node: Any, table: np.ndarray) -> bool:
    """Whether ``node`` gathers whole rows of a constant equal to ``table`` (the exporter's embedding lookup)."""
    if node.op_type not in ("Gather", "GatherND") or not node.input or node.input[0] not in g.consts:
        return False
    attrs = g.attrs(node)
    if list(g.consts[node.input[0]].dims) != list(table.shape) or attrs.get("axis", 0) or attrs.get("batch_dims", 0):
        return False
    return bool(np.array_equal(g.array(node.input[0]), table))


def gather_block_quantized(g: GraphEditor, node: Any, block: BlockQuant) -> None:
    """Emit the GatherBlockQuantized node replacing the embedding lookup ``node``.

    A GatherND's indices end in a unit axis (one index per row) that the op does not take: squeezed.
    """
    base = node.name or node.output[0]
    codes = block.codes.reshape(block.rows, -1)[:, : block.columns]
    data = g.initializer(np.ascontiguousarray(codes if block.bits == 8 else pack_codes(codes, 4)), f"{base}.qdata")
    scales = g.initializer(block.scales.astype(np.float32), f"{base}.scales")
    zero_points = g.initializer(pack_zero_points(block.zero_point_values(), block.bits), f"{base}.zero_points")
    indices = node.input[1]
    if node.op_type == "GatherND":
        axis = g.initializer(np.array([-1], np.int64), f"{base}.last_axis")
        indices = g.add("Squeeze", indices, axis, outputs=[f"{base}.indices"], name=f"{base}.indices")
    g.add(
        "GatherBlockQuantized",
        data,
        indices,
        scales,
        zero_points,
        outputs=[node.output[0]],
        name=f"{base}.blocks",
        domain=MS_DOMAIN,
        metadata={FORMAT_KEY: block.source},
        bits=block.bits,
        block_size=block.block_size,
        gather_axis=0,
        quantize_axis=1,
    )


def set_level(g: GraphEditor, level: int) -> None:
    """Set every MatMulNBits node's ``accuracy_level`` in the graph ``g`` edits."""
    for node in g.nodes("MatMulNBits", MS_DOMAIN):
        g.set_attr(node, "accuracy_level", level)


def set_accuracy_level(graph: str | os.PathLike, level: int) -> None:
    """Set every MatMulNBits node's ``accuracy_level`` in the file ``graph`` (its weights stay as they are)."""
    import onnx

    proto = onnx.load(str(graph), load_external_data=False)
    set_level(GraphEditor(proto, "quantize"), level)
    onnx.save_model(proto, str(graph))


def embedding_weights(path: str | os.PathLike) -> tuple[np.ndarray, str] | None:
    """The de-quantized table of the graph's GatherBlockQuantized and its format, or None if it gathers fp32."""
    import onnx

    g = GraphEditor(onnx.load(str(path)), "read")
    for node in g.nodes("GatherBlockQuantized", MS_DOMAIN):
        bits = int(g.attr(node, "bits"))
        codes = unpack_codes(g.array(node.input[0]), bits)
        scales = g.array(node.input[2])
        rows, k_blocks = scales.shape
        columns, size = codes.shape[1], int(g.attr(node, "block_size"))
        padded = np.pad(codes, ((0, 0), (0, k_blocks * size - columns))).reshape(rows, k_blocks, size)
        zps = unpack_zero_points(g.array(node.input[3]), bits, k_blocks)
        source = g.metadata(node).get(FORMAT_KEY, "?")
        block = BlockQuant(bits, padded, scales, zps, None, columns, source)
        return block.dequantize(), block.source
    return None


def graph_weights(path: str | os.PathLike) -> dict[str, tuple[np.ndarray, Runs, str]]:
    """Every MatMulNBits node's de-quantized weight ``[N, K]``, the source rows it holds and their format."""
    import onnx

    g = GraphEditor(onnx.load(str(path)), "read")
    out = {}
    for node in g.nodes("MatMulNBits", MS_DOMAIN):
        attrs = g.attrs(node)
        bits, n, columns = int(attrs["bits"]), int(attrs["N"]), int(attrs["K"])
        codes = unpack_codes(g.array(node.input[1]), bits)  # [N, k_blocks, block_size]
        scales = g.array(node.input[2]).reshape(n, -1)
        k_blocks = scales.shape[1]
        has_zps = len(node.input) > 3 and node.input[3]
        zps = unpack_zero_points(g.array(node.input[3]), bits, k_blocks) if has_zps else None
        meta = g.metadata(node)
        offsets = g.array(meta[OFFSETS_KEY]).T if OFFSETS_KEY in meta else None
        block = BlockQuant(bits, codes, scales, zps, offsets, columns, meta.get(FORMAT_KEY, "?"))
        runs = [tuple(r) for r in json.loads(meta.get(ROWS_KEY, "[]"))]
        out[node.name] = (block.dequantize(), runs, block.source)
    return out

"""A linear layer for ONNX Runtime's integer GEMM: int8 weights per output channel, int8 activations per row.

Each decoder-layer linear of a ``--quantize w8a8`` graph (``strategies.W8A8``) becomes a chain:
the input smoothed, rounded to uint8 with one scale per row (per token), multiplied by
``MatMulInteger`` (MLAS's QGEMM, u8 x s8) in exact int32 and scaled back to fp32. Why a third form
beside the blocks (``nbits``): MatMulNBits multiplies blocks of 32 inputs, each with its own pair of
scales, while QGEMM is one integer dot product over all K inputs, several times faster on the rows
of a prefill or a batch of verification chains, which are compute-bound; a one-row decode step,
bound by reading the weights and by per-node overhead, is faster on ``int4``. Measured:
``benchmarks/results/quantize.md``, ``benchmarks/results/step_profile_w8a8.md``.

What it costs, and how much is bought back:

* The weights are rounded again: a GGUF source's own blocks become per-channel int8 codes, so this
  export does not hold the file's weights (``int4`` does); the second rounding is at most half a step
  of 1/127 of a row's range.
* One activation scale per token over all K inputs instead of one per 32: a few outlier input
  channels set every row's scale, and the other channels keep few levels. SmoothQuant (Xiao et al.,
  2023) moves part of each channel's range into the weights, exactly in real arithmetic:
  ``x @ W^T = (x / s) @ (W * s)^T`` with ``s_k = max|x_k|^a / max|W_k|^(1-a)``, from the largest input
  each channel saw on calibration prompts (``calibration``).

Exactness: the integer products are exact and every other op of the chain reads its own row
(absolute max, scale, rounding), so a row's output does not depend on the rows beside it, bit for
bit: greedy ``ems`` equals greedy ``ar`` on this graph as on the block-quantized ones
(``tests/test_batch_invariance.py``). One caveat of the kernel, not of the graph: on an x86 CPU
without VNNI, MLAS's u8 x s8 kernel sums pairs of products in int16 with saturation
(``vpmaddubsw``), which can clip large products there (``OrtBackend`` warns: ``onnxruntime.has_vnni``).
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from specdec.runtime.backends.onnx_edit import MS_DOMAIN, GraphEditor

#: SmoothQuant's migration strength (0.5 splits each channel's range evenly between activations and weights); the
#: sweep that chose it: ``benchmarks/results/quantization_choices.md``
SMOOTH_ALPHA = 0.65
#: the activation codes are uint8 around this zero point (MLAS's fast kernel is u8 x s8); weights are symmetric int8
ZERO_POINT = 128
TAG = "w8a8"  # the names of what every chain of a graph shares
TOKEN_ROWS, LOGIT_ROWS = "input_ids", "logits_indices"  # graph inputs with one entry per row: a layer's, the head's
CHAIN_KEY = "specdec.quantize.w8a8"  # metadata on each chain's product node: the chain's tensors (``chains``)
PRODUCT_OP = "MatMulIntegerToFloat"  # a chain's integer GEMM (com.microsoft): int32 products scaled per channel
_FLOOR = 1e-5  # a channel never seen active, or a zero weight column, smoothed as if this small
_TINY = 1e-30  # an all-zero row gets this scale instead of 0 (its codes are then all the zero point)


@dataclass(frozen=True)
class IntegerLinear:
    """A linear weight ``[N, K]`` as ``W ~ codes^T * scales[:, None] * unsmooth[None, :]``.

    ``codes`` int8 ``[K, N]`` (MatMulInteger's B), ``scales`` fp32 ``[N]`` per output channel,
    ``unsmooth`` fp32 ``[K]``: the factor the graph multiplies its input by before rounding it (1 / s).
    """

    codes: np.ndarray
    scales: np.ndarray
    unsmooth: np.ndarray

    def effective(self) -> np.ndarray:
        """The fp32 weight ``[N, K]`` the chain multiplies by, up to the rounding of its activations."""
        return (self.codes.T.astype(np.float32) * self.scales[:, None]) * self.unsmooth[None, :]


def smoothing(maxima: np.ndarray, weight: np.ndarray, alpha: float = SMOOTH_ALPHA) -> np.ndarray:
    """SmoothQuant's per-input-channel divisor ``s [K]`` for ``weight [N, K]`` and the inputs' ``maxima [K]``."""
    act = np.maximum(np.asarray(maxima, np.float64), _FLOOR)
    wmax = np.maximum(np.abs(weight).max(axis=0).astype(np.float64), _FLOOR)
    return np.maximum(act**alpha / wmax ** (1 - alpha), _FLOOR).astype(np.float32)


def quantize_linear(weight: np.ndarray, smooth: np.ndarray) -> IntegerLinear:
    """Round ``weight * smooth`` to symmetric int8, one scale per output channel (row of ``weight``)."""
    scaled = np.asarray(weight, np.float32) * smooth[None, :]
    scales = np.maximum(np.abs(scaled).max(axis=1), _TINY) / np.float32(127)
    codes = np.clip(np.rint(scaled / scales[:, None]), -127, 127).astype(np.int8)
    unsmooth = (np.float32(1) / smooth).astype(np.float32)
    return IntegerLinear(np.ascontiguousarray(codes.T), scales.astype(np.float32), unsmooth)


def _zero_points(g: GraphEditor, rows: str) -> str:
    """The activations' zero points ``uint8 [T]``, one per row of ``rows`` (a per-axis QuantizeLinear wants one per
    row), and the constants every chain reads (named under ``TAG``): emitted by the first chain over ``rows``, read by
    all of them (the LM head's rows are the logit rows, the layers' the step's tokens)."""
    from onnx import TensorProto, helper

    suffix = "" if rows == TOKEN_ROWS else f".{rows}"
    zero_points = f"{TAG}.zero_points{suffix}"
    if (TAG,) not in g.shared:
        g.initializer(np.array([-1], np.int64), f"{TAG}.last_axis")
        g.initializer(np.float32(1 / 127), f"{TAG}.inv127")
        g.initializer(np.float32(_TINY), f"{TAG}.tiny")
        g.initializer(np.uint8(ZERO_POINT), f"{TAG}.zp")
        g.initializer(np.ones([1], np.float32), f"{TAG}.one")  # the product's activation scale: rows rescale after
        g.shared[(TAG,)] = True
    if (TAG, rows) not in g.shared:
        tokens = g.add("Shape", rows, outputs=[f"{TAG}.tokens{suffix}"], name=f"{TAG}.tokens{suffix}", start=0, end=1)
        value = helper.make_tensor(f"{TAG}.zp", TensorProto.UINT8, [1], [ZERO_POINT])
        g.add("ConstantOfShape", tokens, outputs=[zero_points], name=zero_points, value=value)
        g.shared[TAG, rows] = zero_points
    return zero_points


def integer_chain(
    g: GraphEditor, node: Any, linear: IntegerLinear, meta: Mapping[str, str], rows: str = TOKEN_ROWS
) -> None:
    """Emit the chain computing the linear ``node`` (a Gemm of rows ``[T, K]``): smooth, round per row, integer GEMM,
    rescale. A per-axis (axis 0) QuantizeLinear holds the row scales: the exporter's opset has no blocked one.

    The product is ``MatMulIntegerToFloat``: MLAS's integer GEMM with the channel scales applied as it writes
    its output, so the rows are rescaled by one multiply by their scale, not by a pass of int32 to float and one
    more by the channel scales (a pass over ``[T, N]`` fewer; ``benchmarks/results/step_profile_w8a8.md``).
    ``fold_smoothing`` later moves the input's ``1 / s`` into the tensor's producer where it can.

    ``rows``: a tensor with one entry per row along its first axis (a step's ``input_ids``).
    """
    base = f"{node.name or node.output[0]}.w8a8"
    if node.op_type != "Gemm" or (len(node.input) > 2 and node.input[2]):
        raise ValueError(f"{base}: w8a8 rewrites a Gemm of 2-D rows without a bias, not this {node.op_type}")
    zero_points = _zero_points(g, rows)
    for key in ("codes", "scales", "unsmooth"):
        g.initializer(getattr(linear, key), f"{base}.{key}")
    steps: list[tuple[str, list[str], str, dict[str, Any]]] = [
        ("Mul", [node.input[0], f"{base}.unsmooth"], "x", {}),
        ("Abs", [f"{base}.x"], "abs", {}),
        ("ReduceMax", [f"{base}.abs", f"{TAG}.last_axis"], "amax", {"keepdims": 1}),
        ("Mul", [f"{base}.amax", f"{TAG}.inv127"], "scale0", {}),
        ("Max", [f"{base}.scale0", f"{TAG}.tiny"], "row", {}),  # [T, 1]
        ("Reshape", [f"{base}.row", f"{TAG}.last_axis"], "row_scale", {}),  # [T]: QuantizeLinear's per-axis scale
        ("QuantizeLinear", [f"{base}.x", f"{base}.row_scale", zero_points], "codes_x", {"axis": 0}),
        (
            "MatMulIntegerToFloat",
            [f"{base}.codes_x", f"{base}.codes", f"{TAG}.one", f"{base}.scales", f"{TAG}.zp"],
            "acc",
            {"domain": MS_DOMAIN},
        ),
        ("Mul", [f"{base}.acc", f"{base}.row"], "y", {}),
    ]
    chain = {
        "input": node.input[0],
        "output": node.output[0],
        "codes": f"{base}.codes",
        "scales": f"{base}.scales",
        "unsmooth": f"{base}.unsmooth",
        "product": f"{base}.acc",
        "nodes": [f"{base}.{suffix}" for _, _, suffix, _ in steps],
    }
    for op, inputs, suffix, attrs in steps:
        out = node.output[0] if suffix == "y" else f"{base}.{suffix}"
        metadata = {CHAIN_KEY: json.dumps(chain), **meta} if op == PRODUCT_OP else None
        g.add(op, *inputs, outputs=[out], name=f"{base}.{suffix}", metadata=metadata, **attrs)


def fold_smoothing(g: GraphEditor) -> int:
    """Move each chain's ``1 / s`` into the producer of its input where that is exact in real arithmetic; how many.

    Why: the multiply is a pass over the chain's ``[T, K]`` input (and a node) per linear per step. Two producers
    take it: an RMSNorm's weight ``w * normed`` read by this chain alone (q|k|v, gate|up: the weight becomes
    ``w / s``), and the ``up`` half of a gate|up chain whose ``silu(gate) * up`` this chain alone reads (``down``:
    up's channel scales become ``scales / s``). The attention output (``o``) mixes heads that share a kv head,
    so its multiply stays. A folded chain keeps ``unsmooth`` as ones (its effective weight is then what it
    multiplies by; its metadata's ``unsmooth`` is null); ``Linear.computed`` keeps the original factoring, equal in
    real arithmetic.
    """
    folded = 0
    by_name = {node.name: node for node in g.graph.node}
    for chain in chains(g):
        mul = by_name.get(chain["nodes"][0])
        if mul is None or not mul.name.endswith(".x") or len(g.consumers.get(chain["input"], [])) != 1:
            continue
        unsmooth = g.array(chain["unsmooth"])
        if not (_fold_into_norm(g, chain["input"], unsmooth) or _fold_into_up(g, chain["input"], unsmooth)):
            continue
        for reader in g.consumers.get(mul.output[0], []):  # Abs and QuantizeLinear read the input itself now
            for i, name in enumerate(reader.input):
                if name == mul.output[0]:
                    reader.input[i] = chain["input"]
        g.remove(mul)
        updated = {key: value for key, value in chain.items() if key != "meta"}
        updated["nodes"], updated["unsmooth"] = chain["nodes"][1:], None
        entry = next(p for p in by_name[chain["product"]].metadata_props if p.key == CHAIN_KEY)
        entry.value = json.dumps(updated)
        folded += 1
    return folded


def _fold_into_norm(g: GraphEditor, x: str, unsmooth: np.ndarray) -> bool:
    """``x = Mul(w, normed)`` with a constant ``w [K]``: x's producer multiplies by ``w * unsmooth`` instead."""
    norm = g.node_of(x, "Mul")
    if norm is None:
        return False
    for i, name in enumerate(norm.input):
        if name in g.consts and list(g.consts[name].dims) == [unsmooth.size]:
            weight = (g.array(name).astype(np.float32) * unsmooth).astype(np.float32)
            norm.input[i] = g.initializer(weight, f"{x}.{TAG}.folded_weight")
            return True
    return False


def _fold_into_up(g: GraphEditor, x: str, unsmooth: np.ndarray) -> bool:
    """``x = Mul(silu, up)``, ``up`` the second half of a gate|up chain's ``Split``: up's channel scales take it."""
    product = g.node_of(x, "Mul")
    for up in product.input if product is not None else ():
        split = g.node_of(up, "Split")
        if split is None or len(split.output) != 2 or split.output[1] != up or len(g.consumers.get(up, [])) != 1:
            continue
        source = next((c for c in chains(g) if c["output"] == split.input[0]), None)
        scales = g.array(source["scales"]) if source is not None else None
        if scales is None or scales.size != 2 * unsmooth.size or int(g.attr(split, "axis", 0)) not in (-1, 1):
            continue
        sizes = g.const_value(split.input[1]) if len(split.input) > 1 and split.input[1] else None
        if sizes is not None and list(sizes) != [unsmooth.size, unsmooth.size]:
            continue
        scaled = scales.copy()
        scaled[unsmooth.size :] *= unsmooth
        assert source is not None  # scales were found on it
        _set_initializer(g, source["scales"], scaled.astype(np.float32))
        return True
    return False


def _set_initializer(g: GraphEditor, name: str, value: np.ndarray) -> None:
    """Give the initializer ``name`` the value ``value`` (same name, so every reader sees it)."""
    from onnx import numpy_helper

    g.consts[name].CopyFrom(numpy_helper.from_array(value, name))


def chains(g: GraphEditor) -> list[dict[str, Any]]:
    """Every w8a8 chain of the graph ``g`` reads: its tensors' names and its node's metadata."""
    out = []
    for node in g.nodes(PRODUCT_OP, MS_DOMAIN):
        meta = g.metadata(node)
        if CHAIN_KEY in meta:
            out.append({**json.loads(meta[CHAIN_KEY]), "meta": meta})
    return out


def integer_weights(g: GraphEditor) -> dict[str, IntegerLinear]:
    """Each chain's ``IntegerLinear``, by the name of its product node (the graph with its weights loaded)."""
    out = {}
    for chain in chains(g):
        codes = g.array(chain["codes"])
        unsmooth = g.array(chain["unsmooth"]) if chain["unsmooth"] else np.ones(codes.shape[0], np.float32)
        out[chain["product"]] = IntegerLinear(codes, g.array(chain["scales"]), unsmooth)
    return out


def with_fp32_products(g: GraphEditor) -> None:
    """Replace every chain by a Gemm by its effective weight (to be committed with the rest of ``g``'s edit).

    Why: the export's tight check (``quantize_and_validate``) tests the graph's wiring and stored
    weights without the rounding of activations, as the block-quantized graphs are checked at fp32
    activations.
    """
    weights = integer_weights(g)
    by_name = {node.name: node for node in g.graph.node}
    for chain in chains(g):
        name = chain["product"]
        *inner, last = (by_name[n] for n in chain["nodes"])
        for node in inner:
            g.remove(node)
        with g.in_place_of(last):
            weight = g.initializer(weights[name].effective(), f"{name}.effective")
            g.add("Gemm", chain["input"], weight, outputs=[chain["output"]], name=f"{name}.fp32", transB=1)


@contextmanager
def fp32_product_copy(graph: str | os.PathLike, edit: Callable[[GraphEditor], None]) -> Iterator[Path]:
    """A temporary copy of ``graph`` (beside it, with the small files of its directory: config, head token ids)
    with ``with_fp32_products`` and then ``edit`` applied."""
    import shutil

    import onnx

    proto = onnx.load(str(graph))
    g = GraphEditor(proto, "check")
    with_fp32_products(g)
    edit(g)
    g.commit(sort=False)
    with tempfile.TemporaryDirectory(dir=Path(graph).parent, prefix="check-") as tmp:
        for item in Path(graph).parent.glob("*.json"):
            shutil.copy(item, tmp)
        checked = Path(tmp) / "model.onnx"
        onnx.save_model(proto, str(checked), save_as_external_data=True, location="model.onnx.data")
        yield checked

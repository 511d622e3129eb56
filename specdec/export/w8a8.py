"""W8A8 linear layers for ONNX Runtime's integer GEMM (``specdec-export --quantize w8a8``).

Each decoder-layer linear becomes int8 weights with one scale per output channel and int8
activations with one scale per row (per token), multiplied by ``MatMulInteger`` (MLAS's QGEMM,
u8 x s8) in exact int32 and scaled back to fp32. Why a third form beside the block-quantized
``int4``/``int8`` (``specdec.export.quantize``): MatMulNBits multiplies blocks of 32 inputs, each
with its own pair of scales, and on this 2-core machine runs a prefill at ~240 GOP/s; QGEMM, one
integer dot product over all K inputs, runs the same rows at ~700 (VNNI). A prefill and a batch of
verification chains are compute-bound, so that is their speed, while a one-row decode step, bound
by reading the weights and by per-node overhead, is faster on ``int4``
(``benchmarks/results/step_profile_w8a8.md``, ``benchmarks/results/edge_cpu.md``).

What it costs, and how much is bought back:

* The weights are rounded again: a GGUF source's own blocks become per-channel int8 codes, so this
  export does not hold the file's weights (``int4`` does); the second rounding is at most half a step
  of 1/127 of a row's range.
* One activation scale per token over all K inputs instead of one per 32: a few outlier input
  channels set every row's scale, and the other channels keep few levels. SmoothQuant (Xiao et al.,
  2023) moves part of each channel's range into the weights, exactly in real arithmetic:
  ``x @ W^T = (x / s) @ (W * s)^T`` with ``s_k = max|x_k|^a / max|W_k|^(1-a)``, ``a = SMOOTH_ALPHA`` (0.65),
  from the largest input each channel saw on calibration prompts (the distillation's built-in chat
  prompts, none of the benchmarks' held-out ones: ``calibration_ids``). Held-out perplexity and
  agreement with the fp32 export against ``int4``: ``benchmarks/results/edge_cpu.md``.

Exactness: the integer products are exact and every other op of the chain reads its own row
(absolute max, scale, rounding), so a row's output does not depend on the rows beside it, bit for
bit: greedy ``ems`` equals greedy ``ar`` on this graph as on the block-quantized ones
(``tests/test_batch_invariance.py``). One caveat of the kernel, not of the graph: on an x86 CPU
without VNNI, MLAS's u8 x s8 kernel sums pairs of products in int16 with saturation
(``vpmaddubsw``), which can clip large products there (``OrtBackend`` warns: ``onnxruntime.has_vnni``).

The LM head and the embedding table stay as ``--quantize int8`` makes them (MatMulNBits over the
source's blocks): the head multiplies only the rows that need logits, and the table is gathered.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

#: SmoothQuant's migration strength (0.5 would split each channel's range evenly between activations and weights).
#: 0.65, measured on SmolLM2 (next-token agreement with the fp32 export): in a torch simulation over five held-out
#: docstrings 92.8 / 93.1 / 89.7 % at 0.5 / 0.65 / 0.8; on the real graph along the edge benchmark's fp32
#: answers 95.1 / 96.2 / 96.4 / 94.5 / 94.8 % at 0.5 / 0.6 / 0.65 / 0.7 / 0.8 (2026-12-06; at 0.5 one of the
#: main job's answers fell into a loop that 0.65 avoids)
SMOOTH_ALPHA = 0.65
#: chat prompts whose activations calibrate the smoothing (``calibration_ids``)
CALIBRATION_PROMPTS = 64
#: the activation codes are uint8 around this zero point (MLAS's fast kernel is u8 x s8); weights are symmetric int8
ZERO_POINT = 128
CHAIN_KEY = "specdec.quantize.w8a8"  # metadata on each MatMulInteger: the chain's tensors (``chains``)
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


# -- calibration -------------------------------------------------------------------------------------


def calibration_ids(tokenizer: Any | None, vocab_size: int, n: int = CALIBRATION_PROMPTS) -> list[list[int]]:
    """Token sequences to calibrate on: the first ``n`` built-in distillation prompts in the chat template.

    Without a tokenizer (a tiny random model), ``n`` random sequences of 32 ids, seeded: such a
    model's activations have no outlier channels to learn from text.
    """
    if tokenizer is None:
        rng = np.random.default_rng(0)
        return [rng.integers(0, vocab_size, 32).tolist() for _ in range(n)]
    from specdec.distill.prompts import builtin_prompts

    out = []
    for prompt in builtin_prompts()[:n]:
        if getattr(tokenizer, "chat_template", None):
            ids = tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True
            )
            ids = ids["input_ids"] if isinstance(ids, Mapping) else ids
        else:
            ids = tokenizer(prompt).input_ids
        out.append([int(i) for i in ids])
    return out


def activation_maxima(model: Any, sequences: Sequence[Sequence[int]], names: Sequence[str]) -> dict[str, np.ndarray]:
    """The largest ``|input|`` of each input channel of the linear layers ``names`` (weight names) over ``sequences``.

    Runs the transformers twin of ``model`` (``LoadedModel.to_hf``) with a hook on each layer.
    """
    import torch

    hf = model.to_hf()
    modules = dict(hf.named_modules())
    maxima: dict[str, torch.Tensor] = {}

    def hook(name: str) -> Any:
        def record(_module: Any, inputs: tuple[Any, ...]) -> None:
            seen = inputs[0].detach().abs().reshape(-1, inputs[0].shape[-1]).amax(dim=0).float()
            maxima[name] = seen if name not in maxima else torch.maximum(maxima[name], seen)

        return record

    handles = [modules[name.removesuffix(".weight")].register_forward_pre_hook(hook(name)) for name in names]
    try:
        with torch.no_grad():
            for ids in sequences:
                hf(torch.tensor([list(ids)], dtype=torch.long))
    finally:
        for handle in handles:
            handle.remove()
    return {name: maxima[name].numpy() for name in names}


# -- the graph -----------------------------------------------------------------------------------------


def row_zero_points(input_ids: str, tag: str) -> tuple[list[Any], str]:
    """Nodes making the activations' zero points ``uint8 [T]`` (a per-axis QuantizeLinear wants one per row).

    Shared by every chain: each linear of a decoder step multiplies the step's T token rows.
    """
    from onnx import TensorProto, helper

    nodes = [
        helper.make_node("Shape", [input_ids], [f"{tag}.tokens"], name=f"{tag}.tokens", start=0, end=1),
        helper.make_node(
            "ConstantOfShape",
            [f"{tag}.tokens"],
            [f"{tag}.zero_points"],
            name=f"{tag}.zero_points",
            value=helper.make_tensor(f"{tag}.zp", TensorProto.UINT8, [1], [ZERO_POINT]),
        ),
    ]
    return nodes, f"{tag}.zero_points"


def shared_constants(tag: str) -> list[Any]:
    """The scalars every chain reads (``integer_nodes``)."""
    from onnx import numpy_helper

    return [
        numpy_helper.from_array(np.array([-1], np.int64), f"{tag}.last_axis"),
        numpy_helper.from_array(np.float32(1 / 127), f"{tag}.inv127"),
        numpy_helper.from_array(np.float32(_TINY), f"{tag}.tiny"),
        numpy_helper.from_array(np.uint8(ZERO_POINT), f"{tag}.zp"),
    ]


def integer_nodes(
    node: Any, linear: IntegerLinear, tag: str, zero_points: str, meta: Mapping[str, str]
) -> tuple[list[Any], list[Any]]:
    """The chain replacing the linear ``node`` (a Gemm of rows ``[T, K]``): smooth, round per row, integer GEMM,
    rescale. Per-axis (axis 0) Quantize/DequantizeLinear hold the row scales: the exporter's opset has no blocked ones.

    ``tag`` names the constants of ``shared_constants``, ``zero_points`` the tensor of ``row_zero_points``.
    """
    from onnx import helper, numpy_helper

    base = f"{node.name or node.output[0]}.w8a8"
    if node.op_type != "Gemm" or (len(node.input) > 2 and node.input[2]):
        raise ValueError(f"{base}: w8a8 rewrites a Gemm of 2-D rows without a bias, not this {node.op_type}")
    tensors = [
        numpy_helper.from_array(linear.codes, f"{base}.codes"),
        numpy_helper.from_array(linear.scales, f"{base}.scales"),
        numpy_helper.from_array(linear.unsmooth, f"{base}.unsmooth"),
    ]

    def make(op: str, inputs: list[str], suffix: str, **attrs: Any) -> Any:
        return helper.make_node(op, inputs, [f"{base}.{suffix}"], name=f"{base}.{suffix}", **attrs)

    x = node.input[0]
    nodes = [
        make("Mul", [x, f"{base}.unsmooth"], "x"),
        make("Abs", [f"{base}.x"], "abs"),
        make("ReduceMax", [f"{base}.abs", f"{tag}.last_axis"], "amax", keepdims=0),
        make("Mul", [f"{base}.amax", f"{tag}.inv127"], "scale0"),
        make("Max", [f"{base}.scale0", f"{tag}.tiny"], "row_scale"),
        make("QuantizeLinear", [f"{base}.x", f"{base}.row_scale", zero_points], "codes_x", axis=0),
        make("MatMulInteger", [f"{base}.codes_x", f"{base}.codes", f"{tag}.zp"], "acc"),
        make("DequantizeLinear", [f"{base}.acc", f"{base}.row_scale"], "y0", axis=0),
        helper.make_node("Mul", [f"{base}.y0", f"{base}.scales"], [node.output[0]], name=f"{base}.y"),
    ]
    product = next(m for m in nodes if m.op_type == "MatMulInteger")
    chain = {
        "input": x,
        "output": node.output[0],
        "codes": f"{base}.codes",
        "scales": f"{base}.scales",
        "unsmooth": f"{base}.unsmooth",
        "product": product.name,
        "nodes": [m.name for m in nodes],
    }
    product.metadata_props.add(key=CHAIN_KEY, value=json.dumps(chain))
    for key, value in meta.items():
        product.metadata_props.add(key=key, value=value)
    return nodes, tensors


def chains(graph: Any) -> list[dict[str, Any]]:
    """Every w8a8 chain of ``graph`` (an ``onnx.GraphProto``): its tensors' names and its node's metadata."""
    out = []
    for node in graph.node:
        meta = {p.key: p.value for p in node.metadata_props}
        if node.op_type == "MatMulInteger" and CHAIN_KEY in meta:
            out.append({**json.loads(meta[CHAIN_KEY]), "meta": meta})
    return out


def integer_weights(graph: Any) -> dict[str, IntegerLinear]:
    """Each chain's ``IntegerLinear``, by the name of its MatMulInteger node (``graph`` with its weights loaded)."""
    from onnx import numpy_helper

    inits = {i.name: i for i in graph.initializer}
    out = {}
    for chain in chains(graph):
        out[chain["product"]] = IntegerLinear(
            *(numpy_helper.to_array(inits[chain[key]]) for key in ("codes", "scales", "unsmooth"))
        )
    return out


def with_fp32_products(model: Any) -> None:
    """Replace every chain of ``model`` (an ``onnx.ModelProto``, weights loaded) by a Gemm by its effective weight.

    Why: the export's tight check (``quantize_and_validate``) tests the graph's wiring and stored
    weights without the rounding of activations, as the block-quantized graphs are checked at fp32
    activations.
    """
    from onnx import helper, numpy_helper

    graph = model.graph
    weights = integer_weights(graph)
    dropped: set[str] = set()
    gemms = {}
    for chain in chains(graph):
        name = chain["product"]
        dropped.update(chain["nodes"])
        gemms[chain["nodes"][-1]] = (
            helper.make_node(
                "Gemm", [chain["input"], f"{name}.effective"], [chain["output"]], name=f"{name}.fp32", transB=1
            ),
            numpy_helper.from_array(weights[name].effective(), f"{name}.effective"),
        )
    nodes = []
    for node in graph.node:
        if node.name in gemms:
            gemm, weight = gemms[node.name]
            nodes.append(gemm)
            graph.initializer.append(weight)
        elif node.name not in dropped:
            nodes.append(node)
    del graph.node[:]
    graph.node.extend(nodes)


@contextmanager
def fp32_product_copy(graph: str | os.PathLike, edit: Callable[[Any], None]) -> Iterator[Path]:
    """A temporary copy of ``graph`` (beside it, with the small files of its directory: config, head token ids)
    with ``with_fp32_products`` and then ``edit`` applied."""
    import shutil

    import onnx

    proto = onnx.load(str(graph))
    with_fp32_products(proto)
    edit(proto)
    with tempfile.TemporaryDirectory(dir=Path(graph).parent, prefix="check-") as tmp:
        for item in Path(graph).parent.glob("*.json"):
            shutil.copy(item, tmp)
        checked = Path(tmp) / "model.onnx"
        onnx.save_model(proto, str(checked), save_as_external_data=True, location="model.onnx.data")
        yield checked


def chain_for(
    node: Any,
    weight: np.ndarray,
    runs: Sequence[tuple[str, int, int]],
    maxima: Mapping[str, np.ndarray],
    meta: Mapping[str, str],
    reference: Mapping[str, np.ndarray],
    effective: dict[str, np.ndarray] | None,
    first: bool,
) -> tuple[list[Any], list[Any]]:
    """The chain replacing the linear ``node`` whose weight ``[N, K]`` holds the source rows ``runs``.

    ``maxima``: each source's calibrated input maxima (q|k|v, gate|up read one input: the same);
    ``effective`` receives each source's rows as the chain computes them (the size of ``reference``'s);
    ``first``: also make the zero points and constants every chain shares.
    """
    seen = np.max([maxima[name] for name, _, _ in runs], axis=0)
    linear = quantize_linear(weight, smoothing(seen, weight))
    nodes, tensors = integer_nodes(node, linear, "w8a8", "w8a8.zero_points", meta)
    if effective is not None:
        rows, at = linear.effective(), 0
        for name, start, stop in runs:
            effective.setdefault(name, np.zeros_like(reference[name]))[start:stop] = rows[at : at + stop - start]
            at += stop - start
    if first:
        zp_nodes, _ = row_zero_points("input_ids", "w8a8")
        nodes = [*zp_nodes, *nodes]
        tensors = [*shared_constants("w8a8"), *tensors]
    return nodes, tensors

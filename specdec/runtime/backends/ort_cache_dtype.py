"""KV caches stored at a narrower float type than the graph computes in (fp16 caches of an fp32 graph).

Why: an edge runtime keeps its caches in fp16 (llama.cpp's default) because at long contexts and
several sequences they outweigh a quantized model; in fp16 they take half (sizes:
``benchmarks/results/kv_cache_dtype.md``). The exported graph keeps fp32 caches (TensorRT binds them
as they are), so, like ``ort_fuse``, this is a rewrite of the in-memory copy an ``OrtBackend``
opens; the caches it binds are then fp16 arrays.

How, per attention node (after ``ort_fuse``, so on either lowering):

* ``GroupQueryAttention`` runs in the cache's type: its query, key, value and bias are cast down,
  its output cast back up (both calls of a layer in the folded lowering, ``ort_fold``).
  The new K/V it appends are the cast-down ones, which is what the cache holds anyway. ONNX
  Runtime's CPU kernel computes an fp16 GQA in fp32 inside (it converts the fp16 inputs), so the
  only rounding added is that of q, k and v to fp16.
* ``RaggedTreeAttention`` (the unfused graph, the rare step GQA cannot pad) reads its caches cast
  up and writes them cast down, a whole-cache copy each way: correct, slow, and rare.

Both are elementwise casts around row-independent kernels, so a row's logits still do not depend on
the step's shape (``tests/test_batch_invariance.py`` runs the fp16-cache graph too): greedy ``ems``
stays equal to ``ar`` on the same graph. What fp16 costs is agreement with the fp32-cache graph,
reported by ``python -m benchmarks.edge_cpu``.
"""

from __future__ import annotations

import onnx
from onnx import TensorProto

from specdec.plugins import onnx_op
from specdec.runtime.backends.onnx_edit import MS_DOMAIN, GraphEditor
from specdec.runtime.backends.ort_fuse import FOLDED_CACHE
from specdec.runtime.graph_io import CACHE_INPUT, CACHE_OUTPUT, cache_layers, cache_names

#: cache types this rewrite stores, by the name the options and manifests use
CACHE_DTYPES = {"float32": TensorProto.FLOAT, "float16": TensorProto.FLOAT16}
_GQA = (MS_DOMAIN, "GroupQueryAttention")
_GQA_FLOAT_INPUTS = (0, 1, 2, 10)  # query, key, value, attention_bias (its schema type T: the cache's)


def _cache_tensors(graph: onnx.GraphProto) -> tuple[set[str], set[str]]:
    """Names of the graph's cache inputs (``past_key_values.*``) and outputs (``present.*``, and the folded
    layout's hand-over of each, ``ort_fuse.FOLDED_CACHE``, which the padded layout reads as its past)."""
    layers = cache_layers(i.name for i in graph.input)
    outputs = set(cache_names(layers, CACHE_OUTPUT))
    folded = {FOLDED_CACHE.format(name=name) for name in outputs} & {o.name for o in graph.output}
    return set(cache_names(layers, CACHE_INPUT)), outputs | folded


def cache_dtype_of(model: onnx.ModelProto) -> int:
    """The element type of the graph's cache inputs (every layer has the same)."""
    inputs, _ = _cache_tensors(model.graph)
    types = {i.type.tensor_type.elem_type for i in model.graph.input if i.name in inputs}
    if len(types) != 1:
        raise ValueError(f"the graph's caches have {len(types)} element types, expected one")
    return types.pop()


def _narrow_gqa(g: GraphEditor, node: onnx.NodeProto, to: int, down: dict[str, str]) -> None:
    """GQA in the cache's type: its float inputs cast down (each tensor once, e.g. the bias every layer shares),
    its output cast up."""
    for i in _GQA_FLOAT_INPUTS:
        name = node.input[i] if i < len(node.input) else ""
        if not name:
            continue
        if name not in down:
            down[name] = g.add("Cast", name, to=to)
        node.input[i] = down[name]
    result = node.output[0]
    node.output[0] = g.name("gqa_low")
    g.add("Cast", node.output[0], outputs=[result], to=TensorProto.FLOAT)


def _check_reader(node: onnx.NodeProto, inputs: set[str]) -> None:
    if node.op_type != "Shape" and any(name in inputs for name in node.input):  # a shape ignores the type
        raise ValueError(f"{node.op_type} node {node.name} reads a cache; only attention (and Shape) may")


def _widen_reference(g: GraphEditor, node: onnx.NodeProto, to: int) -> None:
    """RaggedTreeAttention over narrow caches: reads them cast up, writes them cast down (whole-cache copies)."""
    for i in (3, 4):
        node.input[i] = g.add("Cast", node.input[i], to=TensorProto.FLOAT)
    for i in (1, 2):
        present = node.output[i]
        node.output[i] = g.name("present32")
        g.add("Cast", node.output[i], outputs=[present], to=to)


def retype_caches(model: onnx.ModelProto, dtype: str) -> bool:
    """Store ``model``'s caches as ``dtype`` (a ``CACHE_DTYPES`` name), in place; False if they already are.

    Only narrowing an fp32 graph's caches is supported (fp16 computing over fp32 caches gains nothing).
    """
    if dtype not in CACHE_DTYPES:
        raise ValueError(f"unknown cache dtype {dtype!r}; known: {sorted(CACHE_DTYPES)}")
    to, compute = CACHE_DTYPES[dtype], cache_dtype_of(model)
    if to == compute:
        return False
    if compute != TensorProto.FLOAT:
        raise ValueError(
            f"caches of {onnx.helper.tensor_dtype_to_np_dtype(to)} need a float32 graph, this one "
            f"computes in {onnx.helper.tensor_dtype_to_np_dtype(compute)}"
        )
    inputs, outputs = _cache_tensors(model.graph)
    g = GraphEditor(model, "ort_fuse")  # the names of the lowering it follows
    down: dict[str, str] = {}
    caches = inputs | outputs  # a GQA call may read the folded layout's hand-over as its past
    for node in model.graph.node:
        kind = (node.domain, node.op_type)
        if kind == _GQA and node.input[3] in caches:
            _narrow_gqa(g, node, to, down)
        elif kind == (onnx_op.DOMAIN, onnx_op.OP_TYPE) and node.input[3] in inputs:
            _widen_reference(g, node, to)
        else:
            _check_reader(node, caches)
    for value in (*model.graph.input, *model.graph.output):
        if value.name in inputs or value.name in outputs:
            value.type.tensor_type.elem_type = to
    g.commit(sort=True)
    return True

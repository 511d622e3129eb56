"""ONNX side of the custom op ``specdec::RaggedTreeAttention`` (and a KV-compaction graph).

One exported file serves every backend: the attention node is a *custom* node
(domain ``specdec``) carrying the TensorRT plugin keys ``plugin_namespace``/``plugin_version``,
and the model also carries a model-local ``FunctionProto`` with the same domain and name
whose body uses only standard ONNX ops. ONNX Runtime (any EP, no extra library) inlines
that body; a TensorRT parser with the plugin loaded binds the plugin instead, and falls back
to the body when it is not loaded. The semantics is ``specdec.plugins.reference.
ragged_tree_attention`` without ``cache_mask`` (only the padded baseline needs holes).

Why a registered schema: ``torch.onnx.export(dynamo=True)`` inlines onnxscript *functions*,
so the exporter must emit a bare node, and onnxscript needs a schema to know the node has
three outputs. The body is attached after export at the model's own opset, because the
checker rejects a function whose opset differs from the model's.

How the body computes (all shapes dynamic; B sequences, T packed tokens, S = S_max):
  1. token -> (sequence, offset) from ``cu_seqlens``; new K/V rows are written with
     ``ScatterND`` (int64 indices) at ``(slot_b, h, past_b + i)``; other rows are untouched.
  2. each sequence's keys ``[0, past_b + n_b)`` are read back with ``GatherND`` into
     ``[B, Hkv, L, D]`` (L = max(past + n)); positions past a sequence's end are clamped onto
     its last valid row, so never-written cache memory (even NaN) is never read.
  3. queries are gathered to ``[B, S]`` and viewed as ``[B, Hkv, group*S, D]``: grouped-query
     attention without repeating K/V.
  4. the mask ``j < past_b  or  (j - past_b < n_b and tree_mask[row, j - past_b])`` is built
     in-graph; masked scores are replaced with a finite large negative (``Where``), so even
     padding rows with nothing visible stay finite.
  5. scores, softmax and the value product run in float32 whatever the I/O dtype: ORT's CPU
     ``MatMul``/``Softmax``/``Where`` only have float kernels, and fp16 would overflow the
     mask constant. Caches keep their dtype (they are only copied).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import onnx
from onnx import TensorProto, helper
from onnx.defs import OpSchema

DOMAIN = "specdec"
OP_TYPE = "RaggedTreeAttention"
OP_VERSION = 1
PLUGIN_NAMESPACE = "specdec"
PLUGIN_VERSION = "1"

MIN_OPSET = 18  # ReduceMax takes its axes as an input from 18 on; torch 2.13's exporter emits 18
INPUT_NAMES = ("q", "k", "v", "k_cache", "v_cache", "cu_seqlens", "past_lens", "slot_ids", "tree_mask")
OUTPUT_NAMES = ("out", "k_cache_out", "v_cache_out")
ATTRIBUTE_NAMES = ("scale", "num_heads", "num_kv_heads", "plugin_namespace", "plugin_version")

_MASKED = -1.0e30  # float32 score of a hidden key; finite, so a row with nothing visible stays finite


# --------------------------------------------------------------------------------------------- schema


def _infer_types(ctx: onnx.shape_inference.InferenceContext) -> None:
    """out has q's type and shape; the caches come back with their own type and shape."""
    for out_index, in_index in ((0, 0), (1, 3), (2, 4)):
        if ctx.has_input(in_index) and ctx.has_output(out_index):
            ctx.set_output_type(out_index, ctx.get_input_type(in_index))


def register_schema() -> None:
    """Register ``specdec::RaggedTreeAttention`` (version 1) with onnx; a no-op when already there.

    The schema lets onnxscript (and so ``torch.onnx.export``) emit the bare custom node with its
    three outputs, and lets ``onnx.checker`` validate the node's attributes and types.
    """
    try:
        onnx.defs.get_schema(OP_TYPE, OP_VERSION, DOMAIN)
        return
    except onnx.defs.SchemaError:
        pass
    fp = OpSchema.FormalParameter
    schema = OpSchema(
        OP_TYPE,
        DOMAIN,
        OP_VERSION,
        doc=(
            "Attention over one packed ragged step: writes each sequence's new K/V rows into its cache slot at "
            "past_len and attends every new token to its sequence's committed prefix plus the new tokens allowed "
            "by tree_mask. Semantics: specdec.plugins.reference.ragged_tree_attention."
        ),
        inputs=[
            fp("q", "T", "[T, num_heads, head_dim] packed queries"),
            fp("k", "T", "[T, num_kv_heads, head_dim] packed new keys"),
            fp("v", "T", "[T, num_kv_heads, head_dim] packed new values"),
            fp("k_cache", "T", "[slots, num_kv_heads, max_len, head_dim]"),
            fp("v_cache", "T", "[slots, num_kv_heads, max_len, head_dim]"),
            fp("cu_seqlens", "I", "[B + 1] prefix sums of new tokens per sequence"),
            fp("past_lens", "I", "[B] committed KV length = write offset"),
            fp("slot_ids", "I", "[B] cache slot of each sequence"),
            fp("tree_mask", "M", "[T, S_max] token t may see the j-th new token of its own sequence"),
        ],
        outputs=[
            fp("out", "T", "[T, num_heads, head_dim]"),
            fp("k_cache_out", "T", "k_cache with the new rows written"),
            fp("v_cache_out", "T", "v_cache with the new rows written"),
        ],
        type_constraints=[
            ("T", ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"], "activations and caches"),
            ("I", ["tensor(int32)"], "index tensors"),
            ("M", ["tensor(bool)"], "tree mask"),
        ],
        attributes=[
            OpSchema.Attribute("scale", OpSchema.AttrType.FLOAT, "softmax scale (usually head_dim ** -0.5)"),
            OpSchema.Attribute("num_heads", OpSchema.AttrType.INT, "query heads (informative for plugins)"),
            OpSchema.Attribute("num_kv_heads", OpSchema.AttrType.INT, "KV heads (informative for plugins)"),
            OpSchema.Attribute(
                "plugin_namespace",
                helper.make_attribute("plugin_namespace", PLUGIN_NAMESPACE),
                "TensorRT plugin namespace",
            ),
            OpSchema.Attribute(
                "plugin_version", helper.make_attribute("plugin_version", PLUGIN_VERSION), "TensorRT plugin version"
            ),
        ],
    )
    schema.set_type_and_shape_inference_function(_infer_types)
    onnx.defs.register_schema(schema)


# --------------------------------------------------------------------------------------------- node


def make_node(
    q: str,
    k: str,
    v: str,
    k_cache: str,
    v_cache: str,
    cu_seqlens: str,
    past_lens: str,
    slot_ids: str,
    tree_mask: str,
    outputs: Sequence[str],
    *,
    scale: float,
    num_heads: int,
    num_kv_heads: int,
    name: str = "",
) -> onnx.NodeProto:
    """The custom node with the plugin keys TensorRT's parser matches (op_type + namespace + version)."""
    if len(outputs) != 3:
        raise ValueError(f"{OP_TYPE} has 3 outputs (out, k_cache_out, v_cache_out), got {list(outputs)}")
    return helper.make_node(
        OP_TYPE,
        [q, k, v, k_cache, v_cache, cu_seqlens, past_lens, slot_ids, tree_mask],
        list(outputs),
        name=name or None,
        domain=DOMAIN,
        scale=float(scale),
        num_heads=int(num_heads),
        num_kv_heads=int(num_kv_heads),
        plugin_namespace=PLUGIN_NAMESPACE,
        plugin_version=PLUGIN_VERSION,
    )


# --------------------------------------------------------------------------------------------- body


class _Body:
    """Tiny node-list builder: ``b("Op", *inputs, **attrs)`` appends a node and returns its output name."""

    def __init__(self) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self._count = 0

    def __call__(
        self,
        op_type: str,
        *inputs: str,
        outputs: Sequence[str] | None = None,
        refs: Sequence[onnx.AttributeProto] = (),
        **attrs: Any,
    ) -> str:
        if outputs is None:
            self._count += 1
            outputs = [f"_{op_type.lower()}{self._count}"]
        node = helper.make_node(op_type, list(inputs), list(outputs), **attrs)
        node.attribute.extend(refs)
        self.nodes.append(node)
        return outputs[0]

    def ints(self, *values: int) -> str:
        """A 1-D int64 constant."""
        return self("Constant", value_ints=list(values))

    def scalar(self, value: int) -> str:
        """A 0-D int64 constant (Range wants scalars)."""
        return self("Constant", value=helper.make_tensor("value", TensorProto.INT64, [], [value]))


def _attention_nodes(b: _Body) -> None:  # noqa: PLR0915 - one straight-line graph reads best in one place
    """Append the body of RaggedTreeAttention to ``b`` (inputs/outputs named as in the schema)."""
    c0, c1, cm1 = b.ints(0), b.ints(1), b.ints(-1)
    s0, s1 = b.scalar(0), b.scalar(1)
    i64 = TensorProto.INT64
    f32 = TensorProto.FLOAT

    cu = b("Cast", "cu_seqlens", to=i64)
    past = b("Cast", "past_lens", to=i64)  # [B]
    slots = b("Cast", "slot_ids", to=i64)  # [B]
    n_tok = b("Shape", "q", start=0, end=1)  # [1] = T
    n_heads = b("Shape", "q", start=1, end=2)  # [1] = Hq
    head_dim = b("Shape", "q", start=2, end=3)  # [1] = D
    n_kv = b("Shape", "k", start=1, end=2)  # [1] = Hkv
    s_max = b("Shape", "tree_mask", start=1, end=2)  # [1] = S
    group = b("Div", n_heads, n_kv)  # [1] = G
    n_cu = b("Shape", cu)
    n_seq = b("Sub", n_cu, c1)  # [1] = B

    starts = b("Slice", cu, c0, cm1)  # [B]
    ends = b("Slice", cu, c1, n_cu)  # [B]
    new_lens = b("Sub", ends, starts)  # [B]

    # 1. token -> (sequence, offset): the sequence of t is the number of sequence ends <= t.
    tok = b("Range", s0, b("Squeeze", n_tok), s1)  # [T]
    after_end = b("GreaterOrEqual", b("Unsqueeze", tok, c1), b("Unsqueeze", ends, c0))  # [T, B]
    tok_seq = b("ReduceSum", b("Cast", after_end, to=i64), c1, keepdims=0)  # [T]
    tok_off = b("Sub", tok, b("Gather", starts, tok_seq))  # [T]

    # 2. write the new rows: cache[slot, h, past + off, :] = k[t, h, :]
    heads = b("Range", s0, b("Squeeze", n_kv), s1)  # [Hkv]
    w_shape = b("Concat", n_tok, n_kv, c1, axis=0)  # [T, Hkv, 1]
    t11 = b("Concat", n_tok, c1, c1, axis=0)
    w_slot = b("Expand", b("Reshape", b("Gather", slots, tok_seq), t11), w_shape)
    w_head = b("Expand", b("Reshape", heads, b("Concat", c1, n_kv, c1, axis=0)), w_shape)
    w_pos = b("Expand", b("Reshape", b("Add", b("Gather", past, tok_seq), tok_off), t11), w_shape)
    w_idx = b("Concat", w_slot, w_head, w_pos, axis=2)  # [T, Hkv, 3]
    b("ScatterND", "k_cache", w_idx, "k", outputs=["k_cache_out"])
    b("ScatterND", "v_cache", w_idx, "v", outputs=["v_cache_out"])

    # 3. read each sequence's keys [0, past + n) back as [B, Hkv, L, D]; L = max(past + n).
    total = b("Add", past, new_lens)  # [B]
    kv_len = b("ReduceMax", total, keepdims=1)  # [1] = L
    pos = b("Range", s0, b("Squeeze", kv_len), s1)  # [L]
    last_row = b("Sub", b("Unsqueeze", total, c1), c1)  # [B, 1]
    r_pos = b("Max", b("Min", b("Unsqueeze", pos, c0), last_row), c0)  # [B, L] clamped onto written rows
    r_shape = b("Concat", n_seq, n_kv, kv_len, c1, axis=0)  # [B, Hkv, L, 1]
    r_slot = b("Expand", b("Unsqueeze", slots, b.ints(1, 2, 3)), r_shape)
    r_head = b("Expand", b("Reshape", heads, b("Concat", c1, n_kv, c1, c1, axis=0)), r_shape)
    r_posx = b("Expand", b("Unsqueeze", r_pos, b.ints(1, 3)), r_shape)
    r_idx = b("Concat", r_slot, r_head, r_posx, axis=3)  # [B, Hkv, L, 3]
    keys = b("Cast", b("GatherND", "k_cache_out", r_idx), to=f32)  # [B, Hkv, L, D]
    values = b("Cast", b("GatherND", "v_cache_out", r_idx), to=f32)

    # 4. packed -> padded queries [B, S] (padding rows repeat a real row of the pack).
    j = b("Range", s0, b("Squeeze", s_max), s1)  # [S]
    p_idx = b("Add", b("Unsqueeze", starts, c1), b("Unsqueeze", j, c0))  # [B, S]
    p_idx = b("Max", b("Min", p_idx, b("Sub", b("Unsqueeze", ends, c1), c1)), c0)
    scale = b("Constant", refs=[_attribute_ref("value_float", "scale", onnx.AttributeProto.FLOAT)])
    q_pad = b("Mul", b("Cast", b("Gather", "q", p_idx, axis=0), to=f32), scale)  # [B, S, Hq, D]
    q_pad = b("Reshape", q_pad, b("Concat", n_seq, s_max, n_kv, group, head_dim, axis=0))
    q_pad = b("Transpose", q_pad, perm=[0, 2, 3, 1, 4])  # [B, Hkv, G, S, D]
    gs = b("Mul", group, s_max)
    q_grp = b("Reshape", q_pad, b("Concat", n_seq, n_kv, gs, head_dim, axis=0))  # [B, Hkv, G*S, D]
    scores = b("MatMul", q_grp, b("Transpose", keys, perm=[0, 1, 3, 2]))  # [B, Hkv, G*S, L]
    scores = b("Reshape", scores, b("Concat", n_seq, n_kv, group, s_max, kv_len, axis=0))

    # 5. mask [B, S, L]: key p visible iff p < past  or  (p - past < n  and  tree[row, p - past]).
    rel = b("Sub", b("Unsqueeze", pos, c0), b("Unsqueeze", past, c1))  # [B, L]
    in_past = b("Less", rel, c0)
    in_new = b("And", b("Not", in_past), b("Less", rel, b("Unsqueeze", new_lens, c1)))
    rel_c = b("Max", b("Min", rel, b("Sub", s_max, c1)), c0)  # [B, L] in [0, S)
    tree = b("Gather", "tree_mask", p_idx, axis=0)  # [B, S, S]
    rel_x = b("Expand", b("Unsqueeze", rel_c, c1), b("Concat", n_seq, s_max, kv_len, axis=0))
    tree_l = b("GatherElements", tree, rel_x, axis=2)  # [B, S, L]
    allowed = b("Or", b("Unsqueeze", in_past, c1), b("And", b("Unsqueeze", in_new, c1), tree_l))
    allowed = b("Unsqueeze", allowed, b.ints(1, 2))  # [B, 1, 1, S, L]
    masked = b("Constant", value=helper.make_tensor("value", f32, [], [_MASKED]))
    probs = b("Softmax", b("Where", allowed, scores, masked), axis=-1)  # [B, Hkv, G, S, L]
    probs = b("Reshape", probs, b("Concat", n_seq, n_kv, gs, kv_len, axis=0))
    ctx = b("MatMul", probs, values)  # [B, Hkv, G*S, D]
    ctx = b("Reshape", ctx, b("Concat", n_seq, n_kv, group, s_max, head_dim, axis=0))
    ctx = b("Transpose", ctx, perm=[0, 3, 1, 2, 4])  # [B, S, Hkv, G, D]
    ctx = b("Reshape", ctx, b("Concat", cm1, n_heads, head_dim, axis=0))  # [B*S, Hq, D]

    # 6. padded -> packed.
    flat = b("Add", b("Mul", tok_seq, b("Squeeze", s_max)), tok_off)  # [T]
    b("CastLike", b("Gather", ctx, flat, axis=0), "q", outputs=["out"])


def _attribute_ref(name: str, ref: str, attr_type: onnx.AttributeProto.AttributeType) -> onnx.AttributeProto:
    """An attribute of a function-body node whose value is the calling node's attribute ``ref``."""
    attr = onnx.AttributeProto()
    attr.name = name
    attr.ref_attr_name = ref
    attr.type = attr_type
    return attr


def function_proto(opset: int) -> onnx.FunctionProto:
    """The standard-op body of ``specdec::RaggedTreeAttention`` at default-domain ``opset`` (>= 18).

    It must be built at the opset of the model that carries it: ORT tolerates a mismatch but
    ``onnx.checker`` does not.
    """
    if opset < MIN_OPSET:
        raise ValueError(f"the RaggedTreeAttention body needs opset >= {MIN_OPSET}, got {opset}")
    if opset > onnx.defs.onnx_opset_version():
        raise ValueError(f"opset {opset} is newer than this onnx ({onnx.defs.onnx_opset_version()})")
    body = _Body()
    _attention_nodes(body)
    return helper.make_function(
        DOMAIN,
        OP_TYPE,
        list(INPUT_NAMES),
        list(OUTPUT_NAMES),
        body.nodes,
        [helper.make_opsetid("", opset)],
        attributes=["scale", "num_heads", "num_kv_heads"],
        attribute_protos=[
            helper.make_attribute("plugin_namespace", PLUGIN_NAMESPACE),
            helper.make_attribute("plugin_version", PLUGIN_VERSION),
        ],
        doc_string="Standard-op fallback body of specdec::RaggedTreeAttention (see specdec/plugins/onnx_op.py).",
    )


# --------------------------------------------------------------------------------------------- model


def model_opset(model: onnx.ModelProto) -> int:
    """The model's default-domain (``ai.onnx``) opset."""
    for imp in model.opset_import:
        if imp.domain in ("", "ai.onnx"):
            return int(imp.version)
    raise ValueError("the model imports no default-domain (ai.onnx) opset")


def attach_functions(model: onnx.ModelProto) -> onnx.ModelProto:
    """Make ``model`` runnable anywhere: add the body, the ``specdec`` opset import and plugin keys.

    Modifies ``model`` in place and returns it. Idempotent: an existing ``specdec``
    RaggedTreeAttention function is replaced by one built at the model's current opset (so a
    model converted to another opset gets a matching body), the opset import is added once,
    and plugin attributes missing on a custom node are filled in (the TensorRT parser needs
    ``plugin_namespace`` to try the plugin at all).
    """
    opset = model_opset(model)
    if model.ir_version and model.ir_version < 8:
        raise ValueError(f"model-local functions need IR version >= 8, the model has {model.ir_version}")
    kept = [f for f in model.functions if (f.domain, f.name) != (DOMAIN, OP_TYPE)]
    del model.functions[:]
    model.functions.extend([*kept, function_proto(opset)])
    if not any(imp.domain == DOMAIN for imp in model.opset_import):
        model.opset_import.append(helper.make_opsetid(DOMAIN, OP_VERSION))
    for node in _all_nodes(model.graph):
        if node.domain == DOMAIN and node.op_type == OP_TYPE:
            present = {a.name for a in node.attribute}
            if "plugin_namespace" not in present:
                node.attribute.append(helper.make_attribute("plugin_namespace", PLUGIN_NAMESPACE))
            if "plugin_version" not in present:
                node.attribute.append(helper.make_attribute("plugin_version", PLUGIN_VERSION))
    return model


def _all_nodes(graph: onnx.GraphProto) -> list[onnx.NodeProto]:
    """Nodes of ``graph`` and of its subgraphs (If/Loop/Scan bodies)."""
    nodes = []
    for node in graph.node:
        nodes.append(node)
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                nodes.extend(_all_nodes(attr.g))
            elif attr.type == onnx.AttributeProto.GRAPHS:
                for sub in attr.graphs:
                    nodes.extend(_all_nodes(sub))
    return nodes


def attention_model(
    *,
    scale: float,
    num_heads: int,
    num_kv_heads: int,
    opset: int = MIN_OPSET,
    dtype: int = TensorProto.FLOAT,
) -> onnx.ModelProto:
    """A model of exactly one RaggedTreeAttention node (+ body): for tests, benchmarks and plugin checks.

    All dimensions are symbolic; the I/O names are the schema's.
    """
    register_schema()
    i32 = TensorProto.INT32
    act = {"q": ["T", "Hq", "D"], "k": ["T", "Hkv", "D"], "v": ["T", "Hkv", "D"]}
    cache = ["slots", "Hkv", "max_len", "D"]
    inputs = [helper.make_tensor_value_info(name, dtype, dims) for name, dims in act.items()]
    inputs += [helper.make_tensor_value_info(name, dtype, cache) for name in ("k_cache", "v_cache")]
    inputs += [
        helper.make_tensor_value_info("cu_seqlens", i32, ["B_plus_1"]),
        helper.make_tensor_value_info("past_lens", i32, ["B"]),
        helper.make_tensor_value_info("slot_ids", i32, ["B"]),
        helper.make_tensor_value_info("tree_mask", TensorProto.BOOL, ["T", "S_max"]),
    ]
    outputs = [
        helper.make_tensor_value_info("out", dtype, ["T", "Hq", "D"]),
        helper.make_tensor_value_info("k_cache_out", dtype, cache),
        helper.make_tensor_value_info("v_cache_out", dtype, cache),
    ]
    node = make_node(
        *INPUT_NAMES, OUTPUT_NAMES, scale=scale, num_heads=num_heads, num_kv_heads=num_kv_heads, name="attn"
    )
    graph = helper.make_graph([node], "ragged_tree_attention", inputs, outputs)
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid(DOMAIN, OP_VERSION)]
    )
    return attach_functions(model)


# --------------------------------------------------------------------------------------------- KV compaction


def kv_compact_model(num_caches: int = 2, *, opset: int = MIN_OPSET, dtype: int = TensorProto.FLOAT) -> onnx.ModelProto:
    """A graph that moves accepted KV rows: ``cache[slot_m, :, dst_m] = cache[slot_m, :, src_m]`` for all m.

    Inputs: ``cache.{i}`` ``[slots, Hkv, max_len, D]`` for i < ``num_caches`` (K and V of every
    layer in one call), ``slot_ids``, ``src_positions``, ``dst_positions`` (int32 ``[M]``).
    Outputs: ``cache_out.{i}``. All rows are read before any is written (GatherND then
    ScatterND), so overlapping moves of a path onto its own prefix are safe; destinations must
    be distinct. ``M = 0`` returns the caches unchanged. Bind ``cache_out.i`` to the buffer of
    ``cache.i`` with IOBinding to avoid the copy (see the research notes on aliasing).
    """
    if num_caches < 1:
        raise ValueError(f"num_caches must be >= 1, got {num_caches}")
    b = _Body()
    c1 = b.ints(1)
    s0, s1 = b.scalar(0), b.scalar(1)
    i64 = TensorProto.INT64
    slot = b("Cast", "slot_ids", to=i64)  # [M]
    src = b("Cast", "src_positions", to=i64)
    dst = b("Cast", "dst_positions", to=i64)
    n_moves = b("Shape", slot)  # [1]
    m11 = b("Concat", n_moves, c1, c1, axis=0)
    slot_col = b("Reshape", slot, m11)  # [M, 1, 1]
    src_col = b("Reshape", src, m11)
    dst_col = b("Reshape", dst, m11)
    for i in range(num_caches):
        cache = f"cache.{i}"
        n_kv = b("Shape", cache, start=1, end=2)
        shape = b("Concat", n_moves, n_kv, c1, axis=0)  # [M, Hkv, 1]
        heads = b("Reshape", b("Range", s0, b("Squeeze", n_kv), s1), b("Concat", c1, n_kv, c1, axis=0))
        heads = b("Expand", heads, shape)
        slots_x = b("Expand", slot_col, shape)
        src_idx = b("Concat", slots_x, heads, b("Expand", src_col, shape), axis=2)  # [M, Hkv, 3]
        dst_idx = b("Concat", slots_x, heads, b("Expand", dst_col, shape), axis=2)
        rows = b("GatherND", cache, src_idx)  # [M, Hkv, D], read before any write
        b("ScatterND", cache, dst_idx, rows, outputs=[f"cache_out.{i}"])
    dims = ["slots", "Hkv", "max_len", "D"]
    inputs = [helper.make_tensor_value_info(f"cache.{i}", dtype, dims) for i in range(num_caches)]
    index_names = ("slot_ids", "src_positions", "dst_positions")
    inputs += [helper.make_tensor_value_info(n, TensorProto.INT32, ["M"]) for n in index_names]
    outputs = [helper.make_tensor_value_info(f"cache_out.{i}", dtype, dims) for i in range(num_caches)]
    graph = helper.make_graph(b.nodes, "kv_compact", inputs, outputs)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def compaction_moves(
    slot_ids: Sequence[int], past_lens: Sequence[int], accepted: Sequence[Sequence[int]]
) -> tuple[list[int], list[int], list[int]]:
    """(slot_ids, src_positions, dst_positions) for ``kv_compact_model`` after a verification step.

    ``accepted[b]`` lists the offsets (among sequence b's new tokens, in path order) of the
    tokens kept; they move to ``past_b, past_b + 1, ...``. Rows already in place are skipped,
    so a fully accepted chain costs nothing.
    """
    slots: list[int] = []
    src: list[int] = []
    dst: list[int] = []
    for slot, past, offsets in zip(slot_ids, past_lens, accepted, strict=True):
        for i, off in enumerate(offsets):
            if off != i:
                slots.append(int(slot))
                src.append(int(past) + int(off))
                dst.append(int(past) + i)
    return slots, src, dst

"""ONNX Runtime-only lowering of a ragged-step graph: fused kernels where ORT has an exact one.

The exported file stays what TensorRT needs (a ``specdec::RaggedTreeAttention`` node per layer,
standard-op body attached); ``fuse_model`` rewrites an in-memory copy when ``OrtBackend`` opens a
session. Why at load time, not as a second file written by the exporter: the kernels depend on
the ORT that *runs* the graph (GroupQueryAttention's ``query_seqlens``: ORT >= 1.32), and the
export directory keeps one graph, one checksum, one validation. Only the graph is read (weights
stay external data), so it costs milliseconds. Rewrites (the exactness argument of each, and the
measurements: docs/export.md, "The ONNX Runtime lowering"; ``benchmarks/results/step_profile.md``):

* **attention** -> ``com.microsoft.GroupQueryAttention`` over a right-padded ``[slots, S, H*D]``
  layout whose batch is the cache's slots (GQA's cache is batch-major, without slot indirection):
  slot ``slot_b`` holds sequence b's rows (``query_seqlens = n_b``, ``seqlens_k = past_b + n_b - 1``,
  new K/V appended in place), other slots are idle entries (``query_seqlens = 0``); the tree mask
  is an additive ``attention_bias``; RoPE stays outside GQA (its own rotary assumes consecutive
  positions, which a tree breaks). q, k and v reach GQA packed in one input, the fused q|k|v
  projection's own output rotated by one ``RotaryEmbedding`` (``ort_packed``). GQA needs ``past + S <= max_len`` for
  every slot, which the reference does not: ``gqa_groups`` says how the backend splits a step.
  A sequence with an odd number of new rows runs one more query row, a copy of its last whose
  output is dropped and whose K/V land one position past the sequence (garbage the next step
  overwrites; ``SPARE_POSITIONS`` keeps room for it at the end of the context). Why: GQA multiplies
  a slot's rows by its keys with MLAS's GEMM in blocks of 128 rows, and a block of a single row takes
  a separate path whose sums round differently; with an even row count no block is a single row
  (a one-row decode step, and a 129- or 257-row prefill chunk alike), and a row's output is bitwise
  the same whatever the slot's row count and whatever shares the step. So a decode row equals the
  same row inside a verification chain bit for bit, and with ``MatMulNBits`` at int8 activations
  (itself row-independent) the whole graph's logits of a row do not depend on the step's shape:
  greedy ``ems`` equals ``ar`` by construction (``tests/test_batch_invariance.py``). It costs one
  attention row per odd-length sequence, nothing in the projections.
  With grouped-query heads, decoding and verification steps run a *folded* layout instead (the
  query heads of a kv group as rows of one GQA call: K/V packed once per kv head, not per query
  head); both layouts run in every layer, the one a step does not use over idle slots (``_attention``);
  ``ort_fold`` says why and how, and why the two layouts give a row the same bits.
* **rmsnorm** -> ``SimplifiedLayerNormalization`` (ORT's own fusion wants ``Div``, the exporter
  emits ``Reciprocal``/``Mul``); **skip_rmsnorm** -> ``SkipSimplifiedLayerNormalization`` for a
  residual ``Add`` feeding a norm (ORT does not fuse it: the sum has other consumers): ``ort_norms``.
* **rotary** -> ``com.microsoft.RotaryEmbedding`` with per-token tables ``Cos(f)``/``Sin(f)`` (the
  first halves of the graph's own ``Cos/Sin(Concat(f, f))``): q and k of fused attention together on
  its packed rows (``ort_packed``), any other RoPE on its own (``ort_rotary``).

This module holds the attention lowering and the driver (``fuse_model``); every rewrite edits the
graph through ``onnx_edit.GraphEditor``, as the export's quantization does. Nothing here touches
MatMul/Gemm nodes, so the rewrites compose with weight quantization (``MatMulNBits``) whichever
runs first.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from dataclasses import dataclass, field

import onnx
from onnx import TensorProto, helper

from specdec.plugins import onnx_op
from specdec.runtime.backends.onnx_edit import MS_DOMAIN, GraphEditor
from specdec.runtime.backends.ort_fold import FOLD_ROWS, Fold, fold_prelude, gqa_width
from specdec.runtime.backends.ort_norms import fuse_rmsnorm, fuse_skip
from specdec.runtime.backends.ort_packed import Packed, pack_qkv
from specdec.runtime.backends.ort_rotary import Rope, fuse_rotary, match_ropes

REWRITES = ("attention", "rmsnorm", "skip_rmsnorm", "rotary")
#: cache positions past ``max_len`` the fused attention needs: the folded layout writes ``fold * n`` K/V rows for a
#: sequence's n (at most FOLD_ROWS), the padded one an odd-length sequence's discarded copy row (module docstring)
SPARE_POSITIONS = FOLD_ROWS - 1
_FLOATS = {TensorProto.FLOAT: "float32", TensorProto.FLOAT16: "float16"}
#: the graph outputs through which the folded layout hands each cache, in place, to the padded one (``_attention``)
FOLDED_CACHE = "{name}.folded"
_LOWEST: dict[int, float] = {TensorProto.FLOAT: -3.4028234663852886e38, TensorProto.FLOAT16: -65504.0}


@functools.cache
def _ort_schemas() -> frozenset[tuple[str, str, str]]:
    """(domain, op, input name) of every operator this onnxruntime registers; empty without onnxruntime."""
    try:
        from onnxruntime.capi import onnxruntime_pybind11_state as capi
    except ImportError:
        return frozenset()
    return frozenset((s.domain, s.name, i.name) for s in capi.get_all_operator_schema() for i in s.inputs)


#: what each rewrite needs from the running onnxruntime: (domain, op, an input it must have)
_NEEDS = {
    "attention": (MS_DOMAIN, "GroupQueryAttention", "query_seqlens"),  # ragged batched chunks: ORT >= 1.32
    "rmsnorm": ("", "SimplifiedLayerNormalization", "scale"),
    "skip_rmsnorm": (MS_DOMAIN, "SkipSimplifiedLayerNormalization", "skip"),
    "rotary": (MS_DOMAIN, "RotaryEmbedding", "position_ids"),
}


def supported(rewrite: str) -> bool:
    """Whether this onnxruntime has the kernel ``rewrite`` lowers to (GQA: with ``query_seqlens``, ORT >= 1.32)."""
    return _NEEDS[rewrite] in _ort_schemas()


def gqa_supported() -> bool:
    """Whether this ONNX Runtime's GroupQueryAttention takes ``query_seqlens`` (ragged batched steps)."""
    return supported("attention")


def gqa_groups(
    past_lens: Sequence[int], new_lens: Sequence[int], max_len: int, num_slots: int, fold: int = 1
) -> list[list[int]] | None:
    """Sequences grouped into sub-steps that GQA accepts, ``[all]`` when the whole step does; None if none exists.

    ``max_len`` is the cache buffer's length (with its ``SPARE_POSITIONS``). GQA pads every slot's
    chunk to ``S`` = ``ort_fold.gqa_width`` of the group (the most rows a sequence runs: an odd count
    runs one more; folded, ``fold`` times its rows; ``fold``: the graph's ``FuseReport.fold``) and needs
    ``P + S <= max_len`` for each slot (``P`` = past of an active slot, 1 for an idle one). A
    sequence near the end of its context fails that next to a long prefill, although its own rows
    fit; such sequences go to a later group with its own, smaller ``S``. None: one sequence fills
    the whole buffer while other slots are idle (the fused graph cannot run it; the caller runs the
    unfused graph).
    """
    pending = list(range(len(new_lens)))
    groups: list[list[int]] = []
    while pending:
        group = pending
        while True:  # the width depends on the group (folded or not): shrink until the group fits its own width
            width = gqa_width([new_lens[i] for i in group], fold)
            fit = [i for i in group if past_lens[i] + width <= max_len]
            if not fit or fit == group:
                break
            group = fit
        if not fit or (width + 1 > max_len and len(fit) < num_slots):  # an idle slot (P = 1) cannot hold S
            return None
        groups.append(fit)
        pending = [i for i in pending if i not in fit]
    return groups


#: the rows from which a chunk runs over the view of its own slot, apart from the step's other sequences (below)
OWN_SLOT_ROWS = 128


def own_slot_chunks(new_lens: Sequence[int], num_slots: int) -> list[int]:
    """The sequences of a step (indices) to run each alone over its own slot's view of the cache: its chunks of at
    least ``OWN_SLOT_ROWS`` rows, when the cache has other slots.

    Why: GQA pads every slot of the cache to the step's widest chunk, so beside a long chunk each other slot (idle,
    decoding, or prefilling a shorter prompt) computes as many query rows over its own past; a step of its own costs
    a step's fixed work instead. Measured on w8a8 (``benchmarks/results/slot_views.md``): apart, a 256-token prefill
    in a cache of 8 slots 1.32x faster, a 128-token chunk beside 7 decoding slots 1.07x, the edge benchmark's 8
    prefills of 160-359 tokens 1.14x; 8 prefills of 64 tokens would run 0.62x as fast, hence the threshold.
    """
    if num_slots < 2:
        return []
    return [i for i, n in enumerate(new_lens) if n >= OWN_SLOT_ROWS]


@dataclass
class FuseReport:
    """What ``fuse_model`` rewrote (counts per rewrite) and what it left alone, with the reason."""

    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(REWRITES, 0))
    skipped: list[str] = field(default_factory=list)
    fold: int = 1  # query heads per kv head of the folded attention layout (1: not folded, ``ort_fold``)

    @property
    def attention(self) -> bool:
        return self.counts["attention"] > 0


# --------------------------------------------------------------------------------------------- attention


@dataclass
class _Prelude:
    """Per-step tensors shared by every fused attention node with the same index inputs."""

    width: str  # [1] S = max new tokens of a sequence
    pad_index: str  # [slots, S] packed row of slot e's chunk row s (clamped onto its last row)
    unpad_index: str  # [T] flat row slot * S + offset of each packed token
    seqlens_k: str  # [slots] int32
    query_seqlens: str  # [slots] int32
    total: str  # [] int32
    allowed: str  # bool [slots, 1, S, L]
    bias: dict[int, str] = field(default_factory=dict)  # dtype -> additive [slots, 1, S, L]


def _prelude(g: GraphEditor, cu_seqlens: str, past_lens: str, slot_ids: str, tree_mask: str, k_cache: str) -> _Prelude:
    i64 = TensorProto.INT64
    c0, c1, cm1 = g.ints(0), g.ints(1), g.ints(-1)
    cu = g.add("Cast", cu_seqlens, to=i64)
    past = g.add("Cast", past_lens, to=i64)
    slots = g.add("Cast", slot_ids, to=i64)
    n_cu = g.add("Shape", cu)
    starts = g.add("Slice", cu, c0, cm1)  # [B]
    ends = g.add("Slice", cu, c1, n_cu)  # [B]
    new = g.add("Sub", ends, starts)  # [B]
    # an odd row count runs one more query row, a discarded copy (module docstring: no one-row GEMM)
    run = g.add("Add", new, g.add("Mod", new, g.ints(2)))  # [B]
    width = g.add("Max", g.add("ReduceMax", run, keepdims=1), c1)  # [1] = S
    n_slots = g.add("Shape", k_cache, start=0, end=1)  # [1]
    zeros = g.add("ConstantOfShape", n_slots, value=helper.make_tensor(g.name("z"), i64, [1], [0]))  # [slots]

    def per_slot(values: str) -> str:
        return g.add("ScatterElements", zeros, slots, values, axis=0)

    q_len = per_slot(new)  # [slots] real rows, 0 for an idle slot
    q_run = per_slot(run)  # [slots] rows GQA runs (and writes K/V for)
    start = per_slot(starts)
    past_s = per_slot(past)
    seq_total = g.add("Add", past, run)  # [B]
    seqlens_k = per_slot(g.add("Max", g.add("Sub", seq_total, c1), c0))  # idle: 0 (= one cached token, unread)
    total = g.add("Max", g.add("ReduceMax", seq_total, keepdims=1), c1)  # [1] = L

    # slot e's chunk row s reads packed row start_e + min(s, n_e - 1) (padding repeats a real row)
    j = g.add("Range", g.add("Squeeze", g.ints(0)), g.add("Squeeze", width), g.add("Squeeze", g.ints(1)))  # [S]
    last = g.add("Max", g.add("Sub", q_len, c1), c0)
    offset = g.add("Min", g.add("Unsqueeze", j, c0), g.add("Unsqueeze", last, c1))  # [slots, S]
    pad = g.add("Add", g.add("Unsqueeze", start, c1), offset)

    # packed token t -> (sequence, offset) -> flat row slot * S + offset of the padded output
    n_tok = g.add("Shape", tree_mask, start=0, end=1)
    tok = g.add("Range", g.add("Squeeze", g.ints(0)), g.add("Squeeze", n_tok), g.add("Squeeze", g.ints(1)))  # [T]
    after = g.add("Cast", g.add("GreaterOrEqual", g.add("Unsqueeze", tok, c1), g.add("Unsqueeze", ends, c0)), to=i64)
    tok_seq = g.add("ReduceSum", after, c1, keepdims=0)  # [T]
    tok_off = g.add("Sub", tok, g.add("Gather", starts, tok_seq))
    unpad = g.add("Add", g.add("Mul", g.add("Gather", slots, tok_seq), width), tok_off)

    # bias[e, s, p]: key p visible iff p < past_e  or  (p - past_e < n_e  and  tree[row(e, s), p - past_e])
    pos = g.add("Range", g.add("Squeeze", g.ints(0)), g.add("Squeeze", total), g.add("Squeeze", g.ints(1)))  # [L]
    rel = g.add("Sub", g.add("Unsqueeze", pos, c0), g.add("Unsqueeze", past_s, c1))  # [slots, L]
    in_past = g.add("Less", rel, c0)
    in_new = g.add("And", g.add("Not", in_past), g.add("Less", rel, g.add("Unsqueeze", q_len, c1)))
    tree_width = g.add("Shape", tree_mask, start=1, end=2)
    rel_c = g.add("Max", g.add("Min", rel, g.add("Sub", tree_width, c1)), c0)
    rows = g.add("Gather", tree_mask, pad, axis=0)  # [slots, S, S_mask]
    rel_x = g.add("Expand", g.add("Unsqueeze", rel_c, c1), g.add("Concat", n_slots, width, total, axis=0))
    tree_l = g.add("GatherElements", rows, rel_x, axis=2)  # [slots, S, L]
    allowed = g.add("Or", g.add("Unsqueeze", in_past, c1), g.add("And", g.add("Unsqueeze", in_new, c1), tree_l))
    allowed = g.add("Unsqueeze", allowed, c1)  # [slots, 1, S, L]
    i32 = TensorProto.INT32
    return _Prelude(
        width=width,
        pad_index=pad,
        unpad_index=unpad,
        seqlens_k=g.add("Cast", seqlens_k, to=i32),
        query_seqlens=g.add("Cast", q_run, to=i32),
        total=g.add("Cast", g.add("Squeeze", total), to=i32),
        allowed=allowed,
    )


def _idle_when(g: GraphEditor, pre: _Prelude, cond: str) -> _Prelude:
    """``pre`` with every slot idle in the steps where ``cond`` holds: no query rows, no K/V written, and one padded
    row per slot (the call then costs next to nothing; its output is not read)."""
    run = g.add("Cast", g.add("Not", cond), to=TensorProto.INT32)
    width = g.add("Where", cond, g.ints(1), pre.width)  # [1] one row per idle slot
    c0, c1 = g.ints(0), g.ints(1)
    return dataclasses.replace(
        pre,
        width=width,
        pad_index=g.add("Slice", pre.pad_index, c0, width, c1),
        unpad_index=g.add("Where", cond, c0, pre.unpad_index),
        seqlens_k=g.add("Mul", pre.seqlens_k, run),
        query_seqlens=g.add("Mul", pre.query_seqlens, run),
        allowed=g.add("Slice", pre.allowed, c0, width, g.ints(2)),
        bias={},
    )


def _bias(g: GraphEditor, layout: _Prelude | Fold, dtype: int) -> str:
    """The layout's additive attention bias in ``dtype``, made once per step and shared by every layer."""
    if dtype not in layout.bias:
        layout.bias[dtype] = g.add("Where", layout.allowed, g.scalar(0.0, dtype), g.scalar(_LOWEST[dtype], dtype))
    return layout.bias[dtype]


# --------------------------------------------------------------------------------------------- attention + rotary


def _gqa(
    g: GraphEditor,
    qkv: str,
    caches: Sequence[str],
    layout: _Prelude | Fold,
    bias: str,
    outputs: Sequence[str],
    heads: int,
    kv_heads: int,
    scale: float,
) -> str:
    """One GroupQueryAttention node over packed ``qkv`` in ``layout`` (its lengths), appending to ``caches`` in
    place."""
    return g.add(
        "GroupQueryAttention",
        qkv,
        "",
        "",
        *caches,
        layout.seqlens_k,
        layout.total,
        "",
        "",
        "",
        bias,
        "",
        "",
        "",
        "",
        "",
        layout.query_seqlens,
        outputs=list(outputs),
        domain=MS_DOMAIN,
        num_heads=heads,
        kv_num_heads=kv_heads,
        scale=scale,
    )


def _padded(
    g: GraphEditor,
    node: onnx.NodeProto,
    packed: Packed,
    pre: _Prelude,
    dtype: int,
    outputs: Sequence[str],
    caches: Sequence[str],
) -> None:
    """The padded layout: slot e's rows are packed rows ``pad_index[e]``, all heads at once; ``outputs``:
    attention's ``[T, H, D]`` and the two caches it writes, ``caches`` the two it reads."""
    heads = int(g.attr(node, "num_heads"))
    out = _gqa(
        g,
        g.add("Gather", packed.rows, pre.pad_index, axis=0),  # [slots, S, W * D]
        caches,
        pre,
        _bias(g, pre, dtype),
        (g.name("gqa"), *outputs[1:]),
        heads,
        int(g.attr(node, "num_kv_heads")),
        float(g.attr(node, "scale")),
    )
    per_head = g.add("Reshape", out, g.ints(-1, heads, packed.head_dim))
    g.add("Gather", per_head, pre.unpad_index, axis=0, outputs=[outputs[0]])


def _attention(
    g: GraphEditor, node: onnx.NodeProto, packed: Packed, pre: _Prelude, fo: Fold | None, dtype: int
) -> None:
    """GQA in place of ``node``: the padded layout alone, or (grouped-query heads) the folded layout (``ort_fold``:
    decoding and verification) then the padded one (prefill chunks), each over idle slots in the other's steps.

    Why both calls and no ``If``: the layouts give a row the same bits, so which one runs is a choice of speed
    per step, and an ``If`` per layer cost a one-row decoding step about 3 % of its time (frames for its
    subgraph each call); an idle GQA call runs one row per slot and writes no K/V. The folded call hands the
    caches to the padded one through graph outputs (``FOLDED_CACHE``) that the backend binds to the cache
    buffers, so both write in place, in order. Measured: ``benchmarks/results/attention_if.md``.
    """
    caches = node.input[3:5]
    if fo is None:
        _padded(g, node, packed, pre, dtype, node.output, caches)
        return
    kv_heads = int(g.attr(node, "num_kv_heads"))
    handed = [FOLDED_CACHE.format(name=name) for name in node.output[1:3]]
    inputs = {i.name: i for i in g.graph.input}
    for name, cache in zip(handed, caches):  # declared as the cache it hands over
        value = g.graph.output.add()
        value.CopyFrom(inputs[cache])
        value.name = name
    qkv = g.add("Reshape", g.add("Gather", packed.flat, fo.qkv_index, axis=0), fo.q_shape)
    scale = float(g.attr(node, "scale"))
    out = _gqa(g, qkv, caches, fo, _bias(g, fo, dtype), (g.name("gqa"), *handed), kv_heads, kv_heads, scale)
    folded = g.add("Gather", g.add("Reshape", out, g.ints(-1, packed.head_dim)), fo.out_index, axis=0)
    padded = g.name("pad_out")
    _padded(g, node, packed, pre, dtype, (padded, *node.output[1:]), handed)
    g.add("Where", fo.cond, folded, padded, outputs=[node.output[0]])


def _fuse_attention(
    g: GraphEditor,
    types: dict[str, int],
    dims: dict[str, list[int | None]],
    ropes: dict[str, Rope],
    report: FuseReport,
) -> tuple[set[int], set[int]]:
    """Replace every RaggedTreeAttention node by the GQA lowering; the ids of the replaced nodes, and of those
    whose replacement applies RoPE itself.

    q, k and v become one packed tensor, RoPE applied on its rows (``ort_packed``). Grouped-query
    attention (``fold`` = heads / kv heads >= 2): the folded layout (``ort_fold``: decoding and
    verification steps) and the padded one (prefill chunks) in every layer, the one a step does not
    use over idle slots (``_idle_when``); they give a row the same bits. Otherwise the padded layout alone.
    """
    preludes: dict[tuple[str, ...], _Prelude] = {}
    folds: dict[tuple[str, ...], Fold] = {}
    unfolded: dict[tuple[str, ...], _Prelude] = {}  # the padded layout beside a fold: idle in the steps that fold
    replaced: set[int] = set()
    rope_inside: set[int] = set()
    slot_dims = {
        i.name: i.type.tensor_type.shape.dim[0].dim_param
        for i in g.graph.input
        if i.type.tensor_type.shape.dim and i.type.tensor_type.shape.dim[0].dim_param
    }
    for node in g.graph.node:
        if node.op_type != onnx_op.OP_TYPE or node.domain != onnx_op.DOMAIN:
            continue
        q, k, v, k_cache, v_cache, cu, past, slot, tree = node.input
        dtype = types.get(k_cache)
        head_dim = (dims.get(k_cache) or [None] * 4)[3]
        if dtype not in _FLOATS or types.get(v_cache) != dtype or types.get(q, dtype) != dtype:
            report.skipped.append(f"attention {node.name}: cache dtype {dtype} (GQA here: float32/float16)")
            continue
        if not head_dim:
            report.skipped.append(f"attention {node.name}: the cache's head size is not static")
            continue
        key = (cu, past, slot, tree, slot_dims.get(k_cache, k_cache))
        if key not in preludes:
            preludes[key] = _prelude(g, cu, past, slot, tree, k_cache)
        num_heads, num_kv_heads = int(g.attr(node, "num_heads")), int(g.attr(node, "num_kv_heads"))
        packed = pack_qkv(g, q, k, v, num_heads, num_kv_heads, head_dim, dims, ropes)
        if packed.rotated:
            rope_inside.add(id(node))
            report.counts["rotary"] += 2
        fold = num_heads // num_kv_heads
        fo, pre = None, preludes[key]
        if fold >= 2:
            fold_key = (*key, str(num_heads), str(num_kv_heads))
            if fold_key not in folds:
                folds[fold_key] = fold_prelude(g, cu, past, slot, tree, k_cache, num_heads, num_kv_heads)
                unfolded[fold_key] = _idle_when(g, pre, folds[fold_key].cond)
            fo, pre = folds[fold_key], unfolded[fold_key]
            report.fold = fold
        _attention(g, node, packed, pre, fo, dtype)
        replaced.add(id(node))
        report.counts["attention"] += 1
    return replaced, rope_inside


# --------------------------------------------------------------------------------------------- driver


def _tensor_info(model: onnx.ModelProto) -> tuple[dict[str, int], dict[str, list[int | None]]]:
    """Element types and dims (None where symbolic) of every tensor shape inference can tell."""
    onnx_op.register_schema()
    inferred = onnx.shape_inference.infer_shapes(model)
    types: dict[str, int] = {}
    dims: dict[str, list[int | None]] = {}
    for vi in (*inferred.graph.input, *inferred.graph.value_info, *inferred.graph.output):
        t = vi.type.tensor_type
        types[vi.name] = t.elem_type
        if t.HasField("shape"):
            dims[vi.name] = [d.dim_value if d.HasField("dim_value") else None for d in t.shape.dim]
    for init in model.graph.initializer:
        types[init.name] = init.data_type
        dims[init.name] = list(init.dims)
    return types, dims


def fuse_model(model: onnx.ModelProto, rewrites: Sequence[str] = REWRITES) -> FuseReport:
    """Rewrite ``model`` (a ragged-step graph, weights not needed) in place for ONNX Runtime; says what changed.

    ``rewrites`` selects among ``REWRITES``; one whose kernel this ORT lacks is skipped and
    reported (``attention`` needs GroupQueryAttention's ``query_seqlens``, ORT >= 1.32). A
    pattern that does not match exactly is left as it is, so the result computes what the
    input did, only with fewer kernels.
    """
    unknown = set(rewrites) - set(REWRITES)
    if unknown:
        raise ValueError(f"unknown ORT rewrites {sorted(unknown)}; known: {list(REWRITES)}")
    report = FuseReport()
    missing = [r for r in rewrites if not supported(r)]
    report.skipped += [f"{r}: this onnxruntime has no {'.'.join(_NEEDS[r][:2])} with {_NEEDS[r][2]}" for r in missing]
    rewrites = [r for r in rewrites if r not in missing]
    types, dims = _tensor_info(model)
    ranks = {name: len(d) for name, d in dims.items()}
    g = GraphEditor(model, "ort_fuse")
    ropes = match_ropes(g, dims) if "rotary" in rewrites else {}
    rope_inside: set[int] = set()
    if "attention" in rewrites:
        attention, rope_inside = _fuse_attention(g, types, dims, ropes, report)
        g.removed |= attention
    rotary = fuse_rotary(g, ropes, rope_inside)
    report.counts["rotary"] += len(rotary)
    g.removed |= rotary
    if "rmsnorm" in rewrites:
        norms = fuse_rmsnorm(g, types, ranks)
        report.counts["rmsnorm"] += len(norms)
        g.removed |= norms
        if "skip_rmsnorm" in rewrites:
            skips = fuse_skip(g)
            report.counts["skip_rmsnorm"] += len(skips) // 2  # the Add and the norm of each
            g.removed |= skips
    g.commit(sort=True)  # drops the rewritten patterns' constants too
    kept = g.graph.node
    if not any(n.domain == onnx_op.DOMAIN and n.op_type == onnx_op.OP_TYPE for n in kept):
        kept_functions = [f for f in model.functions if (f.domain, f.name) != (onnx_op.DOMAIN, onnx_op.OP_TYPE)]
        del model.functions[:]
        model.functions.extend(kept_functions)
    return report

"""The folded GroupQueryAttention layout ``ort_fuse`` uses for decoding and verification steps.

Why: on ONNX Runtime's CPU GQA, a slot's rows are multiplied by its keys per *query* head, and
MLAS packs (and, over fp16 caches, converts) the slot's K and V for every one of those calls. At
several decoding sequences that packing, not the arithmetic, is the attention's cost. Folding runs
GQA with ``num_heads = kv_num_heads``: the ``fold = heads / kv_heads`` query heads of a kv group
become *rows* of one call, so K and V are packed once per kv head, and every GEMM has at least
``fold`` rows (never MLAS's one-row path, so no discarded copy row is needed for invariance either).
Measured: ``benchmarks/results/attention_lowerings.md``.

The layout: slot e runs ``fold * n_e`` query rows; row ``s * fold + g`` holds query head
``j * fold + g`` of its token s in GQA's head j (which reads kv head j). GQA places that row at
position ``P + s * fold + g`` for its causal mask, so the additive bias hides every key past
``P + s`` (and applies the tree mask): the row sees exactly what token s may see. GQA also appends
``fold * n`` K/V rows: the sequence's n rows, then copies of its last one, which land past the
sequence (garbage that later steps overwrite; ``SPARE_POSITIONS`` in ``ort_fuse`` keeps room).

A folded row's causal range grows by about ``2 * s`` keys, so folding loses on long chunks: a step
folds only while its longest sequence has ``fold * n <= FOLD_ROWS`` rows (decode and verification
chains; prefill chunks take the padded layout). Every layer runs both layouts' GQA calls; in a step
that does not fold, this one runs one row per slot, every slot idle (``cond`` false: no query rows,
no K/V written; ``ort_fuse._attention``). Both give the same bits for a row, so the choice never
shows in the logits (``tests/test_batch_invariance.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from onnx import TensorProto, helper

from specdec.runtime.backends.onnx_edit import GraphEditor

#: a step folds while its longest sequence's folded rows (fold * n) are at most this (measured crossover)
FOLD_ROWS = 24


def gqa_width(new_lens: Sequence[int], fold: int = 1) -> int:
    """The rows per slot GQA runs for these sequences: folded (``fold * n``) or ``n`` rounded up to even."""
    longest = max(new_lens)
    if fold >= 2 and fold * longest <= FOLD_ROWS:
        return fold * longest
    return max(n + n % 2 for n in new_lens)


@dataclass
class Fold:
    """Per-step tensors of the folded layout, shared by every layer with the same index inputs."""

    cond: str  # bool []: fold * max(n) <= FOLD_ROWS, the step runs the folded layout (the padded one idles)
    qkv_index: (
        str  # [slots, S_f, 3 KV] rows of the packed q|k|v viewed [T * W, D] (``ort_packed``), row r = s * fold + g:
    )
    #                 q heads j * fold + g of token s, then the kv heads of token min(r, n - 1) (K, then V)
    q_shape: str  # [3] = (slots, S_f, -1)
    out_index: str  # [T, H] row of GQA's output viewed [slots * S_f * KV, D] for each token and head
    seqlens_k: str  # [slots] int32 = past + fold * n - 1 (idle: 0)
    query_seqlens: str  # [slots] int32 = fold * n
    total: str  # [] int32
    allowed: str  # bool [slots, 1, S_f, L]
    bias: dict[int, str] = field(default_factory=dict)  # dtype -> additive [slots, 1, S_f, L]


def fold_prelude(
    g: GraphEditor,
    cu_seqlens: str,
    past_lens: str,
    slot_ids: str,
    tree_mask: str,
    k_cache: str,
    heads: int,
    kv_heads: int,
) -> Fold:
    """The folded layout's indices (into the packed ``q|k|v`` of ``ort_packed``: W = heads + 2 kv_heads per token),
    lengths and mask (module docstring), built once per step.

    The width is ``FOLD_ROWS // fold`` rows per sequence at most, and one in the steps that run the
    other layout, so these tensors stay small there (they are computed either way).
    """
    i64, i32 = TensorProto.INT64, TensorProto.INT32
    fold = heads // kv_heads
    cap = FOLD_ROWS // fold
    c0, c1, cm1 = g.ints(0), g.ints(1), g.ints(-1)
    cu = g.add("Cast", cu_seqlens, to=i64)
    past = g.add("Cast", past_lens, to=i64)
    slots = g.add("Cast", slot_ids, to=i64)
    starts = g.add("Slice", cu, c0, cm1)  # [B]
    ends = g.add("Slice", cu, c1, g.add("Shape", cu))  # [B]
    new = g.add("Sub", ends, starts)  # [B]
    longest = g.add("ReduceMax", new, keepdims=1)
    cond = g.add("Squeeze", g.add("LessOrEqual", g.add("Mul", longest, g.ints(fold)), g.ints(FOLD_ROWS)))
    # [1] S': one row in the steps this layout leaves idle (its GQA call then costs next to nothing)
    width = g.add("Where", cond, g.add("Min", g.add("Max", longest, c1), g.ints(cap)), c1)
    n_slots = g.add("Shape", k_cache, start=0, end=1)
    zeros = g.add("ConstantOfShape", n_slots, value=helper.make_tensor(g.name("z"), i64, [1], [0]))

    def per_slot(values: str) -> str:
        return g.add("ScatterElements", zeros, slots, values, axis=0)

    q_len = g.add("Min", per_slot(new), g.ints(cap))  # [slots] (capped: only the folded layout reads these)
    start, past_s = per_slot(starts), per_slot(past)
    s_f = g.add("Mul", width, g.ints(fold))  # [1]
    last = g.add("Max", g.add("Sub", q_len, c1), c0)
    j = g.add("Range", g.add("Squeeze", c0), g.add("Squeeze", width), g.add("Squeeze", c1))  # [S']
    pad = g.add(
        "Add", g.add("Unsqueeze", start, c1), g.add("Min", g.add("Unsqueeze", j, c0), g.add("Unsqueeze", last, c1))
    )  # [slots, S'] packed row
    heads_of = helper.make_tensor(
        g.name("h"), i64, [fold, kv_heads], [jj * fold + gg for gg in range(fold) for jj in range(kv_heads)]
    )
    per_token = heads + 2 * kv_heads  # heads per token of the packed q|k|v
    q_index = g.add(
        "Add", g.add("Unsqueeze", g.add("Mul", pad, g.ints(per_token)), g.ints(2, 3)), g.add("Constant", value=heads_of)
    )  # [slots, S', fold, KV]
    q_index = g.add("Reshape", q_index, g.add("Concat", n_slots, s_f, g.ints(kv_heads), axis=0))
    r = g.add("Range", g.add("Squeeze", c0), g.add("Squeeze", s_f), g.add("Squeeze", c1))  # [S_f]
    kv_token = g.add(
        "Add", g.add("Unsqueeze", start, c1), g.add("Min", g.add("Unsqueeze", r, c0), g.add("Unsqueeze", last, c1))
    )  # [slots, S_f] the token whose K/V row r appends
    kv_heads_at = helper.make_tensor(
        g.name("kvh"), i64, [1, 1, 2 * kv_heads], [heads + j for j in range(2 * kv_heads)]
    )  # the K heads, then the V heads, of a packed token
    kv_index = g.add(
        "Add",
        g.add("Unsqueeze", g.add("Mul", kv_token, g.ints(per_token)), g.ints(2)),
        g.add("Constant", value=kv_heads_at),
    )  # [slots, S_f, 2 KV]
    # a step this layout does not run leaves every slot idle: no query rows, no K/V written
    q_run = g.add("Mul", g.add("Mul", q_len, g.ints(fold)), g.add("Cast", cond, to=i64))
    seq_total = g.add("Add", past_s, q_run)
    seqlens_k = g.add("Where", g.add("Greater", q_run, c0), g.add("Sub", seq_total, c1), c0)
    total = g.add("Max", g.add("ReduceMax", seq_total, keepdims=1), s_f)  # [1] L (>= S_f, as GQA needs)

    # allowed[e, s, p] as the padded layout's (past, or new and in the tree), one row per token, repeated fold times
    pos = g.add("Range", g.add("Squeeze", c0), g.add("Squeeze", total), g.add("Squeeze", c1))
    rel = g.add("Sub", g.add("Unsqueeze", pos, c0), g.add("Unsqueeze", past_s, c1))
    in_past = g.add("Less", rel, c0)
    in_new = g.add("And", g.add("Not", in_past), g.add("Less", rel, g.add("Unsqueeze", q_len, c1)))
    tree_width = g.add("Shape", tree_mask, start=1, end=2)
    rel_c = g.add("Max", g.add("Min", rel, g.add("Sub", tree_width, c1)), c0)
    rows = g.add("Gather", tree_mask, pad, axis=0)
    rel_x = g.add("Expand", g.add("Unsqueeze", rel_c, c1), g.add("Concat", n_slots, width, total, axis=0))
    tree_l = g.add("GatherElements", rows, rel_x, axis=2)
    allowed = g.add("Or", g.add("Unsqueeze", in_past, c1), g.add("And", g.add("Unsqueeze", in_new, c1), tree_l))
    allowed = g.add(
        "Expand",
        g.add("Unsqueeze", allowed, g.ints(1, 3)),
        g.add("Concat", n_slots, c1, width, g.ints(fold), total, axis=0),
    )  # [slots, 1, S', fold, L]
    allowed = g.add("Reshape", allowed, g.add("Concat", n_slots, c1, s_f, total, axis=0))

    # packed token t -> its slot's row s -> output row ((slot * S' + s) * fold + g) * KV + j of head j * fold + g
    n_tok = g.add("Shape", tree_mask, start=0, end=1)
    tok = g.add("Range", g.add("Squeeze", c0), g.add("Squeeze", n_tok), g.add("Squeeze", c1))
    after = g.add("Cast", g.add("GreaterOrEqual", g.add("Unsqueeze", tok, c1), g.add("Unsqueeze", ends, c0)), to=i64)
    tok_seq = g.add("ReduceSum", after, c1, keepdims=0)
    tok_off = g.add("Sub", tok, g.add("Gather", starts, tok_seq))
    tok_off = g.add("Min", tok_off, g.add("Sub", width, c1))  # a longer chunk (the other layout's step) stays in range
    row = g.add("Add", g.add("Mul", g.add("Gather", slots, tok_seq), width), tok_off)
    head_rows = helper.make_tensor(
        g.name("hr"), i64, [1, heads], [(h % fold) * kv_heads + h // fold for h in range(heads)]
    )
    out_index = g.add(
        "Add", g.add("Unsqueeze", g.add("Mul", row, g.ints(fold * kv_heads)), c1), g.add("Constant", value=head_rows)
    )
    return Fold(
        cond=cond,
        qkv_index=g.add("Concat", q_index, kv_index, axis=2),
        q_shape=g.add("Concat", n_slots, s_f, cm1, axis=0),
        out_index=out_index,
        seqlens_k=g.add("Cast", seqlens_k, to=i32),
        query_seqlens=g.add("Cast", q_run, to=i32),
        total=g.add("Cast", g.add("Squeeze", total), to=i32),
        allowed=allowed,
    )

"""A layer's q, k and v as one packed ``[T, (H + 2 Hkv) * D]`` tensor rotated by one ``RotaryEmbedding`` (ort_fuse).

Why: GroupQueryAttention reads q, k and v packed in one input, so a layer's attention needs one
gather into its layout instead of three, one cast to a narrow cache type instead of three, and no
reshapes between. The exporter's q, k and v are views of one projection (the fused ``q|k|v`` linear)
sliced by columns: that projection's output *is* the packed tensor. Otherwise the three are
concatenated (one node).

RoPE: the matched ``x * cos + rotate_half(x) * sin`` of q and of k (``ort_rotary.Rope``, the same
tables) becomes one ``RotaryEmbedding`` over the packed rows viewed ``[T, 1, H + 2 Hkv, D]`` (batch =
token, one "head", the heads as its sequence): each (token, head) reads its own row of the tables
through ``position_ids [T, H + 2 Hkv]``, the token's row for a q or k head and an identity row
(cos 1, sin 0) for a v head, which leaves v as it is bit for bit (``x * 1 - y * 0 = x``). The
rotation of a q or k head is the kernel's own formula on the same numbers as before, so the
logits do not change.
"""

from __future__ import annotations

from dataclasses import dataclass

from onnx import TensorProto

from specdec.runtime.backends.onnx_edit import MS_DOMAIN, GraphEditor
from specdec.runtime.backends.ort_rotary import Rope, rope_tables


@dataclass(frozen=True)
class Packed:
    """A layer's attention inputs packed: ``rows [T, W * D]`` and its view ``flat [T * W, D]`` (``W = H + 2 Hkv``:
    row ``t * W + h`` is head h of token t, q heads first, then k, then v)."""

    rows: str
    flat: str
    width: int  # W, heads per token
    head_dim: int
    rotated: bool  # whether RoPE is applied here (both matched RoPEs of q and k)


def _column_slice(g: GraphEditor, x: str, dims: dict[str, list[int | None]]) -> tuple[str, int, int] | None:
    """``(P, start, stop)`` when ``x`` is ``Reshape(Slice(P, start, stop, last axis), [., H, D])`` of a 2-D ``P``."""
    view = g.node_of(x, "Reshape")
    cut = view and g.node_of(view.input[0], "Slice")
    if not cut or len(cut.input) < 3:
        return None
    source = dims.get(cut.input[0])
    starts, stops = g.const_value(cut.input[1]), g.const_value(cut.input[2])
    axes = g.const_value(cut.input[3]) if len(cut.input) > 3 and cut.input[3] else [0]
    steps = g.const_value(cut.input[4]) if len(cut.input) > 4 and cut.input[4] else [1]
    if not (source and len(source) == 2 and source[1] and starts and stops and axes and steps):
        return None
    if len(starts) != 1 or axes[0] not in (1, -1) or steps[0] != 1:
        return None
    return cut.input[0], int(starts[0]), min(int(stops[0]), int(source[1]))


def pack_qkv(
    g: GraphEditor,
    q: str,
    k: str,
    v: str,
    heads: int,
    kv_heads: int,
    head_dim: int,
    dims: dict[str, list[int | None]],
    ropes: dict[str, Rope],
) -> Packed:
    """q, k, v (``[T, heads, D]`` views, q and k maybe the outputs of matched RoPEs) as one packed, rotated tensor."""
    rope_q, rope_k = ropes.get(q), ropes.get(k)
    rotate = bool(rope_q and rope_k and (rope_q.f, rope_q.cast) == (rope_k.f, rope_k.cast))
    if rotate:
        q, k = rope_q.x, rope_k.x  # type: ignore[union-attr]
    width = heads + 2 * kv_heads
    cuts = [_column_slice(g, x, dims) for x in (q, k, v)]
    bounds = [0, heads * head_dim, (heads + kv_heads) * head_dim, width * head_dim]
    source = cuts[0][0] if cuts[0] else None
    if (
        source is not None
        and all(c and c[0] == source and (c[1], c[2]) == (bounds[i], bounds[i + 1]) for i, c in enumerate(cuts))
        and (dims.get(source) or [None, None])[1] == width * head_dim
    ):
        rows = str(source)
    else:
        rows = g.add(
            "Concat",
            *(g.add("Reshape", x, g.ints(-1, n * head_dim)) for x, n in ((q, heads), (k, kv_heads), (v, kv_heads))),
            axis=1,
        )
    if rotate:
        cos, sin = _identity_tables(g, rope_q, width)  # type: ignore[arg-type]
        turned = g.add(
            "RotaryEmbedding",
            g.add("Reshape", rows, g.ints(-1, 1, width, head_dim)),
            _positions(g, rope_q.f, heads + kv_heads, kv_heads),  # type: ignore[union-attr]
            cos,
            sin,
            domain=MS_DOMAIN,
            interleaved=0,
        )
        rows = g.add("Reshape", turned, g.ints(-1, width * head_dim))
    flat = g.add("Reshape", rows, g.ints(-1, head_dim))
    return Packed(rows=rows, flat=flat, width=width, head_dim=head_dim, rotated=rotate)


def _identity_tables(g: GraphEditor, rope: Rope, width: int) -> tuple[str, str]:
    """``rope_tables`` (T + 1 rows) and ``width`` more rows of cos 1 and sin 0: the identity, from row T + 1.

    Why ``width`` of them: ``RotaryEmbedding`` refuses tables with fewer rows than its input's sequence axis,
    which here holds a token's ``width`` heads (a one-token step would have T + 2 < width rows).
    """
    key = ("rope_identity", rope.f, rope.cast, width)
    if key not in g.shared:
        cos, sin = rope_tables(g, rope)
        half = g.add("Shape", cos, start=1, end=2)
        shape = g.add("Concat", g.ints(width), half, axis=0)
        dtype = TensorProto.FLOAT if rope.cast is None else rope.cast
        one = g.add("Expand", g.scalar(1.0, dtype), shape)
        zero = g.add("Expand", g.scalar(0.0, dtype), shape)
        g.shared[key] = (g.add("Concat", cos, one, axis=0), g.add("Concat", sin, zero, axis=0))
    return g.shared[key]


def _positions(g: GraphEditor, f: str, rotated_heads: int, kept_heads: int) -> str:
    """``position_ids [T, rotated + kept]``: token t's table row t for the rotated heads, the identity row T + 1
    for the kept ones (``f [T, D/2]``: the per-token angles)."""
    key = ("rope_positions", f, rotated_heads, kept_heads)
    if key not in g.shared:
        tokens = g.add("Shape", f, start=0, end=1)  # [1] T
        tok = g.add("Range", g.add("Squeeze", g.ints(0)), g.add("Squeeze", tokens), g.add("Squeeze", g.ints(1)))
        turned = g.add(
            "Expand", g.add("Unsqueeze", tok, g.ints(1)), g.add("Concat", tokens, g.ints(rotated_heads), axis=0)
        )
        identity = g.add("Add", tokens, g.ints(1))  # [1] = T + 1
        kept = g.add(
            "Expand", g.add("Unsqueeze", identity, g.ints(1)), g.add("Concat", tokens, g.ints(kept_heads), axis=0)
        )
        g.shared[key] = g.add("Concat", turned, kept, axis=1)
    return g.shared[key]

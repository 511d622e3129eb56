"""The exporter's RoPE lowered to ONNX Runtime's ``com.microsoft.RotaryEmbedding`` (``ort_fuse``'s rotary rewrite).

A matched ``x * cos + rotate_half(x) * sin`` whose tables are the graph's own ``Cos/Sin(Concat(f, f))``
becomes ``RotaryEmbedding`` with per-token tables ``Cos(f)`` / ``Sin(f)`` (their first halves). The
fused attention applies a matched RoPE itself on its padded rows (``rope_tables``); ``fuse_rotary``
lowers the ones something else reads.
"""

from __future__ import annotations

from dataclasses import dataclass

import onnx

from specdec.runtime.backends.onnx_edit import MS_DOMAIN, GraphEditor
from specdec.runtime.backends.ort_norms import last_axis


@dataclass
class Rope:
    """A matched ``x * cos + rotate_half(x) * sin`` whose tables are ``Cos/Sin(Concat(f, f))`` (+ Cast)."""

    root: onnx.NodeProto  # the final Add
    x: str  # [T, H, D]
    f: str  # [T, D/2] position * inv_freq
    cast: int | None  # dtype the tables are cast to (fp16 graphs)


def _rope_table(g: GraphEditor, table: str, kind: str) -> tuple[str, int | None] | None:
    """(f, cast dtype) when ``table`` is ``Unsqueeze(Cast?(kind(Concat(f, f))), [1])``, else None."""
    unsq = g.node_of(table, "Unsqueeze")
    if unsq is None or len(unsq.input) < 2 or g.const_value(unsq.input[1]) != [1]:
        return None
    cast = g.node_of(unsq.input[0], "Cast")
    trig = g.node_of(cast.input[0] if cast else unsq.input[0], kind)
    cat = trig and g.node_of(trig.input[0], "Concat")
    if not cat or len(cat.input) != 2 or cat.input[0] != cat.input[1] or int(g.attr(cat, "axis")) != -1:
        return None
    return cat.input[0], (int(g.attr(cast, "to")) if cast else None)


def rope_tables(g: GraphEditor, rope: Rope) -> tuple[str, str]:
    """The per-token tables ``Cos(f)``, ``Sin(f)`` (the first halves of the graph's own), one row longer.

    ``RotaryEmbedding`` refuses an input with more padded rows than its tables have rows, and a
    step of one decoding sequence has one token but two padded rows (its discarded second query
    row): the extra row (a copy of the first, never indexed) makes ``T + 1 >= S`` hold always.
    """
    key = ("rope", rope.f, rope.cast)
    if key not in g.shared:
        f = g.add("Concat", rope.f, g.add("Slice", rope.f, g.ints(0), g.ints(1), g.ints(0)), axis=0)  # [T + 1, D/2]
        cos, sin = g.add("Cos", f), g.add("Sin", f)
        if rope.cast is not None:
            cos, sin = g.add("Cast", cos, to=rope.cast), g.add("Cast", sin, to=rope.cast)
        g.shared[key] = (cos, sin)
    return g.shared[key]


def _match_rope(g: GraphEditor, root: onnx.NodeProto, dims: dict[str, list[int | None]]) -> Rope | None:
    for a, b in (root.input, reversed(root.input)):
        m1, m2 = g.node_of(a, "Mul"), g.node_of(b, "Mul")
        if not (m1 and m2):
            continue
        for x, cos in (m1.input, reversed(m1.input)):
            for rot, sin in (m2.input, reversed(m2.input)):
                cat = g.node_of(rot, "Concat")
                neg = cat and len(cat.input) == 2 and g.node_of(cat.input[0], "Neg")
                hi = neg and g.node_of(neg.input[0], "Slice")
                lo = hi and cat and g.node_of(cat.input[1], "Slice")
                shape = dims.get(x)
                if not (
                    cat and hi and lo and hi.input[0] == lo.input[0] == x and shape and len(shape) == 3 and shape[2]
                ):
                    continue
                half = int(shape[2]) // 2
                c, s = _rope_table(g, cos, "Cos"), _rope_table(g, sin, "Sin")
                f_dims = dims.get(c[0]) if c else None
                if (
                    c
                    and s
                    and c == s
                    and f_dims
                    and f_dims[-1] == half
                    and 2 * half == shape[2]
                    and g.const_value(lo.input[1]) == [0]
                    and g.const_value(lo.input[2]) == [half]
                    and g.const_value(hi.input[1]) == [half]
                    and (g.const_value(hi.input[2]) or [0])[0] >= 2 * half
                    and all(last_axis(g, n, {x: 3}) for n in (lo, hi))
                    and all(len(n.input) < 5 or g.const_value(n.input[4]) == [1] for n in (lo, hi))
                    and int(g.attr(cat, "axis")) in (-1, 2)
                ):
                    return Rope(root=root, x=x, f=c[0], cast=c[1])
    return None


def match_ropes(g: GraphEditor, dims: dict[str, list[int | None]]) -> dict[str, Rope]:
    """Every RoPE of the graph, by the name of its output."""
    ropes = {}
    for root in g.graph.node:
        if root.op_type == "Add" and root.domain == "" and len(root.input) == 2:
            rope = _match_rope(g, root, dims)
            if rope is not None:
                ropes[root.output[0]] = rope
    return ropes


def fuse_rotary(g: GraphEditor, ropes: dict[str, Rope], fused: set[int]) -> set[int]:
    """The RoPEs still needed outside fused attention -> RotaryEmbedding over ``[T, H, 1, D]`` (batch T)."""
    outputs = {o.name for o in g.graph.output}
    replaced: set[int] = set()
    for name, rope in ropes.items():
        if name not in outputs and all(id(n) in fused for n in g.consumers.get(name, [])):
            continue  # only fused attention read it, and that applies the rotation itself
        cos, sin = rope_tables(g, rope)
        if ("positions", rope.f) not in g.shared:
            tok = g.add(
                "Range",
                g.add("Squeeze", g.ints(0)),
                g.add("Squeeze", g.add("Shape", rope.f, start=0, end=1)),
                g.add("Squeeze", g.ints(1)),
            )
            g.shared[("positions", rope.f)] = g.add("Unsqueeze", tok, g.ints(1))  # [T, 1]: token t uses row t
        axis = g.ints(2)
        rotated = g.add(
            "RotaryEmbedding",
            g.add("Unsqueeze", rope.x, axis),
            g.shared[("positions", rope.f)],
            cos,
            sin,
            domain=MS_DOMAIN,
            interleaved=0,
        )
        g.add("Squeeze", rotated, axis, outputs=[name])
        replaced.add(id(rope.root))
    return replaced

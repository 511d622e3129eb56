"""The RMSNorm patterns of an exported graph lowered to ONNX Runtime's fused norms (``ort_fuse``'s rmsnorm rewrites).

``SimplifiedLayerNormalization`` for the exporter's ``w * (x * 1 / Sqrt(ReduceMean(x ** 2) + eps))``
(ORT's own fusion wants ``Div``), and ``SkipSimplifiedLayerNormalization`` for a residual ``Add``
feeding such a norm (ORT does not fuse it: the sum has other readers). Each rewrite returns the ids of
the nodes it replaced, which ``fuse_model`` drops and counts.
"""

from __future__ import annotations

import onnx
from onnx import TensorProto

from specdec.runtime.backends.onnx_edit import MS_DOMAIN, GraphEditor


def _is_const(g: GraphEditor, name: str, value: float) -> bool:
    values = g.const_value(name)
    return values is not None and len(values) == 1 and float(values[0]) == value


def last_axis(g: GraphEditor, node: onnx.NodeProto, ranks: dict[str, int]) -> bool:
    """ReduceMean/Slice/Concat over the last axis only (axes as input or attribute)."""
    rank = ranks.get(node.input[0])
    if node.op_type == "ReduceMean":
        axes = g.const_value(node.input[1]) if len(node.input) > 1 and node.input[1] else g.attr(node, "axes")
    elif node.op_type == "Slice":
        axes = g.const_value(node.input[3]) if len(node.input) > 3 and node.input[3] else None
    else:
        axes = [g.attr(node, "axis")]
    if axes is None or len(axes) != 1:
        return False
    return int(axes[0]) == -1 or (rank is not None and int(axes[0]) == rank - 1)


def fuse_rmsnorm(g: GraphEditor, types: dict[str, int], ranks: dict[str, int]) -> set[int]:
    """``w * (x * 1 / Sqrt(ReduceMean(x ** 2) + eps))`` (fp16: casts around it) -> SimplifiedLayerNormalization."""
    replaced: set[int] = set()
    for root in g.graph.node:
        if root.op_type != "Mul" or root.domain != "":
            continue
        for w, y in (root.input, reversed(root.input)):
            if w not in g.consts or len(g.consts[w].dims) != 1:
                continue
            cast_out = g.node_of(y, "Cast")
            prod = g.node_of(cast_out.input[0] if cast_out else y, "Mul")
            if prod is None:
                continue
            for x32, r in (prod.input, reversed(prod.input)):
                recip = g.node_of(r, "Reciprocal")
                sqrt = recip and g.node_of(recip.input[0], "Sqrt")
                add = sqrt and g.node_of(sqrt.input[0], "Add")
                if not add:
                    continue
                mean_name, eps_name = add.input if g.const_value(add.input[1]) is not None else reversed(add.input)
                eps = g.const_value(eps_name)
                mean = g.node_of(mean_name, "ReduceMean")
                power = mean and g.node_of(mean.input[0], "Pow")
                if not (
                    mean
                    and power
                    and power.input[0] == x32
                    and _is_const(g, power.input[1], 2.0)
                    and eps
                    and len(eps) == 1
                    and int(g.attr(mean, "keepdims", 1)) == 1
                    and last_axis(g, mean, ranks)
                ):
                    continue
                cast_in = g.node_of(x32, "Cast")
                if (cast_in is None) != (cast_out is None):
                    continue
                x = cast_in.input[0] if cast_in else x32
                if cast_in and (types.get(x) != types.get(root.output[0]) or types.get(x32) != TensorProto.FLOAT):
                    continue
                g.add(
                    "SimplifiedLayerNormalization",
                    x,
                    w,
                    outputs=[root.output[0]],
                    axis=-1,
                    epsilon=float(eps[0]),
                    stash_type=1,
                )
                replaced.add(id(root))
                break
            if id(root) in replaced:
                break
    return replaced


def fuse_skip(g: GraphEditor) -> set[int]:
    """``n = SimplifiedLayerNormalization(a + b, w)`` -> ``SkipSimplifiedLayerNormalization(a, b, w)`` (n and a + b)."""
    replaced: set[int] = set()
    for norm in list(g.new_nodes):
        if norm.op_type != "SimplifiedLayerNormalization":
            continue
        add = g.node_of(norm.input[0], "Add")
        if add is None or id(add) in replaced or len(add.input) != 2 or add.input[0] == add.input[1]:
            continue
        eps = float(g.attr(norm, "epsilon"))
        g.add(
            "SkipSimplifiedLayerNormalization",
            add.input[0],
            add.input[1],
            norm.input[1],
            outputs=[norm.output[0], "", "", add.output[0]],
            domain=MS_DOMAIN,
            epsilon=eps,
        )
        replaced |= {id(add), id(norm)}
    return replaced

"""``GraphEditor``, the one library the export's quantization and the runtime's lowerings edit graphs with.

The quantizer relies on ``in_place_of`` + ``commit(sort=False)`` keeping the node order it edited
(its graphs are node-for-node what they were before the editor took them over); the lowerings on
``commit(sort=True)`` putting new nodes before their first reader and dropping dead ones.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from specdec.runtime.backends.onnx_edit import MS_DOMAIN, GraphEditor


def _chain() -> onnx.ModelProto:
    """y = ((x + a) * w) - x over x [2]: three nodes, two initializers."""
    nodes = [
        helper.make_node("Add", ["x", "a"], ["s"], name="add"),
        helper.make_node("Mul", ["s", "w"], ["p"], name="mul"),
        helper.make_node("Sub", ["p", "x"], ["y"], name="sub"),
    ]
    inits = [numpy_helper.from_array(np.full(2, v, np.float32), n) for n, v in (("a", 1.0), ("w", 3.0))]
    io = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2]) for n in ("x", "y")]
    return helper.make_model(
        helper.make_graph(nodes, "g", io[:1], io[1:], inits), opset_imports=[helper.make_opsetid("", 20)]
    )


def _run(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]


def test_in_place_edits_keep_the_order_and_drop_what_only_the_replaced_node_read() -> None:
    model = _chain()
    g = GraphEditor(model, "t")
    mul = g.node_of("p", "Mul")
    with g.in_place_of(mul):  # s * w -> s * 5, in two nodes with given names
        five = g.initializer(np.full(2, 5.0, np.float32), "five")
        g.add("Mul", "s", five, outputs=["p"], name="mul5", metadata={"why": "test"})
    g.commit(sort=False)
    assert [n.name for n in model.graph.node] == ["add", "mul5", "sub"]
    assert [i.name for i in model.graph.initializer] == ["a", "five"]  # w was read by the replaced node only
    assert GraphEditor.metadata(model.graph.node[1]) == {"why": "test"}
    assert not model.graph.node[1].HasField("domain")  # the default domain left unset, as the exporter's nodes
    np.testing.assert_array_equal(_run(model, np.array([1.0, 2.0], np.float32)), [9.0, 13.0])


def test_new_nodes_are_sorted_before_their_readers_with_fresh_names_and_their_domain_imported() -> None:
    model = _chain()
    g = GraphEditor(model, "t")
    sub = g.node_of("y", "Sub")
    g.remove(sub)
    g.add("Identity", "p", outputs=["y"])  # emitted after the graph's nodes, read by nothing yet
    g.add("Relu", "x")  # reaches no output: dropped when sorted
    g.commit(sort=True)
    assert [n.op_type for n in model.graph.node] == ["Add", "Mul", "Identity"]
    assert model.graph.node[2].name.startswith("t/Identity_node/")
    np.testing.assert_array_equal(_run(model, np.array([1.0, 2.0], np.float32)), [6.0, 9.0])
    g = GraphEditor(model, "t")
    g.add("MatMulNBits", "x", outputs=["unused"], domain=MS_DOMAIN)
    g.commit(sort=False)
    assert [o.domain for o in model.opset_import] == ["", MS_DOMAIN]

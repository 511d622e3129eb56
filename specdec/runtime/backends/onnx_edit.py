"""Editing an ONNX graph's node list with fresh names: what ``ort_fuse``'s rewrites build their subgraphs with.

Why apart from the rewrites: matching patterns and emitting nodes are two concerns, and every
rewrite (attention, norms, rotary) shares this one editor and its ``shared`` cache of tensors
built once per graph.
"""

from __future__ import annotations

from collections.abc import Sequence

import onnx
from onnx import TensorProto, helper, numpy_helper


class GraphEditor:
    """Node-list editing with fresh names: ``g.add(op, *inputs, **attrs)`` returns the new node's output."""

    def __init__(self, model: onnx.ModelProto) -> None:
        self.model = model
        self.graph = model.graph
        self.consts = {i.name: i for i in self.graph.initializer}
        self.producer: dict[str, onnx.NodeProto] = {}
        self.consumers: dict[str, list[onnx.NodeProto]] = {}
        for node in self.graph.node:
            for out in node.output:
                self.producer[out] = node
            for inp in node.input:
                self.consumers.setdefault(inp, []).append(node)
        self._count = 0
        self.new_nodes: list[onnx.NodeProto] = []
        self.shared: dict[tuple, object] = {}  # tensors built once and used by several rewrites

    def name(self, tag: str) -> str:
        self._count += 1
        return f"ort_fuse/{tag}/{self._count}"

    def add(self, op: str, *inputs: str, outputs: Sequence[str] | None = None, domain: str = "", n_out: int = 1,
            **attrs: object) -> str:
        outs = list(outputs) if outputs is not None else [self.name(op) for _ in range(n_out)]
        self.new_nodes.append(helper.make_node(op, list(inputs), outs, name=self.name(op + "_node"), domain=domain,
                                               **attrs))
        return outs[0]

    def ints(self, *values: int) -> str:
        return self.add("Constant", value=helper.make_tensor(self.name("c"), TensorProto.INT64, [len(values)],
                                                               list(values)))

    def scalar(self, value: float, dtype: int) -> str:
        return self.add("Constant", value=helper.make_tensor(self.name("c"), dtype, [], [value]))

    def const_value(self, name: str) -> list[float] | None:
        """The values of a constant tensor (initializer or Constant node), flattened; None if not constant."""
        if name in self.consts:
            return numpy_helper.to_array(self.consts[name]).reshape(-1).tolist()
        node = self.producer.get(name)
        if node is not None and node.op_type == "Constant" and node.domain == "":
            for attr in node.attribute:
                if attr.name == "value":
                    return numpy_helper.to_array(attr.t).reshape(-1).tolist()
        return None

    def node_of(self, name: str, op: str) -> onnx.NodeProto | None:
        node = self.producer.get(name)
        return node if node is not None and node.op_type == op and node.domain == "" else None

    def attr(self, node: onnx.NodeProto, name: str, default: object = None) -> object:
        for a in node.attribute:
            if a.name == name:
                return helper.get_attribute_value(a)
        return default

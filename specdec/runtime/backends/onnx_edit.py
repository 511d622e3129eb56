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

    def add(
        self,
        op: str,
        *inputs: str,
        outputs: Sequence[str] | None = None,
        domain: str = "",
        n_out: int = 1,
        **attrs: object,
    ) -> str:
        outs = list(outputs) if outputs is not None else [self.name(op) for _ in range(n_out)]
        self.new_nodes.append(
            helper.make_node(op, list(inputs), outs, name=self.name(op + "_node"), domain=domain, **attrs)
        )
        return outs[0]

    def ints(self, *values: int) -> str:
        return self.add(
            "Constant", value=helper.make_tensor(self.name("c"), TensorProto.INT64, [len(values)], list(values))
        )

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


def outer_inputs(node: onnx.NodeProto) -> set[str]:
    """The outer-scope names the subgraphs of ``node`` (an ``If``'s branches) read: its inputs beside ``input``."""
    names: set[str] = set()
    for attr in node.attribute:
        for sub in [attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs):
            made = {o for n in sub.node for o in n.output} | {i.name for i in sub.initializer}
            for n in sub.node:
                names |= {i for i in (*n.input, *outer_inputs(n)) if i and i not in made}
    return names


def live_sorted(graph: onnx.GraphProto, nodes: list[onnx.NodeProto]) -> list[onnx.NodeProto]:
    """The nodes that reach a graph output, in a topological order close to the given one."""
    producer = {out: i for i, n in enumerate(nodes) for out in n.output if out}
    inputs = [[*n.input, *sorted(outer_inputs(n))] for n in nodes]  # an If's branches read outer values too
    live: set[int] = set()
    stack = [producer[o.name] for o in graph.output if o.name in producer]
    while stack:
        i = stack.pop()
        if i in live:
            continue
        live.add(i)
        stack.extend(producer[name] for name in inputs[i] if name in producer)
    order: list[onnx.NodeProto] = []
    done: set[int] = set()

    def visit(i: int) -> None:  # iterative DFS: the graph is thousands of nodes deep
        todo = [(i, False)]
        while todo:
            j, expanded = todo.pop()
            if j in done:
                continue
            if expanded:
                done.add(j)
                order.append(nodes[j])
                continue
            todo.append((j, True))
            todo.extend((producer[n], False) for n in reversed(inputs[j]) if n in producer and producer[n] not in done)

    for i in sorted(live):
        visit(i)
    return order

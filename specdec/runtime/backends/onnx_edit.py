"""The one library that edits ONNX graphs: the runtime's load-time lowerings and the export's quantization alike.

Both make the same kind of edit to an ``onnx.ModelProto``: match nodes, emit a few new ones (with
fresh or given names, new initializers, metadata), drop what they replace and put the node list
back in order. ``GraphEditor`` is that edit, once: ``ort_fuse`` and ``ort_cache_dtype`` lower a copy
a session opens, ``specdec.export.quantization`` rewrites a file's linear layers.

Why this editor and not ``onnx_ir`` (shipped with onnxscript, the exporter's own IR): the runtime's
rewrites work on the protobuf ONNX Runtime is handed (loaded without its weights, serialized
again for the session), with pattern matches written against it; moving them onto ``onnx_ir`` would
convert every graph to the IR and back at each session start and rewrite every match, to build the
same nodes. The quantizer's edits are replacements of one node by a few, which this editor states in
as many lines as ``onnx_ir`` would.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

#: ONNX Runtime's contrib-op domain (MatMulNBits, GroupQueryAttention, ...)
MS_DOMAIN = "com.microsoft"


class GraphEditor:
    """Node-list editing: ``g.add(op, *inputs, **attrs)`` emits a node and returns its output; ``commit`` applies.

    New nodes go to ``new_nodes`` (placed by ``commit(sort=True)`` before their first reader), or, inside
    ``in_place_of(node)``, where ``node`` stood; ``name`` makes fresh names under ``prefix``.
    """

    def __init__(self, model: onnx.ModelProto, prefix: str) -> None:
        self.model = model
        self.graph = model.graph
        self.prefix = prefix
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
        self.new_initializers: list[onnx.TensorProto] = []
        self.shared: dict[tuple, Any] = {}  # tensors built once and used by several rewrites
        self._sink = self.new_nodes
        self._placed: dict[int, list[onnx.NodeProto]] = {}
        self.removed: set[int] = set()  # ids of the nodes ``commit`` drops

    def name(self, tag: str) -> str:
        self._count += 1
        return f"{self.prefix}/{tag}/{self._count}"

    def add(
        self,
        op: str,
        *inputs: str,
        outputs: Sequence[str] | None = None,
        name: str | None = None,
        domain: str = "",
        n_out: int = 1,
        metadata: Mapping[str, str] | None = None,
        **attrs: Any,
    ) -> str:
        """Emit ``op`` (its attributes ``attrs``); its first output, fresh unless ``outputs`` names them."""
        outs = list(outputs) if outputs is not None else [self.name(op) for _ in range(n_out)]
        node = helper.make_node(
            op, list(inputs), outs, name=name or self.name(op + "_node"), domain=domain or None, **attrs
        )  # the default domain stays unset, as in the exporter's nodes
        for key, value in (metadata or {}).items():
            node.metadata_props.add(key=key, value=value)
        self._sink.append(node)
        return outs[0]

    def initializer(self, value: np.ndarray | np.generic, name: str) -> str:
        """A new initializer ``name`` holding ``value``; its name."""
        tensor = numpy_helper.from_array(np.asarray(value), name)
        self.new_initializers.append(tensor)
        self.consts[name] = tensor
        return name

    def ints(self, *values: int) -> str:
        return self.add(
            "Constant", value=helper.make_tensor(self.name("c"), TensorProto.INT64, [len(values)], list(values))
        )

    def scalar(self, value: float, dtype: int) -> str:
        return self.add("Constant", value=helper.make_tensor(self.name("c"), dtype, [], [value]))

    @contextmanager
    def emitting_into(self, nodes: list[onnx.NodeProto]) -> Iterator[list[onnx.NodeProto]]:
        """Nodes added meanwhile go to ``nodes`` (an ``If`` branch's, say) instead of the graph."""
        before, self._sink = self._sink, nodes
        try:
            yield nodes
        finally:
            self._sink = before

    @contextmanager
    def in_place_of(self, node: onnx.NodeProto) -> Iterator[list[onnx.NodeProto]]:
        """``node`` is removed and the nodes added meanwhile stand where it stood."""
        self.remove(node)
        with self.emitting_into(self._placed.setdefault(id(node), [])) as nodes:
            yield nodes

    def remove(self, node: onnx.NodeProto) -> None:
        self.removed.add(id(node))

    def commit(self, sort: bool) -> None:
        """Apply the edit: the node list (in topological order when ``sort``, else as edited), the initializers
        some node still reads followed by the new ones, and an opset for each new domain."""
        nodes: list[onnx.NodeProto] = []
        for node in self.graph.node:
            nodes += self._placed.get(id(node), [])
            if id(node) not in self.removed:
                nodes.append(node)
        nodes += [n for n in self.new_nodes if id(n) not in self.removed]
        if sort:
            nodes = live_sorted(self.graph, nodes)
        used = {name for n in nodes for name in (*n.input, *outer_inputs(n))} | {o.name for o in self.graph.output}
        initializers = [i for i in self.graph.initializer if i.name in used]
        del self.graph.node[:]
        self.graph.node.extend(nodes)
        del self.graph.initializer[:]
        self.graph.initializer.extend([*initializers, *self.new_initializers])
        known = {o.domain for o in self.model.opset_import}
        for domain in dict.fromkeys(n.domain for n in nodes if n.domain and n.domain not in known):
            self.model.opset_import.append(helper.make_opsetid(domain, 1))

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

    def array(self, name: str) -> np.ndarray:
        """The value of the initializer ``name`` (its weights loaded)."""
        return numpy_helper.to_array(self.consts[name])

    def node_of(self, name: str, op: str) -> onnx.NodeProto | None:
        node = self.producer.get(name)
        return node if node is not None and node.op_type == op and node.domain == "" else None

    def nodes(self, op: str, domain: str = "") -> list[onnx.NodeProto]:
        """The graph's ``op`` nodes of ``domain``, in order."""
        return [n for n in self.graph.node if n.op_type == op and n.domain == domain]

    @staticmethod
    def attr(node: onnx.NodeProto, name: str, default: Any = None) -> Any:
        """``node``'s attribute ``name`` as onnx reads it (an int, float, string, list, tensor or graph: the node's
        op decides, so its caller knows which), else ``default``."""
        for a in node.attribute:
            if a.name == name:
                return helper.get_attribute_value(a)
        return default

    @staticmethod
    def attrs(node: onnx.NodeProto) -> dict[str, Any]:
        return {a.name: helper.get_attribute_value(a) for a in node.attribute}

    @staticmethod
    def set_attr(node: onnx.NodeProto, name: str, value: object) -> None:
        """Set (or replace) ``node``'s attribute ``name``; it becomes the last one."""
        kept = [a for a in node.attribute if a.name != name]
        del node.attribute[:]
        node.attribute.extend([*kept, helper.make_attribute(name, value)])

    @staticmethod
    def metadata(node: onnx.NodeProto) -> dict[str, str]:
        return {p.key: p.value for p in node.metadata_props}


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

"""Stand-ins for the TensorRT tests: graphs with the exported I/O, TensorRT's network and builder API as
``build_engine`` and the plugin's network edits call it, and the engine inspector's JSON.

Why stand-ins: the TensorRT path's logic (profiles, network edits, the build's flow and its checks) runs on every
machine this way, the same with or without TensorRT; the real engines are ``test_tensorrt_engines.py``'s.
"""

from __future__ import annotations

import json
import types
from pathlib import Path

from onnx import TensorProto, helper

from specdec.models.loading import LoadedModel
from specdec.runtime.graph_io import CACHE_INPUT, CACHE_OUTPUT, GRAPH_INPUTS, LOGITS, cache_names

REPO = Path(__file__).resolve().parents[1]


def fake_export(path: Path, num_layers: int = 2, kv_heads: int = 2, head_dim: int = 16, vocab: int = 32) -> Path:
    """A graph with exactly the exported I/O (names, dtypes, symbolic dims) and no computation to speak of."""
    np_to_onnx = {"int64": TensorProto.INT64, "int32": TensorProto.INT32, "bool": TensorProto.BOOL}
    dim_names = {"seqs_plus_1": "seqs + 1"}
    inputs = [
        helper.make_tensor_value_info(t.name, np_to_onnx[t.dtype], [dim_names.get(d, d) for d in t.dims])
        for t in GRAPH_INPUTS
    ]
    cache_dims = ["slots", kv_heads, "max_len", head_dim]
    inputs += [
        helper.make_tensor_value_info(n, TensorProto.FLOAT, cache_dims) for n in cache_names(num_layers, CACHE_INPUT)
    ]
    outputs = [helper.make_tensor_value_info(LOGITS, TensorProto.FLOAT, ["rows", vocab])]
    outputs += [
        helper.make_tensor_value_info(n, TensorProto.FLOAT, cache_dims) for n in cache_names(num_layers, CACHE_OUTPUT)
    ]
    nodes = [
        helper.make_node("Identity", [i], [o])
        for i, o in zip(cache_names(num_layers, CACHE_INPUT), cache_names(num_layers, CACHE_OUTPUT))
    ]
    graph = helper.make_graph(nodes, "fake", inputs, outputs)
    import onnx

    onnx.save(helper.make_model(graph), str(path))
    return path


def export_tiny_graph(directory: Path) -> tuple[Path, LoadedModel]:
    """A real 2-layer export (fp32) and its model: test_onnx_backend's GQA model, whose graph is exported once per
    session (``tests/export_cache.py``)."""
    from specdec.export.onnx import export_onnx
    from specdec.models.loading import tiny_random

    model = tiny_random(seed=1, num_layers=2)
    return export_onnx(model, directory / "model.onnx"), model


class Tensor:
    """A network tensor: its name and dtype (TensorRT's ``ITensor``)."""

    def __init__(self, name: str, dtype: str) -> None:
        self.name, self.dtype = name, dtype


class Layer:
    """A network layer with its inputs (TensorRT's ``ILayer``)."""

    def __init__(self, name: str, kind: str, inputs: list[Tensor]) -> None:
        self.name, self.type, self.inputs = name, kind, inputs

    @property
    def num_inputs(self) -> int:
        return len(self.inputs)

    def get_input(self, i: int) -> Tensor:
        return self.inputs[i]

    def set_input(self, i: int, tensor: Tensor) -> None:
        self.inputs[i] = tensor

    def get_output(self, i: int) -> Tensor:
        return Tensor(f"{self.name}:out{i}", "int32")


class Network:
    """A network's layers, and the cast ``cast_bool_inputs`` adds (TensorRT's ``INetworkDefinition``)."""

    def __init__(self, layers: list[Layer]) -> None:
        self.layers = layers

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def get_layer(self, i: int) -> Layer:
        return self.layers[i]

    def add_cast(self, tensor: Tensor, dtype: str) -> Layer:
        layer = Layer(f"cast({tensor.name})", "CAST", [tensor])
        self.layers.append(layer)
        return layer


def inspector_json(layers: list) -> str:
    """What TensorRT's engine inspector answers in JSON for an engine of ``layers``."""
    return json.dumps({"Layers": layers, "Bindings": ["input_ids", "logits"]})


def fake_builder_trt(  # noqa: C901 - a whole stand-in module, its classes read best together
    plugin_layers_made: int, *, has_fp16_flag: bool = True
) -> tuple[types.ModuleType, dict]:
    """A stand-in ``tensorrt`` recording what ``build_engine`` asks of it (the API calls, not their effects)."""
    import onnx

    seen: dict = {"profile": {}, "config_flags": [], "preview": [], "casts": 0}
    trt = types.ModuleType("tensorrt")
    trt.__version__ = "10.9.0.34"
    trt.bool, trt.int32 = "bool", "int32"

    class ILogger:
        Severity = types.SimpleNamespace(ERROR="E", INTERNAL_ERROR="IE", WARNING="W")

        def __init__(self) -> None:
            pass

    trt.ILogger = ILogger
    trt.NetworkDefinitionCreationFlag = types.SimpleNamespace(STRONGLY_TYPED=5)
    trt.OnnxParserFlag = types.SimpleNamespace(ENABLE_PLUGIN_OVERRIDE="override")
    trt.LayerType = types.SimpleNamespace(PLUGIN_V3="PLUGIN_V3")
    trt.ProfilingVerbosity = types.SimpleNamespace(DETAILED="detailed")
    trt.PreviewFeature = types.SimpleNamespace(ALIASED_PLUGIN_IO_10_03="aliased")
    trt.BuilderFlag = types.SimpleNamespace(**({"FP16": "fp16", "BF16": "bf16"} if has_fp16_flag else {}))
    trt.LayerInformationFormat = types.SimpleNamespace(JSON="json")

    class ParsedNetwork(Network):
        def __init__(self) -> None:
            super().__init__([])
            self.inputs: list = []

        @property
        def num_inputs(self) -> int:
            return len(self.inputs)

        def get_input(self, i: int) -> object:
            return self.inputs[i]

        def add_cast(self, tensor: Tensor, dtype: str) -> Layer:
            seen["casts"] += 1
            return super().add_cast(tensor, dtype)

    class Parser:
        def __init__(self, network: ParsedNetwork, logger: object) -> None:
            self.network, self.num_errors = network, 0

        def set_flag(self, flag: str) -> None:
            seen["parser_flag"] = flag

        def parse_from_file(self, path: str) -> bool:
            graph = onnx.load(path, load_external_data=False).graph
            for value in graph.input:
                tensor = Tensor(value.name, "bool" if value.name == "tree_mask" else "x")
                tensor.is_shape_tensor = False
                self.network.inputs.append(tensor)
            mask = self.network.inputs[[t.name for t in self.network.inputs].index("tree_mask")]
            for i in range(plugin_layers_made):
                self.network.layers.append(Layer(f"node_ragged_tree_attention_{i}", "PLUGIN_V3", [mask]))
            return True

    class Profile:
        def set_shape(self, name: str, lo: tuple, opt: tuple, hi: tuple) -> None:
            seen["profile"][name] = (lo, opt, hi)

    class Config:
        def set_preview_feature(self, feature: str, on: bool) -> None:
            seen["preview"].append((feature, on))

        def set_flag(self, flag: str) -> None:
            seen["config_flags"].append(flag)

        def add_optimization_profile(self, profile: Profile) -> None:
            seen["profiles_added"] = seen.get("profiles_added", 0) + 1

    class Builder:
        def __init__(self, logger: object) -> None:
            pass

        def create_network(self, flags: int) -> ParsedNetwork:
            seen["network_flags"] = flags
            seen["network"] = ParsedNetwork()
            return seen["network"]

        def create_builder_config(self) -> Config:
            seen["config"] = Config()
            return seen["config"]

        def create_optimization_profile(self) -> Profile:
            return Profile()

        def build_serialized_network(self, network: ParsedNetwork, config: Config) -> bytes:
            seen["verbosity"] = config.profiling_verbosity
            return b"engine-bytes"

    class Engine:
        def create_engine_inspector(self) -> object:
            layers = [
                {"Name": layer.name, "LayerType": "PluginV3"}
                for layer in seen["network"].layers
                if layer.type == "PLUGIN_V3"
            ]
            return types.SimpleNamespace(get_engine_information=lambda fmt: inspector_json(layers))

    trt.Builder, trt.OnnxParser = Builder, Parser
    trt.Runtime = lambda logger: types.SimpleNamespace(deserialize_cuda_engine=lambda data: Engine())
    return trt, seen

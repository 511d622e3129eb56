"""``build_engine``'s flow against a stand-in ``tensorrt`` (``trt_stand_ins.fake_builder_trt``): strong typing,
the parser's plugin override, one profile over every input, the plugin-count check, the mask cast and the layer
names, the atomic write, nodes that name another plugin, and the precision flags of TensorRT 10 and 11.
"""

from __future__ import annotations

import shutil
import sys
import types
from pathlib import Path

import pytest
import torch
from trt_stand_ins import export_tiny_graph, fake_builder_trt

from specdec.export import tensorrt as trt_export
from specdec.export.tensorrt import EngineBuildError, PluginFallbackError, ProfileSpec
from specdec.models.loading import LoadedModel
from specdec.plugins import onnx_op, trt_plugin
from specdec.runtime.graph_io import CACHE_INPUT, GRAPH_INPUTS, cache_names


@pytest.fixture(scope="module")
def tiny_graph(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, LoadedModel]:
    """A real 2-layer export (fp32) and its model."""
    return export_tiny_graph(tmp_path_factory.mktemp("trt_graph"))


@pytest.fixture
def fake_builder(monkeypatch: pytest.MonkeyPatch):
    """Install a stand-in TensorRT (plus 'a GPU' and 'triton') for build_engine; returns an installer."""
    import specdec.plugins.triton_kernel as kernel

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(kernel, "triton_available", lambda: True)
    monkeypatch.setattr(trt_plugin, "register", lambda: True)
    monkeypatch.setitem(sys.modules, "tensorrt.plugin", types.ModuleType("tensorrt.plugin"))

    def install(plugin_layers_made: int, **kwargs: bool) -> dict:
        trt, seen = fake_builder_trt(plugin_layers_made, **kwargs)
        monkeypatch.setitem(sys.modules, "tensorrt", trt)
        return seen

    return install


def test_build_engine_flow(tiny_graph, tmp_path: Path, fake_builder) -> None:
    path, _ = tiny_graph
    seen = fake_builder(plugin_layers_made=2)
    profile = ProfileSpec.derive(4, 64)
    engine = trt_export.build_engine(path, tmp_path / "out" / "model.engine", "float32", profile=profile)
    assert engine.read_bytes() == b"engine-bytes"
    assert not list(engine.parent.glob("*.partial"))
    assert seen["network_flags"] == 1 << 5  # strongly typed: the graph already is float32
    assert seen["parser_flag"] == "override" and seen["verbosity"] == "detailed"
    assert seen["preview"] == [("aliased", True)] and seen["config_flags"] == []
    assert seen["profiles_added"] == 1
    inputs = [t.name for t in GRAPH_INPUTS] + cache_names(2, CACHE_INPUT)
    assert seen["profile"] == profile.shapes_for((n, d) for n, d, _ in trt_export.onnx_inputs(path))
    assert set(seen["profile"]) == set(inputs)
    plugins = [layer for layer in seen["network"].layers if layer.type == "PLUGIN_V3"]
    assert [layer.name.split(":")[0] for layer in plugins] == ["RaggedTreeAttention.0", "RaggedTreeAttention.1"]
    assert seen["casts"] == 1 and all(layer.get_input(0).dtype == "int32" for layer in plugins)


def test_build_engine_refuses_the_function_body(tiny_graph, tmp_path: Path, fake_builder) -> None:
    path, _ = tiny_graph
    fake_builder(plugin_layers_made=0)  # the parser inlined the body: no plugin layer
    with pytest.raises(PluginFallbackError, match="made 0 plugin layers for the 2 RaggedTreeAttention nodes"):
        trt_export.build_engine(path, tmp_path / "model.engine", profile=ProfileSpec.derive(4, 64))
    assert not (tmp_path / "model.engine").exists()


def _with_plugin_namespace(graph: Path, directory: Path, namespace: str) -> Path:
    """A copy of an exported graph whose attention nodes name another plugin namespace."""
    import onnx

    model = onnx.load(str(graph), load_external_data=False)
    for node in model.graph.node:
        for attr in node.attribute:
            if node.op_type == onnx_op.OP_TYPE and attr.name == "plugin_namespace":
                attr.s = namespace.encode()
    directory.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(directory / graph.name))
    shutil.copy(graph.with_name(graph.name + ".data"), directory / (graph.name + ".data"))
    return directory / graph.name


def test_build_engine_refuses_nodes_that_name_another_plugin(tiny_graph, tmp_path: Path, fake_builder) -> None:
    path, _ = tiny_graph
    fake_builder(plugin_layers_made=2)
    other = _with_plugin_namespace(path, tmp_path / "other", "someone_else")
    assert trt_export.attention_nodes(other)[0] == 2 and len(trt_export.attention_nodes(other)[1]) == 2
    assert trt_export.attention_nodes(path) == (2, [])
    with pytest.raises(PluginFallbackError, match=r"2 of the 2 RaggedTreeAttention nodes .* do not name the plugin"):
        trt_export.build_engine(other, tmp_path / "model.engine", profile=ProfileSpec.derive(4, 64))


def test_build_engine_precision_choices(tiny_graph, tmp_path: Path, fake_builder) -> None:
    path, _ = tiny_graph
    seen = fake_builder(plugin_layers_made=2)
    trt_export.build_engine(path, tmp_path / "a.engine", "float16", profile=ProfileSpec.derive(4, 64))
    assert seen["network_flags"] == 0 and seen["config_flags"] == ["fp16"]  # weakly typed fp16 on TensorRT 10
    fake_builder(plugin_layers_made=2, has_fp16_flag=False)  # TensorRT 11: strong typing only
    with pytest.raises(EngineBuildError, match="only builds strongly typed networks"):
        trt_export.build_engine(path, tmp_path / "b.engine", "float16", profile=ProfileSpec.derive(4, 64))
    with pytest.raises(ValueError, match="unsupported engine dtype 'int8'"):
        trt_export.build_engine(path, tmp_path / "c.engine", "int8", profile=ProfileSpec.derive(4, 64))

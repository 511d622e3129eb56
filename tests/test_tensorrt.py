"""The TensorRT path: environment checks, profiles, the plugin definition, plugin-layer checks, engines.

Two kinds of tests live here:

* tests that run everywhere (no TensorRT, no GPU): the clear refusal when TensorRT is missing
  (also through ``specdec-export``), ``ProfileSpec``, the polygraphy recipe and its data loader,
  the engine-inspector parsing that detects the silent function-body fallback, the plugin's
  ``tensorrt.plugin`` definition (against a stand-in module) and its enqueue body (on CPU in
  Triton's interpreter). TensorRT's presence is simulated with ``sys.modules`` entries so these
  behave the same on a GPU machine.
* ``needs_trt`` tests that build real engines and compare them with ONNX Runtime and the torch
  reference. They skip with the reason ("TensorRT not installed", "no CUDA GPU") where the
  hardware or library is missing.
"""

from __future__ import annotations

import importlib.util
import inspect
import json
import os
import shlex
import shutil
import subprocess
import sys
import types
import typing
from pathlib import Path

import numpy as np
import pytest
import torch
from onnx import TensorProto, helper

from specdec.export import tensorrt as trt_export
from specdec.export.scripts import polygraphy_glue
from specdec.export.tensorrt import (
    DimRange,
    EngineBuildError,
    PluginFallbackError,
    ProfileSpec,
    TensorRTUnavailableError,
    count_plugin_layers,
    polygraphy_recipe,
    require_tensorrt,
)
from specdec.plugins import onnx_op, trt_plugin
from specdec.runtime.backends import tensorrt as trt_backend
from specdec.runtime.config import EngineConfig
from specdec.runtime.graph_io import CACHE_INPUT, CACHE_OUTPUT, GRAPH_INPUTS, LOGITS, cache_names

REPO = Path(__file__).resolve().parents[1]


def _gpu_skip_reason() -> str | None:
    """Why the engine tests cannot run here; decided without importing triton (see ``_no_triton_import``)."""
    if importlib.util.find_spec("tensorrt") is None:
        return "TensorRT not installed (no `tensorrt` module)"
    if not torch.cuda.is_available():
        return "no CUDA GPU"
    if importlib.util.find_spec("triton") is None:
        return "OpenAI Triton not installed (the plugin runs the Triton kernel)"
    import tensorrt

    if trt_plugin._parse_version(tensorrt.__version__) < trt_plugin.MIN_TENSORRT:
        return f"TensorRT {tensorrt.__version__} is older than {'.'.join(map(str, trt_plugin.MIN_TENSORRT))}"
    return None


_SKIP = _gpu_skip_reason()
needs_trt = pytest.mark.skipif(_SKIP is not None, reason=_SKIP or "")


@pytest.fixture
def _no_triton_import(monkeypatch: pytest.MonkeyPatch) -> None:
    """Answer "triton is here" without importing it.

    Triton decides once, when first imported, whether its language runs in the CPU interpreter
    (TRITON_INTERPRET); test_triton_kernel.py imports it in interpreter mode, so the environment
    checks here must not be the first to import it.
    """
    import specdec.plugins.triton_kernel as kernel

    monkeypatch.setattr(kernel, "triton_available", lambda: True)


# --------------------------------------------------------------------------------------------- environment


def _fake_tensorrt(monkeypatch: pytest.MonkeyPatch, version: str) -> None:
    fake = types.ModuleType("tensorrt")
    fake.__version__ = version
    monkeypatch.setitem(sys.modules, "tensorrt", fake)
    monkeypatch.setitem(sys.modules, "tensorrt.plugin", types.ModuleType("tensorrt.plugin"))


@pytest.mark.usefixtures("_no_triton_import")
def test_require_tensorrt_names_a_missing_module_and_what_to_do(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "tensorrt", None)  # import tensorrt -> ImportError, as on a machine without it
    with pytest.raises(TensorRTUnavailableError) as info:
        require_tensorrt()
    message = str(info.value)
    assert isinstance(info.value, RuntimeError)
    assert "`tensorrt` Python module cannot be imported" in message
    assert "NGC" in message and "pip install 'tensorrt>=10.7'" in message
    assert "specdec-export --backend onnx" in message  # the way forward without a GPU


@pytest.mark.usefixtures("_no_triton_import")
def test_require_tensorrt_refuses_an_old_tensorrt(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_tensorrt(monkeypatch, "10.5.0.18")
    with pytest.raises(TensorRTUnavailableError, match=r"TensorRT 10\.5\.0\.18 is too old: specdec needs >= 10\.7"):
        require_tensorrt()


@pytest.mark.usefixtures("_no_triton_import")
def test_require_tensorrt_refuses_a_machine_without_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_tensorrt(monkeypatch, "10.9.0.34")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(TensorRTUnavailableError, match="no CUDA GPU is visible") as info:
        require_tensorrt()
    assert "too old" not in str(info.value)


@pytest.mark.usefixtures("_no_triton_import")
def test_require_tensorrt_passes_when_everything_is_there(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_tensorrt(monkeypatch, "11.4.0.106")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    require_tensorrt()
    assert trt_export.tensorrt_problems() == []


@pytest.mark.usefixtures("_no_triton_import")
def test_export_cli_refuses_tensorrt_cleanly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from specdec.export.cli import main

    monkeypatch.setitem(sys.modules, "tensorrt", None)
    out = tmp_path / "deploy"
    rc = main(["--target", "tiny-random:num_layers=1", "--backend", "tensorrt", "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.startswith("error: TensorRT is not usable here")
    assert "`tensorrt` Python module cannot be imported" in err
    assert not out.exists()
    assert list(tmp_path.iterdir()) == []  # no partial directory either


def test_modules_import_without_tensorrt() -> None:
    code = (
        "import sys; sys.modules['tensorrt'] = None\n"
        "import specdec.export.tensorrt, specdec.plugins.trt_plugin as p, specdec.runtime.backends.tensorrt\n"
        "import specdec.export.scripts.polygraphy_glue\n"
        "import specdec.export.cli, specdec.runtime.engine\n"
        "assert p.register() is False and 'tensorrt' in p.unavailable_reason()\n"
        "print('ok')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


@pytest.mark.usefixtures("_no_triton_import")
def test_entry_points_without_tensorrt_raise_the_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "tensorrt", None)
    monkeypatch.setattr(trt_plugin, "_registered", False)
    assert trt_plugin.register() is False
    assert "cannot be imported" in (trt_plugin.unavailable_reason() or "")
    with pytest.raises(TensorRTUnavailableError):
        trt_export.build_engine(tmp_path / "model.onnx", tmp_path / "model.engine")
    with pytest.raises(trt_backend.EngineLoadError, match="does not exist"):
        trt_backend.TensorRTBackend(tmp_path / "model.engine")
    (tmp_path / "model.engine").write_bytes(b"not an engine")
    with pytest.raises(TensorRTUnavailableError):
        trt_backend.TensorRTBackend(tmp_path / "model.engine")


def test_build_and_load_share_one_definition_of_each_check() -> None:
    """The export re-exports the plugin module's checks and errors: one definition, so one behaviour and one except."""
    for name in (
        "MIN_TENSORRT",
        "EngineBuildError",
        "PluginFallbackError",
        "TensorRTUnavailableError",
        "assert_plugin_layers",
        "count_plugin_layers",
        "require_tensorrt",
        "tensorrt_problems",
    ):
        assert getattr(trt_export, name) is getattr(trt_plugin, name), name
        assert name in trt_export.__all__, name


# --------------------------------------------------------------------------------------------- profiles


def test_profile_derivation_covers_prefill_and_decode() -> None:
    spec = ProfileSpec.derive(max_batch=8, max_len=512)
    assert spec.tokens == DimRange(1, 64, 8 * 512)  # worst step: 8 prompts of 512 tokens in one pack
    assert spec.rows == spec.tokens
    assert spec.seqs == DimRange(1, 8, 8)
    assert spec.max_new == DimRange(1, 8, 512)
    assert spec.slots == DimRange(1, 8, 8)
    assert spec.max_len == DimRange(1, 512, 512)
    capped = ProfileSpec.derive(max_batch=8, max_len=512, max_tokens=1024, opt_new=4, max_slots=12)
    assert capped.tokens == DimRange(1, 32, 1024)
    assert capped.slots == DimRange(1, 12, 12)
    tiny = ProfileSpec.derive(max_batch=1, max_len=1)
    assert tiny.tokens == DimRange(1, 1, 1) and tiny.max_new == DimRange(1, 1, 1)


def test_profile_dimension_names() -> None:
    spec = ProfileSpec.derive(max_batch=4, max_len=64)
    assert spec.range_of("seqs + 1") == DimRange(2, 5, 5)  # cu_seqlens as torch.onnx.export names it
    assert spec.range_of("B_plus_1") == DimRange(2, 5, 5)  # onnx_op.attention_model's name
    assert spec.range_of("T") == spec.range_of("tokens")
    assert spec.range_of("S_max") == spec.max_new
    with pytest.raises(ValueError, match="no profile range for the symbolic dimension 'heads'"):
        spec.range_of("heads")


@pytest.mark.parametrize(
    "kwargs", [{"max_batch": 0}, {"max_len": 0}, {"max_tokens": 0}, {"opt_new": 0}, {"max_slots": 0}]
)
def test_profile_rejects_nonsense(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        ProfileSpec.derive(**kwargs)


def test_dim_range_checks_its_order() -> None:
    with pytest.raises(ValueError):
        DimRange(3, 2, 4)
    with pytest.raises(ValueError):
        DimRange(0, 0, 0)


def _fake_export(path: Path, num_layers: int = 2, kv_heads: int = 2, head_dim: int = 16, vocab: int = 32) -> Path:
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


def test_profile_shapes_for_the_exported_inputs(tmp_path: Path) -> None:
    inputs = trt_export.onnx_inputs(_fake_export(tmp_path / "model.onnx"))
    shapes = ProfileSpec.derive(max_batch=16, max_len=2048).shapes_for((n, d) for n, d, _ in inputs)
    assert set(shapes) == {t.name for t in GRAPH_INPUTS} | set(cache_names(2, CACHE_INPUT))
    assert shapes["input_ids"] == ((1,), (128,), (32768,))
    assert shapes["cu_seqlens"] == ((2,), (17,), (17,))
    assert shapes["tree_mask"] == ((1, 1), (128, 8), (32768, 2048))
    assert shapes["logits_indices"] == ((1,), (128,), (32768,))
    assert shapes["past_key_values.1.value"] == ((1, 2, 1, 16), (16, 2, 2048, 16), (16, 2, 2048, 16))


# --------------------------------------------------------------------------------------------- polygraphy


def test_polygraphy_recipe_has_the_comparison_flags(tmp_path: Path) -> None:
    model = _fake_export(tmp_path / "model.onnx")
    recipe = polygraphy_recipe(model, profile=ProfileSpec.derive(4, 64), plugin_library="/opt/lib/libspecdec.so")
    for flag in (
        "polygraphy run",
        "--onnxrt --trt",
        "--plugins /opt/lib/libspecdec.so",
        "--onnx-flags enable_plugin_override",
        "--preview-features aliased_plugin_io_10_03",
        "--strongly-typed",
        "--atol 0.001",
        "--rtol 0.001",
        f"--data-loader-script {trt_export.POLYGRAPHY_SCRIPT}:load_data",
        f"--trt-network-postprocess-script {trt_export.POLYGRAPHY_SCRIPT}:postprocess",
        f"SPECDEC_POLYGRAPHY_MODEL={model}",
        "SPECDEC_POLYGRAPHY_SLOTS=4",
        "SPECDEC_POLYGRAPHY_MAX_LEN=64",
    ):
        assert flag in recipe, flag
    argv = shlex.split(recipe.replace("\\\n", " "))
    mins = argv[argv.index("--trt-min-shapes") + 1 : argv.index("--trt-opt-shapes")]
    maxs = argv[argv.index("--trt-max-shapes") + 1 : argv.index("--atol")]
    assert "input_ids:[1]" in mins and "cu_seqlens:[2]" in mins and "past_key_values.0.key:[1,2,1,16]" in mins
    assert "tree_mask:[256,64]" in maxs and "past_key_values.1.value:[4,2,64,16]" in maxs
    assert len(mins) == len(GRAPH_INPUTS) + 4
    loose = polygraphy_recipe(model, atol=0.25, rtol=0.05)
    assert "--plugins" not in loose and "--atol 0.25 --rtol 0.05" in loose
    assert trt_export.POLYGRAPHY_SCRIPT == Path(polygraphy_glue.__file__).resolve()  # the script really is there


def test_polygraphy_inspect_recipe_registers_the_plugin_first(tmp_path: Path) -> None:
    command = trt_export.polygraphy_inspect_recipe(tmp_path / "model.engine")
    argv = shlex.split(command)
    assert argv[:2] == ["python", "-c"]
    code = argv[2]
    assert code.index("trt_plugin.register()") < code.index("from polygraphy.tools import main")
    assert json.dumps(["polygraphy", "inspect", "model", str(tmp_path / "model.engine"), "--show", "layers"]) in code
    compile(code, "<recipe>", "exec")


@pytest.fixture(scope="module")
def tiny_graph(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object]:
    """A real 2-layer export (fp32) and its model."""
    from specdec.export.onnx import export_onnx
    from specdec.models.loading import tiny_random

    model = tiny_random(seed=5, vocab_size=64, num_layers=2)
    path = export_onnx(model, tmp_path_factory.mktemp("trt_graph") / "model.onnx")
    return path, model


def test_polygraphy_data_loader_feeds_run_in_onnxruntime(tiny_graph, monkeypatch: pytest.MonkeyPatch) -> None:
    """The feeds the recipe gives both runners are valid ragged steps (ORT, the reference side, runs them)."""
    import onnxruntime as ort

    path, _ = tiny_graph
    monkeypatch.setenv("SPECDEC_POLYGRAPHY_MODEL", str(path))
    monkeypatch.setenv("SPECDEC_POLYGRAPHY_SLOTS", "3")
    monkeypatch.setenv("SPECDEC_POLYGRAPHY_MAX_LEN", "32")
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    feeds = list(polygraphy_glue.load_data())
    assert len(feeds) == 4  # prefill + 3 mixed rounds
    names = {i.name for i in session.get_inputs()}
    for feed in feeds:
        assert set(feed) == names
        assert feed["past_key_values.0.key"].shape == (3, 2, 32, 16)
        assert feed["tree_mask"].dtype == np.bool_ and feed["cu_seqlens"].dtype == np.int32
        logits, *_ = session.run(None, feed)
        assert logits.shape == (feed["logits_indices"].shape[0], 64) and np.isfinite(logits).all()


def test_polygraphy_data_loader_registers_before_it_is_iterated(tiny_graph, monkeypatch: pytest.MonkeyPatch) -> None:
    """polygraphy calls load_data() before building the engine and iterates later: registration must come first."""
    calls = []
    monkeypatch.setattr(trt_plugin, "register", lambda: calls.append("register") or True)
    monkeypatch.setenv("SPECDEC_POLYGRAPHY_MODEL", str(tiny_graph[0]))
    feeds = polygraphy_glue.load_data()
    assert calls == ["register"]
    assert next(iter(feeds))["input_ids"].dtype == np.int64


def test_polygraphy_script_import_registers_the_plugin(monkeypatch: pytest.MonkeyPatch) -> None:
    """polygraphy imports polygraphy_glue.py as a top-level module named ``polygraphy_glue``; that import registers."""
    calls = []
    monkeypatch.setattr(trt_plugin, "register", lambda: calls.append("register") or True)
    spec = importlib.util.spec_from_file_location("polygraphy_glue", trt_export.POLYGRAPHY_SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert calls == ["register"]
    assert module.trt_plugin is trt_plugin  # the package's plugin module, not a second copy


_POLYGRAPHY_IMPORT = """
import importlib, sys
from pathlib import Path
from specdec.plugins import trt_plugin

calls, real = [], trt_plugin.register
trt_plugin.register = lambda: calls.append("register") or real()
script = Path(sys.argv[1])
sys.path.insert(0, str(script.parent))  # what polygraphy's import_from_script does around the import
try:
    module = importlib.import_module(script.stem)
finally:
    del sys.path[0]
assert calls == ["register"], calls
package = Path(trt_plugin.__file__).resolve().parents[1]
strays = sorted(name for name, mod in list(sys.modules.items())
                if name != script.stem and not name.startswith("specdec")
                and Path(getattr(mod, "__file__", None) or "/").resolve().is_relative_to(package))
assert not strays, f"specdec files imported under foreign names (shadowed packages): {strays}"
print("ok")
"""


def test_polygraphy_script_import_shadows_no_package() -> None:
    """While polygraphy imports the script, no specdec file may stand in for ``tensorrt`` or ``onnx``.

    polygraphy puts the script's directory first on sys.path during that import, and the import
    registers the plugin, which imports ``tensorrt``. In a fresh process, so that ``tensorrt`` and
    the script are imported for the first time, as in polygraphy's.
    """
    done = subprocess.run(
        [sys.executable, "-c", _POLYGRAPHY_IMPORT, str(trt_export.POLYGRAPHY_SCRIPT)],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.strip() == "ok"


class _Tensor:
    def __init__(self, name: str, dtype: str) -> None:
        self.name, self.dtype = name, dtype


class _Layer:
    def __init__(self, name: str, kind: str, inputs: list[_Tensor]) -> None:
        self.name, self.type, self.inputs = name, kind, inputs

    @property
    def num_inputs(self) -> int:
        return len(self.inputs)

    def get_input(self, i: int) -> _Tensor:
        return self.inputs[i]

    def set_input(self, i: int, tensor: _Tensor) -> None:
        self.inputs[i] = tensor

    def get_output(self, i: int) -> _Tensor:
        return _Tensor(f"{self.name}:out{i}", "int32")


class _Network:
    def __init__(self, layers: list[_Layer]) -> None:
        self.layers = layers

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def get_layer(self, i: int) -> _Layer:
        return self.layers[i]

    def add_cast(self, tensor: _Tensor, dtype: str) -> _Layer:
        layer = _Layer(f"cast({tensor.name})", "CAST", [tensor])
        self.layers.append(layer)
        return layer


def test_network_edits_give_the_plugin_an_int32_mask(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = types.ModuleType("tensorrt")
    fake.LayerType = types.SimpleNamespace(PLUGIN_V3="PLUGIN_V3", PLUGIN_V2="PLUGIN_V2")
    fake.bool, fake.int32 = "bool", "int32"
    monkeypatch.setitem(sys.modules, "tensorrt", fake)
    mask, cu = _Tensor("tree_mask", "bool"), _Tensor("cu_seqlens", "int32")
    attn = [_Layer(f"node_ragged_tree_attention_{i}", "PLUGIN_V3", [_Tensor("q", "float"), cu, mask]) for i in range(3)]
    network = _Network([_Layer("MatMul", "MATRIX_MULTIPLY", [mask]), *attn])
    layers = trt_plugin.plugin_layers(network)
    assert layers == attn
    assert trt_plugin.cast_bool_inputs(network, layers) == 1  # one cast, shared by every layer
    casted = {id(layer.get_input(2)) for layer in attn}
    assert len(casted) == 1 and attn[0].get_input(2).dtype == "int32" and attn[0].get_input(1) is cu
    assert network.layers[0].get_input(0) is mask  # other consumers keep the bool tensor
    trt_plugin.name_plugin_layers(layers)
    trt_plugin.name_plugin_layers(layers)  # idempotent
    assert [layer.name for layer in attn] == [
        f"RaggedTreeAttention.{i}:node_ragged_tree_attention_{i}" for i in range(3)
    ]


@pytest.mark.skipif(shutil.which("polygraphy") is None, reason="polygraphy not installed")
def test_polygraphy_runs_onnxruntime_with_the_data_loader(tiny_graph, tmp_path: Path) -> None:
    """The ORT half of the recipe through polygraphy itself (the TRT half is in the GPU test below)."""
    path, _ = tiny_graph
    env = {**os.environ, "SPECDEC_POLYGRAPHY_MODEL": str(path)}
    done = subprocess.run(
        [
            "polygraphy",
            "run",
            str(path),
            "--onnxrt",
            "--data-loader-script",
            f"{trt_export.POLYGRAPHY_SCRIPT}:load_data",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


# --------------------------------------------------------------------------------------------- fallback detection


def _inspector_json(layers: list) -> str:
    return json.dumps({"Layers": layers, "Bindings": ["input_ids", "logits"]})


def test_plugin_layers_are_counted_from_the_inspector() -> None:
    plugin = {
        "Name": "RaggedTreeAttention.0:node_ragged_tree_attention__2",
        "LayerType": "PluginV3",
        "Inputs": [],
        "Outputs": [],
    }
    by_node_name = {"Name": "node_ragged_tree_attention_1__2", "LayerType": "PluginV3", "ParameterType": "PluginV3"}
    other_plugin = {"Name": "nms", "LayerType": "PluginV2", "Plugin": "EfficientNMS_TRT"}
    gemm = {"Name": "/layers.0/mlp/MatMul", "LayerType": "MatrixMultiply"}
    assert count_plugin_layers(_inspector_json([gemm, plugin, by_node_name, other_plugin])) == 2


def test_the_function_body_fallback_counts_zero() -> None:
    # the body's layers carry the node's name but are ordinary layers (Scatter, Gather, Myelin regions...)
    body = [
        {"Name": "node_ragged_tree_attention__2/ScatterND", "LayerType": "Scatter"},
        {"Name": "{ForeignNode[node_ragged_tree_attention__2/Gather...]}", "LayerType": "Myelin"},
    ]
    assert count_plugin_layers(_inspector_json(body)) == 0


def test_inspector_without_details_or_json_is_refused() -> None:
    with pytest.raises(PluginFallbackError, match="layer names only"):
        count_plugin_layers(_inspector_json(["RaggedTreeAttention.0", "MatMul"]))
    with pytest.raises(PluginFallbackError, match="no JSON"):
        count_plugin_layers("Layers: ...")
    assert issubclass(PluginFallbackError, EngineBuildError)


def test_assert_plugin_layers_raises_on_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = types.ModuleType("tensorrt")
    fake.LayerInformationFormat = types.SimpleNamespace(JSON="json")
    monkeypatch.setitem(sys.modules, "tensorrt", fake)

    class Engine:
        def __init__(self, layers: list) -> None:
            self.layers = layers

        def create_engine_inspector(self) -> object:
            return types.SimpleNamespace(get_engine_information=lambda fmt: _inspector_json(self.layers))

    good = Engine([{"Name": f"RaggedTreeAttention.{i}:n", "LayerType": "PluginV3"} for i in range(2)])
    assert trt_export.assert_plugin_layers(good, expected=2) == 2
    with pytest.raises(PluginFallbackError, match="has 0 RaggedTreeAttention plugin layers, expected 2"):
        trt_export.assert_plugin_layers(Engine([{"Name": "x", "LayerType": "Scatter"}]), expected=2)


# --------------------------------------------------------------------------------------------- build_engine's flow


def _fake_builder_trt(  # noqa: C901 - a whole stand-in module, its classes read best together
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

    class Network(_Network):
        def __init__(self) -> None:
            super().__init__([])
            self.inputs: list = []

        @property
        def num_inputs(self) -> int:
            return len(self.inputs)

        def get_input(self, i: int) -> object:
            return self.inputs[i]

        def add_cast(self, tensor: _Tensor, dtype: str) -> _Layer:
            seen["casts"] += 1
            return super().add_cast(tensor, dtype)

    class Parser:
        def __init__(self, network: Network, logger: object) -> None:
            self.network, self.num_errors = network, 0

        def set_flag(self, flag: str) -> None:
            seen["parser_flag"] = flag

        def parse_from_file(self, path: str) -> bool:
            graph = onnx.load(path, load_external_data=False).graph
            for value in graph.input:
                tensor = _Tensor(value.name, "bool" if value.name == "tree_mask" else "x")
                tensor.is_shape_tensor = False
                self.network.inputs.append(tensor)
            mask = self.network.inputs[[t.name for t in self.network.inputs].index("tree_mask")]
            for i in range(plugin_layers_made):
                self.network.layers.append(_Layer(f"node_ragged_tree_attention_{i}", "PLUGIN_V3", [mask]))
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

        def create_network(self, flags: int) -> Network:
            seen["network_flags"] = flags
            seen["network"] = Network()
            return seen["network"]

        def create_builder_config(self) -> Config:
            seen["config"] = Config()
            return seen["config"]

        def create_optimization_profile(self) -> Profile:
            return Profile()

        def build_serialized_network(self, network: Network, config: Config) -> bytes:
            seen["verbosity"] = config.profiling_verbosity
            return b"engine-bytes"

    class Engine:
        def create_engine_inspector(self) -> object:
            layers = [
                {"Name": layer.name, "LayerType": "PluginV3"}
                for layer in seen["network"].layers
                if layer.type == "PLUGIN_V3"
            ]
            return types.SimpleNamespace(get_engine_information=lambda fmt: _inspector_json(layers))

    trt.Builder, trt.OnnxParser = Builder, Parser
    trt.Runtime = lambda logger: types.SimpleNamespace(deserialize_cuda_engine=lambda data: Engine())
    return trt, seen


@pytest.fixture
def fake_builder(monkeypatch: pytest.MonkeyPatch):
    """Install a stand-in TensorRT (plus 'a GPU' and 'triton') for build_engine; returns an installer."""
    import specdec.plugins.triton_kernel as kernel

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(kernel, "triton_available", lambda: True)
    monkeypatch.setattr(trt_plugin, "register", lambda: True)
    monkeypatch.setitem(sys.modules, "tensorrt.plugin", types.ModuleType("tensorrt.plugin"))

    def install(plugin_layers_made: int, **kwargs: bool) -> dict:
        trt, seen = _fake_builder_trt(plugin_layers_made, **kwargs)
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


# --------------------------------------------------------------------------------------------- the plugin


class _OldDesc:
    """Stand-in for tensorrt.plugin.TensorDesc of a TensorRT without ``aliased()``."""

    def __init__(self, name: str, aliased_to: _OldDesc | None = None) -> None:
        self.name, self.aliased_to = name, aliased_to

    def like(self) -> _OldDesc:
        return type(self)(self.name)


class _Desc(_OldDesc):
    """Stand-in for tensorrt.plugin.TensorDesc."""

    def aliased(self) -> _Desc:
        return _Desc(self.name, aliased_to=self)


def _fake_trtp(desc_type: type) -> types.SimpleNamespace:
    fake = types.SimpleNamespace(TensorDesc=desc_type, Tensor=type("Tensor", (), {}), registered={}, impls={})
    fake.register = lambda pid: lambda f: fake.registered.setdefault(pid, f)
    fake.impl = lambda pid: lambda f: fake.impls.setdefault(pid, f)
    return fake


def test_plugin_definition_matches_the_onnx_node() -> None:
    fake = _fake_trtp(_Desc)
    trt_plugin._define(fake)
    assert set(fake.registered) == set(fake.impls) == {"specdec::RaggedTreeAttention"}
    describe, enqueue = fake.registered[trt_plugin.PLUGIN_ID], fake.impls[trt_plugin.PLUGIN_ID]

    sig = inspect.signature(describe)
    attrs = [a for a in onnx_op.ATTRIBUTE_NAMES if not a.startswith("plugin_")]
    assert list(sig.parameters) == [*onnx_op.INPUT_NAMES, *attrs]  # the ONNX node's inputs, then its attributes
    assert all(sig.parameters[n].annotation is _Desc for n in onnx_op.INPUT_NAMES)  # classes, not strings
    assert [sig.parameters[a].annotation for a in attrs] == [float, int, int]
    assert typing.get_origin(sig.return_annotation) is tuple
    assert typing.get_args(sig.return_annotation) == (_Desc, _Desc, _Desc)

    descs = [_Desc(n) for n in onnx_op.INPUT_NAMES]
    out, k_out, v_out = describe(*descs, 0.125, 4, 2)
    assert out.name == "q" and out.aliased_to is None
    assert k_out.aliased_to is descs[3] and v_out.aliased_to is descs[4]  # in-place caches

    impl_sig = inspect.signature(enqueue)
    assert list(impl_sig.parameters) == [*onnx_op.INPUT_NAMES, "scale", "outputs", "stream"]
    assert impl_sig.parameters["scale"].annotation is float and impl_sig.parameters["stream"].annotation is int
    assert typing.get_args(impl_sig.parameters["outputs"].annotation) == (fake.Tensor,) * 3


def test_plugin_definition_without_aliasing_support() -> None:
    fake = _fake_trtp(_OldDesc)
    trt_plugin._define(fake)
    _, k_out, v_out = fake.registered[trt_plugin.PLUGIN_ID](*[_OldDesc(n) for n in onnx_op.INPUT_NAMES], 0.1, 4, 2)
    assert k_out.name == "k_cache" and v_out.name == "v_cache" and k_out.aliased_to is None


def test_sanitize_indices_keeps_valid_packs_and_empties_bad_ones() -> None:
    cu, past, slots = (torch.tensor(x, dtype=torch.int32) for x in ([0, 3, 5], [4, 0], [2, 0]))
    c, p, s, ok = trt_plugin.sanitize_indices(cu, past, slots, num_tokens=5, num_slots=3, max_len=8)
    assert bool(ok) and torch.equal(c, cu) and torch.equal(p, past) and torch.equal(s, slots)
    bad = {
        "slot out of range": (cu, past, torch.tensor([3, 0], dtype=torch.int32)),
        "negative slot": (cu, past, torch.tensor([-1, 0], dtype=torch.int32)),
        "past + n > max_len": (cu, torch.tensor([6, 0], dtype=torch.int32), slots),
        "decreasing cu": (torch.tensor([0, 3, 2], dtype=torch.int32), past, slots),
        "cu not from 0": (torch.tensor([1, 3, 5], dtype=torch.int32), past, slots),
        "cu past T": (torch.tensor([0, 3, 6], dtype=torch.int32), past, slots),
    }
    for what, (c_in, p_in, s_in) in bad.items():
        c, p, s, ok = trt_plugin.sanitize_indices(c_in, p_in, s_in, num_tokens=5, num_slots=3, max_len=8)
        assert not bool(ok), what
        assert not c.any() and not p.any() and not s.any(), what


def _attention_case(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    hq, hkv, d, slots, max_len = 4, 2, 32, 3, 16
    lens, pasts, slot_ids = [3, 1, 4], [5, 9, 0], [2, 0, 1]
    parents = [[-1, 0, 0], [-1], [-1, 0, -1, 2]]  # a tree, a decode token, a forest of two roots
    tokens = sum(lens)
    tree = torch.zeros(tokens, max(lens), dtype=torch.bool)
    row = 0
    for n, par in zip(lens, parents):
        for j in range(n):
            tree[row + j, j] = True
            a = par[j]
            while a >= 0:
                tree[row + j, a] = True
                a = par[a]
        row += n
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    return {
        "q": torch.randn(tokens, hq, d, generator=g),
        "k": torch.randn(tokens, hkv, d, generator=g),
        "v": torch.randn(tokens, hkv, d, generator=g),
        "k_cache": torch.randn(slots, hkv, max_len, d, generator=g),
        "v_cache": torch.randn(slots, hkv, max_len, d, generator=g),
        "cu": cu,
        "past": pasts,
        "slots": slot_ids,
        "tree": tree,
        "scale": d**-0.5,
    }


def _ints(x: list[int]) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.int32)


_ENQUEUE_CHECK = """
import torch
from specdec.plugins import trt_plugin
from specdec.plugins.reference import ragged_tree_attention
from tests.test_tensorrt import _attention_case, _ints

for aliased in (True, False):
    c = _attention_case()
    want_k, want_v = c["k_cache"].clone(), c["v_cache"].clone()
    want = ragged_tree_attention(c["q"], c["k"], c["v"], want_k, want_v, c["cu"], c["past"], c["slots"],
                                 c["tree"], c["scale"])
    k_in, v_in = c["k_cache"].clone(), c["v_cache"].clone()
    k_out, v_out = (k_in, v_in) if aliased else (torch.zeros_like(k_in), torch.zeros_like(v_in))
    out = torch.empty_like(c["q"])
    trt_plugin.run_attention(c["q"], c["k"], c["v"], k_in, v_in, _ints(c["cu"]), _ints(c["past"]),
                             _ints(c["slots"]), c["tree"], c["scale"], out, k_out, v_out)
    torch.testing.assert_close(out, want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(k_out, want_k)
    torch.testing.assert_close(v_out, want_v)
    if not aliased:  # the inputs stay as TensorRT gave them
        assert torch.equal(k_in, c["k_cache"]) and torch.equal(v_in, c["v_cache"])

# bad indices: slot 7 of 3 would make the kernel write outside the cache
c = _attention_case(1)
k, v = c["k_cache"].clone(), c["v_cache"].clone()
out = torch.zeros_like(c["q"])
trt_plugin.run_attention(c["q"], c["k"], c["v"], k, v, _ints(c["cu"]), _ints(c["past"]), _ints([2, 0, 7]),
                         c["tree"], c["scale"], out, k, v)
assert torch.isnan(out).all()
assert torch.equal(k, c["k_cache"]) and torch.equal(v, c["v_cache"])
print("ok")
"""


def test_plugin_enqueue_body_matches_the_reference() -> None:
    """``run_attention`` (the plugin's enqueue minus TensorRT's buffer wrapping) against the torch reference.

    On CPU in Triton's interpreter, in a fresh process: the interpreter must be chosen before
    triton is first imported, which this test process may already have done in compiled mode.
    Covers aliased caches, copied caches, and out-of-range indices (NaN out, caches untouched).
    """
    if importlib.util.find_spec("triton") is None:
        pytest.skip("OpenAI Triton is not installed")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, "-c", _ENQUEUE_CHECK], capture_output=True, text=True, cwd=REPO, env=env, timeout=600
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.strip().endswith("ok")


# --------------------------------------------------------------------------------------------- real engines (GPU)


@pytest.fixture(scope="module")
def tiny_engine(tiny_graph, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path, _ = tiny_graph
    engine = tmp_path_factory.mktemp("trt_engine") / "model.engine"
    return trt_export.build_engine(path, engine, "float32", profile=ProfileSpec.derive(max_batch=4, max_len=64))


@needs_trt
@pytest.mark.gpu
def test_engine_contains_one_plugin_layer_per_attention_layer(tiny_engine: Path) -> None:
    backend = trt_backend.TensorRTBackend(tiny_engine)
    assert backend.num_layers == 2
    assert trt_export.assert_plugin_layers(backend.engine, expected=2) == 2
    assert backend.vocab_size == 64 and backend.dtype == torch.float32


@needs_trt
@pytest.mark.gpu
def test_engine_matches_torch_reference_and_onnxruntime(tiny_graph, tiny_engine: Path) -> None:
    from specdec.export.validate import max_logit_error
    from specdec.runtime.backends.onnxruntime import OrtBackend
    from specdec.runtime.backends.torch_backend import TorchBackend

    path, model = tiny_graph
    for seed in range(3):  # max_logit_error also checks the idle slot was not touched
        assert max_logit_error(TorchBackend(model), trt_backend.TensorRTBackend(tiny_engine), seed=seed) < 1e-3
        assert max_logit_error(OrtBackend(path), trt_backend.TensorRTBackend(tiny_engine), seed=seed) < 1e-3


@needs_trt
@pytest.mark.gpu
def test_engine_writes_the_cache_in_place(tiny_graph, tiny_engine: Path) -> None:
    from specdec.runtime.backends.torch_backend import TorchBackend
    from specdec.runtime.packed import ROOT, SeqWork, pack

    _, model = tiny_graph
    backend, reference = trt_backend.TensorRTBackend(tiny_engine), TorchBackend(model)
    cache, ref_cache = backend.allocate_cache(4, 64), reference.allocate_cache(4, 64)
    pointers = [t.data_ptr() for t in (*cache.k, *cache.v)]
    steps = [
        [SeqWork(0, 0, [1, 2, 3, 4, 5], logits="last"), SeqWork(2, 0, [7, 8], logits="last")],
        [SeqWork(2, 2, [9, 10, 11], parents=[ROOT, 0, ROOT]), SeqWork(0, 5, [12])],
    ]
    for work in steps:
        batch = pack(work)
        logits = backend.step(batch, cache)
        assert isinstance(logits, np.ndarray)  # the logits rows on the host, as every backend returns them
        np.testing.assert_allclose(logits, reference.step(batch, ref_cache), atol=1e-3, rtol=0, strict=True)
    assert [t.data_ptr() for t in (*cache.k, *cache.v)] == pointers  # the caches stay torch CUDA tensors
    for slot, length in ((0, 6), (2, 5), (1, 8)):
        for (k, v), (rk, rv) in zip(cache.read(slot, length), ref_cache.read(slot, length)):
            np.testing.assert_allclose(k, rk, atol=1e-4, rtol=0, strict=True)
            np.testing.assert_allclose(v, rv, atol=1e-4, rtol=0, strict=True)


@needs_trt
@pytest.mark.gpu
def test_engine_refuses_steps_outside_its_profile(tiny_engine: Path) -> None:
    from specdec.runtime.packed import SeqWork, pack

    backend = trt_backend.TensorRTBackend(tiny_engine)
    with pytest.raises(trt_backend.ShapeOutOfProfileError, match=r"built for 1\.\.4"):
        backend.allocate_cache(5, 64)
    cache = backend.allocate_cache(4, 64)
    largest = pack([SeqWork(s, 0, list(range(1, 65))) for s in range(4)])  # 256 tokens, a [256, 64] mask
    assert backend.step(largest, cache).shape == (256, 64)  # exactly the profile's max still runs
    with pytest.raises(trt_backend.ShapeOutOfProfileError):
        backend.allocate_cache(4, 65)


@needs_trt
@pytest.mark.gpu
def test_engine_decodes_like_the_torch_backend(tiny_graph, tiny_engine: Path) -> None:
    from specdec.runtime.backends.torch_backend import TorchBackend
    from specdec.runtime.drafters import NgramDrafter
    from specdec.runtime.engine import Engine
    from specdec.runtime.request import Request

    _, model = tiny_graph
    requests = [
        Request([5, 6, 7, 5, 6], max_tokens=12),
        Request([9, 10] * 4, max_tokens=9),
        Request([3], max_tokens=15),
    ]
    trt_engine = Engine(
        trt_backend.TensorRTBackend(tiny_engine), NgramDrafter(), config=EngineConfig(max_batch=4, max_len=64)
    )
    torch_engine = Engine(TorchBackend(model), NgramDrafter(), config=EngineConfig(max_batch=4, max_len=64))
    want = [o.token_ids for o in torch_engine.generate(requests, "ar").outputs]
    assert [o.token_ids for o in trt_engine.generate(requests, "ar").outputs] == want
    assert [o.token_ids for o in trt_engine.generate(requests, "ems").outputs] == want


@needs_trt
@pytest.mark.gpu
def test_float16_engine_is_close_to_the_float32_reference(tmp_path: Path) -> None:
    import torch as _torch

    from specdec.export.onnx import export_onnx
    from specdec.export.validate import max_logit_error
    from specdec.models.loading import tiny_random
    from specdec.runtime.backends.torch_backend import TorchBackend

    model = tiny_random(seed=6, vocab_size=64, num_layers=2)
    graph = export_onnx(model, tmp_path / "model.onnx", _torch.float16)
    engine = trt_export.build_engine(graph, tmp_path / "model.engine", "float16", profile=ProfileSpec.derive(4, 64))
    backend = trt_backend.TensorRTBackend(engine)
    assert backend.dtype == _torch.float16
    assert max_logit_error(TorchBackend(model), backend) < 0.25


_UNREGISTERED_BUILD = """
import sys
from specdec.plugins import trt_plugin
trt_plugin.register = lambda: True  # pretend: the plugin is NOT in TensorRT's registry
from specdec.export.tensorrt import EngineBuildError, PluginFallbackError, ProfileSpec, build_engine
try:
    build_engine(sys.argv[1], sys.argv[2], profile=ProfileSpec.derive(4, 64))
except PluginFallbackError as exc:
    print("fallback:", exc)
except EngineBuildError as exc:
    print("build-error:", exc)
else:
    print("built")
"""


@needs_trt
@pytest.mark.gpu
def test_build_detects_the_silent_function_body_fallback(tiny_graph, tmp_path: Path) -> None:
    """Without the plugin registered, TensorRT imports the function body; build_engine must refuse the result.

    In a fresh process, since the plugin cannot be unregistered from this one.
    """
    path, _ = tiny_graph
    engine = tmp_path / "model.engine"
    done = subprocess.run(
        [sys.executable, "-c", _UNREGISTERED_BUILD, str(path), str(engine)],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    # "fallback" when TensorRT could import the body, "build-error" when it could not: refused either way
    assert done.stdout.startswith(("fallback:", "build-error:")), done.stdout[-3000:]
    assert not engine.exists()


@needs_trt
@pytest.mark.gpu
def test_export_cli_writes_an_engine(tmp_path: Path) -> None:
    from specdec.export.cli import main
    from specdec.models.manifest import read_manifest
    from specdec.runtime.engine import _backend_opener

    out = tmp_path / "deploy"
    assert main(["--target", "tiny-random:num_layers=1", "--backend", "tensorrt", "--out", str(out)]) == 0
    manifest = read_manifest(out)
    assert (out / manifest["target"]["engine"]).is_file()
    backend = _backend_opener("tensorrt")(out / manifest["target"]["graph"], False)
    assert backend.num_layers == 1


@needs_trt
@pytest.mark.skipif(shutil.which("polygraphy") is None, reason="polygraphy not installed")
@pytest.mark.gpu
def test_polygraphy_recipe_passes(tiny_graph) -> None:
    path, _ = tiny_graph
    recipe = polygraphy_recipe(path, profile=ProfileSpec.derive(4, 64))
    done = subprocess.run(["bash", "-c", recipe], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]

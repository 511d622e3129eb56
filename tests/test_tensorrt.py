"""The TensorRT path that runs everywhere (no TensorRT, no GPU): the clear refusal when TensorRT is missing (also
through ``specdec-export``), ``ProfileSpec`` and the profile shapes, and the engine-inspector parsing that detects
the silent function-body fallback. TensorRT's presence is simulated with ``sys.modules`` entries, so these behave
the same on a GPU machine.

Beside it: ``test_tensorrt_build.py`` (``build_engine``'s flow against a stand-in TensorRT),
``test_tensorrt_polygraphy.py`` (the comparison recipe and its data loader), ``test_trt_plugin.py`` (the plugin's
definition, network edits and enqueue body) and ``test_tensorrt_engines.py`` (real engines: TensorRT and a GPU).
"""

from __future__ import annotations

import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
from trt_stand_ins import REPO, fake_export, inspector_json

from specdec.export import tensorrt as trt_export
from specdec.export.tensorrt import (
    DimRange,
    EngineBuildError,
    PluginFallbackError,
    ProfileSpec,
    TensorRTUnavailableError,
    count_plugin_layers,
    require_tensorrt,
)
from specdec.plugins import trt_plugin
from specdec.runtime.backends import tensorrt as trt_backend
from specdec.runtime.graph_io import CACHE_INPUT, GRAPH_INPUTS, cache_names


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


def test_profile_shapes_for_the_exported_inputs(tmp_path: Path) -> None:
    inputs = trt_export.onnx_inputs(fake_export(tmp_path / "model.onnx"))
    shapes = ProfileSpec.derive(max_batch=16, max_len=2048).shapes_for((n, d) for n, d, _ in inputs)
    assert set(shapes) == {t.name for t in GRAPH_INPUTS} | set(cache_names(2, CACHE_INPUT))
    assert shapes["input_ids"] == ((1,), (128,), (32768,))
    assert shapes["cu_seqlens"] == ((2,), (17,), (17,))
    assert shapes["tree_mask"] == ((1, 1), (128, 8), (32768, 2048))
    assert shapes["logits_indices"] == ((1,), (128,), (32768,))
    assert shapes["past_key_values.1.value"] == ((1, 2, 1, 16), (16, 2, 2048, 16), (16, 2, 2048, 16))


# --------------------------------------------------------------------------------------------- fallback detection


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
    assert count_plugin_layers(inspector_json([gemm, plugin, by_node_name, other_plugin])) == 2


def test_the_function_body_fallback_counts_zero() -> None:
    # the body's layers carry the node's name but are ordinary layers (Scatter, Gather, Myelin regions...)
    body = [
        {"Name": "node_ragged_tree_attention__2/ScatterND", "LayerType": "Scatter"},
        {"Name": "{ForeignNode[node_ragged_tree_attention__2/Gather...]}", "LayerType": "Myelin"},
    ]
    assert count_plugin_layers(inspector_json(body)) == 0


def test_inspector_without_details_or_json_is_refused() -> None:
    with pytest.raises(PluginFallbackError, match="layer names only"):
        count_plugin_layers(inspector_json(["RaggedTreeAttention.0", "MatMul"]))
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
            return types.SimpleNamespace(get_engine_information=lambda fmt: inspector_json(self.layers))

    good = Engine([{"Name": f"RaggedTreeAttention.{i}:n", "LayerType": "PluginV3"} for i in range(2)])
    assert trt_export.assert_plugin_layers(good, expected=2) == 2
    with pytest.raises(PluginFallbackError, match="has 0 RaggedTreeAttention plugin layers, expected 2"):
        trt_export.assert_plugin_layers(Engine([{"Name": "x", "LayerType": "Scatter"}]), expected=2)

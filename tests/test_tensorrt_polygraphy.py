"""The polygraphy comparison recipe (ONNX Runtime against TensorRT): its flags and shapes, the inspect recipe, the
data loader's feeds (run through ONNX Runtime), and the script's import as polygraphy does it. The recipe's TensorRT
half runs in ``test_tensorrt_engines.py``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from trt_stand_ins import REPO, export_tiny_graph, fake_export

from specdec.export import tensorrt as trt_export
from specdec.export.scripts import polygraphy_glue
from specdec.export.tensorrt import ProfileSpec, polygraphy_recipe
from specdec.models.loading import LoadedModel
from specdec.plugins import trt_plugin
from specdec.runtime.graph_io import GRAPH_INPUTS


def test_polygraphy_recipe_has_the_comparison_flags(tmp_path: Path) -> None:
    model = fake_export(tmp_path / "model.onnx")
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
def tiny_graph(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, LoadedModel]:
    """A real 2-layer export (fp32) and its model."""
    return export_tiny_graph(tmp_path_factory.mktemp("trt_graph"))


def test_polygraphy_data_loader_feeds_run_in_onnxruntime(tiny_graph, monkeypatch: pytest.MonkeyPatch) -> None:
    """The feeds the recipe gives both runners are valid ragged steps (ORT, the reference side, runs them)."""
    import onnxruntime as ort

    path, model = tiny_graph
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
        assert logits.shape == (feed["logits_indices"].shape[0], model.vocab_size) and np.isfinite(logits).all()


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

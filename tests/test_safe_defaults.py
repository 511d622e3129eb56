"""What an export directory may make specdec load: only files inside it, each one checksummed.

An export is copied between machines and mounted into servers, so its manifest is input: a graph
path that climbs out of the directory, a graph that no checksum covers, a tokenizer file edited or
added after the export, and pickles that run code on load are all refused with a message.
"""

from __future__ import annotations

import ast
import json
import shutil
from pathlib import Path

import pytest

from specdec.export.cli import main as export_main
from specdec.models.export_meta import ModelResolutionError, load_export_metadata
from specdec.models.manifest import ExportDirError, export_path, read_manifest
from specdec.runtime.engine import Engine

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def export(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("safe") / "deploy"
    # test_onnx_backend's draft model: its graph is exported once per session (export_cache)
    assert export_main(["--target", "tiny-random:seed=10,num_layers=1", "--out", str(out)]) == 0
    return out


@pytest.fixture
def copy(export: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(export, tmp_path / "copy"))


def _edit_manifest(root: Path, **target: object) -> None:
    manifest = json.loads((root / "manifest.json").read_text())
    manifest["target"].update(target)
    (root / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize("name", ["/etc/passwd", "../outside.onnx", "target/../../outside.onnx", "", None, 7])
def test_a_manifest_path_outside_the_export_is_refused(tmp_path: Path, name: object) -> None:
    with pytest.raises(ExportDirError, match="not a path inside the export"):
        export_path(tmp_path, name)
    assert export_path(tmp_path, "target/model.onnx") == tmp_path / "target" / "model.onnx"


def test_a_graph_outside_the_export_or_without_a_checksum_is_not_opened(copy: Path, tmp_path: Path) -> None:
    outside = tmp_path / "outside.onnx"
    shutil.copy(copy / "target" / "model.onnx", outside)
    _edit_manifest(copy, graph="../outside.onnx")
    with pytest.raises(ExportDirError, match="not a path inside the export"):
        Engine.from_export(copy)
    shutil.copy(copy / "target" / "model.onnx", copy / "model.onnx")  # inside, but listed nowhere
    _edit_manifest(copy, graph="model.onnx")
    with pytest.raises(ExportDirError, match="has no checksum"):
        Engine.from_export(copy)


def test_an_edited_or_added_metadata_file_is_caught_by_the_served_loader(copy: Path) -> None:
    load_export_metadata(copy)  # what the served pre- and postprocessing models call
    config = copy / "target" / "config.json"
    original = config.read_bytes()
    config.write_bytes(original.replace(b"{", b"{ ", 1))
    with pytest.raises(ModelResolutionError, match="does not match its checksum"):
        load_export_metadata(copy)
    config.write_bytes(original)
    (copy / "target" / "tokenizer.json").write_text("{}")  # a tokenizer slipped in after the export
    with pytest.raises(ModelResolutionError, match=r"not listed in manifest\.json"):
        load_export_metadata(copy)
    with pytest.raises(ExportDirError, match="not listed"):
        read_manifest(copy)


def test_the_metadata_check_does_not_hash_the_weights(copy: Path) -> None:
    (copy / "target" / "model.onnx.data").write_bytes(b"not the weights")
    load_export_metadata(copy)  # tokenizer and config only: the engine's own load hashes the graph
    with pytest.raises(ExportDirError, match="does not match its checksum"):
        read_manifest(copy)


def test_nothing_unpickles_arbitrary_objects() -> None:
    """Every ``torch.load`` in the package passes ``weights_only=True`` (tensors and plain containers only)."""
    offenders = []
    for path in sorted((REPO / "specdec").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "load"
                and isinstance(node.func.value, ast.Name)
                and node.func.value.id == "torch"
            ):
                flag = next((k.value for k in node.keywords if k.arg == "weights_only"), None)
                if not (isinstance(flag, ast.Constant) and flag.value is True):
                    offenders.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert not offenders, f"torch.load without weights_only=True: {offenders}"

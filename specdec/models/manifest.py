"""An export directory's manifest: what was exported, from what, and the checksum of every file.

It sits below the runtime because loading an export (``Engine.from_export``, ``load_model`` on
an export directory) must verify the files before any session opens them; ``specdec-export``
writes it.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path, PurePosixPath

MANIFEST = "manifest.json"
FORMAT_VERSION = 1
PARTS = ("target", "draft")
#: what a model part's metadata loader reads without the weights: everything but the graphs and weights
WEIGHT_SUFFIXES = (".onnx", ".data", ".engine", ".plan", ".safetensors", ".bin", ".pt")


class ExportDirError(ValueError):
    """An export directory is missing, incomplete or corrupt."""


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def checksums(root: Path, sub: str) -> dict[str, str]:
    return {str(p.relative_to(root)): sha256(p) for p in sorted((root / sub).rglob("*")) if p.is_file()}


def export_path(directory: Path, name: object) -> Path:
    """The file a manifest entry names, which must lie inside the export: relative, with no ``..``.

    Why lexical and not ``resolve()``: a deployment may be made of symlinks into a shared volume
    (``_external_data_folder`` in the ORT backend), which is the operator's choice; a manifest that
    names ``/etc/...`` or ``../../x`` is not, and would make an export load and run a file that no
    checksum covers.
    """
    rel = PurePosixPath(str(name)) if isinstance(name, str) else None
    if rel is None or not rel.parts or rel.is_absolute() or ".." in rel.parts or "\\" in str(name):
        raise ExportDirError(f"{directory / MANIFEST} names {name!r}, which is not a path inside the export")
    return directory / rel


def verify_part(directory: Path, manifest: dict, part: str, *, weights: bool = True) -> None:
    """Check the files of one part (``target``/``draft``) against their checksums.

    Every file of the part's folder must be listed (an added ``chat_template.jinja`` would change what
    the tokenizer does as surely as an edited one) and the part's graph must be one of them.
    ``weights=False`` skips hashing the graphs and weights, for a process that reads only the
    tokenizer and config (the served pre- and postprocessing models).
    """
    entry = manifest.get(part)
    if not isinstance(entry, dict):
        return
    files = entry.get("files", {})
    if not isinstance(files, dict):
        raise ExportDirError(f"{directory / MANIFEST}: the {part} file list is corrupt")
    listed = {export_path(directory, rel): digest for rel, digest in files.items()}
    if "graph" in entry and export_path(directory, entry["graph"]) not in listed:
        raise ExportDirError(f"{directory / MANIFEST}: the {part} graph {entry['graph']!r} has no checksum")
    folder = directory / part
    unlisted = (
        sorted(str(p.relative_to(directory)) for p in folder.rglob("*") if p.is_file() and p not in listed)
        if folder.is_dir()
        else []
    )
    if unlisted:
        raise ExportDirError(
            f"{directory}: {', '.join(unlisted[:3])} not listed in {MANIFEST}: the export was changed "
            "after it was written"
        )
    for file, digest in listed.items():
        if not weights and file.name.endswith(WEIGHT_SUFFIXES):
            continue
        if not file.is_file():
            raise ExportDirError(f"{file} is listed in {MANIFEST} but missing")
        if sha256(file) != digest:
            raise ExportDirError(f"{file} does not match its checksum in {MANIFEST}: the export is corrupt")


def read_manifest(directory: Path, verify: bool = True, *, weights: bool = True) -> dict:
    """Load and (by default) checksum-verify an export directory's manifest (see ``verify_part``)."""
    path = directory / MANIFEST
    if not path.is_file():
        raise ExportDirError(f"{directory} is not a specdec export directory (no {MANIFEST})")
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ExportDirError(f"{path} is corrupt: {exc}") from exc
    if not isinstance(manifest, dict) or manifest.get("specdec_export") != FORMAT_VERSION:
        raise ExportDirError(f"{path} is not a specdec export manifest of format {FORMAT_VERSION}")
    if verify:
        for part in PARTS:
            verify_part(directory, manifest, part, weights=weights)
    return manifest

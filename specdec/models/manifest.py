"""An export directory's manifest: what was exported, from what, and the checksum of every file.

It sits below the runtime because loading an export (``Engine.from_export``, ``load_model`` on
an export directory) must verify the files before any session opens them; ``specdec-export``
writes it.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

MANIFEST = "manifest.json"
FORMAT_VERSION = 1


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


def read_manifest(directory: Path, verify: bool = True) -> dict:
    """Load and (by default) checksum-verify an export directory's manifest."""
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
        for part in ("target", "draft"):
            for rel, digest in manifest.get(part, {}).get("files", {}).items():
                file = directory / rel
                if not file.is_file():
                    raise ExportDirError(f"{file} is listed in {MANIFEST} but missing")
                if sha256(file) != digest:
                    raise ExportDirError(f"{file} does not match its checksum in {MANIFEST}: the export is corrupt")
    return manifest

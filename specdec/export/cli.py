"""``specdec-export``: resolve a target/draft pair and write a self-contained deployment directory.

Layout of ``--out DIR``::

    DIR/manifest.json      what was exported, from what, with which versions and checksums
    DIR/target/            the target as a Hugging Face directory (config, safetensors, tokenizer)
    DIR/draft/             the draft model, when ``--draft`` names one (absent for the n-gram drafter)

The directory is assembled under a temporary name and renamed into place only when
complete, so an interrupted export never leaves something that looks valid.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from tqdm.auto import tqdm

from specdec.export.models import DEFAULT_TARGET, LoadedModel, ModelResolutionError, load_model, save_model

MANIFEST = "manifest.json"
FORMAT_VERSION = 1


class ExportDirError(ValueError):
    """An export directory is missing, incomplete or corrupt."""


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _describe(model: LoadedModel, sub: str, root: Path) -> dict:
    cfg = model.config
    return {
        "name": model.name,
        "source": model.source,
        "path": sub,
        "vocab_size": model.vocab_size,
        "num_layers": int(cfg.num_hidden_layers),
        "hidden_size": int(cfg.hidden_size),
        "num_heads": int(cfg.num_attention_heads),
        "num_kv_heads": int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads),
        "dtype": "float32",
        "weights_checksum": model.checksum(),
        "files": {str(p.relative_to(root)): _sha256(p) for p in sorted((root / sub).rglob("*")) if p.is_file()},
    }


def export(target: str, draft: str | None, out: Path, force: bool = False) -> Path:
    """Write ``out`` (see module docstring); refuses an existing directory unless ``force``."""
    if out.exists() and not force:
        raise ExportDirError(f"{out} already exists: pass --force to overwrite it")
    from specdec import __version__

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial.", dir=out.parent))
    try:
        stages = tqdm(total=3 if draft else 2, desc="export", unit="stage")
        target_model = load_model(target)
        save_model(target_model, tmp / "target")
        stages.update()
        manifest = {
            "specdec_export": FORMAT_VERSION,
            "specdec_version": __version__,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "command": " ".join(["specdec-export", *sys.argv[1:]]),
            "python": platform.python_version(),
            "target": _describe(target_model, "target", tmp),
            "drafter": "ngram",
        }
        if draft:
            from specdec.runtime.engine import check_draft_compatible

            draft_model = load_model(draft)
            check_draft_compatible(target_model, draft_model)
            save_model(draft_model, tmp / "draft")
            manifest["draft"] = _describe(draft_model, "draft", tmp)
            manifest["drafter"] = "model"
            stages.update()
        import torch
        import transformers

        manifest["versions"] = {"torch": torch.__version__, "transformers": transformers.__version__}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2))
        stages.update()
        stages.close()
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


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
                if _sha256(file) != digest:
                    raise ExportDirError(f"{file} does not match its checksum in {MANIFEST}: the export is corrupt")
    return manifest


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="specdec-export", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=DEFAULT_TARGET, help="preset, Hugging Face directory or .gguf file")
    parser.add_argument("--draft", help="draft model (preset, directory, .gguf) or 'none' for the n-gram drafter")
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--force", action="store_true", help="overwrite an existing --out")
    args = parser.parse_args(argv)
    draft = None if args.draft in (None, "none", "ngram") else args.draft
    try:
        out = export(args.target, draft, Path(args.out), args.force)
    except (ModelResolutionError, ExportDirError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted: nothing was written", file=sys.stderr)
        return 130
    print(f"exported to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

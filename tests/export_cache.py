"""Identical ONNX exports are made once per test session and copied after that.

Why: ``torch.onnx.export`` of even a two-layer model takes seconds, and many fast tests export the
same tiny models (the variants of ``test_onnx_backend``, the seed 9 / 10 pair, ``tiny_dir``). The
exporter is deterministic for a model, dtype and file name, so the second and later exports of the
same one copy the first's files: every distinct export still runs, with all its checks, once.

The key holds the full weights and the config, not ``LoadedModel.checksum`` (which samples each
tensor): two models that differ anywhere export separately. Models above ``MAX_PARAMS`` (the real
SmolLM2) are not cached; hashing them costs more than it saves.
"""

from __future__ import annotations

import atexit
import hashlib
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

MAX_PARAMS = 5_000_000


def _key(model: Any, path: Path, dtype: torch.dtype, external_data: bool) -> str | None:
    if sum(t.numel() for t in model.state_dict.values()) > MAX_PARAMS:
        return None
    h = hashlib.sha256()
    h.update(f"{model.name}|{path.name}|{dtype}|{external_data}|{model.config.to_json_string()}".encode())
    for name in sorted(model.state_dict):
        h.update(name.encode())
        h.update(model.state_dict[name].detach().to(torch.float32).contiguous().numpy().tobytes())
    return h.hexdigest()


def caching(export: Callable[..., Path]) -> Callable[..., Path]:
    """``export`` (``specdec.export.onnx.export_onnx``) with a per-session cache of its output files."""
    store = Path(tempfile.mkdtemp(prefix="specdec-export-cache-"))
    atexit.register(shutil.rmtree, store, ignore_errors=True)
    done: dict[str, Path] = {}

    def cached(model: Any, path: Any, dtype: torch.dtype = torch.float32, external_data: bool = True) -> Path:
        out = Path(path)
        key = _key(model, out, dtype, external_data)
        if key is None:
            return export(model, out, dtype, external_data)
        if key not in done:
            made = export(model, out, dtype, external_data)
            keep = store / key
            keep.mkdir()
            for file in made.parent.glob(made.name + "*"):  # the graph and its external data
                shutil.copy2(file, keep / file.name)
            done[key] = keep
            return made
        out.parent.mkdir(parents=True, exist_ok=True)
        for file in done[key].iterdir():
            shutil.copy2(file, out.parent / file.name)
        return out

    cached.__wrapped__ = export  # type: ignore[attr-defined]
    return cached

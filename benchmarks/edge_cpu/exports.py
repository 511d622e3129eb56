"""The specdec exports the edge benchmark runs, made once and reused, and the GGUF's fp32 HF conversion."""

from __future__ import annotations

import shlex
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from benchmarks.edge_cpu import DRAFT, EXPORT_FLAGS, TARGET

# -- exports ---------------------------------------------------------------------------------


def export_command(precision: str, out: Path, k: int, max_batch: int, force: bool = False) -> list[str]:
    """The ``specdec-export`` command of one precision (its ``EXPORT_FLAGS``)."""
    cmd = [
        "specdec-export",
        "--target",
        TARGET,
        "--draft",
        DRAFT,
        "--adaptive-draft",
        "--calibrate",
        "--num-draft-tokens",
        str(k),
        "--max-batch",
        str(max_batch),
        "--out",
        str(out),
        *(["--force"] * force),
    ]
    return [*cmd[:5], *EXPORT_FLAGS[precision], *cmd[5:]]


def quantize_support() -> str | None:
    """None when ``specdec-export`` accepts ``--quantize``; else why the int rows cannot run."""
    proc = subprocess.run(
        [sys.executable, "-m", "specdec.export.cli", "--help"], capture_output=True, text=True, check=False
    )
    if proc.returncode != 0:
        return f"`specdec-export --help` failed: {proc.stderr.strip()[-200:]}"
    return None if "--quantize" in proc.stdout else "not available: this specdec-export has no --quantize option yet"


def ensure_exports(
    precisions: Sequence[str],
    export_dir: Path,
    k: int,
    max_batch: int,
    reexport: bool = False,
) -> dict[str, dict[str, Any]]:
    """Each precision's export directory (reused when it holds a manifest, unless ``reexport``) or why it is
    unavailable."""
    from specdec.models.manifest import read_manifest

    quantize = quantize_support() if any(p != "fp32" for p in precisions) else None
    found: dict[str, dict[str, Any]] = {}
    todo = []
    for precision in precisions:
        out = export_dir / precision
        if (out / "manifest.json").is_file() and not reexport:
            found[precision] = {"dir": str(out), "reused": True}
        elif precision != "fp32" and quantize:
            found[precision] = {"error": quantize}
        else:
            todo.append(precision)
    for precision in tqdm(todo, desc="exports", unit="export", disable=not todo):
        out = export_dir / precision
        cmd = export_command(precision, out, k, max_batch, force=out.exists())
        export_dir.mkdir(parents=True, exist_ok=True)
        log = export_dir / f"{precision}.export.log"
        t0 = time.perf_counter()
        with log.open("w", encoding="utf-8") as f:
            proc = subprocess.run(
                [sys.executable, "-m", "specdec.export.cli", *cmd[1:]], stdout=f, stderr=subprocess.STDOUT, check=False
            )
        if proc.returncode == 0:
            found[precision] = {"dir": str(out), "reused": False, "seconds": round(time.perf_counter() - t0, 1)}
        else:
            tail = log.read_text(encoding="utf-8", errors="replace").strip().splitlines()[-1:]
            found[precision] = {"error": f"not available: `{shlex.join(cmd)}` failed ({' '.join(tail)}; {log})"}
    found = {p: found[p] for p in precisions}
    for info in found.values():
        if "dir" in info:
            manifest = read_manifest(Path(info["dir"]), verify=False)
            info.update(
                command=manifest.get("command"),
                created=manifest.get("created"),
                calibration=manifest.get("calibration"),
                dtype=manifest.get("dtype"),
                quantize=manifest.get("quantize"),
            )
    return found


def ensure_hf_dir(export_dir: Path) -> Path:
    """The GGUF's fp32 conversion as a Hugging Face directory, for transformers' ``from_pretrained``."""
    out = export_dir / "hf"
    if not (out / "config.json").is_file():
        from specdec.models.loading import load_model, save_model

        save_model(load_model(TARGET), out)
    return out

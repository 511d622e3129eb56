"""Which peer models and rows the edge benchmark runs, and the spec each one is run with.

A *model* is one converted artifact (``convert``) an engine opens; a *row* is a model run in one mode at one
batch size. Every peer has a row as a user would deploy it (int4 weights) and one at its most faithful
setting (fp32 weights or int8 weights at f32 arithmetic), each judged against fp32 for its answers, its
next-token choices and its perplexity (``fidelity``).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.peers.protocol import REPO

PEERS = ("llama.cpp", "ortgenai", "openvino")
DEFAULT_PEERS_DIR = REPO / "benchmarks" / ".cache" / "peers"
DEFAULT_VENVS = REPO / ".work" / "peers"
#: the CPU plugin's settings of the most faithful OpenVINO row: f32 arithmetic and caches, no int8 activations
OPENVINO_FAITHFUL = {
    "INFERENCE_PRECISION_HINT": "f32",
    "KV_CACHE_PRECISION": "f32",
    "DYNAMIC_QUANTIZATION_GROUP_SIZE": "0",
}
#: llama-server's n-gram speculation (lookup n-gram, draft m-gram), prompt lookup as the others run it
LLAMA_NGRAM = (3, 6)
#: OpenVINO GenAI's prompt lookup: draft tokens per step, longest n-gram matched
OPENVINO_LOOKUP = {"assistant_tokens": 6, "ngram_size": 3}


@dataclass(frozen=True)
class PeerModel:
    """One converted model of one peer; ``name`` is its folder under the peers directory (``convert``)."""

    name: str
    peer: str
    label: str
    faithful: bool
    properties: dict[str, str] = field(default_factory=dict)  # OpenVINO: the CPU plugin's settings


MODELS = {
    m.name: m
    for m in (
        PeerModel("llama-q4_1", "llama.cpp", "llama-server Q4_1", False),
        PeerModel("llama-f32", "llama.cpp", "llama-server F32 (dequantised Q4_1)", True),
        PeerModel("ortgenai-int4", "ortgenai", "ORT GenAI int4", False),
        PeerModel("ortgenai-fp32", "ortgenai", "ORT GenAI fp32", True),
        PeerModel("openvino-int4", "openvino", "OpenVINO int4", False),
        PeerModel("openvino-int8", "openvino", "OpenVINO int8, f32 arithmetic", True, OPENVINO_FAITHFUL),
    )
}


@dataclass(frozen=True)
class PeerRow:
    """One peer row of the table: a model, a mode (``plain``, ``ngram`` / ``lookup``, ``cb``), a batch size."""

    model: str
    mode: str
    batch: int

    @property
    def label(self) -> str:
        m = MODELS[self.model]
        suffix = {"plain": "", "cb": " continuous batching", "ngram": " n-gram", "lookup": " prompt lookup"}[self.mode]
        return m.label + suffix

    @property
    def plain_label(self) -> str | None:
        """The label of the same model's row without speculation (whose answers a greedy speculation repeats)."""
        return MODELS[self.model].label if self.mode in ("ngram", "lookup") else None


def peer_rows(peers: Sequence[str], batches: Sequence[int]) -> list[PeerRow]:
    """The rows of ``peers``: the deployed model at every batch size (llama-server's slots, ORT GenAI's padded
    batch, OpenVINO's continuous batching past 1) and with its own speculation at batch 1, the faithful model
    at batch 1."""
    rows: list[PeerRow] = []
    for model in MODELS.values():
        if model.peer not in peers:
            continue
        if model.faithful:
            rows.append(PeerRow(model.name, "plain", 1))
            continue
        rows += [PeerRow(model.name, "cb" if model.peer == "openvino" and b > 1 else "plain", b) for b in batches]
        if model.peer == "llama.cpp":
            rows += [PeerRow(model.name, "ngram", b) for b in batches if b in (1, 8)]
        elif model.peer == "openvino" and 1 in batches:
            rows.append(PeerRow(model.name, "lookup", 1))
    return rows


def python_of(peer: str, venvs: Path) -> Path:
    """The interpreter a peer's child runs under: its own venv's, llama.cpp's the project's (an HTTP client)."""
    return Path(sys.executable) if peer == "llama.cpp" else venvs / peer / "bin" / "python"


def model_spec(model: PeerModel, peers_dir: Path, venvs: Path, threads: int) -> dict[str, Any]:
    """What any task of ``model`` needs: where its files are and how its engine is set up."""
    spec: dict[str, Any] = {"threads": threads}
    if model.peer == "llama.cpp":
        spec.update(server=str(venvs / "llama.cpp" / "build" / "bin" / "llama-server"))
        spec.update(gguf=str(peers_dir / f"{model.name}.gguf"))
    else:
        spec.update(model=str(peers_dir / model.name))
    if model.peer == "openvino":
        spec.update(properties={"INFERENCE_NUM_THREADS": str(threads), **model.properties})
    return spec


def row_spec(row: PeerRow, peers_dir: Path, venvs: Path, threads: int) -> dict[str, Any]:
    """The ``generate`` spec of ``row`` (the prompts, budget and EOS are the benchmark's own, added by it)."""
    model = MODELS[row.model]
    spec = {**model_spec(model, peers_dir, venvs, threads), "task": "generate", "batch": row.batch}
    if model.peer == "llama.cpp":
        spec.update(ngram=list(LLAMA_NGRAM) if row.mode == "ngram" else None)
    if model.peer == "openvino":
        spec.update(mode={"plain": "pipeline", "cb": "cb", "lookup": "lookup"}[row.mode], **OPENVINO_LOOKUP)
    return spec

"""Shared fixtures: a tiny random target/draft pair and the real SmolLM2-135M (slow)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from specdec.models.loading import LoadedModel, load_model, save_model, tiny_random

# Two intra-op threads (the CI machine has 2 cores); SPECDEC_TEST_THREADS overrides it, e.g. =1 on a
# loaded machine, where two spinning OpenMP threads make every tiny op wait for a free core.
torch.set_num_threads(int(os.environ.get("SPECDEC_TEST_THREADS", "2")))


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """One intra-op thread for a module of tiny-model tests, restored afterwards.

    Tiny models run thousands of small ops per step; on a loaded 2-core CPU one thread is far
    faster (4,000 engine requests: 3.7 s with one thread, 93 s with two).
    """
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_pair() -> tuple[LoadedModel, LoadedModel]:
    """(target, draft): seeded random LLaMAs sharing a 128-token vocabulary."""
    target = tiny_random(seed=1, vocab_size=128, name="tiny-target")
    draft = tiny_random(seed=2, vocab_size=128, name="tiny-draft")
    return target, draft


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random LLaMA with SmolLM2's real tokenizer, saved as a model directory (fast, but text in and
    text out): what the command-line tests load by path."""
    tokenizer = load_model("smollm2-135m").tokenizer
    tiny = tiny_random(seed=5, vocab_size=len(tokenizer), num_layers=1, hidden_size=16, num_heads=2,
                       num_kv_heads=1, intermediate_size=32, tie_word_embeddings=True)
    tiny.config.eos_token_id = tokenizer.eos_token_id
    path = tmp_path_factory.mktemp("models") / "tiny-smol"
    save_model(LoadedModel("tiny-smol", tiny.config, tiny.state_dict, tokenizer, "test"), path)
    return path


@pytest.fixture(scope="session")
def smollm2() -> LoadedModel:
    """The real SmolLM2-135M-Instruct (first load ~25 s, cached conversion afterwards). Mark users slow."""
    return load_model("smollm2-135m")


@pytest.fixture(scope="session")
def smollm2_export(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2-135M with its shipped distilled draft, exported to ONNX (graphs + Triton repository), once per
    session (~1 min). The draft has a restricted LM head, so ORT runs that path too. Mark users slow."""
    from specdec.export.cli import main as export_main

    out = tmp_path_factory.mktemp("smol") / "deploy"
    assert export_main(["--target", "smollm2-135m", "--draft", "smollm2-135m-draft", "--out", str(out),
                        "--max-batch", "8", "--max-len", "1024"]) == 0
    return out

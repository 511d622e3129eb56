"""Shared fixtures: a tiny random target/draft pair and the real SmolLM2-135M (slow)."""

from __future__ import annotations

import os

import pytest
import torch

from specdec.export.models import LoadedModel, load_model, tiny_random

# Two intra-op threads (the CI machine has 2 cores); SPECDEC_TEST_THREADS overrides it, e.g. =1 on a
# loaded machine, where two spinning OpenMP threads make every tiny op wait for a free core.
torch.set_num_threads(int(os.environ.get("SPECDEC_TEST_THREADS", "2")))


@pytest.fixture(scope="session")
def tiny_pair() -> tuple[LoadedModel, LoadedModel]:
    """(target, draft): seeded random LLaMAs sharing a 128-token vocabulary."""
    target = tiny_random(seed=1, vocab_size=128, name="tiny-target")
    draft = tiny_random(seed=2, vocab_size=128, name="tiny-draft")
    return target, draft


@pytest.fixture(scope="session")
def smollm2() -> LoadedModel:
    """The real SmolLM2-135M-Instruct (first load ~25 s, cached conversion afterwards). Mark users slow."""
    return load_model("smollm2-135m")

"""Shared fixtures and the test tiers: a tiny random target/draft pair, and the real SmolLM2-135M (slow).

Tiers (markers in pyproject.toml): ``real_model`` loads the real SmolLM2-135M, ``server`` starts a
tritonserver, ``statistical`` is a Monte-Carlo law check with many samples, ``gpu`` needs CUDA or
TensorRT. ``slow`` is any of the first three; it is added here, never by hand, so ``-m "not slow"``
(scripts/test_fast.sh) is the inner loop of a couple of minutes and the full run keeps everything.
"""

from __future__ import annotations

import gc
import os
import shutil
from collections.abc import Generator
from pathlib import Path
from typing import NoReturn

import pytest
import torch
from export_cache import caching
from fakes import small_tokenizer
from servers import REPORTS

from specdec.export import onnx as onnx_export
from specdec.models import loading
from specdec.models.loading import LoadedModel, load_model, save_model, tiny_random

# before any test module binds it: identical tiny exports run once per session (tests/export_cache.py)
onnx_export.export_onnx = caching(onnx_export.export_onnx)

# One intra-op thread; SPECDEC_TEST_THREADS overrides it. Why: the models here are tiny (or SmolLM2-135M at batch
# 1), so a step is thousands of small ops, and on a 2-core machine that other work shares, two spinning OpenMP
# threads make each of them wait for a free core: the tiny-model modules ran several times slower with two.
torch.set_num_threads(int(os.environ.get("SPECDEC_TEST_THREADS", "1")))

#: the tiers that make a test slow, each costing tens of seconds to minutes
SLOW_TIERS = ("real_model", "server", "statistical")
#: fixtures that load the real SmolLM2: their users are real_model whether or not they say so
REAL_MODEL_FIXTURES = frozenset({"smollm2", "smollm2_export", "smollm2_int4_graph", "smollm2_w8a8_graph"})


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Derive ``real_model`` from the fixtures a test uses and ``slow`` from its tiers, before ``-m`` selects.

    Why derived: a marker written by hand drifts from what the test does; a test that gains a
    ``smollm2`` fixture (directly or through another fixture) is slow from that moment on.
    """
    for item in items:
        if REAL_MODEL_FIXTURES & set(getattr(item, "fixturenames", ())) and not item.get_closest_marker("real_model"):
            item.add_marker(pytest.mark.real_model)
        if any(item.get_closest_marker(tier) for tier in SLOW_TIERS) and not item.get_closest_marker("slow"):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="module", autouse=True)
def _frozen_survivors() -> None:
    """Before each test module: collect the garbage, then move what survives out of the collector's sight
    (``gc.freeze``): the imported libraries, the collected tests, the session's fixtures and caches.

    Why: a full collection walks every tracked object, and torch, transformers, onnx and the exporter's lazily
    imported modules are hundreds of thousands of them; code under test collects on purpose (the benchmark
    harness before each timed run, the serving models' ``finalize``: ``triton_io.release_senders``), and those
    walks were most of ``test_bench.py``'s and ``test_triton_models.py``'s time. Objects the module's tests make
    are collected as before; a survivor that dies later in a reference cycle waits for the session's end
    (``pytest_sessionfinish``).
    """
    gc.collect()
    gc.freeze()


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """Keep each phase's report on the item (``servers.failed``)."""
    report = yield
    item.stash.setdefault(REPORTS, {})[report.when] = report
    return report


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Hand the frozen objects back, so the interpreter's last collection frees them as it would have (extension
    modules such as triton's nanobind report every object still alive at exit as a leak)."""
    gc.unfreeze()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None, object, object]:
    """Outside ``real_model`` tests, resolving the real SmolLM2 fails the test, naming the marker it lacks.

    The guard wraps the item's whole setup, call and teardown, so a module- or session-scoped
    fixture that the item is the first to need is caught too (an autouse function fixture would
    be set up only after them). It raises pytest's ``Failed``, which ``except Exception`` does not
    swallow. Only in-process loads are caught; a subprocess would need its own guard.
    """
    if item.get_closest_marker("real_model"):
        return (yield)

    def refuse(preset: loading.Preset) -> NoReturn:
        pytest.fail(
            f"{item.nodeid} loads the real model {preset.name!r}: mark it real_model "
            "(or use the tiny models and tests/fakes.py)",
            pytrace=False,
        )

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(loading, "_find_wheel_gguf", refuse)
        return (yield)


@pytest.fixture(scope="session")
def tiny_pair() -> tuple[LoadedModel, LoadedModel]:
    """(target, draft): seeded random LLaMAs sharing a 128-token vocabulary."""
    target = tiny_random(seed=1, vocab_size=128, name="tiny-target")
    draft = tiny_random(seed=2, vocab_size=128, name="tiny-draft")
    return target, draft


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random LLaMA with a small byte-level BPE tokenizer (``fakes.small_tokenizer``: ChatML chat
    template, EOS ``<|im_end|>``), saved as a model directory: text in and text out without loading SmolLM2,
    which is what the command-line tests load by path."""
    tokenizer = small_tokenizer()
    tiny = tiny_random(
        seed=5,
        vocab_size=len(tokenizer),
        num_layers=1,
        hidden_size=16,
        num_heads=2,
        num_kv_heads=1,
        intermediate_size=32,
        tie_word_embeddings=True,
    )
    tiny.config.eos_token_id = tokenizer.eos_token_id
    path = tmp_path_factory.mktemp("models") / "tiny-smol"
    save_model(LoadedModel("tiny-smol", tiny.config, tiny.state_dict, tokenizer, "test"), path)
    return path


@pytest.fixture(scope="session")
def tiny_export(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``tiny_dir`` exported to ONNX drafting for itself (graphs + Triton repository): a whole deployment that loads
    in seconds, for the serving tests whose subject is the serving, not the model."""
    from specdec.export.cli import main as export_main

    out = tmp_path_factory.mktemp("tiny-serving") / "deploy"
    args = ["--target", str(tiny_dir), "--draft", str(tiny_dir), "--out", str(out), "--max-batch", "4"]
    assert export_main([*args, "--max-len", "128"]) == 0
    return out


@pytest.fixture(scope="session")
def smollm2() -> LoadedModel:
    """The real SmolLM2-135M-Instruct (first load ~25 s, cached conversion afterwards); its users are real_model."""
    return load_model("smollm2-135m")


@pytest.fixture(scope="session")
def smollm2_export(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2-135M with its shipped distilled draft, exported to ONNX (graphs + Triton repository), once per
    session (~1 min). The draft has a restricted LM head, so ORT runs that path too. Its users are real_model."""
    from specdec.export.cli import main as export_main

    out = tmp_path_factory.mktemp("smol") / "deploy"
    assert (
        export_main(
            [
                "--target",
                "smollm2-135m",
                "--draft",
                "smollm2-135m-draft",
                "--out",
                str(out),
                "--max-batch",
                "8",
                "--max-len",
                "1024",
            ]
        )
        == 0
    )
    return out


def _smollm2_quantized(smollm2: LoadedModel, smollm2_export: Path, folder: Path, mode: str) -> Path:
    """A copy of ``smollm2_export``'s target graph quantized as ``--quantize mode`` ships it (not re-validated)."""
    from specdec.export.quantization.strategies import strategy_for
    from specdec.export.quantize import quantize_export

    for name in ("model.onnx", "model.onnx.data", "config.json"):
        shutil.copy(smollm2_export / "target" / name, folder / name)
    quantize_export(smollm2, folder / "model.onnx", strategy_for(mode))
    return folder / "model.onnx"


@pytest.fixture(scope="session")
def smollm2_int4_graph(smollm2: LoadedModel, smollm2_export: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The target graph of ``smollm2_export`` quantized as ``--quantize int4`` ships it: the GGUF's own Q4_1 and
    Q8_0 blocks, int8 activations (not re-validated here: ``test_quantize`` checks the blocks). Its users are
    real_model."""
    return _smollm2_quantized(smollm2, smollm2_export, tmp_path_factory.mktemp("smol-int4"), "int4")


@pytest.fixture(scope="session")
def smollm2_w8a8_graph(smollm2: LoadedModel, smollm2_export: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The target graph of ``smollm2_export`` as ``--quantize w8a8`` ships it (calibrated on its own tokenizer's
    chat template). Its users are real_model."""
    return _smollm2_quantized(smollm2, smollm2_export, tmp_path_factory.mktemp("smol-w8a8"), "w8a8")

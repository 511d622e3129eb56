"""Real TensorRT engines (``needs_trt``: TensorRT and a CUDA GPU; they skip with the reason elsewhere): one plugin
layer per attention layer, logits as the torch reference's and ONNX Runtime's, the caches written in place, the
profile's bounds, decoding as the torch backend does, fp16, the refused function-body fallback, the export CLI, and
the polygraphy recipe end to end.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from trt_stand_ins import REPO, export_tiny_graph

from specdec.export import tensorrt as trt_export
from specdec.export.tensorrt import ProfileSpec, polygraphy_recipe
from specdec.models.loading import LoadedModel
from specdec.plugins import trt_plugin
from specdec.runtime.backends import tensorrt as trt_backend
from specdec.runtime.config import EngineConfig


def _gpu_skip_reason() -> str | None:
    """Why the engine tests cannot run here; decided without importing triton, which fixes its interpreter mode
    when first imported (``test_triton_kernel.py`` runs it interpreted)."""
    if importlib.util.find_spec("tensorrt") is None:
        return "TensorRT not installed (no `tensorrt` module)"
    if not torch.cuda.is_available():
        return "no CUDA GPU"
    if importlib.util.find_spec("triton") is None:
        return "OpenAI Triton not installed (the plugin runs the Triton kernel)"
    import tensorrt

    if trt_plugin._parse_version(tensorrt.__version__) < trt_plugin.MIN_TENSORRT:
        return f"TensorRT {tensorrt.__version__} is older than {'.'.join(map(str, trt_plugin.MIN_TENSORRT))}"
    return None


_SKIP = _gpu_skip_reason()
needs_trt = pytest.mark.skipif(_SKIP is not None, reason=_SKIP or "")


@pytest.fixture(scope="module")
def tiny_graph(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, LoadedModel]:
    """A real 2-layer export (fp32) and its model."""
    return export_tiny_graph(tmp_path_factory.mktemp("trt_graph"))


@pytest.fixture(scope="module")
def tiny_engine(tiny_graph, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path, _ = tiny_graph
    engine = tmp_path_factory.mktemp("trt_engine") / "model.engine"
    return trt_export.build_engine(path, engine, "float32", profile=ProfileSpec.derive(max_batch=4, max_len=64))


@needs_trt
@pytest.mark.gpu
def test_engine_contains_one_plugin_layer_per_attention_layer(tiny_graph, tiny_engine: Path) -> None:
    backend = trt_backend.TensorRTBackend(tiny_engine)
    assert backend.num_layers == 2
    assert trt_export.assert_plugin_layers(backend.engine, expected=2) == 2
    assert backend.vocab_size == tiny_graph[1].vocab_size and backend.dtype == torch.float32


@needs_trt
@pytest.mark.gpu
def test_engine_matches_torch_reference_and_onnxruntime(tiny_graph, tiny_engine: Path) -> None:
    from specdec.export.validate import max_logit_error
    from specdec.runtime.backends.onnxruntime import OrtBackend
    from specdec.runtime.backends.torch_backend import TorchBackend

    path, model = tiny_graph
    for seed in range(3):  # max_logit_error also checks the idle slot was not touched
        assert max_logit_error(TorchBackend(model), trt_backend.TensorRTBackend(tiny_engine), seed=seed) < 1e-3
        assert max_logit_error(OrtBackend(path), trt_backend.TensorRTBackend(tiny_engine), seed=seed) < 1e-3


@needs_trt
@pytest.mark.gpu
def test_engine_writes_the_cache_in_place(tiny_graph, tiny_engine: Path) -> None:
    from specdec.runtime.backends.torch_backend import TorchBackend
    from specdec.runtime.packed import ROOT, SeqWork, pack

    _, model = tiny_graph
    backend, reference = trt_backend.TensorRTBackend(tiny_engine), TorchBackend(model)
    cache, ref_cache = backend.allocate_cache(4, 64), reference.allocate_cache(4, 64)
    pointers = [t.data_ptr() for t in (*cache.k, *cache.v)]
    steps = [
        [SeqWork(0, 0, [1, 2, 3, 4, 5], logits="last"), SeqWork(2, 0, [7, 8], logits="last")],
        [SeqWork(2, 2, [9, 10, 11], parents=[ROOT, 0, ROOT]), SeqWork(0, 5, [12])],
    ]
    for work in steps:
        batch = pack(work)
        logits = backend.step(batch, cache)
        assert isinstance(logits, np.ndarray)  # the logits rows on the host, as every backend returns them
        np.testing.assert_allclose(logits, reference.step(batch, ref_cache), atol=1e-3, rtol=0, strict=True)
    assert [t.data_ptr() for t in (*cache.k, *cache.v)] == pointers  # the caches stay torch CUDA tensors
    for slot, length in ((0, 6), (2, 5), (1, 8)):
        for (k, v), (rk, rv) in zip(cache.read(slot, length), ref_cache.read(slot, length)):
            np.testing.assert_allclose(k, rk, atol=1e-4, rtol=0, strict=True)
            np.testing.assert_allclose(v, rv, atol=1e-4, rtol=0, strict=True)


@needs_trt
@pytest.mark.gpu
def test_engine_refuses_steps_outside_its_profile(tiny_engine: Path) -> None:
    from specdec.runtime.packed import SeqWork, pack

    backend = trt_backend.TensorRTBackend(tiny_engine)
    with pytest.raises(trt_backend.ShapeOutOfProfileError, match=r"built for 1\.\.4"):
        backend.allocate_cache(5, 64)
    cache = backend.allocate_cache(4, 64)
    largest = pack([SeqWork(s, 0, list(range(1, 65))) for s in range(4)])  # 256 tokens, a [256, 64] mask
    assert backend.step(largest, cache).shape == (256, backend.vocab_size)  # exactly the profile's max still runs
    with pytest.raises(trt_backend.ShapeOutOfProfileError):
        backend.allocate_cache(4, 65)


@needs_trt
@pytest.mark.gpu
def test_engine_decodes_like_the_torch_backend(tiny_graph, tiny_engine: Path) -> None:
    from specdec.runtime.backends.torch_backend import TorchBackend
    from specdec.runtime.drafters import NgramDrafter
    from specdec.runtime.engine import Engine
    from specdec.runtime.request import Request

    _, model = tiny_graph
    requests = [
        Request([5, 6, 7, 5, 6], max_tokens=12),
        Request([9, 10] * 4, max_tokens=9),
        Request([3], max_tokens=15),
    ]
    trt_engine = Engine(
        trt_backend.TensorRTBackend(tiny_engine), NgramDrafter(), config=EngineConfig(max_batch=4, max_len=64)
    )
    torch_engine = Engine(TorchBackend(model), NgramDrafter(), config=EngineConfig(max_batch=4, max_len=64))
    want = [o.token_ids for o in torch_engine.generate(requests, "ar").outputs]
    assert [o.token_ids for o in trt_engine.generate(requests, "ar").outputs] == want
    assert [o.token_ids for o in trt_engine.generate(requests, "ems").outputs] == want


@needs_trt
@pytest.mark.gpu
def test_float16_engine_is_close_to_the_float32_reference(tmp_path: Path) -> None:
    import torch as _torch

    from specdec.export.onnx import export_onnx
    from specdec.export.validate import max_logit_error
    from specdec.models.loading import tiny_random
    from specdec.runtime.backends.torch_backend import TorchBackend

    model = tiny_random(seed=6, vocab_size=64, num_layers=2)
    graph = export_onnx(model, tmp_path / "model.onnx", _torch.float16)
    engine = trt_export.build_engine(graph, tmp_path / "model.engine", "float16", profile=ProfileSpec.derive(4, 64))
    backend = trt_backend.TensorRTBackend(engine)
    assert backend.dtype == _torch.float16
    assert max_logit_error(TorchBackend(model), backend) < 0.25


_UNREGISTERED_BUILD = """
import sys
from specdec.plugins import trt_plugin
trt_plugin.register = lambda: True  # pretend: the plugin is NOT in TensorRT's registry
from specdec.export.tensorrt import EngineBuildError, PluginFallbackError, ProfileSpec, build_engine
try:
    build_engine(sys.argv[1], sys.argv[2], profile=ProfileSpec.derive(4, 64))
except PluginFallbackError as exc:
    print("fallback:", exc)
except EngineBuildError as exc:
    print("build-error:", exc)
else:
    print("built")
"""


@needs_trt
@pytest.mark.gpu
def test_build_detects_the_silent_function_body_fallback(tiny_graph, tmp_path: Path) -> None:
    """Without the plugin registered, TensorRT imports the function body; build_engine must refuse the result.

    In a fresh process, since the plugin cannot be unregistered from this one.
    """
    path, _ = tiny_graph
    engine = tmp_path / "model.engine"
    done = subprocess.run(
        [sys.executable, "-c", _UNREGISTERED_BUILD, str(path), str(engine)],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    # "fallback" when TensorRT could import the body, "build-error" when it could not: refused either way
    assert done.stdout.startswith(("fallback:", "build-error:")), done.stdout[-3000:]
    assert not engine.exists()


@needs_trt
@pytest.mark.gpu
def test_export_cli_writes_an_engine(tmp_path: Path) -> None:
    from specdec.export.cli import main
    from specdec.models.manifest import read_manifest
    from specdec.runtime.engine import _backend_opener

    out = tmp_path / "deploy"
    assert main(["--target", "tiny-random:num_layers=1", "--backend", "tensorrt", "--out", str(out)]) == 0
    manifest = read_manifest(out)
    assert (out / manifest["target"]["engine"]).is_file()
    backend = _backend_opener("tensorrt")(out / manifest["target"]["graph"], False)
    assert backend.num_layers == 1


@needs_trt
@pytest.mark.skipif(shutil.which("polygraphy") is None, reason="polygraphy not installed")
@pytest.mark.gpu
def test_polygraphy_recipe_passes(tiny_graph) -> None:
    path, _ = tiny_graph
    recipe = polygraphy_recipe(path, profile=ProfileSpec.derive(4, 64))
    done = subprocess.run(["bash", "-c", recipe], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]

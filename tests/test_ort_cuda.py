"""The GPU route of the ONNX Runtime backend: caches in device memory, bound in place.

The provider and device choice is plain logic and runs everywhere; the device tests need
``onnxruntime-gpu`` with a working CUDA execution provider and a CUDA torch (the caches are torch
CUDA tensors there; on the CPU they are numpy arrays), and skip with that reason on any other machine.
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import torch

from specdec.export.onnx import export_onnx
from specdec.export.validate import random_packs
from specdec.models.loading import tiny_random
from specdec.runtime.backends.onnxruntime import OnnxModelError, OrtBackend, cache_device, default_providers
from specdec.runtime.config import EngineConfig
from specdec.runtime.drafters import NgramDrafter
from specdec.runtime.engine import Engine
from specdec.runtime.packed import pack

CUDA_EP = "CUDAExecutionProvider"
HAS_CUDA_EP = CUDA_EP in ort.get_available_providers() and torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(
    not HAS_CUDA_EP,
    reason="needs onnxruntime-gpu with the CUDA execution provider "
    "and a CUDA torch (pip install 'specdec[gpu]' on a CUDA machine)",
)


def test_cuda_is_chosen_on_its_device_only_where_this_onnxruntime_has_it() -> None:
    assert default_providers(["CPUExecutionProvider"]) == ["CPUExecutionProvider"]
    assert default_providers([CUDA_EP, "CPUExecutionProvider"], device_id=3) == [
        (CUDA_EP, {"device_id": "3"}),
        "CPUExecutionProvider",
    ]


def test_the_caches_follow_the_provider_the_session_really_runs_on() -> None:
    requested = [(CUDA_EP, {"device_id": "2"}), "CPUExecutionProvider"]
    assert cache_device([CUDA_EP, "CPUExecutionProvider"], requested) == ("cuda", 2)
    # CUDA asked for but the session fell back to the CPU (no driver): the caches stay on the host
    assert cache_device(["CPUExecutionProvider"], requested) == ("cpu", 0)
    assert cache_device([CUDA_EP], [CUDA_EP]) == ("cuda", 0)


@pytest.fixture(scope="module")
def tiny_graph(tmp_path_factory):
    model = tiny_random(seed=1, num_layers=2)
    return model, export_onnx(model, tmp_path_factory.mktemp("cuda") / "model.onnx")


def test_a_cache_from_another_device_is_refused_with_a_reason(tiny_graph) -> None:
    model, path = tiny_graph
    backend = OrtBackend(path, providers=["CPUExecutionProvider"])
    cache = backend.allocate_cache(2, 16)
    assert backend.device == ("cpu", 0) and all(isinstance(t, np.ndarray) for t in (*cache.k, *cache.v))
    backend.device = ("cuda", 0)  # as a CUDA session would be, with host caches handed to it
    with pytest.raises(OnnxModelError, match=r"caches are on cpu, the session on cuda"):
        backend.step(pack(random_packs(model.vocab_size, 2, 16, seed=0)[0]), cache)


@pytest.mark.gpu
@needs_cuda
def test_cuda_caches_live_on_the_device_and_are_written_in_place(tiny_graph) -> None:
    model, path = tiny_graph
    gpu = OrtBackend(path, providers=[(CUDA_EP, {"device_id": "0"}), "CPUExecutionProvider"])
    cpu = OrtBackend(path, providers=["CPUExecutionProvider"])
    assert gpu.device == ("cuda", 0)
    gpu_cache, cpu_cache = gpu.allocate_cache(3, 32), cpu.allocate_cache(3, 32)
    assert all(t.is_cuda for t in (*gpu_cache.k, *gpu_cache.v))
    pointers = [t.data_ptr() for t in (*gpu_cache.k, *gpu_cache.v)]
    written, committed = [0] * 3, [0] * 3  # per slot: the end of what sequences wrote, and of what they kept
    for work in random_packs(model.vocab_size, 3, 32, seed=4):
        for w in work:
            if w.token_ids:
                written[w.slot_id] = max(written[w.slot_id], w.past_len + len(w.token_ids))
                committed[w.slot_id] = w.past_len + (len(w.token_ids) if w.logits == "last" else 1)  # as packs do
        batch = pack(work)
        logits = gpu.step(batch, gpu_cache)
        assert isinstance(logits, np.ndarray)  # only the logits rows come back, to the host
        want = cpu.step(batch, cpu_cache)
        assert logits.dtype == want.dtype and logits.shape == want.shape
        np.testing.assert_allclose(logits, want, atol=1e-3, rtol=1e-3)
    assert gpu.inplace_ok and [t.data_ptr() for t in (*gpu_cache.k, *gpu_cache.v)] == pointers
    # the kept rows agree; past them the CPU's fused graph writes a one-row sequence's discarded second query row
    # (ort_fuse: one position past the sequence, the spare one at the end), which the CUDA graph (its attention
    # unfused there, no spare position) does not, and nothing on the GPU lies past what the sequences wrote
    gpu_k0, cpu_k0 = gpu_cache.k[0].cpu().numpy(), cpu_cache.k[0]
    assert gpu_k0.dtype == cpu_k0.dtype and gpu_k0.shape == (3, cpu_k0.shape[1], 32, cpu_k0.shape[3])
    for slot in range(3):
        kept = slice(0, committed[slot])
        np.testing.assert_allclose(gpu_k0[slot, :, kept], cpu_k0[slot, :, kept], atol=1e-3, rtol=1e-3)
        assert not gpu_k0[slot, :, written[slot] :].any()


@pytest.mark.gpu
@needs_cuda
def test_greedy_ems_on_cuda_equals_ar_on_cuda(tiny_graph) -> None:
    _, path = tiny_graph

    engine = Engine(OrtBackend(path), NgramDrafter(), config=EngineConfig(max_batch=4, max_len=64))
    prompts = [[1, 2, 3, 1, 2, 3, 1, 2], [5, 6, 7], [9, 9, 9, 9]]
    requests = [engine.request(p, max_tokens=24, request_id=f"r{i}") for i, p in enumerate(prompts)]
    ar = engine.generate(requests, "ar").outputs
    ems = engine.generate(requests, "ems").outputs
    assert [o.token_ids for o in ems] == [o.token_ids for o in ar]


@pytest.mark.gpu
@needs_cuda
def test_an_engine_instance_opens_its_graph_on_the_gpu_triton_gave_it(tiny_graph) -> None:
    """What ``specdec_engine`` does with ``model_instance_device_id`` (``KIND_GPU`` instance groups): the session
    and its caches on that GPU, the last one of the machine, so a multi-GPU node proves it is not always 0."""
    from specdec.runtime.engine import _backend_opener

    _, path = tiny_graph
    last = torch.cuda.device_count() - 1
    backend = _backend_opener("onnx", 1, device_id=last)(path, False)
    assert backend.device == ("cuda", last)
    assert backend.allocate_cache(1, 8).k[0].device == torch.device("cuda", last)

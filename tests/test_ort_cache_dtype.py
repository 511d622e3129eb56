"""fp16 KV caches under an fp32 graph (``ort_cache_dtype``): half the memory, the same answers within a rounding.

The bitwise batch invariance of the fp16-cache graphs is in ``test_batch_invariance``; here the
rewrite's other promises: logits within fp16's rounding of the fp32-cache graph's and of the torch
reference, the caches really fp16 and written in place, the unfused fallback on the same caches,
and the refusals (of the backend and of ``specdec-export --kv-cache``).
"""

from __future__ import annotations

import logging
import random
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper
from test_onnx_backend import TINY_VARIANTS

from specdec.export.cli import main as export_main
from specdec.export.onnx import export_onnx
from specdec.models.loading import tiny_random
from specdec.models.manifest import read_manifest
from specdec.runtime.backends import ort_cache_dtype
from specdec.runtime.backends.host_cache import HostKVStorage
from specdec.runtime.backends.onnxruntime import OnnxModelError, OrtBackend
from specdec.runtime.backends.torch_backend import TorchBackend
from specdec.runtime.engine import Engine
from specdec.runtime.packed import ROOT, SeqWork, pack

#: fp16 keeps 11 significant bits: K/V rounded by ~5e-4 relative move this tiny model's logits by ~1e-4
TOLERANCE = 2e-3


@pytest.fixture(scope="module")
def fp32_graph(tmp_path_factory: pytest.TempPathFactory) -> tuple:
    """test_onnx_backend's GQA model (vocabulary 128), whose graph is exported once per session (export_cache)."""
    model = tiny_random(**TINY_VARIANTS["gqa"])
    return model, export_onnx(model, tmp_path_factory.mktemp("fp32") / "model.onnx")


def _steps(rng: random.Random) -> list[list[SeqWork]]:
    """Prefills, decode rows and a forest over three slots, ragged."""
    prompts = [[rng.randrange(128) for _ in range(n)] for n in (9, 30, 4)]
    steps = [[SeqWork(s, 0, p) for s, p in enumerate(prompts)]]
    past = [len(p) for p in prompts]
    for _ in range(6):
        work = []
        for s in range(3):
            n = rng.choice((1, 2, 5))
            work.append(SeqWork(s, past[s], [rng.randrange(128) for _ in range(n)]))
            past[s] += n
        steps.append(work)
    steps.append([SeqWork(0, past[0], [1, 2, 3, 4], parents=[ROOT, 0, 0, ROOT])])
    return steps


def test_fp16_caches_give_the_fp32_caches_logits_within_a_rounding(fp32_graph: tuple) -> None:
    model, path = fp32_graph
    wide, narrow, ref = OrtBackend(path), OrtBackend(path, cache_dtype="float16"), TorchBackend(model)
    caches = [b.allocate_cache(3, 64) for b in (wide, narrow, ref)]
    assert caches[1].k[0].dtype == np.float16 and caches[1].k[0].nbytes * 2 == caches[0].k[0].nbytes
    worst = 0.0
    for work in _steps(random.Random(0)):
        batch = pack(work)
        w, n, r = (b.step(batch, c) for b, c in zip((wide, narrow, ref), caches))
        assert n.dtype == np.float32  # the graph computes in fp32: only the caches are narrow
        worst = max(worst, float(np.abs(n - w).max()), float(np.abs(n - r).max()))
    assert 0 < worst < TOLERANCE  # the comparison sees fp16's rounding, and only that
    assert narrow.inplace_ok and narrow.unfused_steps == 0
    written = caches[1].k[0][1, :, :30].astype(np.float32)
    assert np.abs(written).max() > 0 and np.allclose(written, caches[0].k[0][1, :, :30], atol=1e-2, rtol=1e-3)


def test_the_unfused_fallback_runs_on_the_same_fp16_caches(fp32_graph: tuple) -> None:
    """A step GQA's padding cannot hold (a cache without the spare position, filled to its end) runs the unfused
    graph, whose attention reads the fp16 caches cast up and writes them cast down."""
    model, path = fp32_graph
    backend, ref = OrtBackend(path, cache_dtype="float16"), TorchBackend(model)
    bare = HostKVStorage(backend.num_layers, 1, int(backend.num_kv_heads), 16, int(backend.head_dim), np.float16)
    ref_cache = ref.allocate_cache(1, 16)
    for work in ([SeqWork(0, 0, list(range(1, 16)))], [SeqWork(0, 15, [7])]):  # the last row's copy has no room
        batch = pack(work)
        got, want = backend.step(batch, bare), ref.step(batch, ref_cache)
        assert float(np.abs(got - want).max()) < TOLERANCE
    assert backend.unfused_steps == 1 and backend.inplace_ok
    assert bare.k[0].dtype == np.float16
    assert np.allclose(bare.k[0][0].astype(np.float32), ref_cache.k[0][0].numpy(), atol=1e-2, rtol=1e-3)


def test_narrow_caches_need_the_fused_attention(fp32_graph: tuple, caplog: pytest.LogCaptureFixture) -> None:
    """Without GQA every step would cast the whole caches both ways: the backend keeps the graph's type, and says so."""
    _, path = fp32_graph
    with caplog.at_level(logging.WARNING):
        backend = OrtBackend(path, fuse=False, cache_dtype="float16")
    assert backend.np_dtype == np.float32 and "keep the graph's type" in caplog.text


def test_the_rewrite_refuses_what_it_cannot_store(fp32_graph: tuple, tmp_path: Path) -> None:
    _, path = fp32_graph
    with pytest.raises(ValueError, match="cache_dtype 'int8'"):
        OrtBackend(path, cache_dtype="int8")
    proto = onnx.load(str(path), load_external_data=False)
    assert ort_cache_dtype.retype_caches(proto, "float32") is False  # already fp32: untouched
    half = tiny_random(seed=4, num_layers=2)  # test_onnx_backend's fp16 export, made once per session
    import torch

    fp16 = onnx.load(str(export_onnx(half, tmp_path / "fp16.onnx", torch.float16)), load_external_data=False)
    assert ort_cache_dtype.retype_caches(fp16, "float16") is False
    with pytest.raises(ValueError, match="need a float32 graph"):
        ort_cache_dtype.retype_caches(fp16, "float32")
    reader = onnx.load(str(path), load_external_data=False)
    cache = reader.graph.input[[i.name for i in reader.graph.input].index("past_key_values.0.key")]
    reader.graph.node.append(helper.make_node("Identity", [cache.name], ["peek"], name="peek"))
    with pytest.raises(ValueError, match="Identity node peek reads a cache"):
        ort_cache_dtype.retype_caches(reader, "float16")


def test_a_corrupt_retyped_graph_is_a_load_error(fp32_graph: tuple, monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever the rewrite raises surfaces as the backend's own load error, naming the graph."""
    _, path = fp32_graph

    def broken(proto: onnx.ModelProto, dtype: str) -> bool:
        raise ValueError("no such layout")

    monkeypatch.setattr(ort_cache_dtype, "retype_caches", broken)
    with pytest.raises(OnnxModelError, match="no such layout"):
        OrtBackend(path, cache_dtype="float16")


# -- specdec-export --kv-cache -----------------------------------------------------------------------------


def test_export_stores_the_cache_type_and_the_engine_allocates_it(tmp_path: Path) -> None:
    plain, narrow = tmp_path / "plain", tmp_path / "narrow"
    # test_onnx_backend's draft model: its graph is exported once per session (export_cache)
    base = ["--target", "tiny-random:seed=10,num_layers=1", "--max-batch", "2", "--max-len", "64"]
    assert export_main([*base, "--out", str(plain)]) == 0
    assert export_main([*base, "--out", str(narrow), "--kv-cache", "float16"]) == 0
    assert read_manifest(plain)["kv_cache_dtype"] == "float32"
    assert read_manifest(narrow)["kv_cache_dtype"] == "float16"
    engines = [Engine.from_export(d) for d in (plain, narrow)]
    assert [e.target.np_dtype for e in engines] == [np.float32, np.float16]
    prompts = [[5, 9, 2, 7], [3] * 11]
    outs = [
        [o.token_ids for o in e.generate([e.request(p, max_tokens=8) for p in prompts], "ar").outputs] for e in engines
    ]
    assert all(len(o) == 8 for o in outs[1])
    narrowed = engines[1].generate([engines[1].request(p, max_tokens=8) for p in prompts], "ems").outputs
    assert [o.token_ids for o in narrowed] == outs[1]  # greedy ems = ar on the fp16-cache graph


@pytest.mark.parametrize(
    "args, message",
    [
        (["--kv-cache", "float16", "--backend", "torch"], "needs --backend onnx"),
        (["--kv-cache", "float32", "--dtype", "float16"], "needs --dtype float32"),
    ],
)
def test_export_refuses_cache_types_it_cannot_serve(
    tmp_path: Path, capsys: pytest.CaptureFixture, args: list[str], message: str
) -> None:
    out = tmp_path / "deploy"
    assert export_main(["--target", "tiny-random:num_layers=1", "--out", str(out), *args]) == 2
    assert message in capsys.readouterr().err and not out.exists()

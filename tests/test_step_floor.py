"""The step profile's helpers (fast tier, tiny graphs): a step's floor read from the graph, a lowering saved by one
specdec and run again as it is, and the variants the profile takes."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from benchmarks import prelowered, step_floor, step_profile
from specdec.export.onnx import export_onnx
from specdec.models.loading import tiny_random
from specdec.runtime.backends import ort_fuse
from specdec.runtime.backends.onnxruntime import OrtBackend
from specdec.runtime.packed import SeqWork, pack

pytestmark = pytest.mark.skipif(not ort_fuse.gqa_supported(), reason="GroupQueryAttention without query_seqlens")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory):
    model = tiny_random(seed=5, num_layers=2)
    return model, export_onnx(model, tmp_path_factory.mktemp("floor") / "model.onnx")


def test_the_floor_counts_every_weight_once_and_each_rows_multiply_adds(tiny) -> None:
    model, path = tiny
    cost = step_floor.graph_cost(path)
    cfg = model.config
    hidden, inter, vocab = int(cfg.hidden_size), int(cfg.intermediate_size), int(cfg.vocab_size)
    heads, kv_heads = int(cfg.num_attention_heads), int(cfg.num_key_value_heads)
    head_dim = hidden // heads
    per_layer = hidden * (heads + 2 * kv_heads) * head_dim + heads * head_dim * hidden + 3 * hidden * inter
    assert cost.layers == 2 and cost.heads == heads and cost.kv_heads == kv_heads and cost.head_dim == head_dim
    assert [lin.head for lin in cost.linears].count(True) == 1
    assert sum(lin.macs_per_row for lin in cost.linears if not lin.head) == 2 * per_layer
    decode = pack([SeqWork(0, 10, [1]), SeqWork(1, 4, [2, 3, 4], logits="last")])
    got = cost.step(decode, cache_bytes=2)
    assert got["weight_bytes"] == sum(lin.weight_bytes for lin in cost.linears)  # read once, whatever the rows
    assert got["kv_bytes"] == (11 + 7) * 2 * kv_heads * head_dim * 2 * 2  # (past + n) rows, K and V, 2 layers, fp16
    assert got["int8_ops"] == 0  # an fp32 graph: every product in fp32
    linear_ops = 2 * (4 * 2 * per_layer + 2 * hidden * vocab)  # 4 rows through the layers, 2 logit rows the head
    attention = 2 * 2 * (10 + 1 + 3 * 4 + 6) * heads * head_dim * 2  # each row's visible keys, QK and PV, 2 layers
    assert got["fp32_ops"] == linear_ops + attention
    rates = {"bytes_per_s": 1e9, "int8_ops_per_s": 1e12, "fp32_flops_per_s": 1e9}
    floor = step_floor.floor_ms(got, rates)
    assert floor["memory_ms"] == pytest.approx(got["bytes"] / 1e6)
    assert floor["compute_ms"] == pytest.approx(got["fp32_ops"] / 1e6)
    assert floor["floor_ms"] == max(floor["memory_ms"], floor["compute_ms"])


def test_a_saved_lowering_runs_as_the_backend_served_it(tiny, tmp_path: Path) -> None:
    _, path = tiny
    report = prelowered.lower(path, tmp_path / "lowered", "float16")
    assert report["counts"]["attention"] == 2 and report["source"] == str(path)
    saved = prelowered.pre_lowered(tmp_path / "lowered")
    served = OrtBackend(path, cache_dtype="float16")
    assert saved.fuse_report == served.fuse_report and saved.np_dtype == served.np_dtype == np.float16
    caches = saved.allocate_cache(3, 32), served.allocate_cache(3, 32)
    assert caches[0].buffer_len == caches[1].buffer_len  # the spare positions of the fused attention
    for work in ([SeqWork(0, 0, [5, 6, 7]), SeqWork(2, 0, [8])], [SeqWork(0, 3, [9]), SeqWork(2, 1, [1, 2])]):
        assert np.array_equal(saved.step(pack(work), caches[0]), served.step(pack(work), caches[1]))
    assert saved.inplace_ok


def test_a_variant_names_its_rewrites_its_caches_or_a_saved_lowering(tiny, tmp_path: Path) -> None:
    _, path = tiny
    assert step_profile.variant(path, "float16") == step_profile.Variant(path, True, "float16")
    assert step_profile.variant(Path(f"{path}@none"), "float32").fuse == []
    assert step_profile.variant(Path(f"{path}@attention,rotary"), "float32").fuse == ["attention", "rotary"]
    assert step_profile.variant(path, "manifest").cache_dtype is None  # no export manifest beside it
    export = tmp_path / "export"
    (export / "target").mkdir(parents=True)
    (export / "manifest.json").write_text(json.dumps({"kv_cache_dtype": "float16"}))
    assert step_profile.served_cache_dtype(export / "target" / "model.onnx") == "float16"
    prelowered.lower(path, tmp_path / "saved", None)
    saved = step_profile.variant(Path(f"lowered:{tmp_path / 'saved'}"), "manifest")
    assert saved.lowered == tmp_path / "saved" and saved.graph == path  # the floor reads the source graph


def test_shapes_cover_every_batch_and_kind() -> None:
    steps = step_profile.shapes([1, 4], ["decode", "verify", "prefill"])
    assert list(steps) == [
        "B=1 decode",
        "B=1 verify 1x5",
        "B=1 prefill 160-160",
        "B=4 decode",
        "B=4 verify 4x5",
        "B=4 prefill 160-280",
    ]
    batch, kind = steps["B=4 verify 4x5"]
    assert kind == "verify" and batch.num_seqs == 4 and batch.num_tokens == 20
    assert batch.past_lens.tolist() == [step_profile.past(s) for s in range(4)]
    assert step_profile.slots_for([1, 16]) == 16 and step_profile.slots_for([32]) == 32

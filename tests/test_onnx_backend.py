"""ONNX export + ONNX Runtime backend: agreement with the torch reference, in-place caches,
exact decoding, the export directory contract and corruption detection."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
import torch

from specdec.export.cli import main as export_main
from specdec.export.onnx import count_attention_nodes, export_onnx, graph_io_names
from specdec.export.validate import max_logit_error, random_packs
from specdec.models.loading import load_model, tiny_random
from specdec.models.manifest import ExportDirError, read_manifest
from specdec.plugins import onnx_op
from specdec.runtime.backends.onnxruntime import OnnxModelError, OrtBackend
from specdec.runtime.backends.torch_backend import TorchBackend
from specdec.runtime.config import DrafterKind, EngineConfig
from specdec.runtime.engine import Engine
from specdec.runtime.graph_io import CacheMaskUnsupportedError, expected_io_names
from specdec.runtime.packed import SeqWork, pack
from specdec.runtime.request import Request

TINY_VARIANTS = {
    "gqa": dict(seed=1, num_layers=2),
    "mha-tied": dict(seed=2, num_layers=1, num_heads=4, num_kv_heads=4, tie_word_embeddings=True),
    "mqa-llama3": dict(
        seed=3,
        num_layers=2,
        num_heads=4,
        num_kv_heads=1,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
    ),
}


@pytest.fixture(scope="module", params=sorted(TINY_VARIANTS))
def tiny_export(request, tmp_path_factory):
    model = tiny_random(**TINY_VARIANTS[request.param])
    path = export_onnx(model, tmp_path_factory.mktemp("onnx") / "model.onnx")
    return model, path


def test_graph_keeps_custom_nodes_passes_checker_and_names_match_the_table(tiny_export) -> None:
    model, path = tiny_export
    layers = int(model.config.num_hidden_layers)
    assert count_attention_nodes(path) == layers
    onnx.checker.check_model(str(path), full_check=True)
    assert graph_io_names(path) == expected_io_names(layers)
    proto = onnx.load(str(path), load_external_data=False)
    node = next(n for n in proto.graph.node if n.op_type == onnx_op.OP_TYPE)
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    assert attrs["plugin_namespace"] == b"specdec" and attrs["plugin_version"] == b"1"
    assert attrs["num_heads"] == model.config.num_attention_heads
    assert [f.name for f in proto.functions] == [onnx_op.OP_TYPE]  # the body ships in the file


def test_ort_matches_torch_on_mixed_ragged_batches(tiny_export) -> None:
    model, path = tiny_export
    for seed in range(3):
        assert max_logit_error(TorchBackend(model), OrtBackend(path), num_slots=5, max_len=48, seed=seed) < 1e-4


def test_caches_are_updated_in_place_without_a_copy(tiny_export) -> None:
    model, path = tiny_export
    backend = OrtBackend(path)
    cache = backend.allocate_cache(3, 32)
    pointers = [t.ctypes.data for t in (*cache.k, *cache.v)]
    for work in random_packs(model.vocab_size, 3, 32, seed=4):
        backend.step(pack(work), cache)
    assert backend.inplace_ok  # ORT's outputs are the bound cache buffers, checked by pointer every step
    assert [t.ctypes.data for t in (*cache.k, *cache.v)] == pointers
    assert any(float(np.abs(t).sum()) > 0 for t in cache.k)  # the graph wrote through the bound buffers


def test_ems_on_ort_equals_ar_on_torch_tiny(tmp_path) -> None:
    model = tiny_random(seed=9, num_layers=2)
    draft = tiny_random(seed=10, num_layers=1)
    out = tmp_path / "deploy"
    assert (
        export_main(
            [
                "--target",
                "tiny-random:seed=9,num_layers=2",
                "--draft",
                "tiny-random:seed=10,num_layers=1",
                "--out",
                str(out),
                "--max-batch",
                "4",
                "--max-len",
                "128",
            ]
        )
        == 0
    )
    ort_engine = Engine.from_export(out)
    assert ort_engine.max_batch == 4 and ort_engine.max_len == 128
    assert ort_engine.target.fuse_report.attention  # the ORT lowering (ort_fuse) is what runs
    torch_engine = Engine.from_models(model, draft, config=EngineConfig(max_batch=4, max_len=128))
    g = torch.Generator().manual_seed(1)
    requests = [
        Request(torch.randint(0, 128, (n,), generator=g).tolist(), max_tokens=m)
        for n, m in ((1, 12), (100, 20), (7, 3), (90, 16))
    ]
    want = torch_engine.generate(requests, "ar").outputs
    got = ort_engine.generate(requests, "ems")
    assert [o.token_ids for o in got.outputs] == [o.token_ids for o in want]
    assert got.run.summary()["draft_tokens"] > 0 and ort_engine.target.inplace_ok
    # two slots: in-flight admission puts the 90-token prefill beside a sequence past 100 of 128, a step GQA's
    # right padding cannot hold (past + 90 > 128 + the spare positions), so the backend splits it; exact answers
    narrow = Engine.from_export(out, config=EngineConfig(max_batch=2))
    assert [o.token_ids for o in narrow.generate(requests, "ems").outputs] == [o.token_ids for o in want]
    assert [o.token_ids for o in narrow.generate(requests, "ar").outputs] == [o.token_ids for o in want]
    assert narrow.target.split_steps > 0
    # the padded baseline needs masked KV holes, which the exported graph cannot express: refused up front
    with pytest.raises(ValueError, match=r"'vanilla' pads the KV cache.*cache_mask"):
        ort_engine.generate(requests, "vanilla")
    assert torch_engine.generate(requests, "vanilla").outputs[1].token_ids == want[1].token_ids


def test_a_step_with_kv_holes_is_refused_and_a_mask_without_holes_runs(tiny_export) -> None:
    """The graph has no cache_mask input: a masked position must never be silently attended to."""
    model, path = tiny_export
    backend = OrtBackend(path)
    cache = backend.allocate_cache(2, 32)
    backend.step(pack([SeqWork(0, 0, [1, 2, 3]), SeqWork(1, 0, [4, 5, 6])]), cache)  # 3 cached positions each
    work = [SeqWork(0, 3, [7]), SeqWork(1, 3, [8, 9])]
    holes = np.ones((2, 32), dtype=bool)
    holes[1, 1] = False  # slot 1's second cached position is a hole
    with pytest.raises(CacheMaskUnsupportedError, match="no cache_mask input"):
        backend.step(pack(work, holes), cache)
    assert backend.step(pack(work, np.ones((2, 32), dtype=bool)), cache).shape == (3, model.vocab_size)


def test_corrupt_graph_or_manifest_is_detected_at_load(tmp_path) -> None:
    out = tmp_path / "deploy"
    # the draft of test_ems_on_ort_equals_ar_on_torch_tiny: its graph is exported once per session (export_cache)
    assert export_main(["--target", "tiny-random:seed=10,num_layers=1", "--out", str(out)]) == 0
    manifest = read_manifest(out)
    assert manifest["backend"] == "onnx" and manifest["target"]["validation_max_abs_logit_error"] < 1e-4
    graph = out / "target" / "model.onnx"
    original = graph.read_bytes()
    graph.write_bytes(original[:100] + b"\x00" * 16 + original[116:])
    with pytest.raises(ExportDirError, match="does not match its checksum"):
        Engine.from_export(out)
    graph.write_bytes(original)
    Engine.from_export(out)
    (out / "manifest.json").write_text("{ broken")
    with pytest.raises(ExportDirError, match="corrupt"):
        Engine.from_export(out)
    (out / "manifest.json").unlink()
    with pytest.raises(ExportDirError, match="not a specdec export directory"):
        Engine.from_export(out)


def test_ort_backend_refuses_files_that_are_not_ragged_step_graphs(tmp_path) -> None:
    with pytest.raises(OnnxModelError, match="does not exist"):
        OrtBackend(tmp_path / "missing.onnx")
    junk = tmp_path / "junk.onnx"
    junk.write_bytes(b"this is not protobuf")
    with pytest.raises(OnnxModelError, match="cannot load"):
        OrtBackend(junk)
    other = onnx_op.attention_model(scale=0.5, num_heads=2, num_kv_heads=1)
    onnx.save(other, str(tmp_path / "other.onnx"))
    with pytest.raises(OnnxModelError, match="not a specdec ragged-step graph"):
        OrtBackend(tmp_path / "other.onnx")


def test_export_refuses_existing_dir_and_unknown_models_fast(tmp_path, capsys, monkeypatch) -> None:
    """A Hub that cannot be reached (as in CI) is a clear refusal naming the repository, whatever the network here:
    the download fails at once, as an unreachable endpoint's would."""
    import huggingface_hub

    def unreachable(*args: object, **kwargs: object) -> None:
        raise OSError("connection refused")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", unreachable)
    out = tmp_path / "d"
    out.mkdir()
    assert export_main(["--target", "tiny-random:num_layers=1", "--out", str(out)]) == 2
    assert "--force" in capsys.readouterr().err
    assert export_main(["--target", "llama-7b", "--out", str(tmp_path / "x")]) == 2
    assert "meta-llama/Llama-2-7b-hf" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_fp16_export_runs_close_to_fp32(tmp_path) -> None:
    model = tiny_random(seed=4, num_layers=2)
    path = export_onnx(model, tmp_path / "fp16.onnx", dtype=torch.float16)
    backend = OrtBackend(path)
    assert backend.np_dtype == np.float16 and all(t.dtype == np.float16 for t in backend.allocate_cache(1, 8).k)
    error = max_logit_error(TorchBackend(model), backend, num_slots=3, max_len=32)
    assert np.isfinite(error) and error < 0.05


@pytest.mark.real_model
def test_smollm2_export_offline_matches_torch(smollm2_export) -> None:
    manifest = json.loads((smollm2_export / "manifest.json").read_text())
    assert manifest["target"]["num_layers"] == 30 and manifest["drafter"] == "model"
    assert manifest["draft"]["head_size"] < manifest["target"]["head_size"]  # the distilled draft's restricted head
    assert manifest["target"]["validation_max_abs_logit_error"] < 1e-3
    graph = smollm2_export / "target" / "model.onnx"
    assert count_attention_nodes(graph) == 30
    onnx.checker.check_model(str(graph), full_check=False)
    error = max_logit_error(
        TorchBackend(load_model("smollm2-135m")), OrtBackend(graph), num_slots=4, max_len=160, seed=7
    )
    assert error < 1e-3


@pytest.mark.real_model
def test_smollm2_ems_on_ort_equals_ar_on_torch(smollm2_export) -> None:
    ort_engine = Engine.from_export(smollm2_export, config=EngineConfig(num_draft_tokens=5))
    torch_engine = Engine.from_models(
        load_model("smollm2-135m"), config=EngineConfig(max_batch=8, max_len=1024, drafter=DrafterKind.NONE)
    )
    texts = [
        "Hi",
        "Repeat exactly: red, green, blue, red, green, blue.",
        "Summarise: " + "The ragged step packs every sequence's new tokens without padding. " * 8,
        "What is 3 + 4?",
    ]
    requests = [
        torch_engine.request(t, chat=i > 0, max_tokens=m) for i, (t, m) in enumerate(zip(texts, (10, 24, 30, 12)))
    ]
    want = torch_engine.generate(requests, "ar").outputs
    got = ort_engine.generate(requests, "ems")
    assert [o.token_ids for o in got.outputs] == [o.token_ids for o in want]
    assert got.run.summary()["accepted_draft_tokens"] > 0


def test_a_served_draft_session_does_not_spin_and_the_target_does(tiny_dir, tmp_path) -> None:
    """The draft's idle workers would hold the cores of the target's next step; the target's own back-to-back
    steps keep ORT's spinning (see ``OrtBackend``)."""
    from specdec.runtime.engine import Engine

    out = tmp_path / "deploy"
    assert (
        export_main(
            [
                "--target",
                str(tiny_dir),
                "--draft",
                str(tiny_dir),
                "--out",
                str(out),
                "--max-batch",
                "2",
                "--max-len",
                "64",
            ]
        )
        == 0
    )
    engine = Engine.from_export(out)

    def spinning(backend: OrtBackend) -> bool:
        options = backend.session.get_session_options()
        try:
            return options.get_session_config_entry("session.intra_op.allow_spinning") != "0"
        except Exception:  # not set: ORT's default, which spins
            return True

    assert spinning(engine.target) and not spinning(engine.drafter.backend)

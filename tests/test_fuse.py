"""ORT-only lowering (``ort_fuse``): GroupQueryAttention, fused RMSNorm / skip-RMSNorm and RotaryEmbedding
agree with the torch reference on random ragged forests, write the caches in place, decode exactly, and a
deliberately wrong bias or seqlens is caught by the same agreement check."""

from __future__ import annotations

import collections

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto
from test_onnx_backend import TINY_VARIANTS

from specdec.export.onnx import count_attention_nodes, export_onnx
from specdec.export.validate import max_logit_error, random_packs
from specdec.models.loading import load_model, tiny_random
from specdec.plugins import onnx_op
from specdec.runtime.backends import ort_fold, ort_fuse
from specdec.runtime.backends.onnxruntime import FUSE_ENV, OrtBackend
from specdec.runtime.backends.ort_fold import FOLD_ROWS
from specdec.runtime.backends.torch_backend import TorchBackend
from specdec.runtime.packed import ROOT, SeqWork, pack

pytestmark = pytest.mark.skipif(not ort_fuse.gqa_supported(), reason="GroupQueryAttention without query_seqlens")


@pytest.fixture(scope="module", params=sorted(TINY_VARIANTS))
def tiny_export(request, tmp_path_factory):
    model = tiny_random(**TINY_VARIANTS[request.param])
    path = export_onnx(model, tmp_path_factory.mktemp("fuse") / "model.onnx")
    return model, path


@pytest.fixture(scope="module")
def gqa_graph(tmp_path_factory):
    """The GQA tiny variant's export, for the tests that need one graph only."""
    model = tiny_random(**TINY_VARIANTS["gqa"])
    return model, export_onnx(model, tmp_path_factory.mktemp("fuse-gqa") / "model.onnx")


def _ops(proto: onnx.ModelProto) -> collections.Counter:
    """(domain, op) counts of the graph's nodes, the nodes of its If branches included."""

    def nodes(graph: onnx.GraphProto):
        for n in graph.node:
            yield n
            for a in n.attribute:
                if a.type == onnx.AttributeProto.GRAPH:
                    yield from nodes(a.g)

    return collections.Counter((n.domain, n.op_type) for n in nodes(proto.graph))


def test_every_pattern_is_lowered_and_the_file_keeps_its_custom_nodes(tiny_export) -> None:
    model, path = tiny_export
    layers = int(model.config.num_hidden_layers)
    before = path.read_bytes()
    proto = onnx.load(str(path), load_external_data=False)
    report = ort_fuse.fuse_model(proto)
    ops = _ops(proto)
    assert report.counts == {
        "attention": layers,
        "rmsnorm": 2 * layers + 1,
        "skip_rmsnorm": 2 * layers - 1,
        "rotary": 2 * layers,
    }, report
    folded = report.fold > 1  # grouped-query heads: two GQA calls per layer, the folded layout's and the padded one's
    assert report.fold == int(model.config.num_attention_heads) // int(model.config.num_key_value_heads)
    assert ops[("", "If")] == 0  # both layouts run, the one a step does not use over idle slots (ort_fold)
    assert ops[("com.microsoft", "GroupQueryAttention")] == (2 * layers if folded else layers)
    handed_over = [o.name for o in proto.graph.output if o.name.endswith(".folded")]
    assert len(handed_over) == (2 * layers if folded else 0)  # bound to the cache buffers, as present.* are
    assert ops[("com.microsoft", "RotaryEmbedding")] == layers  # q and k of a layer in one (ort_packed)
    made_by = {out: n.op_type for n in proto.graph.node for out in n.output}
    cuts = [n for n in proto.graph.node if n.op_type == "Slice" and made_by.get(n.input[0]) in ("Gemm", "MatMul")]
    assert not cuts  # q, k and v reach attention packed, as the fused q|k|v projection made them (ort_packed)
    assert ops[("com.microsoft", "SkipSimplifiedLayerNormalization")] == 2 * layers - 1
    assert ops[("", "SimplifiedLayerNormalization")] == 2  # the first layer's input norm and the final norm
    for gone in ("Pow", "Reciprocal", "Neg", "ScatterND", "Softmax"):
        assert ops[("", gone)] == 0, gone
    assert not any(n.domain == onnx_op.DOMAIN for n in proto.graph.node) and not proto.functions
    assert path.read_bytes() == before and count_attention_nodes(path) == layers  # TensorRT's file is untouched


def test_fused_graph_matches_torch_on_random_ragged_forests(tiny_export) -> None:
    model, path = tiny_export
    backend = OrtBackend(path)
    assert backend.fuse_report is not None and backend.fuse_report.attention
    for seed in range(3):
        assert max_logit_error(TorchBackend(model), backend, num_slots=5, max_len=48, seed=seed) < 1e-4
    assert backend.inplace_ok


def test_fused_caches_are_written_in_place_and_equal_the_reference(tiny_export) -> None:
    model, path = tiny_export
    backend, ref = OrtBackend(path), TorchBackend(model)
    cache, ref_cache = backend.allocate_cache(3, 32), ref.allocate_cache(3, 32)
    assert cache.buffer_len == 32 + ort_fuse.SPARE_POSITIONS and ref_cache.buffer_len == 32
    pointers = [t.ctypes.data for t in (*cache.k, *cache.v)]
    written, committed = [0] * 3, [0] * 3  # per slot: the end of what sequences wrote, and of what they kept
    fold = backend.fuse_report.fold
    for work in random_packs(model.vocab_size, 3, 32, seed=4):
        backend.step(pack(work), cache)
        ref.step(pack(work), ref_cache)
        folded = fold > 1 and fold * max(len(w.token_ids) for w in work) <= FOLD_ROWS
        for w in work:
            if w.token_ids:
                n = len(w.token_ids)  # GQA writes fold * n rows folded, n + n % 2 padded (ort_fold, ort_fuse)
                written[w.slot_id] = max(written[w.slot_id], w.past_len + (fold * n if folded else n + n % 2))
                committed[w.slot_id] = w.past_len + (len(w.token_ids) if w.logits == "last" else 1)  # as packs do
    assert backend.inplace_ok  # GQA's present outputs are the bound cache buffers, checked by pointer every step
    assert [t.ctypes.data for t in (*cache.k, *cache.v)] == pointers
    for got, want in zip((*cache.k, *cache.v), (*ref_cache.k, *ref_cache.v)):
        want = want.numpy()  # the reference's caches are torch tensors
        for slot in range(3):
            # the kept rows where the reference put them (past them, rows a later step overwrites: an odd
            # sequence's discarded copy row, or a folded step's copies of its last row), and nothing past those
            kept = slice(0, committed[slot])
            assert np.allclose(got[slot, :, kept], want[slot, :, kept], rtol=0, atol=1e-5)
            assert float(np.abs(got[slot, :, written[slot] :]).sum()) == 0
    assert any(float(np.abs(t).sum()) > 0 for t in cache.k)


def test_steps_gqa_cannot_pad_are_split_or_run_unfused_and_stay_exact(gqa_graph) -> None:
    """GQA pads each slot's chunk to the longest one and needs past + S <= buffer per slot; the reference does not.
    With the spare position every step fits in one or more groups; a cache without it (not this backend's
    allocate_cache) falls back to the unfused graph where no group fits."""
    from specdec.runtime.backends.host_cache import HostKVStorage

    model, path = gqa_graph
    ref = TorchBackend(model)
    backend = OrtBackend(path)
    fold = backend.fuse_report.fold
    cache, ref_cache = backend.allocate_cache(3, 48), ref.allocate_cache(3, 48)
    assert cache.buffer_len == 48 + 23
    tree = [ROOT, *range(29)]
    tree[4] = 0
    steps = [
        [SeqWork(0, 0, list(range(1, 46)))],
        [SeqWork(0, 45, [3]), SeqWork(1, 0, list(range(4, 34)), parents=tree)],  # 45 + 30 > 71: split
        [SeqWork(2, 0, list(range(48)))],  # fills the context while slots are idle: the spare positions hold S
        [SeqWork(0, 46, [1, 2]), SeqWork(1, 0, list(range(26))), SeqWork(2, 47, [7])],  # 46 + 26 > 71: two groups
    ]
    real = np.zeros((3, 48), dtype=bool)  # positions whose last write was a real row (not a discarded copy)
    for work in steps:
        batch = pack(work)
        assert float(np.abs(backend.step(batch, cache) - ref.step(batch, ref_cache)).max()) < 1e-4
        new = [len(w.token_ids) for w in work]
        for group in ort_fuse.gqa_groups([w.past_len for w in work], new, cache.buffer_len, 3, fold):
            folded = fold * max(new[i] for i in group) <= FOLD_ROWS
            for i in group:  # a folded step writes fold * n rows, a padded one n + n % 2 (copies past the real ones)
                w, n = work[i], new[i]
                real[w.slot_id, w.past_len : w.past_len + n] = True
                real[w.slot_id, w.past_len + n : w.past_len + (fold * n if folded else n + n % 2)] = False
    assert backend.split_steps == 2 and backend.unfused_steps == 0 and backend.inplace_ok
    bare = HostKVStorage(backend.num_layers, 1, int(backend.num_kv_heads), 16, int(backend.head_dim), backend.np_dtype)
    assert bare.buffer_len == 16
    bare_ref = ref.allocate_cache(1, 16)
    for work in ([SeqWork(0, 0, list(range(1, 16)))], [SeqWork(0, 15, [7])]):  # the last row's copy has no room
        batch = pack(work)
        assert float(np.abs(backend.step(batch, bare) - ref.step(batch, bare_ref)).max()) < 1e-4
    assert backend.unfused_steps == 1
    for got, want in zip((*cache.k, *cache.v), (*ref_cache.k, *ref_cache.v)):  # host arrays, the reference's torch
        for slot in range(3):
            kept = real[slot]
            assert float(np.abs(got[slot][:, :48][:, kept] - want.numpy()[slot][:, kept]).max()) < 1e-5


def test_a_step_over_its_slots_view_gives_the_same_bits_and_cache(gqa_graph) -> None:
    """Two prefills beside a decoding slot in one step, then each over the view of its own slot: same logits, same
    caches (``HostKVStorage.slots``: the lever ``benchmarks/slot_views.py`` measures)."""
    _, path = gqa_graph
    backend = OrtBackend(path)
    prompts = [list(range(1, 31)), list(range(5, 17))]
    caches = [backend.allocate_cache(3, 48) for _ in range(2)]
    for cache in caches:
        backend.step(pack([SeqWork(2, 0, [7, 8, 9])]), cache)
    together = backend.step(pack([SeqWork(s, 0, ids) for s, ids in enumerate(prompts)]), caches[0])
    apart = np.concatenate(
        [backend.step(pack([SeqWork(0, 0, ids)]), caches[1].slots(s, 1)) for s, ids in enumerate(prompts)]
    )
    assert np.array_equal(together, apart)
    for slot, n in ((0, 30), (1, 12), (2, 3)):
        for a, b in zip(caches[0].k + caches[0].v, caches[1].k + caches[1].v, strict=True):
            assert np.array_equal(a[slot, :, :n], b[slot, :, :n])
    with pytest.raises(ValueError, match="not within"):
        caches[0].slots(2, 2)


def test_long_chunks_run_over_their_own_slot_with_the_same_bits(gqa_graph, monkeypatch) -> None:
    """``own_slot_chunks`` sends chunks of at least OWN_SLOT_ROWS rows to steps of their own over their slot's view:
    the logits and every written cache row are the bits of the one-step run, and the counters show the split."""
    _, path = gqa_graph
    steps = [
        [SeqWork(0, 0, list(range(1, 21)))],  # one chunk: a one-slot step still splits (idle slots beside it)
        [SeqWork(0, 20, [3]), SeqWork(1, 0, list(range(4, 30))), SeqWork(2, 0, list(range(2, 8)))],
        [SeqWork(0, 21, [4, 5, 6]), SeqWork(1, 26, [7]), SeqWork(2, 6, list(range(9, 40)))],
    ]
    runs = {}
    for rows in (10**9, 8):
        monkeypatch.setattr(ort_fuse, "OWN_SLOT_ROWS", rows)
        backend = OrtBackend(path)
        cache = backend.allocate_cache(3, 64)
        runs[rows] = ([backend.step(pack(work), cache) for work in steps], cache, backend)
    (whole, whole_cache, plain), (apart, apart_cache, split) = runs[10**9], runs[8]
    assert plain.view_steps == 0 and split.view_steps == 3 and split.calls == plain.calls == 3
    for a, b in zip(whole, apart, strict=True):
        assert np.array_equal(a, b)
    for slot, n in ((0, 24), (1, 27), (2, 37)):
        for a, b in zip(whole_cache.k + whole_cache.v, apart_cache.k + apart_cache.v, strict=True):
            assert np.array_equal(a[slot, :, :n], b[slot, :, :n])
    assert ort_fuse.own_slot_chunks([200, 3], 1) == [] and ort_fuse.own_slot_chunks([200, 3, 128], 4) == [0, 2]


def test_gqa_groups() -> None:
    assert ort_fuse.gqa_groups([3, 0], [1, 5], max_len=16, num_slots=4) == [[0, 1]]
    assert ort_fuse.gqa_groups([13, 0], [1, 5], max_len=16, num_slots=4) == [[1], [0]]
    assert ort_fuse.gqa_groups([14, 1, 15], [2, 3, 1], max_len=17, num_slots=3) == [[1], [0, 2]]
    # an odd row count runs one more query row: a one-row sequence at the last position needs the spare one
    assert ort_fuse.gqa_groups([14, 1, 15], [2, 3, 1], max_len=16, num_slots=3) is None
    assert ort_fuse.gqa_groups([0], [16], max_len=16, num_slots=3) is None  # an idle slot cannot hold S = 16
    assert ort_fuse.gqa_groups([0], [16], max_len=17, num_slots=3) == [[0]]
    assert ort_fuse.gqa_groups([0], [16], max_len=16, num_slots=1) == [[0]]
    # folded (fold 3): a decode row runs 3 rows, a chain of 8 runs 24; past 8 rows per sequence the padded width
    assert ort_fuse.gqa_groups([13, 0], [1, 2], max_len=16, num_slots=4, fold=3) == [[1], [0]]  # 13 + 6 > 16
    assert ort_fuse.gqa_groups([13, 0], [1, 1], max_len=16, num_slots=4, fold=3) == [[0, 1]]
    assert ort_fuse.gqa_groups([40, 0], [1, 9], max_len=50, num_slots=4, fold=3) == [[0, 1]]  # padded width 10
    assert ort_fuse.gqa_groups([40, 0], [1, 8], max_len=50, num_slots=4, fold=3) == [[1], [0]]  # folded width 24


def test_without_the_split_gqa_refuses_the_step(monkeypatch, gqa_graph) -> None:
    """Negative control for the split: its precondition is real, ORT rejects the padded step outright."""
    backend = OrtBackend(gqa_graph[1])
    cache = backend.allocate_cache(2, 48)
    backend.step(pack([SeqWork(0, 0, list(range(1, 46)))]), cache)
    monkeypatch.setattr(ort_fuse, "gqa_groups", lambda past, new, max_len, slots, fold: [list(range(len(new)))])
    with pytest.raises(Exception, match="does not fit in the KV cache"):
        backend.step(pack([SeqWork(0, 45, [3]), SeqWork(1, 0, list(range(4, 34)))]), cache)


def _wrong_seqlens(original):
    def prelude(g, *args):
        pre = original(g, *args)  # either layout's prelude: both have query_seqlens
        one = g.add("Constant", value=onnx.helper.make_tensor("one", TensorProto.INT32, [], [1]))
        zero = g.add("Constant", value=onnx.helper.make_tensor("zero", TensorProto.INT32, [], [0]))
        pre.query_seqlens = g.add("Max", g.add("Sub", pre.query_seqlens, one), zero)  # each chunk's last row: padding
        return pre

    return prelude


@pytest.mark.parametrize("mistake", ["bias", "seqlens", "folded bias", "folded seqlens"])
def test_a_wrong_bias_or_seqlens_fails_the_agreement_check(mistake, monkeypatch, gqa_graph) -> None:
    """Each layout checked on its own: the padded one with folding off (FOLD_ROWS 0), the folded one as it runs."""
    model, path = gqa_graph
    if not mistake.startswith("folded"):
        monkeypatch.setattr(ort_fold, "FOLD_ROWS", 0)
    if mistake.endswith("bias"):
        monkeypatch.setitem(ort_fuse._LOWEST, TensorProto.FLOAT, 0.0)  # hidden keys get bias 0: the tree is ignored
    elif mistake == "seqlens":
        monkeypatch.setattr(ort_fuse, "_prelude", _wrong_seqlens(ort_fuse._prelude))
    else:
        monkeypatch.setattr(ort_fuse, "fold_prelude", _wrong_seqlens(ort_fuse.fold_prelude))
    wrong = OrtBackend(path)
    assert wrong.fuse_report.attention
    assert max_logit_error(TorchBackend(model), wrong, num_slots=5, max_len=48, seed=0) > 1e-3


def test_the_folded_and_padded_layouts_give_the_same_bits(gqa_graph, monkeypatch) -> None:
    """Both layouts run in every step, one over idle slots; which one a row takes must not change its bits."""
    _, path = gqa_graph
    folded = OrtBackend(path)
    monkeypatch.setattr(ort_fold, "FOLD_ROWS", 0)  # every step takes the padded branch
    padded = OrtBackend(path)
    assert folded.fuse_report.fold == padded.fuse_report.fold == 2
    caches = folded.allocate_cache(5, 48), padded.allocate_cache(5, 48)
    for work in random_packs(folded.vocab_size, 5, 48, seed=11):
        batch = pack(work)
        assert np.array_equal(folded.step(batch, caches[0]), padded.step(batch, caches[1]))


def test_the_switch_turns_rewrites_off(tiny_export, monkeypatch) -> None:
    _, path = tiny_export
    assert OrtBackend(path, fuse=False).fuse_report is None
    only = OrtBackend(path, fuse=["rmsnorm"]).fuse_report
    assert only.counts["rmsnorm"] > 0 and only.counts["attention"] == only.counts["rotary"] == 0
    monkeypatch.setenv(FUSE_ENV, "0")
    assert OrtBackend(path).fuse_report is None
    monkeypatch.setenv(FUSE_ENV, "attention")
    env = OrtBackend(path).fuse_report
    assert env.attention and env.counts["rmsnorm"] == 0
    with pytest.raises(ValueError, match="unknown ORT rewrites"):
        ort_fuse.fuse_model(onnx.load(str(path), load_external_data=False), ["nope"])


def test_each_rewrite_alone_is_exact(tiny_export) -> None:
    model, path = tiny_export
    for rewrite in ort_fuse.REWRITES:
        if rewrite == "skip_rmsnorm":
            continue  # it rewrites rmsnorm's output
        assert (
            max_logit_error(TorchBackend(model), OrtBackend(path, fuse=[rewrite]), num_slots=4, max_len=40, seed=5)
            < 1e-4
        ), rewrite


def test_fp16_fused_graph_runs_close_to_fp32(tmp_path) -> None:
    model = tiny_random(seed=4, num_layers=2)
    backend = OrtBackend(export_onnx(model, tmp_path / "fp16.onnx", dtype=torch.float16))
    assert backend.fuse_report.counts["attention"] == 2 and backend.fuse_report.counts["rmsnorm"] == 5
    assert max_logit_error(TorchBackend(model), backend, num_slots=3, max_len=32) < 0.05


def test_rewrites_compose_with_quantized_matmuls(tmp_path) -> None:
    from specdec.export.quantization.strategies import strategy_for
    from specdec.export.quantize import quantize_export

    model = tiny_random(seed=1, num_layers=2)
    path = export_onnx(model, tmp_path / "model.onnx")
    quantize_export(model, path, strategy_for("int8"))
    assert _ops(onnx.load(str(path), load_external_data=False))[("com.microsoft", "MatMulNBits")] > 0
    fused, plain = OrtBackend(path), OrtBackend(path, fuse=False)
    assert fused.fuse_report.attention and fused.fuse_report.counts["rmsnorm"] == 5
    assert max_logit_error(plain, fused, num_slots=5, max_len=48) < 1e-4


@pytest.mark.real_model
def test_smollm2_fused_graph_matches_torch(smollm2_export) -> None:
    graph = smollm2_export / "target" / "model.onnx"
    backend = OrtBackend(graph)
    assert backend.fuse_report.counts == {"attention": 30, "rmsnorm": 61, "skip_rmsnorm": 59, "rotary": 60}
    error = max_logit_error(TorchBackend(load_model("smollm2-135m")), backend, num_slots=4, max_len=160, seed=7)
    assert error < 1e-3 and backend.inplace_ok


def test_a_graph_whose_files_are_symlinks_loads_fused(tmp_path) -> None:
    """A deployment made of links (a copied export, a mounted volume): ORT reads the fused graph's external data
    from where the links resolve, which it accepts, instead of refusing a data file outside the graph's folder."""
    model = tiny_random(seed=1, num_layers=2)
    real = export_onnx(model, tmp_path / "real" / "model.onnx")
    links = tmp_path / "links"
    links.mkdir()
    for file in real.parent.iterdir():
        (links / file.name).symlink_to(file)
    backend = OrtBackend(links / "model.onnx")
    assert backend.fuse_report.attention
    assert max_logit_error(TorchBackend(model), backend, num_slots=3, max_len=32) < 1e-4

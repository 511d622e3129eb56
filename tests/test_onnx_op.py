"""The ONNX side of ``specdec::RaggedTreeAttention``: schema, standard-op body, export, KV compaction.

Every numeric check compares ONNX Runtime (CPU, no extra library: it runs the model-local
function body) with the torch reference ``specdec.plugins.reference.ragged_tree_attention``.
Caches are filled with NaN wherever the reference never reads, so a body that touches a row
it must not read, or writes a row it must not write, fails loudly.
"""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper

from specdec.plugins import onnx_op
from specdec.plugins.reference import ragged_tree_attention
from specdec.plugins.torch_op import TRANSLATION_TABLE
from specdec.runtime.packed import ROOT, PackedBatch, SeqWork, pack

ort = pytest.importorskip("onnxruntime")

SCALE = 0.37
OPSETS = (18, 20, 23)


def _session(model: onnx.ModelProto) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1  # the CI box has 2 cores shared with other jobs
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


@functools.cache
def _attention_session(opset: int, dtype: int = TensorProto.FLOAT, scale: float = SCALE) -> ort.InferenceSession:
    """One session per (opset, dtype, scale); all dimensions are symbolic, so it serves every case."""
    # head counts on the node only inform plugins; the body reads them from the shapes (0 = unspecified)
    model = onnx_op.attention_model(scale=scale, num_heads=0, num_kv_heads=0, opset=opset, dtype=dtype)
    onnx.checker.check_model(model, full_check=True)
    return _session(model)


# --------------------------------------------------------------------------------------------- random batches


@dataclass
class Case:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    cu_seqlens: torch.Tensor  # int32, may contain zero-length sequences
    past_lens: torch.Tensor
    slot_ids: torch.Tensor
    tree_mask: torch.Tensor
    idle_slots: list[int]

    def feeds(self, dtype: np.dtype = np.float32) -> dict[str, np.ndarray]:
        acts = {n: getattr(self, n).numpy().astype(dtype) for n in ("q", "k", "v", "k_cache", "v_cache")}
        idx = {n: getattr(self, n).numpy() for n in ("cu_seqlens", "past_lens", "slot_ids", "tree_mask")}
        return {**acts, **idx}

    def reference(self, scale: float = SCALE) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        k_cache, v_cache = self.k_cache.clone(), self.v_cache.clone()
        out = ragged_tree_attention(
            self.q,
            self.k,
            self.v,
            k_cache,
            v_cache,
            self.cu_seqlens.tolist(),
            self.past_lens.tolist(),
            self.slot_ids.tolist(),
            self.tree_mask,
            scale,
        )
        return out, k_cache, v_cache


def _forest(rng: random.Random, n: int) -> list[int]:
    """Random topologically ordered forest: token 0 is a root, later tokens are roots 30% of the time."""
    return [ROOT if j == 0 or rng.random() < 0.3 else rng.randrange(j) for j in range(n)]


KINDS = ("prefill", "decode", "chain", "forest", "forest", "empty")


def _random_case(
    seed: int,
    hq: int,
    hkv: int,
    head_dim: int = 8,
    slots: int = 8,
    max_len: int = 24,
    kinds: list[str] | None = None,
) -> Case:
    """A pack mixing prefill, decode, chains, forests and zero-token sequences, with idle slots.

    Even seeds use every kind in a random order; odd seeds a random subset (other B).
    """
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    if kinds is None:
        kinds = list(KINDS)
        rng.shuffle(kinds)
        if seed % 2:
            kinds = kinds[: rng.randint(2, len(kinds))]
    slot_order = rng.sample(range(slots), len(kinds))
    items: list[SeqWork] = []
    for kind, slot in zip(kinds, slot_order):
        n = {"prefill": rng.randint(2, 5), "decode": 1, "chain": rng.randint(2, 5), "forest": rng.randint(3, 6)}.get(
            kind, 0
        )
        past = 0 if kind == "prefill" else rng.randint(0 if kind in ("forest", "empty") else 1, max_len - 6)
        parents = _forest(rng, n) if kind == "forest" else None
        items.append(SeqWork(slot, past, list(range(n)), parents=parents))
    packed = pack(items)  # drops the empty items; the op must also accept them, so rebuild the index tensors
    lens = [len(w.token_ids) for w in items]
    cu = torch.tensor([0, *np.cumsum(lens).tolist()], dtype=torch.int32)
    tree_mask = torch.from_numpy(packed.tree_mask.copy())  # the torch plugin's input (pack() is numpy)
    for b, n in enumerate(lens):  # columns >= n_b belong to no token of b: set garbage the op must ignore
        if n and n < tree_mask.shape[1]:
            tree_mask[cu[b] : cu[b + 1], n:] = torch.rand(n, tree_mask.shape[1] - n, generator=gen) < 0.5
    t = int(cu[-1])
    k_cache = torch.randn(slots, hkv, max_len, head_dim, generator=gen)
    v_cache = torch.randn(slots, hkv, max_len, head_dim, generator=gen)
    for w, n in zip(items, lens):  # never-written rows: reading them would poison the output with NaN
        k_cache[w.slot_id, :, w.past_len + n :] = float("nan")
        v_cache[w.slot_id, :, w.past_len + n :] = float("nan")
    idle = sorted(set(range(slots)) - set(slot_order))
    k_cache[idle[0], :, max_len // 2 :] = float("nan")
    return Case(
        q=torch.randn(t, hq, head_dim, generator=gen),
        k=torch.randn(t, hkv, head_dim, generator=gen),
        v=torch.randn(t, hkv, head_dim, generator=gen),
        k_cache=k_cache,
        v_cache=v_cache,
        cu_seqlens=cu,
        past_lens=torch.tensor([w.past_len for w in items], dtype=torch.int32),
        slot_ids=torch.tensor([w.slot_id for w in items], dtype=torch.int32),
        tree_mask=tree_mask,
        idle_slots=idle + [w.slot_id for w, n in zip(items, lens) if n == 0],
    )


def _torch_index(packed: PackedBatch) -> tuple[torch.Tensor, ...]:
    """``cu_seqlens, past_lens, slot_ids, tree_mask`` of a (numpy) pack as the torch tensors the plugins take."""
    return tuple(
        torch.from_numpy(getattr(packed, n).copy()) for n in ("cu_seqlens", "past_lens", "slot_ids", "tree_mask")
    )


def _max_abs(a: np.ndarray, b: np.ndarray) -> float:
    """max |a - b| over entries where neither is NaN, after asserting NaNs sit at the same places."""
    a64, b64 = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    np.testing.assert_array_equal(np.isnan(a64), np.isnan(b64))
    ok = ~np.isnan(a64)
    return float(np.abs(a64[ok] - b64[ok]).max()) if ok.any() else 0.0


def _assert_matches(case: Case, got: list[np.ndarray], atol: float, expected=None, bitwise: bool = True) -> None:
    out, k_cache, v_cache = expected if expected is not None else case.reference()
    assert np.isfinite(got[0]).all()
    assert _max_abs(got[0], out.numpy()) < atol
    for got_cache, ref_cache, before in ((got[1], k_cache, case.k_cache), (got[2], v_cache, case.v_cache)):
        ref = ref_cache.numpy().astype(got_cache.dtype)
        assert _max_abs(got_cache, ref) == 0.0  # caches are copies: exact
        before = before.numpy().astype(got_cache.dtype)
        for slot in case.idle_slots:  # untouched bit for bit (NaN payloads included)
            if bitwise:
                assert got_cache[slot].tobytes() == before[slot].tobytes()
            else:
                assert _max_abs(got_cache[slot], before[slot]) == 0.0


# --------------------------------------------------------------------------------------------- (a) schema


def test_schema_registered_and_idempotent() -> None:
    onnx_op.register_schema()
    onnx_op.register_schema()
    schema = onnx.defs.get_schema(onnx_op.OP_TYPE, 1, onnx_op.DOMAIN)
    assert [p.name for p in schema.inputs] == list(onnx_op.INPUT_NAMES)
    assert [p.name for p in schema.outputs] == list(onnx_op.OUTPUT_NAMES)
    assert set(schema.attributes) == set(onnx_op.ATTRIBUTE_NAMES)


def test_node_carries_plugin_keys_and_infers_types() -> None:
    model = onnx_op.attention_model(scale=0.5, num_heads=6, num_kv_heads=2, dtype=TensorProto.FLOAT16)
    (node,) = model.graph.node
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    assert (node.domain, node.op_type) == ("specdec", "RaggedTreeAttention")
    assert attrs == {
        "scale": 0.5,
        "num_heads": 6,
        "num_kv_heads": 2,
        "plugin_namespace": b"specdec",
        "plugin_version": b"1",
    }
    bare = onnx.ModelProto()
    bare.CopyFrom(model)
    del bare.functions[:]
    del bare.graph.output[:]
    bare.graph.output.extend([helper.make_empty_tensor_value_info(n) for n in onnx_op.OUTPUT_NAMES])
    inferred = onnx.shape_inference.infer_shapes(bare, strict_mode=True)  # the schema's own inference
    for vi in inferred.graph.output:
        assert vi.type.tensor_type.elem_type == TensorProto.FLOAT16


def test_function_body_is_standard_ops_with_scale_reference() -> None:
    for opset in OPSETS:
        fn = onnx_op.function_proto(opset)
        assert (fn.domain, fn.name) == ("specdec", "RaggedTreeAttention")
        assert [(o.domain, o.version) for o in fn.opset_import] == [("", opset)]
        assert {n.domain for n in fn.node} == {""}
        assert any(a.ref_attr_name == "scale" for n in fn.node for a in n.attribute)
    with pytest.raises(ValueError, match="opset >= 18"):
        onnx_op.function_proto(17)


def test_attach_functions_is_idempotent() -> None:
    model = onnx_op.attention_model(scale=0.5, num_heads=2, num_kv_heads=2, opset=20)
    once = model.SerializeToString()
    onnx_op.attach_functions(model)
    assert model.SerializeToString() == once
    assert [(o.domain, o.version) for o in model.opset_import].count(("specdec", 1)) == 1


# --------------------------------------------------------------------------------------------- (b) standalone node


@pytest.mark.parametrize("opset", OPSETS)
@pytest.mark.parametrize(("hq", "hkv"), [(2, 2), (4, 2), (6, 2)])
def test_matches_reference_fp32(opset: int, hq: int, hkv: int) -> None:
    session = _attention_session(opset)
    for seed in range(4):
        case = _random_case(seed * 31 + hq, hq, hkv)
        _assert_matches(case, session.run(None, case.feeds()), atol=1e-5)


def test_single_sequence_shapes() -> None:
    """Single decode token (the reference's no-mask path) and a lone prefill."""
    session = _attention_session(20)
    gen = torch.Generator().manual_seed(3)
    for past, n in ((9, 1), (0, 7)):
        packed = pack([SeqWork(2, past, list(range(n)))])
        kc, vc = torch.randn(3, 1, 16, 4, generator=gen), torch.randn(3, 1, 16, 4, generator=gen)
        case = Case(
            torch.randn(n, 3, 4, generator=gen),
            torch.randn(n, 1, 4, generator=gen),
            torch.randn(n, 1, 4, generator=gen),
            kc,
            vc,
            *_torch_index(packed),
            idle_slots=[0, 1],
        )
        _assert_matches(case, session.run(None, case.feeds()), atol=1e-5)


def test_zero_token_sequences_at_both_ends() -> None:
    session = _attention_session(20)
    for kinds in (["empty", "decode", "empty"], ["empty", "empty", "forest"], ["chain", "empty"]):
        case = _random_case(21, 4, 2, kinds=kinds)
        assert 0 in torch.diff(case.cu_seqlens).tolist()
        _assert_matches(case, session.run(None, case.feeds()), atol=1e-5)


def test_scale_attribute_is_used() -> None:
    case = _random_case(5, 4, 2)
    session = _attention_session(20, TensorProto.FLOAT, 1.3)
    _assert_matches(case, session.run(None, case.feeds()), atol=1e-5, expected=case.reference(1.3))


@pytest.mark.parametrize("opset", [18, 20])
def test_fp16_finite_and_close(opset: int) -> None:
    session = _attention_session(opset, TensorProto.FLOAT16)
    for seed in range(3):
        case = _random_case(100 + seed, 6, 2)
        case.q = case.q * 8  # large logits: a fp16 softmax or mask constant would overflow here
        rounded = Case(**{**case.__dict__, **{n: getattr(case, n).half().float() for n in ("q", "k", "v")}})
        rounded.k_cache, rounded.v_cache = case.k_cache.half().float(), case.v_cache.half().float()
        got = session.run(None, case.feeds(np.float16))
        assert all(g.dtype == np.float16 for g in got)
        _assert_matches(rounded, got, atol=1e-2)


def test_bfloat16_through_casts() -> None:
    """bf16 I/O (numpy has no bf16, so the graph casts float inputs to bf16 around the node)."""
    model = onnx_op.attention_model(scale=SCALE, num_heads=4, num_kv_heads=2, opset=20, dtype=TensorProto.BFLOAT16)
    graph = model.graph
    (node,) = graph.node
    for vi in list(graph.input) + list(graph.output):
        if vi.type.tensor_type.elem_type == TensorProto.BFLOAT16:
            vi.type.tensor_type.elem_type = TensorProto.FLOAT
    before = [helper.make_node("Cast", [n], [f"{n}_bf16"], to=TensorProto.BFLOAT16) for n in onnx_op.INPUT_NAMES[:5]]
    after = [helper.make_node("Cast", [f"{n}_bf16"], [n], to=TensorProto.FLOAT) for n in onnx_op.OUTPUT_NAMES]
    node.input[:5] = [f"{n}_bf16" for n in onnx_op.INPUT_NAMES[:5]]
    node.output[:] = [f"{n}_bf16" for n in onnx_op.OUTPUT_NAMES]
    wrapped = [*before, node, *after]
    del graph.node[:]
    graph.node.extend(wrapped)
    onnx.checker.check_model(model, full_check=True)
    case = _random_case(7, 4, 2)
    rounded = Case(**{**case.__dict__, **{n: getattr(case, n).bfloat16().float() for n in ("q", "k", "v")}})
    rounded.k_cache, rounded.v_cache = case.k_cache.bfloat16().float(), case.v_cache.bfloat16().float()
    got = _session(model).run(None, case.feeds())
    _assert_matches(rounded, got, atol=3e-2, bitwise=False)  # the test's own casts canonicalise NaN payloads


# --------------------------------------------------------------------------------------------- (c) export


class _TinyAttention(torch.nn.Module):
    """Two attention layers around the custom op (GQA 4:2), enough to check export and wiring."""

    def __init__(self, hidden: int = 16, hq: int = 4, hkv: int = 2, head_dim: int = 4, layers: int = 2) -> None:
        super().__init__()
        self.hq, self.hkv, self.head_dim = hq, hkv, head_dim
        self.qkv = torch.nn.ModuleList(torch.nn.Linear(hidden, (hq + 2 * hkv) * head_dim) for _ in range(layers))
        self.o = torch.nn.ModuleList(torch.nn.Linear(hq * head_dim, hidden) for _ in range(layers))

    def forward(self, x, cu_seqlens, past_lens, slot_ids, tree_mask, k_caches, v_caches):
        t, d = x.shape[0], self.head_dim
        k_out, v_out = [], []
        for i, (qkv, o) in enumerate(zip(self.qkv, self.o)):
            q, k, v = qkv(x).split([self.hq * d, self.hkv * d, self.hkv * d], dim=-1)
            attn, kc, vc = torch.ops.specdec.ragged_tree_attention(
                q.reshape(t, self.hq, d),
                k.reshape(t, self.hkv, d),
                v.reshape(t, self.hkv, d),
                k_caches[i],
                v_caches[i],
                cu_seqlens,
                past_lens,
                slot_ids,
                tree_mask,
                d**-0.5,
                self.hq,
                self.hkv,
            )
            x = x + o(attn.reshape(t, -1))
            k_out.append(kc)
            v_out.append(vc)
        return x, k_out, v_out


def _module_inputs(seed: int, work: list[SeqWork], slots: int, max_len: int) -> tuple:
    gen = torch.Generator().manual_seed(seed)
    packed = pack(work)
    caches = [[torch.randn(slots, 2, max_len, 4, generator=gen) for _ in range(2)] for _ in range(2)]
    x = torch.randn(packed.num_tokens, 16, generator=gen)
    return (x, *_torch_index(packed), caches[0], caches[1])


@pytest.fixture(scope="module")
def exported() -> tuple[_TinyAttention, onnx.ModelProto]:
    torch.manual_seed(0)
    module = _TinyAttention().eval()
    args = _module_inputs(0, [SeqWork(1, 3, [1, 2, 3]), SeqWork(0, 0, [1, 2])], slots=3, max_len=8)
    dyn = torch.export.Dim.DYNAMIC
    cache_dims = [{0: dyn, 2: dyn}] * 2
    shapes = ({0: dyn}, {0: dyn}, {0: dyn}, {0: dyn}, {0: dyn, 1: dyn}, cache_dims, cache_dims)
    program = torch.onnx.export(
        module, args, dynamic_shapes=shapes, dynamo=True, custom_translation_table=TRANSLATION_TABLE, verbose=False
    )
    return module, program.model_proto


def test_export_keeps_custom_nodes(exported) -> None:
    _, model = exported
    assert onnx_op.model_opset(model) in OPSETS  # the exporter's opset is one the tests cover
    nodes = [n for n in model.graph.node if n.op_type == "RaggedTreeAttention"]
    assert len(nodes) == 2
    for node in nodes:
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        assert node.domain == "specdec"
        assert attrs["plugin_namespace"] == b"specdec" and attrs["plugin_version"] == b"1"
        assert (attrs["num_heads"], attrs["num_kv_heads"]) == (4, 2)
        assert attrs["scale"] == pytest.approx(0.5)


def test_exported_model_runs_in_ort(exported) -> None:
    module, model = exported
    model = onnx_op.attach_functions(onnx.ModelProto.FromString(model.SerializeToString()))
    onnx.checker.check_model(model, full_check=True)
    assert any(n.op_type == "RaggedTreeAttention" for n in model.graph.node)  # attach inlines nothing
    # a different pack from the export example: other T, B, S_max, slot count and cache length
    work = [
        SeqWork(4, 6, [5, 6, 7, 8], parents=[ROOT, 0, ROOT, 2]),
        SeqWork(0, 0, [1, 2, 3]),
        SeqWork(2, 9, [4]),
    ]
    args = _module_inputs(1, work, slots=5, max_len=16)
    with torch.no_grad():
        x, k_out, v_out = module(*args)
    names = [i.name for i in model.graph.input]
    flat = [*args[:5], *args[5], *args[6]]
    got = _session(model).run(None, {n: t.numpy() for n, t in zip(names, flat)})
    assert np.abs(got[0] - x.numpy()).max() < 1e-5
    expected_caches = [c.numpy() for c in (*k_out, *v_out)]
    output_names = [o.name for o in model.graph.output]
    for name, ref in zip(output_names[1:], expected_caches):
        assert np.abs(got[output_names.index(name)] - ref).max() < 1e-6


def test_torch_op_eager_is_functional() -> None:
    case = _random_case(11, 4, 2)
    k_before, v_before = case.k_cache.clone(), case.v_cache.clone()
    out, k_cache, v_cache = torch.ops.specdec.ragged_tree_attention(
        case.q,
        case.k,
        case.v,
        case.k_cache,
        case.v_cache,
        case.cu_seqlens,
        case.past_lens,
        case.slot_ids,
        case.tree_mask,
        SCALE,
        4,
        2,
    )
    ref = case.reference()
    torch.testing.assert_close(out, ref[0])
    torch.testing.assert_close(k_cache, ref[1], equal_nan=True)
    torch.testing.assert_close(v_cache, ref[2], equal_nan=True)
    torch.testing.assert_close(case.k_cache, k_before, equal_nan=True)  # inputs untouched
    torch.testing.assert_close(case.v_cache, v_before, equal_nan=True)
    finite = [case.q, case.k, case.v, torch.nan_to_num(case.k_cache), torch.nan_to_num(case.v_cache)]
    index = [case.cu_seqlens, case.past_lens, case.slot_ids, case.tree_mask]
    result = torch.library.opcheck(torch.ops.specdec.ragged_tree_attention.default, (*finite, *index, SCALE, 4, 2))
    assert set(result.values()) == {"SUCCESS"}  # schema, fake tensor, autograd registration, AOT dispatch


# --------------------------------------------------------------------------------------------- (d) compaction


def test_compaction_moves() -> None:
    slots, src, dst = onnx_op.compaction_moves([3, 1, 0], [5, 0, 2], [[0, 1, 2], [1, 3], []])
    assert (slots, src, dst) == ([1, 1], [1, 3], [0, 1])  # the accepted chain of slot 3 stays in place


@pytest.mark.parametrize("opset", [18, 20])
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_kv_compact_graph_matches_torch(opset: int, dtype: type) -> None:
    onnx_dtype = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    model = onnx_op.kv_compact_model(num_caches=3, opset=opset, dtype=onnx_dtype)
    onnx.checker.check_model(model, full_check=True)
    session = _session(model)
    gen = torch.Generator().manual_seed(opset)
    caches = [torch.randn(4, 2, 20, 8, generator=gen).to(getattr(torch, np.dtype(dtype).name)) for _ in range(3)]
    # slot 2: path through offsets 1, 3, 4 of 6 drafted tokens after past 7; slot 0: offset 2 after past 0
    for slot_ids, past_lens, accepted in (([2, 0], [7, 0], [[1, 3, 4], [2]]), ([1], [4], [[0, 1]])):
        slots, src, dst = onnx_op.compaction_moves(slot_ids, past_lens, accepted)
        feeds = {f"cache.{i}": c.numpy() for i, c in enumerate(caches)}
        feeds |= {
            "slot_ids": np.array(slots, dtype=np.int32),
            "src_positions": np.array(src, dtype=np.int32),
            "dst_positions": np.array(dst, dtype=np.int32),
        }
        got = session.run(None, feeds)
        s, a, b = (torch.tensor(x, dtype=torch.long) for x in (slots, src, dst))
        for cache, out in zip(caches, got):
            expected = cache.clone()
            expected[s, :, b] = cache[s, :, a]  # advanced indexing reads every source first
            assert out.tobytes() == expected.numpy().tobytes()

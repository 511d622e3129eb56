"""``specdec-export --quantize``: MatMulNBits blocks, GGUF block reproduction, exact decoding on quantized graphs.

The packing is checked against ONNX Runtime's own kernel (one-node graphs), the GGUF conversion
against ``gguf.quants.dequantize`` on a tiny GGUF written here and on the real SmolLM2 file, and
the exported graphs by decoding: greedy ``ems`` equals greedy ``ar`` on the same quantized graph,
and speculative sampling keeps the quantized graph's own law.
"""

from __future__ import annotations

import json
import random
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import gguf
import numpy as np
import onnx
import pytest
import torch
from fakes import small_tokenizer
from invariance import MAX_LEN, differing_positions, one_token_per_step, random_steps, sequences_to_the_end
from onnx import TensorProto, helper
from test_lossless_sampling import _TINY as LOSSLESS_TINY
from test_lossless_sampling import (
    MAX_BATCH,
    NUM_SAMPLES,
    NUM_TOKENS,
    PLAIN,
    PROMPT,
    assert_lossless,
    chi_square_pvalue,
    exact_joint,
    marginal_counts,
    total_variation,
)

from specdec.export import quantize as q
from specdec.export.blocks import centred_offsets
from specdec.export.cli import main as export_main
from specdec.export.onnx import export_onnx
from specdec.models import gguf_blocks
from specdec.models.loading import LoadedModel, load_model, tiny_random
from specdec.models.manifest import read_manifest
from specdec.runtime.backends.onnxruntime import OrtBackend
from specdec.runtime.backends.torch_backend import TorchBackend
from specdec.runtime.config import EngineConfig
from specdec.runtime.drafters import make_drafter
from specdec.runtime.engine import Engine
from specdec.runtime.packed import SeqWork, pack
from specdec.runtime.request import Request
from specdec.runtime.sampling import SamplingParams

GG = gguf.GGMLQuantizationType
#: llama.cpp tensor names -> Hugging Face projection names (written out here, independent of specdec's table)
LAYER_TENSORS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
#: the tiny GGUF's block types: every converted type, Q4_1 on the RoPE-permuted q/k, mixed inside fused weights
TINY_TYPES = {
    "attn_q": GG.Q4_1,
    "attn_k": GG.Q4_1,
    "attn_v": GG.Q4_0,
    "attn_output": GG.Q8_0,
    "ffn_gate": GG.Q4_1,
    "ffn_up": GG.Q4_0,
    "ffn_down": GG.Q4_1,
}


# -- packing ---------------------------------------------------------------------------------------


def test_pack_layout_is_the_one_matmul_nbits_reads() -> None:
    codes = np.arange(32, dtype=np.uint8).reshape(1, 1, 32) % 16
    blob = q.pack_codes(codes, 4)
    assert blob.shape == (1, 1, 16) and blob[0, 0, 0] == 0x10 and blob[0, 0, 1] == 0x32  # element 2i low, 2i+1 high
    zps = np.array([[1, 2, 3]], dtype=np.uint8)  # an odd block count: the row's last byte is half used
    assert q.pack_zero_points(zps, 4).tolist() == [[0x21, 0x03]]
    assert np.array_equal(q.pack_codes(codes, 8), codes) and np.array_equal(q.pack_zero_points(zps, 8), zps)


@pytest.mark.parametrize("bits", [4, 8])
def test_quantize_pack_unpack_dequantize_round_trips(bits: int) -> None:
    rng = np.random.default_rng(bits)
    weight = (rng.standard_normal((24, 100)) * 0.05 + 0.01).astype(np.float32)  # K = 100: a padded last block
    block = q.quantize_rtn(weight, bits)
    k_blocks = block.scales.shape[1]
    assert block.codes.shape == (24, 4, 32) and int(block.codes.max()) < 2**bits
    codes = q.unpack_codes(q.pack_codes(block.codes, bits), bits)
    assert np.array_equal(codes, block.codes)
    zps = block.zero_points
    if zps is not None:
        assert np.array_equal(q.unpack_zero_points(q.pack_zero_points(zps, bits), bits, k_blocks), zps)
    again = q.BlockQuant(bits, codes, block.scales, zps, None, 100, "rtn").dequantize()
    assert np.array_equal(again, block.dequantize())
    # round to nearest: every weight within half a step of its block's grid
    step = np.repeat(block.scales, 32, axis=1)[:, :100]
    assert np.all(np.abs(again - weight) <= step / 2 * (1 + 1e-5))
    assert not np.array_equal(again, weight)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
def test_gguf_blocks_convert_bit_exactly(kind: str) -> None:
    rng = np.random.default_rng(7)
    weight = (rng.standard_normal((6, 96)) * 0.05 + 0.02).astype(np.float32)
    raw = gguf.quants.quantize(weight, GG[kind])
    block = q.from_gguf_blocks(kind, raw, 96)
    want = gguf.quants.dequantize(raw, GG[kind])
    assert np.array_equal(block.dequantize(), want)
    assert np.array_equal(block.widened(8).dequantize(), want)  # 4-bit codes held exactly in 8 bits
    assert block.bits == (8 if kind == "Q8_0" else 4)


def test_q4_1_offsets_are_centred_exactly() -> None:
    """Each Q4_1 block takes the zero point that makes its offset smallest, and the weights do not change."""
    rng = np.random.default_rng(11)
    weight = (rng.standard_normal((16, 256)) * 0.05 + rng.normal(0, 0.03, (16, 1))).astype(np.float32)
    raw = gguf.quants.quantize(weight, GG["Q4_1"])
    block = q.from_gguf_blocks("Q4_1", raw, 256)
    m = raw.reshape(16, 8, -1)[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float64)
    d = block.scales.astype(np.float64)
    assert block.zero_points is not None and block.zero_points.max() <= 15
    centred = m + block.zero_points * d
    assert np.array_equal(block.offsets.astype(np.float64), centred)  # exact in fp32: no weight moved
    assert np.all(np.abs(centred) <= np.abs(m))
    assert np.array_equal(np.abs(centred), np.abs(m[..., None] + np.arange(16) * d[..., None]).min(-1))  # nearest
    assert np.array_equal(block.dequantize(), gguf.quants.dequantize(raw, GG["Q4_1"]))


def test_an_offset_that_would_round_keeps_a_zero_point_that_does_not() -> None:
    """-1024 + z * d spans 35 bits for every z >= 1 with this fp16 scale: only z = 0 keeps the weights exact."""
    d = np.array([[2.0**-14 * (1 + 2.0**-10)], [0.5]], np.float32)
    m = np.array([[-1024.0], [-3.0]], np.float32)
    zero_points, offsets = centred_offsets(d, m, 15)
    assert zero_points.tolist() == [[0], [6]]  # the second block centres exactly: -3 + 6 * 0.5 = 0
    assert offsets.tolist() == [[-1024.0], [0.0]]


def test_centred_q4_1_blocks_round_the_inputs_less() -> None:
    """At int8 activations, the Q4_1 product with centred offsets is closer to the exact one than with raw
    codes 0..15 and the whole offset in the correction (the reason for ``centred_offsets``)."""
    rng = np.random.default_rng(5)
    weight = (rng.standard_normal((96, 576)) * 0.05).astype(np.float32)
    block = q.from_gguf_blocks("Q4_1", gguf.quants.quantize(weight, GG["Q4_1"]), 576)
    raw_codes = replace(
        block,
        zero_points=np.zeros_like(block.zero_points),
        offsets=(block.offsets.astype(np.float64) - block.zero_points * block.scales.astype(np.float64)).astype(
            np.float32
        ),
    )
    assert np.array_equal(raw_codes.dequantize(), block.dequantize())  # the same weights, held two ways
    x = rng.standard_normal((32, 576)).astype(np.float32)
    want = x.astype(np.float64) @ block.dequantize().T.astype(np.float64)
    errors = {
        name: float(np.abs(_one_linear(b, None, q.ACCURACY_LEVEL).run(None, {"x": x})[0] - want).mean())
        for name, b in (("centred", block), ("raw", raw_codes))
    }
    assert errors["centred"] < 0.5 * errors["raw"], errors


def _one_linear(block: q.BlockQuant, bias: np.ndarray | None, level: int) -> Any:
    """A session of one Gemm rewritten by the quantizer (x [T, K] -> y [T, N])."""
    import onnxruntime as ort

    n = block.rows
    gemm = helper.make_node("Gemm", ["x", "w", *(["b"] if bias is not None else [])], ["y"], name="lin", transB=1)
    nodes, inits = q._matmul_nbits(gemm, block, [], level)
    if bias is not None:
        inits.append(onnx.numpy_helper.from_array(bias, "b"))
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["T", block.columns])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["T", n])
    graph = helper.make_graph(nodes, "one", [x], [y], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20), helper.make_opsetid(q.MS_DOMAIN, 1)])
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("kind", ["rtn4", "rtn8", "Q4_0", "Q4_1", "Q8_0"])
def test_onnx_runtime_kernel_computes_the_dequantized_product(kind: str) -> None:
    """The packed blocks (nibble order, zero points, Q4_1 offsets, bias) as ORT's MatMulNBits reads them."""
    rng = np.random.default_rng(3)
    columns = 100 if kind.startswith("rtn") else 160  # a padded last block; 5 blocks: odd zero-point rows
    weight = (rng.standard_normal((40, columns)) * 0.05 + 0.01).astype(np.float32)
    if kind.startswith("rtn"):
        block = q.quantize_rtn(weight, int(kind[3:]))
    else:
        block = q.from_gguf_blocks(kind, gguf.quants.quantize(weight, GG[kind]), columns)
    bias = rng.standard_normal(40).astype(np.float32)
    x = rng.standard_normal((7, columns)).astype(np.float32)
    want = x.astype(np.float64) @ block.dequantize().T.astype(np.float64) + bias
    got = _one_linear(block, bias, q.FP32_ACTIVATIONS).run(None, {"x": x})[0]
    assert np.abs(got - want).max() < 1e-5 * np.abs(want).max()
    # int8 activations round the input: close, not exact (the shipped level; its cost is measured, not asserted)
    coarse = _one_linear(block, bias, q.ACCURACY_LEVEL).run(None, {"x": x})[0]
    assert np.abs(coarse - want).max() < 0.05 * np.abs(want).max()


# -- GGUF block reproduction ------------------------------------------------------------------------


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of attn_q / attn_k rows."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _hf_order(w: np.ndarray, n_head: int) -> np.ndarray:
    """The inverse of ``_llama_cpp_permute``."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(model: LoadedModel, tokenizer, path: Path) -> Path:
    """``model`` as llama.cpp would write it (tied Q8_0 embedding, ``TINY_TYPES`` blocks, permuted q/k)."""
    cfg = model.config
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    writer.add_tokenizer_model("gpt2")
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    writer.add_token_list([t for t, _ in vocab])
    writer.add_token_types([3 if t in tokenizer.all_special_tokens else 1 for t, _ in vocab])
    merges = json.loads(tokenizer.backend_tokenizer.to_str())["model"]["merges"]
    writer.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in merges])
    writer.add_eos_token_id(tokenizer.eos_token_id)
    sd = {k: v.numpy() for k, v in model.state_dict.items()}

    def add(name: str, value: np.ndarray, kind: GG) -> None:
        if kind == GG.F32:
            writer.add_tensor(name, value.astype(np.float32))
            return
        raw = gguf.quants.quantize(value.astype(np.float32), kind)
        writer.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=kind)

    add("token_embd.weight", sd["model.embed_tokens.weight"], GG.Q8_0)
    add("output_norm.weight", sd["model.norm.weight"], GG.F32)
    for i in range(cfg.num_hidden_layers):
        add(f"blk.{i}.attn_norm.weight", sd[f"model.layers.{i}.input_layernorm.weight"], GG.F32)
        add(f"blk.{i}.ffn_norm.weight", sd[f"model.layers.{i}.post_attention_layernorm.weight"], GG.F32)
        for short, hf in LAYER_TENSORS.items():
            w = sd[f"model.layers.{i}.{hf}.weight"]
            if short in ("attn_q", "attn_k"):
                w = _llama_cpp_permute(w, cfg.num_attention_heads if short == "attn_q" else cfg.num_key_value_heads)
            add(f"blk.{i}.{short}.weight", w, TINY_TYPES[short])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def gguf_dequantized(path: Path, config) -> dict[str, tuple[np.ndarray, str]]:
    """Every linear weight of a GGUF by Hugging Face name: (``gguf.quants.dequantize`` in HF row order, type)."""
    out = {}
    for t in gguf.GGUFReader(str(path)).tensors:
        parts = t.name.split(".")
        if t.name == "token_embd.weight":
            hf = "model.embed_tokens.weight"
        elif parts[0] == "blk" and parts[2] in LAYER_TENSORS:
            hf = f"model.layers.{parts[1]}.{LAYER_TENSORS[parts[2]]}.weight"
        else:
            continue
        w = gguf.quants.dequantize(t.data, t.tensor_type)
        if parts[-2] in ("attn_q", "attn_k"):
            w = _hf_order(w, config.num_attention_heads if parts[-2] == "attn_q" else config.num_key_value_heads)
        out[hf] = (w, t.tensor_type.name)
    return out


def assert_graph_reproduces_gguf(graph: Path, gguf_path: Path, model: LoadedModel) -> Counter:
    """Every MatMulNBits weight is the GGUF's own de-quantized rows, every linear layer exactly once; the formats."""
    want = gguf_dequantized(gguf_path, model.config)
    layers = int(model.config.num_hidden_layers)
    expected = {f"model.layers.{i}.{p}.weight" for i in range(layers) for p in LAYER_TENSORS.values()}
    expected.add("model.embed_tokens.weight")  # the tied LM head
    covered: Counter = Counter()
    bits: Counter = Counter()
    for name, (weight, runs, source) in q.graph_weights(graph).items():
        rows = np.concatenate([want[src][0][a:b] for src, a, b in runs])
        assert np.array_equal(weight, rows), f"{name}: de-quantized graph weight differs from the GGUF's blocks"
        loaded = np.concatenate([model.state_dict[src].numpy()[a:b] for src, a, b in runs])
        assert np.array_equal(weight, loaded), f"{name}: rows not in the loaded weights' order"
        for src, a, b in runs:
            covered[src] += b - a
            bits[want[src][1]] += 1
        assert source == "+".join(sorted({want[src][1] for src, _, _ in runs}))
    assert set(covered) == expected
    assert all(covered[n] == want[n][0].shape[0] for n in expected)  # each row once
    return bits


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tokenizer = small_tokenizer()
    model = tiny_random(
        seed=3,
        vocab_size=len(tokenizer),
        num_layers=2,
        hidden_size=64,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=128,
        tie_word_embeddings=True,
    )
    return write_tiny_gguf(model, tokenizer, tmp_path_factory.mktemp("gguf") / "tiny.gguf")


@pytest.fixture
def gguf_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    return tmp_path


def test_a_cached_gguf_conversion_keeps_the_path_to_the_blocks(tiny_gguf: Path, gguf_cache: Path) -> None:
    converted = load_model(tiny_gguf)
    cached = load_model(tiny_gguf)
    assert "cached conversion" in cached.source and "cached conversion" not in converted.source
    assert cached.extra[gguf_blocks.GGUF_PATH] == converted.extra[gguf_blocks.GGUF_PATH] == str(tiny_gguf)
    first, again = q.source_blocks(converted, 4), q.source_blocks(cached, 4)
    assert {n: b.source for n, b in again.items()} == {n: b.source for n, b in first.items()}
    assert all(np.array_equal(first[n].codes, again[n].codes) for n in first)
    assert Counter(b.source for b in first.values()) == Counter({"Q4_1": 8, "Q4_0": 4, "Q8_0": 3})


def test_tiny_gguf_graph_holds_the_files_own_blocks(tiny_gguf: Path, gguf_cache: Path) -> None:
    model = load_model(tiny_gguf)
    assert model.extra[gguf_blocks.GGUF_PATH] == str(tiny_gguf) and model.config.tie_word_embeddings
    graph = export_onnx(model, gguf_cache / "g" / "model.onnx")
    # at int8 activations (the default) every tensor is quantized, the Q8_0 ones in 8 bits (fp32 activations keep
    # those fp32: below)
    reference, summary = q.quantize_export(model, graph, "int4")
    # per layer: q|k|v and gate|up mix Q4_1 and Q4_0, o is Q8_0, down Q4_1; and the Q8_0 head
    assert summary["formats"] == {"Q4_0+Q4_1": 4, "Q4_1": 2, "Q8_0": 3}
    bits = assert_graph_reproduces_gguf(graph, tiny_gguf, model)
    assert bits["Q8_0"] == 3  # o_proj of both layers and the head: Q8_0 stays 8-bit under int4
    nbits = {
        n.name: {a.name: helper.get_attribute_value(a) for a in n.attribute}["bits"]
        for n in onnx.load(str(graph), load_external_data=False).graph.node
        if n.op_type == "MatMulNBits"
    }
    assert sorted(nbits.values()) == [4, 4, 4, 4, 4, 4, 8, 8, 8]
    # no second rounding: at fp32 activations the graph computes the loaded (= de-quantized GGUF) model itself
    from specdec.export.validate import max_logit_error

    q.set_accuracy_level(graph, q.CHECK_LEVEL)

    assert max_logit_error(TorchBackend(model), OrtBackend(graph)) < 1e-4
    assert max_logit_error(TorchBackend(reference), OrtBackend(graph)) < 1e-4


def test_at_fp32_activations_wider_source_tensors_stay_fp32(tiny_gguf: Path, gguf_cache: Path) -> None:
    """fp32 activations: the Q8_0 tensors, which MLAS would run 8-bit without an fp32-activation kernel, stay fp32
    Gemms; the 4-bit ones are MatMulNBits holding the file's own blocks."""
    model = load_model(tiny_gguf)
    graph = export_onnx(model, gguf_cache / "exact" / "model.onnx")
    _, summary = q.quantize_export(model, graph, "int4", accuracy_level=q.FP32_ACTIVATIONS)
    assert summary["fp32_tensors"] == [
        "model.embed_tokens.weight",
        "model.layers.0.self_attn.o_proj.weight",
        "model.layers.1.self_attn.o_proj.weight",
    ]
    nbits = [
        {a.name: helper.get_attribute_value(a) for a in n.attribute}
        for n in onnx.load(str(graph), load_external_data=False).graph.node
        if n.op_type == "MatMulNBits"
    ]
    assert [a["bits"] for a in nbits] == [4] * 6 and all(a["accuracy_level"] == 0 for a in nbits)
    # the head stays an fp32 Gemm, but the table is gathered from the file's Q8_0 blocks: the same values
    assert summary["embedding"] == "8-bit Q8_0"
    table, source = q.embedding_weights(graph)
    want, kind = gguf_dequantized(tiny_gguf, model.config)[q.EMBEDDING]
    assert source == kind == "Q8_0" and np.array_equal(table, want)
    assert np.array_equal(table, model.state_dict[q.EMBEDDING].numpy())
    from specdec.export.validate import max_logit_error

    assert max_logit_error(TorchBackend(model), OrtBackend(graph)) < 1e-4


def test_gguf_rows_in_llama_cpp_order_are_refused(
    tiny_gguf: Path, gguf_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without the RoPE un-permutation the blocks do not reproduce the loaded q/k rows: refused, not exported."""
    model = load_model(tiny_gguf)
    read = gguf_blocks.read_gguf_tensors

    def unpermuted(path, config):
        out = read(path, config)
        name = "model.layers.0.self_attn.k_proj.weight"
        t = out[name]
        rows = _llama_cpp_permute(t.data, config.num_key_value_heads)
        out[name] = gguf_blocks.GGUFTensor(name, t.ggml_type, t.shape, rows)
        return out

    monkeypatch.setattr(gguf_blocks, "read_gguf_tensors", unpermuted)
    with pytest.raises(q.QuantizeError, match=r"k_proj.*do not reproduce the loaded weights"):
        q.source_blocks(model, 4)


def test_real_smollm2_graph_holds_the_gguf_blocks(smollm2: LoadedModel, smollm2_int4_graph: Path) -> None:
    """All 210 Q4_1 projections and the Q8_0 head of the shipped GGUF, bit for bit, in HF row order."""
    bits = assert_graph_reproduces_gguf(smollm2_int4_graph, Path(smollm2.extra[gguf_blocks.GGUF_PATH]), smollm2)
    assert bits == Counter({"Q4_1": 210, "Q8_0": 1})  # qkv, o, gate_up, down per layer; the head
    ops = Counter(n.op_type for n in onnx.load(str(smollm2_int4_graph), load_external_data=False).graph.node)
    assert ops["MatMulNBits"] == 121 and ops["Gemm"] == 4 * 30  # the Gemms: Q4_1's block-offset corrections


def test_real_smollm2_int4_greedy_ems_equals_ar_on_the_same_graph(
    smollm2: LoadedModel, smollm2_int4_graph: Path
) -> None:
    """The shipped int4 graph (int8 activations) keeps speculation exact on the real model: verification steps of
    several rows give each row the logits a one-row ar step gives it (bitwise: test_batch_invariance), so greedy
    ems reproduces ar token for token, with prompt lookup accepting drafts."""
    from specdec.runtime.drafters import make_drafter
    from specdec.runtime.engine import Engine

    engine = Engine(
        OrtBackend(smollm2_int4_graph),
        make_drafter("ngram", max_batch=4, max_len=512, ngram=2, min_ngram=2),
        tokenizer=smollm2.tokenizer,
        eos_token_ids=smollm2.eos_token_ids,
        config=EngineConfig(max_batch=4, max_len=512, num_draft_tokens=5),
    )
    prompts = [
        "Name three rivers in Europe and one fact about each.",
        "Rewrite as a list: eggs, flour, two lemons, butter, a pinch of salt.",
        "Why do leaves change colour in autumn? Two sentences.",
        "Repeat exactly: the early bird catches the worm, but the second mouse gets the cheese.",
    ]
    requests = [engine.request(p, chat=True, max_tokens=48) for p in prompts]
    ar = engine.generate(requests, "ar")
    ems = engine.generate(requests, "ems")
    assert [o.token_ids for o in ems.outputs] == [o.token_ids for o in ar.outputs]
    assert ems.run.summary()["accepted_draft_tokens"] > 0


def test_a_gguf_graph_with_q4_1_offsets_is_batch_invariant(tiny_gguf: Path, gguf_cache: Path) -> None:
    """Q4_1's block offsets run outside MatMulNBits (a block-sum correction through a prepacked fp32 Gemm): every
    row's logits stay bitwise the same in any step (tests/test_batch_invariance.py, on RTN graphs)."""
    model = load_model(tiny_gguf)
    graph = export_onnx(model, gguf_cache / "invariant" / "model.onnx")
    _, summary = q.quantize_export(model, graph, "int4")
    assert summary["formats"]["Q4_1"] == 2 and summary["fp32_tensors"] == []
    backend = OrtBackend(graph)
    sequences = sequences_to_the_end(random.Random(3), backend.vocab_size, (MAX_LEN, 11))
    assert (
        differing_positions(one_token_per_step(backend, sequences), random_steps(backend, sequences, random.Random(4)))
        == []
    )


# -- quantized exports --------------------------------------------------------------------------------


SOURCES = {"target": "tiny-random:seed=9,num_layers=2", "draft": "tiny-random:seed=10,num_layers=1"}


@pytest.fixture(scope="module", params=["int4", "int8", "w8a8"])
def quantized_export(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    out = tmp_path_factory.mktemp("quantized") / "deploy"
    assert (
        export_main(
            [
                "--target",
                SOURCES["target"],
                "--draft",
                SOURCES["draft"],
                "--quantize",
                request.param,
                "--out",
                str(out),
                "--max-batch",
                "4",
                "--max-len",
                "256",
            ]
        )
        == 0
    )
    return request.param, out


def test_quantized_graphs_have_no_fp32_linear_weights(quantized_export: tuple[str, Path]) -> None:
    mode, out = quantized_export
    manifest = read_manifest(out)
    assert manifest["quantize"] == mode
    for part, layers in (("target", 2), ("draft", 1)):
        info = manifest[part]["quantize"]
        linears = 4 * layers  # qkv, o, gate_up, down per layer; and the head
        integer = mode in q.INTEGER_MODES  # the layers' linears as w8a8 chains, the head still MatMulNBits
        assert info["mode"] == mode
        assert info["formats"] == ({"w8a8": linears, "rtn": 1} if integer else {"rtn": linears + 1})
        assert info["accuracy_level"] == q.ACCURACY_LEVEL
        assert manifest[part]["validation_max_abs_logit_error"] < 1e-4  # the graph itself: tight
        assert info["max_abs_logit_error_vs_fp32"] > 0  # recorded: the rounding
        proto = onnx.load(str(out / manifest[part]["graph"]), load_external_data=False)
        ops = Counter(n.op_type for n in proto.graph.node)
        assert ops["MatMulNBits"] == (1 if integer else linears + 1) and ops["Gemm"] == 0 and ops["MatMul"] == 0
        assert ops["MatMulInteger"] == (linears if integer else 0)
        # the embedding table is gathered from the head's own blocks: no fp32 copy of it is left
        assert ops["GatherBlockQuantized"] == 1
        assert info["embedding"] == f"{q.MODES[mode]}-bit rtn"
        matrices = {
            i.name
            for i in proto.graph.initializer
            if i.data_type == TensorProto.FLOAT and len(i.dims) == 2 and min(i.dims) > 1
        }
        scales = {n.input[2] for n in proto.graph.node if n.op_type in ("MatMulNBits", "GatherBlockQuantized")}
        assert matrices == scales  # every fp32 matrix left is a table of block scales
        table, source = q.embedding_weights(out / manifest[part]["graph"])
        fp32 = load_model(SOURCES[part]).state_dict[q.EMBEDDING].numpy()
        assert source == "rtn" and np.array_equal(table, q.quantize_rtn(fp32, q.MODES[mode]).dequantize())


def test_greedy_ems_equals_ar_on_the_quantized_graphs(quantized_export: tuple[str, Path]) -> None:
    """On the caches a quantized export serves: fp16, as edge runtimes keep them (the manifest says so)."""
    _, out = quantized_export
    assert read_manifest(out)["kv_cache_dtype"] == "float16"
    engine = Engine.from_export(out)
    assert engine.target.np_dtype == np.float16 and engine.drafter.backend.np_dtype == np.float16
    g = torch.Generator().manual_seed(1)
    requests = [
        Request(torch.randint(0, 128, (n,), generator=g).tolist(), max_tokens=m)
        for n, m in ((1, 12), (40, 20), (7, 3), (90, 16))
    ]
    want = engine.generate(requests, "ar").outputs
    got = engine.generate(requests, "ems")
    assert [o.token_ids for o in got.outputs] == [o.token_ids for o in want]
    assert got.run.summary()["draft_tokens"] > 0
    # the target graph drafting for itself accepts its drafts: verification steps of k + 1 rows whose every row
    # must give what a one-row ar step gives it
    from specdec.runtime.drafters import ModelDrafter

    itself = Engine(
        engine.target,
        ModelDrafter(OrtBackend(out / "target" / "model.onnx", cache_dtype="float16"), 4, engine.max_len),
        config=EngineConfig(max_batch=4, max_len=engine.max_len, num_draft_tokens=4),
    )
    selfdrafted = itself.generate(requests, "ems")
    assert [o.token_ids for o in selfdrafted.outputs] == [o.token_ids for o in want]
    assert selfdrafted.run.summary()["acceptance_rate"] > 0.9


@pytest.mark.parametrize(
    "args, message",
    [
        (["--backend", "torch"], "needs --backend onnx"),
        (["--backend", "tensorrt"], "needs --backend onnx"),
        (["--dtype", "float16"], "needs --dtype float32"),
    ],
)
def test_quantize_refuses_what_it_cannot_make(
    tmp_path: Path, capsys: pytest.CaptureFixture, args: list[str], message: str
) -> None:
    out = tmp_path / "deploy"
    assert export_main(["--target", "tiny-random:num_layers=1", "--quantize", "int4", "--out", str(out), *args]) == 2
    assert message in capsys.readouterr().err and not out.exists()


# -- lossless sampling on a quantized target -----------------------------------------------------------


class GraphLaw:
    """``exact_joint``'s model interface over a graph: the logits of every context from the graph itself."""

    def __init__(self, backend: OrtBackend) -> None:
        self.backend = backend

    def to_hf(self) -> GraphLaw:
        return self

    def __call__(self, ids: torch.Tensor) -> SimpleNamespace:
        cache = self.backend.allocate_cache(len(ids), ids.shape[1])
        logits = self.backend.step(pack([SeqWork(i, 0, row.tolist()) for i, row in enumerate(ids)]), cache)
        return SimpleNamespace(logits=logits.reshape(len(ids), ids.shape[1], -1))  # numpy: exact_joint takes both


@pytest.mark.statistical
@pytest.mark.parametrize("mode", ["int4", "w8a8"])
def test_ems_sampling_on_a_quantized_target_is_lossless(tmp_path: Path, one_thread: None, mode: str) -> None:
    """The int4 and w8a8 graphs of test_lossless_sampling's target (int8 activations as shipped) as the target:
    its own law, enumerated through the graph, is what ems samples with a draft model.

    Why the graph's law and not the de-quantized model's: int8 activations move this 32-wide model's law
    by TV ~0.035 from the de-quantized weights' (fp32 activations: ~1e-6), close to what the check resolves.
    """
    target = tiny_random(seed=11, init_std=0.4, name="lossless-target", **LOSSLESS_TINY)
    draft = tiny_random(seed=11, init_std=0.32, name="lossless-draft", **LOSSLESS_TINY)
    graph = export_onnx(target, tmp_path / "model.onnx")
    q.quantize_and_validate(target, graph, mode, tolerance=1e-3)
    backend = OrtBackend(graph)
    law = exact_joint(GraphLaw(backend), PLAIN)
    engine = Engine(
        backend,
        make_drafter("model", model=TorchBackend(draft), max_batch=MAX_BATCH, max_len=32),
        config=EngineConfig(max_batch=MAX_BATCH, max_len=32, num_draft_tokens=2),
    )
    requests = [
        Request(PROMPT, max_tokens=NUM_TOKENS, sampling=SamplingParams(1.0, seed=7 * 10**6 + i))
        for i in range(NUM_SAMPLES)
    ]
    start = time.perf_counter()
    outputs = engine.generate(requests, "ems").outputs
    drafted = sum(o.metrics.draft_tokens for o in outputs)
    acceptance = sum(o.metrics.accepted_draft_tokens for o in outputs) / max(drafted, 1)
    print(f"ems on the {mode} graph: {time.perf_counter() - start:.1f} s, acceptance {acceptance:.3f}")
    assert 0.3 < acceptance < 0.95  # both acceptance and rejection occur thousands of times
    counts = Counter(tuple(o.token_ids[:NUM_TOKENS]) for o in outputs)
    assert_lossless(counts, law, f"ems on {mode} graph T=1")
    if mode != "int4":
        return
    # the check tells the laws apart: int4 moves this target's law far (TV ~0.45), and the samples reject it
    fp32_law = exact_joint(target, PLAIN)
    for keep, axis in ((slice(0, 3), 3), (slice(1, 4), 0)):
        marginal = marginal_counts(counts, keep)
        tv, bound = total_variation(marginal, fp32_law.sum(axis=axis))
        assert chi_square_pvalue(marginal, fp32_law.sum(axis=axis)) < 1e-12 and tv > 2 * bound

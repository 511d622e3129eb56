"""``--quantize`` from a block-quantized GGUF: the graph holds the file's own blocks, bit for bit, in the loaded order.

Checked against ``gguf.quants.dequantize`` on a tiny GGUF written here (every converted block type,
Q4_1 on the RoPE-permuted q/k, mixed inside fused weights) and on the real SmolLM2 file, and by
decoding: a graph with Q4_1 offsets stays batch invariant, and greedy ``ems`` equals ``ar`` on the
real int4 graph.
"""

from __future__ import annotations

import json
import random
from collections import Counter
from pathlib import Path

import gguf
import numpy as np
import onnx
import pytest
from fakes import small_tokenizer
from invariance import MAX_LEN, differing_positions, one_token_per_step, random_steps, sequences_to_the_end

from specdec.export.onnx import export_onnx
from specdec.export.quantization.blocks import QuantizeError
from specdec.export.quantization.nbits import CHECK_LEVEL, embedding_weights, graph_weights, set_accuracy_level
from specdec.export.quantization.sources import EMBEDDING, source_blocks
from specdec.export.quantization.strategies import strategy_for
from specdec.export.quantize import quantize_export
from specdec.export.validate import max_logit_error
from specdec.models import gguf_blocks
from specdec.models.loading import LoadedModel, load_model, tiny_random
from specdec.runtime.backends.onnx_edit import MS_DOMAIN, GraphEditor
from specdec.runtime.backends.onnxruntime import OrtBackend
from specdec.runtime.backends.torch_backend import TorchBackend
from specdec.runtime.config import EngineConfig
from specdec.runtime.drafters import make_drafter
from specdec.runtime.engine import Engine

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
    for name, (weight, runs, source) in graph_weights(graph).items():
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
    first, again = source_blocks(converted, 4), source_blocks(cached, 4)
    assert {n: b.source for n, b in again.items()} == {n: b.source for n, b in first.items()}
    assert all(np.array_equal(first[n].codes, again[n].codes) for n in first)
    assert Counter(b.source for b in first.values()) == Counter({"Q4_1": 8, "Q4_0": 4, "Q8_0": 3})


def _nbits_attributes(graph: Path) -> list[dict]:
    """The attributes of each MatMulNBits node of ``graph``."""
    g = GraphEditor(onnx.load(str(graph), load_external_data=False), "read")
    return [g.attrs(n) for n in g.nodes("MatMulNBits", MS_DOMAIN)]


def test_tiny_gguf_graph_holds_the_files_own_blocks(tiny_gguf: Path, gguf_cache: Path) -> None:
    model = load_model(tiny_gguf)
    assert model.extra[gguf_blocks.GGUF_PATH] == str(tiny_gguf) and model.config.tie_word_embeddings
    graph = export_onnx(model, gguf_cache / "g" / "model.onnx")
    # at int8 activations (the default) every tensor is quantized, the Q8_0 ones in 8 bits (fp32 activations keep
    # those fp32: below)
    reference, summary = quantize_export(model, graph, strategy_for("int4"))
    # per layer: q|k|v and gate|up mix Q4_1 and Q4_0, o is Q8_0, down Q4_1; and the Q8_0 head
    assert summary["formats"] == {"Q4_0+Q4_1": 4, "Q4_1": 2, "Q8_0": 3}
    bits = assert_graph_reproduces_gguf(graph, tiny_gguf, model)
    assert bits["Q8_0"] == 3  # o_proj of both layers and the head: Q8_0 stays 8-bit under int4
    assert sorted(a["bits"] for a in _nbits_attributes(graph)) == [4, 4, 4, 4, 4, 4, 8, 8, 8]
    # no second rounding: at fp32 activations the graph computes the loaded (= de-quantized GGUF) model itself
    set_accuracy_level(graph, CHECK_LEVEL)

    assert max_logit_error(TorchBackend(model), OrtBackend(graph)) < 1e-4
    assert max_logit_error(TorchBackend(reference), OrtBackend(graph)) < 1e-4


def test_quantize_from_fp32_rounds_a_gguf_again_one_node_per_linear(tiny_gguf: Path, gguf_cache: Path) -> None:
    """``--quantize-from fp32``: the fp32 weights rounded to nearest (ONNX Runtime GenAI's builder's scheme), so no
    Q4_1 offsets run beside any MatMulNBits: every linear is the op alone, and the manifest says where the weights
    came from."""
    model = load_model(tiny_gguf)
    graph = export_onnx(model, gguf_cache / "rtn" / "model.onnx")
    _, summary = quantize_export(model, graph, strategy_for("int4", source="fp32"))
    assert summary["quantize_from"] == "fp32" and set(summary["formats"]) == {"rtn"}
    ops = Counter(node.op_type for node in onnx.load(str(graph), load_external_data=False).graph.node)
    assert ops["MatMulNBits"] == len(_nbits_attributes(graph)) > 0 and not ops["Gemm"] and not ops["ReduceSum"]
    assert max_logit_error(TorchBackend(model), OrtBackend(graph)) > 0  # a second rounding: not the GGUF's values


def test_calibrated_rounding_in_blocks_of_64_is_one_node_per_linear(tiny_gguf: Path, gguf_cache: Path) -> None:
    """``--quantize-from calibrated --quantize-block-size 64``: every decoder-layer linear in blocks of 64 rounded for
    the calibration prompts' inputs, the tied head (and the table gathered from it) in blocks of 32, recorded in the
    manifest's summary, and the graph computes the blocks it holds; a GGUF's own blocks are 32 wide, so asking for
    them in 64 is refused, naming the way out."""
    model = load_model(tiny_gguf)
    graph = export_onnx(model, gguf_cache / "calibrated" / "model.onnx")
    reference, summary = quantize_export(model, graph, strategy_for("int4", source="calibrated", block_size=64))
    assert summary["quantize_from"] == "calibrated" and set(summary["formats"]) == {"calibrated"}
    assert summary["block_size"] == [32, 64] and summary["embedding"] == "4-bit calibrated"
    sizes = {a["N"]: a["block_size"] for a in _nbits_attributes(graph)}
    assert sizes.pop(model.config.vocab_size) == 32 and set(sizes.values()) == {64}
    set_accuracy_level(graph, CHECK_LEVEL)
    assert max_logit_error(TorchBackend(reference), OrtBackend(graph)) < 1e-4
    own = export_onnx(model, gguf_cache / "own64" / "model.onnx")
    with pytest.raises(QuantizeError, match="--quantize-from fp32 or calibrated"):
        quantize_export(model, own, strategy_for("int4", block_size=64))


def test_at_fp32_activations_wider_source_tensors_stay_fp32(tiny_gguf: Path, gguf_cache: Path) -> None:
    """fp32 activations: the Q8_0 tensors, which MLAS would run 8-bit without an fp32-activation kernel, stay fp32
    Gemms; the 4-bit ones are MatMulNBits holding the file's own blocks."""
    model = load_model(tiny_gguf)
    graph = export_onnx(model, gguf_cache / "exact" / "model.onnx")
    _, summary = quantize_export(model, graph, strategy_for("int4", "fp32"))
    assert summary["fp32_tensors"] == [
        "model.embed_tokens.weight",
        "model.layers.0.self_attn.o_proj.weight",
        "model.layers.1.self_attn.o_proj.weight",
    ]
    nbits = _nbits_attributes(graph)
    assert [a["bits"] for a in nbits] == [4] * 6 and all(a["accuracy_level"] == 0 for a in nbits)
    # the head stays an fp32 Gemm, but the table is gathered from the file's Q8_0 blocks: the same values
    assert summary["embedding"] == "8-bit Q8_0"
    table, source = embedding_weights(graph)
    want, kind = gguf_dequantized(tiny_gguf, model.config)[EMBEDDING]
    assert source == kind == "Q8_0" and np.array_equal(table, want)
    assert np.array_equal(table, model.state_dict[EMBEDDING].numpy())
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
    with pytest.raises(QuantizeError, match=r"k_proj.*do not reproduce the loaded weights"):
        source_blocks(model, 4)


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
    _, summary = quantize_export(model, graph, strategy_for("int4"))
    assert summary["formats"]["Q4_1"] == 2 and summary["fp32_tensors"] == []
    backend = OrtBackend(graph)
    sequences = sequences_to_the_end(random.Random(3), backend.vocab_size, (MAX_LEN, 11))
    assert (
        differing_positions(one_token_per_step(backend, sequences), random_steps(backend, sequences, random.Random(4)))
        == []
    )

"""A row's logits do not depend on the step it is in: bit for bit, on the ONNX Runtime lowering of quantized graphs.

Why this is the exactness argument of the quantized exports: greedy ``ems`` equals greedy ``ar`` if
every verified row gets the logits a one-row ``ar`` step gives it, and a request's sampled output
does not depend on its batch neighbours if nothing else in the step touches its rows. With
``MatMulNBits`` at int8 activations (row-independent in MLAS) and the fused attention's discarded
second query row for one-row sequences (``ort_fuse``: GQA then never takes MLAS's one-row GEMM
path), a row's logits are a function of its own token and its own cached prefix only. These tests
decode the same token sequences twice, one token per step alone and in random ragged steps beside
other sequences, prefills and forests, and compare every position's logits bitwise.

The negative control (fp32 activations, where MLAS runs one row through a GEMV and several through
a de-quantized GEMM) shows the comparison sees a difference of one rounding.
"""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from invariance import MAX_LEN, differing_positions, one_token_per_step, random_steps, sequences_to_the_end

from specdec.export.onnx import export_onnx
from specdec.export.quantization.blocks import quantize_rtn
from specdec.export.quantization.nbits import INT8_ACTIVATIONS, matmul_nbits
from specdec.export.quantization.rewrite import one_linear
from specdec.export.quantization.strategies import W8A8, strategy_for
from specdec.export.quantize import quantize_and_validate
from specdec.models.loading import tiny_random
from specdec.runtime.backends.onnxruntime import OrtBackend, evened
from specdec.runtime.packed import ROOT, SeqWork, pack

STRATEGIES = {
    "int4": strategy_for("int4"),
    "int8": strategy_for("int8"),
    "w8a8": strategy_for("w8a8"),
    "w8a8 integer head": W8A8(integer_head=True),
    # blocks wider than 32: MLAS multiplies a lone row otherwise, the backend's row floor keeps the graph invariant
    "int4 calibrated blocks of 128": strategy_for("int4", source="calibrated", block_size=128),
}


@pytest.fixture(scope="module", params=list(STRATEGIES))
def quantized_graph(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    model = tiny_random(seed=9, num_layers=2, vocab_size=160)
    graph = export_onnx(model, tmp_path_factory.mktemp(request.param.replace(" ", "-")) / "model.onnx")
    quantize_and_validate(model, graph, STRATEGIES[request.param], tolerance=1e-4)  # shipped: int8 activations
    return graph


@pytest.mark.parametrize("cache_dtype", [None, "float16"])
def test_every_row_of_a_quantized_graph_is_bitwise_the_same_in_any_step(
    quantized_graph: Path, cache_dtype: str | None
) -> None:
    """Also with fp16 caches (``ort_cache_dtype``): casts around the attention are elementwise."""
    backend = OrtBackend(quantized_graph, cache_dtype=cache_dtype)
    assert backend.fuse_report is not None and backend.fuse_report.attention  # the fused lowering is what runs
    rng = random.Random(0)
    sequences = sequences_to_the_end(rng, 160)
    want = one_token_per_step(backend, sequences)
    for trial in range(3):
        got = random_steps(backend, sequences, random.Random(trial))
        assert differing_positions(want, got) == []
    assert backend.unfused_steps == 0


@pytest.mark.parametrize("cache_dtype", [None, "float16"])
def test_long_odd_chunks_are_bitwise_the_same_as_one_token_per_step(
    quantized_graph: Path, cache_dtype: str | None
) -> None:
    """GQA runs a slot's rows in blocks of 128: a chunk of 129 or 257 rows ends in a one-row block, which took
    MLAS's one-row path until odd row counts got a discarded copy row (ort_fuse). Prompts prefilled in such
    chunks, beside a decode row, equal the same tokens decoded one per step, at every position."""
    backend = OrtBackend(quantized_graph, cache_dtype=cache_dtype)
    rng = random.Random(7)
    tokens = [rng.randrange(160) for _ in range(300)]
    cache = backend.allocate_cache(2, 320)
    want = np.stack([backend.step(pack([SeqWork(0, i, [t])]), cache)[0] for i, t in enumerate(tokens)])
    chunked, done = [], 0
    for n in (129, 1, 129, 41):
        rows = backend.step(pack([SeqWork(1, 0, [7], logits="none"), SeqWork(0, done, tokens[done : done + n])]), cache)
        chunked.extend(rows)
        done += n
    assert np.array_equal(np.stack(chunked), want)
    whole = backend.step(pack([SeqWork(0, 0, tokens[:257])]), cache)
    assert np.array_equal(whole, want[:257])


@pytest.mark.parametrize("cache_dtype", [None, "float16"])
def test_a_forest_gets_the_same_logits_beside_any_other_work(quantized_graph: Path, cache_dtype: str | None) -> None:
    """DSBD verifies forests: a forest's rows depend on its own slot only, not on what else shares the step."""
    backend = OrtBackend(quantized_graph, cache_dtype=cache_dtype)
    rng = random.Random(1)
    prefix = [rng.randrange(160) for _ in range(12)]
    forest = SeqWork(0, len(prefix), [rng.randrange(160) for _ in range(6)], parents=[ROOT, 0, 0, 1, ROOT, 4])

    def forest_logits(others: list[SeqWork]) -> np.ndarray:
        cache = backend.allocate_cache(4, MAX_LEN)
        backend.step(pack([SeqWork(0, 0, prefix, logits="none")]), cache)
        for w in others:  # the others' own prefixes
            backend.step(pack([SeqWork(w.slot_id, 0, [1] * w.past_len, logits="none")]), cache)
        return backend.step(pack([forest, *others]), cache)[: len(forest.token_ids)]

    alone = forest_logits([])
    for others in ([SeqWork(2, 5, [7])], [SeqWork(1, 20, [3, 4, 5, 6, 7, 8, 9, 10, 11]), SeqWork(3, 2, [9])]):
        assert np.array_equal(forest_logits(others), alone)


def test_wide_blocks_run_every_step_on_an_even_row_count(tmp_path: Path) -> None:
    """The row floor: a graph of blocks wider than 32 runs an odd step with one more row (the last token again, one
    position on, its logits not returned); blocks of 32 and a draft's backend run it as it is. What the floor rests
    on, on ONNX Runtime's own kernel: MLAS multiplies such rows in pairs, every row of a pair alike whatever its
    partner, and an odd last row alone, which rounds differently."""
    model = tiny_random(seed=9, num_layers=2, vocab_size=160)
    wide = export_onnx(model, tmp_path / "wide" / "model.onnx")
    quantize_and_validate(model, wide, strategy_for("int4", source="fp32", block_size=64), tolerance=1e-4)
    narrow = export_onnx(model, tmp_path / "narrow" / "model.onnx")
    quantize_and_validate(model, narrow, strategy_for("int4", source="fp32"), tolerance=1e-4)
    assert OrtBackend(wide).even_rows and not OrtBackend(narrow).even_rows
    assert not OrtBackend(wide, row_floor=False).even_rows
    step = pack([SeqWork(1, 4, [7, 8]), SeqWork(3, 9, [40, 41, 42], parents=[ROOT, 0, 0])])
    odd = evened(step)
    assert odd.input_ids.tolist() == [7, 8, 40, 41, 42, 42] and odd.position_ids.tolist() == [4, 5, 9, 10, 10, 11]
    assert odd.cu_seqlens.tolist() == [0, 2, 6] and np.array_equal(odd.logits_indices, step.logits_indices)
    assert odd.tree_mask[-1].tolist() == [True, False, True, True] and odd.tree_mask[:-1, :3].tolist() == (
        step.tree_mask.tolist()
    )
    backend = OrtBackend(wide)
    cache = backend.allocate_cache(1, 8)
    for position in range(8):  # to the context's last position: the extra row lands in the spare one
        assert backend.step(pack([SeqWork(0, position, [position + 1])]), cache).shape == (1, backend.head_size)

    weight = np.random.default_rng(0).standard_normal((256, 576)).astype(np.float32)
    x = np.random.default_rng(1).standard_normal((40, 576)).astype(np.float32)
    for size in (32, 64, 128):
        block = quantize_rtn(weight, 4, size)
        linear = one_linear(576, 256, lambda g, node, b=block: matmul_nbits(g, node, b, [], INT8_ACTIVATIONS))
        session = ort.InferenceSession(linear.SerializeToString(), providers=["CPUExecutionProvider"])
        paired = np.stack([session.run(None, {"x": x[[r, r]]})[0][0] for r in range(len(x))])
        for rows in (2, 4, 6, 16, 40):
            assert np.array_equal(session.run(None, {"x": x[:rows]})[0], paired[:rows]), (size, rows)


def test_fp32_activations_are_not_batch_invariant(tmp_path: Path) -> None:
    """The negative control: at fp32 activations one row and several rows take different MLAS kernels, and the
    comparison above sees it."""
    model = tiny_random(seed=9, num_layers=2, vocab_size=160)
    graph = export_onnx(model, tmp_path / "model.onnx")
    quantize_and_validate(model, graph, strategy_for("int4", "fp32"), tolerance=1e-4)
    backend = OrtBackend(graph)
    rng = random.Random(0)
    sequences = sequences_to_the_end(rng, 160)
    want = one_token_per_step(backend, sequences)
    got = random_steps(backend, sequences, random.Random(0))
    assert differing_positions(want, got)
    assert max(float(np.abs(w - g).max()) for w, g in zip(want, got)) < 1e-3  # a rounding, not a bug


@pytest.mark.real_model
@pytest.mark.parametrize(
    ("graph", "cache_dtype"), [("fp32", None), ("int4", None), ("int4", "float16"), ("w8a8", "float16")]
)
def test_real_smollm2_rows_are_bitwise_the_same_in_any_step(
    graph: str, cache_dtype: str | None, request: pytest.FixtureRequest
) -> None:
    """The same on the real SmolLM2 graphs: the fp32 export (its linear layers are prepacked Gemms, row-independent
    too), the int4 one (the GGUF's Q4_1 blocks with their offset corrections and the Q8_0 head, int8
    activations), the latter also with the fp16 caches a quantized export ships, and the w8a8 one (integer GEMMs
    over per-token activation codes)."""
    path = (
        request.getfixturevalue("smollm2_export") / "target" / "model.onnx"
        if graph == "fp32"
        else request.getfixturevalue(f"smollm2_{graph}_graph")
    )
    backend = OrtBackend(path, cache_dtype=cache_dtype)
    sequences = sequences_to_the_end(random.Random(2), backend.vocab_size, (MAX_LEN, 21, 6))
    want = one_token_per_step(backend, sequences)
    got = random_steps(backend, sequences, random.Random(5))
    assert differing_positions(want, got) == []

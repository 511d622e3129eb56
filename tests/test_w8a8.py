"""``--quantize w8a8``: the integer chain, its smoothing, its calibration and its check (``quantization.w8a8``).

The graph-level properties (greedy ems = ar, row independence in any step, the manifest) run with
the other quantized exports in ``test_quantize.py`` and ``test_batch_invariance.py``.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from specdec.export.cli import main as export_main
from specdec.export.quantization import calibration, w8a8
from specdec.export.quantization.rewrite import one_linear
from specdec.export.quantization.sources import ROWS_KEY
from specdec.models.loading import tiny_random
from specdec.runtime.backends import onnxruntime as ort_backend
from specdec.runtime.backends.onnx_edit import GraphEditor

K, N = 96, 40


def _chain_session(linear: w8a8.IntegerLinear) -> ort.InferenceSession:
    """One Gemm ``y = x @ W^T`` rewritten as a chain over rows ``x [T, K]``."""
    model = one_linear(K, N, lambda g, node: w8a8.integer_chain(g, node, linear, {}, rows="x"))
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def _run(session: ort.InferenceSession, x: np.ndarray) -> np.ndarray:
    return session.run(None, {"x": x})[0]


@pytest.fixture(scope="module")
def linear_case() -> tuple[np.ndarray, np.ndarray, w8a8.IntegerLinear]:
    rng = np.random.default_rng(3)
    weight = rng.standard_normal((N, K)).astype(np.float32)
    x = rng.standard_normal((9, K)).astype(np.float32)
    x[:, 5] *= 40  # an outlier input channel, as LLM activations have
    maxima = np.abs(x).max(axis=0)
    return weight, x, w8a8.quantize_linear(weight, w8a8.smoothing(maxima, weight))


def test_the_chain_is_the_integer_product_of_each_rows_own_codes(linear_case) -> None:
    weight, x, linear = linear_case
    got = _run(_chain_session(linear), x)
    xs = x * linear.unsmooth
    row_scale = np.maximum(np.abs(xs).max(axis=1) * np.float32(1 / 127), np.float32(1e-30))
    codes = np.clip(np.rint(xs / row_scale[:, None]), -127, 127).astype(np.int64)
    want = (codes @ linear.codes.astype(np.int64)).astype(np.float32) * row_scale[:, None] * linear.scales[None, :]
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    # and it is the linear layer, up to the rounding of 8-bit activations and weights
    exact = x @ weight.T
    assert np.abs(got - exact).max() < 0.03 * np.abs(exact).max()


def test_a_rows_output_does_not_depend_on_the_rows_beside_it(linear_case) -> None:
    _, x, linear = linear_case
    session = _chain_session(linear)
    together = _run(session, x)
    alone = np.concatenate([_run(session, x[i : i + 1]) for i in range(len(x))])
    assert np.array_equal(together, alone)
    reordered = _run(session, x[::-1].copy())[::-1]
    assert np.array_equal(together, reordered)


def test_an_all_zero_row_gives_zeros_not_nans(linear_case) -> None:
    _, x, linear = linear_case
    rows = x.copy()
    rows[2] = 0
    out = _run(_chain_session(linear), rows)
    assert np.array_equal(out[2], np.zeros(N, np.float32)) and np.isfinite(out).all()


def test_smoothing_is_exact_in_real_arithmetic_and_balances_the_ranges(linear_case) -> None:
    weight, x, linear = linear_case
    maxima = np.abs(x).max(axis=0)
    s = w8a8.smoothing(maxima, weight)
    wmax, a = np.abs(weight).max(axis=0), w8a8.SMOOTH_ALPHA
    np.testing.assert_allclose(s, maxima**a / wmax ** (1 - a), rtol=1e-5)
    # the ranges after smoothing: (max|x_k| / s_k) / (max|W_k| s_k) = (max|x_k| max|W_k|)^(1 - 2a)
    np.testing.assert_allclose((maxima / s) / (wmax * s), (maxima * wmax) ** (1 - 2 * a), rtol=1e-4)
    # at alpha 0.5 a channel's largest input and its largest weight become equal: the outlier is shared
    half = w8a8.smoothing(maxima, weight, alpha=0.5)
    np.testing.assert_allclose(maxima / half, np.abs(weight * half).max(axis=0), rtol=1e-5)
    # the effective weight is the original one, rounded per output channel to half a step at most
    step = np.abs(weight * s).max(axis=1) / 127
    assert (np.abs(linear.effective() - weight) * s[None, :] <= step[:, None] / 2 * (1 + 1e-5)).all()


def test_smoothing_survives_a_channel_never_seen_and_a_zero_column() -> None:
    weight = np.ones((4, 3), np.float32)
    weight[:, 1] = 0
    s = w8a8.smoothing(np.array([2.0, 0.0, 0.0], np.float32), weight)
    assert np.isfinite(s).all() and (s > 0).all()


def test_calibration_without_a_tokenizer_is_seeded_ids_in_the_vocabulary() -> None:
    first, again = calibration.calibration_ids(None, 50), calibration.calibration_ids(None, 50)
    assert first == again and len(first) == calibration.CALIBRATION_PROMPTS
    assert all(0 <= i < 50 for ids in first for i in ids)


def test_calibration_uses_the_chat_template_of_the_tokenizer() -> None:
    seen = []

    def template(messages, add_generation_prompt, tokenize):
        seen.append(messages[0]["content"])
        return {"input_ids": [1, 2, len(seen)]}

    tokenizer = SimpleNamespace(chat_template="x", apply_chat_template=template)
    ids = calibration.calibration_ids(tokenizer, 100, n=3)
    assert ids == [[1, 2, 1], [1, 2, 2], [1, 2, 3]] and len(set(seen)) == 3


def test_activation_maxima_are_the_largest_input_of_each_channel() -> None:
    model = tiny_random(seed=4, num_layers=1, vocab_size=64)
    names = [f"model.layers.0.{p}.weight" for p in ("self_attn.q_proj", "self_attn.k_proj", "mlp.down_proj")]
    sequences = [[1, 2, 3, 4], [5, 6]]
    maxima = calibration.activation_maxima(model, sequences, names)
    assert np.array_equal(maxima[names[0]], maxima[names[1]])  # q and k read the same normed input
    hidden = model.config.hidden_size
    assert maxima[names[0]].shape == (hidden,) and maxima[names[2]].shape == (model.config.intermediate_size,)
    # one sequence alone sees no more than both
    alone = calibration.activation_maxima(model, sequences[:1], names)
    assert (alone[names[2]] <= maxima[names[2]]).all() and (maxima[names[0]] > 0).all()


def test_the_check_copy_multiplies_by_the_effective_weights(tmp_path: Path) -> None:
    out = tmp_path / "deploy"
    assert (
        export_main(
            [
                "--target",
                "tiny-random:seed=10,num_layers=1",  # test_onnx_backend's draft: exported once per session
                "--quantize",
                "w8a8",
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
    graph = out / "target" / "model.onnx"
    shipped = onnx.load(str(graph))
    weights = w8a8.integer_weights(GraphEditor(shipped, "read"))
    assert len(weights) == 4
    with w8a8.fp32_product_copy(graph, lambda g: None) as checked:
        g = GraphEditor(onnx.load(str(checked)), "read")
        ops = Counter(n.op_type for n in g.graph.node)
        assert ops[w8a8.PRODUCT_OP] == 0 and ops["QuantizeLinear"] == 0 and ops["Gemm"] == 4
        for name, linear in weights.items():
            assert np.array_equal(g.array(f"{name}.effective"), linear.effective())
    assert not checked.exists()


def test_an_integer_head_is_a_chain_over_the_logit_rows(tmp_path: Path) -> None:
    """``W8A8(integer_head=True)``: the LM head a chain too, rounding the rows that need logits (not the step's
    tokens); the table stays gathered from the source's blocks, and the graph checks as tightly as the default."""
    from specdec.export.onnx import export_onnx
    from specdec.export.quantization.strategies import W8A8
    from specdec.export.quantize import quantize_and_validate

    model = tiny_random(seed=9, num_layers=1, vocab_size=96)
    graph = export_onnx(model, tmp_path / "model.onnx")
    info = quantize_and_validate(model, graph, W8A8(integer_head=True), tolerance=1e-4)
    assert info["formats"] == {"w8a8": 5} and info["integer_head"] and info["embedding"] == "8-bit rtn"
    g = GraphEditor(onnx.load(str(graph), load_external_data=False), "read")
    ops = Counter(n.op_type for n in g.graph.node)
    assert ops[w8a8.PRODUCT_OP] == 5 and ops["MatMulNBits"] == 0 and ops["GatherBlockQuantized"] == 1
    quantizers = [n for n in g.graph.node if n.op_type == "QuantizeLinear"]
    head = [n for n in quantizers if n.input[2] == f"{w8a8.TAG}.zero_points.{w8a8.LOGIT_ROWS}"]
    assert len(head) == 1 and len(quantizers) == 5
    shape = g.producer[g.producer[head[0].input[2]].input[0]]
    assert shape.op_type == "Shape" and shape.input[0] == w8a8.LOGIT_ROWS


def test_smoothing_is_folded_into_the_norms_and_the_up_projection(tmp_path: Path) -> None:
    """q|k|v and gate|up read an RMSNorm's output, down reads silu(gate) * up: their ``1 / s`` moves into the norm
    weight and up's channel scales (``fold_smoothing``); o reads the attention output and keeps its multiply. The
    graph still checks tightly against the torch model over the weights it computes."""
    from specdec.export.onnx import export_onnx
    from specdec.export.quantization.strategies import W8A8
    from specdec.export.quantize import quantize_and_validate

    model = tiny_random(seed=9, num_layers=2, vocab_size=96)
    graph = export_onnx(model, tmp_path / "model.onnx")
    info = quantize_and_validate(model, graph, W8A8(), tolerance=1e-4)
    assert info["smoothing_folded"] == 3 * 2  # q|k|v, gate|up, down of each layer
    g = GraphEditor(onnx.load(str(graph)), "read")
    names = {n.name for n in g.graph.node}
    for chain in w8a8.chains(g):
        folded = not chain["nodes"][0].endswith(".x")
        assert folded == ("o_proj" not in chain["meta"][ROWS_KEY])  # only o keeps its multiply
        assert (chain["unsmooth"] is None) == folded  # its 1 / s is in the producer
        assert all(name in names for name in chain["nodes"])  # the metadata names the chain's nodes as they are


def test_w8a8_refuses_fp32_activations(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "deploy"
    assert (
        export_main(
            [
                "--target",
                "tiny-random:num_layers=1",
                "--quantize",
                "w8a8",
                "--quantize-activations",
                "fp32",
                "--out",
                str(out),
            ]
        )
        == 2
    )
    assert "rounds its activations to int8" in capsys.readouterr().err and not out.exists()


@pytest.mark.parametrize(
    ("flags", "want"), [("fpu avx2 avx512_vnni", True), ("fpu avx2 avx_vnni", True), ("fpu avx2", False), (None, None)]
)
def test_vnni_is_read_from_the_cpu_flags(tmp_path: Path, flags: str | None, want: bool | None) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\n" + (f"flags\t\t: {flags}\n" if flags else ""))
    assert ort_backend.has_vnni(str(cpuinfo)) is want


def test_a_w8a8_graph_on_a_cpu_without_vnni_is_warned_about(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("flags\t\t: fpu avx2\n")
    with_integer = SimpleNamespace(graph=SimpleNamespace(node=[SimpleNamespace(op_type=w8a8.PRODUCT_OP)]))
    without = SimpleNamespace(graph=SimpleNamespace(node=[SimpleNamespace(op_type="MatMulNBits")]))
    assert ort_backend._warn_integer_saturation(with_integer, tmp_path / "g.onnx", True, str(cpuinfo))
    assert "no VNNI" in caplog.text
    assert not ort_backend._warn_integer_saturation(without, tmp_path / "g.onnx", True, str(cpuinfo))
    assert not ort_backend._warn_integer_saturation(with_integer, tmp_path / "g.onnx", False, str(cpuinfo))

"""The block format of ``--quantize int4|int8`` as ONNX Runtime's kernels read it (``specdec.export.quantization``).

Packing, round to nearest, the GGUF formats converted bit for bit against ``gguf.quants.dequantize``,
Q4_1's centred offsets, and one linear layer rewritten by the quantizer computing the de-quantized
product in ONNX Runtime's own MatMulNBits kernel (one-node graphs).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import gguf
import numpy as np
import onnxruntime as ort
import pytest

from specdec.export.quantization import blocks as qb
from specdec.export.quantization.nbits import FP32_ACTIVATIONS, INT8_ACTIVATIONS, matmul_nbits
from specdec.export.quantization.rewrite import one_linear

GG = gguf.GGMLQuantizationType


def test_pack_layout_is_the_one_matmul_nbits_reads() -> None:
    codes = np.arange(32, dtype=np.uint8).reshape(1, 1, 32) % 16
    blob = qb.pack_codes(codes, 4)
    assert blob.shape == (1, 1, 16) and blob[0, 0, 0] == 0x10 and blob[0, 0, 1] == 0x32  # element 2i low, 2i+1 high
    zps = np.array([[1, 2, 3]], dtype=np.uint8)  # an odd block count: the row's last byte is half used
    assert qb.pack_zero_points(zps, 4).tolist() == [[0x21, 0x03]]
    assert np.array_equal(qb.pack_codes(codes, 8), codes) and np.array_equal(qb.pack_zero_points(zps, 8), zps)


@pytest.mark.parametrize("bits", [4, 8])
def test_quantize_pack_unpack_dequantize_round_trips(bits: int) -> None:
    rng = np.random.default_rng(bits)
    weight = (rng.standard_normal((24, 100)) * 0.05 + 0.01).astype(np.float32)  # K = 100: a padded last block
    block = qb.quantize_rtn(weight, bits)
    k_blocks = block.scales.shape[1]
    assert block.codes.shape == (24, 4, 32) and int(block.codes.max()) < 2**bits
    codes = qb.unpack_codes(qb.pack_codes(block.codes, bits), bits)
    assert np.array_equal(codes, block.codes)
    zps = block.zero_points
    if zps is not None:
        assert np.array_equal(qb.unpack_zero_points(qb.pack_zero_points(zps, bits), bits, k_blocks), zps)
    again = qb.BlockQuant(bits, codes, block.scales, zps, None, 100, "rtn").dequantize()
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
    block = qb.from_gguf_blocks(kind, raw, 96)
    want = gguf.quants.dequantize(raw, GG[kind])
    assert np.array_equal(block.dequantize(), want)
    assert np.array_equal(block.widened(8).dequantize(), want)  # 4-bit codes held exactly in 8 bits
    assert block.bits == (8 if kind == "Q8_0" else 4)


def test_q4_1_offsets_are_centred_exactly() -> None:
    """Each Q4_1 block takes the zero point that makes its offset smallest, and the weights do not change."""
    rng = np.random.default_rng(11)
    weight = (rng.standard_normal((16, 256)) * 0.05 + rng.normal(0, 0.03, (16, 1))).astype(np.float32)
    raw = gguf.quants.quantize(weight, GG["Q4_1"])
    block = qb.from_gguf_blocks("Q4_1", raw, 256)
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
    zero_points, offsets = qb.centred_offsets(d, m, 15)
    assert zero_points.tolist() == [[0], [6]]  # the second block centres exactly: -3 + 6 * 0.5 = 0
    assert offsets.tolist() == [[-1024.0], [0.0]]


def test_centred_q4_1_blocks_round_the_inputs_less() -> None:
    """At int8 activations, the Q4_1 product with centred offsets is closer to the exact one than with raw
    codes 0..15 and the whole offset in the correction (the reason for ``centred_offsets``)."""
    rng = np.random.default_rng(5)
    weight = (rng.standard_normal((96, 576)) * 0.05).astype(np.float32)
    block = qb.from_gguf_blocks("Q4_1", gguf.quants.quantize(weight, GG["Q4_1"]), 576)
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
        name: float(np.abs(_one_linear(b, None, INT8_ACTIVATIONS).run(None, {"x": x})[0] - want).mean())
        for name, b in (("centred", block), ("raw", raw_codes))
    }
    assert errors["centred"] < 0.5 * errors["raw"], errors


def _one_linear(block: qb.BlockQuant, bias: np.ndarray | None, level: int) -> Any:
    """A session of one Gemm rewritten by the quantizer (x [T, K] -> y [T, N])."""
    model = one_linear(block.columns, block.rows, lambda g, node: matmul_nbits(g, node, block, [], level), bias)
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("kind", ["rtn4", "rtn8", "Q4_0", "Q4_1", "Q8_0"])
def test_onnx_runtime_kernel_computes_the_dequantized_product(kind: str) -> None:
    """The packed blocks (nibble order, zero points, Q4_1 offsets, bias) as ORT's MatMulNBits reads them."""
    rng = np.random.default_rng(3)
    columns = 100 if kind.startswith("rtn") else 160  # a padded last block; 5 blocks: odd zero-point rows
    weight = (rng.standard_normal((40, columns)) * 0.05 + 0.01).astype(np.float32)
    if kind.startswith("rtn"):
        block = qb.quantize_rtn(weight, int(kind[3:]))
    else:
        block = qb.from_gguf_blocks(kind, gguf.quants.quantize(weight, GG[kind]), columns)
    bias = rng.standard_normal(40).astype(np.float32)
    x = rng.standard_normal((7, columns)).astype(np.float32)
    want = x.astype(np.float64) @ block.dequantize().T.astype(np.float64) + bias
    got = _one_linear(block, bias, FP32_ACTIVATIONS).run(None, {"x": x})[0]
    assert np.abs(got - want).max() < 1e-5 * np.abs(want).max()
    # int8 activations round the input: close, not exact (the shipped level; its cost is measured, not asserted)
    coarse = _one_linear(block, bias, INT8_ACTIVATIONS).run(None, {"x": x})[0]
    assert np.abs(coarse - want).max() < 0.05 * np.abs(want).max()

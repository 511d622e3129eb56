"""Weight blocks in the form ONNX Runtime's ``MatMulNBits`` and ``GatherBlockQuantized`` read them.

One representation (``BlockQuant``, blocks along K, ``w = scale * (code - zero_point) + offset``)
for every source, with the packing both ops share (two 4-bit codes per byte, low nibble first).
Formats, and why:

* a generic source (a Hugging Face directory, tiny-random): round to nearest. int4 is asymmetric
  (the block's range, widened to hold 0, in 16 steps; an integer uint8 zero point), which gives a
  skewed block its full 16 levels. int8 is symmetric (``scale = max|w| / 127``, the op's default zero
  point 128, no zero-point tensor): at 8 bits an asymmetric range gains under one bit on skewed
  blocks, and it is Q8_0's own format, so RTN int8 and a GGUF Q8_0 tensor are one layout.
* a block-quantized GGUF (Q4_0 / Q4_1 / Q8_0): the file's own blocks, converted bit for bit, no
  second rounding: Q4_0 ``w = d*(q-8)`` is 4-bit with the default zero point 8; Q8_0 ``w = d*q`` is
  8-bit with ``q+128`` and the default 128; Q4_1 ``w = d*q + m`` is 4-bit as ``d*(q - z) + m'``, a
  per-block integer zero point z and offsets ``m' = m + z*d`` that the graph adds beside the op
  (``nbits``); z makes ``m'`` as small as it can be exactly in fp32 (``centred_offsets``). A tensor
  keeps its source's bits when those are more than asked (``widened``: fewer bits are held exactly
  in 8-bit codes).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

#: the block a GGUF file's Q4_0 / Q4_1 / Q8_0 tensors come in, and the default of round to nearest
BLOCK_SIZE = 32
#: the blocks round to nearest may make: MatMulNBits takes a power of two from 16 (ONNX Runtime's contrib op schema)
BLOCK_SIZES = (16, 32, 64, 128, 256)
#: GGUF block types converted exactly, with their bits
GGUF_BITS = {"Q4_0": 4, "Q4_1": 4, "Q8_0": 8}


class QuantizeError(ValueError):
    """A graph or source cannot be quantized as asked; the message says which weight and why."""


@dataclass(frozen=True)
class BlockQuant:
    """A weight ``[N, K]`` in MatMulNBits form: ``w = scale * (code - zero_point) + offset`` per block.

    ``codes`` are unpacked (one uint8 per weight, ``[N, k_blocks, block_size]``, zero-padded past K);
    ``zero_points`` None means the op's default ``2**(bits-1)``; ``offsets`` (GGUF Q4_1's ``m``) None
    means 0. ``source`` names the format the values came from (``rtn`` or a GGUF type).
    """

    bits: int
    codes: np.ndarray
    scales: np.ndarray
    zero_points: np.ndarray | None
    offsets: np.ndarray | None
    columns: int
    source: str

    @property
    def rows(self) -> int:
        return int(self.codes.shape[0])

    @property
    def block_size(self) -> int:
        """Weights per block along K (the codes' last axis)."""
        return int(self.codes.shape[-1])

    def zero_point_values(self) -> np.ndarray:
        """The zero points as uint8 ``[N, k_blocks]``, the default filled in."""
        if self.zero_points is not None:
            return self.zero_points
        return np.full(self.scales.shape, 1 << (self.bits - 1), dtype=np.uint8)

    def dequantize(self) -> np.ndarray:
        """The fp32 weight ``[N, K]``, in the arithmetic of ``gguf.quants.dequantize`` (bit-exact to it)."""
        centred = self.codes.astype(np.float32) - self.zero_point_values().astype(np.float32)[..., None]
        w = self.scales[..., None] * centred
        if self.offsets is not None:
            w = w + self.offsets[..., None]
        return w.reshape(self.rows, -1)[:, : self.columns]

    def take(self, start: int, stop: int) -> BlockQuant:
        """Rows ``start:stop``."""

        def cut(a: np.ndarray | None) -> np.ndarray | None:
            return None if a is None else a[start:stop]

        return replace(
            self,
            codes=self.codes[start:stop],
            scales=self.scales[start:stop],
            zero_points=cut(self.zero_points),
            offsets=cut(self.offsets),
        )

    def widened(self, bits: int) -> BlockQuant:
        """The same values in ``bits >= self.bits`` (exact: codes re-centred on the wider default zero point)."""
        if bits == self.bits:
            return self
        shift = (1 << (bits - 1)) - self.zero_point_values().astype(np.int32)[..., None]
        codes = (self.codes.astype(np.int32) + shift).astype(np.uint8)
        return replace(self, bits=bits, codes=codes, zero_points=None)


def concat_rows(parts: Sequence[BlockQuant]) -> BlockQuant:
    """One weight from row blocks (q|k|v, gate|up), widened to the parts' largest bits, exactly."""
    bits = max(p.bits for p in parts)
    parts = [p.widened(bits) for p in parts]
    if len({p.columns for p in parts}) != 1 or len({p.block_size for p in parts}) != 1:
        raise QuantizeError("row blocks of one weight must have the same number of columns and block size")
    zps = None if all(p.zero_points is None for p in parts) else np.concatenate([p.zero_point_values() for p in parts])
    offsets = None
    if any(p.offsets is not None for p in parts):
        offsets = np.concatenate([p.offsets if p.offsets is not None else np.zeros_like(p.scales) for p in parts])
    sources = sorted({p.source for p in parts})
    return BlockQuant(
        bits,
        np.concatenate([p.codes for p in parts]),
        np.concatenate([p.scales for p in parts]),
        zps,
        offsets,
        parts[0].columns,
        "+".join(sources),
    )


def pack_codes(codes: np.ndarray, bits: int) -> np.ndarray:
    """MatMulNBits' ``B`` blob ``[N, k_blocks, block_size*bits/8]``: 4-bit puts element 2i in byte i's low nibble,
    2i+1 in its high one."""
    codes = codes.astype(np.uint8)
    if bits == 8:
        return codes
    if bits != 4:
        raise QuantizeError(f"bits must be 4 or 8, got {bits}")
    return codes[..., 0::2] | (codes[..., 1::2] << np.uint8(4))


def unpack_codes(blob: np.ndarray, bits: int) -> np.ndarray:
    """Inverse of ``pack_codes``: one uint8 code per weight."""
    if bits == 8:
        return blob.astype(np.uint8)
    out = np.empty((*blob.shape[:-1], 2 * blob.shape[-1]), dtype=np.uint8)
    out[..., 0::2] = blob & np.uint8(0x0F)
    out[..., 1::2] = blob >> np.uint8(4)
    return out


def pack_zero_points(zero_points: np.ndarray, bits: int) -> np.ndarray:
    """MatMulNBits' uint8 ``zero_points`` ``[N, ceil(k_blocks*bits/8)]``: 4-bit two per byte, low nibble first."""
    zp = zero_points.astype(np.uint8)
    if bits == 8:
        return zp
    if zp.shape[1] % 2:
        zp = np.pad(zp, ((0, 0), (0, 1)))
    return zp[:, 0::2] | (zp[:, 1::2] << np.uint8(4))


def unpack_zero_points(packed: np.ndarray, bits: int, k_blocks: int) -> np.ndarray:
    """Inverse of ``pack_zero_points`` for a weight of ``k_blocks`` blocks per row."""
    if bits == 8:
        return packed.reshape(-1, k_blocks).astype(np.uint8)
    return unpack_codes(packed.reshape(-1, math.ceil(k_blocks / 2)), 4)[:, :k_blocks]


def quantize_rtn(weight: np.ndarray, bits: int, block_size: int = BLOCK_SIZE) -> BlockQuant:
    """Round-to-nearest blocks of an fp32 ``[N, K]`` weight: int4 asymmetric, int8 symmetric (module docstring)."""
    if block_size not in BLOCK_SIZES:
        raise QuantizeError(f"block size must be one of {list(BLOCK_SIZES)}, got {block_size}")
    w = np.asarray(weight, dtype=np.float32)
    rows, columns = w.shape
    k_blocks = math.ceil(columns / block_size)
    blocks = np.pad(w, ((0, 0), (0, k_blocks * block_size - columns))).reshape(rows, k_blocks, block_size)
    if bits == 4:
        lo = np.minimum(blocks.min(-1), 0.0)
        hi = np.maximum(blocks.max(-1), 0.0)
        scales = ((hi - lo) / 15).astype(np.float32)
        scales[scales == 0] = 1.0  # an all-zero block: any scale, codes at the zero point
        zps = np.clip(np.round(-lo / scales), 0, 15).astype(np.uint8)
        codes = np.clip(np.round(blocks / scales[..., None]) + zps[..., None], 0, 15).astype(np.uint8)
        return BlockQuant(4, codes, scales, zps, None, columns, "rtn")
    if bits == 8:
        scales = (np.abs(blocks).max(-1) / 127).astype(np.float32)
        scales[scales == 0] = 1.0
        codes = (np.clip(np.round(blocks / scales[..., None]), -127, 127) + 128).astype(np.uint8)
        return BlockQuant(8, codes, scales, None, None, columns, "rtn")
    raise QuantizeError(f"bits must be 4 or 8, got {bits}")


def from_gguf_blocks(ggml_type: str, data: np.ndarray, columns: int) -> BlockQuant:
    """A GGUF tensor's raw blocks (uint8 ``[rows, bytes per row]``) as MatMulNBits blocks, no rounding.

    Q4_0 block: fp16 d, 16 bytes of nibbles; Q4_1: fp16 d, fp16 m, 16 bytes; in both, byte j holds
    element j (low nibble) and j+16 (high). Q8_0: fp16 d, 32 int8.
    """
    if ggml_type not in GGUF_BITS or columns % BLOCK_SIZE:
        raise QuantizeError(f"GGUF type {ggml_type} with {columns} columns has no exact MatMulNBits form")
    rows, k_blocks = data.shape[0], columns // BLOCK_SIZE
    blocks = np.ascontiguousarray(data, dtype=np.uint8).reshape(rows, k_blocks, -1)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if ggml_type == "Q8_0":
        codes = (blocks[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        return BlockQuant(8, codes, d, None, None, columns, ggml_type)
    offset = 4 if ggml_type == "Q4_1" else 2
    nibbles = blocks[..., offset:]
    codes = np.concatenate([nibbles & np.uint8(0x0F), nibbles >> np.uint8(4)], axis=-1)
    if ggml_type == "Q4_0":
        return BlockQuant(4, codes, d, None, None, columns, ggml_type)
    m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    zero_points, offsets = centred_offsets(d, m, 15)
    return BlockQuant(4, codes, d, zero_points, offsets, columns, ggml_type)


def centred_offsets(scales: np.ndarray, offsets: np.ndarray, top: int) -> tuple[np.ndarray, np.ndarray]:
    """Per block, the zero point z in ``0..top`` whose offset ``m + z*d`` is smallest and exact in fp32.

    ``d*q + m == d*(q - z) + (m + z*d)`` for every code q, so the weights do not change; what changes is
    how much of them the kernel computes. MatMulNBits multiplies ``d*(q - z)`` by int8-rounded inputs and
    the offset correction multiplies ``m'`` by the inputs' exact block sums, so the inputs' rounding
    errors reach the output weighted by ``d*(q - z)`` and are *not* cancelled by the correction. With
    z = 0 (Q4_1's raw codes 0..15) every weight of a block carries about ``-m`` ~ ``7.5 d`` of the same
    sign and the errors add up; centred, they weigh with the weights themselves, as in llama.cpp (whose
    offset term uses the rounded sums). Measured: ``benchmarks/results/edge_cpu.md``, next-token agreement.
    Exact: both sides are computed in fp32 from exact operands (``d*(q - z)`` fits 24 bits), so
    ``dequantize`` stays bit-exact to GGUF's; a z whose ``m + z*d`` would round in fp32 is never chosen
    (z = 0 always qualifies).
    """
    d = scales.astype(np.float64)[..., None]
    z = np.arange(top + 1, dtype=np.float64)
    exact = offsets.astype(np.float64)[..., None] + z * d  # [.., top + 1]
    fits = exact.astype(np.float32).astype(np.float64) == exact
    cost = np.where(fits, np.abs(exact), np.inf)
    best = np.argmin(cost, axis=-1)  # ties: the smallest z; z = 0 always fits
    chosen = np.take_along_axis(exact, best[..., None], axis=-1)[..., 0]
    return best.astype(np.uint8), chosen.astype(np.float32)

"""Calibrated rounding: weight blocks whose range minimises the error the layer's own inputs would see.

Why: round to nearest spends a block's 16 (or 255) levels on its full range, so one large weight
coarsens every other weight of the block, and it weighs an error in an input channel that is almost
always zero the same as one in a channel that carries the signal. Calibrated rounding keeps the same
format (``BlockQuant``: ``w = scale * (code - zero_point)``, what ``MatMulNBits`` reads, so a step
costs the same) and chooses each block's scale and zero point to minimise

    sum_k  E[x_k^2] * (w_k - w'_k)^2

the squared output error of the block's share of a dot product with inputs of those second moments,
measured on the calibration prompts (``calibration.activation_moments``). Per block it tries the
range shrunk by each factor of ``SHRINK`` with the zero point as rounded and one step either way,
refits the scale by weighted least squares for the codes that choice gives, and keeps the best.
The first candidate is round to nearest itself, so no block ends worse than RTN by this measure.

It is what lets a wider block keep its fidelity: the step's int4 linears are cheaper per row in
blocks of 64 than of 32 on MLAS's int8-activation kernel (``benchmarks/results/block_sizes.md``),
and calibrated blocks of 64 agree with the fp32 model more often than nearest-rounded blocks of 32
(``benchmarks/results/graph_fidelity.md``).
"""

from __future__ import annotations

import math

import numpy as np

from specdec.export.quantization.blocks import BLOCK_SIZES, BlockQuant, QuantizeError

#: factors the block's range is shrunk by, the full range (round to nearest) first; finer near 1, where 8-bit blocks
#: find their best (a denser grid gains under 0.1 % of the error on the tests' weights)
SHRINK = (1.0, 0.98, 0.96, 0.94, 0.92, 0.9, 0.85, 0.8, 0.75, 0.7, 0.6, 0.5)
#: rows rounded at once (bounds the memory of the candidates: rows * K floats each)
ROWS_AT_ONCE = 2048
#: added to the normalised importances, so a channel never seen in calibration still counts a little
IMPORTANCE_FLOOR = 1e-3


def quantize_weighted(weight: np.ndarray, bits: int, block_size: int, importance: np.ndarray) -> BlockQuant:
    """Blocks of an fp32 ``[N, K]`` weight in RTN's format (int4 asymmetric, int8 symmetric), each block's range
    chosen to minimise the ``importance``-weighted squared error (module docstring); ``importance [K]``: the
    second moments of the layer's input channels."""
    if block_size not in BLOCK_SIZES:
        raise QuantizeError(f"block size must be one of {list(BLOCK_SIZES)}, got {block_size}")
    if bits not in (4, 8):
        raise QuantizeError(f"bits must be 4 or 8, got {bits}")
    w = np.asarray(weight, dtype=np.float32)
    rows, columns = w.shape
    if importance.shape != (columns,):
        raise QuantizeError(f"importance has shape {importance.shape}, the weight {columns} input channels")
    k_blocks = math.ceil(columns / block_size)
    pad = k_blocks * block_size - columns
    blocks = np.pad(w, ((0, 0), (0, pad))).reshape(rows, k_blocks, block_size)
    imp = np.asarray(importance, dtype=np.float64)
    imp = (imp / max(float(imp.mean()), float(np.finfo(np.float64).tiny)) + IMPORTANCE_FLOOR).astype(np.float32)
    imp = np.pad(imp, (0, pad)).reshape(1, k_blocks, block_size)  # padding weighs nothing
    fit = _asymmetric if bits == 4 else _symmetric
    parts = [fit(blocks[r : r + ROWS_AT_ONCE], imp) for r in range(0, rows, ROWS_AT_ONCE)]
    codes = np.concatenate([p[0] for p in parts])
    scales = np.concatenate([p[1] for p in parts])
    zero_points = None if bits == 8 else np.concatenate([p[2] for p in parts if p[2] is not None])
    return BlockQuant(bits, codes, scales, zero_points, None, columns, "calibrated")


def _refit(w: np.ndarray, imp: np.ndarray, centred: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """The least-squares scale for these centred codes (``scale`` where that is not positive)."""
    num = (imp * w * centred).sum(-1)
    den = (imp * centred * centred).sum(-1)
    refit = np.divide(num, den, out=np.zeros_like(num), where=den > 0).astype(np.float32)
    return np.where(refit > 0, refit, scale)


class _Best:
    """The lowest-error scale and zero point seen so far, per block (its codes follow from them: ``_codes``)."""

    def __init__(self, shape: tuple[int, ...], zero_point: float = 0.0) -> None:
        self.error = np.full(shape, np.inf, dtype=np.float32)
        self.scales = np.ones(shape, dtype=np.float32)
        self.zero_points = np.full(shape, zero_point, dtype=np.float32)

    def offer(self, w: np.ndarray, imp: np.ndarray, scales: np.ndarray, zero_points: np.ndarray, top: int) -> None:
        """Keep ``scales``/``zero_points`` for the blocks where their codes' weighted error is lower."""
        centred = _codes(w, scales, zero_points, top) - zero_points[..., None]
        error = (imp * (w - scales[..., None] * centred) ** 2).sum(-1)
        better = error < self.error
        self.error = np.where(better, error, self.error)
        self.scales = np.where(better, scales, self.scales)
        self.zero_points = np.where(better, zero_points, self.zero_points)


def _codes(w: np.ndarray, scales: np.ndarray, zero_points: np.ndarray, top: int) -> np.ndarray:
    """Each weight's nearest code on its block's grid (RTN's arithmetic): ``0..15`` at 4 bits (``top`` 15), ``1..255``
    at 8 (``top`` 255: symmetric about the zero point 128)."""
    return np.clip(np.round(w / scales[..., None]) + zero_points[..., None], 0 if top == 15 else 1, top)


def _asymmetric(w: np.ndarray, imp: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """4-bit codes 0..15 about an integer zero point (RTN's: the range widened to hold 0)."""
    lo = np.minimum(w.min(-1), 0.0)
    hi = np.maximum(w.max(-1), 0.0)
    best = _Best(lo.shape)
    for factor in SHRINK:
        scale = ((hi - lo) * factor / 15).astype(np.float32)
        scale[scale == 0] = 1.0  # an all-zero block: any scale, codes at the zero point
        nearest = np.round(-lo * factor / scale)
        for shift in (0, -1, 1):
            zp = np.clip(nearest + shift, 0, 15).astype(np.float32)
            best.offer(w, imp, scale, zp, 15)
            refit = _refit(w, imp, _codes(w, scale, zp, 15) - zp[..., None], scale)
            best.offer(w, imp, refit, zp, 15)
    codes = _codes(w, best.scales, best.zero_points, 15).astype(np.uint8)
    return codes, best.scales.astype(np.float32), best.zero_points.astype(np.uint8)


def _symmetric(w: np.ndarray, imp: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """8-bit codes ``q + 128``, q in -127..127 (RTN's: the op's default zero point 128, no zero-point tensor)."""
    top = np.abs(w).max(-1)
    best = _Best(top.shape, 128.0)
    zp = best.zero_points.copy()
    for factor in SHRINK:
        scale = (top * factor / 127).astype(np.float32)
        scale[scale == 0] = 1.0
        best.offer(w, imp, scale, zp, 255)
        best.offer(w, imp, _refit(w, imp, _codes(w, scale, zp, 255) - 128, scale), zp, 255)
    return _codes(w, best.scales, zp, 255).astype(np.uint8), best.scales.astype(np.float32), None

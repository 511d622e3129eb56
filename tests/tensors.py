"""Inputs built exactly as Triton's Python backend hands them to ``model.py``: BYTES as object arrays of bytes,
INT32/FP32/BOOL as numpy arrays of shape [1], so what passes a test is what a client can send."""

from __future__ import annotations

import numpy as np


def b(*texts: str | bytes) -> np.ndarray:
    """A BYTES tensor as the Python backend delivers it: an object array of bytes."""
    return np.array([t.encode() if isinstance(t, str) else t for t in texts], dtype=object)


def i32(value: int) -> np.ndarray:
    return np.array([value], dtype=np.int32)


def f32(value: float) -> np.ndarray:
    return np.array([value], dtype=np.float32)


def flag(value: bool) -> np.ndarray:
    return np.array([value], dtype=np.bool_)

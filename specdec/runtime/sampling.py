"""Sampling parameters, warping, and the lossless acceptance rules.

Notation follows Leviathan et al.: ``p`` is the target's distribution, ``q`` the draft's.
Both are the *warped* distributions actually sampled from (temperature, then top-k, then
top-p), so rejection sampling reproduces exactly what plain sampling from the target would.

The acceptance rules are pure functions of (drafts, q, p, a generator): no backend, no I/O.
Arrays are numpy (the runtime does not import torch: an ONNX Runtime engine's process holds the
graph and its caches, not a second tensor library, ``benchmarks/results/edge_cpu.md``); a
request's generator is its own ``numpy.random.Generator``.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

MIN_TEMPERATURE = 1e-5  # below this, logits / temperature overflows float32


class InvalidRequestError(ValueError):
    """A request parameter is invalid; the message names the parameter and the value."""


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples. ``temperature == 0`` means greedy (argmax)."""

    temperature: float = 0.0
    top_k: int = 0  # 0 = no top-k cut
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)):
            raise InvalidRequestError(f"temperature must be a finite number, got {self.temperature!r}")
        if self.temperature < 0:
            raise InvalidRequestError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if 0 < self.temperature < MIN_TEMPERATURE:
            raise InvalidRequestError(
                f"temperature must be 0 (greedy) or >= {MIN_TEMPERATURE}, got {self.temperature}: "
                "smaller values overflow the logit scaling"
            )
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise InvalidRequestError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if not (isinstance(self.top_p, (int, float)) and 0.0 < self.top_p <= 1.0):
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or self.seed < 0):
            raise InvalidRequestError(f"seed must be a non-negative integer, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def make_generator(self) -> np.random.Generator:
        """The request's own RNG stream, so its output does not depend on batch neighbours."""
        return np.random.default_rng(self.seed if self.seed is not None else secrets.randbits(63))


def softmax(scores: np.ndarray) -> np.ndarray:
    """Softmax over the last axis, in the input's dtype (shifted by the row maximum: -inf scores get probability 0)."""
    shifted = scores - scores.max(axis=-1, keepdims=True)
    exp = np.exp(shifted)
    return exp / exp.sum(axis=-1, keepdims=True)


def log_softmax(scores: np.ndarray) -> np.ndarray:
    """Log-softmax over the last axis, in the input's dtype (float64 for the beam scores)."""
    top = scores.max(axis=-1, keepdims=True)
    shifted = scores - np.where(np.isfinite(top), top, 0.0)
    with np.errstate(divide="ignore"):
        return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def warp(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Probabilities ``[..., V]`` (float32) after temperature, top-k and top-p (in that order)."""
    if params.greedy:
        raise ValueError("greedy requests are decided by argmax, not by a warped distribution")
    logits = np.asarray(logits, dtype=np.float32)
    # shift before dividing so a tiny temperature gives -inf gaps, never inf - inf = NaN
    scores = (logits - logits.max(axis=-1, keepdims=True)) / np.float32(params.temperature)
    if params.top_k and params.top_k < scores.shape[-1]:
        kth = np.partition(scores, -params.top_k, axis=-1)[..., -params.top_k :].min(axis=-1, keepdims=True)
        scores = np.where(scores < kth, -np.inf, scores).astype(np.float32)
    probs = softmax(scores)
    if params.top_p < 1.0:
        order = np.argsort(-probs, axis=-1, kind="stable")
        sorted_probs = np.take_along_axis(probs, order, axis=-1)
        mass_before = np.cumsum(sorted_probs, axis=-1) - sorted_probs
        drop_sorted = mass_before >= params.top_p  # the first token is always kept
        drop = np.zeros_like(drop_sorted)
        np.put_along_axis(drop, order, drop_sorted, axis=-1)
        probs = np.where(drop, np.float32(0.0), probs)
        probs = probs / probs.sum(axis=-1, keepdims=True)
    return probs


def sample_many(probs: np.ndarray, n: int, generator: np.random.Generator) -> np.ndarray:
    """``n`` i.i.d. draws (int64) from an unnormalised ``[V]`` distribution, by inverting its float64 CDF.

    A zero-probability entry owns an empty interval of the CDF, so it is never drawn.
    """
    cdf = np.cumsum(probs, dtype=np.float64)
    if not cdf.size or not cdf[-1] > 0:
        raise ValueError("cannot sample from a distribution without positive mass")
    draws = np.searchsorted(cdf, generator.random(n) * cdf[-1], side="right")
    # a uniform that rounds up to the total mass lands past the end: it belongs to the last token with mass
    return np.minimum(draws, int(np.flatnonzero(probs)[-1])).astype(np.int64)


def sample(probs: np.ndarray, generator: np.random.Generator) -> int:
    """One token from a ``[V]`` distribution."""
    return int(sample_many(probs, 1, generator)[0])


def next_token(logits: np.ndarray, params: SamplingParams, generator: np.random.Generator) -> int:
    """The token plain decoding would emit from ``[V]`` logits."""
    if params.greedy:
        return int(np.argmax(logits))
    return sample(warp(logits, params), generator)


def verify_greedy(draft_tokens: Sequence[int], target_argmax: Sequence[int]) -> list[int]:
    """Accepted drafts followed by the target's own next token.

    ``target_argmax[j]`` is the target's argmax after the j-th fed token (row 0 = the last
    committed token), so it has ``len(draft_tokens) + 1`` entries.
    """
    out: list[int] = []
    for draft, best in zip(draft_tokens, target_argmax):
        if draft != best:
            break
        out.append(draft)
    out.append(int(target_argmax[len(out)]))
    return out


def verify_sampling(
    draft_tokens: Sequence[int],
    draft_probs: np.ndarray | None,  # [k, V] q of each draft, or None for point masses (n-gram)
    target_probs: np.ndarray,  # [k + 1, V] warped p after each fed token
    generator: np.random.Generator,
) -> list[int]:
    """Speculative sampling: accept x with prob min(1, p(x)/q(x)); else draw from norm(max(0, p - q))."""
    out: list[int] = []
    for j, x in enumerate(draft_tokens):
        p = target_probs[j]
        qx = 1.0 if draft_probs is None else float(draft_probs[j, x])
        if generator.random() * qx < float(p[x]):
            out.append(int(x))
            continue
        if draft_probs is None:
            residual = p.copy()
            residual[x] = 0.0
        else:
            residual = np.maximum(p - draft_probs[j], 0.0)
        total = float(residual.sum())
        # total == 0 only when p == q up to rounding, where rejection has probability 0
        out.append(sample(residual if total > 0 else p, generator))
        return out
    out.append(sample(target_probs[len(draft_tokens)], generator))
    return out

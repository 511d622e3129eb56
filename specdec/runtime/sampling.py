"""Sampling parameters, warping, and the lossless acceptance rules.

Notation follows Leviathan et al.: ``p`` is the target's distribution, ``q`` the draft's.
Both are the *warped* distributions actually sampled from (temperature, then top-k, then
top-p), so rejection sampling reproduces exactly what plain sampling from the target would.

The acceptance rules are pure functions of (drafts, q, p, a generator): no backend, no I/O.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Sequence
from dataclasses import dataclass

import torch

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

    def make_generator(self) -> torch.Generator:
        """The request's own RNG stream, so its output does not depend on batch neighbours."""
        return torch.Generator().manual_seed(self.seed if self.seed is not None else secrets.randbits(63))


def warp(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Probabilities ``[..., V]`` after temperature, top-k and top-p (in that order)."""
    if params.greedy:
        raise ValueError("greedy requests are decided by argmax, not by a warped distribution")
    logits = logits.float()
    # shift before dividing so a tiny temperature gives -inf gaps, never inf - inf = NaN
    scores = (logits - logits.max(dim=-1, keepdim=True).values) / params.temperature
    if params.top_k and params.top_k < scores.shape[-1]:
        kth = torch.topk(scores, params.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        drop_sorted = mass_before >= params.top_p  # the first token is always kept
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def sample(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One token from a ``[V]`` distribution."""
    return int(torch.multinomial(probs, 1, generator=generator))


def next_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """The token plain decoding would emit from ``[V]`` logits."""
    if params.greedy:
        return int(torch.argmax(logits))
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
    draft_probs: torch.Tensor | None,  # [k, V] q of each draft, or None for point masses (n-gram)
    target_probs: torch.Tensor,  # [k + 1, V] warped p after each fed token
    generator: torch.Generator,
) -> list[int]:
    """Speculative sampling: accept x with prob min(1, p(x)/q(x)); else draw from norm(max(0, p - q))."""
    out: list[int] = []
    for j, x in enumerate(draft_tokens):
        p = target_probs[j]
        qx = 1.0 if draft_probs is None else float(draft_probs[j, x])
        if float(torch.rand((), generator=generator)) * qx < float(p[x]):
            out.append(int(x))
            continue
        if draft_probs is None:
            residual = p.clone()
            residual[x] = 0.0
        else:
            residual = torch.clamp(p - draft_probs[j], min=0.0)
        total = float(residual.sum())
        # total == 0 only when p == q up to rounding, where rejection has probability 0
        out.append(sample(residual / total if total > 0 else p, generator))
        return out
    out.append(sample(target_probs[len(draft_tokens)], generator))
    return out

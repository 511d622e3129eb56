"""The target's log-probabilities of the tokens a request generates, and what constrains its next token.

Why here and not in a loop: every method emits tokens from rows of target logits the step already has (a decode
row, a verified chain's rows, a beam's node rows), so the log-probability of a token is a pure function of its row,
the token and the request. Computed row by row by the same function, a token's log-probability is the same bits
whether its row came from a decode step or from a verification among drafts: on a row-independent graph greedy
``ems`` reports exactly ``ar``'s log-probabilities.

Which distribution: a sampled request's tokens are drawn from the target's logits after its temperature, top-k
and top-p (``sampling.warp``), and the log-probabilities are of that distribution (tokens it cut get -inf). A
greedy request (temperature 0) reports the unwarped distribution (temperature 1), whose argmax it emits; so do
the beam methods, whose search ranks candidates by the unwarped log-likelihood.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from specdec.runtime.sampling import SamplingParams, log_softmax, warp

#: the most alternatives a token may report (OpenAI's ``top_logprobs`` limit)
MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token's log-probability under the target, and its ``top`` alternatives (most likely first,
    ties by token id), as (token id, log-probability)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def row_logprobs(row: np.ndarray, params: SamplingParams | None) -> np.ndarray:
    """Log-probabilities over the vocabulary after one row of target logits: warped by ``params`` when they
    sample, the raw distribution when greedy or ``None`` (a beam)."""
    if params is None or params.greedy:
        return log_softmax(np.asarray(row, dtype=np.float64))
    with np.errstate(divide="ignore"):
        return np.log(warp(np.asarray(row, dtype=np.float32), params).astype(np.float64))


def token_logprob(row: np.ndarray, token_id: int, params: SamplingParams | None, top: int) -> TokenLogprob:
    """``token_id``'s log-probability after ``row`` and the ``top`` most likely tokens of the same distribution."""
    logp = row_logprobs(row, params)
    alternatives: tuple[tuple[int, float], ...] = ()
    if top > 0:
        count = min(top, logp.shape[-1])
        candidates = np.argpartition(-logp, count - 1)[:count]
        ranked = sorted(candidates.tolist(), key=lambda t: (-logp[t], t))
        alternatives = tuple((int(t), float(logp[t])) for t in ranked)
    return TokenLogprob(int(token_id), float(logp[token_id]), alternatives)


def suppress(row: np.ndarray, token_ids: Iterable[int]) -> np.ndarray:
    """A copy of ``row`` in which ``token_ids`` can never be chosen (their logits -inf): ``min_tokens`` keeps a
    request's stop tokens out until it has generated that many. Masking the target's own row keeps speculation
    exact: a drafted stop token then has probability 0 under the target and is always rejected."""
    masked = np.array(row, copy=True)
    masked[..., list(token_ids)] = -np.inf
    return masked

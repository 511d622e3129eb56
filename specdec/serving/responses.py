"""The responses between the models and to the client, built and read in one place.

An engine response carries every token id of its answer so far and how many of them earlier responses covered
(``sent_tokens``), so postprocessing computes each text delta from ids alone, with no state per request; the
log-probabilities travel only for the new tokens. A failure travels in band, message and code
(``ENGINE_ERROR``, ``ENGINE_ERROR_CODE``): Triton 2.51 loses both on a decoupled BLS error response.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from specdec.runtime.logprobs import TokenLogprob
from specdec.runtime.request import RequestMetrics
from specdec.runtime.sampling import InvalidRequestError
from specdec.serving.inputs import check_dtype, parse_ids, parse_stops, scalar
from specdec.serving.protocol import (
    ANSWER_STOP_IDS,
    ENGINE_ERROR,
    ENGINE_ERROR_CODE,
    ENGINE_OUTPUTS,
    FINISH_REASON,
    FINISHED,
    LOGPROBS,
    METRICS,
    OUTPUT_IDS,
    OUTPUT_LOGPROBS,
    OUTPUT_TOKENS,
    REQUEST_METRICS,
    SENT_TOKENS,
    STOP_STRINGS,
    TEXT_OUTPUT,
    TEXT_OUTPUTS,
    TOP_LOGPROB_IDS,
    TOP_LOGPROB_TOKENS,
    TOP_LOGPROBS,
    array,
)

#: the error codes an engine failure carries (the names of Triton's ``TritonError`` codes): the client's fault, no
#: capacity (the request may be retried elsewhere), or the server's
INVALID, UNAVAILABLE, INTERNAL = "INVALID_ARG", "UNAVAILABLE", "INTERNAL"


def logprob_values(logprobs: Sequence[TokenLogprob]) -> dict[str, list]:
    """The ``LOGPROBS`` tensors' values of some tokens: each one's log-probability, its alternatives' ids and
    theirs (``[tokens, k]``; ``[0, 0]`` when none were asked)."""
    return {
        OUTPUT_LOGPROBS.name: [lp.logprob for lp in logprobs],
        TOP_LOGPROB_IDS.name: [[t for t, _ in lp.top] for lp in logprobs],
        TOP_LOGPROBS.name: [[v for _, v in lp.top] for lp in logprobs],
    }


def engine_response(
    output_ids: Sequence[int],
    sent_tokens: int,
    finished: bool,
    stops: Sequence[str],
    finish_reason: str,
    metrics: RequestMetrics,
    *,
    stop_ids: Sequence[int] = (),
    logprobs: Sequence[TokenLogprob] = (),
    error: str = "",
    error_code: str = "",
) -> dict[str, np.ndarray]:
    """Every tensor of ``ENGINE_OUTPUTS`` for one engine response, in that order and typed by its spec.

    ``logprobs``: those of the tokens after ``sent_tokens`` (the ones this response adds), when asked for."""
    values = {
        OUTPUT_IDS.name: output_ids,
        SENT_TOKENS.name: sent_tokens,
        FINISHED.name: finished,
        STOP_STRINGS.name: stops,
        ANSWER_STOP_IDS.name: stop_ids,
        FINISH_REASON.name: finish_reason,
        ENGINE_ERROR.name: error,
        ENGINE_ERROR_CODE.name: error_code if error else "",
        **{spec.name: getattr(metrics, spec.name) for spec in REQUEST_METRICS},
        **logprob_values(logprobs),
    }
    return {spec.name: array(spec, values[spec.name]) for spec in ENGINE_OUTPUTS}


def engine_failure(message: str, code: str, metrics: RequestMetrics | None = None) -> dict[str, np.ndarray]:
    """The one response of a request the engine refused or failed before it produced anything."""
    return engine_response([], 0, True, (), "", metrics or RequestMetrics(), error=message, error_code=code)


@dataclass(frozen=True)
class EngineResponse:
    """What postprocessing needs of an engine response to compute its text."""

    output_ids: list[int]  # every token so far
    sent_tokens: int  # how many of them earlier responses covered
    finished: bool
    stops: tuple[str, ...]
    stop_ids: tuple[int, ...] = ()  # the request's own stop tokens: a final one is not text

    @property
    def new_ids(self) -> list[int]:
        return self.output_ids[self.sent_tokens :]


def engine_error(tensors: Mapping[str, np.ndarray]) -> tuple[str, str]:
    """The in-band failure of an engine response, message and code (('', '') when it did not fail)."""
    if ENGINE_ERROR.name not in tensors:
        return "", ""
    message = str(scalar(tensors, ENGINE_ERROR) or "")
    code = str(scalar(tensors, ENGINE_ERROR_CODE) or "") if ENGINE_ERROR_CODE.name in tensors else ""
    return message, (code or INTERNAL) if message else ""


def parse_engine_response(tensors: Mapping[str, np.ndarray], vocab_size: int | None = None) -> EngineResponse:
    """The ids, coverage, end flag and stop strings of one engine response (``engine_response``'s tensors).

    Checked as strictly as a client's input, because the postprocessing model that reads it is reachable by any
    client too: missing tensors, ids outside ``[0, vocab_size)``, or a coverage outside the ids raise
    ``InvalidRequestError`` naming the problem (never a traceback).
    """
    missing = [spec.name for spec in (OUTPUT_IDS, SENT_TOKENS, FINISHED) if spec.name not in tensors]
    if missing:
        raise InvalidRequestError(f"missing input(s) {missing}")
    ids = np.asarray(tensors[OUTPUT_IDS.name])
    check_dtype(ids, OUTPUT_IDS)
    sent, finished = scalar(tensors, SENT_TOKENS), scalar(tensors, FINISHED)
    output_ids = [int(t) for t in ids.reshape(-1)]
    if vocab_size is not None and any(not 0 <= t < vocab_size for t in output_ids):
        raise InvalidRequestError(f"input '{OUTPUT_IDS.name}' holds token ids outside [0, {vocab_size})")
    if sent is None or not 0 <= int(sent) <= len(output_ids):  # None: not sent, refused above
        raise InvalidRequestError(f"input '{SENT_TOKENS.name}' must be between 0 and {len(output_ids)}, got {sent}")
    return EngineResponse(
        output_ids,
        int(sent),
        bool(finished),
        parse_stops(tensors.get(STOP_STRINGS.name)),
        parse_ids(tensors.get(ANSWER_STOP_IDS.name), ANSWER_STOP_IDS),
    )


def text_response(
    text: str,
    engine: Mapping[str, np.ndarray],
    response: EngineResponse,
    token_bytes: Sequence[bytes] = (),
    top_bytes: Sequence[Sequence[bytes]] = (),
) -> dict[str, np.ndarray]:
    """Every tensor of ``TEXT_OUTPUTS``: ``text``, the ids this response adds, the engine's metrics and
    log-probabilities as sent, and (with log-probabilities) each new token's bytes and its alternatives'."""
    empty = {spec.name: array(spec, []) for spec in LOGPROBS}
    values = {
        TEXT_OUTPUT.name: array(TEXT_OUTPUT, text),
        OUTPUT_IDS.name: array(OUTPUT_IDS, response.new_ids),
        OUTPUT_TOKENS.name: array(OUTPUT_TOKENS, list(token_bytes)),
        TOP_LOGPROB_TOKENS.name: array(TOP_LOGPROB_TOKENS, [list(row) for row in top_bytes]),
        **{spec.name: engine[spec.name] for spec in METRICS},
        **{spec.name: engine.get(spec.name, empty[spec.name]) for spec in LOGPROBS},
    }
    return {spec.name: values[spec.name] for spec in TEXT_OUTPUTS}


def finish_reason(tensors: Mapping[str, np.ndarray]) -> str:
    return str(scalar(tensors, FINISH_REASON) or "")

"""The responses between the models (``serving.responses``): exactly the declared tensors, checked like input."""

from __future__ import annotations

import numpy as np
import pytest

from specdec.runtime.logprobs import TokenLogprob
from specdec.runtime.request import RequestMetrics
from specdec.runtime.sampling import InvalidRequestError
from specdec.serving import protocol, responses

MAX_LEN = 2048
INT32_MAX = 2**31 - 1


def test_engine_and_client_responses_are_exactly_the_declared_tensors() -> None:
    """A response is built from the tables alone: every declared output, in order, with its numpy type and shape,
    each metric read from ``RequestMetrics`` by its tensor's name; postprocessing reads back what the engine sent
    and passes the metrics on untouched."""
    metrics = RequestMetrics(
        prompt_tokens=3,
        generated_tokens=5,
        draft_tokens=8,
        accepted_draft_tokens=6,
        target_calls=4,
        batch_size_sum=10,
        beam_widths=[2, 2, 1],
    )
    engine = responses.engine_response([7, 8, 9, 10, 11], 2, True, ("\n", "你好"), "stop", metrics, stop_ids=[5])
    assert list(engine) == [s.name for s in protocol.ENGINE_OUTPUTS]
    for spec in protocol.ENGINE_OUTPUTS:
        array = engine[spec.name]
        assert array.dtype == protocol.NUMPY_OF[spec.dtype], spec.name
        assert array.ndim == len(spec.dims) and (spec.dims != (1,) or array.shape == (1,)), spec.name
    assert engine["acceptance_rate"][0] == np.float32(0.75) and engine["mean_batch_size"][0] == np.float32(2.5)
    assert engine["beam_widths"].tolist() == [2, 2, 1] and engine["target_calls"].tolist() == [4]
    assert engine["prompt_tokens"].tolist() == [3] and engine["completion_tokens"].tolist() == [5]
    assert engine["output_logprobs"].shape == (0,) and engine["top_logprobs"].shape == (0, 0)
    response = responses.parse_engine_response(engine)
    assert response == responses.EngineResponse([7, 8, 9, 10, 11], 2, True, ("\n", "你好"), (5,))
    client = responses.text_response("delta", engine, response)
    assert list(client) == [s.name for s in protocol.TEXT_OUTPUTS]
    assert client["text_output"].tolist() == [b"delta"] and client["output_ids"].tolist() == [9, 10, 11]
    assert client["output_ids"].dtype == np.int32
    assert all(client[s.name] is engine[s.name] for s in (*protocol.METRICS, *protocol.LOGPROBS))
    empty = responses.engine_response([], 0, False, (), "", RequestMetrics())
    assert empty["output_ids"].shape == (0,) and empty["stop_strings"].shape == (0,)
    assert empty["beam_widths"].dtype == np.int32 and empty["stop_strings"].dtype == object
    assert responses.engine_error(empty) == ("", "")


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(output_ids=np.array([7, 50_000], dtype=np.int32)), "outside"),
        (dict(output_ids=np.array([-1], dtype=np.int32)), "outside"),
        (dict(output_ids=np.array([1.5], dtype=np.float32)), "output_ids"),
        (dict(sent_tokens=np.array([9], dtype=np.int32)), "sent_tokens"),
        (dict(sent_tokens=None), "missing"),
        (dict(finished=np.array([1, 1], dtype=bool)), "exactly one value"),
    ],
)
def test_an_engine_response_is_checked_like_client_input(change: dict, message: str) -> None:
    """The postprocessing model is reachable by any client: garbage gets a named INVALID_ARGUMENT, no traceback."""
    engine = responses.engine_response([7, 8, 9], 1, False, (), "", RequestMetrics())
    responses.parse_engine_response(engine, vocab_size=100)
    for name, value in change.items():
        if value is None:
            del engine[name]
        else:
            engine[name] = value
    with pytest.raises(InvalidRequestError, match=message):
        responses.parse_engine_response(engine, vocab_size=100)


def test_logprobs_travel_for_the_new_tokens_only() -> None:
    """An engine response holds every id so far but the log-probabilities of the ids it adds: each one's, and its
    alternatives' as a [tokens, k] table; postprocessing passes them on with each token's bytes."""
    logprobs = [TokenLogprob(9, -0.5, ((9, -0.5), (3, -1.5))), TokenLogprob(10, -0.25, ((10, -0.25), (4, -2.0)))]
    engine = responses.engine_response([7, 8, 9, 10], 2, False, (), "", RequestMetrics(), logprobs=logprobs)
    assert engine["output_logprobs"].tolist() == [-0.5, -0.25]
    assert engine["top_logprob_ids"].tolist() == [[9, 3], [10, 4]]
    assert engine["top_logprobs"].dtype == np.float32 and engine["top_logprobs"].shape == (2, 2)
    parsed = responses.parse_engine_response(engine)
    client = responses.text_response("x", engine, parsed, [b"a", b"\xe2"], [[b"a", b"b"], [b"\xe2", b"c"]])
    assert client["output_tokens"].tolist() == [b"a", b"\xe2"]
    assert client["top_logprob_tokens"].shape == (2, 2) and client["top_logprob_tokens"][1, 0] == b"\xe2"


def test_a_failure_travels_in_band_with_its_code() -> None:
    """Triton 2.51 loses the code of a decoupled BLS error response: the engine sends message and code in band."""
    failure = responses.engine_failure("input 'max_tokens' must be between 1 and 2047, got 0", responses.INVALID)
    assert responses.engine_error(failure) == (
        "input 'max_tokens' must be between 1 and 2047, got 0",
        responses.INVALID,
    )
    assert responses.parse_engine_response(failure).finished
    crashed = responses.engine_response([1], 0, True, (), "", RequestMetrics(), error="boom")
    assert responses.engine_error(crashed) == ("boom", responses.INTERNAL)  # no code given: the server's fault

"""The frontend's one connection to Triton: a gRPC stream of ``specdec_stream`` per request (``tritonclient.grpc.aio``).

One channel for the process, many streams over it (HTTP/2 multiplexes them); nothing is kept between requests.
A request's stream ends when the server has answered it; if the HTTP client goes away first, closing the
generator cancels the gRPC call, which the entry point sees (``Client.is_cancelled``) and passes on to the engine,
so the sequence leaves the batch at its next step and its KV slot is freed. A stream that has had its answer is
never cancelled (tritonserver 2.51 then keeps ``specdec_stream`` loaded forever: ``SpecdecClient.stream``).
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Mapping

import numpy as np

from specdec.serving import protocol
from specdec.serving.openai.errors import OpenAIError, from_triton, internal
from specdec.serving.openai.translate import INPUTS, Piece, Translation, piece_of


def _error(exc: BaseException, params: Mapping[str, str]) -> OpenAIError:
    """A tritonclient exception (``InferenceServerException``) or a gRPC failure as an OpenAI error."""
    message_of, status_of = getattr(exc, "message", None), getattr(exc, "status", None)
    message = message_of() if callable(message_of) else str(exc)
    status = status_of() if callable(status_of) else None
    return from_triton(message or "", None if status is None else str(status), params)


class Triton:
    """The aio gRPC client of one Triton endpoint (create it inside the event loop that uses it)."""

    def __init__(self, url: str, timeout_s: float = 600.0) -> None:
        import tritonclient.grpc.aio as grpcclient

        self.url, self.timeout_s = url, timeout_s
        self._client = grpcclient.InferenceServerClient(url)

    async def ready(self) -> bool:
        """Whether Triton serves and ``specdec_stream`` is loaded."""
        try:
            return bool(
                await self._client.is_server_ready(client_timeout=2.0)
                and await self._client.is_model_ready(protocol.STREAM_MODEL, client_timeout=2.0)
            )
        except Exception:
            return False

    async def close(self) -> None:
        await self._client.close()

    def _inputs(self, tensors: Mapping[str, np.ndarray]) -> list:
        import tritonclient.grpc as grpcclient

        inputs = []
        for name, array in tensors.items():
            tensor = grpcclient.InferInput(name, list(array.shape), INPUTS[name].wire_dtype)
            tensor.set_data_from_numpy(array)
            inputs.append(tensor)
        return inputs

    async def generate(self, translation: Translation) -> AsyncIterator[Piece]:
        """The pieces of one request as the server streams them; an error (in band or not) raises ``OpenAIError``.

        Ends when every choice has finished (or the server closed the stream). Closing the generator early (the
        HTTP client went away) cancels the request on the server.
        """
        request = {
            "model_name": protocol.STREAM_MODEL,
            "inputs": self._inputs(translation.inputs),
            "request_id": uuid.uuid4().hex,
        }

        async def requests() -> AsyncIterator[dict]:
            yield request

        finished: set[int] = set()
        complete = False
        try:
            responses = self._client.stream_infer(requests(), stream_timeout=self.timeout_s)
        except Exception as exc:
            raise _error(exc, translation.params) from None
        try:
            async for result, error in _guarded(responses, translation.params):
                if error is not None:
                    complete = True  # an error response is the request's last
                    raise _error(error, translation.params)
                response = result.get_response()
                if not response.outputs:
                    continue
                piece = piece_of({o.name: result.as_numpy(o.name) for o in response.outputs})
                if piece.finished:
                    finished.add(piece.index)
                    complete = len(finished) == translation.n
                yield piece
            if not complete:
                raise internal("the inference server ended the stream before the answer was complete")
        finally:
            if not complete:
                responses.cancel()


async def _guarded(responses: AsyncIterator, params: Mapping[str, str]) -> AsyncIterator:
    """``responses`` with the transport's failures (server gone, deadline) as ``OpenAIError``."""
    iterator = responses.__aiter__()
    while True:
        try:
            item = await iterator.__anext__()
        except StopAsyncIteration:
            return
        except OpenAIError:
            raise
        except Exception as exc:
            status = _grpc_status(exc)
            if status is not None:
                raise from_triton(_grpc_details(exc), f"StatusCode.{status}", params) from None
            raise _error(exc, params) from None
        yield item


def _grpc_status(exc: BaseException) -> str | None:
    code = getattr(exc, "code", None)
    try:
        value = code() if callable(code) else None
    except Exception:
        return None
    return getattr(value, "name", None)


def _grpc_details(exc: BaseException) -> str:
    details = getattr(exc, "details", None)
    try:
        return str(details() if callable(details) else exc)
    except Exception:
        return str(exc)

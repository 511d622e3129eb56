"""The ASGI app (Starlette): routes, authentication, body limits, draining, and server-sent events.

Each completion request is parsed and checked here (``schema``), translated (``translate``), sent as one gRPC
stream (``triton.Triton.generate``) and answered as one JSON object or as SSE chunks (``responses``). A streamed
answer's HTTP status is decided by the server's first response: a request the server refuses gets its 4xx/5xx
status and OpenAI's error object, never a 200 stream holding an error; an error after the stream began is sent as
a last ``data: {"error": ...}`` event before ``data: [DONE]`` (the ``openai`` SDK raises it).

A client that disconnects stops its request on the server: while the answer is collected (unary) or awaited
(a stream's first response), a watcher of the ASGI ``http.disconnect`` cancels it; once streaming, Starlette
cancels the response task, which closes the gRPC stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from specdec.serving.control import Control
from specdec.serving.openai import errors
from specdec.serving.openai.errors import OpenAIError
from specdec.serving.openai.process import LIVE_PATH, READY_PATH
from specdec.serving.openai.responses import (
    Answer,
    chat_chunks,
    chat_completion,
    completion,
    completion_chunks,
    new_id,
    usage_chunk,
)
from specdec.serving.openai.schema import (
    WHY_UNSUPPORTED,
    ChatRequest,
    CompletionRequest,
    GenerationRequest,
    Model,
    ModelList,
    unsupported,
)
from specdec.serving.openai.translate import Piece, Translation, chat_inputs, completion_inputs
from specdec.serving.openai.triton import Triton
from specdec.serving.protocol import DRAINING

log = logging.getLogger("specdec.openai")
#: a request body above this is refused with 413 (a prompt the server takes is at most 64 KiB: ``protocol.Limits``)
DEFAULT_MAX_BODY_BYTES = 1 << 20
#: how far past the limit a body is still read before its 413 (``body``)
DRAIN_FACTOR = 8
Parsed = TypeVar("Parsed", bound=BaseModel)


@dataclass
class Settings:
    """What one frontend serves and how."""

    triton_url: str
    model: str
    api_key: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    timeout_s: float = 600.0
    #: where the launcher raises the drain flag (``specdec.serving.control``); None: only a signal drains
    control_dir: Path | None = None
    created: int = field(default_factory=lambda: int(time.time()))


class ClientGone(Exception):
    """The HTTP client disconnected before its answer was ready."""


class Frontend:
    """The app's state: settings, the Triton client (made at startup, in the server's loop), the drain flag."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.control = Control(settings.control_dir)
        self.draining = False  # set on the process's own shutdown signal
        self.triton: Triton | None = None

    def is_draining(self) -> bool:
        return self.draining or self.control.draining()

    # -- checks every request passes ----------------------------------------------------------------------
    def authorize(self, request: Request) -> None:
        key = self.settings.api_key
        if not key:
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), key.encode()):
            raise errors.unauthorized()

    async def body(self, request: Request) -> bytes:
        """The request body, refused with 413 when it is larger than allowed (declared or sent).

        A body up to ``DRAIN_FACTOR`` times the limit is read to its end (and dropped) before the 413 goes out: a
        client that writes its whole body before it reads (urllib, requests) otherwise meets a connection closed
        under it, a broken pipe instead of the answer. A larger one is refused at once, the connection cut."""
        limit = self.settings.max_body_bytes
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit * DRAIN_FACTOR:
            raise errors.too_large(limit)
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit * DRAIN_FACTOR:
                raise errors.too_large(limit)
            if size <= limit:
                chunks.append(chunk)
        if size > limit:
            raise errors.too_large(limit)
        return b"".join(chunks)

    def parse(self, kind: type[Parsed], body: bytes) -> Parsed:
        try:
            parsed = kind.model_validate_json(body or b"null")
        except ValidationError as exc:
            raise errors.from_validation(exc) from None
        if isinstance(parsed, GenerationRequest):
            if parsed.model != self.settings.model:
                raise errors.not_found(
                    f"the model '{parsed.model}' does not exist: this server serves '{self.settings.model}'"
                )
            name = unsupported(parsed)
            if name is not None:
                why = WHY_UNSUPPORTED.get(name, "this server does not implement it")
                raise errors.bad_request(
                    f"'{name}' is not supported by this server ({why})", param=name, code="unsupported_parameter"
                )
        return parsed

    # -- routes -------------------------------------------------------------------------------------------------
    async def models(self, request: Request) -> Response:
        self.authorize(request)
        return _json(ModelList(data=[self._model()]))

    async def model(self, request: Request) -> Response:
        self.authorize(request)
        name = request.path_params["model"]
        if name != self.settings.model:
            raise errors.not_found(f"the model '{name}' does not exist", param=None)
        return _json(self._model())

    def _model(self) -> Model:
        return Model(id=self.settings.model, created=self.settings.created)

    async def chat(self, request: Request) -> Response:
        req = await self._admit(request, ChatRequest)
        return await self._answer(request, chat_inputs(req), req, chat=True)

    async def completions(self, request: Request) -> Response:
        req = await self._admit(request, CompletionRequest)
        return await self._answer(request, completion_inputs(req), req, chat=False)

    async def live(self, request: Request) -> Response:
        return JSONResponse({"status": "live"})

    async def ready(self, request: Request) -> Response:
        if self.is_draining():
            return JSONResponse({"status": "draining"}, status_code=503)
        if self.triton is None or not await self.triton.ready():
            return JSONResponse({"status": "the inference server is not ready"}, status_code=503)
        return JSONResponse({"status": "ready"})

    async def _admit(self, request: Request, kind: type[Parsed]) -> Parsed:
        self.authorize(request)
        if self.is_draining():
            raise errors.unavailable(DRAINING, code="server_draining")
        return self.parse(kind, await self.body(request))

    # -- answering ----------------------------------------------------------------------------------------------
    async def _answer(self, request: Request, translation: Translation, req: GenerationRequest, chat: bool) -> Response:
        assert self.triton is not None, "the app has not started"
        answer = Answer(translation, new_id("chatcmpl" if chat else "cmpl"), self.settings.model)
        pieces = self.triton.generate(translation)
        if not req.stream:

            async def collect() -> None:
                async for piece in pieces:
                    answer.add(piece)

            try:
                await until_disconnected(request, collect())
            except ClientGone:
                return Response(status_code=499)
            return _json(chat_completion(answer) if chat else completion(answer))
        try:
            first = await until_disconnected(request, pieces.__anext__())
        except ClientGone:
            return Response(status_code=499)
        except StopAsyncIteration:
            raise errors.internal("the inference server answered nothing") from None
        events = _events(first, pieces, answer, chat, req.include_usage)
        return StreamingResponse(
            events, media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        )


async def until_disconnected(request: Request, work: Awaitable[Any]) -> Any:
    """``work``'s result, unless the client disconnects first: then ``work`` is cancelled and ``ClientGone`` raised."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        task.cancel()
        with contextlib.suppress(BaseException):
            await task
        raise ClientGone
    finally:
        watcher.cancel()
        with contextlib.suppress(BaseException):
            await watcher


def sse(obj: BaseModel | dict[str, Any] | str, exclude: set[str] | None = None) -> str:
    """One server-sent event: ``data: <json>`` and a blank line."""
    if isinstance(obj, BaseModel):
        text = obj.model_dump_json(exclude=exclude)
    else:
        text = obj if isinstance(obj, str) else json.dumps(obj)
    return f"data: {text}\n\n"


async def _events(
    first: Piece, pieces: AsyncIterator[Piece], answer: Answer, chat: bool, include_usage: bool
) -> AsyncIterator[str]:
    """The SSE chunks of a streamed answer, ``data: [DONE]`` last; an error mid-stream is the last event before it."""
    build: Callable[[Answer, Piece], list[Any]] = chat_chunks if chat else completion_chunks
    exclude = None if include_usage else {"usage"}
    try:
        for chunk in build(answer, first):
            yield sse(chunk, exclude)
        async for piece in pieces:
            for chunk in build(answer, piece):
                yield sse(chunk, exclude)
        if include_usage:
            yield sse(usage_chunk(answer, chat))
    except OpenAIError as exc:
        yield sse(exc.body())
    yield sse("[DONE]")


def _json(model: BaseModel, status: int = 200) -> Response:
    return Response(model.model_dump_json(), status_code=status, media_type="application/json")


def _error_response(exc: OpenAIError) -> Response:
    headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
    return JSONResponse(exc.body(), status_code=exc.status, headers=headers)


async def _openai_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, OpenAIError)
    return _error_response(exc)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        error = errors.not_found(f"no such route: {request.method} {request.url.path}", code="unknown_url", param=None)
    else:
        error = OpenAIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}")
    return _error_response(error)


async def _internal_error(request: Request, exc: Exception) -> Response:
    """Anything unforeseen: logged with its traceback here, reported without it."""
    log.exception("request %s %s failed", request.method, request.url.path)
    return _error_response(errors.internal(f"internal error: {type(exc).__name__}"))


def create_app(settings: Settings) -> Starlette:
    """The app for ``settings``; its lifespan opens the gRPC channel to Triton and closes it."""
    frontend = Frontend(settings)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        frontend.triton = Triton(settings.triton_url, settings.timeout_s)
        try:
            yield
        finally:
            await frontend.triton.close()

    app = Starlette(
        routes=[
            Route("/v1/models", frontend.models, methods=["GET"]),
            Route("/v1/models/{model:path}", frontend.model, methods=["GET"]),
            Route("/v1/chat/completions", frontend.chat, methods=["POST"]),
            Route("/v1/completions", frontend.completions, methods=["POST"]),
            Route(LIVE_PATH, frontend.live, methods=["GET"]),
            Route(READY_PATH, frontend.ready, methods=["GET"]),
        ],
        exception_handlers={OpenAIError: _openai_error, HTTPException: _http_error, Exception: _internal_error},
        lifespan=lifespan,
    )
    app.state.frontend = frontend
    return app

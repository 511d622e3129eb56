"""OpenAI-shaped errors (``{"error": {"message", "type", "param", "code"}}``) and what each failure maps to.

One table from a failure to its HTTP status: a request this server cannot parse or does not accept (400, naming the
field), a bad API key (401), an unknown model (404), a body over the limit (413), a server over capacity (429), a
server draining or unreachable (503), anything else (500, the server's message and never a traceback).

The Triton side reports its refusals over the gRPC stream *in band*: an error response carries a message and no
status (``specdec.serving.client.SpecdecClient.stream`` says why). So a stream's error is classified by its
message, whose forms the entry points fix: the draining and overload texts, and a validation error that names its
input (``input 'max_tokens' ...``) or starts with the parameter's name (``temperature must be ...``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from specdec.serving.protocol import ABORTED, DRAINING, OVERLOADED, split_coded

CONTEXT_CODE = "context_length_exceeded"
_INPUT = re.compile(r"input '(?P<name>[A-Za-z_]+)'")
_FIRST_WORD = re.compile(r"^(unknown )?(?P<word>[A-Za-z_=]+)\b")


@dataclass
class OpenAIError(Exception):
    """A refused or failed request as OpenAI reports it: the HTTP status and the error object."""

    status: int
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None

    def __post_init__(self) -> None:
        super().__init__(self.message)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param=param, code=code)


def not_found(message: str, code: str = "model_not_found", param: str | None = "model") -> OpenAIError:
    return OpenAIError(404, message, param=param, code=code)


def unauthorized() -> OpenAIError:
    return OpenAIError(
        401,
        "missing or incorrect API key: send it as 'Authorization: Bearer <key>'",
        type="authentication_error",
        code="invalid_api_key",
    )


def too_large(limit: int) -> OpenAIError:
    return OpenAIError(413, f"the request body is larger than this server accepts ({limit} bytes)", code="too_large")


def unavailable(message: str, code: str = "unavailable") -> OpenAIError:
    return OpenAIError(503, message, type="service_unavailable_error", code=code)


def overloaded(message: str) -> OpenAIError:
    return OpenAIError(429, message, type="rate_limit_error", code="server_overloaded")


def internal(message: str) -> OpenAIError:
    return OpenAIError(500, message, type="server_error", code="internal_error")


def _param(loc: tuple[int | str, ...]) -> str | None:
    """A pydantic location as OpenAI names a field: ``messages[0].content``."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif not part.startswith(("function-", "union[", "list[", "str", "int", "tagged")) and part:
            out += f".{part}" if out else part
    return out or None


def from_validation(exc: ValidationError) -> OpenAIError:
    """The first problem of a request body: malformed JSON, an unknown field, a wrong type or value, by name."""
    errors = exc.errors(include_url=False)
    first = errors[0]
    param = _param(tuple(first["loc"]))
    if first["type"] == "json_invalid":
        detail = first.get("ctx", {}).get("error", first["msg"])
        return bad_request(f"the request body is not valid JSON: {detail}", code="invalid_json")
    if first["type"] == "extra_forbidden":
        return bad_request(f"unrecognized request argument supplied: {param}", param=param, code="unknown_parameter")
    if first["type"] == "missing":
        return bad_request(f"missing required parameter: '{param}'", param=param, code="missing_required_parameter")
    if first["type"] == "model_type" and not first["loc"]:
        return bad_request("the request body must be a JSON object", code="invalid_type")
    got = first.get("input")
    shown = repr(got) if not isinstance(got, (dict, list)) or len(repr(got)) < 80 else type(got).__name__
    return bad_request(f"invalid value for '{param}': {first['msg']} (got {shown})", param=param, code="invalid_value")


def from_triton(message: str, status: str | None, params: Mapping[str, str]) -> OpenAIError:
    """The OpenAI error of a Triton refusal or failure.

    ``status``: the gRPC status name where the transport gave one (``StatusCode.INVALID_ARGUMENT``); a stream's
    error carries it at the head of its message instead (``protocol.coded``). ``params``: each Triton input name
    (and ``prompt``) -> the OpenAI field it comes from in this request, so ``input 'max_tokens'`` is reported as
    ``max_completion_tokens`` where the client sent that.
    """
    in_band, message = split_coded(message)
    status = (status or in_band or "").removeprefix("StatusCode.")
    if message.startswith(OVERLOADED):
        return overloaded(message)
    if message.startswith((DRAINING, ABORTED)):
        return unavailable(message, code="server_draining")
    if status == "UNAVAILABLE":
        return unavailable(f"the inference server is not reachable: {message or status}")
    if status == "DEADLINE_EXCEEDED":
        return OpenAIError(504, f"the inference server did not answer in time: {message}", "timeout", code="timeout")
    if status == "INVALID_ARGUMENT":
        name = _named_input(message, params)
        param = params.get(name, name) if name else None
        code = CONTEXT_CODE if message.startswith("prompt has") and "context holds" in message else "invalid_value"
        return bad_request(message, param=param, code=code)
    return internal(message or "the inference server failed without a message")


def _named_input(message: str, params: Mapping[str, str]) -> str | None:
    """The Triton input a validation message is about: ``input 'x'``, else its first word when that is an input."""
    found = _INPUT.search(message)
    if found:
        return found.group("name")
    first = _FIRST_WORD.match(message)
    word = first.group("word") if first else ""
    return word if word in params else None

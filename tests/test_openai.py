"""The OpenAI frontend without a server: translation, error mapping, response shapes and SSE framing.

The app runs in-process (Starlette's ``TestClient``) in front of a scripted stand-in for the Triton stream, so these
check the frontend's own logic; ``test_openai_server.py`` checks it against a real ``specdec serve``.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import numpy as np
import pytest

pytest.importorskip("starlette", reason="starlette (the `serve` extra) is not installed")
from starlette.testclient import TestClient

from specdec.serving.openai import errors
from specdec.serving.openai.app import DRAIN_FACTOR, Settings, create_app
from specdec.serving.openai.errors import OpenAIError
from specdec.serving.openai.schema import ChatRequest, CompletionRequest
from specdec.serving.openai.translate import (
    Piece,
    TokenLogprob,
    Translation,
    chat_inputs,
    completion_inputs,
    piece_of,
    prompt_of,
)
from specdec.serving.protocol import ABORTED, DRAINING, coded

MODEL = "smol-test"
METRICS = {"acceptance_rate": 0.5, "accepted_draft_tokens": 2, "draft_tokens": 4, "target_calls": 3}


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **fields}


def text(inputs: dict[str, np.ndarray], name: str) -> Any:
    values = inputs[name].reshape(-1).tolist()
    values = [v.decode() if isinstance(v, bytes) else v for v in values]
    return values[0] if len(values) == 1 and name not in ("stop", "stop_token_ids", "prompt_ids") else values


# --------------------------------------------------------------------------- translation


def test_chat_request_becomes_the_stream_models_inputs() -> None:
    req = ChatRequest.model_validate(
        chat(
            messages=[
                {"role": "developer", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Hello "}, {"type": "text", "text": "there"}]},
                {"role": "assistant", "content": "Hi!"},
                {"role": "user", "content": "And now?"},
            ],
            max_completion_tokens=12,
            stop="END",
            seed=5,
            top_k=3,
            method="ar",
        )
    )
    t = chat_inputs(req)
    assert json.loads(text(t.inputs, "messages")) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello there"},
        {"role": "assistant", "content": "Hi!"},
        {"role": "user", "content": "And now?"},
    ]
    assert text(t.inputs, "max_tokens") == 12 and t.params["max_tokens"] == "max_completion_tokens"
    assert text(t.inputs, "temperature") == 1.0  # OpenAI's default, not specdec's greedy one
    assert text(t.inputs, "stop") == ["END"] and text(t.inputs, "seed") == 5 and text(t.inputs, "method") == "ar"
    assert t.inputs["max_tokens"].dtype == np.int32 and t.inputs["temperature"].dtype == np.float32
    # what the client did not set is not sent: the server's defaults apply, and a server without the newer
    # inputs still serves a request that does not use them
    for absent in ("n", "logprobs", "top_logprobs", "min_tokens", "stop_token_ids", "continue_final_message", "top_p"):
        assert absent not in t.inputs
    assert t.n == 1 and not t.logprobs


def test_chat_extensions_and_logprobs_are_sent() -> None:
    req = ChatRequest.model_validate(
        chat(
            temperature=0,
            logprobs=True,
            top_logprobs=3,
            n=2,
            min_tokens=4,
            stop_token_ids=[2, 7],
            messages=[{"role": "user", "content": "Say"}, {"role": "assistant", "content": "Well,"}],
            continue_final_message=True,
        )
    )
    t = chat_inputs(req)
    assert text(t.inputs, "temperature") == 0.0 and text(t.inputs, "n") == 2 and text(t.inputs, "min_tokens") == 4
    assert text(t.inputs, "logprobs") is True and text(t.inputs, "top_logprobs") == 3
    assert text(t.inputs, "stop_token_ids") == [2, 7] and text(t.inputs, "continue_final_message") is True
    assert t.n == 2 and t.logprobs and t.top_logprobs == 3


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"max_tokens": 3, "max_completion_tokens": 4}, "max_tokens"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"continue_final_message": True}, "continue_final_message"),
        ({"messages": [{"role": "user", "content": "x", "name": "bob"}]}, "messages[0].name"),
    ],
)
def test_chat_translation_refuses_what_cannot_be_sent(fields: dict, param: str) -> None:
    with pytest.raises(OpenAIError) as refused:
        chat_inputs(ChatRequest.model_validate(chat(**fields)))
    assert refused.value.status == 400 and refused.value.param == param


def test_completion_prompts() -> None:
    assert prompt_of("abc") == "abc" and prompt_of(["abc"]) == "abc"
    assert prompt_of([1, 2, 3]) == [1, 2, 3] and prompt_of([[4, 5]]) == [4, 5]
    for several in (["a", "b"], [[1], [2]]):
        with pytest.raises(OpenAIError, match="one prompt per request") as refused:
            prompt_of(several)
        assert refused.value.param == "prompt"
    with pytest.raises(OpenAIError, match="empty"):
        prompt_of([])
    t = completion_inputs(CompletionRequest.model_validate({"model": MODEL, "prompt": [3, 4], "logprobs": 2}))
    assert text(t.inputs, "prompt_ids") == [3, 4] and "text_input" not in t.inputs
    assert text(t.inputs, "logprobs") is True and text(t.inputs, "top_logprobs") == 2
    t = completion_inputs(CompletionRequest.model_validate({"model": MODEL, "prompt": "Once", "logprobs": 0}))
    assert text(t.inputs, "text_input") == "Once" and t.logprobs and t.top_logprobs == 0


# --------------------------------------------------------------------------- errors


PARAMS = chat_inputs(ChatRequest.model_validate(chat(max_completion_tokens=5))).params


@pytest.mark.parametrize(
    ("message", "status", "http", "param"),
    [
        (DRAINING, None, 503, None),
        (ABORTED, None, 503, None),
        ("the server is overloaded (300 requests in flight): retry later", None, 429, None),
        (coded("input 'max_tokens' must be between 1 and 1023", "INVALID_ARG"), None, 400, "max_completion_tokens"),
        (
            coded("max_tokens must be between 1 and 1023 (the context holds 1024 tokens), got 5000", "INVALID_ARG"),
            None,
            400,
            None,
        ),
        (
            coded("temperature must be a finite number >= 0 (0 = greedy), got -1", "INVALID_ARG"),
            None,
            400,
            "temperature",
        ),
        (coded("unknown method 'x': choose one of ems, ar", "INVALID_ARG"), None, 400, "method"),
        (coded("unknown input(s) ['n']", "INVALID_ARG"), None, 400, None),
        (coded("input 'text_input' is empty: send a non-empty prompt", "INVALID_ARG"), None, 400, "messages"),
        (
            coded(
                "prompt has 2000 tokens but the context holds 1024 (prompt plus at least one new token)", "INVALID_ARG"
            ),
            None,
            400,
            None,
        ),
        (coded("internal error: RuntimeError: boom", "INTERNAL"), None, 500, None),
        ("input 'max_tokens' must be between 1 and 1023", None, 500, None),  # no status at all: the server's
        ("something nobody foresaw", None, 500, None),
        ("beam_width must be 1", "StatusCode.INVALID_ARGUMENT", 400, "beam_width"),
        ("failed to connect to all addresses", "StatusCode.UNAVAILABLE", 503, None),
        ("Deadline Exceeded", "StatusCode.DEADLINE_EXCEEDED", 504, None),
    ],
)
def test_triton_errors_map_to_openai_statuses(message: str, status: str | None, http: int, param: str | None) -> None:
    error = errors.from_triton(message, status, PARAMS)
    assert error.status == http, error
    if param is not None:
        assert error.param == param
    if "max_tokens must be" in message:
        assert error.param == "max_completion_tokens"  # the field this client sent
    if message.startswith("prompt has"):
        assert error.code == errors.CONTEXT_CODE and error.param == "messages"
    body = error.body()["error"]
    assert set(body) == {"message", "type", "param", "code"} and body["message"]


# --------------------------------------------------------------------------- responses


def _tensors(**values: Any) -> dict[str, np.ndarray]:
    out = {
        "text_output": np.array([values.get("text", "").encode()], dtype=object),
        "output_ids": np.array(values.get("ids", []), dtype=np.int32),
        "finish_reason": np.array([values.get("finish", "").encode()], dtype=object),
        **{k: np.array([v]) for k, v in METRICS.items()},
        "mean_batch_size": np.array([1.5], dtype=np.float32),
        "beam_widths": np.array([], dtype=np.int32),
    }
    if "index" in values:
        out["index"] = np.array([values["index"]], dtype=np.int32)
    if "logprobs" in values:
        rows = values["logprobs"]
        out["output_logprobs"] = np.array([lp for _, lp, _ in rows], dtype=np.float32)
        out["output_tokens"] = np.array([tok for tok, _, _ in rows], dtype=object)
        k = len(rows[0][2])
        out["top_logprobs"] = np.array([[lp for _, lp in top] for _, _, top in rows], dtype=np.float32).reshape(-1, k)
        out["top_logprob_tokens"] = np.array([[t for t, _ in top] for _, _, top in rows], dtype=object).reshape(-1, k)
        out["top_logprob_ids"] = np.zeros((len(rows), k), dtype=np.int32)
    return out


def test_a_response_with_logprobs_becomes_a_piece() -> None:
    rows = [
        (b" Hel", -0.25, [(b" Hel", -0.25), (b" Hi", -1.5)]),
        (b"\xe2\x80", -0.5, [(b"\xe2\x80", -0.5), (b"!", -2.0)]),
    ]
    piece = piece_of(_tensors(text=" Hel", ids=[10, 11], finish="context", index=1, logprobs=rows))
    assert (
        piece.index == 1 and piece.text == " Hel" and piece.token_ids == [10, 11] and piece.finish_reason == "context"
    )
    assert piece.metrics["draft_tokens"] == 4 and piece.metrics["beam_widths"] == []
    assert piece.logprobs[1] == TokenLogprob(b"\xe2\x80", -0.5, ((b"\xe2\x80", -0.5), (b"!", -2.0)))
    plain = piece_of(_tensors(text="x", ids=[1]))
    assert plain.index == 0 and plain.logprobs == [] and not plain.finished


# --------------------------------------------------------------------------- the app, in front of a scripted stream


class Scripted:
    """Stands in for ``triton.Triton``: answers every request with the pieces (or the error) it is given."""

    def __init__(self) -> None:
        self.script: list[Piece | OpenAIError] = []
        self.sent: list[Translation] = []
        self.is_ready = True

    async def ready(self) -> bool:
        return self.is_ready

    async def close(self) -> None:
        return None

    async def generate(self, translation: Translation) -> AsyncIterator[Piece]:
        self.sent.append(translation)
        for item in self.script:
            if isinstance(item, OpenAIError):
                raise item
            yield item


def piece(text: str, index: int = 0, finish: str = "", ids: int = 1, **extra: Any) -> Piece:
    return Piece(index, text, list(range(ids)), finish, {**METRICS, "mean_batch_size": 1.0}, **extra)


@pytest.fixture
def app(tmp_path: Any) -> Iterator[tuple[TestClient, Scripted]]:
    settings = Settings("127.0.0.1:1", MODEL, api_key="sekret", max_body_bytes=4096, control_dir=tmp_path)
    application = create_app(settings)
    scripted = Scripted()
    with TestClient(application, raise_server_exceptions=False) as client:
        application.state.frontend.triton = scripted
        client.headers["Authorization"] = "Bearer sekret"
        yield client, scripted


def events(body: str) -> list[Any]:
    """The SSE events of a body, checking the framing: ``data: ...`` lines each followed by a blank line."""
    assert body.endswith("\n\n")
    frames = body.split("\n\n")[:-1]
    assert all(frame.startswith("data: ") and "\n" not in frame for frame in frames), frames
    return [frame.removeprefix("data: ") if frame == "data: [DONE]" else json.loads(frame[6:]) for frame in frames]


def test_unary_chat_has_openais_shape_with_usage_and_the_extension(app: tuple[TestClient, Scripted]) -> None:
    client, scripted = app
    scripted.script = [piece("Hel", prompt_tokens=7), piece("lo", finish="stop", ids=2)]
    resp = client.post("/v1/chat/completions", json=chat(temperature=0))
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["object"] == "chat.completion" and body["model"] == MODEL and body["id"].startswith("chatcmpl-")
    (choice,) = body["choices"]
    assert choice["message"] == {"role": "assistant", "content": "Hello", "refusal": None}
    assert choice["finish_reason"] == "stop" and choice["logprobs"] is None
    assert choice["specdec"]["draft_tokens"] == 4 and choice["specdec"]["finish_reason"] == "stop"
    assert body["usage"] == {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}


def test_streamed_chat_frames_sse_with_usage_and_done(app: tuple[TestClient, Scripted]) -> None:
    client, scripted = app
    scripted.script = [piece("Hel", prompt_tokens=7), piece("", ids=1), piece("lo", finish="context", ids=2)]
    resp = client.post(
        "/v1/chat/completions", json=chat(stream=True, stream_options={"include_usage": True}, temperature=0)
    )
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
    got = events(resp.text)
    assert got[-1] == "[DONE]"
    chunks = got[:-1]
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[:-1]) == "Hello"
    assert all(c["usage"] is None for c in chunks[:-1])  # include_usage: null on all but the last
    end = chunks[-2]["choices"][0]
    assert end["finish_reason"] == "length" and end["specdec"]["finish_reason"] == "context"  # a full context
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["total_tokens"] == 11
    # without include_usage, no usage field at all
    scripted.script = [piece("ok", finish="stop")]
    plain = events(client.post("/v1/chat/completions", json=chat(stream=True)).text)
    assert all("usage" not in c for c in plain[:-1])


def test_n_choices_and_logprobs_in_openais_shapes(app: tuple[TestClient, Scripted]) -> None:
    client, scripted = app
    lp = [TokenLogprob(b"A", -0.1, ((b"A", -0.1), (b"B", -2.5)))]
    scripted.script = [
        piece("A", index=1, logprobs=lp),
        piece("A", index=0, logprobs=lp),
        piece("", index=0, finish="stop", ids=0),
        piece("", index=1, finish="length", ids=0),
    ]
    body = client.post("/v1/chat/completions", json=chat(n=2, logprobs=True, top_logprobs=1)).json()
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert [c["finish_reason"] for c in body["choices"]] == ["stop", "length"]
    (entry,) = body["choices"][0]["logprobs"]["content"]
    assert entry == {
        "token": "A",
        "logprob": pytest.approx(-0.1),
        "bytes": [65],
        "top_logprobs": [
            {"token": "A", "logprob": pytest.approx(-0.1), "bytes": [65]},
            {"token": "B", "logprob": pytest.approx(-2.5), "bytes": [66]},
        ],
    }
    body = client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "n": 2, "logprobs": 1}).json()
    assert body["object"] == "text_completion" and body["choices"][1]["text"] == "A"
    assert body["choices"][0]["logprobs"] == {
        "tokens": ["A"],
        "token_logprobs": [pytest.approx(-0.1)],
        "top_logprobs": [{"A": pytest.approx(-0.1), "B": pytest.approx(-2.5)}],
        "text_offset": [0],
    }


def test_streamed_completion_chunks(app: tuple[TestClient, Scripted]) -> None:
    client, scripted = app
    scripted.script = [piece("Once"), piece(" upon", finish="length")]
    got = events(client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "stream": True}).text)
    assert got[-1] == "[DONE]"
    assert [c["choices"][0]["text"] for c in got[:-1]] == ["Once", " upon"]
    assert [c["choices"][0]["finish_reason"] for c in got[:-1]] == [None, "length"]
    assert all(c["object"] == "text_completion" for c in got[:-1])


def test_errors_before_and_after_a_stream_begins(app: tuple[TestClient, Scripted]) -> None:
    client, scripted = app
    scripted.script = [errors.bad_request("temperature must be ...", param="temperature")]
    resp = client.post("/v1/chat/completions", json=chat(stream=True))
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "temperature"  # a status, not a 200 stream
    scripted.script = [piece("Hel"), errors.unavailable("the server is shutting down: aborted")]
    got = events(client.post("/v1/chat/completions", json=chat(stream=True)).text)
    assert got[-1] == "[DONE]" and got[-2]["error"]["message"] == "the server is shutting down: aborted"
    scripted.script = [errors.overloaded("the server is overloaded")]
    assert client.post("/v1/completions", json={"model": MODEL, "prompt": "x"}).status_code == 429


def error_of(resp: Any, status: int) -> dict:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert "Traceback" not in resp.text
    return body["error"]


def test_refusals_are_openai_errors_naming_the_field(app: tuple[TestClient, Scripted]) -> None:
    client, scripted = app
    post = client.post
    headers = {"Content-Type": "application/json"}
    assert "JSON" in error_of(post("/v1/chat/completions", content=b'{"model": ', headers=headers), 400)["message"]
    assert error_of(post("/v1/chat/completions", content=b"[1, 2]", headers=headers), 400)["message"]
    assert error_of(post("/v1/chat/completions", json=chat(temperature="hot")), 400)["param"] == "temperature"
    assert error_of(post("/v1/chat/completions", json=chat(temperature=3)), 400)["param"] == "temperature"
    assert error_of(post("/v1/chat/completions", json=chat(max_tokens=True)), 400)["param"] == "max_tokens"
    assert error_of(post("/v1/chat/completions", json=chat(n=0)), 400)["param"] == "n"
    assert error_of(post("/v1/chat/completions", json=chat(seed=-1)), 400)["param"] == "seed"
    bad_role = chat(messages=[{"role": "tool", "content": "x"}])
    assert error_of(post("/v1/chat/completions", json=bad_role), 400)["param"] == "messages[0].role"
    image = chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])
    assert error_of(post("/v1/chat/completions", json=image), 400)["param"].startswith("messages[0].content")
    assert error_of(post("/v1/chat/completions", json={"model": MODEL}), 400)["param"] == "messages"
    unknown = error_of(post("/v1/chat/completions", json=chat(frobnicate=1)), 400)
    assert unknown["param"] == "frobnicate" and unknown["code"] == "unknown_parameter"
    for field, value in (("tools", [{"type": "function"}]), ("response_format", {"type": "json_object"})):
        refused = error_of(post("/v1/chat/completions", json=chat(**{field: value})), 400)
        assert refused["param"] == field and refused["code"] == "unsupported_parameter" and field in refused["message"]
    refused = error_of(post("/v1/chat/completions", json=chat(presence_penalty=0.5)), 400)
    assert refused["param"] == "presence_penalty"
    # a field at its neutral value changes nothing and passes
    scripted.script = [piece("ok", finish="stop")]
    assert post("/v1/chat/completions", json=chat(presence_penalty=0, tools=[], logit_bias={})).status_code == 200
    assert error_of(post("/v1/completions", json={"model": MODEL, "prompt": "x", "echo": True}), 400)["param"] == "echo"
    assert error_of(post("/v1/chat/completions", json=chat(model="gpt-4o")), 404)["code"] == "model_not_found"
    # read to its end before the 413 (a client that writes all before it reads gets the answer), or, far past the
    # limit, refused from its declared length alone
    for size in (5000, 4096 * DRAIN_FACTOR + 1):
        assert error_of(post("/v1/chat/completions", content=b"x" * size, headers=headers), 413)["code"] == "too_large"
    assert error_of(client.get("/v1/nothing"), 404)["code"] == "unknown_url"
    assert error_of(client.get("/v1/chat/completions"), 405)
    assert not scripted.sent[:-1], "a refused request reached the server"


def test_api_key_models_health_and_drain(app: tuple[TestClient, Scripted], tmp_path: Any) -> None:
    client, scripted = app
    assert client.get("/v1/models").json()["data"][0]["id"] == MODEL
    assert client.get(f"/v1/models/{MODEL}").json()["object"] == "model"
    error_of(client.get("/v1/models/other"), 404)
    for auth in ({"Authorization": "Bearer wrong"}, {"Authorization": ""}):
        assert error_of(client.get("/v1/models", headers=auth), 401)["code"] == "invalid_api_key"
        assert error_of(client.post("/v1/chat/completions", json=chat(), headers=auth), 401)
    assert client.get("/health/live").status_code == 200 and client.get("/health/ready").status_code == 200
    scripted.is_ready = False
    assert client.get("/health/ready").status_code == 503
    scripted.is_ready = True
    (tmp_path / "drain").touch()  # the launcher's flag (``OpenAIFrontend.drain``)
    assert client.get("/health/ready").status_code == 503 and client.get("/health/live").status_code == 200
    assert error_of(client.post("/v1/chat/completions", json=chat()), 503)["code"] == "server_draining"


def test_an_unforeseen_failure_is_a_500_without_traceback(app: tuple[TestClient, Scripted]) -> None:
    client, scripted = app

    async def broken(translation: Translation) -> AsyncIterator[Piece]:
        raise ZeroDivisionError("secret detail")
        yield  # pragma: no cover

    scripted.generate = broken  # type: ignore[method-assign]
    error = error_of(client.post("/v1/chat/completions", json=chat()), 500)
    assert error["type"] == "server_error" and "ZeroDivisionError" in error["message"]


def test_the_frontend_process_drains_and_exits_zero(tmp_path: Any) -> None:
    """``OpenAIFrontend`` (what ``specdec serve`` runs): listens, takes its key from the environment, refuses new
    requests and reports not ready once drained, exits 0 on SIGTERM and leaves nothing behind."""
    import urllib.request

    from specdec.serving.openai.process import OpenAIFrontend, http_status
    from specdec.serving.server import free_ports, port_free

    (port, nowhere) = free_ports(2)
    frontend = OpenAIFrontend(f"127.0.0.1:{nowhere}", MODEL, port=port, api_key="sekret", graceful_s=5)
    try:
        frontend.start().wait_ready(timeout_s=120)
        assert frontend.api_key not in " ".join(frontend.command())  # the key travels in the environment only
        assert http_status(f"{frontend.url}/health/live") == 200
        assert http_status(f"{frontend.url}/health/ready") == 503  # nothing serves the models
        assert http_status(f"{frontend.url}/v1/models") == 401
        request = urllib.request.Request(f"{frontend.url}/v1/models", headers={"Authorization": "Bearer sekret"})
        with urllib.request.urlopen(request, timeout=30) as resp:
            assert json.loads(resp.read())["data"][0]["id"] == MODEL
        request = urllib.request.Request(
            f"{frontend.url}/v1/completions",
            data=json.dumps({"model": MODEL, "prompt": "x"}).encode(),
            headers={"Authorization": "Bearer sekret", "Content-Type": "application/json"},
        )
        with pytest.raises(urllib.error.HTTPError) as unreachable:
            urllib.request.urlopen(request, timeout=60)
        assert unreachable.value.code == 503 and json.loads(unreachable.value.read())["error"]["code"] == "unavailable"
        frontend.drain()
        with pytest.raises(urllib.error.HTTPError) as draining:
            urllib.request.urlopen(request, timeout=60)
        assert draining.value.code == 503
        assert json.loads(draining.value.read())["error"]["code"] == "server_draining"
        control, log = frontend.control.directory, frontend.log_file
    finally:
        code = frontend.stop()
    assert code == 0, frontend.read_log()
    assert control is not None and not control.exists() and log is not None and not log.exists()
    assert port_free("127.0.0.1", port)

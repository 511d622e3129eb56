"""OpenAI requests -> the inputs of ``specdec_stream``; its responses -> ``Piece``s. Pure numpy, no I/O.

Every tensor is typed by its ``protocol.TensorSpec``, so what the frontend sends is what the entry models declare.
A parameter the client did not set is not sent (the server's default applies), except ``temperature``: OpenAI's
default is 1.0 (sampling) where specdec's own is 0 (greedy), and an OpenAI client that sends no temperature
expects OpenAI's (docs/openai.md).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from specdec.serving import protocol
from specdec.serving.openai.errors import bad_request
from specdec.serving.openai.schema import ChatRequest, CompletionRequest, GenerationRequest, Message

OPENAI_DEFAULT_TEMPERATURE = 1.0

INPUTS: dict[str, protocol.TensorSpec] = {s.name: s for s in protocol.CLIENT_INPUTS}
#: each Triton input -> the OpenAI field it comes from (where the names differ, ``params_of`` adjusts per request)
OPENAI_FIELD = {name: name for name in INPUTS} | {"text_input": "prompt", "prompt_ids": "prompt", "prompt": "prompt"}
#: the outputs read from each response
INDEX, LOGPROBS, TOKENS = protocol.INDEX.name, protocol.OUTPUT_LOGPROBS.name, protocol.OUTPUT_TOKENS.name
TOP_IDS, TOP_LOGPROBS = protocol.TOP_LOGPROB_IDS.name, protocol.TOP_LOGPROBS.name
TOP_TOKENS = protocol.TOP_LOGPROB_TOKENS.name
PROMPT_TOKENS, COMPLETION_TOKENS = "prompt_tokens", "completion_tokens"
#: the server's finish reasons that OpenAI's field reports otherwise (the ``specdec`` extension keeps the server's)
FINISH_REASON = {"context": "length", "timeout": "length", "cancelled": "stop"}


@dataclass
class Translation:
    """One OpenAI request as ``specdec_stream`` takes it."""

    inputs: dict[str, np.ndarray]
    #: Triton input name -> the OpenAI field it came from (errors name the client's field)
    params: dict[str, str]
    n: int
    logprobs: bool
    top_logprobs: int
    method: str | None


def _generation(req: GenerationRequest) -> dict[str, Any]:
    """The sampling, stopping and specdec parameters both endpoints share, by Triton input name."""
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options is only allowed when stream is true", param="stream_options")
    stop = [req.stop] if isinstance(req.stop, str) else req.stop
    return {
        "max_tokens": req.new_tokens(),
        "temperature": OPENAI_DEFAULT_TEMPERATURE if req.temperature is None else req.temperature,
        "top_p": req.top_p,
        "top_k": req.top_k,
        "seed": req.seed,
        "stop": stop or None,
        "stop_token_ids": req.stop_token_ids or None,
        "min_tokens": req.min_tokens,
        "n": req.choices if req.choices > 1 else None,
        "method": req.method,
        "num_draft_tokens": req.num_draft_tokens,
        "beam_width": req.beam_width,
        "dsbd_threshold": req.dsbd_threshold,
        "dsbd_min_width": req.dsbd_min_width,
        "memory_mode": req.memory_mode,
        "timeout_ms": req.timeout_ms,
        "stream": True,
    }


def _tensors(values: Mapping[str, Any]) -> dict[str, np.ndarray]:
    return {name: protocol.array(INPUTS[name], value) for name, value in values.items() if value is not None}


def conversation(messages: list[Message], continue_final: bool) -> str:
    """The ``messages`` input: the turns as a JSON array of ``{role, content}`` (``developer`` sent as ``system``)."""
    for i, message in enumerate(messages):
        if message.name is not None:
            raise bad_request(
                "a message's 'name' is not supported: the chat template has no place for it", f"messages[{i}].name"
            )
    if continue_final and messages[-1].role != "assistant":
        raise bad_request(
            "continue_final_message needs the last message to be the assistant's (the text to continue)",
            "continue_final_message",
        )
    turns = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in messages]
    return json.dumps(turns, ensure_ascii=False)


def chat_inputs(req: ChatRequest) -> Translation:
    """``/v1/chat/completions``: the conversation and the parameters."""
    if req.max_tokens is not None and req.max_completion_tokens is not None:
        raise bad_request("send max_completion_tokens or max_tokens, not both", param="max_tokens")
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs needs logprobs set to true", param="top_logprobs")
    values = _generation(req)
    values["messages"] = conversation(req.messages, bool(req.continue_final_message))
    values["continue_final_message"] = True if req.continue_final_message else None
    if req.logprobs:
        values["logprobs"] = True
        values["top_logprobs"] = req.top_logprobs or 0
    params = dict(OPENAI_FIELD, prompt="messages", text_input="messages", prompt_ids="messages")
    if req.max_completion_tokens is not None:
        params["max_tokens"] = "max_completion_tokens"
    return Translation(_tensors(values), params, req.choices, bool(req.logprobs), req.top_logprobs or 0, req.method)


def prompt_of(prompt: Any) -> str | list[int]:
    """The one prompt of a completions request: a string or token ids (a list of one of either is unwrapped).

    Several prompts in one request are refused: each would be its own set of choices, which a client can as well
    send as its own request (served in the same batch).
    """
    if isinstance(prompt, str):
        return prompt
    if not prompt:
        raise bad_request("prompt is empty: send a string or a list of token ids", param="prompt")
    if all(isinstance(p, int) for p in prompt):
        return list(prompt)
    if len(prompt) > 1:
        raise bad_request(
            f"prompt holds {len(prompt)} prompts: this server takes one prompt per request (send one request each)",
            param="prompt",
        )
    return prompt_of(prompt[0])


def completion_inputs(req: CompletionRequest) -> Translation:
    """``/v1/completions``: the prompt (text or token ids, no chat template) and the parameters."""
    values = _generation(req)
    prompt = prompt_of(req.prompt)
    values["text_input" if isinstance(prompt, str) else "prompt_ids"] = prompt
    if req.logprobs is not None:
        values["logprobs"] = True
        values["top_logprobs"] = req.logprobs
    return Translation(
        _tensors(values), dict(OPENAI_FIELD), req.choices, req.logprobs is not None, req.logprobs or 0, req.method
    )


# --------------------------------------------------------------------------- responses


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token: its raw bytes, the target's log-probability of it, and the top alternatives."""

    token: bytes
    logprob: float
    top: tuple[tuple[bytes, float], ...] = ()


@dataclass
class Piece:
    """What one response of ``specdec_stream`` adds to one choice."""

    index: int
    text: str  # the text delta
    token_ids: list[int]  # the tokens this response adds
    finish_reason: str  # the server's, '' while the choice goes on
    metrics: dict[str, Any]  # ``protocol.REQUEST_METRICS`` by name: the choice's so far
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_tokens: int | None = None
    completion_tokens: int | None = None  # the choice's tokens so far, where the server reports it

    @property
    def finished(self) -> bool:
        return bool(self.finish_reason)


def _values(array: np.ndarray | None) -> list[Any]:
    return [] if array is None else np.asarray(array).reshape(-1).tolist()


def _one(outputs: Mapping[str, np.ndarray], name: str) -> Any:
    values = _values(outputs.get(name))
    return values[0] if values else None


def _float32(value: float) -> float:
    return float(np.format_float_positional(np.float32(value), unique=True, trim="-"))


def _text(value: Any) -> str:
    return value.decode("utf-8", errors="replace") if isinstance(value, bytes) else str(value)


def _logprobs(outputs: Mapping[str, np.ndarray]) -> list[TokenLogprob]:
    """The per-token log-probabilities of a response (none when the request did not ask for them)."""
    values = _values(outputs.get(LOGPROBS))
    if not values:
        return []
    tokens = [t if isinstance(t, bytes) else str(t).encode() for t in _values(outputs.get(TOKENS))]
    top_tokens = outputs.get(TOP_TOKENS)
    top_values = outputs.get(TOP_LOGPROBS)
    rows = len(values)
    k = 0 if top_values is None or np.asarray(top_values).size == 0 else int(np.asarray(top_values).size // rows)
    top_t = np.asarray(top_tokens).reshape(rows, k) if k else np.empty((rows, 0), dtype=object)
    top_v = np.asarray(top_values).reshape(rows, k) if k else np.empty((rows, 0), dtype=np.float32)
    return [
        TokenLogprob(
            tokens[i] if i < len(tokens) else b"",
            _float32(values[i]),
            tuple((bytes(top_t[i, j]), _float32(top_v[i, j])) for j in range(k)),
        )
        for i in range(rows)
    ]


def piece_of(outputs: Mapping[str, np.ndarray]) -> Piece:
    """One response's tensors (by name) as a ``Piece``."""
    metrics = {spec.name: _one(outputs, spec.name) for spec in protocol.REQUEST_METRICS if spec.dims == (1,)}
    for spec in protocol.REQUEST_METRICS:  # a float32 as the number it is (0.22222222, not 0.2222222238779068)
        if spec.dtype == "TYPE_FP32" and metrics.get(spec.name) is not None:
            metrics[spec.name] = _float32(metrics[spec.name])
    metrics["beam_widths"] = [int(w) for w in _values(outputs.get("beam_widths"))]
    index = _one(outputs, INDEX)
    prompt_tokens, completion_tokens = _one(outputs, PROMPT_TOKENS), _one(outputs, COMPLETION_TOKENS)
    return Piece(
        index=0 if index is None else int(index),
        text=_text(_one(outputs, protocol.TEXT_OUTPUT.name) or b""),
        token_ids=[int(t) for t in _values(outputs.get(protocol.OUTPUT_IDS.name))],
        finish_reason=_text(_one(outputs, protocol.FINISH_REASON.name) or b""),
        metrics=metrics,
        logprobs=_logprobs(outputs),
        prompt_tokens=None if prompt_tokens is None else int(prompt_tokens),
        completion_tokens=None if completion_tokens is None else int(completion_tokens),
    )


def openai_finish_reason(reason: str) -> str:
    """The server's finish reason as OpenAI's field says it (``stop`` or ``length``)."""
    return FINISH_REASON.get(reason, reason)

"""The OpenAI API's request and response bodies as pydantic models, faithful to OpenAI's field names and shapes.

Requests are validated strictly (``extra="forbid"``, no string-to-number coercion): a field this server does not
know, or a value of the wrong type, is refused with 400 naming the field, as OpenAI itself refuses an
unrecognized argument. OpenAI fields that specdec does not implement (tools, penalties, response formats, ...) are
declared so that their *neutral* value (absent, null, 0, ``{}``, ...) passes; any other value is refused by
``unsupported`` with 400 naming the field, never silently ignored. The specdec extensions (``top_k``,
``min_tokens``, ``stop_token_ids``, ``method``, ...) use vLLM's names where vLLM has them.

Responses are built from these models and dumped as JSON; the ``specdec`` extension field (the speculation
metrics of a choice) is left out where it is not set, and ordinary clients ignore it where it is.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

#: OpenAI's own bound on ``top_logprobs``; the served engine's too
MAX_TOP_LOGPROBS = 20
#: choices per request at most (each one is a sequence of the engine's batch)
MAX_N = 16
INT32_MAX = 2**31 - 1


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Request):
    include_usage: bool | None = None
    include_obfuscation: bool | None = None  # OpenAI's padding of stream chunks: nothing to pad here, refused if true


class TextPart(_Request):
    """A text part of a message's content (other kinds of part, images or audio, are refused)."""

    type: Literal["text"]
    text: str


class Message(_Request):
    """One turn. ``developer`` is OpenAI's newer name for ``system`` and is sent as ``system``."""

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None  # a participant's name: refused (a chat template has no place for it)

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


NonNegative = Annotated[int, Field(ge=0, le=INT32_MAX)]


class GenerationRequest(_Request):
    """What chat and completions requests share: sampling, stopping, streaming, and the specdec extensions."""

    model: str
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    max_tokens: Annotated[int, Field(ge=1, le=INT32_MAX)] | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] | None = 1
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    seed: NonNegative | None = None
    stop: str | list[str] | None = None
    # identifiers of the end user: no effect on the answer here or at OpenAI
    user: str | None = None
    safety_identifier: str | None = None
    # OpenAI's, accepted at their neutral value only (``unsupported``)
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    service_tier: str | None = None
    # -- extensions (vLLM's names where it has them) --
    top_k: NonNegative | None = None
    min_tokens: NonNegative | None = None
    stop_token_ids: list[NonNegative] | None = None
    method: str | None = None
    num_draft_tokens: NonNegative | None = None
    beam_width: Annotated[int, Field(ge=1, le=INT32_MAX)] | None = None
    dsbd_threshold: Annotated[float, Field(ge=0, le=1)] | None = None
    dsbd_min_width: Annotated[int, Field(ge=1, le=INT32_MAX)] | None = None
    memory_mode: Literal["full", "single"] | None = None
    timeout_ms: Annotated[int, Field(ge=1, le=INT32_MAX)] | None = None

    @property
    def choices(self) -> int:
        return self.n or 1

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def new_tokens(self) -> int | None:
        """The new tokens asked for at most (None: the server's default)."""
        return self.max_tokens


class ChatRequest(GenerationRequest):
    """``POST /v1/chat/completions``."""

    messages: Annotated[list[Message], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1, le=INT32_MAX)] | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    #: extension (vLLM's): continue the last (assistant) message instead of starting a new turn
    continue_final_message: bool | None = None
    # OpenAI's, accepted at their neutral value only
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    functions: list[Any] | None = None
    function_call: Any = None
    response_format: dict[str, Any] | None = None
    modalities: list[str] | None = None
    audio: Any = None
    prediction: Any = None
    reasoning_effort: str | None = None
    verbosity: str | None = None
    web_search_options: Any = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    prompt_cache_key: str | None = None

    def new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


Prompt = str | Annotated[list[NonNegative], Field(min_length=1)] | list[str] | list[list[NonNegative]]


class CompletionRequest(GenerationRequest):
    """``POST /v1/completions``: one prompt, a string or token ids (``translate.prompt_of`` says which lists)."""

    prompt: Prompt
    logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    # OpenAI's, accepted at their neutral value only
    echo: bool | None = None
    best_of: int | None = None
    suffix: str | None = None


#: each OpenAI field that is accepted only at a neutral value, and those values (absent is always neutral)
NEUTRAL: dict[str, tuple[Any, ...]] = {
    "frequency_penalty": (0, 0.0),
    "presence_penalty": (0, 0.0),
    "logit_bias": ({},),
    "service_tier": ("auto", "default"),
    "tools": ([],),
    "tool_choice": ("none",),
    "parallel_tool_calls": (),
    "functions": ([],),
    "function_call": ("none",),
    "response_format": ({"type": "text"},),
    "modalities": (["text"],),
    "audio": (),
    "prediction": (),
    "reasoning_effort": (),
    "verbosity": (),
    "web_search_options": (),
    "store": (False,),
    "metadata": ({},),
    "echo": (False,),
    "best_of": (1,),
    "suffix": ("",),
}
WHY_UNSUPPORTED = {
    "frequency_penalty": "penalties would change the target's distribution, which speculation must reproduce exactly",
    "presence_penalty": "penalties would change the target's distribution, which speculation must reproduce exactly",
    "logit_bias": "a bias would change the target's distribution, which speculation must reproduce exactly",
    "tools": "this server does not call tools",
    "tool_choice": "this server does not call tools",
    "functions": "this server does not call functions",
    "function_call": "this server does not call functions",
    "response_format": "this server does not constrain the output format",
    "echo": "send the prompt back yourself",
}


def unsupported(request: _Request) -> str | None:
    """The first field of ``request`` set to a value this server does not implement, or None."""
    for name in type(request).model_fields:
        if name not in NEUTRAL:
            continue
        value = getattr(request, name)
        if value is not None and value not in NEUTRAL[name]:
            return name
    return None


# --------------------------------------------------------------------------- responses


class _Response(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SpecdecStats(_Response):
    """The ``specdec`` extension of a choice: how speculation went for it, and its own finish reason.

    ``finish_reason`` here is the server's (``stop``, ``length``, ``context``, ``timeout``): OpenAI's field says
    ``length`` for both a ``max_tokens`` cut and a full context, and ``length`` for a server-side timeout.
    """

    method: str | None = None
    finish_reason: str | None = None
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0
    acceptance_rate: float = 0.0
    target_calls: int = 0
    mean_batch_size: float = 0.0
    beam_widths: list[int] = Field(default_factory=list)


class Usage(_Response):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class TopLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChatLogprobs(_Response):
    content: list[TokenLogprob] | None
    refusal: list[TokenLogprob] | None = None


class CompletionLogprobs(_Response):
    """The legacy completions shape: parallel lists, the alternatives as ``{token: logprob}``."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None
    text_offset: list[int]


def _absent_if_none(value: object) -> bool:
    return value is None


Extension = Annotated[SpecdecStats | None, Field(default=None, exclude_if=_absent_if_none)]


class ChatMessage(_Response):
    role: Literal["assistant"] = "assistant"
    content: str | None
    refusal: str | None = None


class ChatChoice(_Response):
    index: int
    message: ChatMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str
    specdec: Extension = None


class ChatCompletion(_Response):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(_Response):
    role: Literal["assistant"] | None = Field(default=None, exclude_if=_absent_if_none)
    content: str | None = Field(default=None, exclude_if=_absent_if_none)


class ChatChunkChoice(_Response):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    specdec: Extension = None


class ChatCompletionChunk(_Response):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    #: with ``stream_options.include_usage``: null on every chunk but the last, whose ``choices`` is empty; without
    #: it, absent (``sse.chunk`` leaves it out)
    usage: Usage | None = None


class CompletionChoice(_Response):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None
    specdec: Extension = None


class Completion(_Response):
    """A completion, and (with ``object`` unchanged, as OpenAI streams it) each chunk of a streamed one."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class Model(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "specdec"


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[Model]

"""``Piece``s -> OpenAI's objects: a whole completion, the chunks of a streamed one, usage, logprobs.

Each choice of a request is its own sequence on the server; its pieces arrive in order (interleaved with the other
choices' when ``n`` > 1). ``Answer`` gathers them for a unary response; the chunk builders turn each piece into the
chunk OpenAI would stream for it.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from specdec.runtime.methods import DEFAULT_METHOD
from specdec.serving.openai.errors import internal
from specdec.serving.openai.schema import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatDelta,
    ChatLogprobs,
    ChatMessage,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    SpecdecStats,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from specdec.serving.openai.translate import Piece, Translation, openai_finish_reason
from specdec.serving.openai.translate import TokenLogprob as RawLogprob


def token_text(raw: bytes) -> str:
    """A token's text as OpenAI shows it; a token that is part of a multi-byte character shows U+FFFD (its
    ``bytes`` are exact)."""
    return raw.decode("utf-8", errors="replace")


@dataclass
class Choice:
    """One choice's pieces so far."""

    index: int
    text: list[str] = field(default_factory=list)
    tokens: int = 0
    logprobs: list[RawLogprob] = field(default_factory=list)
    finish_reason: str = ""
    metrics: dict[str, Any] = field(default_factory=dict)
    completion_tokens: int | None = None
    chars: int = 0  # characters of the token texts so far (the completions logprobs' ``text_offset``)
    started: bool = False  # a chunk of it was streamed

    def add(self, piece: Piece) -> None:
        self.text.append(piece.text)
        self.tokens += len(piece.token_ids)
        self.logprobs.extend(piece.logprobs)
        self.metrics = piece.metrics
        self.finish_reason = piece.finish_reason or self.finish_reason
        if piece.completion_tokens is not None:
            self.completion_tokens = piece.completion_tokens

    @property
    def generated(self) -> int:
        return self.tokens if self.completion_tokens is None else self.completion_tokens


@dataclass
class Answer:
    """Every choice of one request, and its prompt's length once the server reports it."""

    translation: Translation
    id: str
    model: str
    created: int = field(default_factory=lambda: int(time.time()))
    choices: list[Choice] = field(default_factory=list)
    prompt_tokens: int | None = None

    def __post_init__(self) -> None:
        self.choices = [Choice(i) for i in range(self.translation.n)]

    def add(self, piece: Piece) -> Choice:
        if not 0 <= piece.index < len(self.choices):
            raise internal(f"the server answered choice {piece.index} of a request for {len(self.choices)}")
        if piece.prompt_tokens is not None:
            self.prompt_tokens = piece.prompt_tokens
        choice = self.choices[piece.index]
        choice.add(piece)
        return choice

    @property
    def done(self) -> bool:
        return all(c.finish_reason for c in self.choices)

    def usage(self) -> Usage:
        prompt = self.prompt_tokens or 0
        completion = sum(c.generated for c in self.choices)
        return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)

    def stats(self, choice: Choice) -> SpecdecStats:
        """The ``specdec`` extension of a choice."""
        m = choice.metrics
        return SpecdecStats(
            method=self.translation.method or DEFAULT_METHOD,
            finish_reason=choice.finish_reason or None,
            draft_tokens=int(m.get("draft_tokens") or 0),
            accepted_draft_tokens=int(m.get("accepted_draft_tokens") or 0),
            acceptance_rate=float(m.get("acceptance_rate") or 0.0),
            target_calls=int(m.get("target_calls") or 0),
            mean_batch_size=float(m.get("mean_batch_size") or 0.0),
            beam_widths=list(m.get("beam_widths") or []),
        )


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


# --------------------------------------------------------------------------- logprobs


def chat_logprobs(tokens: list[RawLogprob]) -> ChatLogprobs:
    """Chat's shape: one entry per token, its text, log-probability, bytes and top alternatives."""
    return ChatLogprobs(
        content=[
            TokenLogprob(
                token=token_text(t.token),
                logprob=t.logprob,
                bytes=list(t.token),
                top_logprobs=[TopLogprob(token=token_text(tok), logprob=lp, bytes=list(tok)) for tok, lp in t.top],
            )
            for t in tokens
        ]
    )


def completion_logprobs(tokens: list[RawLogprob], choice: Choice) -> CompletionLogprobs:
    """The legacy shape: parallel lists; ``text_offset`` counts characters of the completion (advances ``choice``)."""
    offsets = []
    for t in tokens:
        offsets.append(choice.chars)
        choice.chars += len(token_text(t.token))
    return CompletionLogprobs(
        tokens=[token_text(t.token) for t in tokens],
        token_logprobs=[t.logprob for t in tokens],
        top_logprobs=[{token_text(tok): lp for tok, lp in t.top} for t in tokens],
        text_offset=offsets,
    )


# --------------------------------------------------------------------------- whole answers


def chat_completion(answer: Answer) -> ChatCompletion:
    want = answer.translation.logprobs
    return ChatCompletion(
        id=answer.id,
        created=answer.created,
        model=answer.model,
        choices=[
            ChatChoice(
                index=c.index,
                message=ChatMessage(content="".join(c.text)),
                logprobs=chat_logprobs(c.logprobs) if want else None,
                finish_reason=openai_finish_reason(c.finish_reason),
                specdec=answer.stats(c),
            )
            for c in answer.choices
        ],
        usage=answer.usage(),
    )


def completion(answer: Answer) -> Completion:
    want = answer.translation.logprobs
    return Completion(
        id=answer.id,
        created=answer.created,
        model=answer.model,
        choices=[
            CompletionChoice(
                index=c.index,
                text="".join(c.text),
                logprobs=completion_logprobs(c.logprobs, c) if want else None,
                finish_reason=openai_finish_reason(c.finish_reason),
                specdec=answer.stats(c),
            )
            for c in answer.choices
        ],
        usage=answer.usage(),
    )


# --------------------------------------------------------------------------- streamed answers


def chat_chunks(answer: Answer, piece: Piece) -> list[ChatCompletionChunk]:
    """The chunks one piece streams: the role first (once per choice), then its text and tokens, and with the
    choice's end its finish reason and ``specdec`` extension. A piece that adds nothing visible streams nothing."""
    choice = answer.add(piece)
    chunks = []

    def chunk(choice_chunk: ChatChunkChoice) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=answer.id, created=answer.created, model=answer.model, choices=[choice_chunk])

    if not choice.started:
        choice.started = True
        chunks.append(chunk(ChatChunkChoice(index=choice.index, delta=ChatDelta(role="assistant", content=""))))
    logprobs = chat_logprobs(piece.logprobs) if answer.translation.logprobs and piece.logprobs else None
    if piece.text or logprobs is not None:
        chunks.append(
            chunk(ChatChunkChoice(index=choice.index, delta=ChatDelta(content=piece.text), logprobs=logprobs))
        )
    if piece.finished:
        end = ChatChunkChoice(
            index=choice.index,
            delta=ChatDelta(),
            finish_reason=openai_finish_reason(piece.finish_reason),
            specdec=answer.stats(choice),
        )
        chunks.append(chunk(end))
    return chunks


def completion_chunks(answer: Answer, piece: Piece) -> list[Completion]:
    """The chunks one piece streams: its text (with its tokens' logprobs), the finish reason with the last one."""
    choice = answer.add(piece)
    logprobs = completion_logprobs(piece.logprobs, choice) if answer.translation.logprobs and piece.logprobs else None
    if not (piece.text or logprobs is not None or piece.finished):
        return []
    return [
        Completion(
            id=answer.id,
            created=answer.created,
            model=answer.model,
            choices=[
                CompletionChoice(
                    index=choice.index,
                    text=piece.text,
                    logprobs=logprobs,
                    finish_reason=openai_finish_reason(piece.finish_reason) if piece.finished else None,
                    specdec=answer.stats(choice) if piece.finished else None,
                )
            ],
        )
    ]


def usage_chunk(answer: Answer, chat: bool) -> ChatCompletionChunk | Completion:
    """``stream_options.include_usage``'s last chunk: no choices, the request's usage."""
    if chat:
        return ChatCompletionChunk(
            id=answer.id, created=answer.created, model=answer.model, choices=[], usage=answer.usage()
        )
    return Completion(id=answer.id, created=answer.created, model=answer.model, choices=[], usage=answer.usage())

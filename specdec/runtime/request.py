"""Requests, their live decoding state, stop conditions and metrics."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal, get_args

import numpy as np

from specdec.runtime.draft_length import DraftStats
from specdec.runtime.logprobs import MAX_TOP_LOGPROBS, TokenLogprob
from specdec.runtime.sampling import InvalidRequestError, SamplingParams

_ids = itertools.count()

#: how the ``beam`` baseline draws its pairs (``BeamParams.mode``)
BeamMode = Literal["iid", "without_replacement"]
BEAM_MODES: tuple[BeamMode, ...] = get_args(BeamMode)
MEMORY_MODES = ("full", "single")


@dataclass(frozen=True)
class BeamParams:
    """How a ``beam`` or ``dsbd`` request searches (docs/algorithms.md, DSBD).

    ``width``: beams drawn per step (``beam``), or the draft's width ``W_S`` and the largest
    output width (``dsbd``). ``min_width`` and ``threshold`` set DSBD's dynamic width: a
    layer's width is the largest K whose probability of passing is at least ``threshold``,
    never below ``min_width`` (threshold 0 keeps every layer at ``width``). ``mode``: the
    ``beam`` baseline draws its pairs i.i.d. (the law DSBD reproduces per slot) or without
    replacement (classic beam sampling); greedy requests run deterministic beam search.
    ``memory_mode="single"`` keeps only the best output beam of each round (one KV sequence).
    ``num_return_sequences`` best candidates are returned, ranked by ``logprob / length``
    ** ``length_penalty``.
    """

    width: int = 2
    min_width: int = 1
    threshold: float = 0.0
    mode: BeamMode = "iid"
    memory_mode: str = "full"
    num_return_sequences: int = 1
    length_penalty: float = 1.0

    def __post_init__(self) -> None:
        def integer(name: str, value: object, low: int) -> None:
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise InvalidRequestError(f"{name} must be an integer >= {low}, got {value!r}")

        integer("beam_width", self.width, 1)
        integer("dsbd_min_width", self.min_width, 1)
        integer("num_return_sequences", self.num_return_sequences, 1)
        if self.min_width > self.width:
            raise InvalidRequestError(f"dsbd_min_width ({self.min_width}) must not exceed beam_width ({self.width})")
        if self.num_return_sequences > self.width:
            raise InvalidRequestError(
                f"num_return_sequences ({self.num_return_sequences}) must not exceed beam_width ({self.width})"
            )
        if not (isinstance(self.threshold, (int, float)) and 0.0 <= self.threshold <= 1.0):
            raise InvalidRequestError(f"dsbd_threshold must be in [0, 1], got {self.threshold!r}")
        if self.mode not in BEAM_MODES:
            raise InvalidRequestError(f"beam mode must be one of {', '.join(BEAM_MODES)}, got {self.mode!r}")
        if self.memory_mode not in MEMORY_MODES:
            raise InvalidRequestError(f"memory_mode must be one of {', '.join(MEMORY_MODES)}, got {self.memory_mode!r}")
        if not (isinstance(self.length_penalty, (int, float)) and math.isfinite(self.length_penalty)):
            raise InvalidRequestError(f"length_penalty must be a finite number, got {self.length_penalty!r}")


@dataclass(frozen=True)
class Request:
    """One prompt to continue. Validated on construction; context checks happen at submit."""

    prompt_ids: tuple[int, ...]
    max_tokens: int = 128
    sampling: SamplingParams = field(default_factory=SamplingParams)
    num_draft_tokens: int | None = None  # None = the engine's default
    stop: tuple[str, ...] = ()
    request_id: str = field(default_factory=lambda: f"req-{next(_ids)}")
    beam: BeamParams | None = None  # set for the beam and dsbd methods
    #: tokens besides the model's end-of-sequence ones that end the answer ("stop"); kept in ``token_ids``, not
    #: rendered in its text
    stop_token_ids: tuple[int, ...] = ()
    #: no stop (end of sequence, a stop token or string) ends the answer before it has this many tokens: the stop
    #: tokens are kept out of the target's choices until then (``logprobs.suppress``)
    min_tokens: int = 0
    #: None: no log-probabilities; k >= 0: each generated token's, with its k most likely alternatives
    logprobs: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "prompt_ids", tuple(int(t) for t in self.prompt_ids))
        object.__setattr__(self, "stop", tuple(self.stop))
        if not self.prompt_ids:
            raise InvalidRequestError("prompt is empty: a request needs at least one prompt token")
        if not isinstance(self.max_tokens, int) or self.max_tokens <= 0:
            raise InvalidRequestError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if self.num_draft_tokens is not None and (
            not isinstance(self.num_draft_tokens, int) or self.num_draft_tokens < 0
        ):
            raise InvalidRequestError(f"num_draft_tokens must be an integer >= 0, got {self.num_draft_tokens!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise InvalidRequestError(f"stop strings must be non-empty strings, got {self.stop!r}")
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if any(not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in self.stop_token_ids):
            raise InvalidRequestError(f"stop_token_ids must be token ids >= 0, got {list(self.stop_token_ids)!r}")
        if not isinstance(self.min_tokens, int) or isinstance(self.min_tokens, bool) or self.min_tokens < 0:
            raise InvalidRequestError(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if self.min_tokens > self.max_tokens:
            raise InvalidRequestError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if self.logprobs is not None and (
            not isinstance(self.logprobs, int)
            or isinstance(self.logprobs, bool)
            or not 0 <= self.logprobs <= MAX_TOP_LOGPROBS
        ):
            raise InvalidRequestError(
                f"top_logprobs must be an integer between 0 and {MAX_TOP_LOGPROBS}, got {self.logprobs!r}"
            )

    def check_fits(self, max_len: int, vocab_size: int) -> None:
        """Refuse prompts the cache cannot hold and token ids the model does not have."""
        if len(self.prompt_ids) >= max_len:
            raise InvalidRequestError(
                f"prompt has {len(self.prompt_ids)} tokens but the context holds {max_len} "
                "(prompt plus at least one new token)"
            )
        bad = [t for t in self.prompt_ids if not 0 <= t < vocab_size]
        if bad:
            raise InvalidRequestError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})")
        bad = [t for t in self.stop_token_ids if not 0 <= t < vocab_size]
        if bad:
            raise InvalidRequestError(f"stop_token_ids {bad[:5]} are outside the vocabulary [0, {vocab_size})")


@dataclass
class RequestMetrics:
    """What speculation did for one request (names follow TensorRT-LLM's Triton outputs)."""

    prompt_tokens: int = 0
    generated_tokens: int = 0
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0
    target_calls: int = 0  # target steps this request took part in, prefill included
    batch_size_sum: int = 0  # over those steps, the number of sequences each one verified together
    beam_widths: list[int] = field(default_factory=list)  # beam / dsbd: output beams of each round
    logprob: float | None = None  # beam / dsbd: the answer's target log-likelihood (temperature 1)

    @property
    def mean_batch_size(self) -> float:
        """How many sequences shared this request's target steps on average (1.0 = it ran alone)."""
        return self.batch_size_sum / self.target_calls if self.target_calls else 0.0

    @property
    def completion_tokens(self) -> int:
        """``generated_tokens``, as the OpenAI API names it."""
        return self.generated_tokens

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_draft_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens produced per decoding step (prefill excluded): 1 + accepted drafts on average."""
        steps = self.target_calls - 1
        return (self.generated_tokens - 1) / steps if steps > 0 else 0.0

    def as_dict(self) -> dict[str, float | None]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "generated_tokens": self.generated_tokens,
            "draft_tokens": self.draft_tokens,
            "accepted_draft_tokens": self.accepted_draft_tokens,
            "acceptance_rate": round(self.acceptance_rate, 4),
            "mean_accepted_length": round(self.mean_accepted_length, 4),
            "target_calls": self.target_calls,
            "mean_batch_size": round(self.mean_batch_size, 4),
            **(
                {"mean_beam_width": round(sum(self.beam_widths) / len(self.beam_widths), 4), "logprob": self.logprob}
                if self.beam_widths
                else {}
            ),
        }


@dataclass
class RequestOutput:
    """The answer to one request (or the error that refused it)."""

    request_id: str
    prompt_ids: list[int]
    token_ids: list[int]
    text: str | None
    #: "stop" (EOS or stop string), "length" (max_tokens), CONTEXT, CANCELLED, TIMEOUT; None on error
    finish_reason: str | None
    metrics: RequestMetrics
    error: str | None = None
    #: beam / dsbd: the ``num_return_sequences`` best candidates, best first (the first is ``token_ids``)
    sequences: list[BeamCandidate] = field(default_factory=list)
    #: with ``Request.logprobs``: one per token of ``token_ids``
    logprobs: list[TokenLogprob] = field(default_factory=list)


#: the finish reason of a sequence whose caller gave up on it (``DecodeContext.retire_cancelled``)
CANCELLED = "cancelled"
#: the answer ended because the context (the KV slot, ``max_len``) was full, before ``max_tokens``: a client
#: that sees "length" knows it asked for too few tokens, one that sees "context" that its prompt was too long
CONTEXT = "context"
#: the answer ended because its server-side deadline (``timeout_ms``) passed: a cancellation by the server, which
#: frees the slot as a client's cancel does, named apart so a client can tell it from its own
TIMEOUT = "timeout"


@dataclass(frozen=True)
class BeamCandidate:
    """A returned beam: its output tokens, target log-likelihood and ranking score."""

    token_ids: list[int]
    logprob: float
    score: float
    finish_reason: str


class StopChecker:
    """Appends tokens to a sequence one at a time and decides when it ends: the one stop rule.

    Tokens accepted together in one speculative step pass through here in order, so the
    output is cut exactly where plain autoregressive decoding would have stopped. The beam
    methods end each beam by ``reason`` too.
    """

    def __init__(
        self, eos_ids: Sequence[int], max_len: int, decode: Callable[[Sequence[int]], str] | None = None
    ) -> None:
        self.eos_ids = frozenset(eos_ids)
        self.max_len = max_len
        self.decode = decode

    def stop_ids(self, request: Request) -> frozenset[int]:
        """The tokens that end ``request``'s answer: the model's end of sequence and the request's own."""
        return self.eos_ids.union(request.stop_token_ids) if request.stop_token_ids else self.eos_ids

    def append(self, seq: SeqState, tokens: Sequence[int]) -> list[int]:
        """Add ``tokens`` until a stop condition; returns the tokens actually appended."""
        taken: list[int] = []
        for tok in tokens:
            seq.tokens.append(int(tok))
            taken.append(int(tok))
            reason = self.reason(seq.request, seq.output_ids, len(seq.tokens), strings=True)
            if reason:
                seq.finish_reason = reason
                break
        seq.metrics.generated_tokens = seq.num_generated
        return taken

    def reason(
        self, request: Request, output_ids: Sequence[int], total_tokens: int, strings: bool = True
    ) -> str | None:
        """Why an answer whose last token is ``output_ids[-1]`` ends there ("stop", "length", ``CONTEXT``), or None.

        Before ``min_tokens`` nothing stops it but its limits (``max_tokens``, the context). ``strings``: a stop
        string is looked for in the text of ``output_ids`` where the engine can decode (a beam leaves them to the
        answer it streams: they cut the chosen answer, not the search).
        """
        generated = len(output_ids)
        if generated >= request.min_tokens:
            if output_ids[-1] in self.stop_ids(request):
                return "stop"
            if strings and request.stop and self.decode is not None:
                text = self.decode(output_ids)
                if any(s in text for s in request.stop):
                    return "stop"
        if generated >= request.max_tokens:
            return "length"
        if total_tokens >= self.max_len:
            return CONTEXT
        return None


@dataclass(eq=False)
class SeqState:
    """A live request inside a decoding loop. ``tokens`` = prompt + output so far.

    Invariant between steps: the target cache of ``slot`` holds ``tokens[:-1]``.
    """

    request: Request
    slot: int
    tokens: list[int]
    generator: np.random.Generator
    metrics: RequestMetrics
    finish_reason: str | None = None
    #: set when this sequence alone failed (``DecodeContext.fail``): it ends with this error, its batch-mates go on
    error: str | None = None
    sequences: list[BeamCandidate] = field(default_factory=list)  # beam / dsbd: the returned candidates
    #: acceptance by depth (adaptive draft length), per proposer of a drafter with several
    #: (``drafters.SourcedDrafter``; "" for a drafter of one kind), and the proposer this step's k was chosen for
    draft_stats: dict[str, DraftStats] = field(default_factory=dict)
    draft_source: str = ""
    #: with ``request.logprobs``: one per output token so far
    logprobs: list[TokenLogprob] = field(default_factory=list)

    @classmethod
    def start(cls, request: Request, slot: int) -> SeqState:
        return cls(
            request,
            slot,
            list(request.prompt_ids),
            request.sampling.make_generator(),
            RequestMetrics(prompt_tokens=len(request.prompt_ids)),
        )

    @property
    def num_prompt(self) -> int:
        return len(self.request.prompt_ids)

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - self.num_prompt

    @property
    def output_ids(self) -> list[int]:
        return self.tokens[self.num_prompt :]

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None or self.error is not None

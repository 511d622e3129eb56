"""What clients send, validated: sizes first, then the prompt and every parameter, each refusal naming its input.

Pure numpy, no Triton: the entry points check sizes and the prompt before anything is tokenized, preprocessing
reads the prompt, the engine model turns the parameters into a ``Request``; the tests check the rules without a
server. Every failure is an ``InvalidRequestError`` (INVALID_ARGUMENT on gRPC, 400 on the HTTP API) whose message
names the input, and a value is never echoed back whole (``shown``): a 4 MB method name comes back as its first
characters.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from specdec.runtime.methods import BEAM_METHODS, DEFAULT_METHOD, Method, get_method
from specdec.runtime.request import BeamParams, Request
from specdec.runtime.sampling import InvalidRequestError, SamplingParams
from specdec.serving.protocol import (
    APPLY_CHAT_TEMPLATE,
    CONTINUE_FINAL_MESSAGE,
    INPUT_IDS,
    MAX_CHOICES,
    MESSAGES,
    NUMPY_OF,
    PARAMETER,
    PROMPT_IDS,
    PROMPTS,
    STOP,
    STOP_TOKEN_IDS,
    STREAM_NEEDS_DECOUPLED,
    TEXT_INPUT,
    N,
    TensorSpec,
)

DEFAULT_BEAM_WIDTH = 2
#: num_draft_tokens above this is refused: verification cost grows with k while acceptance decays
MAX_DRAFT_TOKENS = 32
#: the roles a conversation may hold, as the chat templates of instruction-tuned models know them
ROLES = ("system", "user", "assistant")
#: characters of a refused value an error message repeats
SHOWN_CHARS = 64


def shown(value: object) -> str:
    """``value`` for an error message: its ``repr``, cut to ``SHOWN_CHARS`` characters (and its full length)."""
    text = repr(value)
    return text if len(text) <= SHOWN_CHARS else f"{text[:SHOWN_CHARS]}... ({len(text)} characters)"


#: one value of a ``[1]`` input as Python reads it: text for ``TYPE_STRING``, else a number (a bool is an int)
Scalar = str | int | float


def scalar(inputs: Mapping[str, np.ndarray], spec: TensorSpec) -> Scalar | None:
    """The one value of an optional ``[1]`` input, or None when the client did not send it."""
    array = inputs.get(spec.name)
    if array is None:
        return None
    array = np.asarray(array)
    if array.size != 1:
        raise InvalidRequestError(
            f"input '{spec.name}' must hold exactly one value (shape [1]), got shape {list(array.shape)}"
        )
    check_dtype(array, spec)
    value = array.reshape(-1)[0]
    if spec.dtype == "TYPE_STRING":
        return text_of(value, spec.name)
    if spec.dtype == "TYPE_FP32":
        # the number the client wrote, not its float32 rounding: 1e-5 arrives as 9.99999975e-06, which is below
        # the smallest temperature and would be refused; the shortest decimal that rounds to the same float32 is it
        return float(np.format_float_positional(np.float32(value), unique=True, trim="-"))
    return value.item() if hasattr(value, "item") else value


def check_dtype(array: np.ndarray, spec: TensorSpec) -> None:
    expected = NUMPY_OF[spec.dtype]
    if expected is np.object_:
        ok = array.dtype == np.object_ or array.dtype.kind in "SU"
    else:
        ok = array.dtype == expected
    if not ok:
        raise InvalidRequestError(f"input '{spec.name}' must be {spec.dtype.removeprefix('TYPE_')}, got {array.dtype}")


def text_of(value: object, name: str) -> str:
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise InvalidRequestError(f"input '{name}' is not valid UTF-8: {exc}") from exc
    return str(value)


def _bytes(array: np.ndarray) -> int:
    return sum(len(v) if isinstance(v, (bytes, str)) else 0 for v in np.asarray(array).reshape(-1))


@dataclass(frozen=True)
class Limits:
    """What one request may send, checked before anything is tokenized (the config's entry-point parameters).

    Why before tokenization: tokenizing a prompt of megabytes takes seconds only to find it longer than the context,
    and delays every other request meanwhile (``benchmarks/results/runtime_choices.md``). The prompt cap is generous
    against the context (a token of SmolLM2's vocabulary is ~4 bytes of English, so 64 KiB is ~16,000 tokens, far
    past a 2,048 context): it refuses only what cannot fit, quickly; the exact context check still runs on the token
    count. Every other string (a method name, a memory mode) is a word: ``max_word_bytes``.
    """

    max_prompt_bytes: int = 65_536
    max_prompt_ids: int = 65_536
    max_stop_strings: int = 16
    max_stop_bytes: int = 256
    max_stop_token_ids: int = 64
    max_word_bytes: int = 64

    def check(self, inputs: Mapping[str, np.ndarray]) -> None:
        """Raise ``InvalidRequestError`` naming the first limit ``inputs`` exceed."""
        for spec in (TEXT_INPUT, MESSAGES):
            if spec.name in inputs and (size := _bytes(inputs[spec.name])) > self.max_prompt_bytes:
                raise InvalidRequestError(
                    f"input '{spec.name}' is {size} bytes, more than this server accepts ({self.max_prompt_bytes})"
                )
        if PROMPT_IDS.name in inputs and (count := np.asarray(inputs[PROMPT_IDS.name]).size) > self.max_prompt_ids:
            raise InvalidRequestError(
                f"input 'prompt_ids' holds {count} tokens, more than this server accepts ({self.max_prompt_ids})"
            )
        stops = inputs.get(STOP.name)
        if stops is not None:
            values = np.asarray(stops).reshape(-1)
            if values.size > self.max_stop_strings:
                raise InvalidRequestError(
                    f"input 'stop' holds {values.size} strings, more than this server accepts ({self.max_stop_strings})"
                )
            if any(isinstance(v, (bytes, str)) and len(v) > self.max_stop_bytes for v in values):
                raise InvalidRequestError(f"input 'stop' holds a string longer than {self.max_stop_bytes} bytes")
        ids = inputs.get(STOP_TOKEN_IDS.name)
        if ids is not None and np.asarray(ids).size > self.max_stop_token_ids:
            raise InvalidRequestError(
                f"input 'stop_token_ids' holds {np.asarray(ids).size} ids, more than this server accepts "
                f"({self.max_stop_token_ids})"
            )
        for spec in PARAMETER.values():
            if spec.dtype == "TYPE_STRING" and spec is not STOP and spec.name in inputs:
                if _bytes(inputs[spec.name]) > self.max_word_bytes:
                    raise InvalidRequestError(
                        f"input '{spec.name}' is longer than {self.max_word_bytes} bytes: it names a choice"
                    )


@dataclass(frozen=True)
class Prompt:
    """What a request's prompt is: ``text`` (a user turn where ``chat``), a conversation, or token ids."""

    text: str | None = None
    chat: bool = False
    messages: tuple[dict[str, str], ...] = ()
    continue_final: bool = False
    ids: tuple[int, ...] = ()


def parse_prompt(inputs: Mapping[str, np.ndarray]) -> Prompt:
    """The one prompt of a request: exactly one of ``text_input``, ``messages``, ``prompt_ids``, non-empty."""
    given = [spec.name for spec in PROMPTS if spec.name in inputs]
    if len(given) != 1:
        names = ", ".join(f"'{s.name}'" for s in PROMPTS)
        raise InvalidRequestError(
            f"send exactly one prompt input of {names}" + (f", got {given}" if given else ", got none")
        )
    chat, continue_final = scalar(inputs, APPLY_CHAT_TEMPLATE), scalar(inputs, CONTINUE_FINAL_MESSAGE)
    if chat is not None and TEXT_INPUT.name not in inputs:
        raise InvalidRequestError("input 'apply_chat_template' applies to 'text_input' ('messages' always use it)")
    if continue_final is not None and MESSAGES.name not in inputs:
        raise InvalidRequestError("input 'continue_final_message' applies to 'messages'")
    if TEXT_INPUT.name in inputs:
        text = scalar(inputs, TEXT_INPUT)
        assert isinstance(text, str)
        if not text.strip():
            raise InvalidRequestError("input 'text_input' is empty: send a non-empty prompt")
        return Prompt(text=text, chat=bool(chat))
    if MESSAGES.name in inputs:
        return Prompt(messages=parse_messages(inputs), continue_final=bool(continue_final))
    ids = np.asarray(inputs[PROMPT_IDS.name])
    check_dtype(ids, PROMPT_IDS)
    if ids.size == 0:
        raise InvalidRequestError("input 'prompt_ids' is empty: send at least one token")
    return Prompt(ids=tuple(int(t) for t in ids.reshape(-1)))


def parse_messages(inputs: Mapping[str, np.ndarray]) -> tuple[dict[str, str], ...]:
    """The conversation of ``messages``: a JSON array of objects with a known ``role`` and a string ``content``."""
    text = scalar(inputs, MESSAGES)
    try:
        messages = json.loads(str(text))
    except ValueError as exc:
        raise InvalidRequestError(f"input 'messages' is not valid JSON: {exc}") from None
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError("input 'messages' must be a non-empty JSON array of {role, content} objects")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or set(message) - {"role", "content"}:
            raise InvalidRequestError(f"input 'messages'[{i}] must be an object with 'role' and 'content' only")
        role, content = message.get("role"), message.get("content")
        if role not in ROLES:
            raise InvalidRequestError(
                f"input 'messages'[{i}].role must be one of {', '.join(ROLES)}, got {shown(role)}"
            )
        if not isinstance(content, str):
            raise InvalidRequestError(f"input 'messages'[{i}].content must be a string")
        out.append({"role": role, "content": content})
    if not any(m["content"].strip() for m in out):
        raise InvalidRequestError("input 'messages' holds no text: send a non-empty message")
    if scalar(inputs, CONTINUE_FINAL_MESSAGE) and out[-1]["role"] != "assistant":
        raise InvalidRequestError("continue_final_message needs the last message to be the assistant's")
    return tuple(out)


def parse_choices(inputs: Mapping[str, np.ndarray], streaming: bool) -> int:
    """``n``: how many choices to generate (1 by default; more only where responses can say which is which)."""
    n = scalar(inputs, N)
    if n is None:
        return 1
    if not 1 <= int(n) <= MAX_CHOICES:
        raise InvalidRequestError(f"n must be between 1 and {MAX_CHOICES}, got {n}")
    if int(n) > 1 and not streaming:
        raise InvalidRequestError(
            "n > 1 needs the decoupled model 'specdec_stream': each of its responses carries its choice's 'index'"
        )
    return int(n)


@dataclass(frozen=True)
class Generation:
    """A validated request to the engine model: everything but the prompt ids."""

    max_tokens: int
    method: str
    sampling: SamplingParams
    num_draft_tokens: int | None
    stop: tuple[str, ...]
    stream: bool
    beam: BeamParams | None = None  # dsbd and beam only
    timeout_s: float | None = None  # the request's server-side deadline (``timeout_ms``), None: none
    stop_token_ids: tuple[int, ...] = ()
    min_tokens: int = 0
    logprobs: int | None = None  # None: none; k: each token's with k alternatives

    def step_rows(self, default_k: int) -> int:
        """The most rows this request may add to one ragged step: its last token and k drafts (a chain), or per
        live beam its tail and γ layers of W_S draft nodes (DSBD; γ = 0 for ``beam``). What ``max_request_rows``
        bounds: a request's share of every step it takes part in, so of every other request's pace."""
        k = default_k if self.num_draft_tokens is None else self.num_draft_tokens
        if self.beam is None:
            return 1 + k
        return self.beam.width * (1 + k * self.beam.width)

    def request(self, prompt_ids: Sequence[int], request_id: str) -> Request:
        return Request(
            tuple(prompt_ids),
            self.max_tokens,
            self.sampling,
            self.num_draft_tokens,
            self.stop,
            request_id=request_id,
            beam=self.beam,
            stop_token_ids=self.stop_token_ids,
            min_tokens=self.min_tokens,
            logprobs=self.logprobs,
        )


def parse_generation(
    inputs: Mapping[str, np.ndarray], *, max_len: int, default_max_tokens: int = 64, allow_stream: bool = True
) -> Generation:
    """Validate every parameter the engine reads; the first problem raises ``InvalidRequestError`` naming it."""
    values = {name: scalar(inputs, s) for name, s in PARAMETER.items() if s.dims == (1,)}
    prompt = {spec.name for spec in (*PROMPTS, APPLY_CHAT_TEMPLATE, CONTINUE_FINAL_MESSAGE, INPUT_IDS)}
    unknown = sorted(set(inputs) - set(PARAMETER) - prompt)
    if unknown:
        raise InvalidRequestError(f"unknown input(s) {shown(unknown)}")
    spec = get_method(str(values["method"] or DEFAULT_METHOD), served=True)
    beam = _beam(values, spec)
    max_tokens = default_max_tokens if values["max_tokens"] is None else values["max_tokens"]
    if not 1 <= int(max_tokens) < max_len:
        raise InvalidRequestError(
            f"max_tokens must be between 1 and {max_len - 1} (the context holds {max_len} tokens), got {max_tokens}"
        )
    temperature = 0.0 if values["temperature"] is None else float(values["temperature"])
    if not math.isfinite(temperature) or temperature < 0:
        raise InvalidRequestError(f"temperature must be a finite number >= 0 (0 = greedy), got {temperature}")
    sampling = SamplingParams(
        temperature,
        0 if values["top_k"] is None else int(values["top_k"]),
        1.0 if values["top_p"] is None else float(values["top_p"]),
        None if values["seed"] is None else int(values["seed"]),
    )
    k = values["num_draft_tokens"]
    if k is not None and not 0 <= int(k) <= MAX_DRAFT_TOKENS:
        raise InvalidRequestError(f"num_draft_tokens must be between 0 and {MAX_DRAFT_TOKENS}, got {k}")
    stream = bool(values["stream"]) if values["stream"] is not None else allow_stream
    if stream and not allow_stream:
        raise InvalidRequestError(STREAM_NEEDS_DECOUPLED)
    timeout_ms = values["timeout_ms"]
    if timeout_ms is not None and int(timeout_ms) <= 0:
        raise InvalidRequestError(f"timeout_ms must be a positive number of milliseconds, got {timeout_ms}")
    top = values["top_logprobs"]
    if top is not None and not values["logprobs"]:
        raise InvalidRequestError("top_logprobs needs logprobs=true")
    # `ar` is EMS-SD with no drafts and `beam` is DSBD with no draft layers: each shares its loop's ragged steps
    num_draft_tokens = (None if k is None else int(k)) if spec.uses_drafter else 0
    return Generation(
        int(max_tokens),
        spec.name,
        sampling,
        num_draft_tokens,
        parse_stops(inputs.get(STOP.name)),
        stream,
        beam,
        None if timeout_ms is None else int(timeout_ms) / 1000,
        stop_token_ids=parse_ids(inputs.get(STOP_TOKEN_IDS.name), STOP_TOKEN_IDS),
        min_tokens=0 if values["min_tokens"] is None else int(values["min_tokens"]),
        logprobs=(0 if top is None else int(top)) if values["logprobs"] else None,
    )


def _beam(values: Mapping[str, Scalar | None], spec: Method) -> BeamParams | None:
    """The beam parameters of a beam method's request; the others accept only their neutral values."""
    width, threshold, min_width, memory = (
        values[n] for n in ("beam_width", "dsbd_threshold", "dsbd_min_width", "memory_mode")
    )
    beam_names = " or ".join(repr(name) for name in BEAM_METHODS)
    if not spec.beams:
        if width not in (None, 1):
            raise InvalidRequestError(
                f"beam_width must be 1 for method {spec.name!r} (got {width}): beam search is method {beam_names}"
            )
        if threshold is not None or min_width is not None or memory is not None:
            raise InvalidRequestError(
                f"dsbd_threshold, dsbd_min_width and memory_mode apply to method {beam_names}, not {spec.name!r}"
            )
        return None
    if not spec.uses_drafter and (threshold is not None or min_width is not None):
        speculative = " or ".join(repr(n) for n in BEAM_METHODS if get_method(n).uses_drafter)
        raise InvalidRequestError(f"dsbd_threshold and dsbd_min_width apply to method {speculative} only")
    return BeamParams(
        width=DEFAULT_BEAM_WIDTH if width is None else int(width),
        min_width=1 if min_width is None else int(min_width),
        threshold=0.0 if threshold is None else float(threshold),
        memory_mode=str(memory or "full").strip().lower(),
    )


def parse_stops(array: np.ndarray | None) -> tuple[str, ...]:
    """Stop strings from a BYTES tensor of any length (none when absent)."""
    if array is None:
        return ()
    array = np.asarray(array)
    check_dtype(array, STOP)
    stops = tuple(text_of(v, "stop") for v in array.reshape(-1))
    if any(not s for s in stops):
        raise InvalidRequestError("input 'stop' holds an empty string: stop strings must be non-empty")
    return stops


def parse_ids(array: np.ndarray | None, spec: TensorSpec) -> tuple[int, ...]:
    """Token ids from an INT32 tensor of any length (none when absent); each >= 0 (the vocabulary is the engine's
    to check)."""
    if array is None:
        return ()
    array = np.asarray(array)
    check_dtype(array, spec)
    ids = tuple(int(t) for t in array.reshape(-1))
    if any(t < 0 for t in ids):
        raise InvalidRequestError(f"input '{spec.name}' holds a negative token id")
    return ids


def parse_flag(inputs: Mapping[str, np.ndarray], name: str) -> bool | None:
    """A BOOL [1] parameter (type and shape checked), or None when absent."""
    value = scalar(inputs, PARAMETER[name])
    return None if value is None else bool(value)


def parse_text(array: np.ndarray, name: str) -> str:
    """The one string of a BYTES [1] tensor."""
    value = scalar({name: array}, TensorSpec(name, "TYPE_STRING"))
    assert isinstance(value, str)
    return value


def parse_input_ids(inputs: Mapping[str, np.ndarray]) -> list[int]:
    array = inputs.get(INPUT_IDS.name)
    if array is None or np.asarray(array).size == 0:
        raise InvalidRequestError("input 'input_ids' is empty: the prompt has no tokens")
    return [int(t) for t in np.asarray(array).reshape(-1)]

"""The endpoint's models and tensors: names, types, shapes, defaults, and the validation of what clients send.

Pure numpy, no Triton: the model repository writer renders the ``config.pbtxt`` files from
these tables, the Triton models parse their inputs with ``parse_generation`` and build their
responses with ``array`` / ``engine_response`` / ``client_response``, the client types its
inputs with ``array`` and ``TensorSpec.wire_dtype``, and the tests check the rules without a
server. Each name and its type is written here once, so a model cannot send a tensor its
config does not declare, or with another type. Names follow what Triton LLM users know (TensorRT-LLM's
and vLLM's backends): ``text_input``, ``max_tokens``, ``stream``, ``text_output``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from specdec.runtime.methods import BEAM_METHODS, DEFAULT_METHOD, SERVED_METHODS, Method, get_method
from specdec.runtime.request import BeamParams, RequestMetrics
from specdec.runtime.sampling import InvalidRequestError, SamplingParams

# -- the models of the repository (what clients and the BLS calls between the models address) ------------
PREPROCESSING_MODEL, ENGINE_MODEL, POSTPROCESSING_MODEL = "preprocessing", "specdec_engine", "postprocessing"
STREAM_MODEL, UNARY_MODEL = "specdec_stream", "specdec"
MODELS = (PREPROCESSING_MODEL, ENGINE_MODEL, POSTPROCESSING_MODEL, STREAM_MODEL, UNARY_MODEL)
STREAM_NEEDS_DECOUPLED = (
    f"stream=true needs the decoupled model '{STREAM_MODEL}' (gRPC streaming); "
    f"'{UNARY_MODEL}' answers with one complete response"
)

DEFAULT_BEAM_WIDTH = 2
#: num_draft_tokens above this is refused: verification cost grows with k while acceptance decays
MAX_DRAFT_TOKENS = 32


@dataclass(frozen=True)
class TensorSpec:
    """One input or output of a model in the repository."""

    name: str
    dtype: str  # Triton's config type, e.g. TYPE_INT32
    dims: tuple[int, ...] = (1,)
    optional: bool = True
    doc: str = ""

    @property
    def wire_dtype(self) -> str:
        """The type's name on the wire (what a client's ``InferInput`` says): BYTES, INT32, FP32, BOOL."""
        return WIRE_DTYPE[self.dtype]


#: numpy kind each Triton type must arrive as (BYTES arrives as an object array of bytes)
NUMPY_OF = {"TYPE_STRING": np.object_, "TYPE_INT32": np.int32, "TYPE_FP32": np.float32, "TYPE_BOOL": np.bool_}
#: the wire name of each config type (the data types of Triton's inference protocol)
WIRE_DTYPE = {"TYPE_STRING": "BYTES", "TYPE_INT32": "INT32", "TYPE_FP32": "FP32", "TYPE_BOOL": "BOOL"}

# -- client-facing inputs (the `specdec` and `specdec_stream` models) ----------------------------
TEXT_INPUT = TensorSpec("text_input", "TYPE_STRING", optional=False, doc="the prompt")
APPLY_CHAT_TEMPLATE = TensorSpec("apply_chat_template", "TYPE_BOOL", doc="wrap the prompt in the chat template")
PARAMETERS = (
    TensorSpec("max_tokens", "TYPE_INT32", doc="new tokens at most (default 64)"),
    TensorSpec("method", "TYPE_STRING", doc=f"{', '.join(SERVED_METHODS)} (default {DEFAULT_METHOD})"),
    TensorSpec("temperature", "TYPE_FP32", doc="0 = greedy (default)"),
    TensorSpec("top_k", "TYPE_INT32", doc="0 = off"),
    TensorSpec("top_p", "TYPE_FP32", doc="1 = off"),
    TensorSpec("seed", "TYPE_INT32", doc="sampling seed (>= 0)"),
    TensorSpec(
        "num_draft_tokens",
        "TYPE_INT32",
        doc="k per step (ems), γ per round (dsbd); with an adaptive-draft export, the most drafted",
    ),
    TensorSpec("stop", "TYPE_STRING", (-1,), doc="stop strings"),
    TensorSpec("stream", "TYPE_BOOL", doc=f"partial responses ({STREAM_MODEL} only)"),
    TensorSpec("beam_width", "TYPE_INT32", doc="beams per step (beam) / draft width W_S (dsbd); 1 for ems and ar"),
    TensorSpec("dsbd_threshold", "TYPE_FP32", doc="dsbd dynamic width threshold t in [0, 1] (0 = fixed width)"),
    TensorSpec("dsbd_min_width", "TYPE_INT32", doc="dsbd smallest width W_min (default 1)"),
    TensorSpec("memory_mode", "TYPE_STRING", doc="full (default) or single: one beam kept per round"),
    TensorSpec(
        "timeout_ms",
        "TYPE_INT32",
        doc="server-side deadline from arrival at the engine: past it the answer ends finish_reason=timeout "
        "with what it has, and its KV slot is freed (default: none)",
    ),
)
CLIENT_INPUTS = (TEXT_INPUT, APPLY_CHAT_TEMPLATE, *PARAMETERS)
_PARAMETER = {s.name: s for s in PARAMETERS}
STOP, STREAM = _PARAMETER["stop"], _PARAMETER["stream"]

# -- between the models ---------------------------------------------------------------------------
INPUT_IDS = TensorSpec("input_ids", "TYPE_INT32", (-1,))
#: a control input of the engine: cancel the request the entry point started with this Triton request id
CANCEL_REQUEST_ID = TensorSpec("cancel_request_id", "TYPE_STRING")
OUTPUT_IDS = TensorSpec("output_ids", "TYPE_INT32", (-1,), optional=False)
SENT_TOKENS = TensorSpec("sent_tokens", "TYPE_INT32", optional=False, doc="tokens covered by earlier responses")
FINISHED = TensorSpec("finished", "TYPE_BOOL", optional=False)
FINISH_REASON = TensorSpec(
    "finish_reason",
    "TYPE_STRING",
    optional=False,
    doc="stop | length (max_tokens) | context (the context filled up) | cancelled | timeout",
)
#: what a response reports of its request's metrics, each named as the ``RequestMetrics`` attribute it is
REQUEST_METRICS = (
    TensorSpec("acceptance_rate", "TYPE_FP32", optional=False),
    TensorSpec("accepted_draft_tokens", "TYPE_INT32", optional=False),
    TensorSpec("draft_tokens", "TYPE_INT32", optional=False),
    TensorSpec("target_calls", "TYPE_INT32", optional=False),
    TensorSpec("mean_batch_size", "TYPE_FP32", optional=False, doc="sequences sharing this request's steps"),
    TensorSpec("beam_widths", "TYPE_INT32", (-1,), optional=False, doc="dsbd/beam: output beams of each round"),
)
METRICS = (FINISH_REASON, *REQUEST_METRICS)
#: the engine passes the request's stop strings on: in a decoupled ensemble a step may only take inputs that
#: originate from one decoupled model, so postprocessing cannot read them from the ensemble's inputs
STOP_STRINGS = TensorSpec("stop_strings", "TYPE_STRING", (-1,), optional=False)
#: a request that failed inside the engine after it streamed ends with this message in its final response,
#: in band: Triton 2.51 never hands a decoupled BLS caller an error response that follows partial responses
ENGINE_ERROR = TensorSpec("engine_error", "TYPE_STRING", optional=False, doc="why the request failed ('' if not)")
ENGINE_OUTPUTS = (OUTPUT_IDS, SENT_TOKENS, FINISHED, STOP_STRINGS, *METRICS, ENGINE_ERROR)
TEXT_OUTPUT = TensorSpec("text_output", "TYPE_STRING", optional=False)
#: what a client receives: the text (a delta when streaming), the new token ids, and the metrics
CLIENT_OUTPUTS = (TEXT_OUTPUT, OUTPUT_IDS, *METRICS)


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


def _scalar(inputs: Mapping[str, np.ndarray], spec: TensorSpec) -> object | None:
    """The one value of an optional ``[1]`` input, or None when the client did not send it."""
    array = inputs.get(spec.name)
    if array is None:
        return None
    array = np.asarray(array)
    if array.size != 1:
        raise InvalidRequestError(
            f"input '{spec.name}' must hold exactly one value (shape [1]), got shape {list(array.shape)}"
        )
    _check_dtype(array, spec)
    value = array.reshape(-1)[0]
    if spec.dtype == "TYPE_STRING":
        return _text(value, spec.name)
    if spec.dtype == "TYPE_FP32":
        # the number the client wrote, not its float32 rounding: 1e-5 arrives as 9.99999975e-06, which is below
        # the smallest temperature and would be refused; the shortest decimal that rounds to the same float32 is it
        return float(np.format_float_positional(np.float32(value), unique=True, trim="-"))
    return value.item() if hasattr(value, "item") else value


def _check_dtype(array: np.ndarray, spec: TensorSpec) -> None:
    expected = NUMPY_OF[spec.dtype]
    if expected is np.object_:
        ok = array.dtype == np.object_ or array.dtype.kind in "SU"
    else:
        ok = array.dtype == expected
    if not ok:
        raise InvalidRequestError(f"input '{spec.name}' must be {spec.dtype.removeprefix('TYPE_')}, got {array.dtype}")


def _text(value: object, name: str) -> str:
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise InvalidRequestError(f"input '{name}' is not valid UTF-8: {exc}") from exc
    return str(value)


@dataclass(frozen=True)
class Limits:
    """What one request may send, checked before anything is tokenized (the config's entry-point parameters).

    Why before tokenization: tokenizing a 4 MB prompt took 5.5 s only to find it longer than the context, and
    delayed every other request meanwhile. The prompt cap is generous against the context (a token of SmolLM2's
    vocabulary is ~4 bytes of English, so 64 KiB is ~16,000 tokens, far past a 2,048 context): it refuses only
    what cannot fit, quickly; the exact context check still runs on the token count.
    """

    max_prompt_bytes: int = 65_536
    max_stop_strings: int = 16
    max_stop_bytes: int = 256

    def check(self, inputs: Mapping[str, np.ndarray]) -> None:
        """Raise ``InvalidRequestError`` naming the first limit ``inputs`` exceed."""
        text = inputs.get(TEXT_INPUT.name)
        if text is not None:
            size = sum(len(v) if isinstance(v, (bytes, str)) else 0 for v in np.asarray(text).reshape(-1))
            if size > self.max_prompt_bytes:
                raise InvalidRequestError(
                    f"input 'text_input' is {size} bytes, more than this server accepts ({self.max_prompt_bytes})"
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


def parse_prompt(inputs: Mapping[str, np.ndarray]) -> tuple[str, bool]:
    """``text_input`` (non-empty) and whether to apply the chat template."""
    if TEXT_INPUT.name not in inputs:
        raise InvalidRequestError("input 'text_input' is required")
    text = _scalar(inputs, TEXT_INPUT)
    assert isinstance(text, str)
    if not text.strip():
        raise InvalidRequestError("input 'text_input' is empty: send a non-empty prompt")
    chat = _scalar(inputs, APPLY_CHAT_TEMPLATE)
    return text, bool(chat)


def parse_generation(
    inputs: Mapping[str, np.ndarray], *, max_len: int, default_max_tokens: int = 64, allow_stream: bool = True
) -> Generation:
    """Validate every optional parameter; the first problem raises ``InvalidRequestError`` naming it."""
    values = {name: _scalar(inputs, s) for name, s in _PARAMETER.items() if s.dims == (1,)}
    unknown = sorted(set(inputs) - set(_PARAMETER) - {INPUT_IDS.name, TEXT_INPUT.name, APPLY_CHAT_TEMPLATE.name})
    if unknown:
        raise InvalidRequestError(f"unknown input(s) {unknown}")
    spec = get_method(values["method"] or DEFAULT_METHOD, served=True)
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
    stops = parse_stops(inputs.get(STOP.name))
    timeout_ms = values["timeout_ms"]
    if timeout_ms is not None and int(timeout_ms) <= 0:
        raise InvalidRequestError(f"timeout_ms must be a positive number of milliseconds, got {timeout_ms}")
    # `ar` is EMS-SD with no drafts and `beam` is DSBD with no draft layers: each shares its loop's ragged steps
    num_draft_tokens = (None if k is None else int(k)) if spec.uses_drafter else 0
    return Generation(
        int(max_tokens),
        spec.name,
        sampling,
        num_draft_tokens,
        stops,
        stream,
        beam,
        None if timeout_ms is None else int(timeout_ms) / 1000,
    )


def _beam(values: Mapping[str, object], spec: Method) -> BeamParams | None:
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
    _check_dtype(array, STOP)
    stops = tuple(_text(v, "stop") for v in array.reshape(-1))
    if any(not s for s in stops):
        raise InvalidRequestError("input 'stop' holds an empty string: stop strings must be non-empty")
    return stops


def parse_flag(inputs: Mapping[str, np.ndarray], name: str) -> bool | None:
    """A BOOL [1] parameter (type and shape checked), or None when absent."""
    value = _scalar(inputs, _PARAMETER[name])
    return None if value is None else bool(value)


def parse_text(array: np.ndarray, name: str) -> str:
    """The one string of a BYTES [1] tensor."""
    value = _scalar({name: array}, TensorSpec(name, "TYPE_STRING"))
    assert isinstance(value, str)
    return value


def parse_input_ids(inputs: Mapping[str, np.ndarray]) -> list[int]:
    array = inputs.get(INPUT_IDS.name)
    if array is None or np.asarray(array).size == 0:
        raise InvalidRequestError("input 'input_ids' is empty: the prompt has no tokens")
    return [int(t) for t in np.asarray(array).reshape(-1)]


def as_bytes(text: str) -> np.ndarray:
    """A BYTES tensor of shape [1]."""
    return np.array([text.encode("utf-8")], dtype=np.object_)


def array(spec: TensorSpec, value: Any) -> np.ndarray:
    """``value`` as the tensor ``spec`` declares: its numpy type, one element for a ``[1]`` tensor.

    A list, tuple or array is the tensor's elements; anything else (a str too) is its one
    element. Strings go out as UTF-8 bytes, as BYTES tensors travel.
    """
    values = list(value) if isinstance(value, (list, tuple, np.ndarray)) else [value]
    if spec.dtype == "TYPE_STRING":
        return np.array([v.encode("utf-8") if isinstance(v, str) else v for v in values], dtype=np.object_)
    return np.array(values, dtype=NUMPY_OF[spec.dtype])


def engine_response(
    output_ids: Sequence[int],
    sent_tokens: int,
    finished: bool,
    stops: Sequence[str],
    finish_reason: str,
    metrics: RequestMetrics,
    error: str = "",
) -> dict[str, np.ndarray]:
    """Every tensor of ``ENGINE_OUTPUTS`` for one engine response, in that order and typed by its spec."""
    values = {
        OUTPUT_IDS.name: output_ids,
        SENT_TOKENS.name: sent_tokens,
        FINISHED.name: finished,
        STOP_STRINGS.name: stops,
        FINISH_REASON.name: finish_reason,
        ENGINE_ERROR.name: error,
        **{spec.name: getattr(metrics, spec.name) for spec in REQUEST_METRICS},
    }
    return {spec.name: array(spec, values[spec.name]) for spec in ENGINE_OUTPUTS}


@dataclass(frozen=True)
class EngineResponse:
    """What postprocessing needs of an engine response to compute its text."""

    output_ids: list[int]  # every token so far
    sent_tokens: int  # how many of them earlier responses covered
    finished: bool
    stops: tuple[str, ...]


def engine_error(tensors: Mapping[str, np.ndarray]) -> str:
    """The in-band failure of an engine response ('' when it did not fail)."""
    return str(_scalar(tensors, ENGINE_ERROR) or "") if ENGINE_ERROR.name in tensors else ""


def parse_engine_response(tensors: Mapping[str, np.ndarray], vocab_size: int | None = None) -> EngineResponse:
    """The ids, coverage, end flag and stop strings of one engine response (``engine_response``'s tensors).

    Checked as strictly as a client's input, because the postprocessing model that reads it is reachable by any
    client too: missing tensors, ids outside ``[0, vocab_size)``, or a coverage outside the ids raise
    ``InvalidRequestError`` naming the problem (never a traceback).
    """
    missing = [spec.name for spec in (OUTPUT_IDS, SENT_TOKENS, FINISHED) if spec.name not in tensors]
    if missing:
        raise InvalidRequestError(f"missing input(s) {missing}")
    ids = np.asarray(tensors[OUTPUT_IDS.name])
    _check_dtype(ids, OUTPUT_IDS)
    sent, finished = _scalar(tensors, SENT_TOKENS), _scalar(tensors, FINISHED)
    output_ids = [int(t) for t in ids.reshape(-1)]
    if vocab_size is not None and any(not 0 <= t < vocab_size for t in output_ids):
        raise InvalidRequestError(f"input '{OUTPUT_IDS.name}' holds token ids outside [0, {vocab_size})")
    if not 0 <= int(sent) <= len(output_ids):  # type: ignore[call-overload]
        raise InvalidRequestError(f"input '{SENT_TOKENS.name}' must be between 0 and {len(output_ids)}, got {sent}")
    return EngineResponse(
        output_ids,
        int(sent),
        bool(finished),  # type: ignore[call-overload]
        parse_stops(tensors.get(STOP_STRINGS.name)),
    )


def client_response(text: str, engine: Mapping[str, np.ndarray], response: EngineResponse) -> dict[str, np.ndarray]:
    """Every tensor of ``CLIENT_OUTPUTS``: ``text``, the ids this response adds, the engine's metrics as sent."""
    values = {
        TEXT_OUTPUT.name: array(TEXT_OUTPUT, text),
        OUTPUT_IDS.name: array(OUTPUT_IDS, response.output_ids[response.sent_tokens :]),
        **{spec.name: engine[spec.name] for spec in METRICS},
    }
    return {spec.name: values[spec.name] for spec in CLIENT_OUTPUTS}

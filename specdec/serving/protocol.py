"""The endpoint's models and tensors: names, types, shapes and what each one means, in one table.

Pure numpy, no Triton: the model repository writer renders the ``config.pbtxt`` files from
these tables, the Triton models read their inputs by them (``serving.inputs`` validates what
clients send) and build their responses with ``array`` (``serving.responses``), the client types
its inputs with ``array`` and ``TensorSpec.wire_dtype``. Each name and its type is written here
once, so a model cannot send a tensor its config does not declare, or with another type. Names
follow what Triton LLM users know (TensorRT-LLM's and vLLM's backends): ``text_input``,
``max_tokens``, ``stream``, ``text_output``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from specdec.runtime.logprobs import MAX_TOP_LOGPROBS
from specdec.runtime.methods import DEFAULT_METHOD, SERVED_METHODS

# -- the models of the repository (what clients and the BLS calls between the models address) ------------
PREPROCESSING_MODEL, ENGINE_MODEL, POSTPROCESSING_MODEL = "preprocessing", "specdec_engine", "postprocessing"
STREAM_MODEL, UNARY_MODEL = "specdec_stream", "specdec"
#: the model whose presence is the server's readiness (``serving.gate_model``)
READY_MODEL = "specdec_ready"
MODELS = (PREPROCESSING_MODEL, ENGINE_MODEL, POSTPROCESSING_MODEL, STREAM_MODEL, UNARY_MODEL, READY_MODEL)
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
#: the prompt, one of three ways: text (optionally wrapped as one user turn), a conversation, or token ids
TEXT_INPUT = TensorSpec("text_input", "TYPE_STRING", doc="the prompt as text")
APPLY_CHAT_TEMPLATE = TensorSpec(
    "apply_chat_template", "TYPE_BOOL", doc="text_input: wrap it as one user turn of the chat template"
)
MESSAGES = TensorSpec(
    "messages",
    "TYPE_STRING",
    doc='the prompt as a conversation: a JSON array of {"role": "system"|"user"|"assistant", "content": str}, '
    "rendered by the model's chat template with the assistant's turn opened",
)
CONTINUE_FINAL_MESSAGE = TensorSpec(
    "continue_final_message", "TYPE_BOOL", doc="messages: continue the last (assistant) message instead"
)
PROMPT_IDS = TensorSpec("prompt_ids", "TYPE_INT32", (-1,), doc="the prompt as token ids (no template)")
PROMPTS = (TEXT_INPUT, MESSAGES, PROMPT_IDS)
#: what preprocessing reads: a prompt as text or as a conversation (``prompt_ids`` never reach it)
PREPROCESSING_INPUTS = (TEXT_INPUT, APPLY_CHAT_TEMPLATE, MESSAGES, CONTINUE_FINAL_MESSAGE)
#: the most choices one request may ask for
MAX_CHOICES = 16
PARAMETERS = (
    TensorSpec("max_tokens", "TYPE_INT32", doc="new tokens at most (default 64)"),
    TensorSpec("method", "TYPE_STRING", doc=f"{', '.join(SERVED_METHODS)} (default {DEFAULT_METHOD})"),
    TensorSpec("temperature", "TYPE_FP32", doc="0 = greedy (default)"),
    TensorSpec("top_k", "TYPE_INT32", doc="0 = off"),
    TensorSpec("top_p", "TYPE_FP32", doc="1 = off"),
    TensorSpec("seed", "TYPE_INT32", doc="sampling seed (>= 0); choice i of n samples with seed + i"),
    TensorSpec(
        "num_draft_tokens",
        "TYPE_INT32",
        doc="k per step (ems), γ per round (dsbd); with an adaptive-draft export, the most drafted",
    ),
    TensorSpec("stop", "TYPE_STRING", (-1,), doc="stop strings"),
    TensorSpec("stop_token_ids", "TYPE_INT32", (-1,), doc="token ids that end the answer, besides end of sequence"),
    TensorSpec("min_tokens", "TYPE_INT32", doc="no stop before this many tokens (ar and ems)"),
    TensorSpec("logprobs", "TYPE_BOOL", doc="each new token's target log-probability (output_logprobs)"),
    TensorSpec(
        "top_logprobs", "TYPE_INT32", doc=f"with logprobs: the 0-{MAX_TOP_LOGPROBS} most likely alternatives per token"
    ),
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
#: answered by the entry points themselves (the engine decodes one choice per request)
N = TensorSpec("n", "TYPE_INT32", doc=f"choices to generate for the prompt (1-{MAX_CHOICES}, {STREAM_MODEL} only)")
CLIENT_INPUTS = (*PROMPTS, APPLY_CHAT_TEMPLATE, CONTINUE_FINAL_MESSAGE, N, *PARAMETERS)
PARAMETER = {s.name: s for s in PARAMETERS}
STOP, STREAM, STOP_TOKEN_IDS = PARAMETER["stop"], PARAMETER["stream"], PARAMETER["stop_token_ids"]

# -- between the models ---------------------------------------------------------------------------
INPUT_IDS = TensorSpec("input_ids", "TYPE_INT32", (-1,))
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
    TensorSpec("prompt_tokens", "TYPE_INT32", optional=False, doc="the prompt's tokens"),
    TensorSpec("completion_tokens", "TYPE_INT32", optional=False, doc="tokens generated so far"),
)
METRICS = (FINISH_REASON, *REQUEST_METRICS)
#: each new token's target log-probability and its alternatives (rows: the response's new tokens; columns: the
#: request's top_logprobs); empty when the request did not ask
OUTPUT_LOGPROBS = TensorSpec("output_logprobs", "TYPE_FP32", (-1,), optional=False)
TOP_LOGPROB_IDS = TensorSpec("top_logprob_ids", "TYPE_INT32", (-1, -1), optional=False)
TOP_LOGPROBS = TensorSpec("top_logprobs", "TYPE_FP32", (-1, -1), optional=False)
LOGPROBS = (OUTPUT_LOGPROBS, TOP_LOGPROB_IDS, TOP_LOGPROBS)
#: the engine passes the request's stop strings and tokens on: in a decoupled ensemble a step may only take inputs
#: that originate from one decoupled model, so postprocessing cannot read them from the client's inputs
STOP_STRINGS = TensorSpec("stop_strings", "TYPE_STRING", (-1,), optional=False)
ANSWER_STOP_IDS = TensorSpec("answer_stop_ids", "TYPE_INT32", (-1,), optional=False)
#: a request that failed inside the engine ends with this message and its Triton error code in its final
#: response, in band: Triton 2.51 never hands a decoupled BLS caller an error response that follows partial
#: responses, and it loses the code of one that comes first
ENGINE_ERROR = TensorSpec("engine_error", "TYPE_STRING", optional=False, doc="why the request failed ('' if not)")
ENGINE_ERROR_CODE = TensorSpec(
    "engine_error_code", "TYPE_STRING", optional=False, doc="the failure's code: INVALID_ARG, UNAVAILABLE, INTERNAL"
)
ENGINE_OUTPUTS = (
    OUTPUT_IDS,
    SENT_TOKENS,
    FINISHED,
    STOP_STRINGS,
    ANSWER_STOP_IDS,
    *METRICS,
    *LOGPROBS,
    ENGINE_ERROR,
    ENGINE_ERROR_CODE,
)
TEXT_OUTPUT = TensorSpec("text_output", "TYPE_STRING", optional=False)
#: each new token's raw bytes (a token may hold part of a character), and its alternatives'
OUTPUT_TOKENS = TensorSpec("output_tokens", "TYPE_STRING", (-1,), optional=False)
TOP_LOGPROB_TOKENS = TensorSpec("top_logprob_tokens", "TYPE_STRING", (-1, -1), optional=False)
#: what postprocessing makes of an engine response: the text (a delta when streaming), the new token ids and their
#: bytes, the metrics, the log-probabilities
TEXT_OUTPUTS = (TEXT_OUTPUT, OUTPUT_IDS, *METRICS, *LOGPROBS, OUTPUT_TOKENS, TOP_LOGPROB_TOKENS)
#: which of the request's n choices a response belongs to
INDEX = TensorSpec("index", "TYPE_INT32", optional=False, doc="the choice (0 to n - 1)")
CLIENT_OUTPUTS = (INDEX, *TEXT_OUTPUTS)

#: the messages an entry point refuses capacity with (UNAVAILABLE): a client retries on another replica when one
#: drains, and later when one is full (the OpenAI frontend tells the two apart: 503 and 429)
DRAINING = "the server is draining (shutting down) and admits no new requests: retry on another replica"
RESETTING = "a process of the server failed and is being replaced: retry (on another replica)"
OVERLOADED = "the server is overloaded"
ABORTED = "the server is shutting down: this request was aborted before it finished"

#: the gRPC status each refusal or failure of the entry points has (Triton's error code names -> gRPC's). A stream's
#: error reaches a client without its status (tritonserver 2.51 crashes on the header that would add it), so
#: ``specdec_stream`` writes it first in the message: "INVALID_ARGUMENT: input 'max_tokens' must be ..."
GRPC_STATUS = {"INVALID_ARG": "INVALID_ARGUMENT", "UNAVAILABLE": "UNAVAILABLE", "INTERNAL": "INTERNAL"}


def coded(message: str, code: str) -> str:
    """``message`` led by the gRPC status of Triton error code ``code`` (a stream's error: ``GRPC_STATUS``)."""
    return f"{GRPC_STATUS.get(code, code)}: {message}"


def split_coded(message: str) -> tuple[str | None, str]:
    """(gRPC status, message) of a stream error ``coded`` wrote; (None, message) for any other message."""
    status, sep, rest = message.partition(": ")
    return (status, rest) if sep and status in GRPC_STATUS.values() else (None, message)


def as_bytes(text: str) -> np.ndarray:
    """A BYTES tensor of shape [1]."""
    return np.array([text.encode("utf-8")], dtype=np.object_)


def array(spec: TensorSpec, value: Any) -> np.ndarray:
    """``value`` as the tensor ``spec`` declares: its numpy type, one element for a ``[1]`` tensor.

    A list, tuple or array is the tensor's elements (nested for a 2-D tensor); anything else (a str too) is its one
    element. Strings go out as UTF-8 bytes, as BYTES tensors travel.
    """
    if spec.dtype == "TYPE_STRING":
        if len(spec.dims) == 2:
            rows = [[v.encode("utf-8") if isinstance(v, str) else v for v in row] for row in value]
            out = np.empty((len(rows), len(rows[0]) if rows else 0), dtype=np.object_)
            for i, row in enumerate(rows):
                for j, v in enumerate(row):
                    out[i, j] = v
            return out
        values = list(value) if isinstance(value, (list, tuple, np.ndarray)) else [value]
        return np.array([v.encode("utf-8") if isinstance(v, str) else v for v in values], dtype=np.object_)
    if len(spec.dims) == 2:
        rows = [list(row) for row in value]
        return np.array(rows, dtype=NUMPY_OF[spec.dtype]).reshape(len(rows), len(rows[0]) if rows else 0)
    values = list(value) if isinstance(value, (list, tuple, np.ndarray)) else [value]
    return np.array(values, dtype=NUMPY_OF[spec.dtype])

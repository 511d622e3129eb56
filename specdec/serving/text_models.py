"""The tokenizer's two models: ``preprocessing`` (a prompt to ids) and ``postprocessing`` (ids to text).

Both are stateless, so any number of requests share them. The engine never detokenizes: postprocessing computes
each text delta from ids alone (``runtime.text.text_delta``) and, where the request asked for log-probabilities,
each new token's bytes and its alternatives' (``runtime.text.token_bytes``), off the decoding thread.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from specdec.runtime.sampling import InvalidRequestError
from specdec.runtime.text import decode_tokens, encode_messages, encode_text, text_delta, token_bytes
from specdec.serving.control import Control
from specdec.serving.diagnostics import dump_threads_on_sigusr1
from specdec.serving.heartbeat import Heartbeat
from specdec.serving.inputs import parse_prompt
from specdec.serving.protocol import (
    ENGINE_OUTPUTS,
    INPUT_IDS,
    POSTPROCESSING_MODEL,
    PREPROCESSING_INPUTS,
    PREPROCESSING_MODEL,
    TOP_LOGPROB_IDS,
    array,
)
from specdec.serving.responses import parse_engine_response, text_response
from specdec.serving.triton_io import error_response, from_entry_point, internal_only, load_tokenizer, read_inputs
from specdec.serving.triton_io import response as tensors_response

log = logging.getLogger(__name__)


class _Stateless:
    """What both models share: the export's tokenizer, and a heartbeat for the launcher (``serving.heartbeat``)."""

    def initialize(self, args: dict[str, str]) -> None:
        dump_threads_on_sigusr1()
        self.tokenizer = load_tokenizer(args)
        self.heartbeat = Heartbeat(Control.from_env().directory, args.get("model_name", "")).start()

    def finalize(self) -> None:
        self.heartbeat.exit_if_orphaned()
        self.heartbeat.stop()


class Preprocessing(_Stateless):
    """``text_input`` (optionally one user turn of the chat template) or ``messages`` → ``input_ids``."""

    def encode(self, inputs: dict[str, np.ndarray]) -> list[int]:
        prompt = parse_prompt(inputs)
        if prompt.messages:
            try:
                ids = encode_messages(self.tokenizer, prompt.messages, prompt.continue_final)
            except Exception as exc:  # a template that refuses a conversation (e.g. roles it does not alternate)
                raise InvalidRequestError(f"input 'messages' does not fit the model's chat template: {exc}") from exc
        else:
            ids = encode_text(self.tokenizer, prompt.text or "", prompt.chat)
        if not ids:
            raise InvalidRequestError("the prompt tokenizes to nothing")
        return ids

    def execute(self, requests: list[Any]) -> list[Any]:
        responses = []
        for request in requests:
            if not from_entry_point(request):
                responses.append(internal_only(PREPROCESSING_MODEL))
                continue
            try:
                ids = self.encode(read_inputs(request, PREPROCESSING_INPUTS))
                responses.append(tensors_response({INPUT_IDS.name: array(INPUT_IDS, ids)}))
            except InvalidRequestError as exc:
                responses.append(error_response(str(exc)))
        return responses


class Postprocessing(_Stateless):
    """Engine response → ``text_output`` (a delta when streaming), the new ids and their bytes, the metrics."""

    def _decode(self, ids: Any) -> str:
        return decode_tokens(self.tokenizer, ids)

    def outputs(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        engine = parse_engine_response(inputs, vocab_size=len(self.tokenizer))
        delta = text_delta(
            self._decode, engine.output_ids, engine.sent_tokens, engine.finished, engine.stops, engine.stop_ids
        )
        top = np.asarray(inputs.get(TOP_LOGPROB_IDS.name, np.zeros((0, 0), np.int32)))
        with_logprobs = top.shape[0] == len(engine.new_ids) > 0
        token_text = token_bytes(self.tokenizer, engine.new_ids) if with_logprobs else []
        top_text = [token_bytes(self.tokenizer, [int(t) for t in row]) for row in top] if with_logprobs else []
        return text_response(delta, inputs, engine, token_text, top_text)

    def execute(self, requests: list[Any]) -> list[Any]:
        responses = []
        for request in requests:
            if not from_entry_point(request):
                responses.append(internal_only(POSTPROCESSING_MODEL))
                continue
            try:
                responses.append(tensors_response(self.outputs(read_inputs(request, ENGINE_OUTPUTS))))
            except InvalidRequestError as exc:
                responses.append(error_response(str(exc)))
            except Exception as exc:  # the traceback (server paths) goes to the log, not to the client
                log.exception("postprocessing failed")
                responses.append(error_response(f"postprocessing failed: {type(exc).__name__}", invalid=False))
        return responses

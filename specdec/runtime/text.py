"""The text rules of an answer, in one place: where stop strings cut it and what may be streamed.

The engine (final text), the in-process service (streamed deltas) and the Triton
postprocessing model (stateless deltas between responses) all call these, so the text a
client assembles from a stream is, by construction, the text a unary call returns.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

REPLACEMENT = "\ufffd"
#: stands for the user's text while the chat template is rendered: private-use code points no template holds
_USER_SLOT = "\ue000specdec-user\ue000"


def encode_text(tokenizer: Any, prompt: str, chat: bool = False) -> list[int]:
    """Prompt token ids; ``chat`` wraps the prompt as one user turn of the tokenizer's chat template.

    The user's text never becomes control tokens: ``<|im_start|>system ...`` typed by a user is encoded as the
    characters it is (``split_special_tokens``), and only the template's own markup is special. The template
    is rendered around a placeholder and the user's text encoded on its own; at that boundary (a newline
    before, a special token after) byte-level BPE splits anyway, so ordinary prompts get exactly the ids of
    ``apply_chat_template(tokenize=True)`` (checked in the tests).
    """
    if not chat:
        return list(tokenizer(prompt, split_special_tokens=True)["input_ids"]) if prompt else []
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": _USER_SLOT}], add_generation_prompt=True, tokenize=False
    )
    before, slot, after = rendered.partition(_USER_SLOT)
    if not slot or _USER_SLOT in after:
        raise ValueError("the tokenizer's chat template does not hold the user's text once, verbatim")

    def markup(text: str) -> list[int]:
        return list(tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []

    user = list(tokenizer(prompt, add_special_tokens=False, split_special_tokens=True)["input_ids"]) if prompt else []
    return markup(before) + user + markup(after)


def decode_tokens(tokenizer: Any, token_ids: Sequence[int]) -> str:
    """Answer text of generated ids (special tokens such as EOS are not text)."""
    return tokenizer.decode(list(token_ids), skip_special_tokens=True)


def cut_at_stop(text: str, stops: Sequence[str]) -> str:
    """The final text: everything before the earliest stop string (the stop itself is not returned)."""
    cut = min((text.find(s) for s in stops if s in text), default=-1)
    return text if cut < 0 else text[:cut]


def streamable(text: str, stops: Sequence[str]) -> str:
    """The part of an unfinished answer's ``text`` that is safe to send now.

    Nothing from a complete stop string on is ever sent. A trailing U+FFFD is an incomplete
    multi-byte character that the next token may complete, and a suffix that starts a stop
    string may be cut from the final text, so both are held back until more tokens (or the
    end) decide them.
    """
    text = cut_at_stop(text, stops)
    end = len(text)
    while end and text[end - 1] == REPLACEMENT:
        end -= 1
    text = text[:end]
    hold = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), hold, -1):
            if text.endswith(stop[:n]):
                hold = n
                break
    return text[: len(text) - hold]


def text_delta(
    decode: Callable[[Sequence[int]], str],
    output_ids: Sequence[int],
    sent_tokens: int,
    finished: bool,
    stops: Sequence[str],
) -> str:
    """The text a response adds, computed from token ids alone (no per-request state).

    ``output_ids`` are all tokens generated so far and ``sent_tokens`` how many of them the
    earlier responses covered. The earlier responses sent exactly
    ``streamable(decode(output_ids[:sent_tokens]))``, so the deltas telescope: their
    concatenation is the final text. If a tokenizer re-spells text already sent (it never
    should for byte-level BPE), the already-sent prefix is kept and only the new tail is sent.
    """
    before = streamable(decode(output_ids[:sent_tokens]), stops) if sent_tokens else ""
    text = decode(output_ids)
    now = cut_at_stop(text, stops) if finished else streamable(text, stops)
    if now.startswith(before):
        return now[len(before) :]
    common = 0
    while common < min(len(now), len(before)) and now[common] == before[common]:
        common += 1
    return now[max(common, len(before)) :]

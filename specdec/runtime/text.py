"""The text rules of an answer, in one place: where stop strings cut it and what may be streamed.

The engine (final text), the in-process service (streamed deltas) and the Triton
postprocessing model (stateless deltas between responses) all call these, so the text a
client assembles from a stream is, by construction, the text a unary call returns.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

REPLACEMENT = "\ufffd"
#: stands for a message's text while the chat template is rendered: private-use code points no template holds
_SLOT = "\ue000specdec-{}\ue000"


def encode_text(tokenizer: Any, prompt: str, chat: bool = False) -> list[int]:
    """Prompt token ids; ``chat`` wraps the prompt as one user turn of the tokenizer's chat template
    (``encode_messages``)."""
    if not chat:
        return list(tokenizer(prompt, split_special_tokens=True)["input_ids"]) if prompt else []
    return encode_messages(tokenizer, [{"role": "user", "content": prompt}])


def encode_messages(tokenizer: Any, messages: Sequence[Mapping[str, str]], continue_final: bool = False) -> list[int]:
    """A conversation's prompt ids: the tokenizer's chat template with the assistant's turn opened, or with the last
    (assistant) message left open to be continued (``continue_final``).

    The messages' text never becomes control tokens: ``<|im_start|>system ...`` typed in a message is encoded as
    the characters it is (``split_special_tokens``), and only the template's own markup is special. The template
    is rendered around a placeholder per message and each text encoded on its own; at those boundaries (a newline
    before, a special token after) byte-level BPE splits anyway, so ordinary conversations get exactly the ids of
    ``apply_chat_template(tokenize=True)`` (checked in the tests).
    """
    slots = [_SLOT.format(i) for i in range(len(messages))]
    rendered = tokenizer.apply_chat_template(
        [{"role": m["role"], "content": slot} for m, slot in zip(messages, slots)],
        add_generation_prompt=not continue_final,
        continue_final_message=continue_final,
        tokenize=False,
    )

    def markup(text: str) -> list[int]:
        return list(tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []

    ids: list[int] = []
    for slot, message in zip(slots, messages):
        before, found, rendered = rendered.partition(slot)
        if not found or slot in rendered:
            raise ValueError("the tokenizer's chat template does not hold each message's text once, verbatim")
        ids += markup(before)
        if message["content"]:
            ids += tokenizer(message["content"], add_special_tokens=False, split_special_tokens=True)["input_ids"]
    return ids + markup(rendered)


def decode_tokens(tokenizer: Any, token_ids: Sequence[int]) -> str:
    """Answer text of generated ids (special tokens such as EOS are not text)."""
    return tokenizer.decode(list(token_ids), skip_special_tokens=True)


def text_ids(output_ids: Sequence[int], stop_token_ids: Sequence[int], finished: bool) -> Sequence[int]:
    """The ids whose text is the answer: a finished answer's final stop token is not text (it ends the answer, as
    the model's end of sequence does, whose text the tokenizer skips as special)."""
    if finished and output_ids and stop_token_ids and output_ids[-1] in stop_token_ids:
        return output_ids[:-1]
    return output_ids


def token_bytes(tokenizer: Any, token_ids: Sequence[int]) -> list[bytes]:
    """Each token's own bytes, as the model sees it: a byte-level BPE token may hold part of a character, so its
    text alone would be a replacement character. Byte-level vocabularies (GPT-2 style) map each character back to
    its byte; SentencePiece ones spell a space ``▁`` and a byte ``<0xNN>``; a special token is its text."""
    tokens = tokenizer.convert_ids_to_tokens(list(token_ids))
    special = set(getattr(tokenizer, "all_special_ids", ()))
    byte_of = _byte_decoder() if "ByteLevel" in repr(getattr(tokenizer, "backend_tokenizer", None)) else None
    out = []
    for token_id, token in zip(token_ids, tokens):
        token = token or ""
        if token_id in special:
            out.append(token.encode("utf-8"))
        elif byte_of is not None and all(c in byte_of for c in token):
            out.append(bytes(byte_of[c] for c in token))
        elif len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
            out.append(bytes([int(token[3:5], 16)]))
        else:
            out.append(token.replace("\u2581", " ").encode("utf-8"))
    return out


def _byte_decoder() -> dict[str, int]:
    """GPT-2's reversible map of bytes to printable characters, inverted (what its byte-level BPE spells)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    chars, extra = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


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
    stop_token_ids: Sequence[int] = (),
) -> str:
    """The text a response adds, computed from token ids alone (no per-request state).

    ``output_ids`` are all tokens generated so far and ``sent_tokens`` how many of them the
    earlier responses covered. The earlier responses sent exactly
    ``streamable(decode(output_ids[:sent_tokens]))``, so the deltas telescope: their
    concatenation is the final text. If a tokenizer re-spells text already sent (it never
    should for byte-level BPE), the already-sent prefix is kept and only the new tail is sent.
    """
    before = streamable(decode(output_ids[:sent_tokens]), stops) if sent_tokens else ""
    text = decode(text_ids(output_ids, stop_token_ids, finished))
    now = cut_at_stop(text, stops) if finished else streamable(text, stops)
    if now.startswith(before):
        return now[len(before) :]
    common = 0
    while common < min(len(now), len(before)) and now[common] == before[common]:
        common += 1
    return now[max(common, len(before)) :]

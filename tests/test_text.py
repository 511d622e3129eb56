"""The text rules of streaming (``runtime.text``), on the real SmolLM2 tokenizer, whose byte-level BPE splits
multi-byte characters across tokens: that is where a stateless delta scheme goes wrong if it ever does."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specdec.runtime.text import REPLACEMENT, cut_at_stop, decode_tokens, encode_text, streamable, text_delta

MAX_LEN = 2048
INT32_MAX = 2**31 - 1


def test_cut_at_stop_cuts_at_the_earliest_stop_whatever_the_list_order() -> None:
    """The final text ends before the first stop in the text, not before the first stop in the list."""
    assert cut_at_stop("a STOP b END c", ["END", "STOP"]) == "a "
    assert cut_at_stop("a STOP b END c", ["STOP", "END"]) == "a "
    assert cut_at_stop("xEND", ["D", "END"]) == "x"  # overlapping stops: the one starting first
    assert cut_at_stop("END", ["END"]) == ""
    assert cut_at_stop("no stop here", ["END", "STOP"]) == "no stop here"
    assert cut_at_stop("abc", []) == "abc"


@pytest.mark.parametrize(
    ("text", "stops", "expected"),
    [
        pytest.param("ab\ufffd", [], "ab", id="trailing-fffd"),
        pytest.param("ab\ufffd\ufffd", [], "ab", id="two-trailing-fffd"),
        pytest.param("a\ufffdb", [], "a\ufffdb", id="inner-fffd-is-final"),
        pytest.param("Hello\nUs", ["\nUser:"], "Hello", id="stop-prefix"),
        pytest.param("\nUse", ["\nUser:"], "", id="whole-text-is-stop-prefix"),
        pytest.param("abcd", ["cdX", "dY"], "ab", id="longest-prefix-of-several-stops"),
        pytest.param("abcd", ["dY", "cdX"], "ab", id="longest-prefix-order-independent"),
        pytest.param("Us are", ["User"], "Us are", id="inner-match-is-not-held"),
        pytest.param("Hi \n\ufffd", ["\n🙂"], "Hi ", id="fffd-then-stop-prefix"),
        pytest.param("", ["x"], "", id="empty"),
    ],
)
def test_streamable_holds_back_what_later_tokens_may_change(text: str, stops: list[str], expected: str) -> None:
    """Only an incomplete character at the end or the start of a stop string may be revised or cut later."""
    assert streamable(text, stops) == expected


def test_streamable_never_sends_a_complete_stop() -> None:
    """What an unfinished answer streams must be a prefix of its final text, even if it already holds a stop."""
    assert streamable("Hello.\nUser: hi", ["\nUser:"]) == "Hello."


def test_text_delta_keeps_what_was_sent_when_the_tokenizer_respells() -> None:
    """A re-spelt prefix is never re-sent or retracted: only text past what the client holds goes out."""
    spelled = {(1,): "ab", (1, 2): "aXcd"}

    def decode(ids: Sequence[int]) -> str:
        return spelled[tuple(ids)]

    assert text_delta(decode, [1], 0, False, []) == "ab"
    assert text_delta(decode, [1, 2], 1, True, []) == "cd"


@pytest.fixture(scope="module")
def tok() -> Any:
    """The real SmolLM2 tokenizer (byte-level BPE, 49,152 ids)."""
    from specdec.models.loading import load_model

    return load_model("smollm2-135m").tokenizer


#: texts whose characters take 2, 3 and 4 UTF-8 bytes, so their tokens split characters
MULTI_BYTE = ("héllo wörld 你好 🙂", "日本語のテキスト", "👍🏽 ünïcödé", " Ελληνικά — naïve café", "🙂🙂🙂")


def stream(
    decode: Callable[[Sequence[int]], str], ids: list[int], ends: Sequence[int], stops: Sequence[str]
) -> list[str]:
    """The text_output of each response when responses cover ``ids[:end]`` for each end (the last is final)."""
    deltas, sent = [], 0
    for i, end in enumerate(ends):
        deltas.append(text_delta(decode, ids[:end], sent, i == len(ends) - 1, stops))
        sent = end
    return deltas


def finish_at_stop(decode: Callable[[Sequence[int]], str], ids: list[int], stops: Sequence[str]) -> list[int]:
    """The tokens the engine generates: it finishes on the first token whose text completes a stop string."""
    for n in range(1, len(ids) + 1):
        if any(s in decode(ids[:n]) for s in stops):
            return ids[:n]
    return ids


def check_stream(
    decode: Callable[[Sequence[int]], str], ids: list[int], ends: Sequence[int], stops: Sequence[str]
) -> None:
    final = cut_at_stop(decode(ids), stops)
    deltas = stream(decode, ids, ends, stops)
    assert "".join(deltas) == final
    received = ""
    for delta in deltas[:-1]:
        received += delta
        assert final.startswith(received), (received, final)  # nothing sent is ever revised
    if REPLACEMENT not in final:
        assert all(REPLACEMENT not in d for d in deltas), deltas  # an incomplete character was sent


@pytest.mark.real_model
def test_multi_byte_text_streams_whole_characters_at_every_split(tok: Any) -> None:
    """Split a multi-byte text after every token: no response carries half a character or text past a stop."""

    def decode(ids: Sequence[int]) -> str:
        return decode_tokens(tok, ids)

    for text in MULTI_BYTE:
        ids = encode_text(tok, text)
        assert decode(ids) == text
        assert any(REPLACEMENT in decode(ids[:n]) for n in range(1, len(ids)))  # the test does split characters
        for stops in ([], [text[-3:-1]], [text[2:4], "\n"]):  # stops of multi-byte characters too
            kept = finish_at_stop(decode, ids, stops)
            for n in range(1, len(kept)):
                check_stream(decode, kept, [n, len(kept)], stops)
            check_stream(decode, kept, range(1, len(kept) + 1), stops)  # one token per response


@st.composite
def token_streams(draw: st.DrawFn, vocab: int, pieces: list[list[int]]) -> tuple[list[int], list[int]]:
    """Ids mixing arbitrary vocab ids with tokens of multi-byte texts, and the response ends splitting them."""
    parts = draw(
        st.lists(
            st.one_of(
                st.lists(st.integers(0, vocab - 1), min_size=1, max_size=4),
                st.sampled_from(pieces),
                st.sampled_from(pieces).flatmap(lambda p: st.lists(st.sampled_from(p), min_size=1, max_size=6)),
            ),
            min_size=1,
            max_size=5,
        )
    )
    ids = [t for part in parts for t in part]
    ends = draw(st.lists(st.integers(1, len(ids)), max_size=6, unique=True))
    return ids, sorted(ends)


@settings(max_examples=60, deadline=None)
@given(data=st.data())
@pytest.mark.real_model
def test_streamed_deltas_concatenate_to_the_final_text(tok: Any, data: st.DataObject) -> None:
    """Stateless deltas between any responses add up to the unary answer, with or without stop strings."""

    def decode(ids: Sequence[int]) -> str:
        return decode_tokens(tok, ids)

    pieces = [encode_text(tok, text) for text in MULTI_BYTE]
    ids, ends = data.draw(token_streams(len(tok), pieces))
    full = decode(ids)
    stops: list[str] = []
    for _ in range(data.draw(st.integers(0, 3)) if full else 0):
        if data.draw(st.booleans()):  # a few characters of the text
            start = data.draw(st.integers(0, len(full) - 1))
            stops.append(full[start : data.draw(st.integers(start + 1, min(len(full), start + 5)))])
        else:  # the text of a few consecutive tokens, so that responses can end inside it
            start = data.draw(st.integers(0, len(ids) - 1))
            stops.append(decode(ids[start : start + data.draw(st.integers(2, 3))]) or "x")
    ids = finish_at_stop(decode, ids, stops)
    if data.draw(st.booleans()):
        ends = list(range(1, len(ids)))  # one token per response
    ends = sorted({e for e in ends if e < len(ids)} | {len(ids)})
    check_stream(decode, ids, ends, stops)

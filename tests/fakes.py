"""Test doubles that need no real model: scripted backends and a small trained tokenizer.

Loop-control tests (how many target and draft calls a loop makes, what k it drafts, where it
stops) should not depend on what a random LLaMA happens to predict, nor pay for its matmuls.
A ``ScriptedBackend`` implements the ``Backend`` protocol of ``specdec.runtime.backends.base``
with a rule instead of a network: its "KV cache" stores the token ids each slot has seen, and
the logits of a row are a peaked one-hot of ``rule(context)``, where ``context`` is the cached
prefix plus the row's ancestors in the packed step. So a target always continues a known
sequence and a draft proposes known (right or wrong) tokens, through the very cache moves
(commit, compaction, fork, truncation) the loops make on a real model.

``small_tokenizer`` is a byte-level BPE trained in memory on the few KB of ``CORPUS``, with
SmolLM2's special tokens and a ChatML template: text in and text out (chat prompts, multi-byte
characters split across tokens) for tests that must not load SmolLM2 just for its tokenizer.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from specdec.runtime.packed import PackedBatch

#: the next token after a context (prompt + tokens so far, as the model sees them)
Rule = Callable[[Sequence[int]], int]

#: the chosen token's logit; every other token has 0, so even a sampled step picks the chosen one
#: except with probability about vocab * e^-40 (never, in a test)
PEAK = 40.0


def counting(vocab_size: int, stride: int = 1) -> Rule:
    """Each token is the last one plus ``stride`` (mod V): from prompt [5], stride 1 continues 6, 7, 8, ...

    A draft with another stride than its target's is wrong at every position.
    """
    return lambda context: (context[-1] + stride) % vocab_size


def wrong_where(rule: Rule, vocab_size: int, bad: Callable[[Sequence[int]], bool]) -> Rule:
    """``rule``, except that it proposes another token wherever ``bad(context)`` holds."""
    return lambda context: (rule(context) + 1) % vocab_size if bad(context) else rule(context)


class ScriptedKV:
    """Per-slot token ids standing in for K/V: ``ids[slot, pos]`` is the token written at ``pos`` (-1: never)."""

    def __init__(self, num_slots: int, max_len: int) -> None:
        self.num_slots, self.max_len, self.buffer_len = num_slots, max_len, max_len
        self.ids = np.full((num_slots, max_len), -1, dtype=np.int64)

    def move(self, slot: int, src: Sequence[int], dst: Sequence[int]) -> None:
        self.ids[slot, list(dst)] = self.ids[slot, list(src)].copy()

    def copy_prefix(self, src_slot: int, dst_slot: int, length: int) -> None:
        self.ids[dst_slot, :length] = self.ids[src_slot, :length]

    def read(self, slot: int, length: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """One "layer" whose K and V are the token ids, shaped ``[1, length, 1]``."""
        k = self.ids[slot, :length].astype(np.float32).reshape(1, length, 1)
        return [(k, k.copy())]


class ScriptedBackend:
    """A ``Backend`` whose logits follow ``rule``; it counts its calls and keeps every batch it ran.

    ``batches[i]`` is the ``PackedBatch`` of call i (``last_batch`` the latest), so a test reads the
    rows, past lengths and slots of each step; ``rows_in(i)`` gives the new tokens per sequence.
    """

    head_token_ids = None
    supports_cache_mask = True

    def __init__(self, rule: Rule, vocab_size: int) -> None:
        self.rule, self.vocab_size, self.head_size = rule, vocab_size, vocab_size
        self.calls = 0
        self.rows_processed = 0
        self.batches: list[PackedBatch] = []

    @property
    def last_batch(self) -> PackedBatch | None:
        return self.batches[-1] if self.batches else None

    def rows_in(self, call: int) -> list[int]:
        """New tokens of each sequence in call ``call`` (a prefill's prompt, or last token + drafts)."""
        return np.diff(self.batches[call].cu_seqlens).tolist()

    def allocate_cache(self, num_slots: int, max_len: int) -> ScriptedKV:
        return ScriptedKV(num_slots, max_len)

    def step(self, batch: PackedBatch, cache: ScriptedKV) -> np.ndarray:
        """Write each new token at ``past + j`` of its slot; logits of row t = one-hot of ``rule`` after its context."""
        self.calls += 1
        self.rows_processed += batch.num_tokens
        self.batches.append(batch)
        logits = np.zeros((batch.num_tokens, self.vocab_size), dtype=np.float32)
        bounds = batch.cu_seqlens.tolist()
        for b, (start, end) in enumerate(itertools.pairwise(bounds)):
            slot, past = int(batch.slot_ids[b]), int(batch.past_lens[b])
            if past + end - start > cache.max_len:
                raise IndexError(f"slot {slot}: {end - start} rows after {past} pass the cache's {cache.max_len}")
            cached = cache.ids[slot, :past]
            if batch.cache_mask is not None:  # the padded baseline's holes are not part of the context
                cached = cached[batch.cache_mask[b, :past]]
            prefix = cached.tolist()
            new = batch.input_ids[start:end].tolist()
            cache.ids[slot, past : past + len(new)] = new
            for j in range(len(new)):
                seen = batch.tree_mask[start + j, : len(new)].tolist()
                context = prefix + [tok for tok, visible in zip(new, seen) if visible]
                logits[start + j, self.rule(context)] = PEAK
        return logits[batch.logits_indices.astype(np.int64)]


#: what the small tokenizer is trained on: English prose, chat-like questions, and multi-byte text
CORPUS = """\
The water cycle moves water from the oceans to the sky and back again. Sunlight warms the sea, vapour rises,
cools into clouds, and falls as rain or snow on mountains, forests and cities. Rivers carry it home.
Black holes are regions where gravity is so strong that nothing, not even light, can escape. They form when
massive stars collapse at the end of their lives, and they grow by swallowing gas, dust and other stars.
Photosynthesis lets plants turn sunlight, water and carbon dioxide into sugar and oxygen. The green pigment
chlorophyll captures light in the leaves; the sugar feeds the plant, and the oxygen fills the air we breathe.
Prime numbers have exactly two divisors: one and themselves. Two, three, five, seven and eleven are prime;
every whole number greater than one is a product of primes in exactly one way, which is why they matter.
Hello there! How are you today? I am fine, thank you. What is the capital of France? Paris is the capital.
Tell me about bees. Bees live in colonies with a queen, workers and drones; they collect nectar and pollen,
make honey and wax, and pollinate flowers, fruit trees and many crops that people eat every single day.
Write a haiku about tea. Steam curls from the cup, a quiet morning begins, leaves unfold slowly.
What is DNA? DNA is the molecule that carries genetic instructions for growth, function and reproduction.
Explain the French revolution to a ten-year-old. Long ago the people of France were hungry and angry
at their king, so they changed their government and wrote new rules about liberty, equality and brotherhood.
Give step-by-step instructions for baking bread: mix flour, water, yeast and salt; knead the dough;
let it rise for an hour; shape the loaf; bake it in a hot oven until the crust is golden and crisp.
One two three four five six seven eight nine ten. Monday, Tuesday, Wednesday, Thursday, Friday, Saturday.
January February March April May June July August September October November December, spring and autumn.
Quantum computers use qubits, which can hold a superposition of zero and one, to explore many answers
at once; they may someday simulate molecules, break codes, and optimise routes far faster than machines now.
Penguins are birds that cannot fly but swim beautifully through cold southern waters, hunting fish and krill.
The Great Wall of China stretches thousands of kilometres across hills, deserts and grasslands in the north.
Summarise the story in one sentence. Translate this sentence into German. List three reasons why sleep helps.
Compare cats and dogs as pets: cats are independent and quiet, dogs are loyal, playful and need long walks.
A speculative decoder drafts several tokens cheaply and lets the large model verify them in a single step;
when the draft agrees with the target, many tokens are accepted at once and the answer arrives sooner.
Volcanoes erupt when molten rock, called magma, pushes up through cracks in the crust of the earth.
Oceans cover most of our planet; their currents carry heat from the equator toward the poles and shape weather.
Music, painting, poetry, dance and theatre let people share feelings and stories across languages and centuries.
Keep a budget: write down income and expenses, save a little every month, and avoid debts you cannot repay.
Exercise strengthens the heart, lungs and muscles, improves mood and sleep, and helps people live longer lives.
Recycling paper, glass, metal and plastic saves energy and raw materials and keeps rubbish out of landfills.
The moon orbits the earth roughly every twenty-seven days, and its gravity raises the tides of the oceans.
Héllo wörld, naïve café, Ünïcödé text ✓, 日本語のテキスト, 你好, Ελληνικά — emoji 🙂 and 👍🏽 also appear here.
"""

#: SmolLM2-Instruct's ChatML template, default system turn included
CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant.<|im_end|>\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


@functools.cache
def _trained() -> str:
    """The trained BPE as JSON (0.01 s; deterministic: the same corpus always gives the same merges)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    # a vocabulary cap above what the corpus can merge: every merge is kept (about 1,400 ids)
    trainer = trainers.BpeTrainer(
        vocab_size=4096,
        special_tokens=list(SPECIAL_TOKENS),
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    bpe.train_from_iterator(CORPUS.splitlines(), trainer)
    return bpe.to_str()


def small_tokenizer() -> Any:
    """A fresh ``PreTrainedTokenizerFast``: byte-level BPE of ~1,400 ids, EOS = pad = ``<|im_end|>``, ChatML chat.

    Fresh on every call, so a test that edits it (e.g. drops its chat template) changes no one else's.
    """
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_trained()),
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|im_end|>",
        unk_token="<|endoftext|>",
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer

"""What the target is asked to continue: built-in chat prompts, a prompts file, or self-written requests.

Why: the draft learns the target's continuations of these prompts, so they decide which
contexts it gets good at. ``--self-prompts N`` adds N requests that a chat target writes
itself (continued from where its chat template puts a user's message); they are split apart
from the other prompts and evaluated apart (:func:`specdec.distill.data.distill_data`).
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from specdec.distill.records import generate_records
from specdec.distill.settings import DistillSettings
from specdec.models.errors import DraftLoadError
from specdec.models.loading import LoadedModel

_TOPICS = [
    "the water cycle",
    "black holes",
    "photosynthesis",
    "the French revolution",
    "prime numbers",
    "a binary search",
    "recursion in Python",
    "sourdough bread",
    "the immune system",
    "volcanoes",
    "machine learning",
    "the stock market",
    "climate change",
    "the Roman empire",
    "electric cars",
    "honey bees",
    "the internet",
    "chess openings",
    "jazz music",
    "the moon landing",
    "vaccines",
    "coffee",
    "earthquakes",
    "the human heart",
    "solar panels",
    "the Pythagorean theorem",
    "rainbows",
    "sleep",
    "octopuses",
    "the printing press",
    "a hash table",
    "inflation",
    "glaciers",
    "bicycles",
    "Shakespeare",
    "the periodic table",
    "antibiotics",
    "tides",
    "the speed of light",
    "democracy",
]
_TEMPLATES = [
    "Explain {t} to a ten-year-old.",
    "Write a short paragraph about {t}.",
    "What are three interesting facts about {t}?",
    "Summarise what {t} is in two sentences.",
    "Write a haiku about {t}.",
    "List the pros and cons of {t}.",
    "Give me a quiz question about {t}.",
    "How would you describe {t} to someone who has never heard of it?",
    "Write a short story that involves {t}.",
    "What is a common misconception about {t}?",
]


_MORE_TOPICS = [
    "the Great Wall of China",
    "penguins",
    "quantum computers",
    "the Olympic games",
    "tea ceremonies",
    "a linked list",
    "SQL joins",
    "the rain forest",
    "dinosaurs",
    "the violin",
    "gardening",
    "mars rovers",
    "wind turbines",
    "the Renaissance",
    "dolphins",
    "cryptography",
    "the human brain",
    "origami",
    "marathon running",
    "the Silk Road",
    "yeast",
    "lightning",
    "public libraries",
    "the stock exchange",
    "nuclear fusion",
    "sorting algorithms",
    "the Amazon river",
    "time zones",
    "bees and flowers",
    "the piano",
    "deserts",
    "a compiler",
    "the Eiffel tower",
    "cats",
    "meditation",
    "hurricanes",
    "recycling",
    "the ancient Egyptians",
    "DNA",
    "satellites",
    "chocolate",
    "the Industrial Revolution",
    "friendship",
    "unit testing",
    "the metric system",
    "coral reefs",
    "opera",
    "electricity",
    "maps",
    "the Fibonacci sequence",
    "volunteering",
    "trains",
    "the ozone layer",
    "pizza",
    "git branches",
    "the Milky Way",
    "mushrooms",
    "budgeting",
    "the Olympics of ancient Greece",
    "telescopes",
]
_MORE_TEMPLATES = [
    "Write an email to a friend about {t}.",
    "Give step-by-step instructions related to {t}.",
    "Compare {t} with something similar.",
    "Why is {t} important?",
    "Write a limerick about {t}.",
    "Describe the history of {t} briefly.",
    "What questions do people often ask about {t}? Answer one.",
    "Write a tweet about {t}.",
    "Explain {t} in simple terms, then give an example.",
    "Write a dialogue between two people about {t}.",
]


def builtin_prompts() -> list[str]:
    """2000 diverse chat prompts (topics × instruction shapes), in a fixed shuffled order.

    The first 400 (the original 40 topics × 10 shapes) keep their order, so data cached by an
    earlier ``--samples 400`` run is still the prefix of a larger run and is reused.
    """
    first = [template.format(t=topic) for topic in _TOPICS for template in _TEMPLATES]
    random.Random(0).shuffle(first)
    seen = set(first)
    rest = [template.format(t=topic) for topic in _TOPICS + _MORE_TOPICS for template in _TEMPLATES + _MORE_TEMPLATES]
    rest = [p for p in rest if p not in seen]
    random.Random(1).shuffle(rest)
    return first + rest


def pre_query_ids(tokenizer: Any) -> list[int]:
    """The chat template up to where a user's message begins (system turn and user header).

    Why: an instruction-tuned target continued from here writes a *user* turn, a question
    drawn from the kind of requests it was tuned on (the "Magpie" trick, Xu et al. 2024).
    That gives a prompt set far more varied than topics x templates, on a machine with no
    chat dataset, in the target's own distribution of requests.
    """
    marker = "\x00specdec-user-message\x00"
    try:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": marker}], add_generation_prompt=False, tokenize=False
        )
    except (ValueError, AttributeError) as exc:
        raise ValueError(f"--self-prompts needs a target with a chat template: {exc}") from exc
    if marker not in text:
        raise ValueError(
            "the target's chat template does not place the user's message verbatim: "
            "--self-prompts cannot find where a user turn starts"
        )
    return list(tokenizer(text[: text.index(marker)], add_special_tokens=False)["input_ids"])


def self_prompts(
    target: LoadedModel, work: Path, n: int, *, seed: int, max_tokens: int = 96, block: int = 128, min_words: int = 3
) -> list[str]:
    """``n`` distinct user requests written by the target itself, cached in ``work/self-prompts.json``.

    Candidates are sampled at temperature 1 from :func:`pre_query_ids` in blocks of ``block``
    (candidate ``i`` has seed ``seed + 10**6 + i``, so an interrupted run that resumes draws
    the same candidates). A candidate is kept when the target ended the turn itself (EOS
    within ``max_tokens``: a cut-off turn is no request), it has at least ``min_words`` words,
    and it is new. Every usable candidate of a block is kept, even past ``n``, so the list is a
    function of the candidates drawn alone: a later, larger ``n`` extends it exactly as one run
    would have. The file is rewritten after every block and records its settings; a rerun
    with other settings is refused rather than mixed.
    """
    from specdec.runtime.text import decode_tokens

    if n < 0:
        raise ValueError(f"--self-prompts must be >= 0, got {n}")
    work.mkdir(parents=True, exist_ok=True)
    path = work / "self-prompts.json"
    settings = {
        "target": target.checksum(),
        "seed": seed,
        "max_tokens": max_tokens,
        "block": block,
        "min_words": min_words,
    }
    state: dict[str, Any] = {"settings": settings, "candidates": 0, "prompts": []}
    if path.is_file():
        state = json.loads(path.read_text(encoding="utf-8"))
        if state.get("settings") != settings:
            raise DraftLoadError(
                f"{path} was written with other settings ({state.get('settings')} vs {settings}): "
                "remove it or use the settings it was made with"
            )
    prefix = pre_query_ids(target.tokenizer)
    eos = set(target.eos_token_ids)
    seen = set(state["prompts"])
    bar = tqdm(total=n, initial=min(n, len(state["prompts"])), desc="self-written prompts", unit="prompt")
    while len(state["prompts"]) < n:
        if state["candidates"] > 50 * max(n, block):
            raise ValueError(
                f"the target wrote only {len(state['prompts'])} usable requests in "
                f"{state['candidates']} tries: is it an instruction-tuned model?"
            )
        drawn = generate_records(
            target,
            [prefix] * block,
            max_new_tokens=max_tokens,
            temperature=1.0,
            teacher_k=1,
            seed=seed + 10**6 + state["candidates"],
            max_batch=64,
        )
        for record in drawn:
            turn = record.tokens[len(prefix) :]
            if not turn or turn[-1] not in eos:
                continue
            text = decode_tokens(target.tokenizer, turn).strip()
            if len(text.split()) >= min_words and text not in seen:  # all of the block: see the docstring
                seen.add(text)
                state["prompts"].append(text)
        bar.update(min(n, len(state["prompts"])) - bar.n)
        state["candidates"] += block
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(state, indent=1), encoding="utf-8")
        tmp.replace(path)
    bar.close()
    return state["prompts"][:n]


def load_prompts(settings: DistillSettings) -> list[str]:
    """The run's ``--samples`` prompts: from ``--prompts FILE`` (a JSON list or one per line), else built in."""
    if not settings.prompts_file:
        prompts = builtin_prompts()
        # past the built-in list a prompt comes again; its continuation differs (every sample has its own seed)
        return [prompts[i % len(prompts)] for i in range(settings.samples)]
    text = Path(settings.prompts_file).read_text(encoding="utf-8")
    prompts = json.loads(text) if text.lstrip().startswith("[") else [ln for ln in text.splitlines() if ln.strip()]
    return [str(p) for p in prompts][: settings.samples]

"""The benchmarks' prompts and how their answers are scored, all built from the Python standard library.

Why the standard library: EMS-SD's paper measures CNN/DailyMail summarisation with an LLMA
(prompt-lookup) drafter, because answers that copy spans of the prompt are where n-gram drafting
pays. Offline, the closest real text is the documentation that ships with Python: docstrings of
standard-library modules and functions, which need no download.

* ``build_workload``: prompts asking the chat model to summarise or list the points of one
  docstring, so the answer quotes it (``specdec bench`` and most scripts in ``benchmarks/``).
* ``qa_set`` with ``exact_match`` and ``first_choice``: extractive QA whose answer is a word of
  the context (``specdec bench beams``'s quality check).
"""

from __future__ import annotations

import importlib
import inspect
import re
from collections.abc import Sequence
from typing import Any, NamedTuple

# Standard-library objects whose docstrings form the workload, in the order prompts are
# taken (a batch of B uses the first B). Modules and functions are mixed so that every
# prefix holds prose, option lists and API descriptions alike.
DOC_SOURCES = (
    "subprocess",
    "json.dumps",
    "collections",
    "functools.lru_cache",
    "heapq",
    "textwrap.dedent",
    "shutil.rmtree",
    "csv",
    "bisect.bisect_left",
    "statistics.median",
    "random.Random.sample",
    "tarfile.TarFile.extractall",
    "zipfile.ZipFile",
    "itertools",
    "logging.Logger",
    "argparse.ArgumentParser",
    "string",
    "datetime.timedelta",
    "pathlib.Path",
    "unittest.TestCase",
    "json.JSONEncoder",
    "functools.reduce",
    "collections.namedtuple",
    "heapq.merge",
    "textwrap.wrap",
    "shutil.move",
    "statistics.quantiles",
    "subprocess.run",
    "tempfile.mkstemp",
    "contextlib.contextmanager",
    "dataclasses.dataclass",
    "os.makedirs",
    "re.split",
    "sched",
    "struct",
    "inspect",
    "uuid",
    "difflib",
    "copy",
    "timeit",
    "tokenize",
    "typing",
    "sqlite3",
    "io",
    "zlib",
    "fnmatch",
    "pprint",
    "getopt",
    "colorsys",
    "optparse",
)

PROMPT_TEMPLATES = (
    "Summarize the following Python documentation in a few sentences, reusing its own wording.\n\n{text}",
    "List the functions, options and key points described in the following Python documentation, "
    "one per line.\n\n{text}",
)

# About 80 to 300 tokens of English-and-code text (SmolLM2's tokenizer: ~4 characters a token).
MIN_DOC_CHARS, MAX_DOC_CHARS = 320, 1200


# -- summarisation / extraction prompts -------------------------------------------------


def _resolve(dotted: str) -> object:
    """Import ``pkg.mod.attr.attr`` by importing the longest module prefix that exists."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj: object = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            obj = getattr(obj, name)
        return obj
    raise ImportError(f"cannot import {dotted!r}")


def _trim(text: str, max_chars: int) -> str:
    """Cut at the last paragraph (or line) break before ``max_chars`` so the text stays whole."""
    if len(text) <= max_chars:
        return text
    head = text[:max_chars]
    cut = head.rfind("\n\n")
    if cut < max_chars // 2:
        cut = head.rfind("\n")
    return head[:cut].rstrip() if cut > 0 else head


def collect_documents(min_chars: int = MIN_DOC_CHARS, max_chars: int = MAX_DOC_CHARS) -> list[tuple[str, str]]:
    """``(name, docstring)`` pairs from ``DOC_SOURCES`` that are long enough to summarise.

    Docstrings are real, varied technical prose that every Python installation has, so the
    workload needs no download. They change only between Python versions (the report
    records the version).
    """
    docs = []
    for name in DOC_SOURCES:
        try:
            text = inspect.getdoc(_resolve(name)) or ""
        except (ImportError, AttributeError):
            continue  # a stripped-down Python build: skip, the rest is still deterministic
        text = _trim(text.strip(), max_chars)
        if len(text) >= min_chars:
            docs.append((name, text))
    return docs


def build_workload(n: int, *, min_chars: int = MIN_DOC_CHARS, max_chars: int = MAX_DOC_CHARS) -> list[str]:
    """``n`` summarisation / extraction prompts over standard-library docstrings.

    Deterministic (no randomness). Prompt i uses document ``i mod D`` and template
    ``(i + i // D) mod 2``, so a workload longer than the document list repeats documents
    with the other instruction rather than exact duplicates.
    """
    if n < 1:
        raise ValueError(f"need at least one prompt, got n={n}")
    docs = collect_documents(min_chars, max_chars)
    if not docs:
        raise RuntimeError("no standard-library docstring is long enough: is this a stripped Python build?")
    prompts = []
    for i in range(n):
        _, text = docs[i % len(docs)]
        template = PROMPT_TEMPLATES[(i + i // len(docs)) % len(PROMPT_TEMPLATES)]
        prompts.append(template.format(text=text))
    return prompts


# -- extractive QA ----------------------------------------------------------------------

#: standard-library modules whose docstring's first line makes a QA item (those that name themselves are skipped)
QA_MODULES = (
    "csv",
    "re",
    "heapq",
    "bisect",
    "shutil",
    "zipfile",
    "gzip",
    "textwrap",
    "fractions",
    "statistics",
    "tempfile",
    "glob",
    "fnmatch",
    "pickle",
    "uuid",
    "random",
    "struct",
    "copy",
    "itertools",
    "queue",
    "getpass",
    "tarfile",
    "colorsys",
    "timeit",
    "shlex",
    "mimetypes",
    "inspect",
    "tokenize",
    "filecmp",
    "linecache",
    "traceback",
    "codeop",
    "reprlib",
    "configparser",
    "contextlib",
    "operator",
)
QA_GROUP = 5


class QAItem(NamedTuple):
    """One extractive QA item: the prompt, the right module, and the five modules the prompt lists."""

    prompt: str
    answer: str
    choices: tuple[str, ...]


def qa_set(n: int) -> list[QAItem]:
    """``n`` QA items: which of five listed modules a quoted description belongs to.

    Deterministic. Item i shows the group of ``QA_GROUP`` consecutive modules that contains its
    answer, so every context is real documentation text and the answer is extractive.
    """
    entries = []
    for name in QA_MODULES:
        try:
            doc = (importlib.import_module(name).__doc__ or "").strip()
        except ImportError:
            continue
        first = doc.splitlines()[0].strip() if doc else ""
        if first.endswith(".") and len(first) >= 15 and name not in first.lower():
            entries.append((name, first))
    groups = [entries[i : i + QA_GROUP] for i in range(0, len(entries) - QA_GROUP + 1, QA_GROUP)]
    if not groups:
        raise RuntimeError("too few standard-library docstrings for the QA set: is this a stripped Python build?")
    items = []
    for i in range(n):
        group = groups[(i // QA_GROUP) % len(groups)]
        name, description = group[i % QA_GROUP]
        listing = "\n".join(f"- {m}: {d}" for m, d in group)
        items.append(
            QAItem(
                f"Here are Python standard-library modules and what they do:\n{listing}\n\n"
                f'Which module is described as "{description}"? Answer with the module name only.',
                name,
                tuple(m for m, _ in group),
            )
        )
    return items


def exact_match(text: str, answer: str) -> bool:
    """Whether the first line of ``text``, normalised, is ``answer`` (SQuAD-style normalisation)."""
    lines = text.strip().splitlines()
    got = lines[0].strip().lower() if lines else ""
    got = re.sub(r"[`'\"*]", "", got).rstrip(".").strip()
    got = re.sub(r"^(the\s+)?(answer is\s*:?\s*)?", "", got)
    got = re.sub(r"\s+module$", "", got).strip()
    return got == answer.lower()


def first_choice(text: str, choices: Sequence[str]) -> str | None:
    """The first of ``choices`` that ``text`` names as a whole word (any case), or None.

    Why the first: an answer that goes on to mention other modules ("heapq, unlike bisect,
    ...") has already given its choice; a later mention is not a second answer.
    """
    found = [
        (m.start(), c)
        for c in choices
        if (m := re.search(rf"(?<![\w.]){re.escape(c)}(?!\w)", text, flags=re.IGNORECASE))
    ]
    return min(found)[1] if found else None


#: general questions and instructions, deliberately not in the shapes or topics of the
#: prompts the draft was distilled on (``specdec.distill.prompts._TEMPLATES`` x ``_TOPICS``).
CHAT_PROMPTS = (
    "Explain why the sky looks blue during the day and red at sunset.",
    "Write a short email to a colleague asking to move tomorrow's meeting to Friday afternoon.",
    "Give three tips for staying focused while working from home.",
    "What is the difference between a list and a tuple in Python?",
    "Describe how to make a simple tomato pasta sauce, step by step.",
    "Why do cats purr? Keep the answer brief.",
    "Write a polite message declining an invitation to a birthday party.",
    "Give me five ideas for a rainy weekend with children.",
    "Explain what a mortgage is and how the interest rate affects the monthly payment.",
    "How can I improve my handwriting? Give practical advice.",
    "Write a thank-you note to a teacher at the end of the school year.",
    "What should I pack for a three-day hiking trip?",
    "Explain the difference between weather and climate.",
    "Suggest a name for a small bakery and explain your choice.",
    "Give three reasons why regular exercise is good for mental health.",
    "How does a refrigerator keep food cold?",
    "Write a short product description for a reusable water bottle.",
    "What are the main steps to repot a houseplant?",
    "Explain what an API is to someone who is just starting to learn programming.",
    "Write a short apology email for missing a project deadline.",
    "Give four tips for doing well in a job interview.",
    "Why do leaves change colour in autumn?",
    "Compare travelling by train and by plane for a 500 km trip.",
    "Write a to-do list for preparing a dinner party for six people.",
)


def chat_workload(n: int) -> list[str]:
    """``n`` chat prompts, ``CHAT_PROMPTS`` in order (cycled past 24)."""
    return [CHAT_PROMPTS[i % len(CHAT_PROMPTS)] for i in range(n)]


def batch_of(items: Sequence[Any], batch: int) -> list[Any]:
    """The first ``batch`` items, cycling when there are fewer (``--prompts`` below the batch size)."""
    return [items[i % len(items)] for i in range(batch)]


#: short chat requests of a few words, for serving benchmarks that time the server, not long answers
SHORT_PROMPTS = (
    "Name three colours.",
    "What is a river?",
    "Write one sentence about tea.",
    "Count from one to five.",
    "Why is the sky blue?",
    "Give me a word that rhymes with cat.",
    "Describe a cat in two sentences.",
    "What do bees make?",
    "Write a haiku about snow.",
    "List four fruits.",
    "What is the capital of Italy?",
    "Explain what a map is.",
    "Tell me about the sea.",
    "Name a famous painter.",
    "What is bread made of?",
    "Why do birds sing?",
)


#: standard-library modules whose docstrings are held-out text for perplexity: none feeds a workload
HELD_OUT_MODULES = (
    "asyncio",
    "decimal",
    "enum",
    "hashlib",
    "hmac",
    "ipaddress",
    "locale",
    "mailbox",
    "pdb",
    "pickletools",
    "plistlib",
    "secrets",
    "selectors",
    "smtplib",
    "socket",
    "threading",
    "wave",
    "weakref",
    "calendar",
    "gettext",
    "numbers",
    "abc",
    "base64",
    "doctest",
)


def held_out_texts() -> list[str]:
    """The module docstrings (``inspect.getdoc``, the text ``pydoc`` shows) of ``HELD_OUT_MODULES`` that have
    200+ characters; refused if a module also feeds a workload (the text would not be held out)."""
    used = {name.split(".")[0] for name in DOC_SOURCES} | set(QA_MODULES)
    clash = used & set(HELD_OUT_MODULES)
    if clash:
        raise RuntimeError(f"held-out modules also feed a workload: {sorted(clash)}")
    texts = []
    for name in HELD_OUT_MODULES:
        doc = inspect.getdoc(__import__(name)) or ""
        if len(doc) > 200:
            texts.append(doc)
    return texts


def held_out_documents(tokenizer: Any, max_tokens: int = 256) -> list[list[int]]:
    """The held-out texts as token ids (no chat template), ``max_tokens`` at most each: what the quantization
    and edge benchmarks score perplexity on."""
    return [tokenizer(text)["input_ids"][:max_tokens] for text in held_out_texts()]

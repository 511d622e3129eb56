"""The prompts, the local references and the checks of the real-server tests (``test_serving.py``,
``test_serving_deployments.py``): every served answer is compared token for token with the local runtime on the
same export.
"""

from __future__ import annotations

import functools
from pathlib import Path

from specdec.runtime.config import EngineConfig
from specdec.runtime.engine import Engine
from specdec.serving.client import Answer, ClientError
from specdec.serving.repository import ServingOptions, write_repository

TOPICS = [
    "the moon",
    "bread",
    "rivers",
    "chess",
    "volcanoes",
    "bees",
    "libraries",
    "glass",
    "trains",
    "tea",
    "owls",
    "maps",
    "clocks",
    "salt",
    "bridges",
    "snow",
]
# 16 prompts of different lengths and shapes (chat and plain), so the ragged steps really are ragged
PROMPTS = [
    (
        f"Write two sentences about {topic}."
        if i % 2 == 0
        else f"Repeat this list exactly: {topic}, {topic} and more {topic}. " * (1 + i % 3) + "Now continue it.",
        i % 2 == 0,
    )
    for i, topic in enumerate(TOPICS)
]
CONCURRENT_MAX_TOKENS = [16, 40, 24, 32, 20, 36, 28, 12]  # the 8-concurrent test: different lengths
LOAD_MAX_TOKENS = 24
#: how long a test waits for what must happen (a request admitted, cancelled, a server gone): a passing run never
#: waits it out, a loaded CI machine may need many times the usual seconds, and what never happens still fails
WAIT_S = 120.0
#: --exit-timeout-secs of the servers started here: the engine's finalize may take tens of seconds on a busy machine
EXIT_S = 120


@functools.cache
def local_reference(export: Path) -> dict[tuple[int, int], list[int]]:
    """(prompt index, max_tokens) -> greedy output ids of the local runtime on the same export (and ("text", ...)
    -> its text); made once per export and session, for every module that serves it."""
    engine = Engine.from_export(export, config=EngineConfig(threads=1))
    keys = [(i, m) for i, m in enumerate(CONCURRENT_MAX_TOKENS)] + [(i, LOAD_MAX_TOKENS) for i in range(len(PROMPTS))]
    keys = list(dict.fromkeys(keys))
    requests = [engine.request(PROMPTS[i][0], chat=PROMPTS[i][1], max_tokens=m) for i, m in keys]
    result = engine.generate(requests, "ems")
    assert not any(o.error for o in result.outputs)
    return {key: out.token_ids for key, out in zip(keys, result.outputs)} | {
        ("text", *key): out.text for key, out in zip(keys, result.outputs)
    }


def request_params(i: int, max_tokens: int, **extra: object) -> dict:
    """The client's parameters for prompt ``i`` (its chat template where the prompt is a chat)."""
    return {"max_tokens": max_tokens, "apply_chat_template": PROMPTS[i][1] or None, **extra}


def check_answer(answer: Answer | ClientError, reference: dict, i: int, max_tokens: int) -> None:
    assert isinstance(answer, Answer), f"prompt {i}: {answer}"
    assert answer.output_ids == reference[(i, max_tokens)], f"prompt {i}: token ids differ from the local runtime"
    assert answer.text == reference[("text", i, max_tokens)]


def shadow_export(export: Path, root: Path, options: ServingOptions | None = None) -> Path:
    """A copy of the export made of symlinks (the graphs are large), with its own model repository."""

    shadow = root / "export"
    for path in export.rglob("*"):
        if path.is_file() and "triton_repo" not in path.parts:
            target = shadow / path.relative_to(export)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.symlink_to(path)
    write_repository(shadow, options=options)
    return shadow

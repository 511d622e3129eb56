"""The prompts a command runs on: ``--prompt`` flags, a ``--prompts-file``, or the demo prompts."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

#: the demo mix: short chat answers, and requests that quote or rework their prompt (where prompt lookup
#: pays), as a deployment sees them side by side
DEFAULT_PROMPTS = (
    "What is the capital of France? Answer in one sentence.",
    "List the first five prime numbers.",
    "Give me two tips for staying focused while studying.",
    "Repeat this sentence exactly: The quick brown fox jumps over the lazy dog near the river bank.",
    "Summarise in one sentence: Speculative decoding lets a small draft model propose tokens that a "
    "large target model verifies in one pass, so several tokens can be accepted per step.",
    "Rewrite this as a numbered list: buy milk, call the bank about the card, book the dentist, water the "
    "plants, send the report to Anna.",
)


def read_prompts(args: argparse.Namespace) -> list[str]:
    """Prompts from ``--prompt`` and ``--prompts-file`` (a JSON list of strings or one prompt per line).

    Shared by ``specdec generate`` and ``specdec client``; a bad file ends the command with a
    message naming it (``SystemExit``), as argparse does for a bad flag.
    """
    prompts = list(args.prompt or [])
    if args.prompts_file:
        path = Path(args.prompts_file)
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise SystemExit(f"error: cannot read --prompts-file {path}: {exc.strerror}") from exc
        stripped = text.lstrip()
        if stripped.startswith("["):
            try:
                data = json.loads(text)
            except json.JSONDecodeError as exc:
                raise SystemExit(f"error: --prompts-file {path} is not valid JSON: {exc}") from exc
            if not isinstance(data, list) or not all(isinstance(p, str) for p in data):
                raise SystemExit(f"error: --prompts-file {path} must be a JSON list of strings")
            prompts.extend(data)
        else:
            prompts.extend(line for line in text.splitlines() if line.strip())
    return prompts or list(DEFAULT_PROMPTS)

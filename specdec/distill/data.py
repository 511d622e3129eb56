"""The recipe's records, split: training, validation (which checkpoint to keep) and held-out (reported).

Why: the continuations are split *by prompt*, so no held-out prompt is ever trained on. The
held-out prompts are also continued greedily (``OUT/.work/heldout-greedy``); with
``--greedy-data`` every prompt is, and those continuations are trained on too, each in its
prompt's split. Self-written prompts are split apart from the others, so adding them never
moves a prompt between splits and a finished run given more data can continue from its checkpoint.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from specdec.distill.prompts import load_prompts, self_prompts
from specdec.distill.records import Record, collect_data
from specdec.distill.settings import DistillSettings
from specdec.models.loading import LoadedModel


def split_records(
    records: Sequence[Record], settings: DistillSettings
) -> tuple[list[Record], list[Record], list[Record]]:
    """Held-out (reported metrics), validation (checkpoint choice) and training records: disjoint, seeded.

    Records are split by prompt, so a prompt sampled more than once (``--samples`` past the
    prompt list) never has one continuation in training and another in the held-out set.
    """
    by_prompt: dict[tuple[int, ...], list[Record]] = {}
    for r in records:
        by_prompt.setdefault(r.prompt_ids, []).append(r)
    keys = list(by_prompt)
    random.Random(settings.seed).shuffle(keys)
    n_held = max(1, int(len(records) * settings.heldout))
    n_valid = max(1, int(len(records) * settings.valid))
    parts: tuple[list[Record], list[Record], list[Record]] = ([], [], [])
    for key in keys:
        part = 0 if len(parts[0]) < n_held else 1 if len(parts[1]) < n_valid else 2
        parts[part].extend(by_prompt[key])
    if not all(parts):
        raise ValueError(
            f"{len(records)} sequences ({len(keys)} prompts) are too few to hold out {n_held} and validate on {n_valid}"
        )
    return parts


@dataclass
class DistillData:
    """The recipe's records, split: what trains, what picks the best checkpoint, what is reported."""

    train: list[Record]  # sampled, then greedy continuations
    valid: list[Record]
    held: dict[str, list[Record]]  # the reported held-out sets, by manifest name
    greedy_train: int  # greedy continuations at the end of ``train``
    self_prompts: int  # self-written prompts among the data's prompts

    @property
    def records(self) -> list[Record]:
        return [*self.train, *self.valid, *(r for part in self.held.values() for r in part)]

    @property
    def key(self) -> list[int]:
        """Training, validation, sampled and greedy held-out sizes: a checkpoint trained on other data sees it."""
        sampled = len(self.held["heldout"]) + len(self.held.get("self_prompts", []))
        greedy = len(self.held["heldout_greedy"]) + len(self.held.get("self_prompts_greedy", []))
        return [len(self.train), len(self.valid), sampled, greedy]


def distill_data(settings: DistillSettings, target: LoadedModel, work: Path) -> DistillData:
    """Generate (or read back from ``work``) every continuation the recipe uses, and split it.

    Why one function: the held-out sets must be exactly the ones a draft's manifest reports,
    also for whoever scores another draft on them (``benchmarks/results/feature_draft.md``).
    """
    text = Path(settings.text_file).read_text(encoding="utf-8") if settings.text_file else None
    base_prompts = load_prompts(settings)
    written = self_prompts(target, work, settings.self_prompts, seed=settings.seed) if settings.self_prompts else []
    prompts = base_prompts + written
    records = collect_data(
        target,
        work,
        prompts,
        shard_size=settings.shard_size,
        max_new_tokens=settings.max_new_tokens,
        temperature=settings.temperature,
        teacher_k=settings.teacher_k,
        seed=settings.seed,
        text=text,
    )
    # each source is split on its own, so adding self-written prompts never moves a built-in
    # (or --prompts) prompt from one split to another: a continued run stays uncontaminated
    own = records[len(base_prompts) : len(prompts)]
    splits = [
        split_records([r for r in part if r.positions], settings)
        for part in (records[: len(base_prompts)] + records[len(prompts) :], own)
        if part
    ]
    heldout, valid, train = ([r for split in splits for r in split[i]] for i in range(3))
    greedy_held, greedy_valid, greedy_train = greedy_parts(target, work, prompts, (heldout, valid), settings)
    valid, train = valid + greedy_valid, train + greedy_train
    self_keys = {r.prompt_ids for r in own}
    held = {
        "heldout": [r for r in heldout if r.prompt_ids not in self_keys],
        "heldout_greedy": [r for r in greedy_held if r.prompt_ids not in self_keys],
    }
    if self_keys:
        held["self_prompts"] = [r for r in heldout if r.prompt_ids in self_keys]
        held["self_prompts_greedy"] = [r for r in greedy_held if r.prompt_ids in self_keys]
    return DistillData(train, valid, held, len(greedy_train), len(written))


def greedy_parts(
    target: LoadedModel,
    work: Path,
    prompts: Sequence[str],
    split: tuple[Sequence[Record], Sequence[Record]],
    settings: DistillSettings,
) -> tuple[list[Record], list[Record], list[Record]]:
    """Greedy continuations, as (held-out, validation, training) records that follow their prompt's split.

    Why: greedy speculative decoding meets the target's *greedy* contexts, which differ from
    samples at temperature 1 (a small target's greedy text repeats itself, and copying is
    something a draft can learn). The held-out prompts' greedy continuations are always
    generated and evaluated (the second set of metrics in the manifest); ``--greedy-data``
    also generates one per training and validation prompt and trains on them. Each follows its
    prompt into the split of that prompt's sampled continuations, so no held-out prompt is
    ever trained on.
    """
    from specdec.runtime.text import encode_text

    part_of = {r.prompt_ids: i for i, part in enumerate(split) for r in part}
    unique = list(dict.fromkeys(prompts))
    keys = [tuple(encode_text(target.tokenizer, p, chat=True)) for p in unique]
    wanted = unique if settings.greedy_data else [p for p, k in zip(unique, keys) if part_of.get(k) == 0]
    greedy = collect_data(
        target,
        work,
        wanted,
        shard_size=settings.shard_size,
        max_new_tokens=settings.max_new_tokens,
        temperature=0.0,
        teacher_k=settings.teacher_k,
        seed=settings.seed,
        subdir="data-greedy" if settings.greedy_data else "heldout-greedy",
    )
    parts: tuple[list[Record], list[Record], list[Record]] = ([], [], [])
    for r in greedy:
        if r.positions:
            parts[part_of.get(r.prompt_ids, 2)].append(r)
    return parts

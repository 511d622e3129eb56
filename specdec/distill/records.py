"""Teacher data: target continuations with the target's top-``k`` log-probabilities, in resumable shards.

Why: the teacher should cost nothing extra. Continuations are sampled at temperature 1 by our
own runtime (``ar`` batches over the ragged step), and every generated position records the
target's top-``k`` log-probabilities *from the same forward pass that sampled the token*.
``--text FILE`` adds plain documents (one teacher prefill per chunk). Everything is written in
shards under ``OUT/.work/data``; a rerun skips finished shards, and a cache generated with
other settings is refused.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from specdec.models.errors import DraftLoadError
from specdec.models.loading import LoadedModel
from specdec.runtime.config import DrafterKind, EngineConfig


@dataclass
class Record:
    """One training sequence: the tokens, and the teacher's top-k at every position that has one."""

    tokens: list[int]
    positions: list[int]  # index i: teacher row predicts tokens[i] (logits after tokens[:i])
    top_ids: torch.Tensor  # [len(positions), k] int32
    top_logp: torch.Tensor  # [len(positions), k] float16

    @property
    def prompt_ids(self) -> tuple[int, ...]:
        """The prompt's tokens (everything before the first teacher row): what splits group by."""
        return tuple(self.tokens[: self.positions[0]])


def _topk(logits: Any, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The teacher's top-``k`` ids and log-probabilities of logits rows (the runtime's numpy rows, or a tensor)."""
    logp = torch.log_softmax(torch.as_tensor(logits).float(), dim=-1)
    values, ids = torch.topk(logp, k, dim=-1)
    return ids.to(torch.int32), values.to(torch.float16)


def generate_records(
    target: LoadedModel,
    prompts: Sequence[str | Sequence[int]],
    *,
    max_new_tokens: int,
    temperature: float,
    teacher_k: int,
    seed: int,
    max_batch: int = 16,
) -> list[Record]:
    """Sample continuations with the ``ar`` loop, recording the teacher top-k of each sampled token."""
    from specdec.runtime.context import LoopHooks
    from specdec.runtime.engine import Engine
    from specdec.runtime.loops import ar
    from specdec.runtime.scheduler import Scheduler

    engine = Engine.from_models(
        target, config=EngineConfig(max_batch=max_batch, max_len=1024, drafter=DrafterKind.NONE)
    )
    scheduler = Scheduler(engine.max_batch)
    requests = [
        engine.request(
            p, chat=True, max_tokens=max_new_tokens, temperature=temperature, seed=seed + i, request_id=f"d{i}"
        )
        for i, p in enumerate(prompts)
    ]
    teacher: dict[str, list[tuple[int, torch.Tensor, torch.Tensor]]] = {r.request_id: [] for r in requests}
    finished: dict[str, list[int]] = {}

    def on_logits(seq: Any, logits: Any) -> None:
        ids, logp = _topk(logits, teacher_k)
        teacher[seq.request.request_id].append((len(seq.tokens), ids, logp))

    for request in requests:
        scheduler.submit(request)
    ctx = engine.context(
        scheduler,
        LoopHooks(
            on_logits=on_logits,
            on_finish=lambda seq: finished.__setitem__(seq.request.request_id, list(seq.tokens)),
        ),
    )
    ar(ctx)
    records = []
    for request in requests:
        rows = teacher[request.request_id]
        tokens = finished[request.request_id]
        rows = [r for r in rows if r[0] < len(tokens)]
        records.append(
            Record(tokens, [r[0] for r in rows], torch.stack([r[1] for r in rows]), torch.stack([r[2] for r in rows]))
        )
    return records


def text_records(target: LoadedModel, text: str, *, chunk: int, teacher_k: int) -> list[Record]:
    """Documents cut into ``chunk``-token pieces, with the teacher at every position after the first."""
    from specdec.runtime.backends.torch_backend import TorchBackend
    from specdec.runtime.packed import SeqWork, pack

    if target.tokenizer is None:
        raise ValueError(f"{target.name} has no tokenizer: teacher records from text need one")
    ids = list(target.tokenizer(text)["input_ids"])
    pieces = [ids[i : i + chunk] for i in range(0, len(ids) - 1, chunk) if len(ids[i : i + chunk]) > 8]
    backend = TorchBackend(target)
    cache = backend.allocate_cache(1, chunk + 1)
    records = []
    for piece in tqdm(pieces, desc="teacher on text", unit="chunk", leave=False):
        with torch.no_grad():
            logits = backend.step(pack([SeqWork(0, 0, piece, logits="all")]), cache)
        top_ids, top_logp = _topk(logits[:-1], teacher_k)
        records.append(Record(piece, list(range(1, len(piece))), top_ids, top_logp))
    return records


def collect_data(
    target: LoadedModel,
    work: Path,
    prompts: Sequence[str],
    *,
    shard_size: int,
    max_new_tokens: int,
    temperature: float,
    teacher_k: int,
    seed: int,
    text: str | None = None,
    text_chunk: int = 256,
    group: int = 8,
    max_batch: int = 64,
    subdir: str = "data",
) -> list[Record]:
    """All records, generating only the shards that are not on disk yet (so a rerun resumes).

    Up to ``group`` consecutive missing shards are generated in one continuously batched run of
    at most ``max_batch`` live sequences. Why: a lone shard's batch drains as its continuations
    end, and grouped shards keep it full (``benchmarks/results/runtime_choices.md``).
    Every continuation keeps its own seed (``seed`` + its prompt's index), so grouping changes
    no sample's law, and each shard is still written whole, so an interrupted run loses at most
    one group. A shard holding fewer continuations than its prompts (the last shard of a
    smaller earlier ``--samples``) is generated again. ``subdir`` keeps differently generated
    data apart (the greedy continuations live beside the sampled ones), and its
    ``settings.json`` makes a rerun with other generation settings fail instead of silently
    training on stale shards.
    """
    from specdec.runtime.text import encode_text

    data = work / subdir
    data.mkdir(parents=True, exist_ok=True)
    _check_data_settings(
        data,
        {
            "target": target.checksum(),
            "shard_size": shard_size,
            "max_new_tokens": max_new_tokens,
            "temperature": temperature,
            "teacher_k": teacher_k,
            "seed": seed,
        },
    )
    starts = list(range(0, len(prompts), shard_size))
    paths = [data / f"shard-{n:05d}.pt" for n in range(len(starts))]

    def stored(n: int) -> list[Record] | None:
        """Shard ``n`` from disk if it is there with all its continuations (and no more) of its prompts."""
        if not paths[n].is_file():
            return None
        shard = [Record(**r) for r in torch.load(paths[n], weights_only=True)]
        want = prompts[starts[n] : starts[n] + shard_size]
        if len(shard) < len(want):
            return None
        shard = shard[: len(want)]  # a longer shard: a larger earlier --samples
        for record, prompt in zip(shard, want):
            ids = encode_text(target.tokenizer, prompt, chat=True)
            if record.tokens[: len(ids)] != ids:
                return None  # continues other prompts (another --prompts file): generate it again
        return shard

    records: list[Record] = []
    bar = tqdm(total=len(starts), desc="target continuations", unit="shard")
    n = 0
    while n < len(starts):
        shard = stored(n)
        if shard is not None:
            records += shard
            bar.update()
            n += 1
            continue
        todo = [n]
        while len(todo) < group and todo[-1] + 1 < len(starts) and not paths[todo[-1] + 1].is_file():
            todo.append(todo[-1] + 1)
        batch_prompts = prompts[starts[todo[0]] : starts[todo[-1]] + shard_size]
        part = generate_records(
            target,
            batch_prompts,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            teacher_k=teacher_k,
            seed=seed + starts[todo[0]],
            max_batch=min(max_batch, len(batch_prompts)),
        )
        for i, m in enumerate(todo):
            shard = part[i * shard_size : (i + 1) * shard_size]
            tmp = paths[m].with_suffix(".tmp")
            torch.save([asdict(r) for r in shard], tmp)
            tmp.replace(paths[m])  # a shard exists complete or not at all
            records += shard
            bar.update()
        n = todo[-1] + 1
    bar.close()
    if text:
        path = data / "text.pt"
        if not path.is_file():
            torch.save([asdict(r) for r in text_records(target, text, chunk=text_chunk, teacher_k=teacher_k)], path)
        records += [Record(**r) for r in torch.load(path, weights_only=True)]
    return records


def _check_data_settings(data: Path, settings: dict[str, Any]) -> None:
    """Refuse cached shards generated with other settings; record the settings of a new cache.

    A cache written before the record existed is adopted as is (it can only have come from
    the defaults of its day, which a rerun names explicitly if they differ).
    """
    path = data / "settings.json"
    if path.is_file():
        saved = json.loads(path.read_text(encoding="utf-8"))
        differ = {k: (saved.get(k), v) for k, v in settings.items() if k in saved and saved[k] != v}
        if differ:
            raise DraftLoadError(
                f"{data} holds data generated with other settings "
                f"({', '.join(f'{k}: {a!r} there, {b!r} now' for k, (a, b) in differ.items())}); "
                f"use another --out or remove {data}"
            )
    path.write_text(json.dumps(settings, indent=1) + "\n", encoding="utf-8")

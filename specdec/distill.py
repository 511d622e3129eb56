"""``specdec distill``: make a cheap draft model that agrees with a target, on a CPU, resumably.

Why: speculation with a draft model pays only when the draft is cheap and agrees with the
target, and a small model sharing the target's tokenizer rarely exists (none does on PyPI for
SmolLM2). The recipe:

1. **Data** — target continuations of a prompt set, sampled at temperature 1 by our own
   runtime (``ar`` batches over the ragged step). Every generated position records the
   target's top-``k`` log-probabilities *from the same forward pass that sampled the token*,
   so the teacher costs nothing extra. ``--text FILE`` adds plain documents (one teacher
   prefill per chunk). Written in shards under ``OUT/.work/data``; a rerun skips finished shards.
   The held-out prompts are also continued greedily (``OUT/.work/heldout-greedy``); with
   ``--greedy-data`` every prompt is, and those continuations are trained on too.
   ``--self-prompts N`` adds N requests that a chat target writes itself (continued from where
   its chat template puts a user's message), split apart from the other prompts and
   evaluated apart; a finished run given more data continues from its checkpoint.
2. **Draft** — ``--layers`` LLaMA layers of the target's width initialised from target layers
   (first and last, evenly spaced in between), the target's final norm, the target's
   embeddings reused (not trained, not stored), and an LM head restricted to the ``--head-size``
   tokens most frequent in the data (tokens outside it get q = 0; verification stays lossless).
   ``--share-head`` makes the head the target's own rows (frozen, not stored); ``--init-from``
   grows a finished draft by new layers that start as exact no-ops (see :func:`init_draft`).
3. **Training** — cross-entropy to the teacher restricted to the head, i.e. KL(target ‖ draft)
   on the head up to a constant, on every generated position; AdamW; bounded by ``--minutes``
   or ``--steps``; checkpoints so an interrupted run resumes where it stopped.
4. **Evaluation** on held-out continuations with the full target distribution: greedy agreement
   (argmax q = argmax p) and expected acceptance Σ min(p, q) at temperature 1, on the sampled
   continuations and, separately, on the greedy ones (the contexts greedy speculation meets).
5. **Output** — ``OUT/model.safetensors`` (the draft's own weights, fp16), ``config.json``,
   ``head_token_ids.json`` and ``specdec_draft.json`` (command, data size, seed, metrics and
   the target's checksum: loading the draft for another target fails clearly).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from specdec.models.drafts import DRAFT_MANIFEST, FORMAT, DraftLoadError, load_draft, save_draft
from specdec.models.loading import DEFAULT_TARGET, LoadedModel, ModelResolutionError, load_model

# --------------------------------------------------------------------------- prompts


_TOPICS = ["the water cycle", "black holes", "photosynthesis", "the French revolution", "prime numbers",
           "a binary search", "recursion in Python", "sourdough bread", "the immune system", "volcanoes",
           "machine learning", "the stock market", "climate change", "the Roman empire", "electric cars",
           "honey bees", "the internet", "chess openings", "jazz music", "the moon landing", "vaccines",
           "coffee", "earthquakes", "the human heart", "solar panels", "the Pythagorean theorem", "rainbows",
           "sleep", "octopuses", "the printing press", "a hash table", "inflation", "glaciers", "bicycles",
           "Shakespeare", "the periodic table", "antibiotics", "tides", "the speed of light", "democracy"]
_TEMPLATES = ["Explain {t} to a ten-year-old.", "Write a short paragraph about {t}.",
              "What are three interesting facts about {t}?", "Summarise what {t} is in two sentences.",
              "Write a haiku about {t}.", "List the pros and cons of {t}.", "Give me a quiz question about {t}.",
              "How would you describe {t} to someone who has never heard of it?",
              "Write a short story that involves {t}.", "What is a common misconception about {t}?"]


_MORE_TOPICS = ["the Great Wall of China", "penguins", "quantum computers", "the Olympic games", "tea ceremonies",
                "a linked list", "SQL joins", "the rain forest", "dinosaurs", "the violin", "gardening", "mars rovers",
                "wind turbines", "the Renaissance", "dolphins", "cryptography", "the human brain", "origami",
                "marathon running", "the Silk Road", "yeast", "lightning", "public libraries", "the stock exchange",
                "nuclear fusion", "sorting algorithms", "the Amazon river", "time zones", "bees and flowers",
                "the piano", "deserts", "a compiler", "the Eiffel tower", "cats", "meditation", "hurricanes",
                "recycling", "the ancient Egyptians", "DNA", "satellites", "chocolate", "the Industrial Revolution",
                "friendship", "unit testing", "the metric system", "coral reefs", "opera", "electricity", "maps",
                "the Fibonacci sequence", "volunteering", "trains", "the ozone layer", "pizza", "git branches",
                "the Milky Way", "mushrooms", "budgeting", "the Olympics of ancient Greece", "telescopes"]
_MORE_TEMPLATES = ["Write an email to a friend about {t}.", "Give step-by-step instructions related to {t}.",
                   "Compare {t} with something similar.", "Why is {t} important?",
                   "Write a limerick about {t}.", "Describe the history of {t} briefly.",
                   "What questions do people often ask about {t}? Answer one.", "Write a tweet about {t}.",
                   "Explain {t} in simple terms, then give an example.",
                   "Write a dialogue between two people about {t}."]


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
        text = tokenizer.apply_chat_template([{"role": "user", "content": marker}], add_generation_prompt=False,
                                             tokenize=False)
    except (ValueError, AttributeError) as exc:
        raise ValueError(f"--self-prompts needs a target with a chat template: {exc}") from exc
    if marker not in text:
        raise ValueError("the target's chat template does not place the user's message verbatim: "
                         "--self-prompts cannot find where a user turn starts")
    return list(tokenizer(text[: text.index(marker)], add_special_tokens=False)["input_ids"])


def self_prompts(target: LoadedModel, work: Path, n: int, *, seed: int, max_tokens: int = 96,
                 block: int = 128, min_words: int = 3) -> list[str]:
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
    settings = {"target": target.checksum(), "seed": seed, "max_tokens": max_tokens, "block": block,
                "min_words": min_words}
    state: dict[str, Any] = {"settings": settings, "candidates": 0, "prompts": []}
    if path.is_file():
        state = json.loads(path.read_text(encoding="utf-8"))
        if state.get("settings") != settings:
            raise DraftLoadError(f"{path} was written with other settings ({state.get('settings')} vs {settings}): "
                                 "remove it or use the settings it was made with")
    prefix = pre_query_ids(target.tokenizer)
    eos = set(target.eos_token_ids)
    seen = set(state["prompts"])
    bar = tqdm(total=n, initial=min(n, len(state["prompts"])), desc="self-written prompts", unit="prompt")
    while len(state["prompts"]) < n:
        if state["candidates"] > 50 * max(n, block):
            raise ValueError(f"the target wrote only {len(state['prompts'])} usable requests in "
                             f"{state['candidates']} tries: is it an instruction-tuned model?")
        drawn = generate_records(target, [prefix] * block, max_new_tokens=max_tokens, temperature=1.0,
                                 teacher_k=1, seed=seed + 10**6 + state["candidates"], max_batch=64)
        for record in drawn:
            turn = record.tokens[len(prefix):]
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


# --------------------------------------------------------------------------- data


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


def _topk(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    logp = torch.log_softmax(logits.float(), dim=-1)
    values, ids = torch.topk(logp, k, dim=-1)
    return ids.to(torch.int32), values.to(torch.float16)


def generate_records(target: LoadedModel, prompts: Sequence[str], *, max_new_tokens: int, temperature: float,
                     teacher_k: int, seed: int, max_batch: int = 16) -> list[Record]:
    """Sample continuations with the ``ar`` loop, recording the teacher top-k of each sampled token."""
    from specdec.runtime.engine import Engine
    from specdec.runtime.loops import ar
    from specdec.runtime.scheduler import Scheduler

    engine = Engine.from_models(target, None, max_batch=max_batch, max_len=1024)
    scheduler = Scheduler(engine.max_batch)
    requests = [engine.request(p, chat=True, max_tokens=max_new_tokens, temperature=temperature,
                               seed=seed + i, request_id=f"d{i}") for i, p in enumerate(prompts)]
    teacher: dict[str, list[tuple[int, torch.Tensor, torch.Tensor]]] = {r.request_id: [] for r in requests}
    finished: dict[str, list[int]] = {}

    def on_logits(seq: Any, logits: torch.Tensor) -> None:
        ids, logp = _topk(logits, teacher_k)
        teacher[seq.request.request_id].append((len(seq.tokens), ids, logp))

    for request in requests:
        scheduler.submit(request)
    ctx = engine.context(scheduler, on_logits=on_logits,
                         on_finish=lambda seq: finished.__setitem__(seq.request.request_id, list(seq.tokens)))
    ar(ctx)
    records = []
    for request in requests:
        rows = teacher[request.request_id]
        tokens = finished[request.request_id]
        rows = [r for r in rows if r[0] < len(tokens)]
        records.append(Record(tokens, [r[0] for r in rows], torch.stack([r[1] for r in rows]),
                              torch.stack([r[2] for r in rows])))
    return records


def text_records(target: LoadedModel, text: str, *, chunk: int, teacher_k: int) -> list[Record]:
    """Documents cut into ``chunk``-token pieces, with the teacher at every position after the first."""
    from specdec.runtime.backends.torch_backend import TorchBackend
    from specdec.runtime.packed import SeqWork, pack

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


def collect_data(target: LoadedModel, work: Path, prompts: Sequence[str], *, shard_size: int,
                 max_new_tokens: int, temperature: float, teacher_k: int, seed: int,
                 text: str | None = None, text_chunk: int = 256, group: int = 8,
                 max_batch: int = 64, subdir: str = "data") -> list[Record]:
    """All records, generating only the shards that are not on disk yet (so a rerun resumes).

    Up to ``group`` consecutive missing shards are generated in one continuously batched run of
    at most ``max_batch`` live sequences. Why: a lone shard's batch drains as its continuations
    end (measured on SmolLM2-135M: 85 continuations per CPU minute grouped, 60 one shard at a time).
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
    _check_data_settings(data, {"target": target.checksum(), "shard_size": shard_size,
                                "max_new_tokens": max_new_tokens, "temperature": temperature,
                                "teacher_k": teacher_k, "seed": seed})
    starts = list(range(0, len(prompts), shard_size))
    paths = [data / f"shard-{n:05d}.pt" for n in range(len(starts))]

    def stored(n: int) -> list[Record] | None:
        """Shard ``n`` from disk if it is there with all its continuations (and no more) of its prompts."""
        if not paths[n].is_file():
            return None
        shard = [Record(**r) for r in torch.load(paths[n], weights_only=False)]
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
        part = generate_records(target, batch_prompts, max_new_tokens=max_new_tokens, temperature=temperature,
                                teacher_k=teacher_k, seed=seed + starts[todo[0]],
                                max_batch=min(max_batch, len(batch_prompts)))
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
        records += [Record(**r) for r in torch.load(path, weights_only=False)]
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
            raise DraftLoadError(f"{data} holds data generated with other settings "
                                 f"({', '.join(f'{k}: {a!r} there, {b!r} now' for k, (a, b) in differ.items())}); "
                                 f"use another --out or remove {data}")
    path.write_text(json.dumps(settings, indent=1) + "\n", encoding="utf-8")


def select_head(records: Sequence[Record], size: int, vocab_size: int, always: Sequence[int] = (),
                within: torch.Tensor | None = None) -> torch.Tensor:
    """The ``size`` most frequent tokens of the data (teacher top-1s and sampled tokens), plus ``always``.

    ``within``: choose among these tokens only (a grown draft's smaller head is part of its source's).
    """
    counts = torch.zeros(vocab_size, dtype=torch.float64)
    for r in records:
        counts.index_add_(0, torch.as_tensor(r.tokens, dtype=torch.long),
                          torch.ones(len(r.tokens), dtype=torch.float64))
        counts.index_add_(0, r.top_ids[:, 0].long(), torch.ones(len(r.positions), dtype=torch.float64))
    for t in always:
        counts[t] = math.inf
    if within is not None:
        outside = torch.ones(vocab_size, dtype=torch.bool)
        outside[within] = False
        counts[outside] = -math.inf
        size = min(size, len(within))
    size = min(size, vocab_size)
    return torch.sort(torch.topk(counts, size).indices).values


# --------------------------------------------------------------------------- the draft


def init_draft(target: LoadedModel, layers: int, head_ids: torch.Tensor, *, share_head: bool = False,
               grow: LoadedModel | None = None) -> LoadedModel:
    """``layers`` target layers (first, last and evenly spaced), the target's norm and embeddings, a head of rows.

    ``share_head``: the head *is* the target's LM head restricted to ``head_ids``, frozen, so it
    is not stored: the bytes it would take buy another layer under a size budget.
    ``grow``: start from a finished draft instead (``--init-from``): its layers become the first
    ones and the last, and each new layer sits just before its last, initialised from a target
    layer with its two output projections (``o_proj``, ``down_proj``) at zero. A zero output
    adds nothing to the residual stream, so the grown draft computes exactly what the finished
    one did (with its own head, or the rows of a subset of it) and training starts where that
    one stopped, not from scratch. A smaller head pays for the new layer's bytes and compute.
    """
    from specdec.models.loading import restrict_head

    n = int(target.config.num_hidden_layers)
    if not 1 <= layers <= n:
        raise ValueError(f"--layers must be between 1 and {n} (the target's layers), got {layers}")
    picked = [round(i * (n - 1) / (layers - 1)) for i in range(layers)] if layers > 1 else [0]
    restricted = restrict_head(target, head_ids)  # checks the ids; stores them ascending
    head_ids = restricted.head_token_ids
    old = int(grow.config.num_hidden_layers) if grow is not None else 0
    if grow is not None:
        _check_growable(old, layers)
    # slot -> (source state dict, source layer, new?): the grown draft's layers keep their order
    sources = [(target.state_dict, picked[i], False) for i in range(layers)]
    if grow is not None:
        sources[: old - 1] = [(grow.state_dict, i, False) for i in range(old - 1)]
        sources[old - 1 : layers - 1] = [(target.state_dict, picked[i], True) for i in range(old - 1, layers - 1)]
        sources[layers - 1] = (grow.state_dict, old - 1, False)
    sd: dict[str, torch.Tensor] = {}
    for new, (source, layer, silent) in enumerate(sources):
        prefix = f"model.layers.{layer}."
        for name, tensor in source.items():
            if name.startswith(prefix):
                copy = tensor.detach().clone().float()
                if silent and name.endswith(("o_proj.weight", "down_proj.weight")):
                    copy.zero_()
                sd[f"model.layers.{new}." + name[len(prefix):]] = copy
    sd["model.norm.weight"] = (grow or target).state_dict["model.norm.weight"].detach().clone().float()
    sd["model.embed_tokens.weight"] = target.state_dict["model.embed_tokens.weight"]  # shared, frozen
    if grow is not None and not share_head:  # its trained rows (of a subset of its tokens, for a smaller head)
        head = restrict_head(grow, head_ids).state_dict["lm_head.weight"].float()
    else:
        head = restricted.state_dict["lm_head.weight"].float()
    config = target.config.__class__.from_dict({**target.config.to_dict(), "num_hidden_layers": layers,
                                                "tie_word_embeddings": False})
    extra = {"init_layers": picked if grow is None else
             [f"draft {layer}" if source is grow.state_dict else layer for source, layer, _ in sources],
             "head_token_ids": head_ids, "shared_head": share_head}
    return LoadedModel(f"{target.name}-draft", config, {**sd, "lm_head.weight": head}, target.tokenizer,
                       f"distilled from {target.name}", extra)


def _check_growable(old: int, layers: int) -> None:
    if not 1 <= old <= layers:
        raise ValueError(f"--init-from has {old} layers: it can only grow to as many or more, not {layers}")


class DraftNet(torch.nn.Module):
    """The draft as a trainable module: HF LLaMA layers over frozen target embeddings, a head of K rows."""

    def __init__(self, draft: LoadedModel) -> None:
        super().__init__()
        from transformers import LlamaModel

        config = draft.config.__class__.from_dict({**draft.config.to_dict(), "_attn_implementation": "sdpa"})
        self.model = LlamaModel(config)
        own = {k[len("model."):]: v for k, v in draft.state_dict.items() if k.startswith("model.")}
        missing, unexpected = self.model.load_state_dict(own, strict=False)
        if unexpected or [m for m in missing if "rotary" not in m]:
            raise ValueError(f"draft weights do not fit: missing={missing} unexpected={unexpected}")
        self.model.embed_tokens.weight.requires_grad_(False)
        self.head = torch.nn.Parameter(draft.state_dict["lm_head.weight"].detach().clone().float(),
                                       requires_grad=not draft.extra.get("shared_head", False))
        self.register_buffer("head_ids", draft.head_token_ids.clone())

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        hidden = self.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        return hidden @ self.head.t()

    def export(self, template: LoadedModel) -> LoadedModel:
        """Back to a ``LoadedModel`` (trained weights, embeddings still the target's tensor)."""
        sd = {f"model.{k}": v.detach().clone() for k, v in self.model.state_dict().items() if "rotary" not in k}
        sd["model.embed_tokens.weight"] = template.state_dict["model.embed_tokens.weight"]
        sd["lm_head.weight"] = self.head.detach().clone()
        return LoadedModel(template.name, template.config, sd, template.tokenizer, template.source,
                           dict(template.extra))


def _batch(records: Sequence[Record], head_ids: torch.Tensor, vocab_size: int
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Padded inputs, mask, and the teacher as (row, head column, prob) triples over the head."""
    width = max(len(r.tokens) for r in records)
    input_ids = torch.zeros(len(records), width, dtype=torch.long)
    mask = torch.zeros(len(records), width, dtype=torch.long)
    column = torch.full((vocab_size,), -1, dtype=torch.long)
    column[head_ids] = torch.arange(len(head_ids))
    rows, cols, probs = [], [], []
    for b, r in enumerate(records):
        input_ids[b, : len(r.tokens)] = torch.as_tensor(r.tokens)
        mask[b, : len(r.tokens)] = 1
        pos = torch.as_tensor(r.positions, dtype=torch.long)
        head_col = column[r.top_ids.long()]  # [P, k]
        p = torch.exp(r.top_logp.float()) * (head_col >= 0)
        p = p / p.sum(-1, keepdim=True).clamp_min(1e-12)  # the teacher on the head, renormalised
        flat_row = (b * width + pos - 1).unsqueeze(1).expand_as(head_col)
        keep = head_col >= 0
        rows.append(flat_row[keep])
        cols.append(head_col[keep])
        probs.append(p[keep])
    return input_ids, mask, torch.cat(rows), torch.cat(cols), torch.cat(probs)


def distill_loss(net: DraftNet, records: Sequence[Record], vocab_size: int) -> tuple[torch.Tensor, int]:
    """Cross-entropy of the draft to the head-restricted teacher, averaged over teacher positions."""
    return _head_cross_entropy(net, records, vocab_size)


@torch.no_grad()
def validation_loss(net: DraftNet, records: Sequence[Record], vocab_size: int, batch: int = 8) -> float:
    """The training objective on records never trained on: picks the best checkpoint, not a metric to report."""
    was_training = net.training
    net.eval()
    total = count = 0.0
    for i in range(0, len(records), batch):
        loss, positions = _head_cross_entropy(net, records[i : i + batch], vocab_size)
        total += float(loss) * positions
        count += positions
    net.train(was_training)
    return total / max(count, 1)


def lr_factor(step: int, progress: float, warmup: int) -> float:
    """Linear warm-up, then cosine decay to 10% at the end of the budget (``progress`` in [0, 1]).

    Why: a constant rate leaves the weights noisy at the end of a short CPU budget; decaying by
    the fraction of the budget used (time or steps) keeps the schedule resumable.
    """
    warm = min(1.0, (step + 1) / max(warmup, 1))
    return warm * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(max(progress, 0.0), 1.0))))


def _head_cross_entropy(net: DraftNet, records: Sequence[Record], vocab_size: int) -> tuple[torch.Tensor, int]:
    input_ids, mask, rows, cols, probs = _batch(records, net.head_ids, vocab_size)
    logq = torch.log_softmax(net(input_ids, mask).float(), dim=-1).reshape(-1, len(net.head_ids))
    positions = sum(len(r.positions) for r in records)
    return -(probs * logq[rows, cols]).sum() / positions, positions


@torch.no_grad()
def evaluate(net: DraftNet, target: LoadedModel, records: Sequence[Record]) -> dict[str, float]:
    """Greedy agreement and expected acceptance Σ min(p, q) against the FULL target distribution."""
    from specdec.runtime.backends.torch_backend import TorchBackend
    from specdec.runtime.packed import SeqWork, pack

    backend = TorchBackend(target)
    vocab = target.vocab_size
    agree = accept = kl = 0.0
    count = 0
    for r in records:
        cache = backend.allocate_cache(1, len(r.tokens) + 1)
        p_all = torch.softmax(backend.step(pack([SeqWork(0, 0, r.tokens, logits="all")]), cache).float(), -1)
        q_head = torch.softmax(net(torch.as_tensor([r.tokens]), torch.ones(1, len(r.tokens),
                                                                               dtype=torch.long))[0].float(), -1)
        pos = torch.as_tensor(r.positions, dtype=torch.long) - 1
        p = p_all[pos]
        q = torch.zeros(len(pos), vocab)
        q[:, net.head_ids] = q_head[pos]
        agree += float((q.argmax(-1) == p.argmax(-1)).sum())
        accept += float(torch.minimum(p, q).sum())
        p_head = p[:, net.head_ids]
        p_head = p_head / p_head.sum(-1, keepdim=True)
        kl += float((p_head * (torch.log(p_head.clamp_min(1e-12)) - torch.log(q_head[pos].clamp_min(1e-12)))).sum())
        count += len(pos)
    n = max(count, 1)
    return {"greedy_agreement": agree / n, "expected_acceptance": accept / n, "kl_on_head": kl / n,
            "positions": count}


# --------------------------------------------------------------------------- driver


@dataclass
class DistillSettings:
    target: str = DEFAULT_TARGET
    out: str = "draft"
    layers: int = 2
    head_size: int = 8192
    samples: int = 400
    max_new_tokens: int = 128
    temperature: float = 1.0
    teacher_k: int = 32
    batch: int = 8
    lr: float = 1e-3
    warmup: int = 100
    weight_decay: float = 0.01
    steps: int | None = None
    minutes: float | None = 10.0
    seed: int = 0
    heldout: float = 0.05
    valid: float = 0.05
    validate_s: float = 300.0
    shard_size: int = 32
    prompts_file: str | None = None
    text_file: str | None = None
    greedy_data: bool = False
    self_prompts: int = 0
    share_head: bool = False
    init_from: str | None = None
    checkpoint_s: float = 60.0
    extra: dict[str, Any] = field(default_factory=dict)


def _load_prompts(settings: DistillSettings) -> list[str]:
    if not settings.prompts_file:
        prompts = builtin_prompts()
        # past the built-in list a prompt comes again; its continuation differs (every sample has its own seed)
        return [prompts[i % len(prompts)] for i in range(settings.samples)]
    text = Path(settings.prompts_file).read_text(encoding="utf-8")
    prompts = json.loads(text) if text.lstrip().startswith("[") else [ln for ln in text.splitlines() if ln.strip()]
    return [str(p) for p in prompts][: settings.samples]


def split_records(records: Sequence[Record], settings: DistillSettings
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
        raise ValueError(f"{len(records)} sequences ({len(keys)} prompts) are too few to hold out {n_held} and "
                         f"validate on {n_valid}")
    return parts


def _train(net: DraftNet, optimizer: torch.optim.Optimizer, train: Sequence[Record], valid: Sequence[Record],
           settings: DistillSettings, state: dict[str, Any], best_net: dict[str, torch.Tensor] | None,
           save: Callable[[dict[str, torch.Tensor] | None], None]) -> dict[str, torch.Tensor] | None:
    """The optimisation loop, resuming from ``state``; returns the weights with the best validation loss."""
    vocab_size = int(net.model.config.vocab_size)
    params = [p for p in net.parameters() if p.requires_grad]
    budget_s = settings.minutes * 60 if settings.minutes else math.inf
    max_steps = settings.steps if settings.steps is not None else math.inf
    rng = random.Random(settings.seed + state["step"])
    bar = tqdm(total=None if max_steps == math.inf else int(max_steps), initial=state["step"], desc="distill",
               unit="step")
    last_save = last_valid = time.monotonic()
    start = time.monotonic() - state["elapsed"]

    def keep_if_best() -> None:
        nonlocal best_net
        loss = validation_loss(net, valid, vocab_size)
        if state["best"] is None or loss < state["best"]["valid_loss"]:
            state["best"] = {"valid_loss": loss, "step": state["step"]}
            best_net = {k: v.detach().clone() for k, v in net.state_dict().items()}

    net.train()
    while state["step"] < max_steps and state["elapsed"] < budget_s:
        progress = max(state["elapsed"] / budget_s, state["step"] / max_steps)
        for group in optimizer.param_groups:
            group["lr"] = settings.lr * lr_factor(state["step"], progress, settings.warmup)
        loss, _ = distill_loss(net, rng.sample(train, min(settings.batch, len(train))), vocab_size)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        state["step"] += 1
        state["elapsed"] = time.monotonic() - start
        bar.update()
        bar.set_postfix(loss=f"{loss.item():.3f}", minutes=f"{state['elapsed'] / 60:.1f}")
        if time.monotonic() - last_valid > settings.validate_s:
            keep_if_best()
            last_valid = time.monotonic()
        if time.monotonic() - last_save > settings.checkpoint_s:
            save(best_net)
            last_save = time.monotonic()
    bar.close()
    keep_if_best()
    save(best_net)
    return best_net


def distill(settings: DistillSettings, command: str = "") -> dict[str, Any]:
    """Run (or resume, or continue on more data) the recipe; returns the manifest written to ``OUT/specdec_draft.json``.

    A rerun whose data grew (more ``--samples``, ``--self-prompts``) continues the checkpoint
    it finds: the head chosen by the first run is kept (the weights were trained for it), the
    "before" metrics are measured again on the new held-out sets with the untrained
    initialisation, and the best-checkpoint choice starts over, since validation losses on
    two different validation sets cannot be compared. Every command that trained the draft
    is listed in the manifest, in order, so the draft can be reproduced.
    """
    torch.manual_seed(settings.seed)
    out = Path(settings.out)
    work = out / ".work"
    work.mkdir(parents=True, exist_ok=True)
    target = load_model(settings.target)
    # a checkpoint or --init-from that cannot be used fails now, not after hours of data generation
    ckpt = work / "checkpoint.pt"
    saved, grow = _starting_point(ckpt, settings, target)
    data = distill_data(settings, target, work)
    train, valid, held = data.train, data.valid, data.held
    if saved is not None:
        head_ids = saved["head_ids"]
    else:  # a grown draft's layers were trained for its tokens: keep them, or the most frequent of them
        head_ids = select_head(train, settings.head_size, target.vocab_size, target.eos_token_ids,
                               within=grow.head_token_ids if grow is not None else None)
    draft = init_draft(target, settings.layers, head_ids, share_head=settings.share_head, grow=grow)
    net = DraftNet(draft)
    optimizer = torch.optim.AdamW([p for p in net.parameters() if p.requires_grad], lr=settings.lr,
                                  weight_decay=settings.weight_decay)
    state: dict[str, Any] = {"step": 0, "elapsed": 0.0, "before": None, "best": None, "commands": [],
                             "grown_from": None}
    if grow is not None:  # the lineage: whoever reproduces this draft runs the grown one's commands first
        made = grow.extra["draft_manifest"]
        state["commands"] = list(made.get("commands") or [made.get("command", "")])
        state["grown_from"] = {"layers": made.get("layers"), "steps": made.get("steps"),
                               "train_minutes": made.get("train_minutes_total", made.get("train_minutes"))}
    best_net: dict[str, torch.Tensor] | None = None
    if saved is not None:
        state = {**state, **saved["state"]}
        state.pop("greedy_before", None)  # a checkpoint from before the held-out sets were keyed by name
        if not state["commands"] and (out / DRAFT_MANIFEST).is_file():  # nor did it list commands: the manifest
            state["commands"] = [json.loads((out / DRAFT_MANIFEST).read_text()).get("command", "")]
        if state.get("data_key") != data.key:  # the data grew: see the docstring
            state.update(before=None, best=None)
        else:
            best_net = saved.get("best_net")
    if state["before"] is None:  # still the untrained initialisation here
        state["before"] = {name: evaluate(net, target, part) for name, part in held.items()}
    state["data_key"] = data.key
    if not state["commands"] or state["commands"][-1] != command:
        state["commands"].append(command)
    if saved is not None:
        net.load_state_dict(saved["net"])
        optimizer.load_state_dict(saved["optimizer"])
        print(f"resuming at step {state['step']} ({state['elapsed'] / 60:.1f} min trained)", file=sys.stderr)
    best_net = _train(net, optimizer, train, valid, settings, state, best_net,
                      lambda best: _checkpoint(ckpt, net, optimizer, state, head_ids, settings, best))
    if best_net is not None:
        net.load_state_dict(best_net)  # the step with the lowest validation loss, not merely the last
    net.eval()
    after = {name: evaluate(net, target, part) for name, part in held.items()}
    metrics: dict[str, Any] = {name: {"before": state["before"][name], "after": after[name]}
                               for name in held if name != "heldout"}
    trained = net.export(draft)
    manifest = {
        "specdec_draft": FORMAT,
        "command": command,
        "commands": state["commands"],
        "target": {"name": target.name, "checksum": target.checksum(), "vocab_size": target.vocab_size},
        "layers": settings.layers, "init_layers": draft.extra.get("init_layers"),
        "head_size": len(head_ids), "shared_head": settings.share_head, "grown_from": state["grown_from"],
        "data": {"sequences": len(data.records), "train_sequences": len(train),
                 "heldout_sequences": len(held["heldout"]), "validation_sequences": len(valid),
                 "teacher_positions": sum(len(r.positions) for r in data.records), "teacher_k": settings.teacher_k,
                 "temperature": settings.temperature, "text_file": settings.text_file,
                 "greedy_data": settings.greedy_data, "greedy_train_sequences": data.greedy_train,
                 "heldout_greedy_sequences": len(held["heldout_greedy"]), "self_prompts": data.self_prompts,
                 "self_prompt_heldout_sequences": len(held.get("self_prompts", []))},
        "seed": settings.seed, "steps": state["step"], "train_minutes": round(state["elapsed"] / 60, 2),
        "train_minutes_total": round(state["elapsed"] / 60 + ((state["grown_from"] or {}).get("train_minutes") or 0),
                                     2),
        "batch": settings.batch, "lr": settings.lr, "warmup": settings.warmup,
        "weight_decay": settings.weight_decay, "kept_step": state["best"]["step"],
        "validation_loss": state["best"]["valid_loss"],
        "metrics": {"before": state["before"]["heldout"], "after": after["heldout"], **metrics},
    }
    save_draft(trained, out, manifest)
    return manifest


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
    also for whoever scores another draft on them (``benchmarks/experiments/feature_draft``).
    """
    text = Path(settings.text_file).read_text(encoding="utf-8") if settings.text_file else None
    base_prompts = _load_prompts(settings)
    written = self_prompts(target, work, settings.self_prompts, seed=settings.seed) if settings.self_prompts else []
    prompts = base_prompts + written
    records = collect_data(target, work, prompts, shard_size=settings.shard_size,
                           max_new_tokens=settings.max_new_tokens, temperature=settings.temperature,
                           teacher_k=settings.teacher_k, seed=settings.seed, text=text)
    # each source is split on its own, so adding self-written prompts never moves a built-in
    # (or --prompts) prompt from one split to another: a continued run stays uncontaminated
    own = records[len(base_prompts) : len(prompts)]
    splits = [split_records([r for r in part if r.positions], settings)
              for part in (records[: len(base_prompts)] + records[len(prompts):], own) if part]
    heldout, valid, train = ([r for split in splits for r in split[i]] for i in range(3))
    greedy_held, greedy_valid, greedy_train = _greedy_parts(target, work, prompts, (heldout, valid), settings)
    valid, train = valid + greedy_valid, train + greedy_train
    self_keys = {r.prompt_ids for r in own}
    held = {"heldout": [r for r in heldout if r.prompt_ids not in self_keys],
            "heldout_greedy": [r for r in greedy_held if r.prompt_ids not in self_keys]}
    if self_keys:
        held["self_prompts"] = [r for r in heldout if r.prompt_ids in self_keys]
        held["self_prompts_greedy"] = [r for r in greedy_held if r.prompt_ids in self_keys]
    return DistillData(train, valid, held, len(greedy_train), len(written))


def _starting_point(ckpt: Path, settings: DistillSettings, target: LoadedModel
                    ) -> tuple[dict[str, Any] | None, LoadedModel | None]:
    """Where training starts: (this run's checkpoint, or else the draft to grow from, if any).

    A checkpoint of another architecture is refused, unless ``--init-from`` says to grow a new
    draft: then it is kept aside under its layers and step, and the draft grows from there.
    """
    saved = torch.load(ckpt, weights_only=False) if ckpt.is_file() else None
    arch = {"layers": settings.layers, "greedy_data": settings.greedy_data, "share_head": settings.share_head}
    if saved is not None and {k: saved.get(k, False) for k in arch} != arch:
        if not settings.init_from:
            raise DraftLoadError(f"{ckpt} belongs to a different run (--layers, --greedy-data or --share-head "
                                 f"differ): remove {ckpt}, or grow a new draft from a finished one with --init-from")
        kept = ckpt.with_name(f"checkpoint-{saved['layers']}-layers-step-{saved['state']['step']}.pt")
        ckpt.replace(kept)  # the finished run's state stays on disk; this run starts from --init-from
        print(f"{ckpt} belongs to the draft being grown: kept as {kept.name}", file=sys.stderr)
        saved = None
    grow = load_draft(settings.init_from, target) if settings.init_from and saved is None else None
    if grow is not None:
        _check_growable(int(grow.config.num_hidden_layers), settings.layers)
    return saved, grow


def _greedy_parts(target: LoadedModel, work: Path, prompts: Sequence[str],
                  split: tuple[Sequence[Record], Sequence[Record]], settings: DistillSettings
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
    greedy = collect_data(target, work, wanted, shard_size=settings.shard_size,
                          max_new_tokens=settings.max_new_tokens, temperature=0.0, teacher_k=settings.teacher_k,
                          seed=settings.seed, subdir="data-greedy" if settings.greedy_data else "heldout-greedy")
    parts: tuple[list[Record], list[Record], list[Record]] = ([], [], [])
    for r in greedy:
        if r.positions:
            parts[part_of.get(r.prompt_ids, 2)].append(r)
    return parts


def _checkpoint(path: Path, net: DraftNet, optimizer: torch.optim.Optimizer, state: dict, head_ids: torch.Tensor,
                settings: DistillSettings, best_net: dict[str, torch.Tensor] | None) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save({"net": net.state_dict(), "optimizer": optimizer.state_dict(), "state": state,
                "head_ids": head_ids, "layers": settings.layers, "greedy_data": settings.greedy_data,
                "share_head": settings.share_head,
                "best_net": best_net}, tmp)
    tmp.replace(path)


# --------------------------------------------------------------------------- CLI


def add_distill_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    d = DistillSettings()
    parser.add_argument("--target", default=d.target, help="preset, Hugging Face directory or .gguf file")
    parser.add_argument("--out", required=True, help="output directory (also holds .work/ for resuming)")
    parser.add_argument("--prompts", dest="prompts_file", help="JSON list of strings or one prompt per line")
    parser.add_argument("--text", dest="text_file", help="plain documents to add (teacher on every position)")
    parser.add_argument("--samples", type=int, default=d.samples, help="prompts to continue")
    parser.add_argument("--greedy-data", action="store_true",
                        help="also train on one greedy continuation per distinct prompt")
    parser.add_argument("--self-prompts", type=int, default=d.self_prompts,
                        help="add this many requests written by the (chat) target itself to the prompts")
    parser.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens)
    parser.add_argument("--layers", type=int, default=d.layers)
    parser.add_argument("--head-size", type=int, default=d.head_size, help="tokens in the draft's LM head")
    parser.add_argument("--share-head", action="store_true",
                        help="use the target's own LM head rows as the draft's head: frozen, and not stored")
    parser.add_argument("--init-from", metavar="DRAFT_DIR",
                        help="grow a finished draft (its layers first and last, new layers in between starting as "
                             "no-ops, its head tokens) instead of starting from target layers")
    parser.add_argument("--teacher-k", type=int, default=d.teacher_k, help="teacher log-probs kept per position")
    parser.add_argument("--batch", type=int, default=d.batch, help="sequences per training step")
    parser.add_argument("--lr", type=float, default=d.lr, help="peak learning rate (warm-up, then cosine to 10%%)")
    parser.add_argument("--weight-decay", type=float, default=d.weight_decay)
    parser.add_argument("--minutes", type=float, default=d.minutes, help="training time budget (all runs)")
    parser.add_argument("--steps", type=int, help="training steps (overrides --minutes)")
    parser.add_argument("--seed", type=int, default=d.seed)
    return parser


def distill_main(args: argparse.Namespace) -> int:
    settings = DistillSettings(**{k: v for k, v in vars(args).items() if k in DistillSettings.__dataclass_fields__})
    if settings.steps is not None:
        settings.minutes = None
    try:
        manifest = distill(settings, command=" ".join(["specdec", "distill", *sys.argv[2:]]))
    except (ModelResolutionError, DraftLoadError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    before, after = manifest["metrics"]["before"], manifest["metrics"]["after"]
    print(f"draft written to {settings.out}: {manifest['layers']} layers, head {manifest['head_size']} tokens, "
          f"{manifest['steps']} steps in {manifest['train_minutes']} min on "
          f"{manifest['data']['teacher_positions']} teacher positions")
    greedy = manifest["metrics"]["heldout_greedy"]
    for name in ("greedy_agreement", "expected_acceptance", "kl_on_head"):
        print(f"  held-out {name:20s} {before[name]:.4f} -> {after[name]:.4f}   "
              f"(greedy continuations: {greedy['before'][name]:.4f} -> {greedy['after'][name]:.4f})")
    if "self_prompts" in manifest["metrics"]:
        own, own_greedy = manifest["metrics"]["self_prompts"], manifest["metrics"]["self_prompts_greedy"]
        for name in ("greedy_agreement", "expected_acceptance"):
            print(f"  self-written prompts {name:20s} {own['before'][name]:.4f} -> {own['after'][name]:.4f}   "
                  f"(greedy continuations: {own_greedy['before'][name]:.4f} -> {own_greedy['after'][name]:.4f})")
    return 0

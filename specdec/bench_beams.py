"""DSBD vs beam sampling vs EMS-SD sampling on SmolLM2-135M: speed against output quality.

What: the same requests, decoded together as one batch, by

* ``ems`` — speculative sampling with the distilled draft (one sequence per request: the
  target's own sampling law, the quality floor of any sampler);
* ``beam`` — target-only i.i.d. beam sampling with W = 2, 3, 4 (the law DSBD reproduces slot by slot);
* ``dsbd`` — the draft beam-samples a forest of γ layers of W_S nodes, the target verifies
  every forest of the batch in one call; W_S = 2, 3, 4 with dynamic width (threshold t), with
  fixed width (t = 0: every layer keeps W_S beams, the quality of beam W = W_S), the same with
  the number of draft layers chosen per request from its own layer passes (adaptive γ, at most
  γ), once with the dynamic width held at two beams or more (``W_min = 2``), and once in the
  single-KV memory mode.

Quality: the target's mean log-likelihood per token (temperature 1) of each returned
sequence, rescored from scratch by one prefill (``continuation_logprob``), so every method is
measured the same way. Beam methods return the best length-normalised candidate, which is
what raises this number over plain sampling.

Extractive QA: a small set built from real text (the first lines of standard library module
docstrings): each prompt lists five modules with their descriptions and asks which module one
description belongs to; the answer is a word of the context. Two scores, decoded with the same
method, width and temperature:

* *exact match* — the first line of the output, normalised (case, quotes, backticks, a
  trailing period, "the"/"module"), is the module's name (SQuAD-style, strict);
* *QA accuracy* — the first of the five listed modules the output names is the right one.
  A 135M chat model rarely answers with the bare name ("The module named `heapq` ..."), so
  strict exact match is 0 for every method and does not tell them apart; the first-named
  choice is what the answer says (a uniform guess among the five scores 0.20).

Speed: generated tokens / wall seconds of ``Engine.generate`` for the whole batch (prefill
included), one process, one torch thread, the runs interleaved and rotated over repeats
(median kept), as in ``specdec bench``. This machine is shared: compare ratios from one run.

Run::

    specdec bench beams                                   # or python benchmarks/dsbd_pareto.py
    specdec bench beams --quick --out-dir /tmp/dsbd       # smoke run

Writes ``<out-dir>/dsbd_pareto.{json,md,png}`` (default ``benchmarks/results``).
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib
import re
import shlex
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch
from tqdm.auto import tqdm

from specdec.bench import build_workload, machine_info, write_report
from specdec.models.drafts import load_pair
from specdec.models.loading import DEFAULT_TARGET
from specdec.runtime.backends.torch_backend import TorchBackend
from specdec.runtime.beams import continuation_logprob
from specdec.runtime.draft_length import DraftLength
from specdec.runtime.drafters import ModelDrafter
from specdec.runtime.engine import Engine
from specdec.runtime.request import BeamParams

DEFAULT_DRAFT = "smollm2-135m-draft"


@dataclass(frozen=True)
class Config:
    """One point of the front: a method and its knobs."""

    label: str
    method: str
    width: int = 1
    threshold: float = 0.0
    memory_mode: str = "full"
    gamma: int = 3
    min_width: int = 1
    adaptive: bool = False  # γ per request from its own layer passes (the adaptive draft length), at most gamma


def configs(widths: Sequence[int], threshold: float, gamma: int) -> list[Config]:
    out = [Config("ems", "ems", gamma=gamma)]
    out += [Config(f"beam W={w}", "beam", w) for w in widths]
    out += [Config(f"dsbd W_S={w} t={threshold}", "dsbd", w, threshold, gamma=gamma) for w in widths]
    out += [Config(f"dsbd W_S={w} t=0", "dsbd", w, 0.0, gamma=gamma) for w in widths]  # fixed width W_S
    out += [Config(f"dsbd W_S={w} t=0 adaptive γ", "dsbd", w, 0.0, gamma=gamma, adaptive=True) for w in widths]
    if max(widths) > 2:  # the dynamic width held above one beam: between sampling and beam quality
        out.append(Config(f"dsbd W_S={max(widths)} t={threshold} W_min=2", "dsbd", max(widths), threshold,
                          gamma=gamma, min_width=2))
    middle = widths[len(widths) // 2]
    out.append(Config(f"dsbd W_S={middle} t={threshold} single-KV", "dsbd", middle, threshold, "single", gamma))
    return out


#: standard-library modules whose docstring's first line makes a QA item (those that name themselves are skipped)
QA_MODULES = ("csv", "re", "heapq", "bisect", "shutil", "zipfile", "gzip", "textwrap", "fractions", "statistics",
              "tempfile", "glob", "fnmatch", "pickle", "uuid", "random", "struct", "copy", "itertools", "queue",
              "getpass", "tarfile", "colorsys", "timeit", "shlex", "mimetypes", "inspect", "tokenize", "filecmp",
              "linecache", "traceback", "codeop", "reprlib", "configparser", "contextlib", "operator")
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
        items.append(QAItem(f"Here are Python standard-library modules and what they do:\n{listing}\n\n"
                            f"Which module is described as \"{description}\"? Answer with the module name only.",
                            name, tuple(m for m, _ in group)))
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
    found = [(m.start(), c) for c in choices
             if (m := re.search(rf"(?<![\w.]){re.escape(c)}(?!\w)", text, flags=re.IGNORECASE))]
    return min(found)[1] if found else None


def run(engine: Engine, scorer: TorchBackend, prompts: Sequence[list[int]], config: Config, max_tokens: int,
        temperature: float, seed: int, qa: Sequence[QAItem] | None = None) -> dict[str, Any]:
    """One batch of every prompt under ``config``: throughput, quality, speculation counters.

    With ``qa`` (one item per prompt) the result also carries the exact-match rate and the QA
    accuracy of the outputs.
    """
    engine.num_draft_tokens = config.gamma
    engine.draft_length = DraftLength() if config.adaptive else None
    beam = None if config.method in ("ems", "ar") else BeamParams(
        width=config.width, min_width=config.min_width, threshold=config.threshold, memory_mode=config.memory_mode)
    requests = [engine.request(p, max_tokens=max_tokens, temperature=temperature, seed=seed + i, beam=beam)
                for i, p in enumerate(prompts)]
    start = time.perf_counter()
    result = engine.generate(requests, config.method)
    wall = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in result.outputs)
    per_token = [continuation_logprob(scorer, p, o.token_ids) / max(1, len(o.token_ids))
                 for p, o in zip(prompts, result.outputs)]
    drafts = sum(o.metrics.draft_tokens for o in result.outputs)
    widths = [w for o in result.outputs for w in o.metrics.beam_widths]
    return {
        "seconds": wall, "tokens": tokens, "tokens_per_second": tokens / wall,
        "logprob_per_token": statistics.fmean(per_token),
        "target_calls": len(result.run.steps),
        "acceptance_rate": sum(o.metrics.accepted_draft_tokens for o in result.outputs) / drafts if drafts else None,
        "mean_beam_width": statistics.fmean(widths) if widths else None,
        "tokens_per_call": tokens / max(1, len(result.run.steps)),
        **({"exact_match": statistics.fmean(exact_match(o.text, q.answer) for o, q in zip(result.outputs, qa)),
            "qa_accuracy": statistics.fmean(first_choice(o.text, q.choices) == q.answer
                                            for o, q in zip(result.outputs, qa)),
            "answers": [o.text for o in result.outputs]} if qa is not None else {}),
    }


def pareto(points: dict[str, dict[str, Any]]) -> list[str]:
    """Labels not dominated in (tokens/s, log-likelihood per token), fastest first."""
    def key(label: str) -> tuple[float, float]:
        return points[label]["tokens_per_second"], points[label]["logprob_per_token"]

    def dominates(a: tuple[float, float], b: tuple[float, float]) -> bool:
        return a != b and a[0] >= b[0] and a[1] >= b[1]

    front = [p for p in points if not any(dominates(key(q), key(p)) for q in points)]
    return sorted(front, key=lambda label: -key(label)[0])


def markdown(doc: dict[str, Any]) -> str:
    meta, rows = doc["meta"], doc["results"]
    beam = {int(label.split("=")[1]): r for label, r in rows.items() if label.startswith("beam W=")}
    lines = [
        "# DSBD vs beam sampling vs EMS-SD sampling: speed and quality",
        "",
        f"- Date: {meta['date']}; command: `{meta['command']}` ({meta['elapsed_seconds']:.0f} s)",
        f"- Target {meta['target']}, draft {meta['draft']}; torch, fp32, {meta['machine']['torch_threads']} thread",
        f"- {meta['prompts']} requests decoded together (one batch), {meta['max_tokens']} new tokens at most, "
        f"temperature {meta['temperature']}, seeds fixed; γ = {meta['gamma']} draft layers (ems: k = {meta['gamma']})",
        f"- Workload: {meta['workload']}",
        f"- Median of {meta['repeats']} interleaved repeat(s); load average before {meta['load_before']}, after "
        f"{meta['load_after']}",
        "",
        f"- Extractive QA: {meta['qa_items']} items ({meta['qa_workload']}), {meta['qa_max_tokens']} new tokens at "
        "most, same method and temperature; exact match = the first line is the bare name, QA accuracy = the first "
        "listed module the answer names is the right one (a guess scores 0.20); the target at temperature 0 "
        f"scores {', '.join(f'{k} {v:.2f}' for k, v in meta.get('qa_reference', {}).items()) or '–'}",
        "",
        "| method | tokens/s | log-likelihood / token | exact match | QA accuracy | target calls | tokens / call | "
        "acceptance | mean beams / round | speed vs beam of the same width |",
        "|:---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for label, r in rows.items():
        width = next((w for w in beam if f"W_S={w} " in label), None)
        vs = f"{r['tokens_per_second'] / beam[width]['tokens_per_second']:.2f}×" if width else "–"
        acc = "–" if r["acceptance_rate"] is None else f"{r['acceptance_rate']:.2f}"
        mbw = "–" if r["mean_beam_width"] is None else f"{r['mean_beam_width']:.2f}"
        em, acc_qa = ("–" if r.get(key) is None else f"{r[key]:.2f}" for key in ("exact_match", "qa_accuracy"))
        lines.append(f"| {label} | {r['tokens_per_second']:.1f} | {r['logprob_per_token']:.3f} | {em} | {acc_qa} "
                     f"| {r['target_calls']} | {r['tokens_per_call']:.2f} | {acc} | {mbw} | {vs} |")
    lines += ["", f"Pareto front (fastest first): {', '.join(doc['pareto'])}.", "",
              "## Notes", "", *(f"- {n}" for n in meta["notes"])]
    return "\n".join(lines) + "\n"


def plot(doc: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 5))
    colors = {"ems": "tab:gray", "beam": "tab:orange", "dsbd": "tab:blue"}
    for label, r in doc["results"].items():
        kind = label.split()[0]
        ax.scatter(r["tokens_per_second"], r["logprob_per_token"], color=colors[kind],
                   marker="s" if "single" in label else "^" if "adaptive" in label else "o", s=50)
        ax.annotate(label, (r["tokens_per_second"], r["logprob_per_token"]), textcoords="offset points",
                    xytext=(5, 4), fontsize=7)
    front = [doc["results"][label] for label in doc["pareto"]]
    ax.plot([r["tokens_per_second"] for r in front], [r["logprob_per_token"] for r in front], "--",
            color="tab:green", linewidth=1, label="Pareto front")
    ax.set(xlabel="tokens / s (batch, prefill included)", ylabel="target log-likelihood per token (higher = better)",
           title=f"{doc['meta']['target']}: DSBD vs beam sampling vs EMS-SD, {doc['meta']['prompts']} requests")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def auto_notes(rows: dict[str, dict[str, Any]]) -> list[str]:
    """What the table says, stated from the numbers themselves."""
    notes = []
    ems = rows["ems"]
    for label, r in rows.items():
        if not label.startswith("dsbd") or "single" in label:
            continue
        width = int(label.split("W_S=")[1].split()[0])
        b = rows.get(f"beam W={width}")
        if b:
            speed = r["tokens_per_second"] / b["tokens_per_second"]
            notes.append(f"{label}: {speed:.2f}× the tokens/s of beam W={width} at log-likelihood/token "
                         f"{r['logprob_per_token']:.3f} vs {b['logprob_per_token']:.3f} "
                         f"(acceptance {r['acceptance_rate']:.2f}, {r['mean_beam_width']:.2f} beams per round, "
                         f"{r['tokens_per_call']:.2f} tokens per target call vs {b['tokens_per_call']:.2f}"
                         + (f"; QA accuracy {r['qa_accuracy']:.2f} vs {b['qa_accuracy']:.2f}"
                            if r.get("qa_accuracy") is not None and b.get("qa_accuracy") is not None else "")
                         + ").")
    best = max(rows, key=lambda label: rows[label]["logprob_per_token"])
    fastest = max(rows, key=lambda label: rows[label]["tokens_per_second"])
    notes.append(f"Highest quality: {best} ({rows[best]['logprob_per_token']:.3f} per token) vs ems sampling "
                 f"{ems['logprob_per_token']:.3f}; fastest: {fastest} ({rows[fastest]['tokens_per_second']:.1f} "
                 "tokens/s).")
    return notes


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="specdec bench beams", description=__doc__.splitlines()[0])
    p.add_argument("--target", default=DEFAULT_TARGET)
    p.add_argument("--draft", default=DEFAULT_DRAFT)
    p.add_argument("--prompts", type=int, default=4, help="requests in the batch")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--widths", default="2,3,4", help="beam widths W (beam) and W_S (dsbd)")
    p.add_argument("--threshold", type=float, default=0.5, help="dsbd dynamic-width threshold t")
    p.add_argument("--gamma", type=int, default=3, help="draft layers per round (and ems's k)")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--qa", type=int, default=20, help="extractive QA items (0: skip)")
    p.add_argument("--qa-max-tokens", type=int, default=16)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out-dir", type=Path, default=Path("benchmarks/results"))
    p.add_argument("--quick", action="store_true", help="2 prompts, 12 tokens, widths 2")
    p.add_argument("--note", action="append", default=[])
    args = p.parse_args(argv)
    if args.quick:
        args.prompts, args.max_tokens, args.widths, args.qa = 2, 12, "2", min(args.qa, 2)
    widths = tuple(int(w) for w in args.widths.split(","))
    torch.set_num_threads(args.threads)
    command = shlex.join(["specdec", "bench", "beams", *(sys.argv[1:] if argv is None else argv)])
    load_before = machine_info().get("load_average")
    start = time.perf_counter()
    target, draft = load_pair(args.target, args.draft)
    target_backend, draft_backend = TorchBackend(target), TorchBackend(draft)
    batch_slots = max(args.prompts, args.qa) * max(widths)
    engine = Engine(target_backend, ModelDrafter(draft_backend, batch_slots, 1024), tokenizer=target.tokenizer,
                    eos_token_ids=target.eos_token_ids, max_batch=batch_slots, max_len=1024)
    prompts = [engine.encode(text, chat=True) for text in build_workload(args.prompts)]
    qa = qa_set(args.qa)
    qa_prompts = [engine.encode(item.prompt, chat=True) for item in qa]
    plan = configs(widths, args.threshold, args.gamma)
    samples: dict[str, list[dict[str, Any]]] = {c.label: [] for c in plan}
    with tqdm(total=len(plan) * args.repeats, desc="dsbd pareto", unit="run") as bar:
        run(engine, target_backend, prompts[:1], plan[0], 4, args.temperature, args.seed)  # warm-up
        for repeat in range(args.repeats):
            shift = repeat % len(plan)
            for config in plan[shift:] + plan[:shift]:
                bar.set_postfix_str(config.label)
                sample = run(engine, target_backend, prompts, config, args.max_tokens, args.temperature, args.seed)
                if qa:
                    scored = run(engine, target_backend, qa_prompts, config, args.qa_max_tokens, args.temperature,
                                 args.seed, qa=qa)
                    sample |= {"exact_match": scored["exact_match"], "qa_accuracy": scored["qa_accuracy"],
                               "qa_answers": scored["answers"]}
                samples[config.label].append(sample)
                bar.update()
    # the target's own QA accuracy, deterministic: tells a task the model cannot do from a method that loses it
    references = (Config("greedy", "ar"), Config(f"beam search W={max(widths)}", "beam", max(widths)))
    qa_reference = {c.label: run(engine, target_backend, qa_prompts, c, args.qa_max_tokens, 0.0, args.seed,
                                 qa=qa)["qa_accuracy"] for c in references} if qa else {}
    rows = {label: sorted(runs, key=lambda r: r["tokens_per_second"])[len(runs) // 2]
            for label, runs in samples.items()}
    info = machine_info()
    doc = {
        "meta": {
            "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "command": command,
            "target": target.name, "draft": args.draft, "prompts": args.prompts, "max_tokens": args.max_tokens,
            "temperature": args.temperature, "gamma": args.gamma, "threshold": args.threshold,
            "repeats": args.repeats, "machine": info, "load_before": load_before,
            "load_after": info.get("load_average"), "elapsed_seconds": time.perf_counter() - start,
            "workload": "`specdec bench`'s extractive prompts (summarise / list the points of a standard-library "
                        "docstring), chat template applied",
            "qa_items": len(qa), "qa_max_tokens": args.qa_max_tokens,
            "qa_workload": "which of five standard-library modules a quoted docstring line describes",
            "qa_answers": [item.answer for item in qa], "qa_reference": qa_reference,
            "notes": [*auto_notes(rows), *args.note],
        },
        "results": rows, "samples": samples,
    }
    doc["pareto"] = pareto(rows)
    print(write_report(doc, args.out_dir, "dsbd_pareto", markdown, plot))
    return 0


if __name__ == "__main__":
    sys.exit(main())

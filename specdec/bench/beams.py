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

Extractive QA (``specdec.bench.workloads.qa_set``): a small set built from real text (the first
lines of standard library module docstrings): each prompt lists five modules with their
descriptions and asks which module one description belongs to; the answer is a word of the
context. Two scores, decoded with the same method, width and temperature:

* *exact match* — the first line of the output, normalised (case, quotes, backticks, a
  trailing period, "the"/"module"), is the module's name (SQuAD-style, strict);
* *QA accuracy* — the first of the five listed modules the output names is the right one.
  A 135M chat model rarely answers with the bare name ("The module named `heapq` ..."), so
  strict exact match does not tell the methods apart (benchmarks/results/dsbd_pareto.md); the
  first-named choice is what the answer says (a uniform guess among the five scores 0.20).

Speed: generated tokens / wall seconds of ``Engine.generate`` for the whole batch (prefill
included), one process, one torch thread, the runs interleaved and rotated over repeats
(median kept), as in ``specdec bench``. This machine is shared: compare ratios from one run.

Run::

    specdec bench beams                                   # or python -m benchmarks.dsbd_pareto
    specdec bench beams --quick --out-dir /tmp/dsbd       # smoke run

Writes ``<out-dir>/dsbd_pareto.{json,md,png}`` (default ``benchmarks/results``).
"""

from __future__ import annotations

import argparse
import datetime as dt
import shlex
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from specdec.bench.harness import machine_info
from specdec.bench.report import pareto_markdown, pareto_notes, plot_pareto, write_report
from specdec.bench.workloads import QAItem, build_workload, exact_match, first_choice, qa_set
from specdec.models.drafts import load_pair
from specdec.models.presets import DEFAULT_TARGET
from specdec.runtime.backends.torch_backend import TorchBackend
from specdec.runtime.beams import continuation_logprob
from specdec.runtime.config import EngineConfig
from specdec.runtime.draft_length import DraftLength
from specdec.runtime.drafters import ModelDrafter
from specdec.runtime.engine import Engine
from specdec.runtime.methods import get_method
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
    """Every point of the front, ems first: each dsbd width next to the beam width whose law it keeps."""
    out = [Config("ems", "ems", gamma=gamma)]
    out += [Config(f"beam W={w}", "beam", w) for w in widths]
    out += [Config(f"dsbd W_S={w} t={threshold}", "dsbd", w, threshold, gamma=gamma) for w in widths]
    out += [Config(f"dsbd W_S={w} t=0", "dsbd", w, 0.0, gamma=gamma) for w in widths]  # fixed width W_S
    out += [Config(f"dsbd W_S={w} t=0 adaptive γ", "dsbd", w, 0.0, gamma=gamma, adaptive=True) for w in widths]
    if max(widths) > 2:  # the dynamic width held above one beam: between sampling and beam quality
        out.append(
            Config(
                f"dsbd W_S={max(widths)} t={threshold} W_min=2",
                "dsbd",
                max(widths),
                threshold,
                gamma=gamma,
                min_width=2,
            )
        )
    middle = widths[len(widths) // 2]
    out.append(Config(f"dsbd W_S={middle} t={threshold} single-KV", "dsbd", middle, threshold, "single", gamma))
    return out


def run(
    engine: Engine,
    scorer: TorchBackend,
    prompts: Sequence[list[int]],
    config: Config,
    max_tokens: int,
    temperature: float,
    seed: int,
    qa: Sequence[QAItem] | None = None,
) -> dict[str, Any]:
    """One batch of every prompt under ``config``: throughput, quality, speculation counters.

    With ``qa`` (one item per prompt) the result also carries the exact-match rate and the QA
    accuracy of the outputs.
    """
    engine.reconfigure(num_draft_tokens=config.gamma, draft_length=DraftLength() if config.adaptive else None)
    beam = (
        None
        if not get_method(config.method).beams
        else BeamParams(
            width=config.width, min_width=config.min_width, threshold=config.threshold, memory_mode=config.memory_mode
        )
    )
    requests = [
        engine.request(p, max_tokens=max_tokens, temperature=temperature, seed=seed + i, beam=beam)
        for i, p in enumerate(prompts)
    ]
    start = time.perf_counter()
    result = engine.generate(requests, config.method)
    wall = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in result.outputs)
    per_token = [
        continuation_logprob(scorer, p, o.token_ids) / max(1, len(o.token_ids)) for p, o in zip(prompts, result.outputs)
    ]
    drafts = sum(o.metrics.draft_tokens for o in result.outputs)
    widths = [w for o in result.outputs for w in o.metrics.beam_widths]
    return {
        "seconds": wall,
        "tokens": tokens,
        "tokens_per_second": tokens / wall,
        "logprob_per_token": statistics.fmean(per_token),
        "target_calls": len(result.run.steps),
        "acceptance_rate": sum(o.metrics.accepted_draft_tokens for o in result.outputs) / drafts if drafts else None,
        "mean_beam_width": statistics.fmean(widths) if widths else None,
        "tokens_per_call": tokens / max(1, len(result.run.steps)),
        **(
            {
                "exact_match": statistics.fmean(
                    exact_match(o.text or "", q.answer) for o, q in zip(result.outputs, qa)
                ),
                "qa_accuracy": statistics.fmean(
                    first_choice(o.text or "", q.choices) == q.answer for o, q in zip(result.outputs, qa)
                ),
                "answers": [o.text for o in result.outputs],
            }
            if qa is not None
            else {}
        ),
    }


def pareto(points: dict[str, dict[str, Any]]) -> list[str]:
    """Labels not dominated in (tokens/s, log-likelihood per token), fastest first."""

    def key(label: str) -> tuple[float, float]:
        return points[label]["tokens_per_second"], points[label]["logprob_per_token"]

    def dominates(a: tuple[float, float], b: tuple[float, float]) -> bool:
        return a != b and a[0] >= b[0] and a[1] >= b[1]

    front = [p for p in points if not any(dominates(key(q), key(p)) for q in points)]
    return sorted(front, key=lambda label: -key(label)[0])


def main(argv: Sequence[str] | None = None) -> int:
    """Run every configuration interleaved over repeats and write ``dsbd_pareto.{json,md,png}``; 0 when done."""
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
    engine = Engine(
        target_backend,
        ModelDrafter(draft_backend, batch_slots, 1024),
        tokenizer=target.tokenizer,
        eos_token_ids=target.eos_token_ids,
        config=EngineConfig(max_batch=batch_slots, max_len=1024),
    )
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
                    scored = run(
                        engine,
                        target_backend,
                        qa_prompts,
                        config,
                        args.qa_max_tokens,
                        args.temperature,
                        args.seed,
                        qa=qa,
                    )
                    sample |= {
                        "exact_match": scored["exact_match"],
                        "qa_accuracy": scored["qa_accuracy"],
                        "qa_answers": scored["answers"],
                    }
                samples[config.label].append(sample)
                bar.update()
    # the target's own QA accuracy, deterministic: tells a task the model cannot do from a method that loses it
    references = (Config("greedy", "ar"), Config(f"beam search W={max(widths)}", "beam", max(widths)))
    qa_reference = (
        {
            c.label: run(engine, target_backend, qa_prompts, c, args.qa_max_tokens, 0.0, args.seed, qa=qa)[
                "qa_accuracy"
            ]
            for c in references
        }
        if qa
        else {}
    )
    rows = {
        label: sorted(runs, key=lambda r: r["tokens_per_second"])[len(runs) // 2] for label, runs in samples.items()
    }
    info = machine_info()
    doc: dict[str, Any] = {
        "meta": {
            "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "command": command,
            "target": target.name,
            "draft": args.draft,
            "prompts": args.prompts,
            "max_tokens": args.max_tokens,
            "temperature": args.temperature,
            "gamma": args.gamma,
            "threshold": args.threshold,
            "repeats": args.repeats,
            "machine": info,
            "load_before": load_before,
            "load_after": info.get("load_average"),
            "elapsed_seconds": time.perf_counter() - start,
            "workload": "`specdec bench`'s extractive prompts (summarise / list the points of a standard-library "
            "docstring), chat template applied",
            "qa_items": len(qa),
            "qa_max_tokens": args.qa_max_tokens,
            "qa_workload": "which of five standard-library modules a quoted docstring line describes",
            "qa_answers": [item.answer for item in qa],
            "qa_reference": qa_reference,
            "notes": [*pareto_notes(rows), *args.note],
        },
        "results": rows,
        "samples": samples,
    }
    doc["pareto"] = pareto(rows)
    print(write_report(doc, args.out_dir, "dsbd_pareto", pareto_markdown, plot_pareto))
    return 0


if __name__ == "__main__":
    sys.exit(main())

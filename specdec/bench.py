"""EMS-SD vs the padded ("vanilla") multi-sample baseline vs plain greedy decoding.

``specdec bench`` (and ``benchmarks/ems_vs_vanilla.py``) runs the three decoding loops of
``specdec.runtime.loops`` side by side on one target and one prompt-lookup drafter, at
several batch sizes, and writes ``ems_vs_vanilla.{json,md,png}``.

Why it is built this way:

* **Workload.** EMS-SD's paper measures CNN/DailyMail summarisation with an LLMA
  (prompt-lookup) drafter, because answers that copy spans of the prompt are where
  n-gram drafting pays. Offline, the closest real text is the documentation that ships
  with Python: docstrings of standard-library modules and functions. Each prompt asks the
  chat model to summarise or list the points of one docstring, so the answer quotes it.
* **Fairness on a shared, noisy machine.** All methods of one batch size use one engine
  (same weights, same cache), run in the same process, interleaved, with the order
  rotated between repeats, and the median over repeats is reported. Torch runs one
  intra-op thread by default: with two threads on a 2-core machine that other jobs share,
  a step's time varied 2-15× from one call to the next. CPU-time throughput is reported
  next to wall-clock throughput because other jobs stretch the one and hardly the other.
* **Correctness is part of the result.** Greedy speculative decoding must reproduce
  greedy autoregressive decoding token for token; every run is compared with ``ar`` and
  the JSON says whether it did.
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import importlib
import inspect
import json
import os
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from specdec.models.loading import DEFAULT_TARGET, LoadedModel, load_model
from specdec.runtime.backends.torch_backend import TorchBackend
from specdec.runtime.drafters import NgramDrafter
from specdec.runtime.engine import Engine, GenerationResult

METHODS = ("ar", "vanilla", "ems")
SPECULATIVE = ("vanilla", "ems")

# Standard-library objects whose docstrings form the workload, in the order prompts are
# taken (a batch of B uses the first B). Modules and functions are mixed so that every
# prefix holds prose, option lists and API descriptions alike.
DOC_SOURCES = (
    "subprocess", "json.dumps", "collections", "functools.lru_cache", "heapq", "textwrap.dedent",
    "shutil.rmtree", "csv", "bisect.bisect_left", "statistics.median", "random.Random.sample",
    "tarfile.TarFile.extractall", "zipfile.ZipFile", "itertools", "logging.Logger", "argparse.ArgumentParser",
    "string", "datetime.timedelta", "pathlib.Path", "unittest.TestCase", "json.JSONEncoder", "functools.reduce",
    "collections.namedtuple", "heapq.merge", "textwrap.wrap", "shutil.move", "statistics.quantiles",
    "subprocess.run", "tempfile.mkstemp", "contextlib.contextmanager", "dataclasses.dataclass", "os.makedirs",
    "re.split", "sched", "struct", "inspect", "uuid", "difflib", "copy", "timeit", "tokenize", "typing",
    "sqlite3", "io", "zlib", "fnmatch", "pprint", "getopt", "colorsys", "optparse",
)

PROMPT_TEMPLATES = (
    "Summarize the following Python documentation in a few sentences, reusing its own wording.\n\n{text}",
    "List the functions, options and key points described in the following Python documentation, "
    "one per line.\n\n{text}",
)

# About 80 to 300 tokens of English-and-code text (SmolLM2's tokenizer: ~4 characters a token).
MIN_DOC_CHARS, MAX_DOC_CHARS = 320, 1200


@dataclass
class BenchConfig:
    """What a benchmark run measures; the same values apply to every method."""

    batch_sizes: tuple[int, ...] = (1, 4, 8, 16)
    max_tokens: int = 128
    num_draft_tokens: int = 7  # LLMA / EMS-SD copy up to 7 tokens on an n-gram hit
    ngram: int = 2  # LLMA / EMS-SD: look up the last 2-gram ...
    min_ngram: int = 2  # ... and only the 2-gram (a 1-gram "hit" is nearly always a wrong guess)
    repeats: int = 3
    methods: tuple[str, ...] = METHODS
    warmup: bool = True


@dataclass
class MethodRuns:
    """Every timed run of one method at one batch size, with the process CPU time of each."""

    results: list[GenerationResult] = field(default_factory=list)
    cpu_seconds: list[float] = field(default_factory=list)

    def median_run(self) -> GenerationResult:
        """The run with the median wall time (the lower middle one for an even count)."""
        ordered = sorted(self.results, key=lambda r: r.run.wall_seconds)
        return ordered[(len(ordered) - 1) // 2]

    def tokens_per_second(self) -> float:
        """Median over runs of generated tokens / wall seconds (prefill included)."""
        return statistics.median(r.run.generated_tokens / r.run.wall_seconds for r in self.results)

    def decode_tokens_per_second(self) -> float:
        """Median over runs of tokens after each request's first / ``RunMetrics.decode_seconds``.

        The prefill step emits every request's first token, so those are not decode tokens.
        """
        return statistics.median((r.run.generated_tokens - r.run.requests) / r.run.decode_seconds
                                 for r in self.results)

    def cpu_tokens_per_second(self) -> float:
        """Median over runs of generated tokens / process CPU seconds: insensitive to other jobs."""
        return statistics.median(r.run.generated_tokens / c for r, c in zip(self.results, self.cpu_seconds))


# -- workload ---------------------------------------------------------------------------


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


# -- running ----------------------------------------------------------------------------

EngineFactory = Callable[[int, int], Engine]  # (max_batch, max_len) -> Engine


def engine_factory(target: LoadedModel, config: BenchConfig) -> EngineFactory:
    """Engines over one shared target backend, each with a fresh n-gram drafter.

    The backend (fused weights) is built once and shared by every batch size; only the KV
    cache depends on ``max_batch`` and ``max_len``. ``min_ngram`` is not an argument of
    ``Engine.from_models``, so the engine is assembled here from the same parts.
    """
    backend = TorchBackend(target)

    def make(max_batch: int, max_len: int) -> Engine:
        drafter = NgramDrafter(max_ngram=config.ngram, min_ngram=config.min_ngram)
        return Engine(backend, drafter, tokenizer=target.tokenizer, eos_token_ids=target.eos_token_ids,
                      max_batch=max_batch, max_len=max_len, num_draft_tokens=config.num_draft_tokens)

    return make


def required_max_len(prompt_lens: Sequence[int], config: BenchConfig) -> int:
    """Cache length at which vanilla can never run out of room.

    Vanilla advances every write position by the batch's largest accepted length, so in
    the worst case each of the ``max_tokens`` steps leaves ``k + 1`` positions behind.
    EMS-SD needs only ``prompt + max_tokens + k``; its cost does not depend on this size
    (attention reads only committed positions), so one cache serves all three methods.
    """
    return max(prompt_lens) + config.max_tokens * (config.num_draft_tokens + 1) + 1


def run_once(engine: Engine, prompts: Sequence[str | Sequence[int]], method: str, max_tokens: int,
              chat: bool, temperature: float = 0.0, seed: int = 0) -> tuple[GenerationResult, float]:
    """One ``generate`` call; returns its result and the process CPU seconds it used.

    ``temperature`` > 0 samples, prompt i with seed ``seed + i``, so every run draws the same way.
    """
    requests = [engine.request(p, chat=chat, max_tokens=max_tokens, request_id=f"p{i}", temperature=temperature,
                               seed=seed + i if temperature > 0 else None)
                for i, p in enumerate(prompts)]
    gc.collect()  # a collection inside a timed run would be charged to whichever method hit it
    cpu_start = time.process_time()
    result = engine.generate(requests, method)
    cpu_seconds = time.process_time() - cpu_start
    failed = [o.error for o in result.outputs if o.error]
    if failed:
        raise RuntimeError(f"{method}: {len(failed)} request(s) failed, first: {failed[0]}")
    return result, cpu_seconds


def _ratios(values: dict[str, float]) -> dict[str, Any]:
    """Speed-ups over ar and the ems / vanilla ratio of one family of throughputs."""
    out: dict[str, Any] = {
        "over_ar": {m: round(values[m] / values["ar"], 3) for m in SPECULATIVE if m in values}
        if "ar" in values else {},
        "ems_over_vanilla": round(values["ems"] / values["vanilla"], 3)
        if {"ems", "vanilla"} <= values.keys() else None,
    }
    return out


def _identical(runs: dict[str, MethodRuns]) -> dict[str, bool]:
    """Per speculative method: did every run reproduce ar's tokens exactly?"""
    if "ar" not in runs:
        return {}
    reference = [o.token_ids for o in runs["ar"].results[0].outputs]
    return {m: all([o.token_ids for o in r.outputs] == reference for r in mr.results)
            for m, mr in runs.items() if m != "ar"}


def _decode_rows(result: GenerationResult) -> tuple[int, int]:
    """(rows, padded rows) of the decode steps (prompt rows are the same for every method)."""
    decode = [s for s in result.run.steps if s.prefill_rows == 0]
    return sum(s.rows for s in decode), sum(s.padded_rows for s in decode)


def _decode_padded_fraction(result: GenerationResult) -> float:
    """Padding among decode rows (``padded_fraction`` also counts prompt rows, never padded)."""
    rows, padded = _decode_rows(result)
    return round(padded / rows, 4) if rows else 0.0


def mean_accepted_length(result: GenerationResult) -> float:
    """Tokens per sequence per decoding step, counted per request while it is unfinished.

    ``RunMetrics.summary()`` divides by the sequences in each pack, and vanilla's packs
    also hold finished sequences that only compute padding; counting per request keeps
    the number comparable between methods (greedy: it is the same for vanilla and ems).
    """
    steps = sum(o.metrics.target_calls - 1 for o in result.outputs)  # minus the prefill call
    tokens = sum(o.metrics.generated_tokens - 1 for o in result.outputs)  # minus the prefill's token
    return round(tokens / steps, 4) if steps > 0 else 0.0


def summarise(runs: dict[str, MethodRuns], batch: int) -> dict[str, Any]:
    """The JSON record of one batch size.

    Throughputs are medians over repeats. Counters (rows, acceptance) come from the median
    run, but greedy decoding makes them the same in every run.
    """
    tps = {m: round(mr.tokens_per_second(), 3) for m, mr in runs.items()}
    decode_tps = {m: round(mr.decode_tokens_per_second(), 3) for m, mr in runs.items()}
    cpu_tps = {m: round(mr.cpu_tokens_per_second(), 3) for m, mr in runs.items()}
    summary = {m: mr.median_run().run.summary() for m, mr in runs.items()}
    spec = [m for m in SPECULATIVE if m in runs]
    wall, decode, cpu = _ratios(tps), _ratios(decode_tps), _ratios(cpu_tps)
    identical = _identical(runs)
    return {
        **tps,
        "batch_size": batch,
        "speedup_over_ar": wall["over_ar"],
        "ems_over_vanilla": wall["ems_over_vanilla"],
        "decode_tokens_per_second": decode_tps,
        "decode_speedup_over_ar": decode["over_ar"],
        "decode_ems_over_vanilla": decode["ems_over_vanilla"],
        "cpu_tokens_per_second": cpu_tps,
        "cpu_speedup_over_ar": cpu["over_ar"],
        "cpu_ems_over_vanilla": cpu["ems_over_vanilla"],
        "mean_accepted_length": {m: mean_accepted_length(runs[m].median_run()) for m in spec},
        "acceptance_rate": {m: summary[m]["acceptance_rate"] for m in spec},
        "padded_fraction": {m: summary[m]["padded_fraction"] for m in spec},
        "decode_rows": {m: _decode_rows(mr.median_run())[0] for m, mr in runs.items()},
        "decode_padded_fraction": {m: _decode_padded_fraction(runs[m].median_run()) for m in spec},
        "target_rows": {m: s["target_rows"] for m, s in summary.items()},
        "target_rows_padded": {m: s["target_rows_padded"] for m, s in summary.items()},
        "target_calls": {m: s["target_calls"] for m, s in summary.items()},
        "generated_tokens": {m: s["generated_tokens"] for m, s in summary.items()},
        "wall_seconds": {m: [round(r.run.wall_seconds, 3) for r in mr.results] for m, mr in runs.items()},
        "decode_seconds": {m: [round(r.run.decode_seconds, 3) for r in mr.results] for m, mr in runs.items()},
        "cpu_seconds": {m: [round(c, 3) for c in mr.cpu_seconds] for m, mr in runs.items()},
        "prefill_seconds": {m: round(sum(s.seconds for s in mr.median_run().run.steps if s.prefill_rows), 3)
                            for m, mr in runs.items()},
        "draft_seconds": {m: summary[m]["draft_seconds"] for m in spec},
        "identical_to_ar": all(identical.values()) if identical else None,
        "identical_to_ar_by_method": identical,
    }


def run_benchmark(make_engine: EngineFactory, prompts: Sequence[str | Sequence[int]], config: BenchConfig, *,
                  chat: bool = True, progress: bool = True) -> dict[str, dict[str, Any]]:
    """Measure every method at every batch size; returns ``{"<batch>": record}``.

    Batch size B takes the first B prompts, submits them at once to an engine with
    ``max_batch=B``, and runs the methods interleaved ``repeats`` times, rotating their
    order each repeat so no method always runs first (or right after another) on a
    machine whose load drifts.
    """
    needed = max(config.batch_sizes)
    if len(prompts) < needed:
        raise ValueError(f"batch size {needed} needs {needed} prompts, got {len(prompts)}")
    results: dict[str, dict[str, Any]] = {}
    bar = tqdm(total=len(config.batch_sizes) * config.repeats * len(config.methods), desc="bench",
               unit="run", disable=not progress)
    for batch in config.batch_sizes:
        batch_prompts = list(prompts[:batch])
        probe = make_engine(1, 2)  # only to tokenise: the lengths size the real cache
        lens = [len(probe.encode(p, chat)) for p in batch_prompts]
        engine = make_engine(batch, required_max_len(lens, config))
        if config.warmup:  # lazy kernel initialisation and first-touch allocations, untimed
            for method in config.methods:
                run_once(engine, batch_prompts[:1], method, min(4, config.max_tokens), chat)
        runs = {m: MethodRuns() for m in config.methods}
        for repeat in range(config.repeats):
            shift = repeat % len(config.methods)
            for method in config.methods[shift:] + config.methods[:shift]:
                bar.set_postfix_str(f"B={batch} {method} #{repeat + 1}")
                result, cpu_seconds = run_once(engine, batch_prompts, method, config.max_tokens, chat)
                runs[method].results.append(result)
                runs[method].cpu_seconds.append(cpu_seconds)
                bar.update()
        results[str(batch)] = {**summarise(runs, batch), "prompt_tokens": lens}
        del engine
    bar.close()
    return results


# -- reporting --------------------------------------------------------------------------


def machine_info() -> dict[str, Any]:
    """What the numbers depend on: CPU, threads, library versions, load from other users."""
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "processor": platform.processor() or "unknown",
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
    }
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            models = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        if models:
            info["processor"] = models[0]
    except OSError:
        pass
    if hasattr(os, "getloadavg"):
        info["load_average"] = [round(x, 2) for x in os.getloadavg()]
    return info


def write_json(results: dict[str, dict[str, Any]], path: Path) -> None:
    """Top-level keys are batch sizes only; run metadata goes to the markdown report."""
    path.write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")


def _fmt(x: float | None, digits: int = 2, suffix: str = "") -> str:
    return "–" if x is None else f"{x:.{digits}f}{suffix}"


def _throughput_table(results: dict[str, dict[str, Any]], tps_key: str | None, prefix: str) -> list[str]:
    """One markdown table: tok/s of each method, speed-ups over ar, ems / vanilla."""
    lines = [
        "| batch | ar tok/s | vanilla tok/s | ems tok/s | vanilla / ar | ems / ar | ems / vanilla |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for batch, r in results.items():
        tps = r if tps_key is None else r[tps_key]
        sp = r[f"{prefix}speedup_over_ar"]
        lines.append(
            f"| {batch} | {_fmt(tps.get('ar'), 1)} | {_fmt(tps.get('vanilla'), 1)} | {_fmt(tps.get('ems'), 1)} | "
            f"{_fmt(sp.get('vanilla'), 2, '×')} | {_fmt(sp.get('ems'), 2, '×')} | "
            f"{_fmt(r[f'{prefix}ems_over_vanilla'], 2, '×')} |"
        )
    return lines


def _work_table(results: dict[str, dict[str, Any]]) -> list[str]:
    """What the target computed: acceptance, padding, rows, calls, correctness."""
    lines = [
        "| batch | mean accepted length | acceptance rate | vanilla padded fraction (all / decode rows) |"
        " target rows (ar / vanilla / ems) | target calls (ar / vanilla / ems) | identical to ar |",
        "|---:|---:|---:|---:|---:|---:|:---:|",
    ]
    for batch, r in results.items():
        acc, rate, rows, calls = (r["mean_accepted_length"], r["acceptance_rate"], r["target_rows"],
                                  r["target_calls"])
        # vanilla and ems verify the same drafts greedily, so their acceptance is the same
        same = acc.get("vanilla") == acc.get("ems") and rate.get("vanilla") == rate.get("ems")
        acc_text = _fmt(acc.get("ems")) if same else f"{_fmt(acc.get('vanilla'))} / {_fmt(acc.get('ems'))}"
        rate_text = _fmt(rate.get("ems")) if same else f"{_fmt(rate.get('vanilla'))} / {_fmt(rate.get('ems'))}"
        identical = {True: "yes", False: "NO", None: "–"}[r["identical_to_ar"]]
        lines.append(
            f"| {batch} | {acc_text} | {rate_text} | {_fmt(r['padded_fraction'].get('vanilla'), 3)} / "
            f"{_fmt(r['decode_padded_fraction'].get('vanilla'), 3)} | "
            f"{rows.get('ar', '–')} / {rows.get('vanilla', '–')} / {rows.get('ems', '–')} | "
            f"{calls.get('ar', '–')} / {calls.get('vanilla', '–')} / {calls.get('ems', '–')} | {identical} |"
        )
    return lines


def markdown_report(results: dict[str, dict[str, Any]], meta: dict[str, Any]) -> str:
    """The human-readable report: tables, the command, the machine, and how to read them."""
    cfg, machine = meta["config"], meta["machine"]
    lines = [
        "# EMS-SD vs vanilla (padded) multi-sample speculative decoding",
        "",
        f"- Date: {meta['date']}",
        f"- Command: `{meta['command']}` (total {meta.get('elapsed_seconds', 0):.0f} s)",
        f"- Target: {meta['target']}, fp32, greedy, {cfg['max_tokens']} new tokens per request",
        f"- Drafter: prompt lookup on the last {cfg['min_ngram']}..{cfg['ngram']}-gram of prompt + output, "
        f"copying up to k = {cfg['num_draft_tokens']} tokens (same drafter and k for vanilla and ems)",
        f"- Workload: {meta['workload']}",
        f"- Machine: {machine['processor']}, {machine['cpu_count']} cores, {machine['platform']}; "
        f"Python {machine['python']}, torch {machine['torch']} with {machine['torch_threads']} intra-op "
        f"thread(s)",
        f"- Shared machine: load average (1, 5, 15 min) {meta.get('load_before', '?')} before, "
        f"{meta.get('load_after', '?')} after",
        f"- Timing: median of {cfg['repeats']} interleaved repeat(s) per method and batch size "
        "(method order rotated each repeat)",
        "",
        "## Throughput: generated tokens / wall seconds, prefill included",
        "",
        *_throughput_table(results, None, ""),
        "",
        "## Decode-only throughput: prefill step excluded",
        "",
        *_throughput_table(results, "decode_tokens_per_second", "decode_"),
        "",
        "## CPU-time throughput: generated tokens / process CPU seconds, prefill included",
        "",
        *_throughput_table(results, "cpu_tokens_per_second", "cpu_"),
        "",
        "## What the target computed",
        "",
        *_work_table(results),
        "",
        "## How to read this",
        "",
        "- *Throughput* (JSON keys `ar`, `vanilla`, `ems`): generated tokens divided by the wall time of "
        "`Engine.generate`: prefill of all prompts, drafting, every target call, verification and Python "
        "bookkeeping. The median over repeats.",
        "- *Decode-only*: tokens after each request's first one, divided by `RunMetrics.decode_seconds` "
        "(target calls without prompt rows plus their drafting; verification and bookkeeping between "
        "calls are not in it). Closest to the paper's timing, which excludes prefill.",
        "- *CPU-time*: the same runs, divided by the CPU time this process used instead of wall time. Other "
        "jobs on a shared machine stretch wall time but hardly CPU time, so on a busy machine this is the "
        "steadier comparison of the work each method does.",
        "- *Mean accepted length*: tokens committed per sequence per decoding step (1 + accepted drafts); "
        "*acceptance rate*: accepted / proposed draft tokens. Vanilla and ems verify the same drafts "
        "greedily, so both are the same for the two; only the cost of a step differs.",
        "- *Padded fraction*: target rows that were padding (vanilla pads every sequence's drafts to the "
        "batch maximum), among all rows and among decode rows (prompt rows are never padded). Vanilla "
        "also leaves masked holes in the KV cache that attention still reads; "
        "that cost shows in time, not in rows.",
    ]
    notes = meta.get("notes", [])
    if notes:
        lines += ["", "## Notes", "", *(f"- {note}" for note in notes)]
    return "\n".join(lines) + "\n"


def plot(results: dict[str, dict[str, Any]], path: Path, title: str = "") -> None:
    """Throughput and speed-up over ar against batch size, one line per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = [int(b) for b in results]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    styles = {"ar": ("tab:gray", "s"), "vanilla": ("tab:orange", "o"), "ems": ("tab:blue", "D")}
    for method, (color, marker) in styles.items():
        if all(method in results[str(b)] for b in batches):
            ax1.plot(batches, [results[str(b)][method] for b in batches], marker=marker, color=color, label=method)
    for method in SPECULATIVE:
        color, marker = styles[method]
        values = [results[str(b)]["speedup_over_ar"].get(method) for b in batches]
        if all(v is not None for v in values):
            ax2.plot(batches, values, marker=marker, color=color, label=method)
    ax2.axhline(1.0, color="tab:gray", linestyle="--", linewidth=1, label="ar")
    ax1.set(xlabel="batch size", ylabel="generated tokens / s (prefill included)", title="Throughput")
    ax2.set(xlabel="batch size", ylabel="speed-up over ar (same batch size)", title="Speed-up over greedy")
    for ax in (ax1, ax2):
        ax.set_xticks(batches)
        ax.grid(alpha=0.3)
        ax.legend()
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_report(doc: dict[str, Any], out_dir: Path, stem: str, markdown: Callable[[dict[str, Any]], str],
                 draw: Callable[[dict[str, Any], Path], None]) -> str:
    """Write a benchmark's ``<stem>.json``, ``.md`` and ``.png`` into ``out_dir``; returns the markdown.

    One writer, so every committed result comes as the same three files (data, table, plot).
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    text = markdown(doc)
    (out_dir / f"{stem}.json").write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    (out_dir / f"{stem}.md").write_text(text, encoding="utf-8")
    draw(doc, out_dir / f"{stem}.png")
    return text


def write_results(results: dict[str, dict[str, Any]], meta: dict[str, Any], out_dir: Path,
                  stem: str = "ems_vs_vanilla") -> list[Path]:
    """Write ``<stem>.json``, ``<stem>.md`` and ``<stem>.png`` into ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / f"{stem}.json", out_dir / f"{stem}.md", out_dir / f"{stem}.png"]
    write_json(results, paths[0])
    paths[1].write_text(markdown_report(results, meta), encoding="utf-8")
    cfg = meta["config"]
    plot(results, paths[2], f"{meta['target']}, prompt lookup k={cfg['num_draft_tokens']}, "
                            f"{cfg['max_tokens']} new tokens, greedy, {meta['machine']['torch_threads']} thread(s)")
    return paths


def _prompt_lengths(results: dict[str, dict[str, Any]]) -> str:
    """Token counts of the largest batch's prompts as the model saw them (chat template included)."""
    lens = max((r["prompt_tokens"] for r in results.values()), key=len)
    return f"{min(lens)}-{max(lens)} prompt tokens each, chat template included ({sum(lens)} in the largest batch)"


def auto_notes(results: dict[str, dict[str, Any]]) -> list[str]:
    """Plain statements of what the numbers show, so the report cannot drift from them."""
    bad = [b for b, r in results.items() if r["identical_to_ar"] is False]
    notes = ["Every vanilla and ems output was token-identical to ar's." if not bad else
             f"OUTPUTS DIFFER from ar at batch size(s) {', '.join(bad)}: see identical_to_ar_by_method."]
    for label, key in (("wall", "ems_over_vanilla"), ("decode-only", "decode_ems_over_vanilla"),
                       ("CPU-time", "cpu_ems_over_vanilla")):
        ratios = {b: r[key] for b, r in results.items() if r[key] is not None}
        if ratios:
            behind = [b for b, x in ratios.items() if round(x, 2) < 1.0]  # as printed: 0.996 is a tie
            notes.append(f"ems / vanilla, {label}: " + ", ".join(f"B={b} {x:.2f}×" for b, x in ratios.items())
                         + ("." if not behind else f" (ems behind at B={', '.join(behind)})."))
    both = {b: r for b, r in results.items() if {"vanilla", "ems"} <= r["decode_rows"].keys()}
    if both:
        notes.append("Target rows in decode steps, vanilla / ems: " + ", ".join(
            f"B={b} {r['decode_rows']['vanilla']} / {r['decode_rows']['ems']}"
            f" ({r['decode_rows']['vanilla'] / max(r['decode_rows']['ems'], 1):.2f}×)" for b, r in both.items()
        ) + ". The prompt rows (prefill) are the same for every method.")
        notes.append("Share of ems's wall time spent in the prefill step, which every method pays alike: " + ", ".join(
            f"B={b} {r['prefill_seconds']['ems'] / statistics.median(r['wall_seconds']['ems']):.0%}"
            for b, r in both.items()
        ) + ".")
    return notes


# -- command line -----------------------------------------------------------------------


def int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from exc
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def build_parser() -> argparse.ArgumentParser:
    """The ``specdec bench`` options; defaults reproduce the paper's setting at this model's scale."""
    p = argparse.ArgumentParser(prog="specdec bench", description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--target", default=DEFAULT_TARGET, help="preset, Hugging Face directory or .gguf file")
    p.add_argument("--batch-sizes", type=int_list, default=(1, 4, 8, 16), help="comma-separated")
    p.add_argument("--max-tokens", type=int, default=128, help="new tokens per request")
    p.add_argument("--num-draft-tokens", type=int, default=7, help="k: longest n-gram continuation copied")
    p.add_argument("--ngram", type=int, default=2, help="longest n-gram the drafter looks up (LLMA: 2)")
    p.add_argument("--min-ngram", type=int, default=2, help="shortest n-gram that counts as a hit (LLMA: 2)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per method and batch size (median)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads (0 = torch's default). One thread is much steadier on a "
                        "CPU shared with other jobs")
    p.add_argument("--out-dir", type=Path, default=Path("benchmarks/results"))
    p.add_argument("--quick", action="store_true", help="smoke test: batch sizes 1,2, 16 tokens, 2 prompts")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--note", action="append", default=[], help="a line for the report's notes (repeatable)")
    return p


def _command_line(argv: Sequence[str] | None) -> str:
    """How this run was started, for the report (``--note`` text is left out: it is in the notes)."""
    if argv is None:
        script = sys.argv[0]
        words = ["python", script] if script.endswith(".py") else [Path(script).name]
        args = sys.argv[1:]
    else:
        words, args = ["specdec", "bench"], list(argv)
    kept, skip = [], False
    for arg in args:
        if skip:
            skip = False
        elif arg == "--note":
            skip = True
        elif not arg.startswith("--note="):
            kept.append(arg)
    return shlex.join([*words, *kept])


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark and write the JSON, markdown and plot; 1 if any output differs from ar."""
    args = build_parser().parse_args(argv)
    command = _command_line(argv)
    if args.quick:
        args.batch_sizes, args.max_tokens = (1, 2), 16
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    config = BenchConfig(batch_sizes=args.batch_sizes, max_tokens=args.max_tokens,
                         num_draft_tokens=args.num_draft_tokens, ngram=args.ngram, min_ngram=args.min_ngram,
                         repeats=args.repeats)
    prompts = build_workload(2 if args.quick else max(config.batch_sizes))
    load_before = machine_info().get("load_average")
    start = time.perf_counter()
    target = load_model(args.target)
    results = run_benchmark(engine_factory(target, config), prompts, config, chat=True,
                            progress=not args.no_progress)
    elapsed = time.perf_counter() - start
    info = machine_info()
    docs = collect_documents()
    meta = {
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": command,
        "target": target.name,
        "machine": info,
        "load_before": load_before,
        "load_after": info.get("load_average"),
        "elapsed_seconds": elapsed,
        "config": {k: getattr(config, k) for k in ("max_tokens", "num_draft_tokens", "ngram", "min_ngram",
                                                    "repeats")},
        "workload": (f"{len(prompts)} chat prompts asking to summarise / list the points of Python "
                     f"{platform.python_version()} standard-library docstrings ({MIN_DOC_CHARS}-{MAX_DOC_CHARS} "
                     f"characters; first sources: {', '.join(name for name, _ in docs[:len(prompts)][:8])}"
                     f"{', ...' if len(prompts) > 8 else ''}); {_prompt_lengths(results)}; "
                     "batch size B uses the first B prompts."),
        "notes": [*auto_notes(results), *args.note],
    }
    for path in write_results(results, meta, args.out_dir):
        print(f"wrote {path}")
    print("\n".join(_throughput_table(results, None, "")))
    return 0 if all(r["identical_to_ar"] is not False for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())

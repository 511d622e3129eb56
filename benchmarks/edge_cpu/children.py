"""One contestant, one process: the runners that decode a workload in a fresh interpreter, and the parent's
side that starts them."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from benchmarks.edge_cpu import CHILD_TIMEOUT_S
from benchmarks.edge_cpu.forced import run_forced

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
        max_batch=spec["batch"],
        max_len=spec["max_len"],
        num_draft_tokens=spec["k"] if speculative else 0,
        drafter=drafter,
        threads=spec["threads"],
        torch_threads=1,
        kv_cache_dtype=spec.get("kv_cache"),
        draft_length=draft_length_from(adaptive, measured) if speculative else None,
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
        "draft_length": None if engine.draft_length is None else asdict(engine.draft_length),
        "versions": {"onnxruntime": onnxruntime.__version__},
    }


def child_main(spec_path: Path, result_path: Path) -> int:
    """Run one contestant from its spec file and write what it measured, with its own peak RSS."""
    spec = json.loads(spec_path.read_text(encoding="utf-8"))
    runner = {"llama": run_llama, "hf": run_hf, "specdec": run_specdec, "forced": run_forced}[spec["kind"]]
    result = runner(spec)
    result["peak_rss_mb"] = peak_rss_mb()
    result_path.write_text(json.dumps(result), encoding="utf-8")
    return 0


def _child_path() -> str:
    """PYTHONPATH for a child: the repository root first, so ``-m benchmarks.edge_cpu`` imports this checkout."""
    root = str(Path(__file__).resolve().parents[2])
    return os.pathsep.join([root, *filter(None, [os.environ.get("PYTHONPATH")])])


def run_child(spec: dict[str, Any], work: Path, name: str) -> dict[str, Any]:
    """One contestant in a fresh interpreter; its output goes to a log, its failure to the result's ``error``."""
    work.mkdir(parents=True, exist_ok=True)
    spec_path, result_path, log_path = (work / f"{name}.{ext}" for ext in ("spec.json", "result.json", "log"))
    spec_path.write_text(json.dumps(spec), encoding="utf-8")
    result_path.unlink(missing_ok=True)
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": _child_path()}
    with log_path.open("w", encoding="utf-8") as log:
        try:
            proc = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "benchmarks.edge_cpu",
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

"""One contestant, one process: HF and specdec runners that decode the workloads in a fresh interpreter of the
project's venv (``python -m benchmarks.edge_cpu.children``, ``benchmarks.peers.protocol``'s JSON files), and the
parent's side that starts them."""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from benchmarks.edge_cpu import CHILD_TIMEOUT_S
from benchmarks.edge_cpu.forced import run_forced
from benchmarks.peers.protocol import answer, child_main, chunks, run_peer
from specdec.runtime.config import EngineConfig
from specdec.runtime.context import LoopHooks

# -- children: one contestant, one process ---------------------------------------------------


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
        answers = [answer(row[width:].tolist(), eos) for row in out]
        tokenizer.batch_decode(answers, skip_special_tokens=True)  # timed like the others' detokenisation
        return answers, time.perf_counter() - t0

    generate([spec["prompts"]["chat"][0]], 4)  # warm-up, untimed
    workloads = {}
    for name, prompts in spec["prompts"].items():
        ttft, ids_out, seconds, seen = [], [], 0.0, []
        for batch in chunks(prompts, spec["batch"]):
            seen += batch
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
            "prompt_ids": seen,
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

    def context(scheduler: Any, hooks: LoopHooks | None = None) -> Any:
        """The engine's context with the first ``on_tokens`` event timed (what a stream would send first)."""
        hooks = hooks or LoopHooks()
        on_tokens = hooks.on_tokens

        def timed(seq: Any, tokens: list[int]) -> None:
            if not first_token:
                first_token.append(time.perf_counter())
            if on_tokens is not None:
                on_tokens(seq, tokens)

        return original_context(scheduler, replace(hooks, on_tokens=timed))

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
        ttft, ids_out, texts, seconds, drafted, accepted, seen = [], [], [], 0.0, 0, 0, []
        for batch in chunks(prompts, spec["batch"]):
            result, elapsed, first = generate(batch, spec["max_tokens"])
            seen += [list(r.prompt_ids) for r in result.outputs]
            seconds += elapsed
            ttft.append(first)
            ids_out += [answer(o.token_ids, eos) for o in result.outputs]
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
            "prompt_ids": seen,
        }
    return {
        "workloads": workloads,
        "load_seconds": load_seconds,
        "draft_length": None if engine.config.draft_length is None else asdict(engine.config.draft_length),
        "versions": {"onnxruntime": onnxruntime.__version__},
    }


def generate(spec: dict[str, Any]) -> dict[str, Any]:
    """One contestant's timed workloads: transformers or a specdec export (``spec["kind"]``)."""
    return {"hf": run_hf, "specdec": run_specdec}[spec["kind"]](spec)


def run_child(spec: dict[str, Any], work: Path, name: str) -> dict[str, Any]:
    """One contestant (or one export's forced scoring) in a fresh interpreter of this venv, so its peak RSS and
    its start-up are its own; its failure comes back as the result's ``error``."""
    return run_peer(sys.executable, "benchmarks.edge_cpu.children", spec, work, name, CHILD_TIMEOUT_S)


if __name__ == "__main__":
    sys.exit(child_main({"generate": generate, "score": run_forced}))

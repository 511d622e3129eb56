"""OpenVINO GenAI as a peer: an ``optimum-cli export openvino`` model decoded greedily on the CPU plugin.

Runs in ``.work/peers/openvino`` (``install.sh``): ``<venv>/bin/python -m benchmarks.peers.openvino --spec S
--result R`` (``protocol``). ``spec["mode"]``:

* ``pipeline``: ``LLMPipeline``, one prompt per call (batch 1);
* ``lookup``: ``LLMPipeline(prompt_lookup=True)``, batch 1, with ``num_assistant_tokens`` and
  ``max_ngram_size`` from the spec (prompt-lookup speculation);
* ``cb``: ``ContinuousBatchingPipeline``, a batch of ``spec["batch"]`` requests per ``generate`` call
  (paged KV cache; no prefix caching, so no prompt reuses another call's prefill).

``spec["properties"]`` go to the CPU plugin as they are (the thread count, and for the most faithful row the
f32 inference precision, f32 KV cache and no dynamic quantization of activations): the report records them.
Prompts go in as token ids (``TokenizedInputs`` / one ``ov.Tensor`` per request); the prompt ids reported
back are read from those tensors, as the pipeline received them.

``score``: the exported stateful model compiled with the same properties, the logits of every position of a
sequence from one inference (state reset per sequence).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.peers.fidelity import score_logits
from benchmarks.peers.protocol import answer, child_main, timed_workloads


def _config(ovg: Any, max_new: int, spec: dict[str, Any]) -> Any:
    config = ovg.GenerationConfig()
    config.max_new_tokens = max_new
    config.do_sample = False
    config.eos_token_id = spec["eos"][0]
    if spec["mode"] == "lookup":
        config.num_assistant_tokens = spec["assistant_tokens"]
        config.max_ngram_size = spec["ngram_size"]
    return config


def generate(spec: dict[str, Any]) -> dict[str, Any]:
    """Greedy answers of every workload in ``spec["mode"]``."""
    import numpy as np
    import openvino as ov
    import openvino_genai as ovg

    props = dict(spec["properties"])
    start = time.perf_counter()
    if spec["mode"] == "cb":
        scheduler = ovg.SchedulerConfig()
        scheduler.cache_size = 1  # GB of KV blocks: every batch of the benchmark fits
        scheduler.enable_prefix_caching = False
        pipe = ovg.ContinuousBatchingPipeline(spec["model"], scheduler, "CPU", props)
    else:
        if spec["batch"] != 1:
            raise SystemExit(f"spec.batch: {spec['batch']}; mode {spec['mode']!r} runs batch 1 (cb runs a batch)")
        pipe = ovg.LLMPipeline(spec["model"], "CPU", prompt_lookup=spec["mode"] == "lookup", **props)
    tokenizer = pipe.get_tokenizer()
    load_seconds = time.perf_counter() - start
    eos = spec["eos"]

    def run(batch: list[list[int]], max_new: int) -> tuple[list[list[int]], list[list[int]]]:
        config = _config(ovg, max_new, spec)
        tensors = [ov.Tensor(np.array([ids], dtype=np.int64)) for ids in batch]
        seen = [tensor.data[0].tolist() for tensor in tensors]
        if spec["mode"] == "cb":
            results = pipe.generate(tensors, [config] * len(batch))
            return [answer(r.m_generation_ids[0], eos) for r in results], seen
        mask = ov.Tensor(np.ones((1, len(batch[0])), dtype=np.int64))
        out = pipe.generate(ovg.TokenizedInputs(tensors[0], mask), config)
        return [answer(out.tokens[0], eos)], seen

    workloads = timed_workloads(spec, run, lambda ids: tokenizer.decode(ids))
    return {
        "workloads": workloads,
        "load_seconds": load_seconds,
        "versions": {"openvino_genai": ovg.__version__, "openvino": ov.__version__},
    }


def score(spec: dict[str, Any]) -> dict[str, Any]:
    """Forced rows and held-out NLL from the stateful model's logits of whole sequences."""
    import numpy as np
    import openvino as ov

    compiled = ov.Core().compile_model(str(Path(spec["model"]) / "openvino_model.xml"), "CPU", dict(spec["properties"]))
    request = compiled.create_infer_request()

    def logits_of(tokens: list[int]) -> Any:
        request.reset_state()
        n = len(tokens)
        feeds = {
            "input_ids": np.array([tokens], dtype=np.int64),
            "attention_mask": np.ones((1, n), dtype=np.int64),
            "position_ids": np.arange(n, dtype=np.int64)[None],
            "beam_idx": np.zeros(1, dtype=np.int32),
        }
        return np.array(request.infer(feeds)["logits"], dtype=np.float32)[0]

    return score_logits(spec, logits_of)


if __name__ == "__main__":
    sys.exit(child_main({"generate": generate, "score": score}))

"""ONNX Runtime GenAI as a peer: its model builder's ONNX model decoded greedily by its ``Generator`` API.

Runs in ``.work/peers/ortgenai`` (``install.sh``): ``<venv>/bin/python -m benchmarks.peers.ortgenai --spec S
--result R`` (``protocol``). The prompts arrive as token ids (chat template applied once, by specdec's
``encode_text``) and go in as ids, ``append_tokens`` of one left-padded batch; the prompt ids reported back are
what the generator holds (``get_sequence``), padding stripped.

Padding: the generator takes a token equal to the config's ``pad_token_id`` for padding wherever it stands.
The builder copies SmolLM2's ``pad_token_id`` = 2, which is ``<|im_end|>``, a token of every chat prompt, so
``convert`` sets it to 0 (``<|endoftext|>``, in no prompt) and this runner refuses a prompt holding the pad.

``score``: the logits of every position of a sequence come from one ``append_tokens`` (the prefill path).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.peers.fidelity import score_logits
from benchmarks.peers.protocol import answer, child_main, timed_workloads


def _open(spec: dict[str, Any]) -> tuple[Any, Any, int]:
    """The model on ``spec["threads"]`` intra-op threads, its tokenizer and its pad token id."""
    import onnxruntime_genai as og

    config = og.Config(spec["model"])
    config.clear_providers()  # the CPU provider
    options = {"intra_op_num_threads": spec["threads"], "inter_op_num_threads": 1}
    config.overlay(json.dumps({"model": {"decoder": {"session_options": options}}}))
    model = og.Model(config)
    genai = json.loads((Path(spec["model"]) / "genai_config.json").read_text(encoding="utf-8"))
    return model, og.Tokenizer(model), int(genai["model"]["pad_token_id"])


def generate(spec: dict[str, Any]) -> dict[str, Any]:
    """Greedy answers of every workload, ``spec["batch"]`` prompts per ``Generator``."""
    import numpy as np
    import onnxruntime_genai as og

    start = time.perf_counter()
    model, tokenizer, pad = _open(spec)
    load_seconds = time.perf_counter() - start
    for name, prompts in spec["prompts"].items():
        if any(pad in ids for ids in prompts):
            raise SystemExit(f"spec.prompts.{name}: a prompt holds the pad token {pad}, which the generator would mask")
    eos = spec["eos"]

    def run(batch: list[list[int]], max_new: int) -> tuple[list[list[int]], list[list[int]]]:
        width = max(map(len, batch))
        params = og.GeneratorParams(model)
        params.set_search_options(do_sample=False, max_length=width + max_new, batch_size=len(batch))
        generator = og.Generator(model, params)
        generator.append_tokens(np.array([[pad] * (width - len(ids)) + ids for ids in batch], dtype=np.int32))
        while not generator.is_done():
            generator.generate_next_token()
        rows = [list(map(int, generator.get_sequence(i))) for i in range(len(batch))]
        return [answer(r[width:], eos) for r in rows], [[t for t in r[:width] if t != pad] for r in rows]

    workloads = timed_workloads(spec, run, lambda ids: tokenizer.decode(np.array(ids, dtype=np.int32)))
    return {"workloads": workloads, "load_seconds": load_seconds, "versions": {"onnxruntime_genai": og.__version__}}


def score(spec: dict[str, Any]) -> dict[str, Any]:
    """Forced rows and held-out NLL from the logits of whole sequences."""
    import numpy as np
    import onnxruntime_genai as og

    model, _, _ = _open(spec)

    def logits_of(tokens: list[int]) -> Any:
        params = og.GeneratorParams(model)
        params.set_search_options(do_sample=False, max_length=len(tokens) + 1, batch_size=1)
        generator = og.Generator(model, params)
        generator.append_tokens(np.array([tokens], dtype=np.int32))
        return np.asarray(generator.get_output("logits"), dtype=np.float32)[0]

    return score_logits(spec, logits_of)


if __name__ == "__main__":
    sys.exit(child_main({"generate": generate, "score": score}))

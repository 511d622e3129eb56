"""Next-token agreement with the reference along its answers (teacher forcing) and held-out perplexity of a
specdec export (the peers' children score the same way, ``benchmarks.peers.fidelity``), and the reference's
margins where a model parts from it."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.peers.fidelity import score_logits
from specdec.runtime.config import EngineConfig


def miss_margins(model: dict[str, Any], reference: dict[str, Any], answers: Sequence[Sequence[int]]) -> dict[str, Any]:
    """The reference's own margins at the positions where ``model`` (a ``forced_rows`` result) chooses another token
    than the reference answer, beside its margins everywhere (``reference``: ``forced_rows`` of the reference's graph).

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
    """A specdec export's ``score`` (``benchmarks.peers.protocol``): its target graph's choices along the
    reference's answers and its NLL on the held-out documents, every position's logits from one step."""
    import numpy as np

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

    def logits_of(tokens: list[int]) -> Any:
        step = pack([SeqWork(0, 0, tokens, logits=list(range(len(tokens))))])
        return np.asarray(engine.target.step(step, engine.storage))

    return score_logits(spec, logits_of)

"""Next-token agreement with the reference along its answers (teacher forcing), and the reference's margins
where a model parts from it."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any


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
            max_batch=1,
            max_len=spec["max_len"],
            num_draft_tokens=0,
            drafter="none",
            threads=spec["threads"],
            torch_threads=1,
        )

        def top_rows(tokens: list[int], first: int) -> list[tuple[int, float]]:
            rows = list(range(first, len(tokens)))
            return top2(engine.target.step(pack([SeqWork(0, 0, tokens, logits=rows)]), engine.storage))

    return {"workloads": {name: _forced(pairs, top_rows) for name, pairs in spec["pairs"].items()}}

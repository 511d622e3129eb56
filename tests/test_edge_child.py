"""The edge benchmark's specdec child (``benchmarks/edge_cpu/children.run_specdec``) against the real engine API.

Why: the child wraps ``Engine.context`` to time the first token; when the engine's API moved on, every specdec
row of a full benchmark run failed after the peers' half hour. A tiny export runs the child in seconds.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.edge_cpu.children import run_specdec


@pytest.mark.parametrize(("method", "drafter"), [("ar", None), ("ems", "hybrid")])
def test_the_specdec_child_decodes_both_workloads_and_times_a_first_token(
    tiny_export: Path, method: str, drafter: str | None
) -> None:
    prompts = {"chat": [[5, 6, 7], [8, 9, 10, 11]], "extractive": [[12, 13, 14, 15, 12, 13]]}
    spec = {
        "export": str(tiny_export),
        "method": method,
        "drafter": drafter,
        "batch": 2,
        "k": 3,
        "max_len": 64,
        "threads": 1,
        "prompts": prompts,
        "max_tokens": 6,
        "eos": [],
    }
    result = run_specdec(spec)
    for name, ids in prompts.items():
        workload = result["workloads"][name]
        assert workload["prompt_ids"] == ids and len(workload["ids"]) == len(ids)
        assert all(len(answer) <= 6 for answer in workload["ids"])  # EOS may end one early
        assert workload["tokens"] == sum(map(len, workload["ids"]))
        assert all(0 < t <= workload["seconds"] for t in workload["ttft"])
    assert (result["draft_length"] is not None) == (method == "ems")

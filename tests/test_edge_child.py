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


def test_every_precision_has_its_export_flags_and_speculates_only_where_exact() -> None:
    """int4-f32's one-row and many-row kernels differ, so it runs ar alone; int8 ar and prompt lookup."""
    from benchmarks.edge_cpu import EXPORT_FLAGS, PRECISIONS
    from benchmarks.edge_cpu.contestants import contestants

    assert set(EXPORT_FLAGS) == set(PRECISIONS)
    rows = [c for c in contestants([1, 8]) if c.kind == "specdec"]
    methods = {p: {(c.method, c.drafter) for c in rows if c.precision == p and c.kv_cache is None} for p in PRECISIONS}
    assert methods["int4-f32"] == {("ar", None)}
    assert methods["int8"] == {("ar", None), ("ems", "ngram")}
    assert methods["int4"] == {("ar", None), ("ems", "ngram"), ("ems", "draft"), ("ems", "hybrid")}
    assert {c.batch for c in rows if c.precision == "int4-f32"} == {1, 8}

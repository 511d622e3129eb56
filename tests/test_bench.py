"""Smoke test of the EMS-SD vs vanilla benchmark on a tiny random LLaMA (token-id prompts)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from specdec.bench.ems import engine_factory, run_benchmark
from specdec.bench.harness import METHODS, BenchConfig, required_max_len
from specdec.bench.report import markdown_report, write_results
from specdec.bench.workloads import build_workload
from specdec.models.loading import tiny_random

# Repetitive token-id prompts: the n-gram drafter finds hits in them (and in the loops a
# random model falls into), so vanilla pads and ems does not.
PROMPTS = [
    [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7, 10, 11],
    [20, 21, 22, 20, 21, 22, 23, 24, 20, 21],
    [40, 41, 42, 43, 44, 45, 40, 41, 42, 43],
]


@pytest.fixture(scope="module")
def results() -> dict:
    target = tiny_random(seed=3, vocab_size=64)
    config = BenchConfig(batch_sizes=(1, 3), max_tokens=12, num_draft_tokens=4, repeats=2)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny steps: two threads only add synchronisation, badly so on a busy CPU
    try:
        return run_benchmark(engine_factory(target, config), PROMPTS, config, chat=False, progress=False)
    finally:
        torch.set_num_threads(threads)


def test_results_have_one_record_per_batch_size(results: dict) -> None:
    assert list(results) == ["1", "3"]
    for batch, record in results.items():
        assert record["batch_size"] == int(batch)
        for method in METHODS:
            assert isinstance(record[method], float) and record[method] > 0
            assert record["generated_tokens"][method] == 12 * int(batch)
            assert len(record["wall_seconds"][method]) == 2
        assert set(record["speedup_over_ar"]) == {"vanilla", "ems"}
        assert record["ems_over_vanilla"] > 0
        assert record["padded_fraction"]["ems"] == 0.0


def test_speculative_outputs_are_identical_to_ar(results: dict) -> None:
    for record in results.values():
        assert record["identical_to_ar"] is True
        assert record["identical_to_ar_by_method"] == {"vanilla": True, "ems": True}


def test_ems_never_processes_more_rows_than_vanilla(results: dict) -> None:
    for record in results.values():
        rows = record["target_rows"]
        assert rows["ems"] <= rows["vanilla"]
        assert record["mean_accepted_length"]["ems"] == record["mean_accepted_length"]["vanilla"]
    assert results["3"]["padded_fraction"]["vanilla"] > 0  # the batch of 3 really exercised padding


def test_written_files(results: dict, tmp_path: Path) -> None:
    meta = {
        "date": "2026-01-01 00:00 UTC",
        "command": "specdec bench --quick",
        "target": "tiny",
        "workload": "ids",
        "machine": {
            "processor": "cpu",
            "cpu_count": 2,
            "platform": "linux",
            "python": "3.11",
            "torch": "2.13",
            "torch_threads": 1,
        },
        "config": {"max_tokens": 12, "num_draft_tokens": 4, "ngram": 2, "min_ngram": 2, "repeats": 2},
        "notes": ["a note"],
    }
    paths = write_results(results, meta, tmp_path)
    assert [p.name for p in paths] == ["ems_vs_vanilla.json", "ems_vs_vanilla.md", "ems_vs_vanilla.png"]
    loaded = json.loads(paths[0].read_text())
    assert list(loaded) == ["1", "3"]  # top-level keys are batch sizes only
    assert {"ar", "vanilla", "ems", "identical_to_ar"} <= set(loaded["3"])
    assert paths[2].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = markdown_report(results, meta)
    assert "specdec bench --quick" in text and "| 3 |" in text and "a note" in text


def test_workload_is_deterministic_and_sized() -> None:
    prompts = build_workload(20)
    assert prompts == build_workload(20)
    assert len(prompts) == 20 and len(set(prompts)) == 20
    assert all(300 < len(p) < 1500 for p in prompts)
    assert prompts[0].startswith("Summarize") and prompts[1].startswith("List")


def test_max_len_leaves_room_for_vanillas_holes() -> None:
    config = BenchConfig(max_tokens=128, num_draft_tokens=7)
    assert required_max_len([100, 300], config) >= 300 + 128 * 8

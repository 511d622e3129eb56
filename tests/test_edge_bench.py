"""The edge benchmark's next-token agreement: its counting and its table (logic only, fast tier)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest


@pytest.fixture(scope="module")
def edge_cpu() -> ModuleType:
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "edge_cpu.py"
    spec = importlib.util.spec_from_file_location("edge_cpu_under_test", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_forced_judges_each_position_on_the_references_context(edge_cpu: ModuleType) -> None:
    # a "model" that predicts token + 1, except after token 7, where it predicts 0
    def argmax_rows(tokens: list[int], first: int) -> list[int]:
        return [0 if t == 7 else t + 1 for t in tokens[first:]]

    seen: list[tuple[list[int], int]] = []

    def recording(tokens: list[int], first: int) -> list[int]:
        seen.append((list(tokens), first))
        return argmax_rows(tokens, first)

    pairs = [([1, 2, 3], [4, 5, 6, 7, 8]),  # 4 5 6 7 follow; after 7 the model says 0, not 8: 4 of 5
             ([5], [6, 9]),                  # 6 agrees; after 6 it says 7, not 9: a miss that does not cascade
             ([3], [])]                      # an empty answer has no position
    assert edge_cpu._forced(pairs, recording) == {"positions": 7, "agree": 5}
    # the model reads the prompt and the reference answer but its last token, and is asked from the prompt's end
    assert seen == [([1, 2, 3, 4, 5, 6, 7], 2), ([5, 6], 0)]


def test_forced_table_reports_rates_and_errors(edge_cpu: ModuleType) -> None:
    forced = {"specdec int4": {"chat": {"positions": 200, "agree": 196, "rate": 0.98},
                               "extractive": {"positions": 100, "agree": 97, "rate": 0.97}},
              "llama.cpp Q4_1": {"error": "exit 1: no llama"}}
    text = "\n".join(edge_cpu.forced_table(forced))
    assert "| specdec int4 | 98.0% | 97.0% | 200 / 100 |" in text
    assert "| llama.cpp Q4_1 | exit 1: no llama |" in text
    assert edge_cpu.forced_table({}) == []

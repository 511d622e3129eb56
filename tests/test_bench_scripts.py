"""Pure helpers of the benchmark scripts (logic only, fast tier): the edge benchmark's next-token agreement,
the step profile's own-time accounting of control-flow nodes."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest


def _script(name: str) -> ModuleType:
    path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"{name}_under_test", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def edge_cpu() -> ModuleType:
    return _script("edge_cpu")


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


def _event(op: str, ts: int, dur: int) -> dict:
    return {"name": f"{op}_{ts}_kernel_time", "ts": ts, "dur": dur, "args": {"op_name": op}}


def test_a_control_flow_node_keeps_only_its_own_time() -> None:
    step_profile = _script("step_profile")
    events = [_event("MatMulNBits", 0, 50),
              _event("If", 60, 40),                 # its branch: the two nodes inside its window
              _event("GroupQueryAttention", 62, 30),
              _event("Gather", 93, 5),
              _event("MatMulNBits", 101, 20)]       # after the If: not its branch
    own = step_profile.own_durations(events)
    assert own == [50.0, 5.0, 30.0, 5.0, 20.0]
    assert sum(own) == 110  # no node counted twice: the wall of the nodes run, 50 + 40 + 20

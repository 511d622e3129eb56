"""The reliability suite's map: every test R1-R20 of ``docs/reliability.md`` is run by a test marked
``@pytest.mark.reliability("Rn")``, by a benchmark whose committed result shows it, or is named here as out of reach
with the reason. Why a test of the map: the R tests live beside the features they exercise (drain in
test_lifecycle.py, client kills in test_serving.py, ...), and a renamed or deleted test would otherwise drop an R
from the suite without anyone noticing."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ALL = {f"R{i}" for i in range(1, 21)}
#: R tests a benchmark runs (too long for a test), with the committed result that shows the outcome
BENCHMARKED = {"R17": ("benchmarks/reliability.py", "benchmarks/results/reliability.md")}
#: R tests out of reach here, and why
OUT_OF_REACH = {"R20": "a 2-8 h soak: CI has 30 minutes; R17's bounded soak (1,000 requests) is what runs"}


def marked() -> dict[str, list[str]]:
    """R id -> the tests that carry ``pytest.mark.reliability(id, ...)``, read from the test sources."""
    found: dict[str, list[str]] = {}
    for path in sorted((ROOT / "tests").glob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.FunctionDef):
                continue
            for deco in node.decorator_list:
                if (
                    isinstance(deco, ast.Call)
                    and isinstance(deco.func, ast.Attribute)
                    and deco.func.attr == "reliability"
                ):
                    # pytest collects test_* functions only: a mark on a helper would cover an R vacuously
                    assert node.name.startswith("test_"), f"{path.name}::{node.name} is not a test: mark the test"
                    for arg in deco.args:
                        assert isinstance(arg, ast.Constant) and arg.value in ALL, (path.name, node.name, arg)
                        found.setdefault(arg.value, []).append(f"{path.name}::{node.name}")
    return found


def test_every_reliability_test_is_run_benchmarked_or_named_out_of_reach() -> None:
    tests = marked()
    covered = set(tests) | set(BENCHMARKED) | set(OUT_OF_REACH)
    assert covered == ALL, f"no test, benchmark or reason for {sorted(ALL - covered)}"
    assert not set(tests) & set(OUT_OF_REACH), "an R named out of reach has a test: take it off the list"
    for script, result in BENCHMARKED.values():
        assert (ROOT / script).is_file() and (ROOT / result).is_file(), (script, result)

"""The benchmarks as a maintained area: importable modules (no path tricks), files of one concern, and every
committed result named with the command that makes it again (fast tier, reads files only)."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
MAX_LINES = 600


def test_benchmark_files_stay_readable() -> None:
    long = {
        str(p.relative_to(ROOT)): n for p in BENCH.rglob("*.py") if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"split these by concern: {long}"


def test_no_benchmark_edits_the_import_path() -> None:
    tricks = [
        str(p.relative_to(ROOT)) for p in BENCH.rglob("*.py") if re.search(r"sys\.path\.(insert|append)", p.read_text())
    ]
    assert not tricks, f"import benchmarks.<name> instead of editing sys.path: {tricks}"


def _index() -> dict[str, str]:
    rows = re.findall(
        r"^\| \[`(results/[^`]+\.md)`\]\([^)]*\)[^|]* \| (.+) \|$", (BENCH / "README.md").read_text(), re.M
    )
    return dict(rows)


def test_every_result_is_listed_with_the_command_that_makes_it() -> None:
    index = _index()
    results = {str(p.relative_to(BENCH)) for p in (BENCH / "results").rglob("*.md")}
    assert results - set(index) == set(), "results missing from benchmarks/README.md"
    assert set(index) - results == set(), "benchmarks/README.md lists results that do not exist"


@pytest.mark.parametrize("result", sorted(_index()))
def test_a_listed_command_runs_a_module_that_exists_or_names_the_commit(result: str) -> None:
    how = _index()[result]
    module = re.match(r"`python -m ([\w.]+)", how)
    if module:
        assert importlib.util.find_spec(module.group(1)) is not None, f"{result}: no module {module.group(1)}"
    else:
        assert how.startswith("`specdec bench") or re.search(r"git show [0-9a-f]{7,}:", how), how

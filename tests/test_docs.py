"""The documentation's guards: a README of one or two screens, links and paths that resolve, commands that parse,
quick starts that run, and no dated measurement outside ``benchmarks/results/``.

Why tests: the README had grown into a lab notebook (889 lines, over 200 speed figures, rewritten in a third of all
commits), docstrings carried dated timings, and pages pointed to design notes outside the repository. Each guard
below fails on the regression it names, and the pattern-based ones are checked against sample strings first, so a
pattern that matches nothing cannot pass vacuously.
"""

from __future__ import annotations

import argparse
import ast
import io
import os
import re
import shlex
import signal
import subprocess
import sys
import time
import tokenize
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
BENCH_README = ROOT / "benchmarks" / "README.md"
PAGES = [README, *DOCS, BENCH_README]

#: The README's size limit, in bytes. Why 8 KiB: an entry point a reader takes in at once, about two screens of
#: prose plus the code blocks of four quick starts; the READMEs of comparable projects are that size (gpt-fast's
#: ~7 kB, vLLM's ~9 kB), and ours at the time of the limit is ~6 kB, which leaves room for a results row or two but
#: not for a section of measurements (those belong in benchmarks/results/ and docs/).
README_MAX_BYTES = 8 * 1024

# -- dated figures --------------------------------------------------------------------------------------------------
#: a calendar date or a clock time (two-digit hours, not a slice like ``x[0:32]`` nor a port like ``host:8001``)
DATED = re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b|(?<![\w\[:.])(?:[01]\d|2[0-3]):[0-5]\d(?::[0-5]\d)?(?![\w\]:])")
#: a timing or speed figure, and a number a sentence says was measured or took
FIGURES = (
    re.compile(r"\d(?:[\d,.]*\d)?\s?(?:ms|µs|us|tok/s|tokens/s|req/s|GOP/s|GB/s)\b"),
    re.compile(r"\b(?i:measured|took)\b[^.;:()]{0,40}?\d+(?:[.,]\d+)*"),
)
#: where a figure must say it comes from
SOURCE = "benchmarks/results/"


def docstrings_and_comments(source: str) -> Iterator[tuple[int, str]]:
    """(first line, text) of every docstring and every block of consecutive comment lines of a Python source."""
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc is not None:
                yield node.body[0].lineno, doc
    block: list[str] = []
    start = last = 0
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type != tokenize.COMMENT:
            continue
        if block and tok.start[0] != last + 1:
            yield start, "\n".join(block)
            block = []
        if not block:
            start = tok.start[0]
        block.append(tok.string)
        last = tok.start[0]
    if block:
        yield start, "\n".join(block)


def dated_figures(text: str) -> list[str]:
    """What is wrong with one docstring or comment block: a date or clock time anywhere, or a timing / measured
    figure in a text that names no file under ``benchmarks/results/``."""
    problems = [f"dated: {m.group(0)!r}" for m in DATED.finditer(text)]
    if SOURCE not in text:
        problems += [f"figure without a source: {m.group(0)!r}" for figure in FIGURES for m in figure.finditer(text)]
    return problems


def test_the_dated_figure_check_catches_what_it_must_and_nothing_else() -> None:
    """Negative controls: the patterns on sample strings, and the extraction on a sample module."""
    assert dated_figures("Measured 12.4 ms a step on 2026-12-05, 13:29 UTC.") == [
        "dated: '2026-12-05'",
        "dated: '13:29'",
        "figure without a source: '12.4 ms'",
        "figure without a source: 'Measured 12.4'",
    ]
    assert dated_figures("(edge_cpu.md of 04:16)") == ["dated: '04:16'"]
    assert dated_figures("a step took 2.3 s on this CPU") == ["figure without a source: 'took 2.3'"]
    assert dated_figures("the int4 graph ran 75.9 tok/s") == ["figure without a source: '75.9 tok/s'"]
    # a figure that names its results file is a pointer, not a log; ports, slices and plain numbers are no figures
    assert dated_figures("costs 2.3 ms of a step (benchmarks/results/step_profile.md)") == []
    assert dated_figures("listens on 127.0.0.1:8001; ids[0:32]; 64 KiB; at most 16 stop strings; a 2x speed-up") == []
    assert dated_figures("the costs measured there win over the defaults") == []
    module = (
        '"""Module: measured 3 ms."""\n\n\ndef f():\n    """On 2026-01-02."""\n    # one\n    # two 10:15\n\n'
        "    x = 1  # alone\n"
    )
    found = dict(docstrings_and_comments(module))
    assert found == {1: "Module: measured 3 ms.", 5: "On 2026-01-02.", 6: "# one\n# two 10:15", 9: "# alone"}


def _python_files() -> list[Path]:
    return sorted((ROOT / "specdec").rglob("*.py"))


def test_no_docstring_or_comment_under_specdec_carries_a_dated_or_unsourced_figure() -> None:
    """Docstrings say why, not when and how fast: a measurement lives in benchmarks/results/ and the code points
    there (``benchmarks/results/runtime_choices.md``, ``quantization_choices.md``)."""
    seen, problems = 0, []
    for path in _python_files():
        for line, text in docstrings_and_comments(path.read_text()):
            seen += 1
            problems += [f"{path.relative_to(ROOT)}:{line}: {p}" for p in dated_figures(text)]
    assert seen > 1000, f"only {seen} docstrings and comment blocks found: the extraction is broken"
    assert not problems, "\n".join(problems)


def test_the_readme_and_docs_carry_no_dates() -> None:
    """A page quotes a measurement with a pointer to its results file, which holds the date; a dated figure in a
    page is a log entry that goes stale."""
    problems = [
        f"{page.relative_to(ROOT)}:{n}: {m.group(0)!r}"
        for page in PAGES
        for n, line in enumerate(page.read_text().splitlines(), 1)
        for m in DATED.finditer(line)
    ]
    assert not problems, "\n".join(problems)


# -- the README as an entry point -------------------------------------------------------------------------------------
def test_the_readme_fits_two_screens() -> None:
    size = len(README.read_bytes())
    assert size <= README_MAX_BYTES, f"README.md is {size} bytes, over {README_MAX_BYTES}: move details to docs/"


def test_the_readme_has_the_two_commands_the_quick_starts_and_the_map() -> None:
    text = README.read_text()
    for needed in (
        "bash scripts/main.sh",
        "bash scripts/test.sh",
        "CI runs `bash scripts/test.sh` through `.ci/run`",
        "specdec generate",
        "specdec-export",
        "Engine.from_export(",
        "engine.request(",
        "engine.generate(",
        "specdec serve",
        "specdec client",
        "tritonclient",
        "curl http://127.0.0.1:8003/v1/chat/completions",
        "from openai import OpenAI",
    ):
        assert needed in text, f"README.md lacks {needed!r}"
    links = set(_links(README))
    assert any(link.startswith("benchmarks/results/") for link in links), "no result linked"
    unlinked = {f"docs/{page.name}" for page in DOCS} - links
    assert not unlinked, f"README.md's map of docs/ lacks {sorted(unlinked)}"
    assert (ROOT / ".ci" / "run").read_text().count("scripts/test.sh") == 1, "CI no longer runs scripts/test.sh"


# -- links, paths, pointers -------------------------------------------------------------------------------------------
def _links(page: Path) -> list[str]:
    """The targets of the page's markdown links, outside code blocks."""
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return re.findall(r"\[[^\]]*\]\(([^)\s]+)\)", text)


def _anchors(page: Path) -> set[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation dropped, spaces as hyphens."""
    headings = re.findall(r"^#+\s+(.+)$", re.sub(r"```.*?```", "", page.read_text(), flags=re.S), re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def test_every_relative_link_points_to_an_existing_file_and_heading() -> None:
    broken = []
    for page in PAGES:
        for link in _links(page):
            if re.match(r"[a-z]+:", link):
                continue
            target, _, anchor = link.partition("#")
            path = (page.parent / target).resolve() if target else page
            if not path.exists():
                broken.append(f"{page.relative_to(ROOT)}: {link}")
            elif anchor and path.suffix == ".md" and anchor not in _anchors(path):
                broken.append(f"{page.relative_to(ROOT)}: {link} (no such heading)")
    assert not broken, "\n".join(broken)


def test_the_link_check_sees_links_and_headings() -> None:
    assert _links(README), "no link found in README.md: the pattern is broken"
    assert "the-ragged-step" in _anchors(ROOT / "docs" / "algorithms.md")


#: a repository file or folder named in backquotes (``docs/x.md``, ``tests/test_x.py::test_y``, ``specdec/runtime/``):
#: a name with an extension or a trailing slash (``specdec/entry-models`` is an annotation); placeholders are skipped
REPO_PATH = re.compile(r"`((?:specdec|tests|benchmarks|docs|scripts)/[\w./-]*(?:\.\w+|/))(?:::\w+)?`")


def test_every_repository_path_named_in_the_readme_and_docs_exists() -> None:
    missing = [
        f"{page.relative_to(ROOT)}: {name}"
        for page in PAGES
        for name in REPO_PATH.findall(page.read_text())
        if "/.cache/" not in name and not (ROOT / name).exists()
    ]
    assert not missing, "\n".join(missing)
    assert REPO_PATH.findall("see `tests/test_fuse.py::test_x` and `benchmarks/results/<stem>.md`") == [
        "tests/test_fuse.py"
    ]


def test_nothing_points_outside_the_repository() -> None:
    """Users of the package have the repository only: design notes it needs are in docs/."""
    files = [*PAGES, ROOT / "pyproject.toml", *_python_files(), *sorted((ROOT / "tests").glob("*.py"))]
    files += sorted((ROOT / "benchmarks").rglob("*.py")) + sorted((ROOT / "scripts").glob("*.sh"))
    outside = re.compile(r"\.\./shared|shared/docs")
    hits = [str(f.relative_to(ROOT)) for f in files if f != Path(__file__) and outside.search(f.read_text())]
    assert not hits, hits


# -- commands and snippets --------------------------------------------------------------------------------------------
def _blocks(page: Path, language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", page.read_text(), re.S)


def _commands(page: Path) -> list[str]:
    """The ``specdec`` and ``specdec-export`` command lines of a page's bash blocks, continuations joined."""
    found = []
    for block in _blocks(page, "bash"):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.strip()
            if re.match(r"specdec(-export)? ", line) and not re.search(r"\[|\.\.\.|<", line):
                found.append(line)
    return found


class _Parsed(Exception):
    """Raised instead of running a command whose arguments parsed."""


@pytest.mark.parametrize("page", [README, *DOCS], ids=lambda p: p.name)
def test_every_command_in_the_docs_parses(page: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each command's options exist and take the values shown: its parser parses it, and nothing runs."""
    from specdec import cli
    from specdec.export import cli as export_cli

    parse = argparse.ArgumentParser.parse_args

    def parse_only(self: argparse.ArgumentParser, args: object = None, namespace: object = None) -> object:
        raise _Parsed(parse(self, args, namespace))  # type: ignore[arg-type]

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_only)
    for line in _commands(page):
        argv = shlex.split(line, comments=True)
        main = export_cli.main if argv[0] == "specdec-export" else cli.main
        with pytest.raises(_Parsed):
            try:
                main(argv[1:])
            except SystemExit as exc:  # argparse's refusal
                raise AssertionError(f"{page.name}: {line!r} does not parse") from exc


def test_the_readme_has_commands_to_parse() -> None:
    assert len(_commands(README)) >= 5, _commands(README)


def _tiny_export(tiny_dir: Path, out: Path) -> Path:
    """The tiny export the Triton model tests serve (a random LLaMA with a small tokenizer drafting for itself)."""
    from specdec.export.cli import main as export_main

    args = ["--target", str(tiny_dir), "--draft", str(tiny_dir), "--out", str(out), "--max-batch", "4"]
    assert export_main([*args, "--max-len", "128"]) == 0
    return out


def _run_python(code: str, cwd: Path) -> str:
    """``code`` in a fresh interpreter with this checkout first on the path; its output, or a failure showing it."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, f"{code}\n--- stderr:\n{run.stderr}"
    return run.stdout


def _local_snippets() -> list[tuple[str, str]]:
    return [
        (page.name, code)
        for page in [README, *DOCS]
        for code in _blocks(page, "python")
        if 'Engine.from_export("deploy"' in code
    ]


def test_the_python_quick_starts_run_on_a_tiny_export(
    tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The README's (and docs/usage.md's) Python API snippet, as written, over an export at ``deploy``: run in this
    process (the fast tier; the export is the one ``test_triton_models`` makes, so a session makes it once)."""
    snippets = _local_snippets()
    assert {name for name, _ in snippets} >= {"README.md", "usage.md"}, snippets
    _tiny_export(tiny_dir, tmp_path / "deploy")
    monkeypatch.chdir(tmp_path)
    for name, code in snippets:
        capsys.readouterr()
        exec(compile(code, f"<{name}>", "exec"), {"__name__": "__snippet__"})
        assert capsys.readouterr().out.strip(), f"{name}: the snippet printed nothing"


@pytest.mark.server
def test_the_served_quick_starts_run_against_a_real_server(tiny_dir: Path, tmp_path: Path) -> None:
    """The README's gRPC and OpenAI quick starts and the Python clients of docs/ (serving.md, openai.md), as written,
    against ``specdec serve`` on a tiny export: ports 8001 and 8003 become free ones, and the OpenAI model name
    ``smollm2-135m`` is the one the snippets send."""
    from servers import free_ports, needs_tritonserver

    needs_tritonserver()
    pytest.importorskip("openai")
    export = _tiny_export(tiny_dir, tmp_path / "deploy")
    grpc, http, metrics, api = free_ports(4)
    serve = [sys.executable, "-m", "specdec.cli", "serve", str(export), "--grpc-port", str(grpc), "--http-port"]
    serve += [str(http), "--metrics-port", str(metrics), "--openai-port", str(api), "--openai-model-name"]
    serve += ["smollm2-135m", "--log-file", str(tmp_path / "server.log")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen(serve, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while (line := proc.stdout.readline()) and not line.startswith("(Ctrl-C"):  # type: ignore[union-attr]
            assert time.monotonic() < deadline, "specdec serve did not get ready"
        assert proc.poll() is None, proc.stderr.read()  # type: ignore[union-attr]

        def ported(text: str) -> str:
            return text.replace("127.0.0.1:8001", f"127.0.0.1:{grpc}").replace("127.0.0.1:8003", f"127.0.0.1:{api}")

        snippets = [
            (page.name, code)
            for page in [README, *DOCS]
            for code in _blocks(page, "python")
            if "127.0.0.1:8001" in code or "127.0.0.1:8003" in code
        ]
        assert {name for name, _ in snippets} >= {"README.md", "serving.md", "openai.md"}, snippets
        for name, code in snippets:  # the tiny random model may answer in whitespace: printed at all is enough
            assert _run_python(ported(code), tmp_path), f"{name}: the snippet printed nothing"
        curls = [block for block in _blocks(README, "bash") if block.startswith("curl ")]
        clients = [line for line in _commands(README) if line.startswith("specdec client")]
        assert curls and clients
        for command in [*curls, *clients]:
            run = subprocess.run(
                ["bash", "-c", ported(command)], env=env, capture_output=True, text=True, timeout=300, cwd=ROOT
            )
            assert run.returncode == 0 and run.stdout, f"{command}\n{run.stdout}\n{run.stderr}"
            assert '"error"' not in run.stdout and ("chat.completion" in run.stdout) == command.startswith("curl"), (
                run.stdout
            )
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
        assert proc.wait(120) == 0, proc.stderr.read()  # type: ignore[union-attr]

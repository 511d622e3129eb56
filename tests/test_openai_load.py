"""The OpenAI load benchmark's own logic (``benchmarks.openai_load``), fast tier: the order of the runs, the aiperf
command and prompts file, reading aiperf's JSON export (a real one, trimmed to the fields read:
``tests/data/aiperf_profile_export.json``), the main job's export command read from ``scripts/main.sh``, the
folded rows, the table and the plot. No network, no load generator, no server."""

from __future__ import annotations

import itertools
import json
import shlex
import time
from collections import Counter
from pathlib import Path

import pytest

from benchmarks.openai_load import aiperf as loadgen
from benchmarks.openai_load.__main__ import parse_args, plan, requests_of
from benchmarks.openai_load.engines import ENGINES, export_command, llama_spec, main_export_args
from benchmarks.openai_load.report import fold, markdown, notes, plot, ratio_to_baseline, table
from benchmarks.peers.llama_server import server_command

ROOT = Path(__file__).resolve().parents[1]
EXPORT = json.loads((ROOT / "tests" / "data" / "aiperf_profile_export.json").read_text())
ALL = list(ENGINES)


def test_plan_runs_everything_once_per_repeat_one_server_at_a_time_in_alternating_order() -> None:
    blocks = plan(ALL, [1, 4, 8, 16], repeats=2)
    runs = Counter((b.repeat, e, c) for b in blocks for e, c in b.runs)
    assert set(runs.values()) == {1} and len(runs) == 2 * 3 * 4
    llama = [b for b in blocks if b.server == "llama-server"]
    assert [b.slots for b in llama] == [1, 4, 8, 16, 1, 4, 8, 16]  # a fresh server per concurrency, -np = C
    assert all(b.runs == (("llama-server", b.slots),) for b in llama)
    assert next(b.server for b in blocks if b.repeat == 0) == "llama-server"
    assert next(b.server for b in blocks if b.repeat == 1) == "specdec"  # the servers' order flips
    specdec = [b for b in blocks if b.server == "specdec"]
    assert len(specdec) == 2 and all(b.slots is None for b in specdec)  # one specdec server per repeat
    first = [next(e for e, c in b.runs if c == conc) for b in specdec for conc in (1, 4, 8, 16)]
    assert first == ["specdec-ar", "specdec-ems"] * 2 + ["specdec-ems", "specdec-ar"] * 2


def test_plan_of_a_subset_and_the_request_count() -> None:
    assert [b.server for b in plan(["specdec-ems"], [2], 3)] == ["specdec"] * 3
    assert requests_of(1, 4, 16) == 16 and requests_of(8, 4, 16) == 32 and requests_of(16, 4, 16) == 64


def test_parse_args_refuses_unknown_engines_and_non_positive_counts() -> None:
    assert parse_args(["--engines", "specdec-ar, llama-server"]).engines == ["specdec-ar", "llama-server"]
    assert parse_args([]).concurrency == (1, 4, 8, 16)
    with pytest.raises(SystemExit):
        parse_args(["--engines", "vllm"])
    with pytest.raises(SystemExit):
        parse_args(["--repeats", "0"])


def test_profile_command_sends_the_engines_body_fields_and_the_budget_as_max_tokens(tmp_path: Path) -> None:
    cmd = loadgen.profile_command(
        Path("/venv/bin/aiperf"),
        url="http://127.0.0.1:9",
        model="smollm2-135m",
        tokenizer=tmp_path / "target",
        dataset=tmp_path / "prompts.jsonl",
        concurrency=8,
        requests=32,
        warmup=8,
        extra=ENGINES["specdec-ems"].extra,
        artifacts=tmp_path / "art",
    )
    flags = {a: b for a, b in itertools.pairwise(cmd) if a.startswith("--")}
    assert cmd[:2] == ["/venv/bin/aiperf", "profile"]
    assert flags["--concurrency"] == "8" and flags["--request-count"] == "32" and flags["--warmup-request-count"] == "8"
    assert json.loads(flags["--extra-inputs"]) == {"temperature": 0, "method": "ems"}
    assert flags["--custom-dataset-type"] == "single_turn" and flags["--dataset-sampling-strategy"] == "sequential"
    assert {"--streaming", "--use-legacy-max-tokens", "--use-server-token-count"} <= set(cmd)
    assert {"--no-server-metrics", "--no-gpu-telemetry"} <= set(cmd)  # no polling beside a CPU engine
    assert flags["--tokenizer"] == str(tmp_path / "target") and flags["--endpoint-type"] == "chat"
    no_warmup = loadgen.profile_command(
        Path("a"), url="u", model="m", tokenizer=tmp_path, dataset=tmp_path, concurrency=1, requests=1, warmup=0,
        extra={}, artifacts=tmp_path,
    )  # fmt: skip
    assert "--warmup-request-count" not in no_warmup
    llama = ENGINES["llama-server"].extra
    assert llama == {"temperature": 0, "cache_prompt": False} and "method" not in llama


def test_dataset_is_one_single_turn_line_per_prompt_with_the_budget(tmp_path: Path) -> None:
    path = loadgen.write_dataset(tmp_path / "d" / "p.jsonl", ['a "quoted"\nline', "b"], 96)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert lines == [{"text": 'a "quoted"\nline', "output_length": 96}, {"text": "b", "output_length": 96}]


def test_summarize_reads_a_real_aiperf_export() -> None:
    row = loadgen.summarize(EXPORT)
    assert row["requests"] == 2 and row["errors"] == 0 and row["error_messages"] == [] and row["complete"]
    assert row["tokens_per_s"] == pytest.approx(EXPORT["output_token_throughput"]["avg"])
    assert row["ttft_p50_ms"] == pytest.approx(EXPORT["time_to_first_token"]["p50"])
    assert row["ttft_p99_ms"] == pytest.approx(EXPORT["time_to_first_token"]["p99"])
    assert row["itl_p50_ms"] == pytest.approx(EXPORT["inter_token_latency"]["p50"])
    assert row["itl_p99_ms"] == pytest.approx(EXPORT["inter_token_latency"]["p99"])
    assert row["output_tokens_mean"] == 8.0 and row["duration_s"] == pytest.approx(EXPORT["benchmark_duration"]["avg"])


def test_summarize_counts_errors_and_a_run_that_only_failed() -> None:
    failure = {
        "error_details": {"code": 404, "type": "NotFoundError", "message": "model 'x' is not served"},
        "count": 3,
    }
    mixed = {**EXPORT, "error_summary": [failure]}
    row = loadgen.summarize(mixed)
    assert row["requests"] == 5 and row["errors"] == 3 and row["error_messages"] == ["model 'x' is not served"]
    only_errors = {"error_summary": [failure], "is_complete": True, "was_cancelled": False}
    row = loadgen.summarize(only_errors)
    assert row["requests"] == 3 and row["errors"] == 3
    assert row["tokens_per_s"] is None and row["ttft_p50_ms"] is None and row["itl_p99_ms"] is None
    assert not loadgen.summarize({**EXPORT, "was_cancelled": True})["complete"]


def test_a_run_whose_every_request_failed_is_read_from_aiperfs_records() -> None:
    # a real run against specdec serve with "method": "nope": aiperf exits 1 and leaves only its per-request records
    lines = (ROOT / "tests" / "data" / "aiperf_records_all_failed.jsonl").read_text().splitlines()
    row = loadgen.summarize(loadgen.export_from_records(lines))
    assert row["requests"] == 3 and row["errors"] == 3 and row["tokens_per_s"] is None and row["complete"]
    assert len(row["error_messages"]) == 1 and "unknown method 'nope'" in row["error_messages"][0]
    assert loadgen.export_from_records(["", lines[0].replace('"error":{', '"ignored":{')])["error_summary"] == []


def test_a_run_past_its_time_is_ended_with_every_process_it_started(tmp_path: Path) -> None:
    # a stand-in for aiperf that starts a service process of its own and never finishes
    stand_in = tmp_path / "aiperf"
    stand_in.write_text(f"#!/bin/bash\nsleep 120 &\necho $! > {tmp_path}/child\nsleep 120\n")
    stand_in.chmod(0o755)
    with pytest.raises(RuntimeError, match="did not finish within 1 s"):
        loadgen.run_profile([str(stand_in)], tmp_path / "art", timeout_s=1)
    child = int((tmp_path / "child").read_text())

    def gone() -> bool:
        try:
            return Path(f"/proc/{child}/stat").read_text().split()[2] == "Z"
        except OSError:
            return True

    deadline = time.monotonic() + 10
    while not gone() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert gone()


def test_aiperf_env_drops_hub_offline_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    env = loadgen.aiperf_env()
    assert "HF_HUB_OFFLINE" not in env and env["HF_HUB_DISABLE_TELEMETRY"] == "1"


def test_the_export_is_the_main_jobs_with_enough_slots(tmp_path: Path) -> None:
    args = main_export_args()
    assert "--out" not in args and "--force" not in args and args[:2] == ["--target", "smollm2-135m"]
    assert args[args.index("--quantize") + 1] == "w8a8"  # what scripts/main.sh exports today
    cmd = export_command(tmp_path / "e", 16)
    assert cmd[0] == "specdec-export" and cmd[-2:] == ["--out", str(tmp_path / "e")]
    assert cmd[cmd.index("--max-batch") + 1] == "16"
    script = tmp_path / "main.sh"
    script.write_text(
        "set -e\n# specdec-export in a comment\n"
        "specdec-export --target t --max-batch 32 --out deploy \\\n  --force --calibrate\n"
    )
    assert main_export_args(script) == ["--target", "t", "--max-batch", "32", "--calibrate"]
    assert export_command(tmp_path, 16, script)[4] == "32"  # never lowered
    script.write_text("echo nothing\n")
    with pytest.raises(RuntimeError, match="no specdec-export"):
        main_export_args(script)


def test_llama_server_runs_with_continuous_batching_slots_threads_and_the_served_name() -> None:
    spec = llama_spec(Path("/b/llama-server"), Path("/m.gguf"), 2, 2048, "smollm2-135m")
    cmd = server_command(spec, 4242, 8)
    text = shlex.join(cmd)
    assert "-np 8" in text and "-t 2" in text and "-c 16384" in text and "--port 4242" in text
    assert "--cont-batching" in cmd and "--jinja" in cmd and cmd[cmd.index("--alias") + 1] == "smollm2-135m"
    assert "--spec-type" not in cmd


def _run(engine: str, c: int, repeat: int, tps: float | None, **kw: object) -> dict:
    base = {"engine": engine, "concurrency": c, "repeat": repeat, "tokens_per_s": tps, "requests": 4, "errors": 0}
    base.update({k: (None if tps is None else tps * 10) for k in ("ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms")})
    base.update(itl_p99_ms=None if tps is None else 1.0, output_tokens_mean=90.0, prompt_tokens_mean=40.0)
    base.update(kw)
    return base


def test_fold_takes_medians_over_repeats_and_keeps_failures() -> None:
    runs = [
        _run("llama-server", 1, 0, 40.0),
        _run("llama-server", 1, 1, 60.0),
        _run("specdec-ems", 1, 0, 50.0),
        _run("specdec-ems", 1, 1, 70.0, errors=1),
        {"engine": "specdec-ar", "concurrency": 1, "repeat": 0, "error": "specdec serve exited with 1"},
    ]
    rows = fold(runs, ["llama-server", "specdec-ar", "specdec-ems"], [1])
    by = {r["engine"]: r for r in rows}
    assert by["llama-server"]["tokens_per_s"] == 50.0 and by["llama-server"]["ttft_p50_ms"] == 500.0
    assert by["specdec-ems"]["tokens_per_s"] == 60.0 and by["specdec-ems"]["errors"] == 1
    assert by["specdec-ems"]["requests"] == 8 and by["specdec-ems"]["runs"] == 2
    assert ratio_to_baseline(rows, by["specdec-ems"]) == pytest.approx(1.2)
    assert by["specdec-ar"]["tokens_per_s"] is None and by["specdec-ar"]["failed_runs"] == [
        "specdec serve exited with 1"
    ]
    assert ratio_to_baseline(rows, by["specdec-ar"]) is None
    labels = {k: e.label for k, e in ENGINES.items()}
    lines = table(rows, labels)
    assert lines[0].startswith("| engine | concurrency | tokens/s | / llama-server | TTFT p50 / p99 (ms)")
    ems = next(line for line in lines if line.startswith("| specdec ems"))
    assert "| 60.0 | 1.20× | 600 / 600 |" in ems and ems.endswith("| 8 | 1 |")
    assert "1 failed run(s)" in next(line for line in lines if line.startswith("| specdec ar"))
    said = "\n".join(notes(rows, labels))
    assert "most tokens/s from specdec ems, 60.0 (1.20× llama-server)" in said
    assert "specdec ar at concurrency 1: 0 request error(s), 1 failed run(s): specdec serve exited" in said
    assert "the same for every engine at every concurrency" in said


def test_notes_say_when_the_servers_counted_different_prompt_tokens() -> None:
    runs = [_run("llama-server", 1, 0, 40.0), _run("specdec-ar", 1, 0, 40.0, prompt_tokens_mean=45.0)]
    said = "\n".join(notes(fold(runs, ["llama-server", "specdec-ar"], [1]), {}))
    assert "they DIFFER (C=1: llama-server 40.0, specdec-ar 45.0)" in said


def test_markdown_and_plot_of_a_whole_document(tmp_path: Path) -> None:
    runs = [_run(e, c, 0, 10.0 * c + i) for i, e in enumerate(ALL) for c in (1, 2)]
    doc = {
        "meta": {
            "date": "d", "command": "python -m benchmarks.openai_load", "seconds": 1.0, "loadgen": "aiperf",
            "workload": "w", "order": "o", "export": {"command": "specdec-export", "reused": True},
            "machine": {"processor": "cpu", "cpu_count": 2, "platform": "p", "python": "3"}, "load_before": [],
            "load_after": [], "stem": "openai_load", "work_dir": "w",
        },
        "labels": {k: e.label for k, e in ENGINES.items()},
        "rows": fold(runs, ALL, [1, 2]),
        "runs": runs,
    }  # fmt: skip
    text = markdown(doc)
    assert "| llama-server Q4_1 | 2 | 20.0 | 1.00× |" in text and "(reused)" in text
    assert "busy" not in text
    doc["meta"]["load_before"] = [1.5, 1.0, 1.0]
    assert "**Warning: the machine was busy when the run began** (1-minute load 1.5 on 2 cores)" in markdown(doc)
    plot(doc, tmp_path / "p.png")
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

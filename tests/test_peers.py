"""The edge benchmark's peers without the peers (fast tier): the fidelity arithmetic, the JSON protocol with a
scripted child process, the rows and specs, the conversion commands. The peers' own runs are benchmark-only."""

from __future__ import annotations

import math
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from benchmarks.peers import catalog, convert, fidelity, llama_server, protocol


def test_forced_rows_judge_each_position_on_the_references_context() -> None:
    # a "model" that predicts token + 1 with margin 2.0, except after token 7, where it predicts 0 with margin 0.25
    seen: list[tuple[list[int], int]] = []

    def top_rows(tokens: list[int], first: int) -> list[tuple[int, float]]:
        seen.append((list(tokens), first))
        return [(0, 0.25) if t == 7 else (t + 1, 2.0) for t in tokens[first:]]

    pairs = [
        ([1, 2, 3], [4, 5, 6, 7, 8]),  # 4 5 6 7 follow; after 7 the model says 0, not 8: 4 of 5
        ([5], [6, 9]),  # 6 agrees; after 6 it says 7, not 9: a miss that does not cascade
        ([3], []),  # an empty answer has no position
    ]
    got = fidelity.forced_rows(pairs, top_rows)
    assert (got["positions"], got["agree"]) == (7, 5)
    assert got["picks"] == [[4, 5, 6, 7, 0], [6, 7], []]
    assert got["margins"] == [[2.0, 2.0, 2.0, 2.0, 0.25], [2.0, 2.0], []]
    # the model reads the prompt and the reference answer but its last token, and is asked from the prompt's end
    assert seen == [([1, 2, 3, 4, 5, 6, 7], 2), ([5, 6], 0)]


def test_top2_gives_each_rows_choice_and_its_lead() -> None:
    rows = fidelity.top2(np.array([[0.0, 3.0, 1.0], [5.0, 5.0, -1.0], [-2.0, -7.0, -2.5]], np.float32))
    assert rows == [(1, 2.0), (0, 0.0), (0, 0.5)]  # a tie has no lead; the first of the tied is greedy's


def test_nll_and_perplexity_are_the_log_softmax_of_the_targets() -> None:
    logits = np.array([[0.0, 0.0], [np.log(3.0), 0.0]])  # p = (1/2, 1/2), then (3/4, 1/4)
    assert fidelity.nll(logits, [1, 0]) == pytest.approx(-math.log(0.5) - math.log(0.75))
    assert fidelity.nll(logits + 1000.0, [1, 0]) == pytest.approx(-math.log(0.5) - math.log(0.75))  # no overflow
    assert fidelity.perplexity(2 * math.log(4.0), 2) == pytest.approx(4.0)
    assert fidelity.perplexity(0.0, 0) is None


def test_forced_counts_refuse_picks_that_do_not_cover_the_answers() -> None:
    assert fidelity.forced_counts([[1, 2], [3]], [[1, 5], [3]]) == {"positions": 3, "agree": 2}
    with pytest.raises(ValueError, match="one pick per answer position"):
        fidelity.forced_counts([[1]], [[1, 2]])


def _bigram_logits(tokens: list[int], vocab: int = 8) -> np.ndarray:
    """A model whose next token after t is (t + 1) % vocab, three logits ahead of the rest."""
    rows = np.zeros((len(tokens), vocab))
    for i, t in enumerate(tokens):
        rows[i, (t + 1) % vocab] = 3.0
    return rows


def test_scoring_by_whole_sequences_and_by_positions_agree() -> None:
    spec = {"pairs": {"chat": [[[1, 2], [3, 5]]]}, "documents": [[1, 2, 3, 4], [6, 7]]}
    by_logits = fidelity.score_logits(spec, _bigram_logits)

    def at(prefix: list[int], target: int) -> tuple[tuple[int, float], float]:
        row = _bigram_logits(prefix)[-1]
        log_p = row - np.log(np.exp(row).sum())
        return fidelity.top2(row[None])[0], float(log_p[target])

    by_positions = fidelity.score_positions(spec, at)
    assert by_logits["forced"]["chat"]["picks"] == by_positions["forced"]["chat"]["picks"] == [[3, 4]]
    assert by_logits["forced"]["chat"]["agree"] == 1  # 3 follows 2; after 3 the model says 4, the answer 5
    assert by_logits["predicted"] == by_positions["predicted"] == 4
    assert by_logits["nll"] == pytest.approx(by_positions["nll"])
    every_hit = 4 * -math.log(math.exp(3.0) / (math.exp(3.0) + 7))  # each document follows the model's choice
    assert by_logits["nll"] == pytest.approx(every_hit)


GENERATE = {"task": "generate", "prompts": {"chat": [[1, 2], [3]]}}


def _workload(**overrides: object) -> dict:
    w = {
        "tokens": 2,
        "seconds": 1.0,
        "ttft": [0.1],
        "ids": [[5], [6]],
        "texts": ["a", "b"],
        "prompt_ids": [[1, 2], [3]],
    }
    return {**w, **overrides}


def test_check_result_names_the_missing_or_malformed_field() -> None:
    good = {"workloads": {"chat": _workload()}}
    assert protocol.check_result(GENERATE, good) is good
    missing = {"workloads": {"chat": {k: v for k, v in _workload().items() if k != "prompt_ids"}}}
    assert protocol.check_result(GENERATE, missing) == {"error": "result.workloads.chat: missing prompt_ids"}
    short = {"workloads": {"chat": _workload(ids=[[5]])}}
    assert "result.workloads.chat.ids: 1 answers for 2 prompts" in protocol.check_result(GENERATE, short)["error"]
    assert "result.workloads" in protocol.check_result(GENERATE, {"workloads": {}})["error"]
    score = {"task": "score", "pairs": {"chat": [[[1], [2, 3]]]}}
    assert "missing nll" in protocol.check_result(score, {"forced": {}, "predicted": 0})["error"]
    bad = {"forced": {"chat": {"picks": [[2]]}}, "nll": 1.0, "predicted": 1}
    assert "result.forced.chat.picks" in protocol.check_result(score, bad)["error"]
    assert "spec.task" in protocol.check_result({"task": "train"}, {})["error"]


@pytest.fixture
def scripted_child(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A child module on PYTHONPATH that behaves as its spec's ``behave`` says, through ``child_main``."""
    (tmp_path / "scripted_peer.py").write_text(
        textwrap.dedent(
            """
            import sys, time
            from benchmarks.peers.protocol import child_main

            def generate(spec):
                if spec["behave"] == "crash":
                    print("loading the model failed: no such file")
                    raise SystemExit(3)
                if spec["behave"] == "hang":
                    time.sleep(60)
                ids = [[7] for _ in spec["prompts"]["chat"]]
                w = {"tokens": len(ids), "seconds": 0.5, "ttft": [0.1], "ids": ids, "texts": ["x"] * len(ids),
                     "prompt_ids": spec["prompts"]["chat"]}
                if spec["behave"] == "malformed":
                    del w["ttft"]
                return {"workloads": {"chat": w}, "load_seconds": 0.1, "versions": {}}

            sys.exit(child_main({"generate": generate}))
            """
        )
    )
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    return "scripted_peer"


def _run(module: str, work: Path, behave: str, timeout_s: float = 60) -> dict:
    spec = {**GENERATE, "behave": behave}
    return protocol.run_peer(sys.executable, module, spec, work, behave, timeout_s)


def test_run_peer_returns_the_childs_result_with_its_peak_rss(scripted_child: str, tmp_path: Path) -> None:
    got = _run(scripted_child, tmp_path / "work", "ok")
    assert got["workloads"]["chat"]["ids"] == [[7], [7]] and got["workloads"]["chat"]["prompt_ids"] == [[1, 2], [3]]
    assert got["peak_rss_mb"] > 0  # the child's own VmHWM


def test_run_peer_turns_a_failed_malformed_or_hung_child_into_an_error(scripted_child: str, tmp_path: Path) -> None:
    crashed = _run(scripted_child, tmp_path / "work", "crash")["error"]
    assert crashed.startswith("exit 3") and "loading the model failed" in crashed and "crash.log" in crashed
    assert _run(scripted_child, tmp_path / "work", "malformed") == {"error": "result.workloads.chat: missing ttft"}
    assert _run(scripted_child, tmp_path / "work", "hang", timeout_s=2)["error"].startswith("timeout after 2 s")
    missing = protocol.run_peer(tmp_path / "no-venv" / "python", scripted_child, GENERATE, tmp_path, "x", 5)
    assert missing["error"].startswith("not installed:")


def test_timed_workloads_time_each_batch_and_report_what_the_engine_saw() -> None:
    calls: list[tuple[int, int]] = []

    def generate(batch: list[list[int]], max_new: int) -> tuple[list[list[int]], list[list[int]]]:
        calls.append((len(batch), max_new))
        return [[9] * max_new for _ in batch], [list(ids) for ids in batch]

    spec = {"prompts": {"chat": [[1], [2], [3]], "extractive": [[4]]}, "batch": 2, "max_tokens": 5}
    got = protocol.timed_workloads(spec, generate, lambda ids: "t" * len(ids))
    # a warm-up, then per batch a one-token call (time to first token) and the timed call
    assert calls == [(1, 4), (2, 1), (2, 5), (1, 1), (1, 5), (1, 1), (1, 5)]
    assert got["chat"]["tokens"] == 15 and len(got["chat"]["ttft"]) == 2 and got["chat"]["texts"][0] == "ttttt"
    assert got["chat"]["prompt_ids"] == [[1], [2], [3]] and got["extractive"]["ids"] == [[9] * 5]


def test_answers_stop_at_the_first_eos() -> None:
    assert protocol.answer([5, 6, 2, 7], [2, 0]) == [5, 6]
    assert protocol.chunks([1, 2, 3], 2) == [[1, 2], [3]]


def test_llama_server_runs_greedy_on_loopback_with_its_slots_and_ngram_speculation() -> None:
    spec = {"server": "llama-server", "gguf": "m.gguf", "threads": 2, "max_len": 512, "ngram": [3, 6]}
    cmd = llama_server.server_command(spec, 8080, 4)
    assert cmd[cmd.index("--host") + 1] == "127.0.0.1" and cmd[cmd.index("-np") + 1] == "4"
    assert cmd[cmd.index("-c") + 1] == str(512 * 4)  # each slot gets the benchmark's context
    assert cmd[cmd.index("--spec-type") + 1] == "ngram-simple" and cmd[cmd.index("-t") + 1] == "2"
    assert "--spec-type" not in llama_server.server_command({**spec, "ngram": None}, 8080, 1)
    assert llama_server.GREEDY["temperature"] == 0.0 and llama_server.GREEDY["repeat_penalty"] == 1.0


def test_row_specs_carry_each_peers_mode_and_settings(tmp_path: Path) -> None:
    lookup = catalog.row_spec(catalog.PeerRow("openvino-int4", "lookup", 1), tmp_path, tmp_path, 2)
    assert lookup["mode"] == "lookup" and lookup["properties"] == {"INFERENCE_NUM_THREADS": "2"}
    faithful = catalog.row_spec(catalog.PeerRow("openvino-int8", "plain", 1), tmp_path, tmp_path, 2)
    assert faithful["mode"] == "pipeline" and faithful["properties"]["KV_CACHE_PRECISION"] == "f32"
    cb = catalog.row_spec(catalog.PeerRow("openvino-int4", "cb", 8), tmp_path, tmp_path, 2)
    assert (cb["mode"], cb["batch"]) == ("cb", 8)
    ngram = catalog.row_spec(catalog.PeerRow("llama-q4_1", "ngram", 1), tmp_path, tmp_path, 2)
    assert ngram["ngram"] == list(catalog.LLAMA_NGRAM) and ngram["gguf"] == str(tmp_path / "llama-q4_1.gguf")
    assert catalog.python_of("llama.cpp", tmp_path) == Path(sys.executable)  # an HTTP client: the project's venv
    assert catalog.python_of("ortgenai", tmp_path) == tmp_path / "ortgenai" / "bin" / "python"


def test_conversion_commands_are_the_documented_ones(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(convert, "shipped_gguf", lambda: Path("/w/q4_1.gguf"))
    (int4,) = convert.commands("ortgenai-int4", tmp_path, tmp_path)
    builder = ["-m", "onnxruntime_genai.models.builder", "-i", "hf", "-o", "ortgenai-int4", "-p", "int4", "-e", "cpu"]
    assert int4[1:] == [*builder, "-c", "ortgenai-cache", "--extra_options", "accuracy_level=4"]
    (ov,) = convert.commands("openvino-int4", tmp_path, tmp_path)
    weights = ["--weight-format", "int4", "--group-size", "32", "--ratio", "1.0", "--backup-precision", "int8_asym"]
    assert ov[ov.index("--weight-format") :] == [*weights, "openvino-int4"]
    (f32,) = convert.commands("llama-f32", tmp_path, tmp_path)
    assert f32[1:] == ["--allow-requantize", "/w/q4_1.gguf", "llama-f32.gguf", "F32"]
    with pytest.raises(KeyError, match="no conversion"):
        convert.commands("tensorrt-int4", tmp_path, tmp_path)


def test_the_ortgenai_pad_is_moved_off_the_chat_templates_end_token(tmp_path: Path) -> None:
    (tmp_path / "genai_config.json").write_text('{"model": {"pad_token_id": 2, "eos_token_id": 2}}')
    convert._fix_pad(tmp_path)
    assert '"pad_token_id": 0' in (tmp_path / "genai_config.json").read_text()

"""Pure helpers of the benchmark scripts (logic only, fast tier): the edge benchmark's next-token agreement and
perplexity per model, the reference's margins where a model parts from it, its rows and notes, the step profile's
own-time accounting of control-flow nodes,
and the rule that picks the main job's export from the served candidates."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from benchmarks import ems_vs_ar, step_profile
from benchmarks import served_configs as served
from benchmarks.edge_cpu import EXPORT_FLAGS, PRECISIONS, forced, parent, report, summary
from benchmarks.edge_cpu import contestants as edge_contestants


def test_miss_margins_reads_the_references_margin_where_the_model_parts() -> None:
    answers = [[4, 5, 6], [8, 9]]
    reference = {"picks": [[4, 5, 6], [8, 9]], "margins": [[3.0, 0.1, 5.0], [0.3, 7.0]]}
    model = {"picks": [[4, 1, 6], [2, 9]], "margins": [[1.0, 1.0, 1.0], [1.0, 1.0]]}  # its own margins: not read
    got = forced.miss_margins(model, reference, answers)
    assert got["misses"] == 2 and got["median"] == pytest.approx(0.2) and got["max"] == 0.3
    assert got["median_all"] == 3.0
    assert forced.miss_margins(reference, reference, answers)["misses"] == 0  # the reference never misses itself
    assert forced.miss_margins(reference, reference, answers)["median"] is None


def test_forced_table_reports_rates_margins_and_errors() -> None:
    ties = {"misses": 4, "median": 0.12, "p90": 0.5, "max": 0.9, "median_all": 4.2}
    forced = {
        "specdec int4": {
            "chat": {"positions": 200, "agree": 196, "rate": 0.98, "near_ties": ties},
            "extractive": {
                "positions": 100,
                "agree": 97,
                "rate": 0.97,
                "near_ties": {**ties, "misses": 0, "median_all": 3.0},
            },
        },
        "llama-server Q4_1": {"error": "exit 1: no server"},
    }
    forced["specdec int4"]["perplexity"] = 21.3761
    text = "\n".join(report.forced_table(forced))
    assert "| specdec int4 | 98.0% | 97.0% | 200 / 100 | 21.376 | 4: 0.12 / 0.50 / 0.90 | 0 | 4.20 / 3.00 |" in text
    assert "| llama-server Q4_1 | exit 1: no server |" in text
    assert report.forced_table({}) == []


def _event(op: str, ts: int, dur: int) -> dict:
    return {"name": f"{op}_{ts}_kernel_time", "ts": ts, "dur": dur, "args": {"op_name": op}}


def test_a_control_flow_node_keeps_only_its_own_time() -> None:
    events = [
        _event("MatMulNBits", 0, 50),
        _event("If", 60, 40),  # its branch: the two nodes inside its window
        _event("GroupQueryAttention", 62, 30),
        _event("Gather", 93, 5),
        _event("MatMulNBits", 101, 20),
    ]  # after the If: not its branch
    own = step_profile.own_durations(events)
    assert own == [50.0, 5.0, 30.0, 5.0, 20.0]
    assert sum(own) == 110  # no node counted twice: the wall of the nodes run, 50 + 40 + 20


def _served(name: str, ems: tuple[float, float], ar: tuple[float, float], identical: bool = True) -> dict:
    regimes = ("all at once", "one at a time")
    return {
        "name": name,
        "identical": identical,
        **{
            g: {"ems_tokens_per_second": e, "ar_tokens_per_second": a} for g, e, a in zip(regimes, ems, ar, strict=True)
        },
    }


def test_served_configs_pools_a_graphs_ar_and_keeps_each_drafters_own_ratio() -> None:
    rows = [
        _served("int4, n-gram", (132.0, 90.0), (132.0, 90.0)),  # ratio 1, on a fast server
        _served("int4, hybrid", (110.0, 75.0), (100.0, 75.0)),  # ratio 1.1 all at once, on a slow one
        _served("int8, hybrid", (120.0, 80.0), (120.0, 80.0)),
        _served("fp32, draft model", (500.0, 500.0), (100.0, 100.0), identical=False),
    ]
    est = served.estimates(rows)
    pooled = (132.0 * 90.0 * 100.0 * 75.0) ** 0.25  # int4's ar over both of its candidates and both regimes
    assert est["int4, n-gram"] == pytest.approx(pooled)
    assert est["int4, hybrid"] == pytest.approx(pooled * 1.1**0.5)
    assert est["int8, hybrid"] == pytest.approx((120.0 * 80.0) ** 0.5)
    # int4 hybrid: its own ems speed (110 / 75) is below int8 hybrid's (120 / 80), but on a server that ran ar slower
    # too; pooled, its graph is the faster one. n-gram cannot serve DSBD; the inexact fp32 candidate never counts.
    assert served.choose(rows)["name"] == "int4, hybrid"
    assert not served.serves_dsbd(rows[0]) and served.serves_dsbd(rows[3])
    with pytest.raises(RuntimeError, match="serves DSBD"):
        served.choose([rows[0], rows[3]])


def test_forced_agreement_judges_misses_by_the_fp32_graphs_margins(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    answers = {"chat": [[4, 5]], "extractive": [[6]]}
    # each child's score: fp32 repeats its answers; int4 misses chat's second token; the peer failed
    results = {
        "specdec fp32": {"chat": ([[4, 5]], [[2.0, 0.1]]), "extractive": ([[6]], [[3.0]])},
        "specdec int4": {"chat": ([[4, 9]], [[1.0, 1.0]]), "extractive": ([[6]], [[1.0]])},
    }
    specs: list[dict] = []

    def run_peer(python: str, module: str, spec: dict, work: Path, name: str, timeout_s: float) -> dict:
        specs.append(spec)
        if module != "benchmarks.edge_cpu.children":
            return {"error": "exit 1: no server"}
        forced = {
            n: {
                "positions": len(answers[n][0]),
                "agree": sum(a == b for a, b in zip(picks[0], answers[n][0], strict=True)),
                "picks": picks,
                "margins": margins,
            }
            for n, (picks, margins) in results[f"specdec {spec['export']}"].items()
        }
        return {"forced": forced, "nll": 2.0 * len(spec["documents"][0]), "predicted": len(spec["documents"][0])}

    monkeypatch.setattr(parent, "run_peer", run_peer)
    common = {"prompts": {"chat": [[1]], "extractive": [[2]]}, "max_len": 64}
    reference = {n: {"ids": a} for n, a in answers.items()}
    models = [
        ("specdec fp32", "python", "benchmarks.edge_cpu.children", {"export": "fp32"}),
        ("specdec int4", "python", "benchmarks.edge_cpu.children", {"export": "int4"}),
        ("llama-server Q4_1", "python", "benchmarks.peers.llama_server", {}),
    ]
    documents = [list(range(100))]
    out = parent.forced_agreement(common, reference, models, documents, tmp_path)
    assert out["llama-server Q4_1"] == {"error": "exit 1: no server"}
    chat = out["specdec int4"]["chat"]
    assert chat["rate"] == 0.5 and chat["near_ties"]["misses"] == 1
    assert chat["near_ties"]["median"] == 0.1  # fp32's margin where int4 parted, not int4's own 1.0
    assert out["specdec fp32"]["chat"]["near_ties"]["misses"] == 0
    assert out["specdec int4"]["perplexity"] == pytest.approx(np.exp(2.0))
    assert "picks" not in chat and "margins" not in chat  # the report keeps the summary only
    # every model is given the same pairs and documents, and a cache long enough for the longest document
    assert all(s["pairs"] == specs[0]["pairs"] and s["documents"] == documents for s in specs)
    assert specs[0]["pairs"]["chat"] == [[[1], [4, 5]]] and specs[0]["max_len"] == 128
    # without the fp32 row there is nothing to judge the misses by: rates stay, no margins
    out = parent.forced_agreement(common, reference, models[1:2], documents, tmp_path)
    assert out["specdec int4"]["chat"]["rate"] == 0.5 and "near_ties" not in out["specdec int4"]["chat"]


def test_acceptance_note_states_the_issue_lines_from_the_rows() -> None:
    def row(batch: int, mix: float, rss: float = 300.0, kind: str = "specdec") -> dict:
        return {"kind": kind, "batch": batch, "over_llama": {"mix": mix}, "peak_rss_mb": rss}

    base = row(1, 1.0, 200.0, "peer")
    ok = {
        "llama-server Q4_1 B=1": base,
        "specdec int4 ar B=1": row(1, 1.1, 370.0),
        "specdec w8a8 ar B=1": row(1, 1.5),
        "specdec int4 ar B=8": row(8, 2.5),
        "specdec w8a8 ar B=8": row(8, 3.6),
    }
    note = summary.acceptance_note(ok, base)
    assert "int4 ar B=1 1.10x" in note and "best B=1 1.50x, specdec w8a8 ar B=1" in note
    assert "best B=8 3.60x, specdec w8a8 ar B=8" in note and "370 MB, 1.85x llama-server's 200 MB" in note
    assert summary.acceptance_note({k: v for k, v in ok.items() if "B=8" not in k}, base) is None


def test_w8a8_runs_every_method_and_only_the_block_exports_add_fp32_cache_rows() -> None:
    rows = edge_contestants.contestants((1, 8))
    w8a8 = {c.label for c in rows if c.precision == "w8a8"}
    assert w8a8 == {"specdec w8a8 ar", "specdec w8a8 ems n-gram", "specdec w8a8 ems draft", "specdec w8a8 ems hybrid"}
    assert {c.precision for c in rows if c.kv_cache == "float32"} == {"int8", "int4"}


def test_every_precision_has_its_export_flags_and_speculates_only_where_exact() -> None:
    """int4-f32's one-row and many-row kernels differ, so it runs ar alone; int8 ar and prompt lookup."""
    rows = [c for c in edge_contestants.contestants((1, 8)) if c.kind == "specdec"]
    assert set(EXPORT_FLAGS) == set(PRECISIONS)
    methods = {p: {(c.method, c.drafter) for c in rows if c.precision == p and c.kv_cache is None} for p in PRECISIONS}
    assert methods["int4-f32"] == {("ar", None)}
    assert methods["int8"] == {("ar", None), ("ems", "ngram")}
    assert methods["int4"] == {("ar", None), ("ems", "ngram"), ("ems", "draft"), ("ems", "hybrid")}
    assert {c.batch for c in rows if c.precision == "int4-f32"} == {1, 8}
    assert "int4-f32" not in ems_vs_ar.SPECULATING_PRECISIONS and "int4" in ems_vs_ar.SPECULATING_PRECISIONS


def test_peer_rows_run_the_deployed_model_at_every_batch_and_the_faithful_one_at_batch_1() -> None:
    rows = edge_contestants.contestants((1, 8), ("llama.cpp", "ortgenai", "openvino"))
    peers = {(c.label, c.batch) for c in rows if c.kind == "peer"}
    assert ("llama-server Q4_1", 8) in peers and ("llama-server Q4_1 n-gram", 1) in peers
    assert ("OpenVINO int4 continuous batching", 8) in peers and ("OpenVINO int4", 8) not in peers
    assert ("OpenVINO int4 prompt lookup", 1) in peers and ("ORT GenAI int4", 8) in peers
    assert {b for label, b in peers if "fp32" in label or "F32" in label or "f32" in label} == {1}
    speculating = {c.key: c.plain_key for c in rows if c.kind == "peer" and c.plain_key}
    assert speculating["llama-server Q4_1 n-gram B=8"] == "llama-server Q4_1 B=8"
    assert speculating["OpenVINO int4 prompt lookup B=1"] == "OpenVINO int4 B=1"
    assert edge_contestants.contestants((1,), ()) == [c for c in edge_contestants.contestants((1,)) if c.kind != "peer"]


def test_a_row_that_saw_other_prompt_ids_is_counted_and_named() -> None:
    prompts = {"chat": [[1, 2], [3]], "extractive": [[4]]}
    seen = {"chat": {"prompt_ids": [[1, 2], [3]]}, "extractive": {"prompt_ids": [[4]]}}
    assert summary.prompt_ids_differ([{"workloads": seen}], prompts) == 0
    templated = {**seen, "chat": {"prompt_ids": [[1, 2], [9, 3]]}}  # e.g. a template the engine applied again
    assert summary.prompt_ids_differ([{"workloads": seen}, {"workloads": templated}], prompts) == 1

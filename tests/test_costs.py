"""Pricing the adaptive draft length on the hardware at hand: ``specdec.runtime.costs``, and where it reaches users."""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Iterator
from dataclasses import replace

import pytest
import torch

from specdec.cli import _open_engine, add_generate_args, build_engine, main
from specdec.export.cli import main as export_main
from specdec.runtime.backends.torch_backend import TorchBackend
from specdec.runtime.config import EngineConfig
from specdec.runtime.costs import DraftCosts, calibrate, calibrate_engine, draft_costs, loop_costs, step_costs
from specdec.runtime.draft_length import DraftLength, batch_prices, fixed_shares, prices_text
from specdec.runtime.engine import Engine
from specdec.serving.engine_model import served_engine
from specdec.serving.repository import ServingOptions, read_parameters, render_configs


@pytest.fixture(autouse=True)
def _keep_torch_threads() -> Iterator[None]:
    """``specdec generate`` on an ONNX export sets the process's torch threads to 1 (as a server does); a test
    calls it in-process, so the threads the other tests run with are restored."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def _record(batch: int, plain: float, spec: float, draft: float | None, verify: float, k: int = 4) -> dict:
    return {
        "batch_size": batch,
        "context": 8,
        "k": k,
        "plain_ms": plain,
        "spec_ms": spec,
        "draft_ms": draft,
        "verify_ms": verify,
    }


def test_prices_are_per_draft_token_medians_over_batch_sizes() -> None:
    # B=1: 4 drafts add 0.8 plain steps (0.2 each), 0.1 of it the draft step's own -> verify 0.1
    # B=4: 4 drafts add 1.6 plain steps (0.4 each), draft 0.1 -> verify 0.3; B=16: 0.25 each, draft 0.05 -> 0.2
    costs = draft_costs(
        [_record(1, 10.0, 18.0, 1.0, 14.0), _record(4, 20.0, 52.0, 2.0, 44.0), _record(16, 40.0, 80.0, 2.0, 72.0)]
    )
    assert costs.verify_cost == pytest.approx(0.2)
    assert costs.draft_cost == pytest.approx(0.1)  # 0.1, 0.1, 0.05
    # and per batch size, what greedy sequences are priced by
    assert costs.verify_by_batch == ((1, 0.1), (4, 0.3), (16, 0.2))
    assert costs.draft_by_batch == ((1, 0.1), (4, 0.1), (16, 0.05))
    assert costs.as_dict()["verify_cost_by_batch"] == [[1, 0.1], [4, 0.3], [16, 0.2]]
    assert costs.as_dict()["batch_sizes"] == [1, 4, 16] and costs.as_dict()["k"] == 4
    assert costs.as_dict()["plain_ms"] == [10.0, 20.0, 40.0]
    # a speculative step timed below its draft steps' share (noise) prices the rest at 0, not below
    assert draft_costs([_record(1, 10.0, 11.0, 1.0, 7.0)]).verify_cost == 0.0
    lookup = draft_costs([_record(1, 10.0, 12.0, None, 12.0, k=2)])
    assert lookup.draft_cost is None and lookup.verify_cost == pytest.approx(0.1)  # nothing drafted: no draft price
    assert lookup.draft_by_batch == () and lookup.verify_by_batch == ((1, 0.1),)
    with pytest.raises(ValueError, match="no step-cost records"):
        draft_costs([])


def test_step_costs_times_every_shape_on_real_backends(tiny_pair) -> None:
    target, draft = (TorchBackend(m) for m in tiny_pair)
    record = step_costs(target, draft, 3, context=16, ks=(1, 3), steps=3)
    assert record["batch_size"] == 3 and set(record["verify_ms"]) == {"1", "3"}
    assert set(record["samples_ms"]) == {"draft", "target", "verify1", "verify3"}
    assert all(len(v) == 3 and min(v) > 0 for v in record["samples_ms"].values())
    assert record["break_even_accepted_length"]["draft"]["3"] > record["break_even_accepted_length"]["ngram"]["3"]
    alone = step_costs(target, None, 2, context=16, ks=(2,), steps=2)
    assert alone["draft_ms"] is None and "draft" not in alone["break_even_accepted_length"]
    with pytest.raises(ValueError, match=">= 1"):
        step_costs(target, None, 0, ks=(2,))
    record = loop_costs(target, draft, 2, k=3, context=16, steps=3)
    assert record["k"] == 3 and record["draft_ms"] > 0 and record["verify_ms"] > 0
    assert record["spec_ms"] > record["verify_ms"]  # the whole speculative step holds its draft steps too
    with pytest.raises(ValueError, match=">= 1"):
        loop_costs(target, draft, 1, k=0)
    assert loop_costs(target, None, 1, k=2, context=16, steps=2)["draft_ms"] is None
    costs = calibrate(target, draft, batch_sizes=(1, 2), k=2, context=16, steps=3)
    assert isinstance(costs, DraftCosts) and len(costs.records) == 2
    assert costs.draft_cost is not None and 0 < costs.draft_cost < 50 and math.isfinite(costs.draft_cost)
    assert 0 <= costs.verify_cost < 50


def test_a_prompt_lookup_engine_has_no_draft_step_to_price(tiny_pair) -> None:
    target, draft = tiny_pair
    ngram = Engine.from_models(target, config=EngineConfig(max_batch=2, max_len=64))
    costs = calibrate_engine(ngram, batch_sizes=(1, 4), context=16, steps=2)
    assert costs.draft_cost is None  # the policy then uses the drafter's own price: 0 for a lookup
    assert [r["batch_size"] for r in costs.records] == [1, 2]  # never above the engine's max_batch
    model = Engine.from_models(target, draft, config=EngineConfig(max_batch=4, max_len=64))
    assert calibrate_engine(model, batch_sizes=(2,), context=16, steps=2).draft_cost is not None


def test_serving_options_take_measured_prices_only_where_none_was_set() -> None:
    measured = DraftCosts(draft_cost=0.07, verify_cost=0.02, records=())
    assert ServingOptions(adaptive_draft=True).priced(measured).verify_cost == 0.02
    explicit = ServingOptions(adaptive_draft=True, verify_cost=0.0).priced(measured)
    assert (explicit.verify_cost, explicit.draft_cost) == (0.0, 0.07)  # an explicit 0 (a GPU's row) is kept
    config = render_configs("..", ServingOptions(adaptive_draft=True))["specdec_engine"]
    assert 'key: "verify_cost" value: { string_value: "" }' in config  # unset: the engine's default
    assert 'key: "draft_cost" value: { string_value: "" }' in config


def _engine_prices(config: str, by_batch: bool = False) -> tuple[str, str]:
    def value(key: str) -> str:
        line = next(line for line in config.splitlines() if f'key: "{key}"' in line)
        return line.split('string_value: "')[1].split('"')[0]

    return (
        (value("verify_cost_by_batch"), value("draft_cost_by_batch"))
        if by_batch
        else (value("verify_cost"), value("draft_cost"))
    )


@pytest.mark.parametrize("backend", ["torch", "onnx"])
def test_an_export_calibrated_on_this_machine_serves_and_generates_with_its_prices(
    tiny_dir, tmp_path, capsys, backend: str
) -> None:
    out = tmp_path / "deploy"
    assert (
        export_main(
            [
                "--target",
                str(tiny_dir),
                "--draft",
                str(tiny_dir),
                "--out",
                str(out),
                "--backend",
                backend,
                "--max-batch",
                "2",
                "--max-len",
                "256",
                "--adaptive-draft",
                "--calibrate",
            ]
        )
        == 0
    )
    assert "calibrated on this machine" in capsys.readouterr().out
    measured = json.loads((out / "manifest.json").read_text())["calibration"]
    assert measured["batch_sizes"] == [1, 2] and measured["draft_cost"] > 0 and measured["verify_cost"] >= 0
    # the prices per batch size (for greedy requests), one per measured batch size; the flat ones are their medians
    verify_by_batch, draft_by_batch = (
        tuple(map(tuple, measured[key])) for key in ("verify_cost_by_batch", "draft_cost_by_batch")
    )
    assert [b for b, _ in verify_by_batch] == [b for b, _ in draft_by_batch] == [1, 2]
    assert measured["verify_cost"] == pytest.approx(sum(p for _, p in verify_by_batch) / 2, abs=1e-4)
    config = (out / "triton_repo" / "specdec_engine" / "config.pbtxt").read_text()
    assert _engine_prices(config) == (str(measured["verify_cost"]), str(measured["draft_cost"]))
    assert _engine_prices(config, by_batch=True) == (prices_text(verify_by_batch), prices_text(draft_by_batch))
    calibrated = DraftLength(
        verify_cost=measured["verify_cost"],
        draft_cost=measured["draft_cost"],
        verify_by_batch=verify_by_batch,
        draft_by_batch=draft_by_batch,
    )
    # the engine the server builds from that config (Triton's EngineModel, or a benchmark's local twin); a server
    # never plans a batch (its requests wait for their own answers), so it needs no fixed shares
    served = served_engine(out, read_parameters(out / "triton_repo"))
    assert served.config.draft_length == calibrated
    # `specdec generate` over the export prices its policy the same way, unless told otherwise, and plans its
    # batches with the fixed shares of the calibrated steps
    parser = argparse.ArgumentParser()
    add_generate_args(parser)
    engine = _open_engine(parser.parse_args(["--target", str(out), "--adaptive-draft"]))
    shares = fixed_shares(measured)
    assert [b for b, _ in shares] == [1, 2]
    assert engine.config.draft_length == replace(calibrated, fixed_by_batch=shares)
    pinned = _open_engine(parser.parse_args(["--target", str(out), "--adaptive-draft", "--verify-cost", "0"]))
    assert pinned.config.draft_length == DraftLength(
        verify_cost=0.0, draft_cost=measured["draft_cost"], draft_by_batch=draft_by_batch, fixed_by_batch=shares
    )
    # an explicit price is kept over the measured one in the served config too
    again = tmp_path / "pinned"
    assert (
        export_main(
            [
                "--target",
                str(tiny_dir),
                "--draft",
                str(tiny_dir),
                "--out",
                str(again),
                "--backend",
                backend,
                "--max-batch",
                "2",
                "--max-len",
                "256",
                "--adaptive-draft",
                "--calibrate",
                "--draft-cost",
                "0.5",
            ]
        )
        == 0
    )
    measured = json.loads((again / "manifest.json").read_text())["calibration"]
    config = (again / "triton_repo" / "specdec_engine" / "config.pbtxt").read_text()
    assert _engine_prices(config) == (str(measured["verify_cost"]), "0.5")
    # the pinned draft price has no per-batch variant; the measured verification price keeps its own
    assert _engine_prices(config, by_batch=True) == (prices_text(batch_prices(measured["verify_cost_by_batch"])), "")


def test_generate_calibrates_first_and_stays_exact(tiny_dir, capsys) -> None:
    common = [
        "generate",
        "--target",
        str(tiny_dir),
        "--draft",
        str(tiny_dir),
        "--prompt",
        "hello there",
        "--max-tokens",
        "8",
        "--json",
        "--max-batch",
        "2",
    ]
    assert main([*common, "--method", "ar"]) == 0
    ar = json.loads(capsys.readouterr().out)
    assert main([*common, "--adaptive-draft", "--calibrate"]) == 0
    captured = capsys.readouterr()
    assert "calibrated: a draft token costs" in captured.err
    assert json.loads(captured.out)["outputs"][0]["token_ids"] == ar["outputs"][0]["token_ids"]


@pytest.mark.parametrize("flags", [["--calibrate"], ["--verify-cost", "0.1"], ["--draft-cost", "0.1"]])
def test_prices_without_the_adaptive_draft_length_are_refused(tiny_dir, tmp_path, capsys, flags) -> None:
    out = tmp_path / "never"
    with pytest.raises(SystemExit) as exit_info:
        export_main(["--target", str(tiny_dir), "--out", str(out), *flags])
    assert exit_info.value.code == 2 and "add --adaptive-draft" in capsys.readouterr().err and not out.exists()
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--target", str(tiny_dir), "--prompt", "x", *flags])
    assert exit_info.value.code == 2 and "add --adaptive-draft" in capsys.readouterr().err


def test_build_engine_without_calibrate_keeps_the_defaults(tiny_dir) -> None:
    parser = argparse.ArgumentParser()
    add_generate_args(parser)
    engine = build_engine(parser.parse_args(["--target", str(tiny_dir), "--adaptive-draft"]))
    assert engine.config.draft_length == DraftLength()

"""The command-line interface: ``specdec generate`` and ``specdec-export``."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from specdec.cli import main
from specdec.export.cli import main as export_main


def run_json(capsys, *args: str) -> dict:
    code = main(["generate", *args, "--json"])
    out = capsys.readouterr().out
    assert code == 0, out
    return json.loads(out)


def test_generate_json_in_prompt_order_and_identical_to_ar(tiny_dir, capsys) -> None:
    common = [
        "--target",
        str(tiny_dir),
        "--prompt",
        "one two three one two three",
        "--prompt",
        "Hello",
        "--prompt",
        "a b c d a b c d a b",
        "--max-tokens",
        "12",
    ]
    ems = run_json(capsys, *common, "--method", "ems")
    ar = run_json(capsys, *common, "--method", "ar")
    vanilla = run_json(capsys, *common, "--method", "vanilla")
    assert len(ems["outputs"]) == 3
    assert [o["token_ids"] for o in ems["outputs"]] == [o["token_ids"] for o in ar["outputs"]]
    assert [o["token_ids"] for o in vanilla["outputs"]] == [o["token_ids"] for o in ar["outputs"]]
    for key in (
        "acceptance_rate",
        "target_calls",
        "draft_tokens",
        "accepted_draft_tokens",
        "tokens_per_second",
        "mean_accepted_length",
        "target_rows_padded",
    ):
        assert key in ems["metrics"]
    assert all(isinstance(o["text"], str) for o in ems["outputs"])
    # the adaptive draft length changes how much is drafted, never the greedy tokens
    adaptive = run_json(
        capsys, *common, "--method", "ems", "--draft", str(tiny_dir), "--adaptive-draft", "--num-draft-tokens", "6"
    )
    fixed = run_json(capsys, *common, "--method", "ems", "--draft", str(tiny_dir), "--num-draft-tokens", "6")
    assert [o["token_ids"] for o in adaptive["outputs"]] == [o["token_ids"] for o in ar["outputs"]]
    assert adaptive["metrics"]["draft_tokens"] != fixed["metrics"]["draft_tokens"]
    # rows that cost more are worth fewer drafts
    dear = run_json(
        capsys,
        *common,
        "--method",
        "ems",
        "--draft",
        str(tiny_dir),
        "--adaptive-draft",
        "--num-draft-tokens",
        "6",
        "--verify-cost",
        "2",
    )
    assert dear["metrics"]["draft_tokens"] < adaptive["metrics"]["draft_tokens"]


def test_prompts_file_formats_and_compare_ar(tiny_dir, tmp_path, capsys) -> None:
    listing = tmp_path / "prompts.json"
    listing.write_text(json.dumps(["first prompt", "second prompt"]))
    lines = tmp_path / "prompts.txt"
    lines.write_text("first prompt\n\nsecond prompt\n")
    a = run_json(capsys, "--target", str(tiny_dir), "--prompts-file", str(listing), "--max-tokens", "5")
    b = run_json(capsys, "--target", str(tiny_dir), "--prompts-file", str(lines), "--max-tokens", "5")
    assert [o["token_ids"] for o in a["outputs"]] == [o["token_ids"] for o in b["outputs"]]
    doc = run_json(capsys, "--target", str(tiny_dir), "--prompt", "x y x y", "--max-tokens", "5", "--compare-ar")
    assert "speedup_over_ar" in doc and doc["baseline"]["method"] == "ar"
    assert main(["generate", "--target", str(tiny_dir), "--prompt", "x", "--max-tokens", "3", "--compare-ar"]) == 0
    assert "speed-up of ems over ar" in capsys.readouterr().out


def test_sampling_flags_and_seed_reproducibility(tiny_dir, capsys) -> None:
    args = [
        "--target",
        str(tiny_dir),
        "--prompt",
        "tell me",
        "--max-tokens",
        "10",
        "--temperature",
        "0.9",
        "--top-k",
        "50",
        "--top-p",
        "0.95",
        "--seed",
        "3",
    ]
    assert run_json(capsys, *args)["outputs"] == run_json(capsys, *args)["outputs"]


def test_bad_inputs_exit_nonzero_with_clear_messages(tiny_dir, tmp_path, capsys) -> None:
    assert main(["generate", "--target", "no-such-model"]) == 2
    assert "unknown model 'no-such-model'" in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2]")
    with pytest.raises(SystemExit, match="JSON list of strings"):
        main(["generate", "--target", str(tiny_dir), "--prompts-file", str(bad)])
    with pytest.raises(SystemExit, match="cannot read --prompts-file"):
        main(["generate", "--target", str(tiny_dir), "--prompts-file", str(tmp_path / "missing.txt")])
    # one bad prompt (empty) is reported; the good one still gets its answer
    code = main(
        ["generate", "--target", str(tiny_dir), "--prompt", "fine", "--prompt", "", "--json", "--max-tokens", "4"]
    )
    doc = json.loads(capsys.readouterr().out)
    assert code == 1
    assert doc["outputs"][0]["token_ids"] and "prompt is empty" in doc["outputs"][1]["error"]
    assert main(["generate", "--target", str(tiny_dir), "--prompt", "x", "--temperature", "-1", "--json"]) == 1
    assert "temperature must be >= 0" in capsys.readouterr().out


def test_export_directory_roundtrip_force_and_corruption(tiny_dir, tmp_path, capsys) -> None:
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
                "torch",
                "--adaptive-draft",
                "--verify-cost",
                "0.01",
            ]
        )
        == 0
    )
    engine_config = (out / "triton_repo" / "specdec_engine" / "config.pbtxt").read_text()
    assert 'key: "adaptive_draft" value: { string_value: "1" }' in engine_config
    assert 'key: "verify_cost" value: { string_value: "0.01" }' in engine_config
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["drafter"] == "model" and manifest["target"]["vocab_size"] == manifest["draft"]["vocab_size"]
    assert export_main(["--target", str(tiny_dir), "--out", str(out)]) == 2
    assert "--force" in capsys.readouterr().err
    doc = run_json(capsys, "--target", str(out), "--prompt", "hello there", "--max-tokens", "6")
    assert doc["metrics"]["draft_tokens"] > 0  # the exported draft model was used
    adaptive = run_json(
        capsys, "--target", str(out), "--prompt", "hello there", "--max-tokens", "6", "--adaptive-draft"
    )
    assert adaptive["outputs"][0]["token_ids"] == doc["outputs"][0]["token_ids"]
    assert export_main(["--target", str(tiny_dir), "--out", str(out), "--force", "--backend", "torch"]) == 0
    assert not (out / "draft").exists()
    weights = out / "target" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-8] + b"corrupt!")
    assert main(["generate", "--target", str(out), "--prompt", "x"]) == 2
    assert "does not match its checksum" in capsys.readouterr().err
    assert not any(p.name.startswith(".deploy.partial") for p in tmp_path.iterdir())


def test_export_failure_leaves_nothing(tmp_path, capsys) -> None:
    out = tmp_path / "never"
    assert export_main(["--target", "llama-7b", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "meta-llama/Llama-2-7b-hf" in err and "--target /path/to" in err
    assert list(tmp_path.iterdir()) == []


def test_console_scripts_are_installed() -> None:
    for script in ("specdec", "specdec-export"):
        exe = shutil.which(script) or str(Path(sys.executable).parent / script)
        result = subprocess.run([exe, "--help"], capture_output=True, text=True, timeout=60)
        assert result.returncode == 0 and "usage" in result.stdout


def test_generate_beam_and_dsbd(tiny_dir, capsys) -> None:
    """Greedy dsbd = beam search through the CLI; candidates come back; dsbd without a draft model is refused."""
    common = [
        "--target",
        str(tiny_dir),
        "--prompt",
        "one two three",
        "--prompt",
        "Hello there",
        "--max-tokens",
        "8",
        "--beam-width",
        "3",
        "--num-return-sequences",
        "2",
    ]
    beam = run_json(capsys, *common, "--method", "beam")
    dsbd = run_json(capsys, *common, "--method", "dsbd", "--draft", str(tiny_dir), "--num-draft-tokens", "3")
    assert [o["token_ids"] for o in dsbd["outputs"]] == [o["token_ids"] for o in beam["outputs"]]
    assert all(len(o["sequences"]) == 2 and o["sequences"][0]["token_ids"] == o["token_ids"] for o in dsbd["outputs"])
    assert all(o["metrics"]["accepted_draft_tokens"] > 0 for o in dsbd["outputs"])  # the draft is the target
    sampled = run_json(
        capsys,
        *common,
        "--method",
        "dsbd",
        "--draft",
        str(tiny_dir),
        "--temperature",
        "0.8",
        "--seed",
        "3",
        "--dsbd-threshold",
        "0.5",
    )
    assert all(o["metrics"]["mean_beam_width"] >= 1 for o in sampled["outputs"])
    assert main(["generate", *common, "--method", "dsbd"]) == 2
    assert "needs a draft model" in capsys.readouterr().err
    assert main(["generate", *common, "--method", "beam", "--beam-width", "40", "--max-batch", "8", "--json"]) == 1
    assert "beam_width 40 exceeds" in capsys.readouterr().out


def test_bench_beams_quick_writes_its_report(tiny_dir, tmp_path, capsys) -> None:
    """`specdec bench beams` runs every method of the front and writes json, md and png."""
    out = tmp_path / "beams"
    assert (
        main(["bench", "beams", "--quick", "--target", str(tiny_dir), "--draft", str(tiny_dir), "--out-dir", str(out)])
        == 0
    )
    doc = json.loads((out / "dsbd_pareto.json").read_text())
    assert set(doc["results"]) == {
        "ems",
        "beam W=2",
        "dsbd W_S=2 t=0.5",
        "dsbd W_S=2 t=0",
        "dsbd W_S=2 t=0 adaptive γ",
        "dsbd W_S=2 t=0.5 single-KV",
    }
    assert doc["pareto"] and all(r["tokens"] > 0 for r in doc["results"].values())
    assert doc["results"]["dsbd W_S=2 t=0.5"]["acceptance_rate"] > 0.5  # the draft is the target itself
    assert (out / "dsbd_pareto.png").stat().st_size > 0 and "Pareto front" in (out / "dsbd_pareto.md").read_text()
    assert doc["meta"]["qa_items"] == 2 and all(
        0 <= r["exact_match"] <= r["qa_accuracy"] <= 1 for r in doc["results"].values()
    )
    assert all(len(r["qa_answers"]) == 2 for r in doc["results"].values())
    assert set(doc["meta"]["qa_reference"]) == {"greedy", "beam search W=2"}
    assert all(0 <= v <= 1 for v in doc["meta"]["qa_reference"].values())


def test_the_qa_set_is_extractive_and_exact_match_normalises_only_form() -> None:
    """Every QA answer is a word of its own prompt (extractive), answers vary, and exact match forgives quoting,
    case, a trailing period and "the ... module" but not a different or longer name."""
    from specdec.bench.workloads import exact_match, qa_set

    items = qa_set(12)
    assert len(items) == 12 and len({item.answer for item in items}) >= 10
    for item in items:
        assert f"- {item.answer}: " in item.prompt and item.prompt.count('"') == 2
        assert item.answer in item.choices and len(set(item.choices)) == 5
        assert all(f"- {c}: " in item.prompt for c in item.choices)
    for text in ("heapq", "`heapq`.", "The heapq module", " HEAPQ\nbecause it is", '"heapq"', "The answer is: heapq"):
        assert exact_match(text, "heapq"), text
    for text in ("", "bisect", "heapq is the one", "heapqx", "import heapq"):
        assert not exact_match(text, "heapq"), text


def test_qa_accuracy_takes_the_first_listed_module_the_answer_names() -> None:
    """The first choice named as a whole word decides, in any case and quoting; names inside other words,
    dotted names and unlisted modules do not count."""
    from specdec.bench.workloads import first_choice

    choices = ("heapq", "shutil", "zipfile", "textwrap", "re")
    for text, want in [
        ("The module named `heapq`", "heapq"),
        ('It is "Shutil", not heapq.', "shutil"),
        ("zipfile", "zipfile"),
        ("heapq\nshutil", "heapq"),
        ("The module re handles it", "re"),
        ("There are regular modules; textwrap", "textwrap"),
        ("os.path, not heapq", "heapq"),
        ("The module is NumPy", None),
        ("heapqx and shutilx", None),
        ("", None),
        ("mypkg.shutil is it", None),
    ]:
        assert first_choice(text, choices) == want, text


@pytest.mark.parametrize("value", ["-1", "nan", "cheap"])
def test_a_bad_verify_cost_is_refused_before_any_work(tiny_dir, tmp_path, capsys, value: str) -> None:
    out = tmp_path / "never"
    with pytest.raises(SystemExit) as exit_info:
        export_main(["--target", str(tiny_dir), "--out", str(out), "--adaptive-draft", "--verify-cost", value])
    assert exit_info.value.code == 2 and "--verify-cost" in capsys.readouterr().err
    assert not out.exists()
    with pytest.raises(SystemExit):
        main(["generate", "--target", str(tiny_dir), "--adaptive-draft", "--verify-cost", value, "--prompt", "x"])
    assert "--verify-cost" in capsys.readouterr().err


@pytest.mark.parametrize(
    "flags",
    [
        ["--quantize-from", "fp32"],
        ["--quantize-activations", "fp32"],
        ["--quantize-from", "gguf"],
        ["--quantize-from", "calibrated"],
        ["--quantize-block-size", "64"],
    ],
)
def test_rounding_options_without_quantize_are_refused(tiny_dir, tmp_path, capsys, flags: list[str]) -> None:
    """Ignored, they would leave an fp32 export its user believes rounded their way."""
    out = tmp_path / "never"
    with pytest.raises(SystemExit) as exit_info:
        export_main(["--target", str(tiny_dir), "--out", str(out), *flags])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and f"{flags[0]} shape(s) the rounding" in err
    assert not out.exists()


@pytest.mark.parametrize("value", ["0", "-2", "two"])
def test_client_refuses_a_repeat_count_below_one(value: str, capsys: pytest.CaptureFixture) -> None:
    """``specdec client --repeats`` is refused at parsing (exit 2, the flag named), before any request is sent."""
    import argparse

    from specdec.serving.client import add_client_args

    parser = add_client_args(argparse.ArgumentParser(prog="specdec client"))
    with pytest.raises(SystemExit) as exc:
        parser.parse_args(["--compare-ar", "--repeats", value])
    assert exc.value.code == 2 and "--repeats" in capsys.readouterr().err
    assert parser.parse_args(["--compare-ar", "--repeats", "3"]).repeats == 3


def test_the_client_reports_the_run_of_median_wall_time() -> None:
    from specdec.serving.client import _median_run

    runs = [(["a"], 3.0), (["b"], 1.0), (["c"], 2.0)]
    assert _median_run(runs) == (["c"], 2.0)
    assert _median_run(runs[:2]) == (["b"], 1.0)  # an even count: the faster of the middle two
    assert _median_run(runs[:1]) == (["a"], 3.0)

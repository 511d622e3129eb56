"""An engine over an ONNX Runtime export runs without torch, and reads the same tokenizer the export was made with.

Why it matters: torch's import alone is ~200 MB resident, more than the int4 SmolLM2 graph
(``benchmarks/results/edge_cpu.md``), and an edge engine holds what it runs, nothing else. The
check runs in a fresh process (this one has torch loaded by other tests): it opens the export the
way ``specdec generate --target EXPORT`` does, decodes greedy and sampled requests with ar, ems and
dsbd, and fails if ``torch`` (or transformers' modeling code) was imported on the way.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from specdec.export.cli import main as export_main
from specdec.models.export_meta import load_export_metadata

PROBE = textwrap.dedent("""
    import json, sys
    from specdec.cli import main
    code = main(sys.argv[1:])
    heavy = sorted(m for m in sys.modules if m == "torch" or m.startswith(("torch.", "transformers.models")))
    print(json.dumps({"code": code, "heavy": heavy[:5]}), file=sys.stderr)
""")


@pytest.fixture(scope="module")
def tiny_export(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("meta") / "deploy"
    assert (
        export_main(
            [
                "--target",
                str(tiny_dir),
                "--draft",
                str(tiny_dir),
                "--out",
                str(out),
                "--max-batch",
                "2",
                "--max-len",
                "128",
            ]
        )
        == 0
    )
    return out


@pytest.mark.parametrize(
    "args",
    [
        ["--method", "ems", "--max-tokens", "8"],
        ["--method", "ar", "--temperature", "0.8", "--seed", "3", "--max-tokens", "8"],
        ["--method", "dsbd", "--beam-width", "2", "--temperature", "1", "--seed", "1", "--max-tokens", "6"],
    ],
)
def test_generating_on_an_onnx_export_never_imports_torch(tiny_export: Path, args: list[str]) -> None:
    run = subprocess.run(
        [
            sys.executable,
            "-c",
            PROBE,
            "generate",
            "--target",
            str(tiny_export),
            "--prompt",
            "hello there",
            "--json",
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    report = json.loads(run.stderr.strip().splitlines()[-1])
    assert run.returncode == 0 and report["code"] in (0, None), run.stderr[-2000:]
    assert report["heavy"] == [], f"an ONNX Runtime engine imported {report['heavy']}"
    outputs = json.loads(run.stdout)["outputs"]
    assert outputs and all(o["token_ids"] for o in outputs)


def test_the_exports_tokenizer_encodes_as_the_model_tokenizer(tiny_export: Path) -> None:
    """The torch-free ``PreTrainedTokenizerFast`` over the export's files equals ``AutoTokenizer`` on them."""
    _assert_same_tokenizer(
        load_export_metadata(tiny_export).tokenizer, AutoTokenizer.from_pretrained(str(tiny_export / "target"))
    )


@pytest.mark.real_model
def test_the_real_smollm2_exports_tokenizer_encodes_as_the_model_tokenizer(smollm2_export: Path) -> None:
    meta = load_export_metadata(smollm2_export)
    _assert_same_tokenizer(meta.tokenizer, AutoTokenizer.from_pretrained(str(smollm2_export / "target")))
    assert meta.eos_token_ids and meta.vocab_size == 49152


def _assert_same_tokenizer(fast: object, auto: object) -> None:
    texts = [
        "Hello, world!",
        "  leading spaces and\ttabs\nnew lines",
        "naïve café — 東京 🙂",
        "<|im_start|>user",
        "def f(x):\n    return x ** 2",
    ]
    for text in texts:
        assert fast(text)["input_ids"] == auto(text)["input_ids"], text
        ids = auto(text)["input_ids"]
        assert fast.decode(ids, skip_special_tokens=True) == auto.decode(ids, skip_special_tokens=True)
    assert fast.eos_token_id == auto.eos_token_id and fast.bos_token_id == auto.bos_token_id
    if getattr(auto, "chat_template", None):
        messages = [{"role": "user", "content": "What is 2 + 2?"}]
        assert (
            fast.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)["input_ids"]
            == auto.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)["input_ids"]
        )

"""``specdec-export --quantize``: each strategy's export, exact decoding on its graphs, lossless sampling on them.

The strategies (``specdec.export.quantization.strategies``) come from the flags in one place and
answer one interface; the exported graphs hold no fp32 linear weight, greedy ``ems`` equals greedy
``ar`` on the same quantized graph, and speculative sampling keeps the quantized graph's own law.
The block format is tested in ``test_quantize_blocks.py``, GGUF sources in ``test_quantize_gguf.py``,
the integer chains in ``test_w8a8.py``.
"""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto
from test_lossless_sampling import _TINY as LOSSLESS_TINY
from test_lossless_sampling import (
    MAX_BATCH,
    NUM_SAMPLES,
    NUM_TOKENS,
    PLAIN,
    PROMPT,
    assert_lossless,
    chi_square_pvalue,
    exact_joint,
    marginal_counts,
    total_variation,
)

from specdec.export.cli import main as export_main
from specdec.export.onnx import export_onnx
from specdec.export.quantization.blocks import QuantizeError, quantize_rtn
from specdec.export.quantization.nbits import FP32_ACTIVATIONS, INT8_ACTIVATIONS, embedding_weights
from specdec.export.quantization.sources import EMBEDDING
from specdec.export.quantization.strategies import STRATEGIES, W8A8, WeightBlocks, strategy_for
from specdec.export.quantize import quantize_and_validate
from specdec.models.loading import load_model, tiny_random
from specdec.models.manifest import read_manifest
from specdec.runtime.backends.onnxruntime import OrtBackend
from specdec.runtime.backends.torch_backend import TorchBackend
from specdec.runtime.config import EngineConfig
from specdec.runtime.drafters import make_drafter
from specdec.runtime.engine import Engine
from specdec.runtime.packed import SeqWork, pack
from specdec.runtime.request import Request
from specdec.runtime.sampling import SamplingParams

# -- the strategies ------------------------------------------------------------------------------------


def test_the_flags_build_each_strategy_with_its_settings() -> None:
    assert strategy_for("int4") == WeightBlocks(4, INT8_ACTIVATIONS)
    assert strategy_for("int8", "fp32", source="fp32") == WeightBlocks(8, FP32_ACTIVATIONS, use_gguf=False)
    assert strategy_for("w8a8") == W8A8()
    assert [strategy_for(name).name for name in STRATEGIES] == list(STRATEGIES)  # the manifest's mode
    with pytest.raises(QuantizeError, match="rounds its activations to int8"):
        strategy_for("w8a8", "fp32")
    with pytest.raises(QuantizeError, match="unknown --quantize 'int2'"):
        strategy_for("int2")
    with pytest.raises(QuantizeError, match="unknown --quantize-activations"):
        strategy_for("int4", "int16")


def test_w8a8_settles_its_calibration_on_the_target_for_the_draft_too() -> None:
    """A draft ships no tokenizer: both graphs smooth on the target's calibration prompts (``bind``)."""
    target = SimpleNamespace(tokenizer=None, vocab_size=50)
    bound = W8A8().bind(target)
    assert bound.calibration is not None and all(0 <= i < 50 for ids in bound.calibration for i in ids)
    assert bound.bind(SimpleNamespace(tokenizer=None, vocab_size=7)) is bound  # settled once
    assert WeightBlocks(4).bind(target) == WeightBlocks(4)


# -- quantized exports --------------------------------------------------------------------------------


SOURCES = {"target": "tiny-random:seed=9,num_layers=2", "draft": "tiny-random:seed=10,num_layers=1"}


@pytest.fixture(scope="module", params=["int4", "int8", "w8a8"])
def quantized_export(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    out = tmp_path_factory.mktemp("quantized") / "deploy"
    assert (
        export_main(
            [
                "--target",
                SOURCES["target"],
                "--draft",
                SOURCES["draft"],
                "--quantize",
                request.param,
                "--out",
                str(out),
                "--max-batch",
                "4",
                "--max-len",
                "256",
            ]
        )
        == 0
    )
    return request.param, out


def test_quantized_graphs_have_no_fp32_linear_weights(quantized_export: tuple[str, Path]) -> None:
    mode, out = quantized_export
    manifest = read_manifest(out)
    assert manifest["quantize"] == mode
    for part, layers in (("target", 2), ("draft", 1)):
        info = manifest[part]["quantize"]
        linears = 4 * layers  # qkv, o, gate_up, down per layer; and the head
        integer = mode == "w8a8"  # the layers' linears as w8a8 chains, the head still MatMulNBits
        assert info["mode"] == mode
        assert info["formats"] == ({"w8a8": linears, "rtn": 1} if integer else {"rtn": linears + 1})
        assert info["accuracy_level"] == INT8_ACTIVATIONS
        assert manifest[part]["validation_max_abs_logit_error"] < 1e-4  # the graph itself: tight
        assert info["max_abs_logit_error_vs_fp32"] > 0  # recorded: the rounding
        proto = onnx.load(str(out / manifest[part]["graph"]), load_external_data=False)
        ops = Counter(n.op_type for n in proto.graph.node)
        assert ops["MatMulNBits"] == (1 if integer else linears + 1) and ops["Gemm"] == 0 and ops["MatMul"] == 0
        assert ops["MatMulIntegerToFloat"] == (linears if integer else 0)
        # the embedding table is gathered from the head's own blocks: no fp32 copy of it is left
        assert ops["GatherBlockQuantized"] == 1
        assert info["embedding"] == f"{strategy_for(mode).bits}-bit rtn"
        matrices = {
            i.name
            for i in proto.graph.initializer
            if i.data_type == TensorProto.FLOAT and len(i.dims) == 2 and min(i.dims) > 1
        }
        scales = {n.input[2] for n in proto.graph.node if n.op_type in ("MatMulNBits", "GatherBlockQuantized")}
        assert matrices == scales  # every fp32 matrix left is a table of block scales
        table, source = embedding_weights(out / manifest[part]["graph"])
        fp32 = load_model(SOURCES[part]).state_dict[EMBEDDING].numpy()
        assert source == "rtn" and np.array_equal(table, quantize_rtn(fp32, strategy_for(mode).bits).dequantize())


def test_greedy_ems_equals_ar_on_the_quantized_graphs(quantized_export: tuple[str, Path]) -> None:
    """On the caches a quantized export serves: fp16, as edge runtimes keep them (the manifest says so)."""
    _, out = quantized_export
    assert read_manifest(out)["kv_cache_dtype"] == "float16"
    engine = Engine.from_export(out)
    assert engine.target.np_dtype == np.float16 and engine.drafter.backend.np_dtype == np.float16
    g = torch.Generator().manual_seed(1)
    requests = [
        Request(torch.randint(0, 128, (n,), generator=g).tolist(), max_tokens=m)
        for n, m in ((1, 12), (40, 20), (7, 3), (90, 16))
    ]
    want = engine.generate(requests, "ar").outputs
    got = engine.generate(requests, "ems")
    assert [o.token_ids for o in got.outputs] == [o.token_ids for o in want]
    assert got.run.summary()["draft_tokens"] > 0
    # the target graph drafting for itself accepts its drafts: verification steps of k + 1 rows whose every row
    # must give what a one-row ar step gives it
    from specdec.runtime.drafters import ModelDrafter

    itself = Engine(
        engine.target,
        ModelDrafter(OrtBackend(out / "target" / "model.onnx", cache_dtype="float16"), 4, engine.max_len),
        config=EngineConfig(max_batch=4, max_len=engine.max_len, num_draft_tokens=4),
    )
    selfdrafted = itself.generate(requests, "ems")
    assert [o.token_ids for o in selfdrafted.outputs] == [o.token_ids for o in want]
    assert selfdrafted.run.summary()["acceptance_rate"] > 0.9


@pytest.mark.parametrize(
    "args, message",
    [
        (["--backend", "torch"], "needs --backend onnx"),
        (["--backend", "tensorrt"], "needs --backend onnx"),
        (["--dtype", "float16"], "needs --dtype float32"),
    ],
)
def test_quantize_refuses_what_it_cannot_make(
    tmp_path: Path, capsys: pytest.CaptureFixture, args: list[str], message: str
) -> None:
    out = tmp_path / "deploy"
    assert export_main(["--target", "tiny-random:num_layers=1", "--quantize", "int4", "--out", str(out), *args]) == 2
    assert message in capsys.readouterr().err and not out.exists()


# -- lossless sampling on a quantized target -----------------------------------------------------------


class GraphLaw:
    """``exact_joint``'s model interface over a graph: the logits of every context from the graph itself."""

    def __init__(self, backend: OrtBackend) -> None:
        self.backend = backend

    def to_hf(self) -> GraphLaw:
        return self

    def __call__(self, ids: torch.Tensor) -> SimpleNamespace:
        cache = self.backend.allocate_cache(len(ids), ids.shape[1])
        logits = self.backend.step(pack([SeqWork(i, 0, row.tolist()) for i, row in enumerate(ids)]), cache)
        return SimpleNamespace(logits=logits.reshape(len(ids), ids.shape[1], -1))  # numpy: exact_joint takes both


@pytest.mark.statistical
@pytest.mark.parametrize("mode", ["int4", "w8a8"])
def test_ems_sampling_on_a_quantized_target_is_lossless(tmp_path: Path, mode: str) -> None:
    """The int4 and w8a8 graphs of test_lossless_sampling's target (int8 activations as shipped) as the target:
    its own law, enumerated through the graph, is what ems samples with a draft model.

    Why the graph's law and not the de-quantized model's: int8 activations move this 32-wide model's law
    by TV ~0.035 from the de-quantized weights' (fp32 activations: ~1e-6), close to what the check resolves.
    """
    target = tiny_random(seed=11, init_std=0.4, name="lossless-target", **LOSSLESS_TINY)
    draft = tiny_random(seed=11, init_std=0.32, name="lossless-draft", **LOSSLESS_TINY)
    graph = export_onnx(target, tmp_path / "model.onnx")
    quantize_and_validate(target, graph, strategy_for(mode), tolerance=1e-3)
    backend = OrtBackend(graph)
    law = exact_joint(GraphLaw(backend), PLAIN)
    engine = Engine(
        backend,
        make_drafter("model", model=TorchBackend(draft), max_batch=MAX_BATCH, max_len=32),
        config=EngineConfig(max_batch=MAX_BATCH, max_len=32, num_draft_tokens=2),
    )
    requests = [
        Request(PROMPT, max_tokens=NUM_TOKENS, sampling=SamplingParams(1.0, seed=7 * 10**6 + i))
        for i in range(NUM_SAMPLES)
    ]
    start = time.perf_counter()
    outputs = engine.generate(requests, "ems").outputs
    drafted = sum(o.metrics.draft_tokens for o in outputs)
    acceptance = sum(o.metrics.accepted_draft_tokens for o in outputs) / max(drafted, 1)
    print(f"ems on the {mode} graph: {time.perf_counter() - start:.1f} s, acceptance {acceptance:.3f}")
    assert 0.3 < acceptance < 0.95  # both acceptance and rejection occur thousands of times
    counts = Counter(tuple(o.token_ids[:NUM_TOKENS]) for o in outputs)
    assert_lossless(counts, law, f"ems on {mode} graph T=1")
    if mode != "int4":
        return
    # the check tells the laws apart: int4 moves this target's law far (TV ~0.45), and the samples reject it
    fp32_law = exact_joint(target, PLAIN)
    for keep, axis in ((slice(0, 3), 3), (slice(1, 4), 0)):
        marginal = marginal_counts(counts, keep)
        tv, bound = total_variation(marginal, fp32_law.sum(axis=axis))
        assert chi_square_pvalue(marginal, fp32_law.sum(axis=axis)) < 1e-12 and tv > 2 * bound

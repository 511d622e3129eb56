"""What ``specdec-export --quantize`` costs and gains on SmolLM2-135M (the target), on this CPU.

For the fp32 ONNX graph and each quantized variant of it (``specdec.export.quantize``):

* *greedy agreement*: 16 held-out chat prompts (written here, in none of the repository's prompt
  sets), 64 new tokens each, greedy ``ar`` on the graph; the share of prompts whose answer equals the
  fp32 graph's token for token, and where the others first diverge (token position);
* *held-out perplexity*: the module docstrings (``inspect.getdoc``, the text ``pydoc`` shows) of those
  of 24 standard-library modules that have one of 200+ characters and that no workload of
  ``specdec.bench.workloads`` uses, up to 256 tokens each;
* *max |Δlogit|* on the export validation's random ragged packs, against the fp32 model and against
  the torch reference over the de-quantized weights;
* *step time* (ms, median of repeats, every graph timed interleaved with the others) for decode steps of
  1, 4 and 16 sequences, a verification step of 4 x 5 tokens and a 128-token prefill; the graph's size.

Variants: the GGUF's own blocks (the default for this model: its Q4_1 projections and Q8_0 head,
so the weights equal the fp32 model's) and round-to-nearest blocks of the fp32 weights (what a
second rounding costs; the path every non-GGUF source takes), each at ``accuracy_level`` 4 (int8
activations, what an export ships) and 0 (fp32 activations). A kernel table times one
SmolLM2-sized linear layer in each MatMulNBits form, including float zero points, which the
quantizer does not use (module docstring of ``specdec.export.quantize``).

Writes benchmarks/results/quantize.{json,md}. Takes about 15 minutes (one fp32 export of the real
model, eight quantizations, the greedy runs).
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from specdec.bench.harness import machine_info
from specdec.bench.workloads import held_out_documents
from specdec.export.onnx import export_onnx
from specdec.export.quantization import blocks as q
from specdec.export.quantization import w8a8
from specdec.export.quantization.nbits import matmul_nbits
from specdec.export.quantization.rewrite import one_linear
from specdec.export.quantization.strategies import strategy_for
from specdec.export.quantize import quantize_export
from specdec.export.validate import max_logit_error
from specdec.models.loading import load_model
from specdec.runtime.backends.onnx_edit import MS_DOMAIN
from specdec.runtime.backends.onnxruntime import OrtBackend
from specdec.runtime.backends.torch_backend import TorchBackend
from specdec.runtime.config import EngineConfig
from specdec.runtime.engine import Engine
from specdec.runtime.packed import SeqWork, pack

CHAT_PROMPTS = (
    "Explain in two sentences why the sky looks blue during the day.",
    "Give me three tips for keeping houseplants alive in winter.",
    "What is the difference between a virus and a bacterium?",
    "Write a haiku about a lighthouse in a storm.",
    "How many minutes are there in a week? Show the calculation.",
    "Suggest a name for a bakery that specialises in sourdough bread.",
    "Describe the water cycle to a ten-year-old.",
    "What should I pack for a two-day hiking trip in the mountains?",
    "Translate 'Where is the train station?' into French and Spanish.",
    "Why do cats purr? Answer briefly.",
    "List four renewable sources of energy and one drawback of each.",
    "Write a short apology email for missing a team meeting.",
    "What is photosynthesis, in one paragraph?",
    "Give a simple recipe for a vegetable omelette.",
    "Compare tea and coffee in terms of caffeine and taste.",
    "What are the rules of tic-tac-toe?",
)
MAX_NEW, PPL_TOKENS = 64, 256
#: (label, mode, the GGUF's own blocks, accuracy_level)
VARIANTS = (
    ("int4 gguf L4", "int4", True, 4),
    ("int4 gguf L0", "int4", True, 0),
    ("int8 gguf L4", "int8", True, 4),
    ("int4 rtn L4", "int4", False, 4),
    ("int4 rtn L0", "int4", False, 0),
    ("int8 rtn L4", "int8", False, 4),
    ("int8 rtn L0", "int8", False, 0),
    ("w8a8", "w8a8", True, 4),
)


def perplexity(backend: OrtBackend, documents: list[list[int]]) -> float:
    nll, count = 0.0, 0
    for ids in documents:
        cache = backend.allocate_cache(1, len(ids))
        logits = torch.from_numpy(np.asarray(backend.step(pack([SeqWork(0, 0, ids)]), cache), dtype=np.float64))
        logp = torch.log_softmax(logits[:-1], dim=-1)
        nll -= float(logp.gather(1, torch.tensor(ids[1:])[:, None]).sum())
        count += len(ids) - 1
    return math.exp(nll / count)


SHAPES = (
    ("decode 1x1", 1, 1),
    ("decode 4x1", 4, 1),
    ("verify 4x5", 4, 5),
    ("decode 16x1", 16, 1),
    ("prefill 1x128", 1, 128),
)


def step_times(backends: dict[str, OrtBackend], repeats: int, bar: tqdm) -> dict[str, dict[str, float]]:
    """Median ms per step shape for every graph, interleaved (each repeat times every graph once, the order
    rotated), so load from other jobs on the shared machine drifts over all of them alike."""
    g = torch.Generator().manual_seed(0)
    vocab = next(iter(backends.values())).vocab_size
    times: dict[str, dict[str, list[float]]] = {name: {s[0]: [] for s in SHAPES} for name in backends}
    for label, seqs, n in SHAPES:
        caches = {name: b.allocate_cache(seqs, 512) for name, b in backends.items()}
        prefix = pack(
            [SeqWork(s, 0, torch.randint(0, vocab, (100,), generator=g).tolist(), logits="last") for s in range(seqs)]
        )
        for name, b in backends.items():
            b.step(prefix, caches[name])
        batch = pack(
            [
                SeqWork(s, 100, torch.randint(0, vocab, (n,), generator=g).tolist(), logits="last" if n > 16 else "all")
                for s in range(seqs)
            ]
        )
        names = list(backends)
        for r in range(repeats if n <= 16 else max(3, repeats // 3)):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                start = time.perf_counter()
                backends[name].step(batch, caches[name])
                times[name][label].append(time.perf_counter() - start)
        bar.update()
    return {
        name: {k: round(1e3 * statistics.median(v), 1) for k, v in shapes.items()} for name, shapes in times.items()
    }


def greedy(backend: OrtBackend, model, prompts: list[str]) -> list[list[int]]:
    engine = Engine(
        backend,
        None,
        tokenizer=model.tokenizer,
        eos_token_ids=model.eos_token_ids,
        config=EngineConfig(max_batch=len(prompts), max_len=512),
    )
    requests = [engine.request(p, chat=True, max_tokens=MAX_NEW) for p in prompts]
    return [o.token_ids for o in engine.generate(requests, "ar").outputs]


def divergence(got: list[int], want: list[int]) -> int | None:
    """First position where two answers differ (None: identical)."""
    if got == want:
        return None
    return next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))


def graph_bytes(graph: Path) -> int:
    return sum(p.stat().st_size for p in (graph, graph.with_name(graph.name + ".data")) if p.exists())


def kernel_table(repeats: int) -> list[dict]:
    """One SmolLM2 gate|up layer (N=3072, K=576) in each MatMulNBits form, microseconds per call.

    On one ORT thread: the kernels' own cost, without the spin-waits a second thread suffers when
    other jobs hold the shared cores.
    """
    import gguf
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    n, k = 3072, 576
    weight = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
    q41 = q.from_gguf_blocks("Q4_1", gguf.quants.quantize(weight, gguf.GGMLQuantizationType.Q4_1), k)

    def session(nodes, inits) -> ort.InferenceSession:
        x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["T", k])
        y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["T", n])
        model = helper.make_model(
            helper.make_graph(nodes, "k", [x], [y], inits),
            opset_imports=[helper.make_opsetid("", 20), helper.make_opsetid(MS_DOMAIN, 1)],
        )
        options = ort.SessionOptions()
        options.intra_op_num_threads = 1
        return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])

    def replaced(emit) -> tuple[list, list]:  # the nodes and initializers the quantizer puts in place of one Gemm
        model = one_linear(k, n, emit)
        return list(model.graph.node), list(model.graph.initializer)

    gemm = helper.make_node("Gemm", ["x", "w"], ["y"], name="lin", transB=1)
    cases = {"fp32 Gemm": ([gemm], [numpy_helper.from_array(weight, "w")])}
    forms = (
        ("int4 Q4_1 (centred zero points + offsets)", q41),
        ("int8 Q4_1 codes (+ offsets)", q41.widened(8)),
        ("int4 rtn", q.quantize_rtn(weight, 4)),
        ("int8 rtn", q.quantize_rtn(weight, 8)),
    )
    for label, block in forms:
        for level in (0, 4):
            cases[f"{label} L{level}"] = replaced(lambda g, node, b=block, lv=level: matmul_nbits(g, node, b, [], lv))
    linear = w8a8.quantize_linear(weight, w8a8.smoothing(np.ones(k), weight))
    cases["w8a8 (int8 per channel, activations per token)"] = replaced(
        lambda g, node: w8a8.integer_chain(g, node, linear, {}, rows="x")
    )
    float_zp = [
        numpy_helper.from_array(q.pack_codes(q41.codes, 4), "b"),
        numpy_helper.from_array(q41.scales, "s"),
        numpy_helper.from_array((q41.zero_points - q41.offsets / q41.scales).astype(np.float32), "z"),
    ]
    cases["int4 Q4_1 (float zero points -m/d) L0"] = (
        [
            helper.make_node(
                "MatMulNBits",
                ["x", "b", "s", "z"],
                ["y"],
                domain=MS_DOMAIN,
                K=k,
                N=n,
                bits=4,
                block_size=q.BLOCK_SIZE,
                accuracy_level=0,
            )
        ],
        float_zp,
    )
    sessions = {label: session(nodes, inits) for label, (nodes, inits) in cases.items()}
    rows = {label: {"form": label} for label in sessions}
    names = list(sessions)
    for m in (1, 20, 128):
        x = rng.standard_normal((m, k)).astype(np.float32)
        times: dict[str, list[float]] = {label: [] for label in names}
        for r in range(repeats):  # interleaved, the order rotated (see step_times)
            for label in names[r % len(names) :] + names[: r % len(names)]:
                start = time.perf_counter()
                sessions[label].run(None, {"x": x})
                times[label].append(time.perf_counter() - start)
        for label in names:
            rows[label][f"M={m}"] = round(1e6 * statistics.median(times[label][5:]))
    return list(rows.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=15, help="timed calls per step shape and graph")
    parser.add_argument("--out", default="benchmarks/results/quantize")
    parser.add_argument(
        "--kernels-only",
        action="store_true",
        help="re-time only the one-layer table into an existing result (a quieter moment)",
    )
    args = parser.parse_args()
    out = Path(args.out)
    if args.kernels_only:
        result = json.loads(out.with_suffix(".json").read_text())
        result["kernels"] = kernel_table(args.repeats * 10)
        out.with_suffix(".json").write_text(json.dumps(result, indent=2))
        out.with_suffix(".md").write_text(report(result))
        return
    torch.set_num_threads(1)  # the graphs run on ORT's threads; torch only samples
    model = load_model("smollm2-135m")
    prompts = list(CHAT_PROMPTS)
    documents = held_out_documents(model.tokenizer, PPL_TOKENS)
    bar = tqdm(total=2 + 2 * len(VARIANTS) + len(SHAPES) + 1, desc="quantize quality", unit="stage")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        fp32 = export_onnx(model, Path(tmp) / "fp32" / "model.onnx")
        bar.update()
        graphs = {"fp32": fp32}
        want = greedy(OrtBackend(fp32, intra_op_threads=2), model, prompts)
        rows.append(
            {
                "variant": "fp32",
                "bytes": graph_bytes(fp32),
                "perplexity": perplexity(OrtBackend(fp32, intra_op_threads=2), documents),
                "identical": 1.0,
                "divergence": [],
                "error_vs_fp32": 0.0,
                "error_vs_dequantized": 0.0,
            }
        )
        bar.update()
        for label, mode, use_gguf, level in VARIANTS:
            bar.set_postfix_str(label)
            graph = Path(tmp) / label.replace(" ", "-") / "model.onnx"
            graph.parent.mkdir()
            shutil.copy(fp32, graph)
            shutil.copy(fp32.with_name("model.onnx.data"), graph.with_name("model.onnx.data"))
            strategy = strategy_for(mode, {0: "fp32", 4: "int8"}[level], "gguf" if use_gguf else "fp32")
            reference, summary = quantize_export(model, graph, strategy)
            graphs[label] = graph
            bar.update()
            backend = OrtBackend(graph, intra_op_threads=2)
            points = [divergence(a, b) for a, b in zip(greedy(backend, model, prompts), want)]
            rows.append(
                {
                    "variant": label,
                    "formats": summary["formats"],
                    "bytes": graph_bytes(graph),
                    "perplexity": perplexity(backend, documents),
                    "identical": sum(p is None for p in points) / len(points),
                    "divergence": sorted(p for p in points if p is not None),
                    "error_vs_fp32": max_logit_error(TorchBackend(model), backend),
                    "error_vs_dequantized": max_logit_error(
                        TorchBackend(reference), OrtBackend(graph, intra_op_threads=2)
                    ),
                }
            )
            bar.update()
        bar.set_postfix_str("timing, interleaved")
        steps = step_times({name: OrtBackend(g, intra_op_threads=2) for name, g in graphs.items()}, args.repeats, bar)
        for row in rows:
            row["steps_ms"] = steps[row["variant"]]
    kernels = kernel_table(args.repeats * 10)
    bar.update()
    bar.close()
    result = {
        "machine": machine_info(),
        "model": "smollm2-135m",
        "prompts": len(prompts),
        "max_new_tokens": MAX_NEW,
        "perplexity_documents": len(documents),
        "perplexity_tokens": sum(len(d) - 1 for d in documents),
        "rows": rows,
        "kernels": kernels,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=2))
    out.with_suffix(".md").write_text(report(result))
    print(report(result))


def report(result: dict) -> str:
    lines = [
        "# `specdec-export --quantize` on SmolLM2-135M-Instruct (target)",
        "",
        "Produced by `python -m benchmarks.quantize_quality` (raw numbers: `quantize.json`). Machine: "
        f"{result['machine']['processor']}, ORT on 2 threads, shared with other jobs (timings are medians and noisy).",
        "",
        f"Greedy: {result['prompts']} held-out chat prompts, {result['max_new_tokens']} new tokens, `ar` at batch "
        f"{result['prompts']}, compared with the fp32 graph token for token. Perplexity: "
        f"{result['perplexity_documents']} standard-library module docstrings no workload uses "
        f"({result['perplexity_tokens']} predicted tokens). Max |Δlogit|: the export validation's random ragged packs.",
        "",
        "`gguf`: the GGUF's own Q4_1 / Q8_0 blocks (the weights equal the fp32 model's, which *is* the de-quantized "
        "GGUF); `rtn`: round-to-nearest blocks of the fp32 weights (a second rounding). `L4`: accuracy_level 4, "
        "int8 activations (what an export ships); `L0`: fp32 activations. `w8a8`: `--quantize w8a8` "
        "(`specdec.export.w8a8`: the decoder layers' weights rounded again to int8 per output channel, activations "
        "to int8 per token, smoothed on calibration prompts; ONNX Runtime's integer GEMM; the head the GGUF's Q8_0).",
        "",
        "Step times: median ms per step of each shape (sequences x new tokens; prefill: one 128-token prompt), all "
        "graphs timed interleaved, the order rotated every repeat, on a machine shared with other jobs.",
        "",
        "| variant | size MB | "
        + " | ".join(f"{label} ms" for label, _, _ in SHAPES)
        + " | identical answers | first divergence (tokens) | perplexity | max Δlogit vs fp32 | vs de-quantized |",
        "|---|---|" + "---|" * len(SHAPES) + "---|---|---|---|---|",
    ]
    for r in result["rows"]:
        div = ", ".join(str(d) for d in r["divergence"]) or "-"
        steps = " | ".join(str(r["steps_ms"][label]) for label, _, _ in SHAPES)
        lines.append(
            f"| {r['variant']} | {r['bytes'] / 1e6:.0f} | {steps} | {r['identical']:.0%} | {div} | "
            f"{r['perplexity']:.3f} | {r['error_vs_fp32']:.3g} | {r['error_vs_dequantized']:.3g} |"
        )
    lines += [
        "",
        "## One linear layer (gate|up, N=3072, K=576), µs per call, by rows M (one ORT thread)",
        "",
        "| form | M=1 | M=20 | M=128 |",
        "|---|---|---|---|",
    ]
    for k in result["kernels"]:
        lines.append(f"| {k['form']} | {k['M=1']} | {k['M=20']} | {k['M=128']} |")
    lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    main()

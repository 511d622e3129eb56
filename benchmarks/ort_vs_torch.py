"""ONNX Runtime (exported graph, function-body attention) vs the torch backend on this CPU.

Measures, side by side in one process (the machine is shared and noisy, so methods and
backends are interleaved and the median of repeats is kept):

1. tokens/s of ``ar`` and ``ems`` (n-gram drafter, greedy, the extraction workload of
   ``specdec bench``) on SmolLM2-135M at batch 1 and 8, for both backends, checking that
   every output equals torch ``ar`` token for token;
2. ms per call of one attention layer in a ragged verification step: the ONNX
   function body (what ORT runs for ``specdec::RaggedTreeAttention``) vs the torch
   reference loop. The GroupQueryAttention rewrite is not used by the loader (see notes).

Writes benchmarks/results/ort_vs_torch.{json,md,png}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from specdec.bench.figures import figure
from specdec.bench.harness import machine_info, run_command
from specdec.bench.workloads import build_workload
from specdec.export.cli import export
from specdec.export.validate import random_forest
from specdec.models.loading import load_model
from specdec.plugins import onnx_op
from specdec.plugins.reference import ragged_tree_attention
from specdec.runtime.config import EngineConfig
from specdec.runtime.engine import Engine
from specdec.runtime.packed import SeqWork, pack


def decode_throughput(
    engines: dict[str, Engine], prompts: list[str], batch: int, max_tokens: int, repeats: int, bar: tqdm
) -> dict:
    """Median tokens/s per (backend, method); outputs checked against torch ar."""
    reference = engines["torch"]
    requests = [reference.request(p, chat=True, max_tokens=max_tokens) for p in prompts[:batch]]
    times: dict[str, list[float]] = {}
    identical = True
    want = None
    for _ in range(repeats):
        for backend, engine in engines.items():
            for method in ("ar", "ems"):
                result = engine.generate(requests, method)
                tokens = [o.token_ids for o in result.outputs]
                want = want or tokens
                identical &= tokens == want
                s = result.run.summary()
                times.setdefault(f"{backend}/{method}", []).append(s["tokens_per_second"])
                bar.update()
    row = {key: round(statistics.median(v), 3) for key, v in times.items()}
    row["identical_to_torch_ar"] = identical
    return row


def attention_ms(num_heads: int, num_kv_heads: int, head_dim: int, repeats: int = 20) -> dict:
    """One attention layer on a verification step of 8 sequences (forests of 4-8 nodes, past 100-400)."""
    import onnxruntime as ort

    g = torch.Generator().manual_seed(0)
    import random

    rng = random.Random(0)
    slots, max_len = 8, 512
    work = [
        SeqWork(s, rng.randint(100, 400), [1] * (n := rng.randint(4, 8)), parents=random_forest(rng, n))
        for s in range(slots)
    ]
    batch = pack(work)
    t = batch.num_tokens
    q = torch.randn(t, num_heads, head_dim, generator=g)
    k = torch.randn(t, num_kv_heads, head_dim, generator=g)
    v = torch.randn(t, num_kv_heads, head_dim, generator=g)
    kc = torch.randn(slots, num_kv_heads, max_len, head_dim, generator=g)
    vc = torch.randn(slots, num_kv_heads, max_len, head_dim, generator=g)
    scale = head_dim**-0.5
    cu, past, sl = batch.cu_seqlens.tolist(), batch.past_lens.tolist(), batch.slot_ids.tolist()
    ragged_tree_attention(q, k, v, kc, vc, cu, past, sl, batch.tree_mask, scale)
    start = time.perf_counter()
    for _ in range(repeats):
        ragged_tree_attention(q, k, v, kc, vc, cu, past, sl, batch.tree_mask, scale)
    torch_ms = (time.perf_counter() - start) / repeats * 1000
    model = onnx_op.attention_model(scale=scale, num_heads=num_heads, num_kv_heads=num_kv_heads, opset=20)
    options = ort.SessionOptions()
    options.intra_op_num_threads = torch.get_num_threads()
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    binding = session.io_binding()
    feeds = {
        "q": q,
        "k": k,
        "v": v,
        "cu_seqlens": batch.cu_seqlens,
        "past_lens": batch.past_lens,
        "slot_ids": batch.slot_ids,
        "tree_mask": batch.tree_mask,
    }
    for name, tensor in feeds.items():
        binding.bind_cpu_input(name, tensor.numpy())
    for name, out_name, buf in (("k_cache", "k_cache_out", kc), ("v_cache", "v_cache_out", vc)):
        binding.bind_input(name, "cpu", 0, torch.zeros(0).numpy().dtype, list(buf.shape), buf.data_ptr())
        binding.bind_output(out_name, "cpu", 0, torch.zeros(0).numpy().dtype, list(buf.shape), buf.data_ptr())
    binding.bind_output("out")
    session.run_with_iobinding(binding)
    start = time.perf_counter()
    for _ in range(repeats):
        session.run_with_iobinding(binding)
    ort_ms = (time.perf_counter() - start) / repeats * 1000
    return {
        "tokens": t,
        "sequences": slots,
        "torch_reference_ms": round(torch_ms, 3),
        "onnx_function_body_ms": round(ort_ms, 3),
        "gqa_rewrite_ms": None,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", default="1,8")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--num-draft-tokens", type=int, default=5)
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="intra-op threads for torch and ONNX Runtime alike (1: steadiest on a shared 2-core box)",
    )
    parser.add_argument("--out-dir", default="benchmarks/results")
    args = parser.parse_args(argv)
    batches = [int(b) for b in args.batch_sizes.split(",")]
    torch.set_num_threads(args.threads)
    target = load_model("smollm2-135m")
    with tempfile.TemporaryDirectory() as tmp:
        deploy = export("smollm2-135m", None, Path(tmp) / "deploy", max_batch=max(batches), max_len=2048)
        engines = {
            "torch": Engine.from_models(
                target,
                config=EngineConfig(max_batch=max(batches), max_len=2048, num_draft_tokens=args.num_draft_tokens),
            ),
            "onnxruntime": Engine.from_export(
                deploy, config=EngineConfig(num_draft_tokens=args.num_draft_tokens, threads=args.threads)
            ),
        }
        prompts = build_workload(max(batches))
        results: dict = {}
        with tqdm(total=len(batches) * args.repeats * 4, desc="ort vs torch") as bar:
            for batch in batches:
                results[str(batch)] = decode_throughput(engines, prompts, batch, args.max_tokens, args.repeats, bar)
    cfg = target.config
    layer = attention_ms(cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    doc = {
        "decode_tokens_per_second": results,
        "attention_layer_ms": layer,
        "machine": machine_info(),
        "command": run_command("benchmarks.ort_vs_torch", argv),
    }
    (out / "ort_vs_torch.json").write_text(json.dumps(doc, indent=2))
    lines = [
        "# ONNX Runtime vs torch backend (SmolLM2-135M, CPU)",
        "",
        f"Command: `{doc['command']}`  ",
        f"Machine: {doc['machine']}  ",
        f"Threads: {args.threads} intra-op thread(s) for both runtimes",
        "",
        "| batch | torch ar | torch ems | ORT ar | ORT ems | ORT/torch (ar) | ORT/torch (ems) | identical |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for batch, row in results.items():
        lines.append(
            f"| {batch} | {row['torch/ar']:.1f} | {row['torch/ems']:.1f} | {row['onnxruntime/ar']:.1f} | "
            f"{row['onnxruntime/ems']:.1f} | {row['onnxruntime/ar'] / row['torch/ar']:.2f}x | "
            f"{row['onnxruntime/ems'] / row['torch/ems']:.2f}x | {row['identical_to_torch_ar']} |"
        )
    lines += [
        "",
        "tokens/s, greedy, n-gram drafter, median of repeats, prefill included.",
        "",
        "## One attention layer of a verification step (8 sequences, forests of 4-8 nodes, past 100-400)",
        "",
        "| torch reference (ms) | ONNX function body in ORT (ms) | GQA rewrite (ms) |",
        "|---|---|---|",
        f"| {layer['torch_reference_ms']} | {layer['onnx_function_body_ms']} | not used |",
    ]
    (out / "ort_vs_torch.md").write_text("\n".join(lines) + "\n")
    with figure(out / "ort_vs_torch.png", figsize=(6, 4)) as (_, ax):
        keys = ["torch/ar", "torch/ems", "onnxruntime/ar", "onnxruntime/ems"]
        width = 0.2
        for i, key in enumerate(keys):
            ax.bar([j + i * width for j in range(len(results))], [results[b][key] for b in results], width, label=key)
        ax.set_xticks([j + 1.5 * width for j in range(len(results))], [f"batch {b}" for b in results])
        ax.set_ylabel("tokens/s")
        ax.set_title("SmolLM2-135M on CPU: ONNX Runtime vs torch")
        ax.legend()
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

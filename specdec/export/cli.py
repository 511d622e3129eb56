"""``specdec-export``: resolve a target/draft pair and write a self-contained deployment directory.

Layout of ``--out DIR`` (default ``exports/<target name>``)::

    DIR/manifest.json      what was exported, from what, with which versions and checksums
    DIR/target/            the target as a Hugging Face directory (config, safetensors, tokenizer)
    DIR/draft/             the draft model, when ``--draft`` names one (absent for the n-gram drafter);
                           with ``head_token_ids.json`` when its LM head is restricted to K target tokens
    DIR/triton_repo/       the Triton model repository serving it (``specdec serve DIR``)

With ``--backend onnx`` (the default) each model directory holds ``model.onnx`` (+ ``.data``)
and its config/tokenizer instead of safetensors; ``--backend tensorrt`` adds ``model.engine``.
``--quantize int4|int8`` makes every linear layer of both graphs a weight-only block-quantized
``MatMulNBits`` (``specdec.export.quantize``; a GGUF source keeps its own blocks); ``--quantize w8a8``
makes the decoder layers' linears integer GEMMs over per-channel int8 weights and per-token int8
activations, smoothed on calibration prompts (``specdec.export.quantization.w8a8``: faster prefill and batches).
Every graph is validated against the torch reference before the export is declared done.

The directory is assembled under a temporary name and renamed into place only when
complete, so an interrupted export never leaves something that looks valid.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import resource
import shlex
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import torch
from tqdm.auto import tqdm

from specdec.export.quantization.blocks import BLOCK_SIZE, BLOCK_SIZES
from specdec.export.quantization.nbits import ACTIVATIONS
from specdec.export.quantization.strategies import SOURCES, STRATEGIES, QuantizationStrategy, strategy_for
from specdec.models.drafts import check_draft_compatible, resolve_draft
from specdec.models.errors import ModelResolutionError
from specdec.models.loading import LoadedModel, atomic_directory, load_model, save_model
from specdec.models.manifest import FORMAT_VERSION, MANIFEST, ExportDirError, checksums, read_manifest
from specdec.models.presets import DEFAULT_TARGET, PRESETS
from specdec.runtime.config import (
    DEFAULT_MAX_BATCH,
    DEFAULT_MAX_LEN,
    DEFAULT_NUM_DRAFT_TOKENS,
    DrafterKind,
    EngineConfig,
)
from specdec.runtime.costs import DraftCosts, calibrate_engine
from specdec.runtime.draft_length import add_draft_length_args, check_draft_length_args
from specdec.serving.repository import REPOSITORY_DIR, ServingOptions, write_repository


def _describe(model: LoadedModel, sub: str, root: Path, dtype: str) -> dict:
    cfg = model.config
    return {
        "name": model.name,
        "source": model.source,
        "path": sub,
        "vocab_size": model.vocab_size,
        # logits columns: vocab_size, or K for a restricted head (its map is head_token_ids.json in the model dir)
        "head_size": model.vocab_size if model.head_token_ids is None else len(model.head_token_ids),
        "num_layers": int(cfg.num_hidden_layers),
        "hidden_size": int(cfg.hidden_size),
        "num_heads": int(cfg.num_attention_heads),
        "num_kv_heads": int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads),
        "head_dim": int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads),
        "dtype": dtype,
        "weights_checksum": model.checksum(),
    }


BACKENDS = ("onnx", "tensorrt", "torch")
VALIDATION_TOLERANCE = {"float32": 1e-3, "float16": 0.25}


def _export_model(
    model: LoadedModel,
    sub: str,
    tmp: Path,
    backend: str,
    dtype: str,
    stages: tqdm,
    max_batch: int,
    max_len: int,
    quantize: QuantizationStrategy | None = None,
) -> dict:
    """Write one model under ``tmp/sub`` and check the graph against the torch reference.

    A quantized graph is checked against the torch backend over its de-quantized weights
    (``quantize.quantize_and_validate``): the check tests the graph, not the rounding.
    """
    save_model(model, tmp / sub, weights=backend == "torch")
    info: dict = {}
    if backend in ("onnx", "tensorrt"):
        from specdec.export.onnx import export_onnx, torch_dtype
        from specdec.export.validate import max_logit_error
        from specdec.runtime.backends.onnxruntime import OrtBackend
        from specdec.runtime.backends.torch_backend import TorchBackend

        stages.set_postfix_str(f"{sub}: ONNX export")
        graph = export_onnx(model, tmp / sub / "model.onnx", torch_dtype(dtype))
        stages.update()
        if quantize:
            from specdec.export.quantize import quantize_and_validate

            stages.set_postfix_str(f"{sub}: {quantize.name} quantization, validating on random ragged forests")
            quantized = quantize_and_validate(model, graph, quantize, VALIDATION_TOLERANCE[dtype])
            error = quantized["validation_max_abs_logit_error_fp32_activations"]
            stages.update()
        else:
            stages.set_postfix_str(f"{sub}: validating on random ragged forests")
            # the reference runs in the graph's dtype: the same math, and no fp32 copy of a 7B model beside the graph
            error = max_logit_error(TorchBackend(model, dtype=torch_dtype(dtype)), OrtBackend(graph))
            if error > VALIDATION_TOLERANCE[dtype]:
                raise ExportDirError(
                    f"{sub}: exported graph differs from the torch reference by {error:.3g} "
                    f"(tolerance {VALIDATION_TOLERANCE[dtype]}): not writing a broken export"
                )
        info = {"graph": f"{sub}/model.onnx", "validation_max_abs_logit_error": error}
        if quantize:
            info["quantize"] = quantized
        if backend == "tensorrt":
            from specdec.export.tensorrt import ProfileSpec, build_engine

            stages.set_postfix_str(f"{sub}: TensorRT engine")
            engine = build_engine(
                graph, tmp / sub / "model.engine", dtype, profile=ProfileSpec.derive(max_batch, max_len)
            )
            info["engine"] = str(engine.relative_to(tmp))
    stages.update()
    return {**_describe(model, sub, tmp, dtype), **info}


def export(
    target: str,
    draft: str | None,
    out: Path,
    force: bool = False,
    backend: str = "onnx",
    dtype: str = "float32",
    max_batch: int = DEFAULT_MAX_BATCH,
    max_len: int = DEFAULT_MAX_LEN,
    serving: ServingOptions | None = None,
    calibrate: bool = False,
    quantize: QuantizationStrategy | None = None,
    offline: bool = False,
    command: Sequence[str] | None = None,
    kv_cache: str | None = None,
) -> Path:
    """Write ``out`` (see module docstring); refuses an existing directory unless ``force``.

    ``quantize``: the quantization of the target and draft graphs (``strategy_for`` builds it from the
    flags), ONNX Runtime only (its ops are ORT contrib ops) and an fp32 graph only.
    ``kv_cache``: the type the served KV caches are stored in ("float16" halves an fp32 graph's, ONNX
    Runtime only: ``specdec.runtime.backends.ort_cache_dtype``); default: float16 for a quantized
    export (an edge runtime's caches), the graph's dtype otherwise.

    ``calibrate``: time the exported graphs on this machine and price the adaptive draft length
    with what they cost (``specdec.runtime.costs``): the manifest keeps the measurement and the
    served engine's config the prices, except those ``serving`` sets explicitly. Export on the
    hardware that will serve, or set the prices by hand.

    The target is read in ``dtype`` (a 7B fp16 checkpoint is never held in fp32) and fetched from the
    Hub when it is a Hub model missing from the Hugging Face cache, unless ``offline``.
    """
    if backend not in BACKENDS:
        raise ExportDirError(f"unknown backend {backend!r}: choose one of {', '.join(BACKENDS)}")
    if dtype not in VALIDATION_TOLERANCE:
        raise ExportDirError(f"unsupported dtype {dtype!r}: choose float32 or float16")
    if quantize is not None:
        _check_quantize(quantize.name, backend, dtype)
    kv_cache = _kv_cache_dtype(kv_cache, backend, dtype, quantize)
    if out.exists() and not force:
        raise ExportDirError(f"{out} already exists: pass --force to overwrite it")
    if backend == "tensorrt":
        from specdec.plugins.trt_plugin import require_tensorrt

        require_tensorrt()
    from specdec import __version__

    with atomic_directory(out) as tmp:
        per_model = 1 if backend == "torch" else 2 if not quantize else 3
        stages = tqdm(total=1 + per_model * (2 if draft else 1), desc="export", unit="stage")
        stages.set_postfix_str("loading models")
        with _hub_offline(offline):
            target_model = load_model(target, _load_dtype(target, dtype), offline=offline)
            draft_model = resolve_draft(draft, target_model) if draft else None
        if draft_model is not None:
            check_draft_compatible(target_model, draft_model)
        if quantize is not None:
            quantize = quantize.bind(target_model)  # what the target settles for both graphs (w8a8: calibration)
        stages.update()
        manifest = {
            "specdec_export": FORMAT_VERSION,
            "specdec_version": __version__,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            # the command as a shell would run it again (a pod's init container does): ``command``, else this process's
            "command": shlex.join(["specdec-export", *(sys.argv[1:] if command is None else command)]),
            "python": platform.python_version(),
            "backend": backend,
            "dtype": dtype,
            "max_batch": max_batch,
            "max_len": max_len,
            "drafter": (DrafterKind.MODEL if draft_model is not None else DrafterKind.NGRAM).value,
            "quantize": quantize.name if quantize else None,
            "kv_cache_dtype": kv_cache,
            "target": _export_model(
                target_model,
                "target",
                tmp,
                backend,
                dtype,
                stages,
                max_batch,
                max_len,
                quantize,
            ),
        }
        if draft_model is not None:
            manifest["draft"] = _export_model(
                draft_model,
                "draft",
                tmp,
                backend,
                dtype,
                stages,
                max_batch,
                max_len,
                quantize,
            )
        manifest["versions"] = _versions()
        for part in ("target", "draft"):
            if part in manifest:
                manifest[part]["files"] = checksums(tmp, part)
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2))
        if calibrate:
            stages.set_postfix_str("timing the graphs")
            costs = _calibrate(tmp, max_batch, serving)
            manifest["calibration"] = costs.as_dict()
            (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2))
            serving = (serving or ServingOptions()).priced(costs)
        write_repository(tmp, tmp / REPOSITORY_DIR, serving)
        stages.close()
    return out


def _load_dtype(target: str, dtype: str) -> torch.dtype:
    """The dtype the target's weights are read in: the export's, except for a GGUF source.

    Why: a 7B checkpoint read in fp32 is 27 GB before the export starts; read in fp16 it is what
    the graph holds. A GGUF source is de-quantized to fp32 from its blocks and is small, and its
    shipped drafts name it by the checksum of those fp32 values, so it stays fp32 (cast per graph).
    """
    from specdec.export.onnx import torch_dtype

    preset = PRESETS.get(target)
    if (preset is not None and preset.gguf_file) or str(target).endswith(".gguf"):
        return torch.float32
    return torch_dtype(dtype)


@contextmanager
def _hub_offline(offline: bool) -> Iterator[None]:
    """``HF_HUB_OFFLINE=1`` while the models are resolved, so ``--offline`` also holds for a Hub draft."""
    before = os.environ.get("HF_HUB_OFFLINE")
    if offline:
        os.environ["HF_HUB_OFFLINE"] = "1"
    try:
        yield
    finally:
        if offline:
            if before is None:
                os.environ.pop("HF_HUB_OFFLINE", None)
            else:
                os.environ["HF_HUB_OFFLINE"] = before


def default_out(target: str) -> Path:
    """``exports/<target name>``: a preset's name, a directory's or Hub id's last part, a GGUF file's stem."""
    name = Path(str(target).rstrip("/")).name
    name = name[: -len(".gguf")] if name.endswith(".gguf") else name
    return Path("exports") / (re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-.") or "model")


def peak_rss_bytes() -> int:
    """This process's peak resident memory so far (``ru_maxrss``: KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def _check_quantize(quantize: str, backend: str, dtype: str) -> None:
    """Refuse what ``--quantize`` cannot make: a graph only ONNX Runtime runs, with fp32 activations."""
    if backend != "onnx":
        raise ExportDirError(
            f"--quantize {quantize} needs --backend onnx: MatMulNBits is an ONNX Runtime contrib op "
            f"that {backend} does not run"
        )
    if dtype != "float32":
        raise ExportDirError(
            f"--quantize {quantize} needs --dtype float32 (fp32 activations and scales): "
            "ONNX Runtime's CPU MatMulNBits has no fast fp16 path off ARM"
        )


def _check_quantize_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse the options that shape ``--quantize``'s rounding when nothing is quantized: ignored, they would
    let a user believe an fp32 export was rounded their way."""
    if args.quantize is None:
        given = [
            flag
            for flag, value in (
                ("--quantize-activations", args.quantize_activations),
                ("--quantize-from", args.quantize_from),
                ("--quantize-block-size", args.quantize_block_size if args.quantize_block_size != BLOCK_SIZE else None),
            )
            if value is not None
        ]
        if given:
            parser.error(
                f"{', '.join(given)} shape(s) the rounding of --quantize: add --quantize {'|'.join(STRATEGIES)}"
            )


def _kv_cache_dtype(kv_cache: str | None, backend: str, dtype: str, quantize: QuantizationStrategy | None) -> str:
    """The served caches' type: ``kv_cache``, else fp16 for a quantized export and the graph's dtype otherwise."""
    chosen = kv_cache or ("float16" if quantize else dtype)
    if chosen not in VALIDATION_TOLERANCE:
        raise ExportDirError(f"unknown --kv-cache {chosen!r}: choose float32 or float16")
    if chosen == dtype:
        return chosen
    if dtype == "float16":
        raise ExportDirError("--kv-cache float32 needs --dtype float32: an fp16 graph computes attention in fp16")
    if backend != "onnx":
        raise ExportDirError(
            f"--kv-cache float16 on a float32 graph needs --backend onnx (ONNX Runtime narrows the "
            f"caches when it opens the graph); {backend} keeps the graph's: use --dtype float16"
        )
    return chosen


def _calibrate(root: Path, max_batch: int, serving: ServingOptions | None) -> DraftCosts:
    """The draft and verification prices of the graphs in ``root``, on the backend and threads that will serve."""
    from specdec.runtime.engine import Engine

    threads = (serving.intra_op_threads if serving else 0) or None
    before = torch.get_num_threads()  # timed as served (torch on one thread), then restored for the caller
    try:
        # room for the batch sizes and the context calibrate_engine times (its defaults: 1, 4, 8 and 256 tokens)
        engine = Engine.from_export(
            root, config=EngineConfig(max_batch=min(8, max_batch), max_len=512, threads=threads, torch_threads=1)
        )
        return calibrate_engine(engine)
    finally:
        torch.set_num_threads(before)


def _versions() -> dict[str, str]:
    import importlib.metadata as md

    found = {}
    for pkg in ("torch", "transformers", "onnx", "onnxscript", "onnxruntime", "tensorrt"):
        try:
            found[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            continue
    return found


def _device_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"--gpus takes comma-separated device ids, e.g. 0,1 (got {text!r})") from None


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="specdec-export", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--target", default=DEFAULT_TARGET, help="preset, Hugging Face directory or .gguf file")
    parser.add_argument("--draft", help="draft model (preset, directory, .gguf) or 'none' for the n-gram drafter")
    parser.add_argument(
        "--backend",
        choices=BACKENDS,
        default="onnx",
        help="onnx (ONNX Runtime, default), tensorrt (engine; NVIDIA GPU) or torch (weights only)",
    )
    parser.add_argument("--dtype", choices=sorted(VALIDATION_TOLERANCE), default="float32")
    parser.add_argument(
        "--quantize",
        choices=STRATEGIES,
        help="int4/int8: weight-only block-quantized linear layers (MatMulNBits; a GGUF source keeps "
        "its blocks); w8a8: int8 weights per channel and int8 activations per token in the decoder "
        "layers (ORT's integer GEMM: faster prefill and batches, a second rounding of the weights)",
    )
    parser.add_argument(
        "--quantize-activations",
        choices=sorted(ACTIVATIONS),
        help="with --quantize: int8 (default) runs ORT's int8 kernels, fast and row-independent "
        "(greedy ems = ar bit for bit); fp32 computes the stored weights in fp32 (answers equal the "
        "fp32 export's), slower above one row",
    )
    parser.add_argument(
        "--quantize-from",
        choices=SOURCES,
        help="with --quantize: gguf (default) keeps a block-quantized GGUF's own blocks bit for bit (Q4_1's "
        "offsets run beside each MatMulNBits); fp32 rounds the fp32 weights to nearest instead, as ONNX Runtime "
        "GenAI's model builder does: one node per linear and a faster step, a second rounding; calibrated "
        "rounds them too, each block's range chosen for the least error on calibration prompts' inputs: "
        "the same step, closer to fp32 (int4/int8; benchmarks/results/graph_fidelity_rounding.md)",
    )
    parser.add_argument(
        "--quantize-block-size",
        type=int,
        choices=BLOCK_SIZES,
        default=BLOCK_SIZE,
        help="with --quantize int4/int8 rounded from fp32: the decoder layers' weights per block (default "
        f"{BLOCK_SIZE}, a GGUF's own; the LM head keeps 32); wider blocks are faster per row, and the backend then "
        "runs a one-token step as two rows so that speculation stays exact (docs/export.md; "
        "benchmarks/results/block_sizes.md)",
    )
    parser.add_argument(
        "--kv-cache",
        choices=("float32", "float16"),
        help="the type the served KV caches are stored in (default: float16 with --quantize, as edge "
        "runtimes keep them, else --dtype); float16 over a float32 graph: ONNX Runtime only",
    )
    parser.add_argument(
        "--drafter",
        choices=(DrafterKind.NGRAM.value, DrafterKind.HYBRID.value),
        help="served drafter: ngram (prompt lookup), or hybrid (prompt lookup where the context "
        "matches, the --draft model elsewhere); default: the draft model, or ngram without one",
    )
    parser.add_argument(
        "--max-batch", type=int, default=DEFAULT_MAX_BATCH, help="sequences decoded together (KV slots)"
    )
    parser.add_argument("--max-len", type=int, default=DEFAULT_MAX_LEN, help="KV-cache length per sequence")
    parser.add_argument("--out", help="output directory (default: exports/<target name>)")
    parser.add_argument(
        "--offline",
        action="store_true",
        help="use only the Hugging Face cache, never the network (as HF_HUB_OFFLINE=1)",
    )
    parser.add_argument("--force", action="store_true", help="overwrite an existing --out")
    parser.add_argument(
        "--num-draft-tokens",
        type=int,
        default=DEFAULT_NUM_DRAFT_TOKENS,
        help="served k when a request does not say",
    )
    add_draft_length_args(parser)
    parser.add_argument(
        "--intra-op-threads", type=int, default=0, help="ONNX Runtime threads of the served engine (0 = all cores)"
    )
    parser.add_argument(
        "--prefill-budget",
        type=int,
        default=ServingOptions.prefill_budget,
        help="rows a served ragged step may spend on prompt prefills: longer prompts are prefilled "
        f"in chunks beside running streams (default {ServingOptions.prefill_budget}; 0: whole)",
    )
    parser.add_argument(
        "--instances",
        type=int,
        default=1,
        help="served engine instances (each its own process, loops and KV caches): on the host, or "
        "on each of --gpus (default 1)",
    )
    parser.add_argument(
        "--gpus",
        type=_device_list,
        default=(),
        help="comma-separated GPU ids the engine instances run on (KIND_GPU); default: the host",
    )
    args = parser.parse_args(argv)
    check_draft_length_args(parser, args)
    _check_quantize_args(parser, args)
    draft = None if args.draft in (None, "none", "ngram") else args.draft
    out_dir = Path(args.out) if args.out else default_out(args.target)
    if not args.out:
        print(f"writing the export to {out_dir} (--out to choose)", file=sys.stderr)
    try:
        serving = ServingOptions(
            intra_op_threads=args.intra_op_threads,
            num_draft_tokens=args.num_draft_tokens,
            adaptive_draft=args.adaptive_draft,
            verify_cost=args.verify_cost,
            draft_cost=args.draft_cost,
            drafter=DrafterKind.parse(args.drafter),
            prefill_budget=args.prefill_budget,
            instances=args.instances,
            gpus=tuple(args.gpus),
        )
        if serving.drafter is DrafterKind.HYBRID and draft is None:
            raise ExportDirError("--drafter hybrid needs --draft (prompt lookup first, the draft model elsewhere)")
        quantize = (
            strategy_for(
                args.quantize,
                args.quantize_activations or "int8",
                args.quantize_from or "gguf",
                args.quantize_block_size,
            )
            if args.quantize
            else None
        )
        out = export(
            args.target,
            draft,
            out_dir,
            args.force,
            args.backend,
            args.dtype,
            args.max_batch,
            args.max_len,
            serving,
            calibrate=args.calibrate,
            quantize=quantize,
            offline=args.offline,
            command=list(argv) if argv is not None else None,
            kv_cache=args.kv_cache,
        )
    except (ModelResolutionError, ExportDirError, ValueError, RuntimeError) as exc:
        # RuntimeError: TensorRT unavailable, engine build failure, plugin fallback
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted: nothing was written", file=sys.stderr)
        return 130
    measured = read_manifest(out, verify=False).get("calibration")
    if measured:
        print(
            f"calibrated on this machine: a draft token costs {measured['draft_cost']} and a verified row "
            f"{measured['verify_cost']} of a target step (the served prices: {out / REPOSITORY_DIR}"
            "/specdec_engine/config.pbtxt)"
        )
    print(f"exported to {out}; serve it with: specdec serve {out}")
    print(f"peak memory (RSS) of the export: {peak_rss_bytes() / 2**30:.2f} GiB", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The engine: a target backend, a drafter, a KV cache, and the decoding loops over them.

This is the object the CLI, the benchmarks and the served engine model hold. It owns
tokenisation, request validation and the turning of loop state into ``RequestOutput``.
A request that fails validation gets an output carrying its error; the others run.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from specdec.models.errors import DraftMismatchError
from specdec.runtime.backends.base import Backend
from specdec.runtime.draft_length import DraftLength, DraftStats
from specdec.runtime.drafters import Drafter, make_drafter
from specdec.runtime.kv import KVCacheManager
from specdec.runtime.loops import DecodeContext, FaultHook
from specdec.runtime.methods import DEFAULT_METHOD, get_method
from specdec.runtime.metrics import RunMetrics
from specdec.runtime.request import BeamParams, Request, RequestMetrics, RequestOutput, SeqState, StopChecker
from specdec.runtime.sampling import InvalidRequestError, SamplingParams
from specdec.runtime.scheduler import Scheduler
from specdec.runtime.text import cut_at_stop, decode_tokens, encode_text


def _backend_opener(
    kind: str, threads: int | None = None, device_id: int = 0, cache_dtype: str | None = None
) -> Callable[[Path, bool], Backend]:
    """How to open one exported graph of this export's backend kind; the flag says it is the draft.

    ``device_id``: the GPU its session and caches live on (a Triton instance's ``model_instance_device_id``);
    an ONNX Runtime session without the CUDA provider runs on the host whatever it says. ``cache_dtype``:
    the KV caches' type where the export narrows them (the manifest's ``kv_cache_dtype``; ONNX Runtime only).
    """
    if kind == "onnx":
        from specdec.runtime.backends.onnxruntime import OrtBackend

        # a draft's idle ORT workers must not spin: they would hold the cores of the target's next step
        return lambda graph, draft: OrtBackend(
            graph, intra_op_threads=threads, spin=not draft, device_id=device_id, cache_dtype=cache_dtype
        )
    if kind == "tensorrt":
        from specdec.runtime.backends.tensorrt import TensorRTBackend

        return lambda graph, draft: TensorRTBackend(graph.with_name("model.engine"), device=f"cuda:{device_id}")
    raise ValueError(f"export backend {kind!r} is not known to this version of specdec")


@dataclass
class GenerationResult:
    outputs: list[RequestOutput]  # in request order
    run: RunMetrics


class Engine:
    """Runs any method of ``specdec.runtime.methods`` over one target backend and one drafter."""

    def __init__(
        self,
        target: Backend,
        drafter: Drafter | None = None,
        *,
        tokenizer: Any = None,
        eos_token_ids: Sequence[int] = (),
        max_batch: int = 16,
        max_len: int = 1024,
        num_draft_tokens: int = 4,
        draft_length: DraftLength | None = None,
    ) -> None:
        """``num_draft_tokens``: k of every step, or with an adaptive ``draft_length`` the most a sequence drafts."""
        if getattr(target, "head_token_ids", None) is not None:
            raise ValueError(
                "the target backend has a restricted LM head: the verifier needs logits over the "
                "whole vocabulary (only a draft may restrict its head)"
            )
        if drafter is not None and drafter.vocab_size not in (None, target.vocab_size):
            raise DraftMismatchError(
                f"draft vocabulary ({drafter.vocab_size}) differs from the target's ({target.vocab_size})"
            )
        if num_draft_tokens < 0:
            raise ValueError(f"num_draft_tokens must be >= 0, got {num_draft_tokens}")
        self.target, self.drafter, self.tokenizer = target, drafter, tokenizer
        self.eos_token_ids = tuple(eos_token_ids)
        self.max_batch, self.max_len, self.num_draft_tokens = max_batch, max_len, num_draft_tokens
        self.draft_length = draft_length
        #: every sequence's verifications, pooled across runs per draft source: a greedy sequence's prior acceptance
        #: (``draft_length``, ``DecodeContext.pooled_drafts``)
        self.pooled_drafts: dict[str, DraftStats] = {}
        #: a test's fault injection, called at each sequence's per-step points (``DecodeContext.fault_hook``)
        self.fault_hook: FaultHook | None = None
        #: rows a ragged step may spend on prompt prefills (``DecodeContext.prefill_budget``; None: whole prompts)
        self.prefill_budget: int | None = None
        self.storage = target.allocate_cache(max_batch, max_len)

    @classmethod
    def from_models(
        cls,
        target: Any,
        draft: Any = "ngram",
        *,
        max_batch: int = 16,
        max_len: int | None = None,
        num_draft_tokens: int = 4,
        ngram: int = 3,
        min_ngram: int = 2,
        draft_length: DraftLength | None = None,
        hybrid: bool = False,
    ) -> Engine:
        """Torch backends for ``target`` and ``draft`` (a ``LoadedModel``, ``"ngram"`` or ``None``).

        ``hybrid``: with a draft model, draft by prompt lookup where the context has a match and by
        the model elsewhere (``HybridDrafter``).
        """
        from specdec.models.drafts import check_draft_compatible
        from specdec.models.loading import LoadedModel
        from specdec.runtime.backends.torch_backend import TorchBackend

        max_len = max_len or min(int(target.config.max_position_embeddings), 2048)
        backend = TorchBackend(target)
        if isinstance(draft, LoadedModel):
            check_draft_compatible(target, draft)
        elif draft not in (None, "none", "ngram"):
            raise ValueError(f"draft must be a loaded model, 'ngram' or None, got {draft!r}")
        if hybrid and not isinstance(draft, LoadedModel):
            raise ValueError("the hybrid drafter needs a draft model")
        model = TorchBackend(draft) if isinstance(draft, LoadedModel) else None
        drafter = make_drafter(
            "hybrid" if hybrid else model or draft,
            max_batch=max_batch,
            max_len=max_len,
            ngram=ngram,
            min_ngram=min_ngram,
            model=model,
        )
        return cls(
            backend,
            drafter,
            tokenizer=target.tokenizer,
            eos_token_ids=target.eos_token_ids,
            max_batch=max_batch,
            max_len=max_len,
            num_draft_tokens=num_draft_tokens,
            draft_length=draft_length,
        )

    @classmethod
    def from_export(
        cls,
        directory: str | Path,
        *,
        max_batch: int | None = None,
        max_len: int | None = None,
        num_draft_tokens: int = 4,
        drafter: str | None = None,
        threads: int | None = None,
        draft_length: DraftLength | None = None,
        torch_threads: int | None = None,
        device_id: int = 0,
        kv_cache_dtype: str | None = None,
    ) -> Engine:
        """An engine over a ``specdec-export`` directory, on the backend it was exported for.

        The manifest's checksums are verified first, so a corrupt graph is refused at load.
        ``drafter`` overrides the exported choice ("ngram", "hybrid", "none"); ``threads`` sets ONNX
        Runtime's intra-op threads (default: all cores). ``device_id``: the GPU an ONNX Runtime (CUDA provider)
        or TensorRT export runs on, so each Triton instance of a multi-GPU node opens its own.

        ``torch_threads``: torch's (process-wide) intra-op threads, set only where an export's backend
        brings torch (a TensorRT export's caches, ONNX Runtime's CUDA caches). A serving process passes 1:
        torch's OpenMP workers otherwise contend with the backend's for the cores (measured:
        ``benchmarks/results/ort_contention.md``). An ONNX Runtime export on the CPU never imports torch:
        the loops run on numpy (``backends.base``). The KV caches take the type ``kv_cache_dtype`` says,
        else the manifest's (a quantized export's: fp16), else the graph's own.
        """
        from specdec.models.export_meta import load_export_metadata
        from specdec.models.manifest import export_path, read_manifest

        root = Path(directory)
        manifest = read_manifest(root)
        max_batch = max_batch or int(manifest.get("max_batch", 16))
        max_len = max_len or int(manifest.get("max_len", 2048))
        backend_kind = manifest.get("backend", "torch")
        if drafter == "hybrid" and "draft" not in manifest:
            raise ValueError(f"{root} has no draft model for the hybrid drafter (export it with --draft)")
        wants_model = drafter in (None, "model", "hybrid") and "draft" in manifest
        if backend_kind == "torch":
            from specdec.models.loading import load_model

            target = load_model(root)
            model = load_model(root / "draft") if wants_model else None
            draft = model if model is not None else "ngram" if drafter in (None, "model") else drafter
            return cls.from_models(
                target,
                draft,
                max_batch=max_batch,
                max_len=max_len,
                num_draft_tokens=num_draft_tokens,
                draft_length=draft_length,
                hybrid=drafter == "hybrid",
            )
        meta = load_export_metadata(root, "target")
        cache_dtype = kv_cache_dtype or manifest.get("kv_cache_dtype")
        open_backend = _backend_opener(backend_kind, threads, device_id, cache_dtype)
        target_backend = open_backend(export_path(root, manifest["target"]["graph"]), False)
        model = open_backend(export_path(root, manifest["draft"]["graph"]), True) if wants_model else None
        draft: Backend | str | None = drafter if drafter in ("hybrid", "none", "ngram") else model or "ngram"
        chosen = make_drafter(draft, max_batch=max_batch, max_len=max_len, model=model)
        if torch_threads and "torch" in sys.modules:  # only where a backend runs torch (TensorRT's caches)
            sys.modules["torch"].set_num_threads(torch_threads)
        return cls(
            target_backend,
            chosen,
            tokenizer=meta.tokenizer,
            eos_token_ids=meta.eos_token_ids,
            max_batch=max_batch,
            max_len=max_len,
            num_draft_tokens=num_draft_tokens,
            draft_length=draft_length,
        )

    def sibling(self) -> Engine:
        """Another engine over the same model backends with its own KV caches (a second decoding loop).

        A server runs its beam loop beside the EMS-SD loop this way: the weights are shared,
        each loop owns its caches, and both may call the backends from their own threads.
        """
        drafter = None if self.drafter is None else self.drafter.fork()
        twin = Engine(
            self.target,
            drafter,
            tokenizer=self.tokenizer,
            eos_token_ids=self.eos_token_ids,
            max_batch=self.max_batch,
            max_len=self.max_len,
            num_draft_tokens=self.num_draft_tokens,
            draft_length=self.draft_length,
        )
        twin.fault_hook, twin.prefill_budget = self.fault_hook, self.prefill_budget
        return twin

    # -- requests ---------------------------------------------------------------------
    def encode(self, prompt: str | Sequence[int], chat: bool = False) -> list[int]:
        if not isinstance(prompt, str):
            return [int(t) for t in prompt]
        if self.tokenizer is None:
            raise InvalidRequestError("this model has no tokenizer: pass token ids instead of text")
        return encode_text(self.tokenizer, prompt, chat)

    def decode(self, token_ids: Sequence[int]) -> str:
        return decode_tokens(self.tokenizer, token_ids) if self.tokenizer else ""

    def request(
        self,
        prompt: str | Sequence[int],
        *,
        chat: bool = False,
        max_tokens: int = 128,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int | None = None,
        num_draft_tokens: int | None = None,
        stop: Sequence[str] = (),
        request_id: str | None = None,
        beam: BeamParams | None = None,
    ) -> Request:
        """Build and validate a request; raises ``InvalidRequestError`` naming the problem.

        ``beam`` configures the ``beam`` and ``dsbd`` methods (width, dynamic-width knobs).
        """
        ids = self.encode(prompt, chat)
        if not ids:
            raise InvalidRequestError("prompt is empty: a request needs at least one prompt token")
        kwargs = {} if request_id is None else {"request_id": request_id}
        req = Request(
            tuple(ids),
            max_tokens,
            SamplingParams(temperature, top_k, top_p, seed),
            num_draft_tokens,
            tuple(stop),
            beam=beam,
            **kwargs,
        )
        self.check(req)
        return req

    def check(self, req: Request) -> None:
        """What this engine in particular cannot serve: a prompt past the context, a width past the cache."""
        req.check_fits(self.max_len, self.target.vocab_size)
        if req.beam is not None and req.beam.width > self.max_batch:
            raise InvalidRequestError(
                f"beam_width {req.beam.width} exceeds the {self.max_batch} KV slots of this engine (one per beam)"
            )

    # -- running ----------------------------------------------------------------------
    def context(
        self,
        scheduler: Scheduler,
        *,
        on_tokens: Callable[[SeqState, list[int]], None] | None = None,
        on_finish: Callable[[SeqState], None] | None = None,
        keep_running: Callable[[], bool] | None = None,
        on_logits: Callable[[SeqState, Any], None] | None = None,
        is_cancelled: Callable[[SeqState], bool] | None = None,
    ) -> DecodeContext:
        """A fresh decoding context over this engine's cache (all slots free)."""
        if self.drafter is not None:
            self.drafter.reset()
        stopper = StopChecker(self.eos_token_ids, self.max_len, self.decode if self.tokenizer else None)
        return DecodeContext(
            self.target,
            KVCacheManager(self.storage),
            scheduler,
            stopper,
            self.drafter,
            self.num_draft_tokens,
            on_tokens,
            on_finish,
            keep_running,
            on_logits,
            is_cancelled,
            self.draft_length,
            fault_hook=self.fault_hook,
            prefill_budget=self.prefill_budget,
            pooled_drafts=self.pooled_drafts,
        )

    def generate(
        self, requests: Sequence[Request | Exception], method: str = DEFAULT_METHOD, progress: bool = False
    ) -> GenerationResult:
        """Run ``requests`` to completion with ``method``; outputs come back in request order.

        Items that are exceptions (a request that failed to build) or that do not fit the
        context become outputs with ``error`` set; the rest are decoded together.
        """
        spec = get_method(method)
        if spec.masks_cache and not getattr(self.target, "supports_cache_mask", False):
            raise ValueError(
                f"{spec.name!r} pads the KV cache with masked holes, which the "
                f"{type(self.target).__name__} target cannot mask (an exported graph has no cache_mask "
                "input): run it on the torch backend, or use 'ems'"
            )
        outputs: dict[int, RequestOutput] = {}
        scheduler = Scheduler(self.max_batch)
        position: dict[str, int] = {}
        for i, req in enumerate(requests):
            try:
                if isinstance(req, Exception):
                    raise req
                if spec.beams and req.beam is None:
                    req = replace(req, beam=BeamParams())
                if spec.needs_draft_model and req.beam is not None and req.beam.mode != "iid":
                    raise InvalidRequestError(f"{spec.name} reproduces i.i.d. beam sampling: beam mode must be 'iid'")
                self.check(req)
                if req.request_id in position:
                    raise InvalidRequestError(f"duplicate request_id {req.request_id!r}")
            except InvalidRequestError as exc:
                prompt = [] if isinstance(req, Exception) else list(req.prompt_ids)
                outputs[i] = RequestOutput(
                    getattr(req, "request_id", f"invalid-{i}"), prompt, [], None, None, RequestMetrics(), error=str(exc)
                )
                continue
            position[req.request_id] = i
            scheduler.submit(req)
        total = sum(r.max_tokens for i, r in enumerate(requests) if i not in outputs)
        bar = tqdm(total=total, desc=spec.name, unit="tok", disable=not progress, leave=False)

        def finish(seq: SeqState) -> None:
            outputs[position[seq.request.request_id]] = self.output(seq)
            bar.update(seq.request.max_tokens - seq.num_generated)

        ctx = self.context(scheduler, on_tokens=lambda seq, toks: bar.update(len(toks)), on_finish=finish)
        ctx.run.requests = len(position)
        start = time.perf_counter()
        spec.loop(ctx)
        ctx.run.wall_seconds = time.perf_counter() - start
        bar.close()
        return GenerationResult([outputs[i] for i in range(len(requests))], ctx.run)

    def output(self, seq: SeqState, text: bool = True) -> RequestOutput:
        """A finished sequence as the caller's answer; ``text=False`` skips detokenising (for callers of ids)."""
        decoded = cut_at_stop(self.decode(seq.output_ids), seq.request.stop) if text and self.tokenizer else None
        return RequestOutput(
            seq.request.request_id,
            list(seq.request.prompt_ids),
            seq.output_ids,
            decoded,
            seq.finish_reason,
            seq.metrics,
            error=seq.error,
            sequences=seq.sequences,
        )

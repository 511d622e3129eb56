"""The engine: a target backend, a drafter, a KV cache, and the decoding loops over them.

This is the object the CLI, the benchmarks and the served engine model hold. It owns
tokenisation, request validation and the turning of loop state into ``RequestOutput``.
A request that fails validation gets an output carrying its error; the others run.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from specdec.models.errors import DraftMismatchError
from specdec.runtime.backends.base import Backend
from specdec.runtime.config import DrafterKind, EngineConfig
from specdec.runtime.context import DecodeContext, FaultHook, LoopHooks
from specdec.runtime.draft_planner import make_planner
from specdec.runtime.drafters import Drafter, make_drafter
from specdec.runtime.kv import KVCacheManager
from specdec.runtime.methods import DEFAULT_METHOD, get_method
from specdec.runtime.metrics import RunMetrics
from specdec.runtime.request import BeamParams, Request, RequestMetrics, RequestOutput, SeqState, StopChecker
from specdec.runtime.sampling import InvalidRequestError, SamplingParams
from specdec.runtime.scheduler import Scheduler
from specdec.runtime.text import cut_at_stop, decode_tokens, encode_text, text_ids

log = logging.getLogger(__name__)


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

        # a draft's idle ORT workers must not spin: they would hold the cores of the target's next step; its steps
        # need no row floor: its proposals are verified, never compared
        return lambda graph, draft: OrtBackend(
            graph,
            intra_op_threads=threads,
            spin=not draft,
            device_id=device_id,
            cache_dtype=cache_dtype,
            row_floor=not draft,
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
    """Runs any method of ``specdec.runtime.methods`` over one target backend and one drafter.

    ``config`` holds every setting (``EngineConfig``); its sizes are resolved here (``max_batch`` 16 and
    ``max_len`` 2048 where unset) and the KV caches allocated to them.
    """

    def __init__(
        self,
        target: Backend,
        drafter: Drafter | None = None,
        *,
        tokenizer: Any = None,
        eos_token_ids: Sequence[int] = (),
        config: EngineConfig | None = None,
        fault_hook: FaultHook | None = None,
    ) -> None:
        """``fault_hook``: a test's fault injection, called at each sequence's per-step points."""
        if getattr(target, "head_token_ids", None) is not None:
            raise ValueError(
                "the target backend has a restricted LM head: the verifier needs logits over the "
                "whole vocabulary (only a draft may restrict its head)"
            )
        if drafter is not None and drafter.vocab_size not in (None, target.vocab_size):
            raise DraftMismatchError(
                f"draft vocabulary ({drafter.vocab_size}) differs from the target's ({target.vocab_size})"
            )
        self.target, self.drafter, self.tokenizer = target, drafter, tokenizer
        self.eos_token_ids = tuple(eos_token_ids)
        self.config = (config or EngineConfig()).resolved()
        self.fault_hook = fault_hook
        #: chooses each sequence's draft length and keeps the engine's pooled acceptance across runs
        self.planner = make_planner(self.config.draft_length, drafter)
        self.storage = target.allocate_cache(self.max_batch, self.max_len)

    @property
    def max_batch(self) -> int:
        return self.config.max_batch_set

    @property
    def max_len(self) -> int:
        return self.config.max_len_set

    def reconfigure(self, **changes: Any) -> None:
        """Run with other settings from the next run on, over the same backends and caches: a calibration that
        timed this engine's own steps prices its draft length, a benchmark sweeps k. The cache's shape
        (``max_batch``, ``max_len``, ``kv_cache_dtype``) and the backends' (threads, device) are fixed once built;
        a new draft-length policy starts its pooled acceptance afresh."""
        fixed = sorted(
            set(changes)
            & {"max_batch", "max_len", "kv_cache_dtype", "threads", "torch_threads", "device_id", "drafter"}
        )
        if fixed:
            raise ValueError(f"{', '.join(fixed)} shape the engine's caches or backends: build another engine")
        self.config = replace(self.config, **changes)
        if "draft_length" in changes:
            self.planner = make_planner(self.config.draft_length, self.drafter)

    @classmethod
    def from_models(
        cls,
        target: Any,
        draft: Any = None,
        config: EngineConfig | None = None,
        *,
        ngram: int = 3,
        min_ngram: int = 2,
    ) -> Engine:
        """Torch backends for ``target`` and the ``draft`` model (a ``LoadedModel`` or None).

        ``config.drafter``: None drafts with the model where one is given, else by prompt lookup; ``HYBRID`` drafts
        by prompt lookup where the context has a match and by the model elsewhere (``HybridDrafter``).
        """
        from specdec.models.drafts import check_draft_compatible
        from specdec.models.loading import LoadedModel
        from specdec.runtime.backends.torch_backend import TorchBackend

        if draft is not None and not isinstance(draft, LoadedModel):
            raise ValueError(f"draft must be a loaded model or None, got {draft!r}")
        config = (config or EngineConfig()).for_model(getattr(target.config, "max_position_embeddings", None))
        if isinstance(draft, LoadedModel):
            check_draft_compatible(target, draft)
        model = TorchBackend(draft) if draft is not None else None
        drafter = make_drafter(
            config.drafter or (DrafterKind.MODEL if model else DrafterKind.NGRAM),
            model=model,
            max_batch=config.max_batch_set,
            max_len=config.max_len_set,
            ngram=ngram,
            min_ngram=min_ngram,
        )
        return cls(
            TorchBackend(target),
            drafter,
            tokenizer=target.tokenizer,
            eos_token_ids=target.eos_token_ids,
            config=config,
        )

    @classmethod
    def from_export(cls, directory: str | Path, config: EngineConfig | None = None) -> Engine:
        """An engine over a ``specdec-export`` directory, on the backend it was exported for.

        The manifest's checksums are verified first, so a corrupt graph is refused at load; its sizes and cache
        type fill what ``config`` leaves unset (``EngineConfig.from_manifest``). An ONNX Runtime export on the CPU
        never imports torch: the loops run on numpy (``backends.base``); ``config.torch_threads`` applies where a
        backend brings torch (a TensorRT export's caches), since its OpenMP workers contend with the backend's
        (``benchmarks/results/ort_contention.md``).
        """
        from specdec.models.export_meta import load_export_metadata
        from specdec.models.manifest import export_path, read_manifest

        root = Path(directory)
        manifest = read_manifest(root)
        config = (config or EngineConfig()).from_manifest(manifest)
        if config.num_draft_tokens and manifest["target"].get("quantize", {}).get("batch_invariant") is False:
            log.warning(
                "%s: its target graph is not batch-invariant (int4/int8 blocks at fp32 activations): speculation on "
                "it equals ar only up to near-ties; ar is exact (docs/export.md, Quantization)",
                root,
            )
        has_draft = "draft" in manifest
        kind = config.drafter or (DrafterKind.MODEL if has_draft else DrafterKind.NGRAM)
        if kind is DrafterKind.HYBRID and not has_draft:
            raise ValueError(f"{root} has no draft model for the hybrid drafter (export it with --draft)")
        if kind is DrafterKind.MODEL and not has_draft:
            kind = DrafterKind.NGRAM  # an export without a draft model drafts by prompt lookup
        backend_kind = manifest.get("backend", "torch")
        if backend_kind == "torch":
            from specdec.models.loading import load_model

            draft = load_model(root / "draft") if kind.needs_model else None
            return cls.from_models(load_model(root), draft, replace(config, drafter=kind))
        meta = load_export_metadata(root, "target")
        open_backend = _backend_opener(backend_kind, config.threads, config.device_id, config.kv_cache_dtype)
        target_backend = open_backend(export_path(root, manifest["target"]["graph"]), False)
        model = open_backend(export_path(root, manifest["draft"]["graph"]), True) if kind.needs_model else None
        drafter = make_drafter(kind, model=model, max_batch=config.max_batch_set, max_len=config.max_len_set)
        if config.torch_threads and "torch" in sys.modules:  # only where a backend runs torch (TensorRT's caches)
            sys.modules["torch"].set_num_threads(config.torch_threads)
        return cls(
            target_backend,
            drafter,
            tokenizer=meta.tokenizer,
            eos_token_ids=meta.eos_token_ids,
            config=replace(config, drafter=kind),
        )

    def sibling(self) -> Engine:
        """Another engine over the same model backends with its own KV caches (a second decoding loop).

        A server runs its beam loop beside the EMS-SD loop this way: the weights and the settings are shared,
        each loop owns its caches (and its drafter's), and both may call the backends from their own threads.
        """
        drafter = None if self.drafter is None else self.drafter.fork()
        return Engine(
            self.target,
            drafter,
            tokenizer=self.tokenizer,
            eos_token_ids=self.eos_token_ids,
            config=self.config,
            fault_hook=self.fault_hook,
        )

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
        stop_token_ids: Sequence[int] = (),
        min_tokens: int = 0,
        logprobs: int | None = None,
    ) -> Request:
        """Build and validate a request; raises ``InvalidRequestError`` naming the problem.

        ``beam`` configures the ``beam`` and ``dsbd`` methods (width, dynamic-width knobs); ``logprobs``: None,
        or how many alternatives each token's log-probability comes with (``Request.logprobs``).
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
            stop_token_ids=tuple(stop_token_ids),
            min_tokens=min_tokens,
            logprobs=logprobs,
            **kwargs,
        )
        self.check(req)
        return req

    def check(self, req: Request) -> None:
        """What this engine in particular cannot serve: a prompt past the context, a width past the cache, and
        ``min_tokens`` on a beam request (its stop tokens would have to be kept out of every beam's search)."""
        req.check_fits(self.max_len, self.target.vocab_size)
        if req.beam is not None and req.beam.width > self.max_batch:
            raise InvalidRequestError(
                f"beam_width {req.beam.width} exceeds the {self.max_batch} KV slots of this engine (one per beam)"
            )
        if req.beam is not None and req.min_tokens:
            raise InvalidRequestError(
                f"min_tokens applies to the chain methods (ar, ems), not to beam search (got {req.min_tokens})"
            )

    # -- running ----------------------------------------------------------------------
    def context(self, scheduler: Scheduler, hooks: LoopHooks | None = None) -> DecodeContext:
        """A fresh decoding context over this engine's cache (all slots free)."""
        if self.drafter is not None:
            self.drafter.reset()
        hooks = hooks or LoopHooks()
        if hooks.fault_hook is None:
            hooks.fault_hook = self.fault_hook
        stopper = StopChecker(self.eos_token_ids, self.max_len, self.decode if self.tokenizer else None)
        return DecodeContext(
            self.target,
            KVCacheManager(self.storage),
            scheduler,
            stopper,
            self.config,
            self.drafter,
            self.planner,
            hooks,
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
        total = 0  # the most tokens the admitted requests may generate (the progress bar's length)
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
            total += req.max_tokens
        bar = tqdm(total=total, desc=spec.name, unit="tok", disable=not progress, leave=False)

        def finish(seq: SeqState) -> None:
            outputs[position[seq.request.request_id]] = self.output(seq)
            bar.update(seq.request.max_tokens - seq.num_generated)

        ctx = self.context(scheduler, LoopHooks(on_tokens=lambda seq, toks: bar.update(len(toks)), on_finish=finish))
        ctx.run.requests = len(position)
        start = time.perf_counter()
        spec.loop(ctx)
        ctx.run.wall_seconds = time.perf_counter() - start
        bar.close()
        return GenerationResult([outputs[i] for i in range(len(requests))], ctx.run)

    def output(self, seq: SeqState, text: bool = True) -> RequestOutput:
        """A finished sequence as the caller's answer; ``text=False`` skips detokenising (for callers of ids)."""
        ids = text_ids(seq.output_ids, seq.request.stop_token_ids, finished=True)
        decoded = cut_at_stop(self.decode(ids), seq.request.stop) if text and self.tokenizer else None
        return RequestOutput(
            seq.request.request_id,
            list(seq.request.prompt_ids),
            seq.output_ids,
            decoded,
            seq.finish_reason,
            seq.metrics,
            error=seq.error,
            sequences=seq.sequences,
            logprobs=list(seq.logprobs),
        )

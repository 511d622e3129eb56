"""An engine's settings: one frozen object, one default each, built in one place per source and passed whole.

Why one object: the settings used to be threaded argument by argument through the CLI, the export, the served
config, ``Engine`` and the decoding context, with defaults written where each was read (the draft length in eight
places, a context of 1024 or 2048 tokens depending on the path) and some attached after construction. Now a
source builds an ``EngineConfig`` once (``from_manifest`` for an export, the CLI and the served engine model for
their options), ``Engine`` keeps it, its decoding contexts read it, and ``Engine.sibling`` shares it.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from specdec.runtime.draft_length import DraftLength

#: sequences decoded together when neither the caller nor the export says (one KV slot each)
DEFAULT_MAX_BATCH = 16
#: tokens a sequence's KV slot holds (prompt + answer) when neither the caller nor the export says; a model with
#: fewer positions caps it
DEFAULT_MAX_LEN = 2048
#: draft tokens per step (EMS-SD's k, DSBD's layers γ) when a request does not say; with the adaptive draft length
#: the most a sequence drafts
DEFAULT_NUM_DRAFT_TOKENS = 4


class DrafterKind(enum.Enum):
    """What proposes the drafts: the draft model, prompt lookup, lookup with the model where lookup has nothing,
    or nothing (``ar`` and ``beam`` need no drafter)."""

    MODEL = "model"
    NGRAM = "ngram"
    HYBRID = "hybrid"
    NONE = "none"

    @classmethod
    def parse(cls, value: str | DrafterKind | None) -> DrafterKind | None:
        """``value`` as a kind (None stays None: "as the artifact offers"); a clear error naming the choices."""
        if value is None or isinstance(value, DrafterKind):
            return value
        try:
            return cls(str(value).strip().lower())
        except ValueError:
            raise ValueError(f"unknown drafter {value!r}: choose one of {', '.join(NAMES)}") from None

    @property
    def needs_model(self) -> bool:
        return self in DrafterKind.with_model()

    @classmethod
    def with_model(cls) -> tuple[DrafterKind, ...]:
        """The kinds that draft with a draft model."""
        return (cls.MODEL, cls.HYBRID)


NAMES = tuple(kind.value for kind in DrafterKind)


@dataclass(frozen=True)
class EngineConfig:
    """What an engine is built with. ``None`` means "as the model or export says", resolved by ``resolved``.

    ``max_batch``: KV slots (sequences decoded together). ``max_len``: tokens per slot. ``num_draft_tokens``: k
    when a request does not say (the most, with ``draft_length``). ``drafter``: None takes the export's draft model
    where it has one, else prompt lookup. ``draft_length``: the adaptive draft-length policy's prices (None: every
    sequence drafts its k). ``prefill_budget``: rows a ragged step may spend on prompt prefills (None: whole
    prompts). ``kv_cache_dtype``: the KV caches' type (None: the manifest's, else the graph's). ``threads``: ONNX
    Runtime's intra-op threads (None: all cores). ``torch_threads``: torch's, set only where a backend brings torch
    (a serving process passes 1: its OpenMP workers contend with the backend's). ``device_id``: the GPU of a CUDA
    or TensorRT export.
    """

    max_batch: int | None = None
    max_len: int | None = None
    num_draft_tokens: int = DEFAULT_NUM_DRAFT_TOKENS
    drafter: DrafterKind | None = None
    draft_length: DraftLength | None = None
    prefill_budget: int | None = None
    kv_cache_dtype: str | None = None
    threads: int | None = None
    torch_threads: int | None = None
    device_id: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "drafter", DrafterKind.parse(self.drafter))
        for name in ("max_batch", "max_len", "prefill_budget", "threads", "torch_threads"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be an integer >= 1 (or unset), got {value!r}")
        if self.max_len is not None and self.max_len < 2:
            raise ValueError(f"max_len must be >= 2 (a prompt token and a new one), got {self.max_len}")
        if not isinstance(self.num_draft_tokens, int) or self.num_draft_tokens < 0:
            raise ValueError(f"num_draft_tokens must be an integer >= 0, got {self.num_draft_tokens!r}")
        if self.device_id < 0:
            raise ValueError(f"device_id must be >= 0, got {self.device_id}")

    def resolved(self, max_batch: int | None = None, max_len: int | None = None) -> EngineConfig:
        """Every size set: this config's own, else the artifact's (``max_batch``, ``max_len``), else the defaults."""
        return replace(
            self,
            max_batch=self.max_batch or max_batch or DEFAULT_MAX_BATCH,
            max_len=self.max_len or max_len or DEFAULT_MAX_LEN,
        )

    def from_manifest(self, manifest: Mapping[str, Any]) -> EngineConfig:
        """Resolved against an export's manifest: its KV slots, context and cache type unless this config says."""
        config = self.resolved(_int_or_none(manifest.get("max_batch")), _int_or_none(manifest.get("max_len")))
        return replace(config, kv_cache_dtype=self.kv_cache_dtype or manifest.get("kv_cache_dtype"))

    def for_model(self, max_position_embeddings: int | None) -> EngineConfig:
        """Resolved for a model loaded from weights: its context unless this config says, capped by the default."""
        positions = _int_or_none(max_position_embeddings)
        return self.resolved(max_len=min(positions, DEFAULT_MAX_LEN) if positions else None)

    @property
    def max_batch_set(self) -> int:
        """``max_batch`` of a resolved config (raises on an unresolved one: a bug, not a user error)."""
        if self.max_batch is None:
            raise RuntimeError("EngineConfig.max_batch is unresolved: call resolved() first")
        return self.max_batch

    @property
    def max_len_set(self) -> int:
        """``max_len`` of a resolved config (raises on an unresolved one)."""
        if self.max_len is None:
            raise RuntimeError("EngineConfig.max_len is unresolved: call resolved() first")
        return self.max_len


def _int_or_none(value: Any) -> int | None:
    return None if value in (None, "", 0) else int(value)

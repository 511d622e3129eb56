"""The backend interface: one ragged step over a slot-major KV cache.

Every backend (torch, ONNX Runtime, TensorRT) implements ``step`` and a ``KVStorage``
with the few cache moves the KV manager needs; decoding loops see neither raw caches nor
a particular runtime.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from specdec.runtime.packed import PackedBatch


class KVStorage(Protocol):
    """Per-layer caches ``[slots, kv_heads, max_len, head_dim]`` and the moves on them."""

    num_slots: int
    max_len: int

    def move(self, slot: int, src: Sequence[int], dst: Sequence[int]) -> None:
        """Copy positions ``src`` to ``dst`` inside ``slot`` in every layer (compaction)."""

    def copy_prefix(self, src_slot: int, dst_slot: int, length: int) -> None:
        """Copy positions ``[0, length)`` of ``src_slot`` into ``dst_slot`` (fork)."""

    def read(self, slot: int, length: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """K and V of ``[0, length)`` per layer, as ``[kv_heads, length, head_dim]`` copies (tests)."""


class Backend(Protocol):
    """A model that runs ragged steps; ``rows_processed`` counts every packed row it ran.

    ``vocab_size`` is the token-id space the model reads (V). Its logits have ``head_size``
    columns: V for a full LM head, or K for a restricted-vocabulary head, whose column j
    means token ``head_token_ids[j]`` (``head_token_ids`` is None for a full head). Only a
    draft may have a restricted head; a target must score every token.
    ``supports_cache_mask``: whether ``step`` honours ``PackedBatch.cache_mask`` (masked KV holes,
    which only the padded ``vanilla`` baseline makes); a backend that cannot refuses such a step.
    """

    vocab_size: int
    head_size: int
    head_token_ids: torch.Tensor | None
    rows_processed: int
    calls: int
    supports_cache_mask: bool

    def allocate_cache(self, num_slots: int, max_len: int) -> KVStorage: ...

    def step(self, batch: PackedBatch, cache: KVStorage) -> torch.Tensor:
        """Logits ``[R, head_size]`` for ``batch.logits_indices``; writes the new K/V in place."""
        ...

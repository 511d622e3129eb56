"""The backend interface: one ragged step over a slot-major KV cache.

Every backend (torch, ONNX Runtime, TensorRT) implements ``step`` and a ``KVStorage``
with the few cache moves the KV manager needs; decoding loops see neither raw caches nor
a particular runtime. What crosses this interface is numpy on the host: the packed batch in, the
logits rows out (float32). Why: the loops, the sampler and the drafters then need no tensor
library of their own, so an engine over an ONNX Runtime export never imports torch (its memory,
``benchmarks/results/edge_cpu.md``); a torch or TensorRT backend converts at its own boundary.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, TypeVar

import numpy as np

from specdec.runtime.packed import PackedBatch


class KVStorage(Protocol):
    """Per-layer caches ``[slots, kv_heads, buffer_len, head_dim]`` and the moves on them.

    ``max_len`` positions of a slot belong to its sequence; ``buffer_len`` (>= ``max_len``) may add
    scratch positions a backend's kernel writes past a sequence (``ort_fuse.SPARE_POSITIONS``).
    """

    num_slots: int
    max_len: int
    buffer_len: int

    def move(self, slot: int, src: Sequence[int], dst: Sequence[int]) -> None:
        """Copy positions ``src`` to ``dst`` inside ``slot`` in every layer (compaction)."""

    def copy_prefix(self, src_slot: int, dst_slot: int, length: int) -> None:
        """Copy positions ``[0, length)`` of ``src_slot`` into ``dst_slot`` (fork)."""

    def read(self, slot: int, length: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """K and V of ``[0, length)`` per layer, as ``[kv_heads, length, head_dim]`` host copies (tests): in the
        cache's own dtype for host caches, float32 for torch caches (numpy has no bfloat16)."""


#: the storage a backend allocates and steps over: each backend binds its own (numpy or torch buffers)
CacheT = TypeVar("CacheT", bound=KVStorage)


class Backend(Protocol[CacheT]):
    """A model that runs ragged steps; ``rows_processed`` counts every packed row it ran.

    ``vocab_size`` is the token-id space the model reads (V). Its logits have ``head_size``
    columns: V for a full LM head, or K for a restricted-vocabulary head, whose column j
    means token ``head_token_ids[j]`` (``head_token_ids`` is None for a full head). Only a
    draft may have a restricted head; a target must score every token.
    ``supports_cache_mask``: whether ``step`` honours ``PackedBatch.cache_mask`` (masked KV holes,
    which only the padded ``vanilla`` baseline makes); a backend that cannot refuses such a step.
    ``CacheT``: the storage ``allocate_cache`` makes and ``step`` takes (a bare ``Backend`` takes any): a backend
    steps only over caches it allocated.
    """

    vocab_size: int
    head_size: int
    head_token_ids: np.ndarray | None
    rows_processed: int
    calls: int
    supports_cache_mask: bool

    def allocate_cache(self, num_slots: int, max_len: int) -> CacheT: ...

    def step(self, batch: PackedBatch, cache: CacheT) -> np.ndarray:
        """Logits ``[R, head_size]`` (float32, host) for ``batch.logits_indices``; writes the new K/V in place."""
        ...

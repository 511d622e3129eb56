"""KV caches in host memory as numpy arrays: what a CPU backend (ONNX Runtime on the CPU) binds in place.

Why numpy and ``np.zeros``: ``np.zeros`` is ``calloc``, whose large blocks are fresh zero pages of
the kernel, so a cache sized ``max_batch x buffer_len`` is resident only where sequences wrote, as an
edge runtime's is (``benchmarks/results/engine_memory.md``); and the engine over such a backend needs
no tensor library besides numpy.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class SlotMajorMoves:
    """The KV manager's moves on slot-major per-layer caches ``self.k`` / ``self.v``, for numpy and torch alike.

    Both index the same way (a list of positions is advanced indexing, which copies the source before the
    assignment, so overlapping compaction moves are safe), so every storage shares this one implementation.
    """

    k: list
    v: list

    def move(self, slot: int, src: Sequence[int], dst: Sequence[int]) -> None:
        src_list, dst_list = list(src), list(dst)
        for cache in (*self.k, *self.v):
            cache[slot, :, dst_list] = cache[slot, :, src_list]

    def copy_prefix(self, src_slot: int, dst_slot: int, length: int) -> None:
        for cache in (*self.k, *self.v):
            cache[dst_slot, :, :length] = cache[src_slot, :, :length]


class HostKVStorage(SlotMajorMoves):
    """Slot-major per-layer caches ``[slots, kv_heads, buffer_len, head_dim]`` in host memory (``KVStorage``)."""

    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        kv_heads: int,
        max_len: int,
        head_dim: int,
        dtype: np.dtype | type = np.float32,
        spare: int = 0,
    ) -> None:
        """``spare`` positions past ``max_len`` in every slot are scratch for the backend (``KVStorage``)."""
        self.num_slots, self.max_len, self.buffer_len = num_slots, max_len, max_len + spare
        shape = (num_slots, kv_heads, self.buffer_len, head_dim)
        self.k = [np.zeros(shape, dtype=dtype) for _ in range(num_layers)]
        self.v = [np.zeros(shape, dtype=dtype) for _ in range(num_layers)]

    def slots(self, first: int, count: int) -> HostKVStorage:
        """Slots ``[first, first + count)`` as a storage of their own over the same memory (views, no copy).

        Why: ONNX Runtime's attention pads every slot of a step to the step's widest chunk and attends over each
        slot's past, so a long prefill pays for the other slots of its cache; run over the view of its own slot it
        does not, with the same bits (``benchmarks/results/slot_views.md``). A slot's buffer is contiguous in the
        slot-major layout, so a backend binds the view in place.
        """
        if not (0 <= first and count >= 1 and first + count <= self.num_slots):
            raise ValueError(f"slots [{first}, {first + count}) are not within this cache's {self.num_slots}")
        view = object.__new__(HostKVStorage)
        view.num_slots, view.max_len, view.buffer_len = count, self.max_len, self.buffer_len
        view.k = [k[first : first + count] for k in self.k]
        view.v = [v[first : first + count] for v in self.v]
        return view

    def read(self, slot: int, length: int) -> list[tuple[np.ndarray, np.ndarray]]:
        return [(k[slot, :, :length].copy(), v[slot, :, :length].copy()) for k, v in zip(self.k, self.v)]

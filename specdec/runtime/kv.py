"""KV-cache manager: which slot a sequence uses and how much of it is committed.

The decoding loops never touch raw caches. They ask this manager for a slot, write new
K/V through ragged steps at ``length(slot)``, and then tell it what was accepted:

* ``commit(slot, offsets)`` — the accepted new tokens sit at ``length + offsets``; they are
  moved to ``length .. length + a - 1`` (a no-op for a chain) and become committed.
  Anything written beyond is garbage that the next step overwrites (EMS-SD: no holes).
* ``commit_padded(slot, accepted, advance)`` — the padded baseline: the write position
  moves by the batch maximum ``advance`` and the gap becomes masked holes.
* ``fork(slot, written)`` copies a prefix into a new slot (DSBD beams sharing a parent).
* ``truncate(slot, n)`` forgets speculative tokens (the draft model's rejected proposals).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from specdec.runtime.backends.base import KVStorage


class KVCapacityError(RuntimeError):
    """No free slot is left; the scheduler waits for one instead of failing the request."""


class ContextOverflowError(ValueError):
    """A sequence would grow past the cache's ``max_len``."""


class KVCacheManager:
    """Slot allocation and committed lengths over a backend's ``KVStorage``."""

    def __init__(self, storage: KVStorage) -> None:
        self.storage = storage
        self.num_slots, self.max_len = storage.num_slots, storage.max_len
        self._free = list(range(self.num_slots - 1, -1, -1))  # pop() hands out slot 0 first
        self._length: dict[int, int] = {}  # physical write position of each live slot
        self._holes: dict[int, np.ndarray] = {}  # slot -> bool [max_len], True = masked hole

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def live_slots(self) -> list[int]:
        return sorted(self._length)

    def alloc(self) -> int:
        if not self._free:
            raise KVCapacityError(f"all {self.num_slots} KV-cache slots are in use")
        slot = self._free.pop()
        self._length[slot] = 0
        return slot

    def free(self, slot: int) -> None:
        self._check(slot)
        del self._length[slot]
        self._holes.pop(slot, None)
        self._free.append(slot)

    def length(self, slot: int) -> int:
        """Write position: committed positions including holes."""
        self._check(slot)
        return self._length[slot]

    def num_tokens(self, slot: int) -> int:
        """Committed tokens (the logical sequence length; equals ``length`` without holes)."""
        holes = self._holes.get(slot)
        return self.length(slot) - (0 if holes is None else int(holes[: self._length[slot]].sum()))

    def room(self, slot: int) -> int:
        return self.max_len - self.length(slot)

    def ensure_room(self, slot: int, n: int) -> None:
        if n > self.room(slot):
            raise ContextOverflowError(
                f"slot {slot}: {n} new tokens after {self.length(slot)} exceed the context of {self.max_len}"
            )

    def commit(self, slot: int, offsets: Sequence[int] | int) -> None:
        """Commit accepted new tokens written at ``length + offsets`` (int n = a chain of n)."""
        base = self.length(slot)
        if isinstance(offsets, int) and offsets < 0:
            raise ValueError(f"cannot commit a negative number of tokens ({offsets})")
        offs = list(range(offsets)) if isinstance(offsets, int) else list(offsets)
        if any(o < 0 for o in offs) or len(set(offs)) != len(offs) or offs != sorted(offs):
            raise ValueError(f"accepted offsets must be distinct, increasing and >= 0, got {offs}")
        self.ensure_room(slot, (offs[-1] + 1) if offs else 0)
        src = [base + o for o in offs]
        dst = list(range(base, base + len(offs)))
        moved = [(s, d) for s, d in zip(src, dst) if s != d]
        if moved:
            self.storage.move(slot, [s for s, _ in moved], [d for _, d in moved])
        self._length[slot] = base + len(offs)

    def commit_padded(self, slot: int, accepted: int, advance: int) -> None:
        """Padded baseline: ``accepted`` real tokens, write position moves by ``advance``."""
        if not 0 <= accepted <= advance:
            raise ValueError(f"need 0 <= accepted <= advance, got {accepted}, {advance}")
        base = self.length(slot)
        self.ensure_room(slot, advance)
        if accepted < advance:
            holes = self._holes.setdefault(slot, np.zeros(self.max_len, dtype=bool))
            holes[base + accepted : base + advance] = True
        self._length[slot] = base + advance

    def truncate(self, slot: int, length: int) -> None:
        """Forget committed positions from ``length`` on (speculative draft tokens)."""
        if not 0 <= length <= self.length(slot):
            raise ValueError(f"cannot truncate slot {slot} of length {self.length(slot)} to {length}")
        if slot in self._holes:
            self._holes[slot][length:] = False
        self._length[slot] = length

    def fork(self, slot: int, written: int = 0) -> int:
        """A new slot holding a copy of ``slot``'s committed prefix.

        ``written`` more positions past the committed ones are copied too but stay
        uncommitted: a beam that shares its parent's prefix but accepted other tree nodes
        forks first and then ``commit``s its own nodes' offsets in the copy.
        """
        length = self.length(slot)
        if not 0 <= written <= self.room(slot):
            raise ValueError(f"slot {slot}: cannot copy {written} uncommitted positions after {length}")
        new = self.alloc()
        self.storage.copy_prefix(slot, new, length + written)
        self._length[new] = length
        if slot in self._holes:
            self._holes[new] = self._holes[slot].copy()
        return new

    def cache_mask(self, slots: Sequence[int]) -> np.ndarray | None:
        """[B, max_len] visibility of cached positions, or None when no slot has holes."""
        if not any(s in self._holes for s in slots):
            return None
        mask = np.ones((len(slots), self.max_len), dtype=bool)
        for row, slot in enumerate(slots):
            if slot in self._holes:
                mask[row] = ~self._holes[slot]
        return mask

    def _check(self, slot: int) -> None:
        if slot not in self._length:
            raise KeyError(f"KV slot {slot} is not allocated")

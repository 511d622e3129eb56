"""The packed ragged batch: the one input format of every model call.

Prefill, autoregressive steps, chain verification (EMS-SD), forest verification (DSBD)
and draft steps are all the same call on a ``PackedBatch``. ``pack()`` is the only place
that builds one from per-sequence work items.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

ROOT = -1  # parent index of a token attached directly to the committed prefix


class WorkKind(enum.Enum):
    """What a sequence's work item in a target step is; a step's metrics are derived from it (``StepRecord.of``).

    ``DECODE``: the last token alone (``ar``; padding rows of the padded baseline). ``VERIFY``: the last token, or a
    beam's uncached tail, followed by ``drafts`` draft tokens (a chain or a tree). ``PREFILL``: a chunk of a prompt
    that is not its last (no logits). ``LAST_CHUNK``: a prompt's last chunk, or all of it, whose last row gives the
    first token (a beam group's first round also carries its first tree here).
    """

    DECODE = "decode"
    VERIFY = "verify"
    PREFILL = "prefill"
    LAST_CHUNK = "last_chunk"

    @property
    def prefills(self) -> bool:
        return self in (WorkKind.PREFILL, WorkKind.LAST_CHUNK)


@dataclass(frozen=True)
class SeqWork:
    """One sequence's new tokens in a ragged step.

    ``parents[j]`` is the index (among this sequence's new tokens) of token j's parent, or
    ``ROOT``; ``None`` means a chain (parent of j is j-1). Parents must precede children.
    ``position_offset`` is the logical position of depth 0; it equals ``past_len`` unless
    the slot's cache has holes (only the padded baseline makes holes).
    ``logits`` selects the rows that need logits: "all", "last", "none" or explicit offsets.
    ``kind``: what the item is (``WorkKind``); ``drafts``: how many of its tokens are drafts (the last ones);
    ``padding``: how many are padding (the padded baseline's).
    """

    slot_id: int
    past_len: int
    token_ids: Sequence[int]
    parents: Sequence[int] | None = None
    position_offset: int | None = None
    logits: str | Sequence[int] = "all"
    kind: WorkKind = WorkKind.DECODE
    drafts: int = 0
    padding: int = 0

    def __post_init__(self) -> None:
        n = len(self.token_ids)
        if self.parents is not None and len(self.parents) != n:
            raise ValueError(f"slot {self.slot_id}: {len(self.parents)} parents for {n} tokens")
        if isinstance(self.logits, str):
            if self.logits not in ("all", "last", "none"):
                raise ValueError(f"logits must be 'all', 'last', 'none' or offsets, got {self.logits!r}")
        elif any(not 0 <= off < n for off in self.logits):
            raise ValueError(f"slot {self.slot_id}: logit offsets {list(self.logits)} outside [0, {n})")
        if not 0 <= self.drafts + self.padding <= n:
            raise ValueError(f"slot {self.slot_id}: {self.drafts} drafts and {self.padding} padding in {n} tokens")

    @property
    def real_tokens(self) -> int:
        """Tokens that are not padding."""
        return len(self.token_ids) - self.padding

    @property
    def prompt_tokens(self) -> int:
        """Tokens of a prompt being prefilled (0 unless the item prefills)."""
        return len(self.token_ids) - self.drafts - self.padding if self.kind.prefills else 0

    def logit_offsets(self) -> list[int]:
        n = len(self.token_ids)
        if not isinstance(self.logits, str):
            return list(self.logits)
        if self.logits == "all":
            return list(range(n))
        if self.logits == "last":
            return [n - 1] if n else []
        return []  # "none", the one other word __post_init__ admits


@dataclass(frozen=True)
class PackedBatch:
    """All new tokens of all sequences, concatenated with no padding (see design.md)."""

    input_ids: np.ndarray  # [T] int64
    position_ids: np.ndarray  # [T] int64, logical position = past + depth
    cu_seqlens: np.ndarray  # [B + 1] int32, prefix sums of new tokens per sequence
    past_lens: np.ndarray  # [B] int32, where each sequence's new K/V are written
    slot_ids: np.ndarray  # [B] int32, KV-cache slot of each sequence
    tree_mask: np.ndarray  # [T, S_max] bool, row t may see new token j of its own sequence
    logits_indices: np.ndarray  # [R] int32, rows that need logits, in sequence order
    cache_mask: np.ndarray | None = None  # [B, max(past_lens)] bool, visible cached positions

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_seqs(self) -> int:
        return int(self.slot_ids.shape[0])


def pack(work: Sequence[SeqWork], cache_mask: np.ndarray | None = None) -> PackedBatch:
    """Build the packed batch for ``work`` (sequences with no new tokens are dropped).

    Worked example — three sequences: a prefill of 3 tokens in slot 4, a chain of 2 in
    slot 0 with 7 cached tokens, and a forest (two roots a, b; c child of a) in slot 2:

        token_ids       [p0 p1 p2 | x0 x1 | a  b  c ]
        position_ids    [0  1  2  | 7  8  | 5  5  6 ]     (slot 2 has past_len 5)
        cu_seqlens      [0, 3, 5, 8]      past_lens [0, 7, 5]   slot_ids [4, 0, 2]
        tree_mask rows  p2 -> 111, x1 -> 11., c -> 1.1  (S_max = 3, "." = False)

    ``cache_mask`` (only for the padded baseline) has one row per item of ``work`` (empty
    items included, as ``KVCacheManager.cache_mask`` builds it); rows of empty items are
    dropped and the columns are cut to the longest past.
    """
    items = [w for w in work if len(w.token_ids) > 0]
    keep = [i for i, w in enumerate(work) if len(w.token_ids) > 0]
    seq_lens = [len(w.token_ids) for w in items]
    total = sum(seq_lens)
    s_max = max(seq_lens, default=0)
    input_ids = np.empty(total, dtype=np.int64)
    position_ids = np.empty(total, dtype=np.int64)
    tree_mask = np.zeros((total, max(s_max, 1)), dtype=bool)
    logits_rows: list[int] = []
    start = 0
    for w in items:
        n = len(w.token_ids)
        input_ids[start : start + n] = w.token_ids
        base = w.past_len if w.position_offset is None else w.position_offset
        if w.parents is None:
            position_ids[start : start + n] = np.arange(base, base + n)
            tree_mask[start : start + n, :n] = np.tri(n, dtype=bool)
        else:
            _fill_tree(w.parents, base, position_ids[start : start + n], tree_mask[start : start + n])
        logits_rows.extend(start + off for off in w.logit_offsets())
        start += n
    cu = np.zeros(len(items) + 1, dtype=np.int32)
    cu[1:] = np.cumsum(seq_lens, dtype=np.int32)
    past = np.array([w.past_len for w in items], dtype=np.int32)
    if cache_mask is not None:
        width = int(past.max()) if len(items) else 0
        cache_mask = cache_mask[keep, :width]
    return PackedBatch(
        input_ids=input_ids,
        position_ids=position_ids,
        cu_seqlens=cu,
        past_lens=past,
        slot_ids=np.array([w.slot_id for w in items], dtype=np.int32),
        tree_mask=tree_mask,
        logits_indices=np.array(logits_rows, dtype=np.int32),
        cache_mask=cache_mask,
    )


def _fill_tree(parents: Sequence[int], base: int, positions: np.ndarray, mask: np.ndarray) -> None:
    """Rows of one sequence's tree: ancestors + self visible, position = base + depth."""
    depth = [0] * len(parents)
    for j, parent in enumerate(parents):
        if parent == ROOT:
            depth[j] = 0
        elif 0 <= parent < j:
            depth[j] = depth[parent] + 1
            mask[j] = mask[parent]
        else:
            raise ValueError(f"tree node {j} has parent {parent}: parents must precede their children")
        mask[j, j] = True
    positions[:] = np.asarray(depth, dtype=np.int64) + base

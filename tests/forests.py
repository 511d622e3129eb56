"""Test helpers: ragged sequences described by their parents, and an independent ancestor mask.

Written without the library's ``pack`` so tests of the packer, the attention reference and
the kernels have a reference of their own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

ROOT = -1


@dataclass
class Seq:
    slot: int
    past: int
    parents: list[int]  # ROOT or an earlier index


def visible_new(parents: list[int]) -> torch.Tensor:
    """[n, n] bool: token t sees new token j iff j is t or one of t's ancestors."""
    n = len(parents)
    out = torch.zeros(n, n, dtype=torch.bool)
    for t in range(n):
        node = t
        while node != ROOT:
            out[t, node] = True
            node = parents[node]
    return out


def mixed_batch() -> list[Seq]:
    """Every kind of sequence in one pack: prefill, decode, chain, forests with and without a past.

    Slot 2 stays idle, so kernels can be checked for leaving unnamed slots untouched.
    """
    return [
        Seq(slot=3, past=0, parents=[ROOT, 0, 1, 2, 3]),  # prefill
        Seq(slot=0, past=7, parents=[ROOT]),  # decode step
        Seq(slot=5, past=4, parents=[ROOT, 0, 1]),  # chain
        Seq(slot=1, past=9, parents=[ROOT, ROOT, 0, 1, 2, ROOT, 5]),  # forest of three trees
        Seq(slot=4, past=0, parents=[ROOT, ROOT, 1, 1]),  # forest with no past
    ]


def attention_case(seed: int = 0) -> dict:
    """One ragged attention step over three slots (a tree, a decode token, a forest of two roots) with its caches,
    as the attention op's inputs (the plugin's enqueue body is checked against the reference on it)."""
    g = torch.Generator().manual_seed(seed)
    hq, hkv, d, slots, max_len = 4, 2, 32, 3, 16
    lens, pasts, slot_ids = [3, 1, 4], [5, 9, 0], [2, 0, 1]
    parents = [[-1, 0, 0], [-1], [-1, 0, -1, 2]]  # a tree, a decode token, a forest of two roots
    tokens = sum(lens)
    tree = torch.zeros(tokens, max(lens), dtype=torch.bool)
    row = 0
    for n, par in zip(lens, parents):
        for j in range(n):
            tree[row + j, j] = True
            a = par[j]
            while a >= 0:
                tree[row + j, a] = True
                a = par[a]
        row += n
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    return {
        "q": torch.randn(tokens, hq, d, generator=g),
        "k": torch.randn(tokens, hkv, d, generator=g),
        "v": torch.randn(tokens, hkv, d, generator=g),
        "k_cache": torch.randn(slots, hkv, max_len, d, generator=g),
        "v_cache": torch.randn(slots, hkv, max_len, d, generator=g),
        "cu": cu,
        "past": pasts,
        "slots": slot_ids,
        "tree": tree,
        "scale": d**-0.5,
    }


def ints(x: list[int]) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.int32)

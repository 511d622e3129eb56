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

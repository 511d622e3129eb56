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

"""Torch reference of ``specdec::RaggedTreeAttention``: attention over one ragged step.

This is the semantics every backend (ONNX function body, GPU kernel, TensorRT plugin)
must reproduce. For each sequence b of the pack:
  * its n_b new K/V rows are written into ``k_cache[slot_b, :, past_b : past_b + n_b]``;
  * its new token t attends to cached positions ``[0, past_b)`` (all, or those set in
    ``cache_mask[b]``) and to the new tokens j of its own sequence with ``tree_mask[t, j]``.
There is no attention across sequences, and slots not named in ``slot_ids`` are untouched.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def ragged_tree_attention(
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [slots, Hkv, max_len, D], updated in place
    v_cache: torch.Tensor,  # [slots, Hkv, max_len, D], updated in place
    cu_seqlens: list[int],  # [B + 1]
    past_lens: list[int],  # [B]
    slot_ids: list[int],  # [B]
    tree_mask: torch.Tensor,  # [T, S_max] bool
    scale: float,
    cache_mask: torch.Tensor | None = None,  # [B, >= max(past_lens)] bool
) -> torch.Tensor:  # [T, Hq, D]
    """Write the new K/V in place and return the attention output of every packed token."""
    out = torch.empty_like(q)
    gqa = q.shape[1] != k.shape[1]
    for seq in range(len(slot_ids)):
        start, end = cu_seqlens[seq], cu_seqlens[seq + 1]
        n = end - start
        if n == 0:
            continue
        slot, past = slot_ids[seq], past_lens[seq]
        k_cache[slot, :, past : past + n] = k[start:end].transpose(0, 1)
        v_cache[slot, :, past : past + n] = v[start:end].transpose(0, 1)
        keys = k_cache[slot, :, : past + n]
        values = v_cache[slot, :, : past + n]
        mask = _visible(tree_mask[start:end, :n], past, None if cache_mask is None else cache_mask[seq])
        o = F.scaled_dot_product_attention(
            q[start:end].transpose(0, 1).unsqueeze(0),
            keys.unsqueeze(0),
            values.unsqueeze(0),
            attn_mask=mask,
            scale=scale,
            enable_gqa=gqa,
        )
        out[start:end] = o.squeeze(0).transpose(0, 1)
    return out


def _visible(tree: torch.Tensor, past: int, cache_row: torch.Tensor | None) -> torch.Tensor | None:
    """[n, past + n] bool mask, or None when every key is visible (a single token, no holes)."""
    n = tree.shape[0]
    if n == 1 and cache_row is None:
        return None
    prefix = (
        torch.ones(n, past, dtype=torch.bool, device=tree.device)
        if cache_row is None
        else cache_row[:past].unsqueeze(0).expand(n, past)
    )
    return torch.cat([prefix, tree], dim=1)

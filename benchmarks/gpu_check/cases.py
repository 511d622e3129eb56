"""The cases of the GPU check: random ragged forests, their tensors, and the torch reference they are judged by."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Any

from benchmarks.gpu_check import ROOT


@dataclass
class Case:
    """One ragged step: per-sequence (slot, past, parents) plus the head layout."""

    slots: list[int]
    pasts: list[int]
    parents: list[list[int]]
    hq: int
    hkv: int
    d: int
    num_slots: int
    max_len: int
    cache_mask_width: int = 0  # 0: no cache_mask
    label: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def lens(self) -> list[int]:
        return [len(p) for p in self.parents]


# ----------------------------------------------------------------------------------------------
# case generation
# ----------------------------------------------------------------------------------------------


def _forest(rng: random.Random, n: int) -> list[int]:
    roots = rng.randint(2, max(2, n // 3))
    return [ROOT if j < roots else rng.randint(-1, j - 1) for j in range(n)]


def _seq(rng: random.Random, kind: str, max_n: int, max_prefill: int, max_past: int) -> tuple[int, list[int]]:
    if kind == "decode":
        return rng.randint(1, max_past), [ROOT]
    if kind == "chain":
        n = rng.randint(2, max_n)
        return rng.randint(1, max_past), [ROOT, *range(n - 1)]
    if kind == "forest":
        return rng.choice([0, rng.randint(1, max_past)]), _forest(rng, rng.randint(3, max_n))
    n = rng.randint(2, max_prefill)  # prefill
    return 0, [ROOT, *range(n - 1)]


def random_case(
    rng: random.Random,
    heads: tuple[int, int, int],
    *,
    max_seqs: int,
    max_n: int,
    max_prefill: int,
    max_past: int,
    with_cache_mask: bool,
    label: str,
) -> Case:
    num_seqs = rng.randint(1, max_seqs)
    num_slots = num_seqs + rng.randint(1, 3)  # idle slots always exist
    slots = rng.sample(range(num_slots), num_seqs)
    pasts, parents = [], []
    for _ in range(num_seqs):
        past, par = _seq(rng, rng.choice(("decode", "chain", "forest", "prefill")), max_n, max_prefill, max_past)
        pasts.append(past)
        parents.append(par)
    max_len = max(p + len(q) for p, q in zip(pasts, parents)) + rng.randint(0, 8)
    width = max(pasts) + rng.randint(0, 5) if with_cache_mask else 0
    return Case(
        slots,
        pasts,
        parents,
        *heads,
        num_slots=num_slots,
        max_len=max_len,
        cache_mask_width=max(width, 1) if with_cache_mask else 0,
        label=label,
    )


def _visible(parents: list[int]) -> list[list[int]]:
    """For each new token, the indices it sees (itself and its ancestors)."""
    out = []
    for t in range(len(parents)):
        seen, node = [], t
        while node != ROOT:
            seen.append(node)
            node = parents[node]
        out.append(seen)
    return out


def materialize(case: Case, dtype: Any, device: str, seed: int) -> dict[str, Any]:
    """Random tensors for a case (q/k/v/caches in dtype on device, index tensors int32)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    dev_gen = torch.Generator(device=device).manual_seed(seed)  # big caches are drawn on the device
    total = sum(case.lens)

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=dev_gen, device=device).to(dtype)

    q, k, v = rnd(total, case.hq, case.d), rnd(total, case.hkv, case.d), rnd(total, case.hkv, case.d)
    k_cache = rnd(case.num_slots, case.hkv, case.max_len, case.d)
    v_cache = rnd(case.num_slots, case.hkv, case.max_len, case.d)
    cu = [0]
    for n in case.lens:
        cu.append(cu[-1] + n)
    tree = torch.zeros(total, max(case.lens), dtype=torch.bool)
    rows, cols = [], []
    for b, par in enumerate(case.parents):
        for t, seen in enumerate(_visible(par)):
            rows.extend([cu[b] + t] * len(seen))
            cols.extend(seen)
    tree[rows, cols] = True
    cache_mask = None
    if case.cache_mask_width:
        cache_mask = torch.rand(len(case.slots), case.cache_mask_width, generator=gen) > 0.3
        cache_mask[0] = True
        if len(case.slots) > 1:
            cache_mask[-1] = False  # a sequence whose whole past is hidden
        cache_mask = cache_mask.to(device)
    idx = {"dtype": torch.int32, "device": device}
    return {
        "q": q,
        "k": k,
        "v": v,
        "k_cache": k_cache,
        "v_cache": v_cache,
        "cu": cu,
        "tree": tree.to(device),
        "cache_mask": cache_mask,
        "cu_t": torch.tensor(cu, **idx),
        "past_t": torch.tensor(case.pasts, **idx),
        "slot_t": torch.tensor(case.slots, **idx),
        "scale": 1.0 / math.sqrt(case.d),
    }


# ----------------------------------------------------------------------------------------------
# references
# ----------------------------------------------------------------------------------------------


def reference_cpu_fp32(case: Case, x: dict[str, Any], k_cache: Any, v_cache: Any, dtype: Any = None) -> Any:
    """specdec's torch reference on CPU copies (fp32 unless dtype is given); caches are copies, not updated."""
    import torch

    from specdec.plugins.reference import ragged_tree_attention

    dt = dtype or torch.float32

    def cpu(t: Any) -> Any:
        return t.detach().to("cpu", dt)

    cm = None if x["cache_mask"] is None else x["cache_mask"].cpu()
    return ragged_tree_attention(
        cpu(x["q"]),
        cpu(x["k"]),
        cpu(x["v"]),
        cpu(k_cache),
        cpu(v_cache),
        x["cu"],
        case.pasts,
        case.slots,
        x["tree"].cpu(),
        x["scale"],
        cm,
    )


def reference_on_device(
    q: Any,
    k: Any,
    v: Any,
    k_cache: Any,
    v_cache: Any,
    cu: list[int],
    pasts: list[int],
    slots: list[int],
    tree: Any,
    scale: float,
    cache_mask: Any = None,
) -> Any:
    """The reference algorithm with every mask built on q's device (the timing baseline on CUDA).

    specdec.plugins.reference builds its prefix mask with CPU ``torch.ones``, so it fails on CUDA
    when a sequence has a past and several new tokens; this copy differs only in that.
    """
    import torch
    import torch.nn.functional as F

    out = torch.empty_like(q)
    group = q.shape[1] // k.shape[1]
    for b, slot in enumerate(slots):
        start, end = cu[b], cu[b + 1]
        n, past = end - start, pasts[b]
        if n == 0:
            continue
        k_cache[slot, :, past : past + n] = k[start:end].transpose(0, 1)
        v_cache[slot, :, past : past + n] = v[start:end].transpose(0, 1)
        keys, values = k_cache[slot, :, : past + n], v_cache[slot, :, : past + n]
        if group > 1:
            keys, values = keys.repeat_interleave(group, 0), values.repeat_interleave(group, 0)
        mask = None
        if n > 1 or cache_mask is not None:
            prefix = (
                torch.ones(n, past, dtype=torch.bool, device=q.device)
                if cache_mask is None
                else cache_mask[b, :past].unsqueeze(0).expand(n, past)
            )
            mask = torch.cat([prefix, tree[start:end, :n]], dim=1)
        o = F.scaled_dot_product_attention(
            q[start:end].transpose(0, 1).unsqueeze(0),
            keys.unsqueeze(0),
            values.unsqueeze(0),
            attn_mask=mask,
            scale=scale,
        )
        out[start:end] = o.squeeze(0).transpose(0, 1)
    return out

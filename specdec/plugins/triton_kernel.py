"""GPU kernel of ``specdec::RaggedTreeAttention`` in OpenAI Triton.

Same semantics as :func:`specdec.plugins.reference.ragged_tree_attention` (the definition every
backend must match), for the packed, ragged step of ``design.md``:

* kernel 1 (``kv_write``) scatters the n_b new K/V rows of sequence b into
  ``cache[slot_b, :, past_b + i]``;
* kernel 2 (``attention``) is flash-attention style: one program per (token block of one
  sequence, query head). It runs an online softmax over the cached prefix ``[0, past_b)`` in
  blocks (honouring ``cache_mask`` when given), then over the sequence's new tokens (read back
  from the cache, as the reference does) with the tree mask. GQA: query head h reads KV head
  ``h // (Hq // Hkv)``. fp32 accumulation for fp32/fp16/bf16 inputs.

There is no padding across sequences beyond one block: the launch grid is a table of
(sequence, first row) blocks built on the device from ``cu_seqlens`` (no host sync), sized by
the upper bound ``ceil(T / BLOCK_M) + B``; the few surplus programs exit at once.

Triton is imported lazily, so this module imports (and ``triton_available()`` answers False)
on machines without it. The kernels are built on first use, once per value of
``TRITON_INTERPRET``: with ``TRITON_INTERPRET=1`` they run in Triton's CPU interpreter on CPU
tensors, which is how the tests check them without a GPU.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from specdec.plugins.reference import ragged_tree_attention

# Bound to ``triton.language`` / ``triton`` by ``_kernels()`` on first use: the kernel bodies below
# are plain functions until then, so importing this module never needs triton.
tl: Any = None
triton: Any = None

_LOG2E = 1.4426950408889634
IndexLike = torch.Tensor | Sequence[int]


@dataclass(frozen=True)
class KernelConfig:
    """Tile sizes and launch options; ``None`` fields are chosen by ``_pick_config``.

    Exposed so benchmarks can sweep them on a GPU; the defaults are educated guesses that
    have not been tuned on hardware.
    """

    block_m: int | None = None  # query rows (new tokens of one sequence) per program
    block_n: int | None = None  # keys per inner-loop step
    num_warps: int | None = None
    num_stages: int | None = None


@functools.cache
def triton_available() -> bool:
    """True when ``import triton`` succeeds here (a real import, done once: a broken install counts as absent).

    Called only on the CUDA path, so CPU runs never pay for importing triton.
    """
    try:
        import triton as _triton  # noqa: F401
        import triton.language as _tl  # noqa: F401
    except Exception:  # an install can fail in many ways (missing libs, ABI); all mean "use the reference"
        return False
    return True


def _interpret_mode() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


# ----------------------------------------------------------------------------------------------
# Kernel bodies. They are decorated with ``triton.jit`` lazily in ``_kernels()``; ``tl`` is the
# module global bound there. Keep them free of calls to other Python functions.
# ----------------------------------------------------------------------------------------------


def _kv_write_body(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    cu_ptr,
    past_ptr,
    slot_ptr,
    table_ptr,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vt,
    stride_vh,
    stride_vd,
    stride_kcs,
    stride_kch,
    stride_kcl,
    stride_kcd,
    stride_vcs,
    stride_vch,
    stride_vcl,
    stride_vcd,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Program (kv head, block): copy up to BLOCK_M new K/V rows of one sequence into its slot."""
    head = tl.program_id(0)
    blk = tl.program_id(1)
    seq = tl.load(table_ptr + 2 * blk)
    if seq >= 0:
        m0 = tl.load(table_ptr + 2 * blk + 1)
        start = tl.load(cu_ptr + seq)
        n = tl.load(cu_ptr + seq + 1) - start
        past = tl.load(past_ptr + seq)
        slot = tl.load(slot_ptr + seq).to(tl.int64)
        rows = m0 + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        tile = (rows < n)[:, None] & (offs_d < HEAD_DIM)[None, :]
        src = (start + rows).to(tl.int64)
        dst = (past + rows).to(tl.int64)
        kk = tl.load(k_ptr + src[:, None] * stride_kt + head * stride_kh + offs_d[None, :] * stride_kd, mask=tile)
        vv = tl.load(v_ptr + src[:, None] * stride_vt + head * stride_vh + offs_d[None, :] * stride_vd, mask=tile)
        kc = k_cache_ptr + slot * stride_kcs + head * stride_kch
        vc = v_cache_ptr + slot * stride_vcs + head * stride_vch
        tl.store(
            kc + dst[:, None] * stride_kcl + offs_d[None, :] * stride_kcd,
            kk.to(k_cache_ptr.dtype.element_ty),
            mask=tile,
        )
        tl.store(
            vc + dst[:, None] * stride_vcl + offs_d[None, :] * stride_vcd,
            vv.to(v_cache_ptr.dtype.element_ty),
            mask=tile,
        )


def _attention_body(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    cu_ptr,
    past_ptr,
    slot_ptr,
    table_ptr,
    tree_ptr,
    cmask_ptr,
    qk_scale,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_ot,
    stride_oh,
    stride_od,
    stride_kcs,
    stride_kch,
    stride_kcl,
    stride_kcd,
    stride_vcs,
    stride_vch,
    stride_vcl,
    stride_vcd,
    stride_tt,
    stride_tj,
    tree_cols,
    stride_cb,
    stride_cj,
    cmask_cols,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_CACHE_MASK: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Program (query head, block): BLOCK_M new tokens of one sequence against prefix + own tree."""
    head = tl.program_id(0)
    blk = tl.program_id(1)
    seq = tl.load(table_ptr + 2 * blk)
    if seq >= 0:
        m0 = tl.load(table_ptr + 2 * blk + 1)
        start = tl.load(cu_ptr + seq)
        n = tl.load(cu_ptr + seq + 1) - start
        past = tl.load(past_ptr + seq)
        slot = tl.load(slot_ptr + seq).to(tl.int64)
        kv_head = head // GROUP

        rows = m0 + tl.arange(0, BLOCK_M)  # indices among this sequence's new tokens
        row_ok = rows < n
        grow = (start + rows).to(tl.int64)  # packed row
        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < HEAD_DIM
        offs_n = tl.arange(0, BLOCK_N)

        q = tl.load(
            q_ptr + grow[:, None] * stride_qt + head * stride_qh + offs_d[None, :] * stride_qd,
            mask=row_ok[:, None] & d_ok[None, :],
            other=0.0,
        )
        kc = k_cache_ptr + slot * stride_kcs + kv_head * stride_kch
        vc = v_cache_ptr + slot * stride_vcs + kv_head * stride_vch

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

        # 1) the committed prefix [0, past): every row sees the same keys (minus cache_mask holes)
        for j0 in range(0, past, BLOCK_N):
            cols = j0 + offs_n
            col_ok = cols < past
            if HAS_CACHE_MASK:
                hole = tl.load(
                    cmask_ptr + seq * stride_cb + cols * stride_cj, mask=col_ok & (cols < cmask_cols), other=0
                )
                col_ok = col_ok & (hole != 0)
            kt = tl.load(
                kc + cols[None, :].to(tl.int64) * stride_kcl + offs_d[:, None] * stride_kcd,
                mask=col_ok[None, :] & d_ok[:, None],
                other=0.0,
            )
            s = tl.dot(q, kt, input_precision=DOT_PRECISION) * qk_scale
            s = tl.where(col_ok[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_safe)
            p = tl.exp2(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            vt = tl.load(
                vc + cols[:, None].to(tl.int64) * stride_vcl + offs_d[None, :] * stride_vcd,
                mask=col_ok[:, None] & d_ok[None, :],
                other=0.0,
            )
            acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt, input_precision=DOT_PRECISION)
            m_i = m_new

        # 2) the sequence's own new tokens (already written at past + j), under the tree mask;
        #    blocks where no row of this program sees any key are skipped (for topologically
        #    ordered trees that is everything right of the diagonal block)
        for j0 in range(0, n, BLOCK_N):
            cols = j0 + offs_n
            vis = tl.load(
                tree_ptr + grow[:, None] * stride_tt + cols[None, :] * stride_tj,
                mask=row_ok[:, None] & ((cols < n) & (cols < tree_cols))[None, :],
                other=0,
            )
            vis = vis != 0
            if tl.max(vis.to(tl.int32)) > 0:
                pos = (past + cols).to(tl.int64)
                col_ok = cols < n
                kt = tl.load(
                    kc + pos[None, :] * stride_kcl + offs_d[:, None] * stride_kcd,
                    mask=col_ok[None, :] & d_ok[:, None],
                    other=0.0,
                )
                s = tl.dot(q, kt, input_precision=DOT_PRECISION) * qk_scale
                s = tl.where(vis, s, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(s, 1))
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
                alpha = tl.exp2(m_i - m_safe)
                p = tl.exp2(s - m_safe[:, None])
                l_i = l_i * alpha + tl.sum(p, 1)
                vt = tl.load(
                    vc + pos[:, None] * stride_vcl + offs_d[None, :] * stride_vcd,
                    mask=col_ok[:, None] & d_ok[None, :],
                    other=0.0,
                )
                acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt, input_precision=DOT_PRECISION)
                m_i = m_new

        # a row that sees nothing gives 0, as torch's SDPA (the reference) does
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        o = acc / l_safe[:, None]
        tl.store(
            out_ptr + grow[:, None] * stride_ot + head * stride_oh + offs_d[None, :] * stride_od,
            o.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & d_ok[None, :],
        )


@functools.cache
def _kernels(interpret: bool) -> tuple[Any, Any]:
    """JIT-wrap the kernel bodies (once per interpreter mode: ``triton.jit`` reads it when it wraps)."""
    global tl, triton
    import triton as _triton
    import triton.language as _tl

    triton, tl = _triton, _tl
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1" if interpret else "0"
    try:
        # the tree/cache-mask widths change every step: do not specialise on them (1 / multiple of 16),
        # or each new combination would compile a new kernel variant
        varying = ["stride_tt", "tree_cols", "stride_cb", "cmask_cols"]
        return triton.jit(_kv_write_body), triton.jit(_attention_body, do_not_specialize=varying)
    finally:
        if previous is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = previous


def _pick_config(
    num_tokens: int, num_seqs: int, head_dim: int, dtype: torch.dtype, cfg: KernelConfig | None
) -> tuple[int, int, int, int]:
    """Block sizes from host-known shapes only (no device sync): small blocks for decode/verify steps."""
    cfg = cfg or KernelConfig()
    avg = num_tokens / max(num_seqs, 1)
    block_m = cfg.block_m or (16 if avg <= 16 else 32 if avg <= 48 else 64)
    block_d = max(16, triton_next_pow2(head_dim))
    wide = dtype == torch.float32 or block_d > 128
    block_n = cfg.block_n or (32 if wide else 64)
    num_warps = cfg.num_warps or (4 if block_m <= 64 else 8)
    num_stages = cfg.num_stages or 2
    return block_m, block_n, num_warps, num_stages


def triton_next_pow2(x: int) -> int:
    """Smallest power of two >= x (triton.next_power_of_2 without importing triton)."""
    return 1 << max(0, math.ceil(math.log2(max(x, 1))))


def block_table(cu_seqlens: torch.Tensor, num_tokens: int, block_m: int) -> torch.Tensor:
    """int32 [G, 2] table of (sequence, first row) per program, G = ceil(T / block_m) + B.

    Built with device ops from ``cu_seqlens`` so the host never waits for the GPU; rows past the
    real block count hold sequence -1 (those programs exit). ``G`` bounds the true count because
    sum_b ceil(n_b / M) <= T / M + B.
    """
    device = cu_seqlens.device
    num_seqs = cu_seqlens.shape[0] - 1
    grid = -(-num_tokens // block_m) + num_seqs
    lens = (cu_seqlens[1:] - cu_seqlens[:-1]).to(torch.int64)
    blocks = (lens + block_m - 1) // block_m
    ends = torch.cumsum(blocks, 0)
    g = torch.arange(grid, device=device, dtype=torch.int64)
    seq = torch.searchsorted(ends, g, right=True)
    seq_c = seq.clamp(max=max(num_seqs - 1, 0))
    first = (ends - blocks)[seq_c]
    row0 = (g - first) * block_m
    seq = torch.where(seq < num_seqs, seq, torch.full_like(seq, -1))
    return torch.stack([seq, row0], dim=1).to(torch.int32).contiguous()


def _as_index(x: IndexLike, device: torch.device, name: str) -> torch.Tensor:
    t = x if isinstance(x, torch.Tensor) else torch.tensor(list(x), dtype=torch.int32)
    if t.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name} must be an integer tensor, got {t.dtype}")
    return t.to(device=device, dtype=torch.int32).contiguous()


def _check_shapes(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tree_mask: torch.Tensor,
    num_seqs: int,
    cache_mask: torch.Tensor | None,
) -> None:
    """Validate what the host knows without reading device memory (the kernel trusts the rest)."""
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(f"q, k, v must be [T, H, D], got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    t, hq, d = q.shape
    if k.shape != v.shape or k.shape[0] != t or k.shape[2] != d:
        raise ValueError(f"k {tuple(k.shape)} / v {tuple(v.shape)} do not match q {tuple(q.shape)}")
    hkv = k.shape[1]
    if hkv == 0 or hq % hkv:
        raise ValueError(f"query heads {hq} are not a multiple of KV heads {hkv}")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape or k_cache.shape[1] != hkv or k_cache.shape[3] != d:
        raise ValueError(
            f"caches must be [slots, {hkv}, max_len, {d}], got {tuple(k_cache.shape)}, {tuple(v_cache.shape)}"
        )
    if not (q.dtype == k_cache.dtype == v_cache.dtype):
        raise TypeError(f"q ({q.dtype}) and the caches ({k_cache.dtype}, {v_cache.dtype}) must share a dtype")
    if q.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"unsupported dtype {q.dtype}: fp32, fp16 or bf16")
    if tree_mask.dim() != 2 or tree_mask.shape[0] != t:
        raise ValueError(f"tree_mask must be [T={t}, S_max], got {tuple(tree_mask.shape)}")
    if cache_mask is not None and (cache_mask.dim() != 2 or cache_mask.shape[0] != num_seqs):
        raise ValueError(f"cache_mask must be [B={num_seqs}, >= max(past_lens)], got {tuple(cache_mask.shape)}")
    devices = {x.device for x in (q, k, v, k_cache, v_cache)}
    if len(devices) != 1:
        raise ValueError(f"q, k, v and the caches must be on one device, got {sorted(map(str, devices))}")


def _byte_mask(mask: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A bool mask as uint8 on ``device`` (a free reinterpretation when it already is bool there)."""
    mask = mask.to(device=device)
    if mask.dtype != torch.bool:
        mask = mask != 0
    return mask.view(torch.uint8)


def ragged_tree_attention_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens: IndexLike,
    past_lens: IndexLike,
    slot_ids: IndexLike,
    tree_mask: torch.Tensor,
    scale: float,
    cache_mask: torch.Tensor | None = None,
    *,
    config: KernelConfig | None = None,
) -> torch.Tensor:
    """Triton version of :func:`specdec.plugins.reference.ragged_tree_attention` (same arguments).

    q [T, Hq, D], k/v [T, Hkv, D]; caches [slots, Hkv, max_len, D] updated in place at
    ``past_b + i`` (their dtype must be q's; k/v are cast on write); ``cu_seqlens`` [B+1],
    ``past_lens`` [B], ``slot_ids`` [B] int32 on q's device (int64 or lists are converted);
    ``tree_mask`` [T, S_max] bool; ``cache_mask`` [B, >= max(past_lens)] bool, positions
    beyond its width count as hidden. Any strides are accepted (q/k/v may be views of a fused
    QKV projection). Returns a new [T, Hq, D] tensor of q's dtype.

    Contract the kernel trusts, as the reference does: slots are distinct, ``past_b + n_b <=
    max_len`` and the index tensors are in range (checking would need a device->host sync).
    """
    num_seqs = int(slot_ids.shape[0]) if isinstance(slot_ids, torch.Tensor) else len(slot_ids)
    _check_shapes(q, k, v, k_cache, v_cache, tree_mask, num_seqs, cache_mask)
    num_tokens, hq, head_dim = q.shape
    hkv = k.shape[1]
    device = q.device
    out = torch.empty(q.shape, dtype=q.dtype, device=device)
    if num_tokens == 0 or num_seqs == 0:
        return out
    cu = _as_index(cu_seqlens, device, "cu_seqlens")
    past = _as_index(past_lens, device, "past_lens")
    slots = _as_index(slot_ids, device, "slot_ids")
    if cu.shape[0] != num_seqs + 1 or past.shape[0] != num_seqs:
        raise ValueError(f"cu_seqlens {tuple(cu.shape)} / past_lens {tuple(past.shape)} do not match B={num_seqs}")
    tree = _byte_mask(tree_mask, device)
    cmask = None if cache_mask is None else _byte_mask(cache_mask, device)

    block_m, block_n, num_warps, num_stages = _pick_config(num_tokens, num_seqs, head_dim, q.dtype, config)
    block_d = max(16, triton_next_pow2(head_dim))
    table = block_table(cu, num_tokens, block_m)
    grid_blocks = table.shape[0]
    interpret = _interpret_mode()
    kv_write, attention = _kernels(interpret)
    launch = {} if interpret else {"num_warps": num_warps, "num_stages": num_stages}

    kv_write[(hkv, grid_blocks)](
        k,
        v,
        k_cache,
        v_cache,
        cu,
        past,
        slots,
        table,
        *k.stride(),
        *v.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        HEAD_DIM=head_dim,
        BLOCK_M=block_m,
        BLOCK_D=block_d,
        **({} if interpret else {"num_warps": 4}),
    )
    cm = cmask if cmask is not None else tree  # any valid pointer; unused unless HAS_CACHE_MASK
    attention[(hq, grid_blocks)](
        q,
        k_cache,
        v_cache,
        out,
        cu,
        past,
        slots,
        table,
        tree,
        cm,
        float(scale) * _LOG2E,
        *q.stride(),
        *out.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        tree.stride(0),
        tree.stride(1),
        tree.shape[1],
        cm.stride(0),
        cm.stride(1),
        cm.shape[1],
        GROUP=hq // hkv,
        HEAD_DIM=head_dim,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        HAS_CACHE_MASK=cmask is not None,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        **launch,
    )
    return out


def torch_cuda_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens: IndexLike,
    past_lens: IndexLike,
    slot_ids: IndexLike,
    tree_mask: torch.Tensor,
    scale: float,
    cache_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """The attention call of the torch backend: Triton kernel on CUDA when triton imports, else the reference.

    Index arguments may be lists (as the torch backend passes them) or tensors; the torch
    reference gets lists and the kernel int32 tensors on q's device. Keeping the dispatch here
    means the backend has one call site and CPU runs never touch triton.
    """
    if q.is_cuda and triton_available():
        return ragged_tree_attention_triton(
            q,
            k,
            v,
            k_cache,
            v_cache,
            cu_seqlens,
            past_lens,
            slot_ids,
            tree_mask.to(q.device),
            scale,
            None if cache_mask is None else cache_mask.to(q.device),
        )
    return ragged_tree_attention(
        q,
        k,
        v,
        k_cache,
        v_cache,
        _as_list(cu_seqlens),
        _as_list(past_lens),
        _as_list(slot_ids),
        tree_mask,
        scale,
        cache_mask,
    )


def _as_list(x: IndexLike) -> list[int]:
    return [int(i) for i in x.tolist()] if isinstance(x, torch.Tensor) else [int(i) for i in x]

#!/usr/bin/env python
"""GPU check of the Triton RaggedTreeAttention kernel: correctness against the torch reference, then timing.

Why one script: GPU time is scarce and lent by chance, so everything that needs the device runs
in one pass that fits the lease (default budget 420 s, hard stop well under 8 minutes):

1. correctness — many random ragged forests (prefill, decode, chains, multi-root forests, idle
   slots, GQA ratios 1/3/4/4, head dims 64/80/128, cache_mask with holes) in fp32, fp16, bf16:
   kernel output vs the reference run in fp32 on the CPU, caches bitwise equal to the expected
   scatter, idle slots bitwise untouched; plus the CUDA dispatch (``torch_cuda_attention``),
   a host-sync-free launch and a CUDA-graph replay (both reported, not fatal);
2. timing — ms per call of the kernel (default tiles, and a small tile sweep whose outputs must
   agree) against the torch reference (per-sequence SDPA loop) at realistic sizes:
   Hq=32, Hkv=8, D=128, cache 4096, B=1..64 sequences, T up to 512.

Writes ``gpu_check.json`` and ``gpu_check.md`` to $OUT (when set) or benchmarks/results/.
Exit status: 0 all good (or "SKIPPED: no CUDA"), 1 a mismatch, 3 triton missing on a CUDA machine.
``--cpu-interpret`` runs tiny cases through Triton's CPU interpreter: it only tests this script.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # the GPU machine has torch and triton but not this package installed

ROOT = -1
TOL = {"float32": 1e-4, "float16": 1e-2, "bfloat16": 5e-2}  # max |Δ| vs the fp32 reference


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


# ----------------------------------------------------------------------------------------------
# correctness
# ----------------------------------------------------------------------------------------------


def check_case(tk: Any, case: Case, dtype: Any, device: str, seed: int, config: Any = None) -> dict[str, Any]:
    """Run the kernel once; compare output and caches. Returns a JSON-able record with ``ok``."""
    import torch

    x = materialize(case, dtype, device, seed)
    k_before, v_before = x["k_cache"].clone(), x["v_cache"].clone()
    out = tk.ragged_tree_attention_triton(
        x["q"],
        x["k"],
        x["v"],
        x["k_cache"],
        x["v_cache"],
        x["cu_t"],
        x["past_t"],
        x["slot_t"],
        x["tree"],
        x["scale"],
        x["cache_mask"],
        config=config,
    )
    want = reference_cpu_fp32(case, x, k_before, v_before)
    got = out.detach().float().cpu()
    err = (got - want).abs().max().item() if got.numel() else 0.0
    finite = bool(torch.isfinite(got).all())
    k_expect, v_expect = k_before.clone(), v_before.clone()
    for b, (slot, past) in enumerate(zip(case.slots, case.pasts)):
        n = case.lens[b]
        k_expect[slot, :, past : past + n] = x["k"][x["cu"][b] : x["cu"][b + 1]].transpose(0, 1)
        v_expect[slot, :, past : past + n] = x["v"][x["cu"][b] : x["cu"][b + 1]].transpose(0, 1)
    caches_ok = bool(torch.equal(x["k_cache"], k_expect) and torch.equal(x["v_cache"], v_expect))
    idle = sorted(set(range(case.num_slots)) - set(case.slots))
    idle_ok = all(torch.equal(x["k_cache"][s], k_before[s]) and torch.equal(x["v_cache"][s], v_before[s]) for s in idle)
    name = str(dtype).removeprefix("torch.")
    rec = {
        "label": case.label,
        "dtype": name,
        "B": len(case.slots),
        "T": sum(case.lens),
        "S_max": max(case.lens),
        "max_past": max(case.pasts),
        "Hq": case.hq,
        "Hkv": case.hkv,
        "D": case.d,
        "cache_mask": bool(case.cache_mask_width),
        "idle_slots": len(idle),
        "max_abs_err": err,
        "tol": TOL[name],
        "finite": finite,
        "caches_ok": caches_ok,
        "idle_untouched": idle_ok,
    }
    if name != "float32":  # context: how far torch itself lands at this precision (CPU SDPA)
        try:
            lowp = reference_cpu_fp32(case, x, k_before, v_before, dtype=dtype).float()
            rec["reference_lowp_err"] = (lowp - want).abs().max().item()
        except Exception as exc:  # CPU SDPA may lack a low-precision kernel on some builds
            rec["reference_lowp_err"] = f"n/a ({type(exc).__name__})"
    rec["ok"] = finite and err < TOL[name] and caches_ok and idle_ok
    return rec


def correctness(tk: Any, device: str, deadline: float, small: bool) -> tuple[list[dict[str, Any]], list[str]]:
    """Random ragged forests in three dtypes; stops early (and says so) at the deadline."""
    import torch

    heads_by_dtype = {  # a bounded set of (Hq, Hkv, D): every distinct combination compiles a kernel variant
        torch.float32: [(32, 8, 128), (12, 4, 64), (8, 8, 64)],
        torch.float16: [(32, 8, 128), (12, 4, 64), (8, 8, 64), (4, 1, 128), (8, 2, 80)],
        torch.bfloat16: [(32, 8, 128), (12, 4, 64), (8, 2, 80)],
    }
    if small:
        heads_by_dtype = {torch.float32: [(4, 2, 32), (3, 1, 32)], torch.float16: [(4, 2, 32)]}
    per_heads = 2 if small else 4
    sizes = (
        {"max_seqs": 4, "max_n": 8, "max_prefill": 20, "max_past": 40}
        if small
        else {"max_seqs": 12, "max_n": 48, "max_prefill": 160, "max_past": 600}
    )
    # round-robin over dtypes and head layouts, so a deadline cut leaves every dtype covered
    jobs = [(i, dtype, heads) for i in range(per_heads) for dtype, hl in heads_by_dtype.items() for heads in hl]
    records, notes = [], []
    rng = random.Random(1234)
    for seed, (i, dtype, heads) in enumerate(jobs):
        if time.monotonic() > deadline:
            notes.append(f"correctness stopped at the deadline after {len(records)} of {len(jobs)} cases")
            break
        case = random_case(rng, heads, with_cache_mask=i % 2 == 1, label=f"random-{seed}", **sizes)
        try:
            rec = check_case(tk, case, dtype, device, seed)
        except Exception as exc:
            rec = {
                "label": case.label,
                "dtype": str(dtype).removeprefix("torch."),
                "ok": False,
                "error": f"{type(exc).__name__}: {exc}",
                "trace": traceback.format_exc()[-3000:],
            }
        records.append(rec)
        status = "ok" if rec["ok"] else "MISMATCH"
        print(
            f"  [{status}] {rec.get('dtype')} {rec.get('label')} B={rec.get('B')} T={rec.get('T')} "
            f"Hq/Hkv/D={heads} cache_mask={rec.get('cache_mask')} err={rec.get('max_abs_err', '-')}"
            + (f" {rec['error']}" if "error" in rec else ""),
            flush=True,
        )
    return records, notes


def extra_checks(tk: Any, device: str) -> dict[str, Any]:
    """Dispatch (kernel on CUDA, reference on CPU), no host sync, CUDA-graph replay. Only dispatch is fatal."""
    import torch

    rng = random.Random(99)
    shape = (8, 2, 64) if device == "cuda" else (4, 2, 32)
    case = random_case(
        rng, shape, max_seqs=6, max_n=12, max_prefill=30, max_past=100, with_cache_mask=False, label="extra"
    )
    dtype = torch.float16 if device == "cuda" else torch.float32
    x = materialize(case, dtype, device, 7)
    args = (
        x["q"],
        x["k"],
        x["v"],
        x["k_cache"],
        x["v_cache"],
        x["cu_t"],
        x["past_t"],
        x["slot_t"],
        x["tree"],
        x["scale"],
    )
    res: dict[str, Any] = {}
    a = tk.ragged_tree_attention_triton(*args)
    b = tk.torch_cuda_attention(*args)
    if device != "cuda":  # on CPU the dispatch must pick the reference
        want = reference_cpu_fp32(case, x, x["k_cache"], x["v_cache"])
        res["dispatch_ok"] = bool(torch.equal(b, want))
        return res
    res["dispatch_ok"] = bool(torch.equal(a, b))  # on CUDA it must be the kernel, bit for bit
    try:
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            tk.ragged_tree_attention_triton(*args)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        res["host_sync_free"] = True
    except Exception as exc:
        res["host_sync_free"] = f"no: {type(exc).__name__}: {exc}"[:300]
    try:
        tk.ragged_tree_attention_triton(*args)  # compiled and warm before capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            g_out = tk.ragged_tree_attention_triton(*args)
        graph.replay()
        torch.cuda.synchronize()
        res["cuda_graph_replay_matches"] = bool(torch.equal(g_out, a))
    except Exception as exc:
        res["cuda_graph_replay_matches"] = f"no: {type(exc).__name__}: {exc}"[:300]
    return res


# ----------------------------------------------------------------------------------------------
# timing
# ----------------------------------------------------------------------------------------------


def timing_cases(small: bool) -> list[Case]:
    """Realistic steps for a LLaMA-7B-like layer (Hq=32, Hkv=8, D=128, cache 4096)."""
    rng = random.Random(4242)
    hq, hkv, d, max_len = (4, 2, 32, 64) if small else (32, 8, 128, 4096)
    lo, hi = (4, 40) if small else (512, 3500)

    def make(label: str, items: list[tuple[int, list[int]]]) -> Case:
        return Case(
            list(range(len(items))),
            [p for p, _ in items],
            [par for _, par in items],
            hq,
            hkv,
            d,
            num_slots=len(items) + 1,
            max_len=max_len,
            label=label,
        )

    def chain(n: int) -> list[int]:
        return [ROOT, *range(n - 1)]

    if small:
        return [
            make("decode B=4", [(rng.randint(lo, hi), [ROOT]) for _ in range(4)]),
            make("forests B=2", [(rng.randint(lo, hi), _forest(rng, 10)) for _ in range(2)]),
        ]
    return [
        make("decode B=8", [(rng.randint(3000, 4000), [ROOT]) for _ in range(8)]),
        make("decode B=64", [(rng.randint(lo, 4000), [ROOT]) for _ in range(64)]),
        make("EMS verify chains B=64 (n 1-8)", [(rng.randint(lo, hi), chain(rng.randint(1, 8))) for _ in range(64)]),
        make(
            "DSBD forests B=16 (n 16-32)", [(rng.randint(lo, hi), _forest(rng, rng.randint(16, 32))) for _ in range(16)]
        ),
        make(
            "mixed B=32: prefill 256 + 31 chains",
            [(0, chain(256))] + [(rng.randint(lo, hi), chain(rng.randint(1, 8))) for _ in range(31)],
        ),
        make("prefill B=8 x 64", [(0, chain(64)) for _ in range(8)]),
        make("prefill B=1 x 512", [(0, chain(512))]),
    ]


def _time(fn: Any, iters: int, device: str) -> float:
    """ms per call (CUDA events on GPU, wall clock otherwise), after warm-up."""
    import torch

    for _ in range(2):
        fn()
    if device != "cuda":
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - t0) * 1000 / iters
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def _work(case: Case) -> tuple[float, float]:
    """(attention FLOPs counting visible keys only, bytes of K/V that must be read once per KV head)."""
    flops, kv_bytes = 0.0, 0.0
    for past, par in zip(case.pasts, case.parents):
        seen = sum(len(s) for s in _visible(par))
        flops += 4.0 * case.hq * case.d * (len(par) * past + seen)
        kv_bytes += 2.0 * case.hkv * case.d * (past + len(par)) * 2  # fp16/bf16
    return flops, kv_bytes


def time_case(
    tk: Any,
    case: Case,
    dtype: Any,
    device: str,
    deadline: float,
    sweep: list[Any],
    iters: int,
    ref_iters: int,
    notes: list[str],
) -> dict[str, Any]:
    """One timing row: default tiles, the reference loop, then the tile sweep (whose outputs must agree)."""
    x = materialize(case, dtype, device, 5)
    base = (x["q"], x["k"], x["v"], x["k_cache"], x["v_cache"])
    idx = (x["cu_t"], x["past_t"], x["slot_t"], x["tree"], x["scale"])
    row: dict[str, Any] = {
        "case": case.label,
        "dtype": str(dtype).removeprefix("torch."),
        "B": len(case.slots),
        "T": sum(case.lens),
        "S_max": max(case.lens),
        "mean_past": sum(case.pasts) / len(case.pasts),
        "Hq": case.hq,
        "Hkv": case.hkv,
        "D": case.d,
    }

    def kernel(cfg: Any = None) -> Any:
        return tk.ragged_tree_attention_triton(*base, *idx, config=cfg)

    ref_args = (*base, x["cu"], case.pasts, case.slots, x["tree"], x["scale"])
    default_out = kernel()
    row["kernel_ms"] = _time(kernel, iters, device)
    ref_out = reference_on_device(*ref_args)
    row["reference_ms"] = _time(lambda: reference_on_device(*ref_args), ref_iters, device)
    row["kernel_vs_reference_max_abs"] = (default_out.float() - ref_out.float()).abs().max().item()
    row["speedup"] = row["reference_ms"] / row["kernel_ms"]
    flops, kv_bytes = _work(case)
    row["kernel_tflops"] = flops / (row["kernel_ms"] * 1e-3) / 1e12
    row["kernel_kv_gbps"] = kv_bytes / (row["kernel_ms"] * 1e-3) / 1e9
    best, sweep_rows = ("default", row["kernel_ms"]), []
    for cfg in sweep:
        if time.monotonic() > deadline:
            notes.append(f"tile sweep cut short at the deadline in '{case.label}'")
            break
        name = f"m{cfg.block_m}/n{cfg.block_n}/w{cfg.num_warps}/s{cfg.num_stages}"
        try:
            diff = (kernel(cfg).float() - default_out.float()).abs().max().item()
            ms = _time(lambda cfg=cfg: kernel(cfg), iters, device)
            sweep_rows.append({"config": name, "ms": ms, "max_abs_vs_default": diff, "ok": diff < TOL["float16"]})
            if ms < best[1]:
                best = (name, ms)
        except Exception as exc:  # e.g. a tile that does not fit shared memory: record it, go on
            sweep_rows.append({"config": name, "error": f"{type(exc).__name__}: {exc}"[:300], "ok": True})
    row["sweep"] = sweep_rows
    row["best_config"], row["best_ms"] = best
    row["ok"] = row["kernel_vs_reference_max_abs"] < TOL[row["dtype"]] and all(s["ok"] for s in sweep_rows)
    return row


def timing(tk: Any, device: str, deadline: float, small: bool) -> tuple[list[dict[str, Any]], list[str]]:
    """Time every realistic case until the deadline."""
    import torch

    dtype = torch.float16 if device == "cuda" else torch.float32
    sweep = [
        tk.KernelConfig(16, 64, 4, 2),
        tk.KernelConfig(32, 64, 4, 3),
        tk.KernelConfig(64, 64, 4, 3),
        tk.KernelConfig(64, 32, 4, 2),
        tk.KernelConfig(64, 128, 8, 3),
        tk.KernelConfig(128, 64, 8, 3),
        tk.KernelConfig(16, 128, 4, 3),
    ]
    if small:
        sweep = sweep[:2]
    iters, ref_iters = (2, 1) if small else (30, 5)
    rows: list[dict[str, Any]] = []
    notes: list[str] = []
    for case in timing_cases(small):
        if time.monotonic() > deadline:
            notes.append(f"timing stopped at the deadline before '{case.label}'")
            break
        try:
            row = time_case(tk, case, dtype, device, deadline, sweep, iters, ref_iters, notes)
        except Exception as exc:
            row = {
                "case": case.label,
                "ok": False,
                "error": f"{type(exc).__name__}: {exc}",
                "trace": traceback.format_exc()[-3000:],
            }
            print(f"  {case.label}: ERROR {row['error']}", flush=True)
        else:
            print(
                f"  {case.label:40s} T={row['T']:4d} kernel {row['kernel_ms']:.3f} ms  reference "
                f"{row['reference_ms']:.3f} ms  x{row['speedup']:.1f}  best {row['best_config']} "
                f"{row['best_ms']:.3f} ms",
                flush=True,
            )
        rows.append(row)
        if device == "cuda":
            torch.cuda.empty_cache()
    return rows, notes


# ----------------------------------------------------------------------------------------------
# report
# ----------------------------------------------------------------------------------------------


def markdown(report: dict[str, Any]) -> str:
    env = report["environment"]
    lines = [
        "# RaggedTreeAttention Triton kernel — GPU check",
        "",
        f"- device: {env.get('gpu', 'cpu (interpreter)')}; torch {env['torch']}; triton {env['triton']}; "
        f"CUDA {env.get('cuda', '-')}",
        f"- verdict: **{'PASS' if report['ok'] else 'FAIL'}**; wall {report['wall_s']:.0f} s",
        "",
        "## Correctness (kernel vs torch reference in fp32 on CPU)",
        "",
        "| dtype | cases | failures | max abs err | tol | worst torch-at-dtype err |",
        "|---|---|---|---|---|---|",
    ]
    for dtype, s in report["correctness_summary"].items():
        lines.append(
            f"| {dtype} | {s['cases']} | {s['failures']} | {s['max_abs_err']:.2e} | {s['tol']:.0e} | "
            f"{s['reference_lowp_err']} |"
        )
    lines += [
        "",
        f"Extra checks: `{json.dumps(report['extra_checks'])}`",
        "",
        "## Timing (ms per call, one layer; reference = per-sequence SDPA loop)",
        "",
        "| case | B | T | S_max | mean past | kernel ms | reference ms | speedup | TFLOP/s | KV GB/s "
        "| best tile | best ms |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["timing"]:
        if "error" in r:
            lines.append(f"| {r['case']} | ERROR: {r['error'][:200]} |")
            continue
        lines.append(
            f"| {r['case']} | {r['B']} | {r['T']} | {r['S_max']} | {r['mean_past']:.0f} | "
            f"{r['kernel_ms']:.3f} | {r['reference_ms']:.3f} | {r['speedup']:.1f} | "
            f"{r['kernel_tflops']:.1f} | {r['kernel_kv_gbps']:.0f} | {r['best_config']} | "
            f"{r['best_ms']:.3f} |"
        )
    if report["notes"]:
        lines += ["", "Notes:", *[f"- {n}" for n in report["notes"]]]
    failures = [r for r in report["correctness"] if not r["ok"]]
    if failures:
        lines += ["", "## Failures", "", "```", *[json.dumps(r)[:1500] for r in failures[:20]], "```"]
    return "\n".join(lines) + "\n"


def _summary(records: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for r in records:
        s = out.setdefault(
            r.get("dtype", "?"),
            {
                "cases": 0,
                "failures": 0,
                "max_abs_err": 0.0,
                "tol": TOL.get(r.get("dtype", ""), 0.0),
                "reference_lowp_err": "-",
            },
        )
        s["cases"] += 1
        s["failures"] += 0 if r["ok"] else 1
        s["max_abs_err"] = max(s["max_abs_err"], r.get("max_abs_err", float("inf")))  # inf: the case raised
        low = r.get("reference_lowp_err")
        if isinstance(low, float):
            s["reference_lowp_err"] = low if s["reference_lowp_err"] == "-" else max(s["reference_lowp_err"], low)
    for s in out.values():
        if isinstance(s["reference_lowp_err"], float):
            s["reference_lowp_err"] = f"{s['reference_lowp_err']:.2e}"
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--budget-s", type=float, default=420.0, help="wall-clock budget; phases stop early")
    parser.add_argument("--out", default=os.environ.get("OUT") or str(REPO / "benchmarks" / "results"))
    parser.add_argument(
        "--cpu-interpret",
        action="store_true",
        help="tiny cases in Triton's CPU interpreter: tests this script, measures nothing",
    )
    args = parser.parse_args(argv)
    t0 = time.monotonic()
    os.environ["TRITON_INTERPRET"] = "1" if args.cpu_interpret else "0"

    import torch

    if not args.cpu_interpret and not torch.cuda.is_available():
        print("SKIPPED: no CUDA — this check needs an NVIDIA GPU (torch.cuda.is_available() is False)")
        return 0
    from specdec.plugins import triton_kernel as tk

    if not tk.triton_available():
        print("ERROR: CUDA is present but OpenAI Triton does not import (pip install triton); nothing was checked")
        return 3
    import triton

    device = "cpu" if args.cpu_interpret else "cuda"
    env = {
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "interpreter": args.cpu_interpret,
    }
    if device == "cuda":
        env.update(
            gpu=torch.cuda.get_device_name(),
            cuda=torch.version.cuda,
            capability=".".join(map(str, torch.cuda.get_device_capability())),
        )
    print(f"gpu_check: {env}", flush=True)

    print("correctness:", flush=True)
    records, notes = correctness(tk, device, t0 + 0.5 * args.budget_s, args.cpu_interpret)
    extra = extra_checks(tk, device)
    print(f"extra checks: {extra}", flush=True)
    print("timing:", flush=True)
    rows, tnotes = timing(tk, device, t0 + 0.95 * args.budget_s, args.cpu_interpret)
    notes += tnotes
    ok = bool(records) and all(r["ok"] for r in records) and extra["dispatch_ok"] and all(r["ok"] for r in rows)
    report = {
        "ok": ok,
        "environment": env,
        "wall_s": time.monotonic() - t0,
        "notes": notes,
        "correctness_summary": _summary(records),
        "extra_checks": extra,
        "timing": rows,
        "correctness": records,
    }
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "gpu_check.json").write_text(json.dumps(report, indent=1, default=str))
    (out_dir / "gpu_check.md").write_text(markdown(report))
    print(markdown(report))
    print(f"wrote {out_dir / 'gpu_check.json'} and {out_dir / 'gpu_check.md'}")
    print("PASS" if ok else "FAIL: kernel mismatch (see the failures above)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

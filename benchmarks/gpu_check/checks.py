"""Correctness of the Triton kernel against the reference, and the CUDA dispatch / launch / graph checks."""

from __future__ import annotations

import random
import time
import traceback
from typing import Any

from benchmarks.gpu_check import TOL
from benchmarks.gpu_check.cases import Case, materialize, random_case, reference_cpu_fp32

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

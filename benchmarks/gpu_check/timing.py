"""Timing of the Triton kernel against the torch reference at realistic sizes."""

from __future__ import annotations

import random
import time
import traceback
from typing import Any

from benchmarks.gpu_check import ROOT, TOL
from benchmarks.gpu_check.cases import Case, _forest, _visible, materialize, reference_on_device

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

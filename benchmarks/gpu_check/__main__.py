"""``python -m benchmarks.gpu_check``: the report and the one pass that fits the GPU lease."""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import benchmarks.gpu_check as package
from benchmarks.gpu_check import TOL
from benchmarks.gpu_check.checks import correctness, extra_checks
from benchmarks.gpu_check.timing import timing

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
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu_check", description=package.__doc__.split("\n")[0])
    parser.add_argument("--budget-s", type=float, default=420.0, help="wall-clock budget; phases stop early")
    parser.add_argument("--out", default=os.environ.get("OUT") or str(Path(__file__).resolve().parents[1] / "results"))
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

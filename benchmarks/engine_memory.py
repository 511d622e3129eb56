"""Resident memory of an engine opened on an export, with the KV caches filled at allocation or mapped lazily.

``HostKVStorage`` allocates the host caches with ``np.zeros`` (``calloc``), so a cache sized
``max_batch x max_len`` costs resident memory only for the positions sequences use; a cache
written at allocation (here: every cache filled right after the engine opens) is resident in full.
Each row runs in a fresh process: open the export as ``specdec serve`` sizes it (``--max-batch``,
``--max-len``), then answer one short chat request with ``ar``; VmHWM is the peak, VmRSS what stays.
The process imports no torch (the runtime is numpy); the report says so per row.

    python -m benchmarks.served_configs   # makes the exports under benchmarks/.cache/served
    python -m benchmarks.engine_memory benchmarks/.cache/served/int4-hybrid benchmarks/.cache/served/fp32-n-gram

Results: ``benchmarks/results/engine_memory.{md,json,png}``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from tqdm import tqdm

from specdec.bench.figures import figure
from specdec.bench.harness import utc_stamp
from specdec.runtime.config import EngineConfig

DEFAULT_OUT = Path(__file__).resolve().parent / "results"
FILLS = ("written at allocation", "lazy pages (calloc)")


def child(export: str, fill: str, max_batch: int, max_len: int, kv_cache: str) -> dict[str, Any]:
    from specdec.runtime.engine import Engine

    def status() -> dict[str, int]:
        return {
            line.split(":")[0]: int(line.split()[1]) // 1024
            for line in open("/proc/self/status")
            if line.startswith(("VmHWM", "VmRSS"))
        }

    engine = Engine.from_export(
        export,
        config=EngineConfig(max_batch=max_batch, max_len=max_len, drafter="ngram", threads=2, kv_cache_dtype=kv_cache),
    )
    if fill == FILLS[0]:  # every page of every cache written, as an allocation that fills its memory would
        for cache in (*engine.storage.k, *engine.storage.v):
            cache.fill(0)
    opened = status()
    engine.generate([engine.request("Explain why the sky is blue in two sentences.", chat=True, max_tokens=32)], "ar")
    done = status()
    return {
        "cache_dtype": str(engine.storage.k[0].dtype),
        "open_rss_mb": opened["VmRSS"],
        "peak_mb": done["VmHWM"],
        "after_request_rss_mb": done["VmRSS"],
        "torch_imported": "torch" in sys.modules,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("exports", nargs="*", help="export directories")
    parser.add_argument("--max-batch", type=int, default=8)
    parser.add_argument("--max-len", type=int, default=2048)
    parser.add_argument(
        "--kv-cache",
        default="float32,float16",
        help="KV-cache types to measure, comma-separated (Engine.from_export's kv_cache_dtype)",
    )
    parser.add_argument("--out-dir", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(*args.child[:2], args.max_batch, args.max_len, args.child[2])))
        return 0
    rows = []
    runs = [(e, f, k) for e in args.exports for k in args.kv_cache.split(",") for f in FILLS]
    for export, fill, kv in tqdm(runs, desc="engines"):
        out = subprocess.run(
            [
                sys.executable,
                __file__,
                "--child",
                export,
                fill,
                kv,
                "--max-batch",
                str(args.max_batch),
                "--max-len",
                str(args.max_len),
            ],
            check=True,
            capture_output=True,
            text=True,
        )
        rows.append({"export": export, "fill": fill, **json.loads(out.stdout.strip().splitlines()[-1])})
    lines = [
        "# Engine memory: KV caches filled at allocation or mapped as used",
        "",
        f"- Date: {utc_stamp()}; command: "
        f"`python -m benchmarks.engine_memory {' '.join(args.exports)} --kv-cache {args.kv_cache}`",
        "- Each row a fresh process: "
        f"`Engine.from_export(config=EngineConfig(max_batch={args.max_batch}, max_len={args.max_len}))` "
        "(the main job's served size), then one 32-token chat request with ar",
        "",
        "| export | KV cache type | KV cache allocation | RSS after open (MB) | RSS after one request (MB) | "
        "peak (MB) | torch imported |",
        "|:---|:---|:---|---:|---:|---:|:---|",
    ]
    lines += [
        f"| {r['export']} | {r['cache_dtype']} | {r['fill']}"
        f" | {r['open_rss_mb']} | {r['after_request_rss_mb']} | {r['peak_mb']} | "
        f"{'yes' if r['torch_imported'] else 'no'} |"
        for r in rows
    ]
    text = "\n".join(lines) + "\n"
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "engine_memory.md").write_text(text)
    (args.out_dir / "engine_memory.json").write_text(json.dumps(rows, indent=2) + "\n")
    with figure(args.out_dir / "engine_memory.png", figsize=(max(7, 1.1 * len(rows)), 3.8)) as (_, ax):
        labels = [f"{Path(r['export']).name}\n{r['cache_dtype']}\n{r['fill'].split(' (')[0]}" for r in rows]
        ax.bar(labels, [r["peak_mb"] for r in rows])
        ax.set_ylabel("peak RSS (MB)")
        ax.set_title(f"Engine at max_batch {args.max_batch} x max_len {args.max_len}")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

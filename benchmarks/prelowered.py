"""A graph as ``OrtBackend`` lowers it, saved, and run again as it is: comparing two versions' lowerings in one process.

Why: the ONNX Runtime lowering (``ort_fuse``, ``ort_cache_dtype``) happens in memory when a backend
opens a graph, so the lowering of an older specdec cannot be timed beside the current one in the
same process, which is what interleaved A/B timing on a shared machine needs. This module saves a
lowering (run it with the older specdec first on the import path) into a directory: the lowered
graph, hard links to its weights, its ``FuseReport``; ``PreLowered`` opens such a directory as
``OrtBackend`` would have served the graph then (its caches, spare positions and sub-steps as its
report says). ``benchmarks/step_profile.py`` takes one as ``lowered:DIR``.

Run (the older version's lowering, from its own checkout or an archive of it)::

    cd /tmp && PYTHONPATH=/path/to/old:/path/to/this python -m benchmarks.prelowered \\
        exports/int4/target/model.onnx lowered/int4-before --cache-dtype float16
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

REPORT = "fuse_report.json"


def lower(graph: Path, out: Path, cache_dtype: str | None) -> dict:
    """Write ``graph`` as the importable specdec lowers it (all rewrites, caches of ``cache_dtype``) into ``out``."""
    import onnx

    from specdec.runtime.backends import ort_cache_dtype, ort_fuse

    proto = onnx.load(str(graph), load_external_data=False)
    report = ort_fuse.fuse_model(proto)
    if cache_dtype:
        ort_cache_dtype.retype_caches(proto, cache_dtype)
    out.mkdir(parents=True, exist_ok=True)
    for item in graph.parent.iterdir():
        if item.name != graph.name and item.is_file() and not (out / item.name).exists():
            os.link(item.resolve(), out / item.name)  # ORT refuses external data reached through a symlink
    onnx.save_model(proto, str(out / "model.onnx"))
    doc = {**dataclasses.asdict(report), "source": str(graph), "nodes": len(proto.graph.node)}
    (out / REPORT).write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    return doc


def pre_lowered(directory: Path, **options: object):  # -> OrtBackend
    """An ``OrtBackend`` over a saved lowering (``lower``): the graph run as it is, with the report it was made with."""
    from specdec.runtime.backends.onnxruntime import OrtBackend
    from specdec.runtime.backends.ort_fuse import FuseReport

    doc = json.loads((directory / REPORT).read_text())
    backend = OrtBackend(directory / "model.onnx", fuse=False, **options)  # type: ignore[arg-type]
    backend.fuse_report = FuseReport(counts=doc["counts"], skipped=doc["skipped"], fold=doc["fold"])
    return backend


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("graph", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--cache-dtype", default=None, help="float16: the caches of a quantized export as served")
    args = parser.parse_args(argv)
    print(json.dumps(lower(args.graph, args.out, args.cache_dtype)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

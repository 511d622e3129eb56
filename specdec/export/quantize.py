"""The export's quantization step (``specdec-export --quantize``): rewrite a graph with a strategy, then check it.

After ``export_onnx`` wrote the fp32 graph, a ``QuantizationStrategy`` (``quantization.strategies``,
built from the flags by ``strategy_for``) decides what each linear weight and the embedding table
become, the shared rewrite (``quantization.rewrite``) puts them in the graph, and the graph is
checked against the torch backend over the weights it now computes (``quantize_and_validate``).
Why the check runs without the rounding of activations: it tests the graph (packing, nibble order,
row order, Q4_1 offsets, a chain's codes, scales and smoothing), not the rounding, which is recorded
beside it and measured in ``benchmarks/results/quantize.md``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from specdec.export.quantization.blocks import QuantizeError
from specdec.export.quantization.rewrite import rewrite_graph
from specdec.export.quantization.sources import dequantized_model
from specdec.export.quantization.strategies import QuantizationStrategy


def quantize_export(model: Any, graph: str | os.PathLike, strategy: QuantizationStrategy) -> tuple[Any, dict]:
    """Quantize the exported ``graph`` of ``model`` in place with ``strategy``; (the de-quantized model: the source
    with the weights the graph computes, the manifest's summary)."""
    plan = strategy.plan(model)
    rewritten = rewrite_graph(graph, strategy, plan)
    reference = dequantized_model(model, plan.blocks, plan.embedding, rewritten.computed)
    return reference, {**strategy.describe(plan), **rewritten.summary}


def quantize_and_validate(
    model: Any, graph: str | os.PathLike, strategy: QuantizationStrategy, tolerance: float
) -> dict:
    """Quantize ``graph``, check it tightly (``strategy.checked``); the manifest's ``quantize`` entry.

    The check runs the graph with its stored weights computed exactly against the torch backend over
    the de-quantized weights, and must stay below ``tolerance``. The shipped graph's error against
    that reference and against the fp32 source are recorded, not asserted: they are the rounding of
    activations and weights.
    """
    from specdec.export.validate import max_logit_error
    from specdec.runtime.backends.onnxruntime import OrtBackend
    from specdec.runtime.backends.torch_backend import TorchBackend

    reference_model, summary = quantize_export(model, graph, strategy)
    reference = TorchBackend(reference_model)
    with strategy.checked(Path(graph)) as checked:
        error = max_logit_error(reference, OrtBackend(checked))
    if error > tolerance:
        raise QuantizeError(
            f"{graph}: the quantized graph differs from the torch reference over its de-quantized "
            f"weights by {error:.3g} (tolerance {tolerance}): not writing a broken export"
        )
    shipped = OrtBackend(graph)
    return {
        **summary,
        "accuracy_level": strategy.accuracy_level,
        "validation_max_abs_logit_error_fp32_activations": error,
        "max_abs_logit_error_vs_dequantized": max_logit_error(reference, shipped),
        "max_abs_logit_error_vs_fp32": max_logit_error(TorchBackend(model), OrtBackend(graph)),
    }

"""polygraphy's side of the ONNX Runtime (function body) vs TensorRT (plugin) comparison.

``specdec.export.tensorrt.polygraphy_recipe`` writes a ``polygraphy run`` command that names this
file twice: ``--data-loader-script FILE:load_data`` (both runners get the same valid ragged
packs; random index inputs would crash any ragged kernel) and
``--trt-network-postprocess-script FILE:postprocess`` (``build_engine``'s network edits).
polygraphy imports the file as a top-level module named ``polygraphy_glue``; that import
registers the Python plugin, so it is known before TensorRT parses the graph. The plugin module
is imported by its package name, so polygraphy's process holds one copy of it whichever way
this file was loaded.

The glue lives in the export layer, not beside the plugin, because it builds its feeds from the
export's validation packs and the runtime's packer; ``specdec.plugins.trt_plugin`` stays free of
anything above the plugins layer.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from specdec.export.tensorrt import onnx_inputs
from specdec.export.validate import random_packs
from specdec.plugins import trt_plugin
from specdec.runtime.graph_io import GRAPH_INPUTS
from specdec.runtime.packed import pack


def ragged_feeds(
    inputs: Sequence[tuple[str, Sequence[int | str], int]],
    vocab_size: int,
    *,
    num_slots: int = 4,
    max_len: int = 64,
    seed: int = 0,
) -> Iterator[dict[str, np.ndarray]]:
    """Feeds (name -> array) of random ragged steps for a specdec graph with inputs ``inputs`` (``onnx_inputs``).

    Each feed is self-contained (polygraphy does not carry caches between iterations): random
    caches stand for the committed history, and the packs mix prefill, decode, chains, forests
    and an idle slot, as ``specdec.export.validate`` does.
    """
    from onnx import helper

    rng = np.random.default_rng(seed)
    caches = [(name, dims, elem) for name, dims, elem in inputs if name not in {t.name for t in GRAPH_INPUTS}]
    for work in random_packs(vocab_size, num_slots, max_len, seed=seed):
        batch = pack(work)
        feed = {spec.name: getattr(batch, spec.name).astype(spec.dtype) for spec in GRAPH_INPUTS}
        for name, dims, elem in caches:
            shape = (num_slots, int(dims[1]), max_len, int(dims[3]))
            feed[name] = (0.5 * rng.standard_normal(shape)).astype(helper.tensor_dtype_to_np_dtype(elem))
        yield feed


def load_data() -> Iterator[dict[str, np.ndarray]]:
    """Polygraphy ``--data-loader-script`` entry point; registers the plugin in polygraphy's process first.

    Not a generator on purpose: polygraphy calls it before it builds the TensorRT engine and
    iterates it later, so the registration must happen in the call. The model comes from
    ``SPECDEC_POLYGRAPHY_MODEL``; ``SPECDEC_POLYGRAPHY_SLOTS`` and ``SPECDEC_POLYGRAPHY_MAX_LEN``
    size the caches (defaults 4 and 64; they must lie in the engine's profile).
    """
    import onnx

    trt_plugin.register()
    model = os.environ.get("SPECDEC_POLYGRAPHY_MODEL")
    if not model:
        raise RuntimeError("set SPECDEC_POLYGRAPHY_MODEL to the model.onnx being compared (see polygraphy_recipe())")
    graph = onnx.load(model, load_external_data=False).graph
    logits = next(o for o in graph.output if o.name == "logits")
    vocab = int(logits.type.tensor_type.shape.dim[-1].dim_value)
    return ragged_feeds(
        onnx_inputs(model),
        vocab,
        num_slots=int(os.environ.get("SPECDEC_POLYGRAPHY_SLOTS", 4)),
        max_len=int(os.environ.get("SPECDEC_POLYGRAPHY_MAX_LEN", 64)),
    )


def postprocess(network: Any) -> None:
    """Polygraphy ``--trt-network-postprocess-script`` entry point: what ``build_engine`` does to the parsed network."""
    layers = trt_plugin.plugin_layers(network)
    trt_plugin.cast_bool_inputs(network, layers)
    trt_plugin.name_plugin_layers(layers)


if __name__ == "polygraphy_glue":  # imported by polygraphy as a script: register before it parses the graph
    trt_plugin.register()

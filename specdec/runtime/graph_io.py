"""The exported ragged step's tensor names, dtypes and dims: one table beside ``PackedBatch``.

The exporter names the graph's inputs and outputs from it, and the ONNX Runtime and TensorRT
backends feed their graphs through ``graph_feeds``, so a ``PackedBatch`` field and a graph
input cannot drift apart in one backend only. ``cache_mask`` (the padded ``vanilla``
baseline's holes) is deliberately not a graph input: the exported attention keeps the
unpadded layout that EMS-SD and DSBD need, and a step that masks cached positions is refused
here, for both backends, instead of silently attending to the holes.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from specdec.runtime.packed import PackedBatch


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str  # numpy name
    dims: tuple[str, ...]  # symbolic dims; "layer" tensors are repeated per layer


GRAPH_INPUTS = (
    TensorSpec("input_ids", "int64", ("tokens",)),
    TensorSpec("position_ids", "int64", ("tokens",)),
    TensorSpec("cu_seqlens", "int32", ("seqs_plus_1",)),
    TensorSpec("past_lens", "int32", ("seqs",)),
    TensorSpec("slot_ids", "int32", ("seqs",)),
    TensorSpec("tree_mask", "bool", ("tokens", "max_new")),
    TensorSpec("logits_indices", "int32", ("rows",)),
)
CACHE_INPUT = "past_key_values.{layer}.{kind}"  # kind: key | value; [slots, kv_heads, max_len, head_dim]
CACHE_OUTPUT = "present.{layer}.{kind}"
LOGITS = "logits"  # float32 [rows, head]: head = vocab, or K for a restricted draft head (head_token_ids.json)


def cache_layers(input_names: Iterable[str]) -> int:
    """How many layers' caches a graph takes, counted from its input names (one ``past_key_values.L.key`` each)."""
    key = re.compile(CACHE_INPUT.format(layer="LAYER", kind="key").replace(".", r"\.").replace("LAYER", r"\d+"))
    return sum(1 for name in input_names if key.fullmatch(name))


def cache_names(num_layers: int, template: str) -> list[str]:
    """Cache tensor names in graph order: all keys, then all values."""
    return [template.format(layer=i, kind=kind) for kind in ("key", "value") for i in range(num_layers)]


class CacheMaskUnsupportedError(ValueError):
    """A step masks cached positions (``vanilla``'s KV holes), which an exported graph cannot express."""


def graph_feeds(batch: PackedBatch) -> dict[str, np.ndarray]:
    """The packed batch as the graph's inputs, by name, in ``GRAPH_INPUTS`` order (caches not included).

    Raises ``CacheMaskUnsupportedError`` for a step with masked cache positions: the graph has
    no ``cache_mask`` input, so running it would attend to the holes of the padded baseline.
    """
    if batch.cache_mask is not None and not bool(batch.cache_mask.all()):
        raise CacheMaskUnsupportedError(
            "this step masks cached positions (cache_mask: the padded 'vanilla' baseline's KV holes), and an "
            "exported graph has no cache_mask input: run 'vanilla' on the torch backend, or use 'ems'"
        )
    return {spec.name: getattr(batch, spec.name) for spec in GRAPH_INPUTS}


def expected_io_names(num_layers: int) -> tuple[list[str], list[str]]:
    """The names this table prescribes for a model with ``num_layers`` layers."""
    return (
        [t.name for t in GRAPH_INPUTS] + cache_names(num_layers, CACHE_INPUT),
        [LOGITS, *cache_names(num_layers, CACHE_OUTPUT)],
    )

"""``torch.ops.specdec.ragged_tree_attention``: the custom op a model calls so it exports as one node.

Eager it runs the torch reference on cloned caches (a ``custom_op`` may not return views of
its inputs, and ``mutates_args=()`` keeps it functional, which ``torch.export`` needs); the
fake implementation gives shapes only. ``onnx_translation`` maps it to the bare
``specdec::RaggedTreeAttention`` node for ``torch.onnx.export(dynamo=True)``: an onnxscript
*function* would be inlined by the exporter, a bare node with a registered schema survives.
Call ``specdec.plugins.onnx_op.attach_functions`` on the exported model to add the body.
"""

from __future__ import annotations

from typing import Any

import torch

from specdec.plugins import onnx_op
from specdec.plugins.reference import ragged_tree_attention as _reference


@torch.library.custom_op("specdec::ragged_tree_attention", mutates_args=())
def ragged_tree_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens: torch.Tensor,
    past_lens: torch.Tensor,
    slot_ids: torch.Tensor,
    tree_mask: torch.Tensor,
    scale: float,
    num_heads: int,
    num_kv_heads: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out [T, Hq, D], k_cache_out, v_cache_out): the reference semantics, caches returned updated.

    ``num_heads``/``num_kv_heads`` are not needed to compute (shapes carry them); they are
    arguments so the exported node gets them as attributes for plugins.
    """
    k_out, v_out = k_cache.clone(), v_cache.clone()
    out = _reference(
        q,
        k,
        v,
        k_out,
        v_out,
        cu_seqlens.tolist(),
        past_lens.tolist(),
        slot_ids.tolist(),
        tree_mask,
        scale,
    )
    return out, k_out, v_out


@ragged_tree_attention.register_fake
def _fake(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens: torch.Tensor,
    past_lens: torch.Tensor,
    slot_ids: torch.Tensor,
    tree_mask: torch.Tensor,
    scale: float,
    num_heads: int,
    num_kv_heads: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return torch.empty_like(q), torch.empty_like(k_cache), torch.empty_like(v_cache)


def onnx_translation(
    q: Any,
    k: Any,
    v: Any,
    k_cache: Any,
    v_cache: Any,
    cu_seqlens: Any,
    past_lens: Any,
    slot_ids: Any,
    tree_mask: Any,
    scale: float,
    num_heads: int,
    num_kv_heads: int,
) -> tuple[Any, Any, Any]:
    """Custom translation emitting the bare ``specdec::RaggedTreeAttention`` node (not inlined).

    Use as ``custom_translation_table={torch.ops.specdec.ragged_tree_attention.default:
    onnx_translation}``; the arguments are onnxscript values (tensors) and Python scalars.
    """
    import onnxscript  # export-only dependency

    onnx_op.register_schema()  # onnxscript reads the output count from the schema
    specdec = onnxscript.values.Opset(onnx_op.DOMAIN, onnx_op.OP_VERSION)
    return specdec.RaggedTreeAttention(
        q,
        k,
        v,
        k_cache,
        v_cache,
        cu_seqlens,
        past_lens,
        slot_ids,
        tree_mask,
        scale=float(scale),
        num_heads=int(num_heads),
        num_kv_heads=int(num_kv_heads),
        plugin_namespace=onnx_op.PLUGIN_NAMESPACE,
        plugin_version=onnx_op.PLUGIN_VERSION,
    )


TRANSLATION_TABLE = {torch.ops.specdec.ragged_tree_attention.default: onnx_translation}
"""Ready-made ``custom_translation_table`` for ``torch.onnx.export(dynamo=True)``."""

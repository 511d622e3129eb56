"""Export the ragged step of a LLaMA-family model to ONNX with ``specdec::RaggedTreeAttention`` nodes.

The graph is the torch backend's own ``forward`` (one place for the LLaMA math) with the
attention bound to the custom op, exported with ``torch.onnx.export(dynamo=True)``. The
attention nodes stay custom nodes carrying ``plugin_namespace="specdec"`` and
``plugin_version="1"`` (a TensorRT parser binds them to the plugin); a standard-op
function body is attached after export so any ONNX Runtime runs the file as it is.

The graph's tensor names, dtypes and dims are ``specdec.runtime.graph_io``'s table, which the
exporter, both graph backends and the tests read.
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from specdec.models.loading import LoadedModel
from specdec.runtime.backends.torch_backend import TorchBackend
from specdec.runtime.graph_io import CACHE_INPUT, CACHE_OUTPUT, GRAPH_INPUTS, LOGITS, cache_names


class RaggedStep(torch.nn.Module):
    """The exportable ragged step: packed inputs + caches in, logits + updated caches out."""

    def __init__(self, backend: TorchBackend) -> None:
        super().__init__()
        self.backend = backend

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        cu_seqlens: torch.Tensor,
        past_lens: torch.Tensor,
        slot_ids: torch.Tensor,
        tree_mask: torch.Tensor,
        logits_indices: torch.Tensor,
        *caches: torch.Tensor,
    ) -> tuple[torch.Tensor, ...]:
        from specdec.plugins import torch_op  # registers torch.ops.specdec.ragged_tree_attention

        b = self.backend
        keys, values = caches[: b.num_layers], caches[b.num_layers :]
        new_keys: list[torch.Tensor] = []
        new_values: list[torch.Tensor] = []

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            out, k_cache, v_cache = torch_op.ragged_tree_attention(
                q,
                k,
                v,
                keys[layer],
                values[layer],
                cu_seqlens,
                past_lens,
                slot_ids,
                tree_mask,
                b.scale,
                b.num_heads,
                b.num_kv_heads,
            )
            new_keys.append(k_cache)
            new_values.append(v_cache)
            return out

        logits = b.forward(input_ids, position_ids, logits_indices, attend)
        return (logits, *new_keys, *new_values)


def _example_inputs(backend: TorchBackend) -> tuple[torch.Tensor, ...]:
    """A small ragged batch (a forest and a chain) that exercises every input."""
    from specdec.runtime.packed import ROOT, SeqWork, pack

    batch = pack([SeqWork(1, 3, [5, 6, 7], parents=[ROOT, 0, ROOT]), SeqWork(0, 2, [8, 9])])
    slots, max_len = 3, 16
    shape = (slots, backend.num_kv_heads, max_len, backend.head_dim)
    caches = [torch.zeros(shape, dtype=backend.dtype) for _ in range(2 * backend.num_layers)]
    packed = (
        batch.input_ids,
        batch.position_ids,
        batch.cu_seqlens,
        batch.past_lens,
        batch.slot_ids,
        batch.tree_mask,
        batch.logits_indices,
    )
    return (*(torch.from_numpy(a) for a in packed), *caches)


def _dynamic_shapes(num_caches: int) -> tuple:
    dim = torch.export.Dim
    tokens, seqs, new, rows = dim("tokens", min=1), dim("seqs", min=1), dim("max_new", min=1), dim("rows", min=1)
    slots, max_len = dim("slots", min=1), dim("max_len", min=2)
    cache = {0: slots, 2: max_len}
    return (
        {0: tokens},
        {0: tokens},
        {0: seqs + 1},
        {0: seqs},
        {0: seqs},
        {0: tokens, 1: new},
        {0: rows},
        tuple([cache] * num_caches),
    )  # the *caches varargs are one nested entry


def export_onnx(
    model: LoadedModel, path: str | os.PathLike, dtype: torch.dtype = torch.float32, external_data: bool = True
) -> Path:
    """Write ``path`` (+ ``path.data`` for the weights): the model's ragged step as ONNX.

    The graph keeps one ``specdec::RaggedTreeAttention`` node per layer with its function
    body attached, and passes ``onnx.checker``. The weights are written in ``dtype`` as ONNX
    external data (``external_data=False`` inlines them, which only fits graphs under 2 GB), so a
    7B graph is written without a second in-memory copy of its weights.
    """
    import onnx

    from specdec.plugins import onnx_op
    from specdec.plugins.torch_op import TRANSLATION_TABLE

    out = Path(path)
    backend = TorchBackend(model, dtype=dtype)
    num_caches = 2 * backend.num_layers
    input_names = [t.name for t in GRAPH_INPUTS] + cache_names(backend.num_layers, CACHE_INPUT)
    output_names = [LOGITS, *cache_names(backend.num_layers, CACHE_OUTPUT)]
    onnx_op.register_schema()
    # the exporter logs, for every export, each torchvision op it cannot register (torchvision is not a
    # dependency): noise on every console that exports, so that logger is quiet while it runs
    registration = logging.getLogger("torch.onnx._internal.exporter._registration")
    level = registration.level
    registration.setLevel(logging.ERROR)
    try:
        with torch.no_grad(), warnings.catch_warnings():
            # the exporter warns about every dynamic axis name it merges and about deprecated pytree APIs
            warnings.simplefilter("ignore", UserWarning)
            warnings.simplefilter("ignore", FutureWarning)
            program = torch.onnx.export(
                RaggedStep(backend).eval(),
                _example_inputs(backend),
                dynamo=True,
                custom_translation_table=TRANSLATION_TABLE,  # type: ignore[arg-type]  # torch types it by callables
                input_names=input_names,
                output_names=output_names,
                dynamic_shapes=_dynamic_shapes(num_caches),
                optimize=True,
                verbose=False,
            )
    finally:
        registration.setLevel(level)
    if program is None:  # torch returns None only when asked to write the file itself, which this never does
        raise RuntimeError("torch.onnx.export returned no program")
    out.parent.mkdir(parents=True, exist_ok=True)
    data = out.with_name(out.name + ".data")
    if data.exists():
        data.unlink()
    program.model.doc_string = f"specdec ragged step of {model.name} ({dtype})"
    if external_data:
        _save_external(program.model, out, data)
    else:  # one self-contained file: only below protobuf's 2 GB limit
        onnx.save_model(onnx_op.attach_functions(program.model_proto), str(out))
    del program
    onnx.checker.check_model(str(out), full_check=False)
    count_attention_nodes(out, expect=backend.num_layers)
    return out


def _save_external(model: Any, out: Path, data: Path) -> None:
    """Write ``model`` (an ``onnx_ir.Model``) as ``out`` + ``data``, weights streamed to ``data``.

    Why not ``onnx.save_model`` of the proto: serializing a model to one ``ModelProto`` copies every
    weight into it (a second 13 GB for a 7B fp16 model) and protobuf refuses a message over 2 GB.
    ``onnx_ir`` writes the tensors one by one from the exporter's own buffers; the function body is
    then attached to the small graph proto, which is read and rewritten without its weights.
    """
    import onnx
    import onnx_ir

    from specdec.plugins import onnx_op

    onnx_ir.save(model, out, external_data=data.name, size_threshold_bytes=1024)
    proto = onnx.load(str(out), load_external_data=False)
    onnx.save_model(onnx_op.attach_functions(proto), str(out))


def count_attention_nodes(path: str | os.PathLike, expect: int | None = None) -> int:
    """Number of RaggedTreeAttention nodes (with the plugin attributes) in the main graph."""
    import onnx

    from specdec.plugins import onnx_op

    graph = onnx.load(str(path), load_external_data=False).graph
    nodes = [n for n in graph.node if n.op_type == onnx_op.OP_TYPE and n.domain == onnx_op.DOMAIN]
    ok = [
        n
        for n in nodes
        if {a.name: a.s.decode() for a in n.attribute if a.type == onnx.AttributeProto.STRING}.get("plugin_namespace")
        == onnx_op.PLUGIN_NAMESPACE
    ]
    if expect is not None and len(ok) != expect:
        raise RuntimeError(
            f"{path}: expected {expect} RaggedTreeAttention nodes with plugin_namespace="
            f"'{onnx_op.PLUGIN_NAMESPACE}', found {len(ok)} (was the op inlined?)"
        )
    return len(ok)


def graph_io_names(path: str | os.PathLike) -> tuple[list[str], list[str]]:
    """(input names, output names) of an exported graph, for consistency checks."""
    import onnx

    graph = onnx.load(str(path), load_external_data=False).graph
    return [i.name for i in graph.input], [o.name for o in graph.output]


def torch_dtype(name: str) -> torch.dtype:
    table = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16}
    if name not in table:
        raise ValueError(f"unsupported dtype {name!r} for ONNX export (float32 or float16)")
    return table[name]


__all__: Sequence[str] = ("GRAPH_INPUTS", "RaggedStep", "count_attention_nodes", "export_onnx")

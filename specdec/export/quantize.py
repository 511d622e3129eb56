"""Weight-only block quantization of an exported graph (``--quantize int4|int8``; ``w8a8``: ``specdec.export.w8a8``).

After ``export_onnx`` wrote the fp32 graph, every linear layer's ``Gemm`` (the exporter's form of
``F.linear``: weight ``[N, K]`` initializer, ``transB=1``; q/k/v and gate/up are each one fused
weight) becomes a ``com.microsoft.MatMulNBits`` node: blocks of 32 weights along K, ``bits`` 4 or 8,
one fp32 scale per block and, where needed, a uint8 zero point per block. Why that op: it is the
form ONNX Runtime's CPU kernels (MLAS ``SQNBitGemm``) run from the packed blocks, so a decode step
reads 4 or 8 bits per weight instead of 32. The LM
head is quantized too, and so is the embedding table: its ``GatherND`` becomes a
``com.microsoft.GatherBlockQuantized`` over the same blocks (the source's own where they have
no Q4_1 offsets, which that op cannot hold), so a tied table is not kept twice in fp32 beside its
quantized head. Why: the fp32 table of a 49k-token vocabulary is 113 MB, more than every 4-bit
projection of SmolLM2-135M together (peak RSS in ``benchmarks/results/edge_cpu.md``); the op
computes ``scale * (code - zero_point)`` in fp32, the same arithmetic as ``BlockQuant.dequantize``,
so a Q8_0 table gathers exactly the values the fp32 one held.

Formats, and why:

* generic source (a Hugging Face directory, tiny-random): round to nearest. int4 is asymmetric
  (the block's range, widened to hold 0, in 16 steps; an integer uint8 zero point), which gives a
  skewed block its full 16 levels. int8 is symmetric (``scale = max|w| / 127``, the op's default zero
  point 128, no zero-point tensor): at 8 bits an asymmetric range gains under one bit on skewed
  blocks, and it is Q8_0's own format, so RTN int8 and a GGUF Q8_0 tensor are one layout.
* block-quantized GGUF source (Q4_0 / Q4_1 / Q8_0): the file's own blocks, converted bit for bit,
  no second rounding: Q4_0 ``w = d*(q-8)`` is 4-bit with the default zero point 8; Q8_0 ``w = d*q`` is
  8-bit with ``q+128`` and the default 128; Q4_1 ``w = d*q + m`` is 4-bit as ``d*(q - z) + m'`` with
  a per-block integer zero point z and the block offsets ``m' = m + z*d`` applied by a small correction
  ``(sum of the block's inputs) @ m'^T`` (a ``ReduceSum`` over each 32-input block and an fp32 ``Gemm``
  with 1/32 of the weight's columns). z makes ``m'`` as small as it can be exactly in fp32
  (``blocks.centred_offsets``): the kernel rounds its inputs to int8, the correction does not, so an
  uncentred block (z = 0, every weight carrying ``-m`` ~ 7.5 d) let the rounding errors add up; centred,
  next-token agreement with the fp32 export went from 90.6 / 95.6 % to 97.1 / 98.3 % (chat /
  extractive; llama.cpp's own Q4_1: 96.9 / 98.8 %; ``benchmarks/results/edge_cpu.md``).
  Why not the op's float zero point ``-m/d``, which would hold Q4_1 in the op alone: ONNX Runtime's
  CPU kernel does not pre-pack a weight with float zero points and dequantizes the whole matrix to
  fp32 on every call instead (``ComputeBUnpacked``; 8-bit it refuses outright), slower than the fp32
  graph (measured in ``benchmarks/results/quantize.md``). A tensor keeps its source's bits when those
  are more than asked (the Q8_0 embedding under ``int4`` stays 8-bit); fewer bits are held exactly in
  8-bit codes. Rows follow the loaded weights' order: llama.cpp permutes attn_q/attn_k rows for its
  RoPE layout and ``specdec.models.gguf_blocks.read_gguf_tensors`` undoes it as transformers does; each
  converted tensor is checked bit-exact against the loaded fp32 weights before it is used.

``accuracy_level`` 4 (int8 activation blocks, ``--quantize-activations int8``) is what the graph
ships with by default: MLAS's int8 kernels are the fast ones at every row count (one decode row, a
verification chain, a prefill chunk), and they are row-independent: a row's product is bitwise the
same whether it is multiplied alone or beside other rows. So are the prepacked fp32 ``Gemm`` (the
Q4_1 offsets below: MLAS takes its one-row path only for an unpacked B) and the per-row norms, and
the ONNX Runtime lowering keeps its attention off MLAS's one-row path (``ort_fuse``), so a row's
logits do not depend on the step it is in and greedy ``ems`` equals greedy ``ar`` on the same graph
bit for bit (``tests/test_batch_invariance.py``). What the int8 rounding of activations costs is
quality against the fp32 export: held-out perplexity 0.1 % (int8 RTN) to 0.4 % (int8 from the GGUF)
higher (``benchmarks/results/quantize.md``), and greedy answers that part from the fp32 export's
after a near-tie, as llama.cpp's own (it rounds activations to 8 bits too) do
(``benchmarks/results/edge_cpu.md``). Level 0 (fp32 activations, ``--quantize-activations fp32``)
computes the stored weights in fp32, so its answers are the fp32 export's; but MLAS multiplies one
row with a GEMV and several by unpacking the weights to an fp32 GEMM, whose sums round differently
(~1e-5 in the logits, ``test_fp32_activations_are_not_batch_invariant``): ems equals ar there only
as it does on the fp32 export, up to a near-tie, and steps of several rows pay the unpacking. MLAS
has no fp32-activation kernel for 8-bit weights (5x slower than fp32), so at level 0 a tensor that
would be 8-bit under ``int4`` (the GGUF's Q8_0 embedding as the tied head) stays an fp32 Gemm
(``fp32_at_level``). The export is validated at level 0, where the graph computes its stored
weights exactly, so the check tests the graph and not the rounding (``quantize_and_validate``).

The rewrite matches every graph weight row for row against the source tensors (exact fp32
equality), so it needs no knowledge of how the backend fuses projections, and it records on each
node which source rows it holds (``metadata_props``: ``specdec.quantize.rows``), which
``graph_weights`` reads back to de-quantize a graph for the tests.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from specdec.export.blocks import (
    BLOCK_SIZE,
    GGUF_BITS,
    BlockQuant,
    QuantizeError,
    concat_rows,
    from_gguf_blocks,
    pack_codes,
    pack_zero_points,
    quantize_rtn,
    unpack_codes,
    unpack_zero_points,
)

MODES = {"int4": 4, "int8": 8, "w8a8": 8}
#: modes whose decoder-layer linears are integer GEMMs (``specdec.export.w8a8``), not MatMulNBits
INTEGER_MODES = ("w8a8",)
#: MatMulNBits ``accuracy_level``: fp32 activations (the stored weights computed exactly: the level a graph is
#: checked at) and int8 activation blocks (fast and row-independent: what a graph ships with by default)
FP32_ACTIVATIONS, INT8_ACTIVATIONS = 0, 4
CHECK_LEVEL = FP32_ACTIVATIONS
ACCURACY_LEVEL = INT8_ACTIVATIONS
#: ``--quantize-activations`` choices
ACTIVATIONS = {"fp32": FP32_ACTIVATIONS, "int8": INT8_ACTIVATIONS}
MS_DOMAIN = "com.microsoft"
#: the projections quantized in every decoder layer (Hugging Face names), besides the LM head
LINEAR_PROJECTIONS = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)
EMBEDDING = "model.embed_tokens.weight"
ROWS_KEY, FORMAT_KEY, OFFSETS_KEY = "specdec.quantize.rows", "specdec.quantize.format", "specdec.quantize.offsets"
# -- the source tensors ------------------------------------------------------------------------------


def linear_names(model: Any) -> list[str]:
    """The state-dict names of every linear weight the graph multiplies by: 7 per layer and the LM head."""
    sd = model.state_dict
    names = [
        f"model.layers.{i}.{p}.weight" for i in range(int(model.config.num_hidden_layers)) for p in LINEAR_PROJECTIONS
    ]
    names.append("lm_head.weight" if "lm_head.weight" in sd and not model.config.tie_word_embeddings else EMBEDDING)
    return names


def source_blocks(
    model: Any, bits: int, use_gguf: bool = True, names: Sequence[str] | None = None
) -> dict[str, BlockQuant]:
    """Each linear weight of ``model`` (or the tensors ``names``) in blocks: the GGUF file's own where it has
    them, RTN otherwise.

    A GGUF tensor is used only after its de-quantized values equal the loaded fp32 weights bit for
    bit (so a row order that does not follow the loaded one, e.g. a missed RoPE un-permutation,
    is refused here rather than exported).
    """
    from specdec.models.gguf_blocks import GGUF_PATH, read_gguf_tensors

    path = model.extra.get(GGUF_PATH) if use_gguf else None
    raw = read_gguf_tensors(path, model.config) if path else {}
    out: dict[str, BlockQuant] = {}
    for name in linear_names(model) if names is None else names:
        weight = model.state_dict[name].detach().float().numpy()
        tensor = raw.get(name)
        if tensor is None or tensor.ggml_type not in GGUF_BITS or tensor.shape != weight.shape:
            out[name] = quantize_rtn(weight, bits)  # e.g. F16 tensors, or a restricted head cut from the file's
            continue
        block = from_gguf_blocks(tensor.ggml_type, tensor.data, tensor.shape[1])
        if not np.array_equal(block.dequantize(), weight):
            raise QuantizeError(
                f"{path}: the {tensor.ggml_type} blocks of {name} do not reproduce the loaded "
                "weights (rows in another order than transformers' un-permuted ones?)"
            )
        out[name] = block.widened(max(block.bits, bits))
    return out


def fp32_at_level(blocks: Mapping[str, BlockQuant], bits: int, accuracy_level: int) -> set[str]:
    """The tensors left as fp32 Gemms: at level 0, those wider than asked (8-bit under ``int4``), which MLAS
    runs 5x slower than fp32 without int8 activations (module docstring)."""
    if accuracy_level != FP32_ACTIVATIONS:
        return set()
    return {name for name, block in blocks.items() if block.bits > bits}


def quantize_export(
    model: Any,
    graph: str | os.PathLike,
    mode: str,
    *,
    use_gguf: bool = True,
    accuracy_level: int = ACCURACY_LEVEL,
    calibration: Sequence[Sequence[int]] | None = None,
) -> tuple[Any, dict]:
    """Quantize the exported ``graph`` of ``model`` in place; (the de-quantized model, the manifest's summary).

    ``calibration``: token sequences whose activations smooth a ``w8a8`` graph (default:
    ``w8a8.calibration_ids`` with the model's own tokenizer; a draft has none, so the export passes the target's).

    ``use_gguf=False`` rounds the fp32 weights even when the model came from a block-quantized GGUF
    (what a second rounding costs: ``python -m benchmarks.quantize_quality``). ``accuracy_level`` is the
    level the graph is written at; it decides which tensors stay fp32 (``fp32_at_level``).
    The embedding table is gathered from blocks too (``embedding_block``), whatever the level: a
    gather de-quantizes rows, it multiplies nothing.
    """
    if mode not in MODES:
        raise QuantizeError(f"unknown quantization {mode!r}: choose one of {', '.join(MODES)}")
    bits = MODES[mode]
    names = linear_names(model)
    maxima: dict[str, np.ndarray] = {}
    if mode in INTEGER_MODES:  # the decoder layers' linears; the head stays MatMulNBits (``specdec.export.w8a8``)
        from specdec.export import w8a8

        sequences = calibration or w8a8.calibration_ids(model.tokenizer, model.vocab_size)
        maxima = w8a8.activation_maxima(model, sequences, names[:-1])
        names = [name for name in names if name not in maxima]
    blocks = source_blocks(model, bits, use_gguf=use_gguf, names=names)
    table = embedding_block(model, bits, blocks, use_gguf)
    kept = fp32_at_level(blocks, bits, accuracy_level)
    blocks = {name: block for name, block in blocks.items() if name not in kept}
    reference = {name: model.state_dict[name].detach().float().numpy() for name in [*blocks, *maxima]}
    embedding = None if table is None else (table, model.state_dict[EMBEDDING].detach().float().numpy())
    effective: dict[str, np.ndarray] = {}
    summary = quantize_graph(
        graph,
        blocks,
        reference,
        accuracy_level,
        keep={name: model.state_dict[name].detach().float().numpy() for name in kept},
        embedding=embedding,
        integer=maxima,
        effective=effective,
    )
    return (
        dequantized_model(model, blocks, table, effective),
        {"mode": mode, "bits": bits, "fp32_tensors": sorted(kept), **summary},
    )


def embedding_block(model: Any, bits: int, blocks: Mapping[str, BlockQuant], use_gguf: bool) -> BlockQuant | None:
    """The embedding table in blocks for ``GatherBlockQuantized``, or None where it stays fp32.

    A tied table is the LM head's own blocks; an untied one comes from the source like a linear
    weight. None: Q4_1 blocks (their offsets have no place in the op) or an odd width at 4 bits.
    """
    block = blocks.get(EMBEDDING) or source_blocks(model, bits, use_gguf, names=[EMBEDDING])[EMBEDDING]
    if block.offsets is not None or (block.bits == 4 and block.columns % 2):
        return None
    return block


def set_accuracy_level(graph: str | os.PathLike, level: int) -> None:
    """Set every MatMulNBits node's ``accuracy_level`` (the weights in the external data stay untouched)."""
    import onnx

    proto = onnx.load(str(graph), load_external_data=False)
    _set_level(proto, level)
    onnx.save_model(proto, str(graph))


def _set_level(proto: Any, level: int) -> None:
    from onnx import helper

    for node in proto.graph.node:
        if node.op_type == "MatMulNBits" and node.domain == MS_DOMAIN:
            kept = [a for a in node.attribute if a.name != "accuracy_level"]
            del node.attribute[:]
            node.attribute.extend([*kept, helper.make_attribute("accuracy_level", level)])


@contextmanager
def _checked_form(graph: str | os.PathLike, mode: str, accuracy_level: int) -> Iterator[Path]:
    """The graph as the tight check runs it: fp32 activations, w8a8 chains as fp32 Gemms by their weights.

    A block-quantized graph is switched in place (and back); a w8a8 one is checked as a temporary copy,
    since its chains have no fp32-activation level to switch to.
    """
    from specdec.export import w8a8

    if mode not in INTEGER_MODES:
        set_accuracy_level(graph, CHECK_LEVEL)
        yield Path(graph)
        set_accuracy_level(graph, accuracy_level)
        return
    with w8a8.fp32_product_copy(graph, lambda proto: _set_level(proto, CHECK_LEVEL)) as checked:
        yield checked


def quantize_and_validate(
    model: Any,
    graph: str | os.PathLike,
    mode: str,
    tolerance: float,
    accuracy_level: int = ACCURACY_LEVEL,
    use_gguf: bool = True,
    calibration: Sequence[Sequence[int]] | None = None,
) -> dict:
    """Quantize ``graph``, check it tightly, switch it to ``accuracy_level``; the manifest's ``quantize`` entry.

    The tight check runs the graph at accuracy level 0 (fp32 activations, the weights exactly as
    stored) against the torch backend over the de-quantized weights, so it tests the graph (packing,
    nibble order, row order, Q4_1 offsets; a w8a8 chain's codes, scales and smoothing: ``_checked_form``), not
    the rounding; it must stay below ``tolerance``.
    The shipped level's error against that reference and against the fp32 source are recorded, not
    asserted: they are the rounding of activations and weights (``benchmarks/results/quantize.md``).
    """
    from specdec.export.validate import max_logit_error
    from specdec.runtime.backends.onnxruntime import OrtBackend
    from specdec.runtime.backends.torch_backend import TorchBackend

    reference_model, summary = quantize_export(
        model, graph, mode, use_gguf=use_gguf, accuracy_level=accuracy_level, calibration=calibration
    )
    reference = TorchBackend(reference_model)
    with _checked_form(graph, mode, accuracy_level) as checked:
        error = max_logit_error(reference, OrtBackend(checked))
    if error > tolerance:
        raise QuantizeError(
            f"{graph}: the quantized graph differs from the torch reference over its de-quantized "
            f"weights by {error:.3g} (tolerance {tolerance}): not writing a broken export"
        )
    shipped = OrtBackend(graph)
    return {
        **summary,
        "accuracy_level": accuracy_level,
        "validation_max_abs_logit_error_fp32_activations": error,
        "max_abs_logit_error_vs_dequantized": max_logit_error(reference, shipped),
        "max_abs_logit_error_vs_fp32": max_logit_error(TorchBackend(model), OrtBackend(graph)),
    }


def dequantized_model(
    model: Any,
    blocks: Mapping[str, BlockQuant],
    embedding: BlockQuant | None = None,
    effective: Mapping[str, np.ndarray] | None = None,
) -> Any:
    """A copy of ``model`` whose linear weights (and the ``embedding`` table, when the graph gathers it from
    blocks) are the de-quantized blocks, and the ``effective`` weights of w8a8 chains: the validation reference.

    A tied head becomes an untied ``lm_head``, since the head may be kept fp32 while the table is not.
    """
    import copy

    import torch

    from specdec.models.loading import LoadedModel

    state = dict(model.state_dict)
    config = model.config
    for name, block in blocks.items():
        target = name
        if name == EMBEDDING:
            target = "lm_head.weight"
            config = copy.deepcopy(config)
            config.tie_word_embeddings = False
        state[target] = torch.from_numpy(block.dequantize().copy())
    for name, weight in (effective or {}).items():
        state[name] = torch.from_numpy(np.ascontiguousarray(weight, np.float32))
    if embedding is not None:
        if config.tie_word_embeddings:
            config = copy.deepcopy(config)
            config.tie_word_embeddings = False
            state.setdefault("lm_head.weight", state[EMBEDDING])
        state[EMBEDDING] = torch.from_numpy(embedding.dequantize().copy())
    return LoadedModel(model.name, config, state, model.tokenizer, model.source, dict(model.extra))


# -- the graph rewrite -------------------------------------------------------------------------------


def _digest(row: np.ndarray) -> bytes:
    return hashlib.blake2b(np.ascontiguousarray(row).tobytes(), digest_size=16).digest()


class _RowIndex:
    """Finds each graph weight row among the source tensors' rows (fp32 bytes equal)."""

    def __init__(self, reference: Mapping[str, np.ndarray]) -> None:
        self.reference = reference
        self.rows: dict[str, list[bytes]] = {name: [_digest(r) for r in w] for name, w in reference.items()}
        self.where: dict[bytes, list[tuple[str, int]]] = {}
        for name, digests in self.rows.items():
            for i, d in enumerate(digests):
                self.where.setdefault(d, []).append((name, i))

    def runs(self, weight: np.ndarray) -> list[tuple[str, int, int]] | None:
        """``weight`` as runs ``(source, start, stop)`` of consecutive source rows, or None if a row is unknown."""
        digests = [_digest(r) for r in weight]
        runs: list[tuple[str, int, int]] = []
        i = 0
        while i < len(digests):
            best: tuple[str, int, int] | None = None
            for name, start in self.where.get(digests[i], ()):
                source = self.rows[name]
                n = 0
                while i + n < len(digests) and start + n < len(source) and source[start + n] == digests[i + n]:
                    n += 1
                if best is None or n > best[2] - best[1]:
                    best = (name, start, start + n)
            if best is None:
                return None
            runs.append(best)
            i += best[2] - best[1]
        stacked = np.concatenate([self.reference[n][a:b] for n, a, b in runs])
        return runs if np.array_equal(stacked, weight) else None


def _linear_weight(node: Any, inits: Mapping[str, Any]) -> tuple[str, bool] | None:
    """(initializer name, whether it is stored [N, K]) of a Gemm/MatMul by a constant 2-D weight, else None."""
    from onnx import helper

    if node.op_type not in ("Gemm", "MatMul") or len(node.input) < 2 or node.input[1] not in inits:
        return None
    if len(inits[node.input[1]].dims) != 2:
        return None
    if node.op_type == "MatMul":
        return node.input[1], False
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    if attrs.get("transA", 0) or attrs.get("alpha", 1.0) != 1.0 or attrs.get("beta", 1.0) != 1.0:
        return None
    return node.input[1], bool(attrs.get("transB", 0))


def quantize_graph(
    path: str | os.PathLike,
    blocks: Mapping[str, BlockQuant],
    reference: Mapping[str, np.ndarray],
    accuracy_level: int = ACCURACY_LEVEL,
    keep: Mapping[str, np.ndarray] | None = None,
    embedding: tuple[BlockQuant, np.ndarray] | None = None,
    integer: Mapping[str, np.ndarray] | None = None,
    effective: dict[str, np.ndarray] | None = None,
) -> dict:
    """Rewrite the graph at ``path`` in place: every linear layer becomes MatMulNBits; returns a summary.

    ``blocks`` are the source tensors in block form and ``reference`` their fp32 values as the
    exported graph holds them; ``keep`` the fp32 values of linear weights deliberately left as they
    are. A Gemm/MatMul by a constant weight that matches neither is an error (no linear layer is left
    in fp32 unnoticed), and so is a source tensor no node uses. ``embedding``: the table's blocks and
    fp32 values; the gather that reads a table equal to them becomes GatherBlockQuantized. ``integer``: the
    tensors that become w8a8 chains instead, with their inputs' calibrated maxima; the fp32 weights each
    chain computes with are written into ``effective`` (by source tensor).
    """
    import onnx
    from onnx import helper, numpy_helper

    out = Path(path)
    proto = onnx.load(str(out))
    graph = proto.graph
    inits = {i.name: i for i in graph.initializer}
    index = _RowIndex({**reference, **(keep or {})})
    new_nodes, new_inits, replaced, used = [], [], set(), Counter()
    formats: Counter = Counter()
    gathered: str | None = None
    for node in graph.node:
        if embedding is not None and gathered is None and _gathers(node, inits, embedding[1]):
            nodes, tensors = _gather_block_quantized(node, embedding[0])
            new_nodes.extend(nodes)
            new_inits.extend(tensors)
            replaced.add(node.input[0])
            gathered = embedding[0].source
            continue
        found = _linear_weight(node, inits)
        if found is None:
            new_nodes.append(node)
            continue
        name, rows_first = found
        stored = numpy_helper.to_array(inits[name])
        weight = stored if rows_first else stored.T
        runs = index.runs(np.ascontiguousarray(weight, dtype=np.float32))
        if runs is None:
            raise QuantizeError(
                f"{out}: {node.op_type} {node.name!r} multiplies by {name}, which matches no "
                "linear weight of the model: not leaving it in fp32 unnoticed"
            )
        if all(n in (keep or {}) for n, _, _ in runs):
            new_nodes.append(node)  # left in fp32 on purpose (``fp32_at_level``)
            continue
        if integer and all(n in integer for n, _, _ in runs):
            from specdec.export import w8a8

            nodes, tensors = w8a8.chain_for(
                node,
                weight,
                runs,
                integer,
                {ROWS_KEY: json.dumps(runs), FORMAT_KEY: "w8a8"},
                reference,
                effective,
                first=not formats["w8a8"],
            )
            new_nodes.extend(nodes)
            new_inits.extend(tensors)
            used.update(n for n, _, _ in runs)
            formats["w8a8"] += 1
            replaced.add(name)
            continue
        block = concat_rows([blocks[n].take(a, b) for n, a, b in runs])
        used.update(n for n, _, _ in runs)
        formats[block.source] += 1
        nodes, tensors = _matmul_nbits(node, block, runs, accuracy_level)
        new_nodes.extend(nodes)
        new_inits.extend(tensors)
        replaced.add(name)
    unused = [n for n in [*blocks, *(integer or {})] if n not in used]
    if unused:
        raise QuantizeError(f"{out}: no linear node of the graph uses {unused}")
    still_used = {i for n in new_nodes for i in n.input}
    kept = [i for i in graph.initializer if i.name not in replaced or i.name in still_used]
    del graph.node[:]
    graph.node.extend(new_nodes)
    del graph.initializer[:]
    graph.initializer.extend([*kept, *new_inits])
    if not any(o.domain == MS_DOMAIN for o in proto.opset_import):
        proto.opset_import.append(helper.make_opsetid(MS_DOMAIN, 1))
    data = out.with_name(out.name + ".data")
    if data.exists():
        data.unlink()
    onnx.save_model(
        proto,
        str(out),
        save_as_external_data=True,
        all_tensors_to_one_file=True,
        location=data.name,
        size_threshold=1024,
    )
    if embedding is not None and gathered is None:
        raise QuantizeError(f"{out}: no gather reads the embedding table")
    table = "fp32" if gathered is None else f"{embedding[0].bits}-bit {gathered}"
    return {
        "linear_layers": sum(formats.values()),
        "formats": dict(sorted(formats.items())),
        "embedding": table,
        "block_size": BLOCK_SIZE,
        "accuracy_level": accuracy_level,
        "graph_bytes": out.stat().st_size + (data.stat().st_size if data.exists() else 0),
    }


def _matmul_nbits(
    node: Any, block: BlockQuant, runs: list[tuple[str, int, int]], accuracy_level: int
) -> tuple[list[Any], list[Any]]:
    """The MatMulNBits node (and the Q4_1 offset correction) replacing ``node``, with their initializers."""
    from onnx import helper, numpy_helper

    base = node.name or node.output[0]
    n, k_blocks = block.scales.shape
    tensors = [
        numpy_helper.from_array(pack_codes(block.codes, block.bits), f"{base}.qweight"),
        numpy_helper.from_array(block.scales.astype(np.float32), f"{base}.scales"),
    ]
    inputs = [node.input[0], tensors[0].name, tensors[1].name, "", "", ""]
    if block.zero_points is not None:
        tensors.append(numpy_helper.from_array(pack_zero_points(block.zero_points, block.bits), f"{base}.zero_points"))
        inputs[3] = tensors[-1].name
    if node.op_type == "Gemm" and len(node.input) > 2 and node.input[2]:
        inputs[5] = node.input[2]  # a bias [N]
    while inputs[-1] == "":
        inputs.pop()
    output = node.output[0] if block.offsets is None else f"{base}.nbits"
    q = helper.make_node(
        "MatMulNBits",
        inputs,
        [output],
        name=f"{base}.nbits",
        domain=MS_DOMAIN,
        K=block.columns,
        N=n,
        bits=block.bits,
        block_size=BLOCK_SIZE,
        accuracy_level=accuracy_level,
    )
    meta = {ROWS_KEY: json.dumps(runs), FORMAT_KEY: block.source}
    nodes = [q]
    if block.offsets is not None:
        if block.columns != k_blocks * BLOCK_SIZE:
            raise QuantizeError(f"{base}: block offsets need whole blocks of inputs")
        tensors += [
            numpy_helper.from_array(np.array([-1, k_blocks, BLOCK_SIZE], np.int64), f"{base}.block_shape"),
            numpy_helper.from_array(np.array([-1], np.int64), f"{base}.block_axis"),
            numpy_helper.from_array(np.ascontiguousarray(block.offsets.T, np.float32), f"{base}.offsets"),
        ]
        meta[OFFSETS_KEY] = f"{base}.offsets"
        nodes += [
            helper.make_node(
                "Reshape", [node.input[0], f"{base}.block_shape"], [f"{base}.blocks"], name=f"{base}.blocks"
            ),
            helper.make_node(
                "ReduceSum",
                [f"{base}.blocks", f"{base}.block_axis"],
                [f"{base}.block_sums"],
                name=f"{base}.block_sums",
                keepdims=0,
            ),
        ]
        if node.op_type == "Gemm":  # 2-D rows: one Gemm adds the offsets to the product (fewest kernel calls)
            nodes.append(
                helper.make_node(
                    "Gemm",
                    [f"{base}.block_sums", f"{base}.offsets", output],
                    [node.output[0]],
                    name=f"{base}.add_offsets",
                )
            )
        else:  # a MatMul's input may have leading dims: back to the product's shape first
            nodes += [
                helper.make_node(
                    "MatMul",
                    [f"{base}.block_sums", f"{base}.offsets"],
                    [f"{base}.offset_rows"],
                    name=f"{base}.offset_rows",
                ),
                helper.make_node("Shape", [output], [f"{base}.shape"], name=f"{base}.shape"),
                helper.make_node(
                    "Reshape", [f"{base}.offset_rows", f"{base}.shape"], [f"{base}.offset"], name=f"{base}.offset"
                ),
                helper.make_node("Add", [output, f"{base}.offset"], [node.output[0]], name=f"{base}.add_offsets"),
            ]
    for key, value in meta.items():
        q.metadata_props.add(key=key, value=value)
    return nodes, tensors


def _gathers(node: Any, inits: Mapping[str, Any], table: np.ndarray) -> bool:
    """Whether ``node`` gathers whole rows of a constant equal to ``table`` (the exporter's embedding lookup)."""
    from onnx import helper, numpy_helper

    if node.op_type not in ("Gather", "GatherND") or not node.input or node.input[0] not in inits:
        return False
    init = inits[node.input[0]]
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    if list(init.dims) != list(table.shape) or attrs.get("axis", 0) != 0 or attrs.get("batch_dims", 0) != 0:
        return False
    return bool(np.array_equal(numpy_helper.to_array(init), table))


def _gather_block_quantized(node: Any, block: BlockQuant) -> tuple[list[Any], list[Any]]:
    """The GatherBlockQuantized node replacing the embedding lookup ``node``, with its initializers.

    A GatherND's indices end in a unit axis (one index per row) that the op does not take: squeezed.
    """
    from onnx import helper, numpy_helper

    base = node.name or node.output[0]
    codes = block.codes.reshape(block.rows, -1)[:, : block.columns]
    data = codes if block.bits == 8 else pack_codes(codes, 4)
    tensors = [
        numpy_helper.from_array(np.ascontiguousarray(data), f"{base}.qdata"),
        numpy_helper.from_array(block.scales.astype(np.float32), f"{base}.scales"),
        numpy_helper.from_array(pack_zero_points(block.zero_point_values(), block.bits), f"{base}.zero_points"),
    ]
    nodes = []
    indices = node.input[1]
    if node.op_type == "GatherND":
        tensors.append(numpy_helper.from_array(np.array([-1], np.int64), f"{base}.last_axis"))
        nodes.append(
            helper.make_node("Squeeze", [indices, f"{base}.last_axis"], [f"{base}.indices"], name=f"{base}.indices")
        )
        indices = f"{base}.indices"
    gather = helper.make_node(
        "GatherBlockQuantized",
        [tensors[0].name, indices, tensors[1].name, tensors[2].name],
        [node.output[0]],
        name=f"{base}.blocks",
        domain=MS_DOMAIN,
        bits=block.bits,
        block_size=BLOCK_SIZE,
        gather_axis=0,
        quantize_axis=1,
    )
    gather.metadata_props.add(key=FORMAT_KEY, value=block.source)
    return [*nodes, gather], tensors


def embedding_weights(path: str | os.PathLike) -> tuple[np.ndarray, str] | None:
    """The de-quantized table of the graph's GatherBlockQuantized and its format, or None if it gathers fp32."""
    import onnx
    from onnx import helper, numpy_helper

    proto = onnx.load(str(path))
    inits = {i.name: numpy_helper.to_array(i) for i in proto.graph.initializer}
    for node in proto.graph.node:
        if node.op_type != "GatherBlockQuantized" or node.domain != MS_DOMAIN:
            continue
        bits = int({a.name: helper.get_attribute_value(a) for a in node.attribute}["bits"])
        codes = unpack_codes(inits[node.input[0]], bits)
        scales = inits[node.input[2]]
        rows, k_blocks = scales.shape
        columns = codes.shape[1]
        padded = np.pad(codes, ((0, 0), (0, k_blocks * BLOCK_SIZE - columns))).reshape(rows, k_blocks, BLOCK_SIZE)
        zps = unpack_zero_points(inits[node.input[3]], bits, k_blocks)
        meta = {p.key: p.value for p in node.metadata_props}
        block = BlockQuant(bits, padded, scales, zps, None, columns, meta.get(FORMAT_KEY, "?"))
        return block.dequantize(), block.source
    return None


def graph_weights(path: str | os.PathLike) -> dict[str, tuple[np.ndarray, list[tuple[str, int, int]], str]]:
    """Every MatMulNBits node's de-quantized weight ``[N, K]``, the source rows it holds and their format."""
    import onnx
    from onnx import helper, numpy_helper

    proto = onnx.load(str(path))
    inits = {i.name: numpy_helper.to_array(i) for i in proto.graph.initializer}
    out = {}
    for node in proto.graph.node:
        if node.op_type != "MatMulNBits" or node.domain != MS_DOMAIN:
            continue
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        bits, n, columns = int(attrs["bits"]), int(attrs["N"]), int(attrs["K"])
        codes = unpack_codes(inits[node.input[1]], bits)
        scales = inits[node.input[2]].reshape(n, -1)
        k_blocks = scales.shape[1]
        zps = (
            unpack_zero_points(inits[node.input[3]], bits, k_blocks) if len(node.input) > 3 and node.input[3] else None
        )
        meta = {p.key: p.value for p in node.metadata_props}
        offsets = inits[meta[OFFSETS_KEY]].T if OFFSETS_KEY in meta else None
        block = BlockQuant(bits, codes, scales, zps, offsets, columns, meta.get(FORMAT_KEY, "?"))
        runs = [tuple(r) for r in json.loads(meta.get(ROWS_KEY, "[]"))]
        out[node.name] = (block.dequantize(), runs, block.source)
    return out

"""The model's tensors a quantized export replaces, as its source holds them, and the model they make.

Which weights are linear layers (``linear_names``); each one in blocks, the source's own where it
has them (a block-quantized GGUF, bit for bit), rounded from fp32 otherwise, to nearest or
calibrated (``source_blocks``); the
table the embedding gathers from blocks (``embedding_block``); and the model the export is checked
against: the source with the weights the rewritten graph computes (``dequantized_model``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from specdec.export.quantization.blocks import (
    BLOCK_SIZE,
    GGUF_BITS,
    BlockQuant,
    QuantizeError,
    from_gguf_blocks,
    quantize_rtn,
)
from specdec.export.quantization.rounding import quantize_weighted

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
#: the LM head's weight names (a tied head multiplies by the embedding table)
HEADS = ("lm_head.weight", EMBEDDING)
#: node metadata: the source rows a rewritten node holds (``Runs``) and the format they came in
ROWS_KEY, FORMAT_KEY = "specdec.quantize.rows", "specdec.quantize.format"
#: a graph weight as consecutive rows of source tensors: (source name, first row, end row)
Runs = list[tuple[str, int, int]]


def fp32(model: Any, name: str) -> np.ndarray:
    """The fp32 value of the state-dict tensor ``name``."""
    return model.state_dict[name].detach().float().numpy()


def node_metadata(runs: Runs, source_format: str) -> dict[str, str]:
    """What a rewritten node records of itself: its source rows and their format (read by ``graph_weights``)."""
    return {ROWS_KEY: json.dumps(runs), FORMAT_KEY: source_format}


def linear_names(model: Any) -> list[str]:
    """The state-dict names of every linear weight the graph multiplies by: 7 per layer and the LM head."""
    sd = model.state_dict
    names = [
        f"model.layers.{i}.{p}.weight" for i in range(int(model.config.num_hidden_layers)) for p in LINEAR_PROJECTIONS
    ]
    names.append("lm_head.weight" if "lm_head.weight" in sd and not model.config.tie_word_embeddings else EMBEDDING)
    return names


def source_blocks(
    model: Any,
    bits: int,
    use_gguf: bool = True,
    names: Sequence[str] | None = None,
    block_size: int = BLOCK_SIZE,
    importance: Mapping[str, np.ndarray] | None = None,
) -> dict[str, BlockQuant]:
    """Each linear weight of ``model`` (or the tensors ``names``) in blocks: the GGUF file's own where it has them,
    else calibrated rounding where ``importance`` holds the weight's input moments (``rounding``), else RTN.

    ``block_size`` is the decoder layers'; the LM head (and a tied table) keep blocks of ``BLOCK_SIZE``. Why: the
    head multiplies only the rows that need logits, often a lone row, which MLAS multiplies alike whatever the
    other rows only in blocks of up to 32 (``nbits.ROW_INVARIANT_BLOCK``); and the head is where a rounding moves a
    token's choice most directly (``benchmarks/results/graph_fidelity_rounding.md``).

    A GGUF tensor is used only after its de-quantized values equal the loaded fp32 weights bit for
    bit (so a row order that does not follow the loaded one, e.g. a missed RoPE un-permutation,
    is refused here rather than exported).
    """
    from specdec.models.gguf_blocks import GGUF_PATH, read_gguf_tensors

    path = model.extra.get(GGUF_PATH) if use_gguf else None
    raw = read_gguf_tensors(path, model.config) if path else {}
    out: dict[str, BlockQuant] = {}
    for name in linear_names(model) if names is None else names:
        weight = fp32(model, name)
        tensor = raw.get(name)
        size = BLOCK_SIZE if name in HEADS else block_size
        if tensor is None or tensor.ggml_type not in GGUF_BITS or tensor.shape != weight.shape:
            if importance is not None and name in importance:
                out[name] = quantize_weighted(weight, bits, size, importance[name])
            else:  # e.g. F16 tensors, or a restricted head cut from the file's
                out[name] = quantize_rtn(weight, bits, size)
            continue
        if size != BLOCK_SIZE:
            raise QuantizeError(
                f"{path}: {name} comes in the file's {tensor.ggml_type} blocks of {BLOCK_SIZE}, not {block_size}: "
                "round the fp32 weights to other blocks with --quantize-from fp32 or calibrated"
            )
        block = from_gguf_blocks(tensor.ggml_type, tensor.data, tensor.shape[1])
        if not np.array_equal(block.dequantize(), weight):
            raise QuantizeError(
                f"{path}: the {tensor.ggml_type} blocks of {name} do not reproduce the loaded "
                "weights (rows in another order than transformers' un-permuted ones?)"
            )
        out[name] = block.widened(max(block.bits, bits))
    return out


def embedding_block(model: Any, bits: int, blocks: Mapping[str, BlockQuant], use_gguf: bool) -> BlockQuant | None:
    """The embedding table in blocks for ``GatherBlockQuantized``, or None where it stays fp32.

    A tied table is the LM head's own blocks; an untied one comes from the source like a linear
    weight, to nearest where it is rounded (it is gathered, not multiplied: no input weighs its
    columns). None: Q4_1 blocks (their offsets have no place in the op) or an odd width at 4 bits.
    """
    block = blocks.get(EMBEDDING) or source_blocks(model, bits, use_gguf, [EMBEDDING])[EMBEDDING]
    if block.offsets is not None or (block.bits == 4 and block.columns % 2):
        return None
    return block


def dequantized_model(
    model: Any,
    blocks: Mapping[str, BlockQuant],
    embedding: BlockQuant | None = None,
    computed: Mapping[str, np.ndarray] | None = None,
) -> Any:
    """A copy of ``model`` whose linear weights (and the ``embedding`` table, when the graph gathers it from
    blocks) are the de-quantized blocks, and the weights ``computed`` by other forms (w8a8 chains): the
    validation's reference.

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
    for name, weight in (computed or {}).items():
        state[name] = torch.from_numpy(np.ascontiguousarray(weight, np.float32))
    if embedding is not None:
        if config.tie_word_embeddings:
            config = copy.deepcopy(config)
            config.tie_word_embeddings = False
            state.setdefault("lm_head.weight", state[EMBEDDING])
        state[EMBEDDING] = torch.from_numpy(embedding.dequantize().copy())
    return LoadedModel(model.name, config, state, model.tokenizer, model.source, dict(model.extra))

"""A GGUF file's LLaMA tensors as stored (blocks, no de-quantization), by Hugging Face name.

Split from ``loading`` (which de-quantizes a GGUF to load it): a quantized export reads the file's own blocks
here, so it reproduces them instead of rounding the fp32 weights a second time.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

#: ``LoadedModel.extra`` key of the GGUF file a model was loaded from (its raw blocks: ``read_gguf_tensors``)
GGUF_PATH = "gguf_path"
_GGUF_NAMES = {"token_embd": "model.embed_tokens", "output": "lm_head", "output_norm": "model.norm"}
_GGUF_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}


@dataclass(frozen=True)
class GGUFTensor:
    """One GGUF tensor as stored: ggml type, Hugging Face name and shape, raw bytes one row per weight row."""

    name: str
    ggml_type: str  # "Q4_1", "Q8_0", "F32", ...
    shape: tuple[int, ...]  # the Hugging Face shape, e.g. (out_features, in_features)
    data: Any  # numpy uint8 [rows, bytes per row] (float32 for F32 tensors), rows in the loaded weights' order


def read_gguf_tensors(path: str | os.PathLike, config: Any) -> dict[str, GGUFTensor]:
    """The LLaMA tensors of a GGUF file by Hugging Face name, blocks as stored (no de-quantization).

    Why: a quantized export reproduces the file's own blocks instead of rounding the fp32 weights
    a second time. llama.cpp's converter permutes the rows of attn_q / attn_k for its RoPE layout;
    their rows are put back in transformers' order here (as its GGUF loader does), so row i of
    every tensor is row i of the loaded weights.
    """
    import numpy as np
    from gguf import GGUFReader

    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    out: dict[str, GGUFTensor] = {}
    for tensor in GGUFReader(str(path)).tensors:
        base, _, suffix = tensor.name.rpartition(".")
        parts = base.split(".")
        hf = (
            f"model.layers.{parts[1]}.{_GGUF_LAYER_NAMES[parts[2]]}"
            if parts[0] == "blk" and len(parts) == 3 and parts[2] in _GGUF_LAYER_NAMES
            else _GGUF_NAMES.get(base)
        )
        if hf is None:
            continue
        data = np.asarray(tensor.data)
        n_head = heads if parts[-1] == "attn_q" else kv_heads if parts[-1] == "attn_k" else 0
        if n_head:  # transformers' reverse permutation, applied to whole rows of blocks
            rows = data.shape[0]
            data = data.reshape(n_head, rows // n_head // 2, 2, -1).swapaxes(2, 1).reshape(rows, -1)
        shape = tuple(int(d) for d in reversed(tensor.shape))
        out[f"{hf}.{suffix}"] = GGUFTensor(f"{hf}.{suffix}", tensor.tensor_type.name, shape, data)
    return out

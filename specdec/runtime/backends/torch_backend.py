"""LLaMA in plain torch over the ragged step (RMSNorm, RoPE, GQA, SwiGLU).

Built from Hugging Face parameter names but independent of HF modeling code: no HF
attention, no ``generate``. Q/K/V and gate/up projections are fused into one GEMM each
because on a 2-core CPU the step is bound by weight reads, and one pass over the weights
is cheaper than three.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from specdec.models.export_meta import check_head_token_ids
from specdec.models.loading import LoadedModel
from specdec.plugins.reference import ragged_tree_attention
from specdec.runtime.backends.host_cache import SlotMajorMoves
from specdec.runtime.packed import PackedBatch

Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero tensor whose host pages are only mapped when first written.

    ``torch.zeros`` writes every byte at allocation, so a cache sized ``max_batch x max_len`` is
    resident in full before the first token; numpy's ``zeros`` is ``calloc``, whose large blocks
    are fresh zero pages of the kernel. Resident memory then grows with the positions sequences
    really use, as an edge runtime's does (peak RSS in ``benchmarks/results/edge_cpu.md``).
    """
    if device.type == "cpu" and dtype in (torch.float32, torch.float16):
        return torch.from_numpy(np.zeros(shape, dtype=np.float32 if dtype == torch.float32 else np.float16))
    return torch.zeros(shape, dtype=dtype, device=device)


class TorchKVStorage(SlotMajorMoves):
    """Slot-major per-layer caches held as torch tensors.

    ``max_len`` positions belong to sequences; ``spare`` more at the end of each slot are scratch
    for a backend whose kernel writes past a sequence (the ONNX Runtime lowering's discarded query
    rows, ``ort_fuse.SPARE_POSITIONS``). ``buffer_len`` is both together.
    """

    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        kv_heads: int,
        max_len: int,
        head_dim: int,
        dtype: torch.dtype,
        device: str | torch.device = "cpu",
        spare: int = 0,
    ) -> None:
        self.buffer_len = max_len + spare
        shape = (num_slots, kv_heads, self.buffer_len, head_dim)
        self.num_slots, self.max_len = num_slots, max_len
        self.device = torch.device(device)
        self.k = [zeroed(shape, dtype, self.device) for _ in range(num_layers)]
        self.v = [zeroed(shape, dtype, self.device) for _ in range(num_layers)]

    def read(self, slot: int, length: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """Copies as float32 host arrays (``copy=True``: a CPU fp32 cache would otherwise be returned as a view)."""
        return [
            (
                k[slot, :, :length].to("cpu", torch.float32, copy=True).numpy(),
                v[slot, :, :length].to("cpu", torch.float32, copy=True).numpy(),
            )
            for k, v in zip(self.k, self.v)
        ]


def rope_inv_freq(config: Any) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and attention scaling for the model's RoPE variant.

    Supports the static variants LLaMA checkpoints use: default, linear and llama3.
    Dynamic variants change with sequence length and are refused rather than silently
    computed wrong.
    """
    params = dict(getattr(config, "rope_parameters", None) or {})
    legacy = getattr(config, "rope_scaling", None)
    if legacy and not params.get("rope_type"):
        params.update(legacy)
    theta = float(params.get("rope_theta", getattr(config, "rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if rope_type == "default":
        pass
    elif rope_type == "linear":
        inv_freq = inv_freq / float(params["factor"])
    elif rope_type == "llama3":
        factor = float(params["factor"])
        low, high = float(params["low_freq_factor"]), float(params["high_freq_factor"])
        old_ctx = float(params["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
        inv_freq = torch.where(medium, smoothed, scaled)
    else:
        raise ValueError(f"RoPE type {rope_type!r} is not supported (default, linear, llama3 are)")
    return inv_freq.to(torch.float32), 1.0


@dataclass
class _Layer:
    qkv: torch.Tensor  # [(Hq + 2 Hkv) D, H]
    qkv_bias: torch.Tensor | None
    o: torch.Tensor
    o_bias: torch.Tensor | None
    gate_up: torch.Tensor  # [2 I, H]
    gate_up_bias: torch.Tensor | None
    down: torch.Tensor
    down_bias: torch.Tensor | None
    attn_norm: torch.Tensor
    mlp_norm: torch.Tensor


class TorchBackend:
    """The reference backend: runs ragged steps of a LLaMA-family model on CPU or CUDA."""

    #: its attention takes ``PackedBatch.cache_mask``, so the padded ``vanilla`` baseline runs here
    supports_cache_mask = True

    def __init__(
        self, model: LoadedModel, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
    ) -> None:
        cfg = model.config
        self.name = model.name
        self.device, self.dtype = torch.device(device), dtype
        self.vocab_size = int(cfg.vocab_size)
        self.num_layers = int(cfg.num_hidden_layers)
        self.num_heads = int(cfg.num_attention_heads)
        self.num_kv_heads = int(getattr(cfg, "num_key_value_heads", None) or self.num_heads)
        self.head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // self.num_heads)
        self.eps = float(cfg.rms_norm_eps)
        self.scale = self.head_dim**-0.5
        self.rows_processed = 0
        self.calls = 0
        sd = model.state_dict

        def w(name: str) -> torch.Tensor:
            return sd[name].to(device=self.device, dtype=dtype).contiguous()

        def b(name: str) -> torch.Tensor | None:
            return w(name) if name in sd else None

        def cat_bias(*names: str) -> torch.Tensor | None:
            parts = [p for p in (b(n) for n in names) if p is not None]
            return torch.cat(parts) if len(parts) == len(names) else None

        self.embed = w("model.embed_tokens.weight")
        self.lm_head = self.embed if "lm_head.weight" not in sd else w("lm_head.weight")
        self.head_size = int(self.lm_head.shape[0])
        self.head_token_ids = None
        if model.head_token_ids is not None:
            if self.lm_head is self.embed:
                raise ValueError(f"{model.name}: a restricted LM head needs its own lm_head.weight (untied)")
            self.head_token_ids = check_head_token_ids(
                model.head_token_ids, self.vocab_size, self.head_size, where=f"{model.name}: head_token_ids"
            )
        elif self.head_size != self.vocab_size:
            raise ValueError(
                f"{model.name}: lm_head has {self.head_size} rows for a vocabulary of {self.vocab_size} "
                "but no head_token_ids say which tokens they score"
            )
        self.final_norm = w("model.norm.weight")
        self.layers: list[_Layer] = []
        for i in range(self.num_layers):
            p = f"model.layers.{i}."
            attn = [p + f"self_attn.{x}_proj" for x in "qkv"]
            self.layers.append(
                _Layer(
                    qkv=torch.cat([w(n + ".weight") for n in attn]),
                    qkv_bias=cat_bias(*(n + ".bias" for n in attn)),
                    o=w(p + "self_attn.o_proj.weight"),
                    o_bias=b(p + "self_attn.o_proj.bias"),
                    gate_up=torch.cat([w(p + "mlp.gate_proj.weight"), w(p + "mlp.up_proj.weight")]),
                    gate_up_bias=cat_bias(p + "mlp.gate_proj.bias", p + "mlp.up_proj.bias"),
                    down=w(p + "mlp.down_proj.weight"),
                    down_bias=b(p + "mlp.down_proj.bias"),
                    attn_norm=w(p + "input_layernorm.weight"),
                    mlp_norm=w(p + "post_attention_layernorm.weight"),
                )
            )
        inv_freq, self.rope_scaling = rope_inv_freq(cfg)
        self.inv_freq = inv_freq.to(self.device)

    def allocate_cache(self, num_slots: int, max_len: int) -> TorchKVStorage:
        return TorchKVStorage(
            self.num_layers, num_slots, self.num_kv_heads, max_len, self.head_dim, self.dtype, self.device
        )

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return weight * x32.to(x.dtype)

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)  # [T, D]
        return (
            (emb.cos() * self.rope_scaling).to(self.dtype)[:, None, :],
            (emb.sin() * self.rope_scaling).to(self.dtype)[:, None, :],
        )

    @staticmethod
    def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin

    def forward(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, logits_indices: torch.Tensor, attend: Attend
    ) -> torch.Tensor:
        """The LLaMA computation of one ragged step, attention left to ``attend``.

        Only attention needs to know which sequence a token belongs to; everything else
        runs on the T packed rows. ``attend(layer, q, k, v)`` gets rotated q [T, Hq, D] and
        k, v [T, Hkv, D] and returns [T, Hq, D]: the torch backend binds it to the
        in-place reference, the ONNX exporter to the custom op.
        """
        cos, sin = self._rope(position_ids)
        h = self.embed[input_ids]
        tokens = h.shape[0]
        q_dim, kv_dim = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        for i, layer in enumerate(self.layers):
            x = self._rms_norm(h, layer.attn_norm)
            qkv = F.linear(x, layer.qkv, layer.qkv_bias)
            q = qkv[:, :q_dim].reshape(tokens, self.num_heads, self.head_dim)
            k = qkv[:, q_dim : q_dim + kv_dim].reshape(tokens, self.num_kv_heads, self.head_dim)
            v = qkv[:, q_dim + kv_dim :].reshape(tokens, self.num_kv_heads, self.head_dim)
            attn = attend(i, self._rotate(q, cos, sin), self._rotate(k, cos, sin), v)
            h = h + F.linear(attn.reshape(tokens, q_dim), layer.o, layer.o_bias)
            x = self._rms_norm(h, layer.mlp_norm)
            gate, up = F.linear(x, layer.gate_up, layer.gate_up_bias).chunk(2, dim=-1)
            h = h + F.linear(F.silu(gate) * up, layer.down, layer.down_bias)
        rows = h[logits_indices.long()]
        return F.linear(self._rms_norm(rows, self.final_norm), self.lm_head).float()

    def _tensor(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array)).to(self.device)

    @torch.inference_mode()
    def step(self, batch: PackedBatch, cache: TorchKVStorage) -> np.ndarray:
        """The backend interface's step (numpy in and out, ``base.Backend``) over torch caches."""
        self.calls += 1
        self.rows_processed += batch.num_tokens
        cu, past, slots = batch.cu_seqlens.tolist(), batch.past_lens.tolist(), batch.slot_ids.tolist()
        tree = self._tensor(batch.tree_mask)
        cache_mask = None if batch.cache_mask is None else self._tensor(batch.cache_mask)

        attention = ragged_tree_attention
        if self.device.type == "cuda":  # the OpenAI Triton kernel the TensorRT plugin also runs
            from specdec.plugins.triton_kernel import torch_cuda_attention as attention

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return attention(q, k, v, cache.k[layer], cache.v[layer], cu, past, slots, tree, self.scale, cache_mask)

        logits = self.forward(
            self._tensor(batch.input_ids), self._tensor(batch.position_ids), self._tensor(batch.logits_indices), attend
        )
        return logits.cpu().numpy()

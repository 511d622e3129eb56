"""ONNX Runtime backend: runs an exported ragged-step graph with the caches bound in place.

The caches are ordinary torch tensors (so the KV manager's moves and forks work on them
directly); each step binds every ``past_key_values.*`` input and its ``present.*`` output
to the same buffer through IOBinding, so the graph's scatter writes the new K/V rows into
the cache itself and no full-cache copy happens per step. ``inplace_ok`` records whether
ORT really wrote through the bound buffer (checked by pointer on every step).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import torch

from specdec.models.loading import HEAD_TOKEN_IDS_FILE, ModelResolutionError, read_head_token_ids
from specdec.runtime.backends.torch_backend import TorchKVStorage
from specdec.runtime.graph_io import CACHE_INPUT, CACHE_OUTPUT, GRAPH_INPUTS, LOGITS, cache_names, graph_feeds
from specdec.runtime.packed import PackedBatch

_NP_DTYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16}
_TORCH_DTYPES = {np.float32: torch.float32, np.float16: torch.float16}


class OnnxModelError(RuntimeError):
    """An ONNX file is missing, corrupt, or not a specdec ragged-step graph."""


def graph_head(graph: Path, head_size: int) -> tuple[torch.Tensor | None, int]:
    """(head_token_ids, vocab_size) of an exported graph whose logits have ``head_size`` columns.

    A full head's width is the vocabulary. A restricted head's map is ``head_token_ids.json``
    next to the graph, and the vocabulary it reads comes from the ``config.json`` beside it
    (the graph's logits alone cannot tell V). Shared by the ONNX Runtime and TensorRT backends.
    """
    directory = graph.parent
    if not (directory / HEAD_TOKEN_IDS_FILE).is_file():
        return None, head_size
    config = directory / "config.json"
    try:
        vocab_size = int(json.loads(config.read_text())["vocab_size"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise OnnxModelError(f"{graph} has a restricted LM head ({HEAD_TOKEN_IDS_FILE}) but no readable "
                             f"vocab_size in {config}: {exc}") from exc
    try:
        ids = read_head_token_ids(directory, vocab_size)
    except ModelResolutionError as exc:
        raise OnnxModelError(str(exc)) from exc
    if ids is None or len(ids) != head_size:
        raise OnnxModelError(f"{graph}: {HEAD_TOKEN_IDS_FILE} lists {0 if ids is None else len(ids)} token ids "
                             f"but the graph's logits have {head_size} columns")
    return ids, vocab_size


class OrtBackend:
    """A ``Backend`` over an ONNX Runtime session of a ``specdec-export`` graph."""

    #: the graph has no cache_mask input (``graph_io``): a step with KV holes is refused
    supports_cache_mask = False

    def __init__(self, path: str | os.PathLike, *, providers: list[str] | None = None,
                 intra_op_threads: int | None = None, name: str | None = None, spin: bool = True) -> None:
        """``spin``: let the session's idle worker threads spin-wait for the next run (ORT's default).

        Why a draft opens without: its workers spin on after each short draft step and hold the
        cores the target's next step needs, while the target's own steps run back to back and gain
        from spinning (measured: ``benchmarks/results/ort_contention.md``).
        """
        import onnxruntime as ort

        self.path = Path(path)
        self.name = name or self.path.stem
        if not self.path.is_file():
            raise OnnxModelError(f"{self.path} does not exist")
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        if intra_op_threads:
            options.intra_op_num_threads = intra_op_threads
        if not spin:
            options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        available = ort.get_available_providers()
        wanted = providers or [p for p in ("CUDAExecutionProvider", "CPUExecutionProvider") if p in available]
        try:
            self.session = ort.InferenceSession(str(self.path), options, providers=wanted)
        except Exception as exc:  # ORT raises its own Fail/InvalidGraph/... types
            raise OnnxModelError(f"cannot load {self.path}: {exc}") from exc
        inputs = {i.name: i for i in self.session.get_inputs()}
        outputs = {o.name: o for o in self.session.get_outputs()}
        missing = [t.name for t in GRAPH_INPUTS if t.name not in inputs] + [n for n in (LOGITS,) if n not in outputs]
        if missing:
            raise OnnxModelError(f"{self.path} is not a specdec ragged-step graph: missing {missing}")
        self.num_layers = sum(1 for n in inputs if n.startswith("past_key_values.") and n.endswith(".key"))
        first = inputs[CACHE_INPUT.format(layer=0, kind="key")]
        _, self.num_kv_heads, _, self.head_dim = first.shape
        self.np_dtype = _NP_DTYPES[first.type]
        self.dtype = _TORCH_DTYPES[self.np_dtype]
        self.head_size = int(outputs[LOGITS].shape[-1])
        self.head_token_ids, self.vocab_size = graph_head(self.path, self.head_size)
        self._in_names = cache_names(self.num_layers, CACHE_INPUT)
        self._out_names = cache_names(self.num_layers, CACHE_OUTPUT)
        self.device = "cuda" if "CUDAExecutionProvider" in self.session.get_providers() else "cpu"
        self.rows_processed = 0
        self.calls = 0
        self.inplace_ok = True

    def allocate_cache(self, num_slots: int, max_len: int) -> TorchKVStorage:
        return TorchKVStorage(self.num_layers, num_slots, int(self.num_kv_heads), max_len, int(self.head_dim),
                              self.dtype)

    def step(self, batch: PackedBatch, cache: TorchKVStorage) -> torch.Tensor:
        self.calls += 1
        self.rows_processed += batch.num_tokens
        binding = self.session.io_binding()
        for name, tensor in graph_feeds(batch).items():
            binding.bind_cpu_input(name, np.ascontiguousarray(tensor.numpy()))
        binding.bind_output(LOGITS)  # first, so it is outputs[0]
        buffers = [*cache.k, *cache.v]
        for in_name, out_name, buf in zip(self._in_names, self._out_names, buffers):
            shape = list(buf.shape)
            binding.bind_input(in_name, "cpu", 0, self.np_dtype, shape, buf.data_ptr())
            binding.bind_output(out_name, "cpu", 0, self.np_dtype, shape, buf.data_ptr())
        self.session.run_with_iobinding(binding)
        outputs = binding.get_outputs()
        self.inplace_ok = self.inplace_ok and all(
            o.data_ptr() == b.data_ptr() for o, b in zip(outputs[1:], buffers))
        return torch.from_numpy(outputs[0].numpy())

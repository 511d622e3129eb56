"""TensorRT backend: runs a ragged-step engine built by ``specdec.export.tensorrt.build_engine``.

The engine's attention layers are the Python plugin of ``specdec.plugins.trt_plugin``, so the
plugin is registered before the engine is deserialised, and the engine is checked to really
contain one plugin layer per attention layer (an engine built while the plugin was missing
runs the standard-op function body instead: correct, slow, and not what was asked for). The
environment check and that engine check come from the plugin module, the same ones
``build_engine`` runs, so loading an engine needs nothing from the export layer.

Caches are torch CUDA tensors (``TorchKVStorage``, the torch backend's storage allocated on the
GPU), so the KV manager's compaction and forks run on them directly. Every step binds each
``past_key_values.*`` input and its ``present.*`` output to the *same* buffer: with the
plugin's aliased outputs the new K/V rows are written in place and no cache is copied. Input
shapes are set per step (T, B, S_max and R change every step) and checked against the
engine's optimization profile first, so a step the engine was not built for fails with a
message naming the limit instead of a TensorRT error code. The engine runs with
``execute_async_v3`` on torch's current CUDA stream, so torch-side copies and the engine are
ordered without extra synchronisation.

``tensorrt`` is imported lazily (in the constructor): this module imports anywhere.
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path

import numpy as np
import torch

from specdec.runtime.backends.onnxruntime import OnnxModelError, graph_head
from specdec.runtime.backends.torch_backend import TorchKVStorage
from specdec.runtime.graph_io import (
    CACHE_INPUT,
    CACHE_OUTPUT,
    GRAPH_INPUTS,
    LOGITS,
    cache_layers,
    cache_names,
    graph_feeds,
)
from specdec.runtime.packed import PackedBatch

_TORCH_TYPES = {
    "FLOAT": torch.float32,
    "HALF": torch.float16,
    "BF16": torch.bfloat16,
    "INT32": torch.int32,
    "INT64": torch.int64,
    "INT8": torch.int8,
    "UINT8": torch.uint8,
    "BOOL": torch.bool,
}


class EngineLoadError(RuntimeError):
    """An engine file is missing, does not deserialise here, or is not a specdec ragged-step engine."""


class ShapeOutOfProfileError(ValueError):
    """A step or a cache does not fit the optimization profile the engine was built with."""


class TensorRTBackend:
    """A ``Backend`` over a TensorRT engine of a ``specdec-export --backend tensorrt`` graph.

    The caches live on ``device``; ``step`` returns the logits rows on the host, as every backend
    does (``base.Backend``).
    """

    #: the engine has no cache_mask input (``graph_io``): a step with KV holes is refused
    supports_cache_mask = False

    def __init__(
        self, engine_path: str | os.PathLike, *, device: str | torch.device = "cuda", name: str | None = None
    ) -> None:
        from specdec.plugins import trt_plugin

        self.path = Path(engine_path)
        self.name = name or self.path.parent.name or self.path.stem
        if not self.path.is_file():
            raise EngineLoadError(f"{self.path} does not exist (build it with specdec-export --backend tensorrt)")
        trt_plugin.require_tensorrt()
        trt = importlib.import_module("tensorrt")
        if not trt_plugin.register():
            raise EngineLoadError(f"cannot register the attention plugin: {trt_plugin.unavailable_reason()}")
        self.device = torch.device(device)
        self._logger = trt.Logger(trt.Logger.WARNING)
        with torch.cuda.device(self.device):
            self._runtime = trt.Runtime(self._logger)
            self.engine = self._runtime.deserialize_cuda_engine(self.path.read_bytes())
        if self.engine is None:
            raise EngineLoadError(
                f"{self.path} does not deserialise with TensorRT {trt.__version__} on this GPU "
                "(engines are tied to the TensorRT version and GPU they were built with: rebuild)"
            )
        names = [self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)]
        self._inputs = [n for n in names if self.engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
        outputs = [n for n in names if self.engine.get_tensor_mode(n) == trt.TensorIOMode.OUTPUT]
        missing = [t.name for t in GRAPH_INPUTS if t.name not in self._inputs] + ([] if LOGITS in outputs else [LOGITS])
        if missing:
            raise EngineLoadError(f"{self.path} is not a specdec ragged-step engine: missing {missing}")
        shape_io = [n for n in names if self.engine.is_shape_inference_io(n)]
        if shape_io:
            raise EngineLoadError(f"{self.path} takes {shape_io} as shape tensors: not built from the plugin graph")
        self.num_layers = cache_layers(self._inputs)
        trt_plugin.assert_plugin_layers(self.engine, expected=self.num_layers)

        first = CACHE_INPUT.format(layer=0, kind="key")
        cache_shape = tuple(self.engine.get_tensor_shape(first))
        self.num_kv_heads, self.head_dim = int(cache_shape[1]), int(cache_shape[3])
        self.dtype = self._torch_dtype(first)
        self.head_size = int(self.engine.get_tensor_shape(LOGITS)[-1])
        try:  # a restricted draft head: the map and the vocabulary sit next to the engine, as for ONNX
            self.head_token_ids, self.vocab_size = graph_head(self.path, self.head_size)
        except OnnxModelError as exc:
            raise EngineLoadError(str(exc)) from exc
        self._in_names = cache_names(self.num_layers, CACHE_INPUT)
        self._out_names = cache_names(self.num_layers, CACHE_OUTPUT)
        self._profile = {n: [tuple(d) for d in self.engine.get_tensor_profile_shape(n, 0)] for n in self._inputs}
        with torch.cuda.device(self.device):
            self.context = self.engine.create_execution_context()
        self.rows_processed = 0
        self.calls = 0

    def _torch_dtype(self, name: str) -> torch.dtype:
        kind = self.engine.get_tensor_dtype(name).name
        if kind not in _TORCH_TYPES:
            raise EngineLoadError(f"{self.path}: tensor {name!r} has dtype {kind}, which has no torch equivalent")
        return _TORCH_TYPES[kind]

    def _check_profile(self, name: str, shape: tuple[int, ...]) -> None:
        lo, _, hi = self._profile[name]
        for axis, (d, a, b) in enumerate(zip(shape, lo, hi)):
            if not a <= d <= b:
                raise ShapeOutOfProfileError(
                    f"{name} dimension {axis} is {d}, but the engine {self.path} was built for {a}..{b} "
                    f"(shape {list(shape)}, profile min {list(lo)} max {list(hi)}): rebuild it with a larger "
                    "ProfileSpec (specdec.export.tensorrt.ProfileSpec.derive(max_batch, max_len, max_tokens=...)) "
                    "or send smaller steps"
                )

    def allocate_cache(self, num_slots: int, max_len: int) -> TorchKVStorage:
        """Zeroed GPU caches; refused up front when the engine's profile cannot take them."""
        shape = (num_slots, self.num_kv_heads, max_len, self.head_dim)
        self._check_profile(CACHE_INPUT.format(layer=0, kind="key"), shape)
        return TorchKVStorage(
            self.num_layers, num_slots, self.num_kv_heads, max_len, self.head_dim, self.dtype, self.device
        )

    def _bind_input(self, name: str, tensor: torch.Tensor) -> None:
        shape = tuple(int(d) for d in tensor.shape)
        self._check_profile(name, shape)
        if not self.context.set_input_shape(name, shape):
            raise ShapeOutOfProfileError(f"TensorRT refused shape {list(shape)} for {name}")
        self.context.set_tensor_address(name, tensor.data_ptr())

    @torch.inference_mode()
    def step(self, batch: PackedBatch, cache: TorchKVStorage) -> np.ndarray:
        """Logits ``[R, vocab]`` (float32, host: ``base.Backend``); the new K/V are written into ``cache`` in place.

        Only the logits rows cross to the host (the caches stay on the device): the loops sample and verify
        on the host, as they do for every backend."""
        self.calls += 1
        self.rows_processed += batch.num_tokens
        feeds = graph_feeds(batch)  # refuses a masked cache (vanilla's holes) before touching the GPU
        if not isinstance(cache, TorchKVStorage) or cache.device != self.device:
            raise TypeError(f"cache must come from this backend's allocate_cache() (CUDA storage on {self.device})")
        rows = int(batch.logits_indices.shape[0])
        if batch.num_tokens == 0:
            return np.empty((0, self.head_size), dtype=np.float32)

        with torch.cuda.device(self.device):
            stream = torch.cuda.current_stream(self.device)
            if rows == 0:  # the profile starts at one row: compute one and return none
                feeds["logits_indices"] = np.zeros(1, dtype=np.int32)
            on_device = {
                name: torch.from_numpy(np.ascontiguousarray(a))
                .to(device=self.device, dtype=self._torch_dtype(name))
                .contiguous()
                for name, a in feeds.items()
            }
            for name, tensor in on_device.items():
                self._bind_input(name, tensor)
            for in_name, out_name, buf in zip(self._in_names, self._out_names, (*cache.k, *cache.v)):
                self._bind_input(in_name, buf)
                self.context.set_tensor_address(out_name, buf.data_ptr())  # present.* aliases past_key_values.*
            out_shape = tuple(int(d) for d in self.context.get_tensor_shape(LOGITS))
            if any(d < 0 for d in out_shape):
                raise RuntimeError(f"TensorRT could not infer the logits shape from the inputs (got {out_shape})")
            logits = torch.empty(out_shape, dtype=self._torch_dtype(LOGITS), device=self.device)
            self.context.set_tensor_address(LOGITS, logits.data_ptr())
            if not self.context.execute_async_v3(stream.cuda_stream):
                raise RuntimeError(f"TensorRT failed to enqueue the engine {self.path} (see the TensorRT log above)")
            return logits[:rows].float().cpu().numpy()

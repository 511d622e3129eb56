"""TensorRT plugin ``specdec::RaggedTreeAttention`` (version "1") as a Python Quickly-Deployable Plugin.

``tensorrt.plugin`` (TensorRT >= 10.6) turns three decorated Python functions into an
``IPluginV3`` and registers its creator, so TensorRT's ONNX parser binds every exported
``RaggedTreeAttention`` node (``plugin_namespace="specdec"``, ``plugin_version="1"``) to it:

* ``@trtp.register`` describes the I/O: ``out`` is like ``q``; ``k_cache_out`` / ``v_cache_out``
  are *aliased* to the cache inputs (``TensorDesc.aliased()``, build flag
  ``PreviewFeature.ALIASED_PLUGIN_IO_10_03``), so TensorRT hands the plugin the same buffer
  for input and output and the new K/V rows are written in place. On a TensorRT without
  ``aliased()`` they are declared ``like()`` the inputs and ``run_attention`` copies the cache
  first (correct, one cache copy per layer per step).
* ``@trtp.impl`` runs at enqueue time: it wraps TensorRT's device buffers as torch CUDA tensors
  (``__cuda_array_interface__``), makes TensorRT's stream torch's current stream, and calls the
  OpenAI Triton kernel ``specdec.plugins.triton_kernel.ragged_tree_attention_triton``.
* No ``@trtp.autotune``: the plugin runs in the I/O types the network gives it (the graph's
  precision, int32 indices) and linear formats. The tree mask is the exception: TensorRT's
  plugin documentation does not promise BOOL plugin I/O (``PluginTensorDesc``: "kBOOL ... not
  supported"), so ``cast_bool_inputs`` (called by ``build_engine``, and by polygraphy through
  ``postprocess``) feeds the plugin an int32 copy of the mask, made once per step and shared by
  every layer; the kernel accepts any integer mask.

Why there is no ``@trtp.aot_impl`` (ahead-of-time PTX, no Python at run time): an AOT plugin is
exactly one kernel launch whose grid TensorRT computes from symbolic shapes. This plugin
launches two Triton kernels (the KV write, then the attention) and builds its launch table
from ``cu_seqlens`` with torch ops on the device, so it does not fit. **An engine built here
therefore needs Python, torch and triton in the process that runs it**, with this module's
``register()`` called before deserialising. A Python-free engine needs either a fused
single-kernel variant whose programs find their (sequence, row block) from ``cu_seqlens``
themselves (then ``aot_impl`` can return its PTX) or a C++ ``IPluginV3``.

TensorRT runs a plugin with arbitrary input data while it autotunes during the build. The
Triton kernel trusts its index inputs (checking them on the host would need a device sync),
so ``run_attention`` first checks them *on the device* (``sanitize_indices``): when any is out
of range the kernel sees an empty pack (nothing is read or written) and ``out`` becomes NaN,
so bad inputs are visible rather than memory corruption.

Everything touching ``tensorrt`` is imported lazily: this module imports without it, and
``register()`` answers False (``unavailable_reason()`` says why).

The module is also polygraphy's data loader (``load_data``) for the ORT-vs-TRT comparison in
``specdec.export.tensorrt.polygraphy_recipe``. Deliberately no ``from __future__ import
annotations`` here: ``tensorrt.plugin`` validates the decorated functions' annotations as classes.
"""

import importlib
import math
import os
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch

from specdec.plugins.onnx_op import OP_TYPE, PLUGIN_NAMESPACE, PLUGIN_VERSION

PLUGIN_ID = f"{PLUGIN_NAMESPACE}::{OP_TYPE}"

_lock = threading.Lock()
_registered = False
_reason: str | None = None


def unavailable_reason() -> str | None:
    """Why the last ``register()`` returned False (None when it did not)."""
    return _reason


def register() -> bool:
    """Register the plugin with TensorRT's plugin registry (idempotent); False when ``tensorrt.plugin`` is missing.

    Must run in every process that builds *or deserialises* an engine containing the plugin:
    a Python plugin's engine stores only the plugin's name and attributes, not its code.
    """
    global _registered, _reason
    with _lock:
        if _registered:
            return True
        try:
            trt = importlib.import_module("tensorrt")
            trtp = importlib.import_module("tensorrt.plugin")
        except Exception as exc:  # ImportError, or OSError for missing TensorRT shared libraries
            _reason = f"`tensorrt.plugin` cannot be imported ({type(exc).__name__}: {exc}); TensorRT >= 10.6 needed"
            return False
        if not _creator_registered(trt):  # another copy of this module (polygraphy's script import) may have done it
            _define(trtp)
        _registered, _reason = True, None
        return True


def _creator_registered(trt: Any) -> bool:
    try:
        return trt.get_plugin_registry().get_creator(OP_TYPE, PLUGIN_VERSION, PLUGIN_NAMESPACE) is not None
    except Exception:  # registry API differences: fall back to defining (which fails loudly on a real duplicate)
        return False


def _define(trtp: Any) -> None:
    """Declare the plugin's I/O and implementation with ``tensorrt.plugin`` (annotations must be real classes)."""
    TensorDesc, Tensor = trtp.TensorDesc, trtp.Tensor

    def in_place(cache: Any) -> Any:
        return cache.aliased() if hasattr(cache, "aliased") else cache.like()

    @trtp.register(PLUGIN_ID)
    def _describe(q: TensorDesc, k: TensorDesc, v: TensorDesc, k_cache: TensorDesc, v_cache: TensorDesc,
                  cu_seqlens: TensorDesc, past_lens: TensorDesc, slot_ids: TensorDesc, tree_mask: TensorDesc,
                  scale: float, num_heads: int, num_kv_heads: int) -> tuple[TensorDesc, TensorDesc, TensorDesc]:
        # every ONNX attribute the exporter writes is declared: the parser passes declared ones as plugin fields
        return q.like(), in_place(k_cache), in_place(v_cache)

    @trtp.impl(PLUGIN_ID)
    def _enqueue(q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, cu_seqlens: Tensor,
                 past_lens: Tensor, slot_ids: Tensor, tree_mask: Tensor, scale: float,
                 outputs: tuple[Tensor, Tensor, Tensor], stream: int) -> None:
        # only `scale` is serialised into the engine: head counts come from the shapes
        with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
            args = [as_torch(t) for t in (q, k, v, k_cache, v_cache, cu_seqlens, past_lens, slot_ids, tree_mask)]
            out, k_out, v_out = (as_torch(t) for t in outputs)
            run_attention(*args, scale, out, k_out, v_out)


# --------------------------------------------------------------------------------------------- buffers

# TensorRT DataType name -> (array-interface typestr, torch dtype to view the result as, item size)
_CAI_TYPES = {
    "FLOAT": ("<f4", None, 4),
    "HALF": ("<f2", None, 2),
    "BF16": ("<i2", torch.bfloat16, 2),  # the array interface has no bfloat16: wrap as int16, view as bf16
    "INT32": ("<i4", None, 4),
    "INT64": ("<i8", None, 8),
    "INT8": ("|i1", None, 1),
    "UINT8": ("|u1", None, 1),
    "BOOL": ("|b1", None, 1),
}
_TORCH_TYPES = {"FLOAT": torch.float32, "HALF": torch.float16, "BF16": torch.bfloat16, "INT32": torch.int32,
                "INT64": torch.int64, "INT8": torch.int8, "UINT8": torch.uint8, "BOOL": torch.bool}


class _DeviceArray:
    """A minimal ``__cuda_array_interface__`` (v3) over a device pointer, for ``torch.as_tensor``."""

    def __init__(self, ptr: int, shape: tuple[int, ...], strides: tuple[int, ...], typestr: str) -> None:
        self.__cuda_array_interface__ = {
            "data": (int(ptr), False), "shape": shape, "strides": strides, "typestr": typestr,
            "version": 3, "stream": None,  # TensorRT's stream is torch's current stream already: no sync
        }


def as_torch(t: Any) -> torch.Tensor:
    """A torch CUDA tensor over a ``tensorrt.plugin.Tensor``'s buffer (no copy; same strides; bf16 too).

    ``tensorrt.plugin.Tensor`` implements ``__cuda_array_interface__`` itself, but refuses bf16;
    building the interface here from ``data_ptr``/``shape``/``strides`` covers every dtype the
    plugin sees with one code path.
    """
    name = t.dtype.name
    if name not in _CAI_TYPES:
        raise TypeError(f"{PLUGIN_ID}: unsupported tensor dtype {name}")
    typestr, view, itemsize = _CAI_TYPES[name]
    shape = tuple(int(d) for d in t.shape)
    if math.prod(shape) == 0:
        return torch.empty(shape, dtype=_TORCH_TYPES[name], device="cuda")
    strides = tuple(int(s) * itemsize for s in t.strides)
    tensor = torch.as_tensor(_DeviceArray(t.data_ptr, shape, strides, typestr), device="cuda")
    return tensor.view(view) if view is not None else tensor


# --------------------------------------------------------------------------------------------- the computation


def sanitize_indices(cu_seqlens: torch.Tensor, past_lens: torch.Tensor, slot_ids: torch.Tensor, *,
                     num_tokens: int, num_slots: int, max_len: int
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(cu_seqlens, past_lens, slot_ids, ok): the inputs unchanged when valid, an empty pack when not.

    Valid = ``cu_seqlens`` starts at 0, never decreases, ends <= T; every slot is in
    ``[0, num_slots)``; ``0 <= past_b`` and ``past_b + n_b <= max_len``. Computed on the device
    (a few tiny element-wise kernels, no host sync): ``ok`` is a 0-d bool tensor and the
    replacement is all-or-nothing, so a valid pack is never altered.
    """
    n = cu_seqlens[1:] - cu_seqlens[:-1]
    ok = ((cu_seqlens[:1] == 0).all() & (n >= 0).all() & (cu_seqlens[-1:] <= num_tokens).all()
          & ((slot_ids >= 0) & (slot_ids < num_slots)).all() & (past_lens >= 0).all()
          & (past_lens + n <= max_len).all())
    return (torch.where(ok, cu_seqlens, 0), torch.where(ok, past_lens, 0), torch.where(ok, slot_ids, 0), ok)


def run_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  cu_seqlens: torch.Tensor, past_lens: torch.Tensor, slot_ids: torch.Tensor, tree_mask: torch.Tensor,
                  scale: float, out: torch.Tensor, k_cache_out: torch.Tensor, v_cache_out: torch.Tensor) -> None:
    """The plugin's enqueue on torch tensors: caches updated in ``*_cache_out``, attention written to ``out``.

    When TensorRT aliased the cache outputs to the inputs (the normal case) they are the same
    buffers and nothing is copied; otherwise the input cache is copied to the output first.
    Index inputs that break the kernel's contract give NaN in ``out`` and leave the caches as
    they came (see ``sanitize_indices``); shapes that disagree with each other do the same.
    """
    from specdec.plugins.triton_kernel import ragged_tree_attention_triton

    for src, dst in ((k_cache, k_cache_out), (v_cache, v_cache_out)):
        if dst.data_ptr() != src.data_ptr():
            dst.copy_(src)
    num_tokens = int(q.shape[0])
    if num_tokens == 0:
        return
    if cu_seqlens.shape[0] != slot_ids.shape[0] + 1 or past_lens.shape[0] != slot_ids.shape[0]:
        out.fill_(float("nan"))
        return
    cu, past, slots, ok = sanitize_indices(cu_seqlens, past_lens, slot_ids, num_tokens=num_tokens,
                                           num_slots=int(k_cache_out.shape[0]), max_len=int(k_cache_out.shape[2]))
    result = ragged_tree_attention_triton(q, k, v, k_cache_out, v_cache_out, cu, past, slots, tree_mask, scale)
    out.copy_(torch.where(ok, result, float("nan")))


# --------------------------------------------------------------------------------------------- polygraphy


def ragged_feeds(inputs: Sequence[tuple[str, Sequence[int | str], int]], vocab_size: int, *, num_slots: int = 4,
                 max_len: int = 64, seed: int = 0) -> Iterator[dict[str, np.ndarray]]:
    """Feeds (name -> array) of random ragged steps for a specdec graph with inputs ``inputs`` (``onnx_inputs``).

    Each feed is self-contained (polygraphy does not carry caches between iterations): random
    caches stand for the committed history, and the packs mix prefill, decode, chains, forests
    and an idle slot, as ``specdec.export.validate`` does.
    """
    from onnx import helper

    from specdec.export.validate import random_packs
    from specdec.runtime.graph_io import GRAPH_INPUTS
    from specdec.runtime.packed import pack

    rng = np.random.default_rng(seed)
    caches = [(name, dims, elem) for name, dims, elem in inputs if name not in {t.name for t in GRAPH_INPUTS}]
    for work in random_packs(vocab_size, num_slots, max_len, seed=seed):
        batch = pack(work)
        feed = {spec.name: getattr(batch, spec.name).numpy().astype(spec.dtype) for spec in GRAPH_INPUTS}
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

    from specdec.export.tensorrt import onnx_inputs

    _canonical().register()
    model = os.environ.get("SPECDEC_POLYGRAPHY_MODEL")
    if not model:
        raise RuntimeError("set SPECDEC_POLYGRAPHY_MODEL to the model.onnx being compared (see polygraphy_recipe())")
    graph = onnx.load(model, load_external_data=False).graph
    logits = next(o for o in graph.output if o.name == "logits")
    vocab = int(logits.type.tensor_type.shape.dim[-1].dim_value)
    return ragged_feeds(onnx_inputs(model), vocab, num_slots=int(os.environ.get("SPECDEC_POLYGRAPHY_SLOTS", 4)),
                        max_len=int(os.environ.get("SPECDEC_POLYGRAPHY_MAX_LEN", 64)))


def postprocess(network: Any) -> None:
    """Polygraphy ``--trt-network-postprocess-script`` entry point: what ``build_engine`` does to the parsed network."""
    canonical = _canonical()
    layers = canonical.plugin_layers(network)
    canonical.cast_bool_inputs(network, layers)
    canonical.name_plugin_layers(layers)


def _canonical() -> Any:
    """This module as the package knows it (polygraphy imports this file a second time, as ``trt_plugin``)."""
    return importlib.import_module("specdec.plugins.trt_plugin")


# --------------------------------------------------------------------------------------------- network helpers


def plugin_layers(network: Any) -> list[Any]:
    """The plugin layers of a parsed ``trt.INetworkDefinition`` (the parser makes one per bound custom node)."""
    trt = importlib.import_module("tensorrt")
    kinds = {getattr(trt.LayerType, k) for k in ("PLUGIN_V3", "PLUGIN_V2", "PLUGIN") if hasattr(trt.LayerType, k)}
    return [layer for layer in (network.get_layer(i) for i in range(network.num_layers)) if layer.type in kinds]


def cast_bool_inputs(network: Any, layers: Sequence[Any]) -> int:
    """Feed ``layers`` int32 casts of their BOOL inputs (one cast per source tensor); return the casts added."""
    trt = importlib.import_module("tensorrt")
    casts: dict[str, Any] = {}
    for layer in layers:
        for i in range(layer.num_inputs):
            tensor = layer.get_input(i)
            if tensor is None or tensor.dtype != trt.bool:
                continue
            if tensor.name not in casts:
                cast = network.add_cast(tensor, trt.int32)
                cast.name = f"{OP_TYPE}.mask_as_int32:{tensor.name}"
                casts[tensor.name] = cast.get_output(0)
            layer.set_input(i, casts[tensor.name])
    return len(casts)


def name_plugin_layers(layers: Sequence[Any]) -> None:
    """Prefix the layers' names with ``RaggedTreeAttention.<i>:`` so engine inspections find them by name too."""
    for i, layer in enumerate(layers):
        if not layer.name.startswith(f"{OP_TYPE}."):
            layer.name = f"{OP_TYPE}.{i}:{layer.name}"


if __name__ == "trt_plugin":  # imported by polygraphy as a script: register before it parses the graph
    _canonical().register()

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
  supported"), so ``cast_bool_inputs`` (called by ``build_engine``, and by polygraphy through the
  export layer's ``polygraphy_glue.postprocess``) feeds the plugin an int32 copy of the mask,
  made once per step and shared by every layer; the kernel accepts any integer mask.

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

The checks that building an engine (the export layer's ``build_engine``) and loading one (the
runtime's ``TensorRTBackend``) both run live here, at the bottom layer, so that the runtime
needs nothing from the export layer above it: the environment check (``require_tensorrt``: TensorRT >=
``MIN_TENSORRT`` with ``tensorrt.plugin``, a CUDA GPU, Triton) and the guard against the silent
function-body fallback (``assert_plugin_layers`` on an engine's inspector records).

Everything touching ``tensorrt`` is imported lazily: this module imports without it, and
``register()`` answers False (``unavailable_reason()`` says why). ``tensorrt.plugin`` reads the decorated
functions' annotations as its I/O declaration and validates them as classes, which exist only once
``tensorrt.plugin`` is imported: ``_define`` sets them as data (``_declare``), not as static annotations.
"""

import importlib
import json
import math
import re
import threading
import types
from collections.abc import Callable, Sequence
from typing import Any

import torch

from specdec.plugins.onnx_op import INPUT_NAMES, OP_TYPE, PLUGIN_NAMESPACE, PLUGIN_VERSION

PLUGIN_ID = f"{PLUGIN_NAMESPACE}::{OP_TYPE}"

#: Oldest TensorRT this path supports: Python Quickly-Deployable Plugins exist since 10.6 and the ONNX
#: parser prefers a registered plugin over a model-local function of the same name since 10.7 (before,
#: the function body always won and the plugin was never used).
MIN_TENSORRT = (10, 7)

_WHAT_TO_DO = (
    "To build or run TensorRT engines use a machine with an NVIDIA GPU and driver, and either run inside an "
    "NGC container that ships TensorRT >= {min} (e.g. the PyTorch or TensorRT images) or `pip install "
    "'tensorrt>={min}'` on a machine that can reach NVIDIA's package index (the TensorRT libraries are "
    "not on PyPI proper), with a CUDA build of torch and OpenAI Triton. The ONNX export "
    "(`specdec-export --backend onnx`) needs none of this."
)

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
        if not _creator_registered(trt):  # another copy of this module (loaded from its file path) may have done it
            _define(trtp)
        _registered, _reason = True, None
        return True


def _creator_registered(trt: Any) -> bool:
    try:
        return trt.get_plugin_registry().get_creator(OP_TYPE, PLUGIN_VERSION, PLUGIN_NAMESPACE) is not None
    except Exception:  # registry API differences: fall back to defining (which fails loudly on a real duplicate)
        return False


def _declare(function: Callable[..., Any], tensor: type, returns: Any, **others: Any) -> Callable[..., Any]:
    """``function`` annotated as ``tensorrt.plugin`` reads it: each of the op's inputs (``onnx_op.INPUT_NAMES``) a
    ``tensor`` (``TensorDesc`` or ``Tensor``), then ``others``, returning ``returns``."""
    function.__annotations__ = {**dict.fromkeys(INPUT_NAMES, tensor), **others, "return": returns}
    return function


def _define(trtp: Any) -> None:
    """Declare the plugin's I/O and implementation with ``tensorrt.plugin`` (annotations must be real classes)."""
    TensorDesc, Tensor = trtp.TensorDesc, trtp.Tensor

    def in_place(cache: Any) -> Any:
        return cache.aliased() if hasattr(cache, "aliased") else cache.like()

    def _describe(  # annotated by _declare
        q, k, v, k_cache, v_cache, cu_seqlens, past_lens, slot_ids, tree_mask, scale, num_heads, num_kv_heads
    ):
        # every ONNX attribute the exporter writes is declared: the parser passes declared ones as plugin fields
        return q.like(), in_place(k_cache), in_place(v_cache)

    def _enqueue(  # annotated by _declare
        q, k, v, k_cache, v_cache, cu_seqlens, past_lens, slot_ids, tree_mask, scale, outputs, stream
    ):
        # only `scale` is serialised into the engine: head counts come from the shapes
        with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
            q_, k_, v_, kc, vc, cu, past, slots, mask = (
                as_torch(t) for t in (q, k, v, k_cache, v_cache, cu_seqlens, past_lens, slot_ids, tree_mask)
            )
            out, k_out, v_out = (as_torch(t) for t in outputs)
            run_attention(q_, k_, v_, kc, vc, cu, past, slots, mask, scale, out, k_out, v_out)

    three = types.GenericAlias(tuple, (TensorDesc, TensorDesc, TensorDesc))
    trtp.register(PLUGIN_ID)(_declare(_describe, TensorDesc, three, scale=float, num_heads=int, num_kv_heads=int))
    outputs = types.GenericAlias(tuple, (Tensor, Tensor, Tensor))
    trtp.impl(PLUGIN_ID)(_declare(_enqueue, Tensor, None, scale=float, outputs=outputs, stream=int))


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


class _DeviceArray:
    """A minimal ``__cuda_array_interface__`` (v3) over a device pointer, for ``torch.as_tensor``."""

    def __init__(self, ptr: int, shape: tuple[int, ...], strides: tuple[int, ...], typestr: str) -> None:
        self.__cuda_array_interface__ = {
            "data": (int(ptr), False),
            "shape": shape,
            "strides": strides,
            "typestr": typestr,
            "version": 3,
            "stream": None,  # TensorRT's stream is torch's current stream already: no sync
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


def sanitize_indices(
    cu_seqlens: torch.Tensor,
    past_lens: torch.Tensor,
    slot_ids: torch.Tensor,
    *,
    num_tokens: int,
    num_slots: int,
    max_len: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(cu_seqlens, past_lens, slot_ids, ok): the inputs unchanged when valid, an empty pack when not.

    Valid = ``cu_seqlens`` starts at 0, never decreases, ends <= T; every slot is in
    ``[0, num_slots)``; ``0 <= past_b`` and ``past_b + n_b <= max_len``. Computed on the device
    (a few tiny element-wise kernels, no host sync): ``ok`` is a 0-d bool tensor and the
    replacement is all-or-nothing, so a valid pack is never altered.
    """
    n = cu_seqlens[1:] - cu_seqlens[:-1]
    ok = (
        (cu_seqlens[:1] == 0).all()
        & (n >= 0).all()
        & (cu_seqlens[-1:] <= num_tokens).all()
        & ((slot_ids >= 0) & (slot_ids < num_slots)).all()
        & (past_lens >= 0).all()
        & (past_lens + n <= max_len).all()
    )
    return (torch.where(ok, cu_seqlens, 0), torch.where(ok, past_lens, 0), torch.where(ok, slot_ids, 0), ok)


def run_attention(
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
    out: torch.Tensor,
    k_cache_out: torch.Tensor,
    v_cache_out: torch.Tensor,
) -> None:
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
    cu, past, slots, ok = sanitize_indices(
        cu_seqlens,
        past_lens,
        slot_ids,
        num_tokens=num_tokens,
        num_slots=int(k_cache_out.shape[0]),
        max_len=int(k_cache_out.shape[2]),
    )
    result = ragged_tree_attention_triton(q, k, v, k_cache_out, v_cache_out, cu, past, slots, tree_mask, scale)
    out.copy_(torch.where(ok, result, float("nan")))


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


# --------------------------------------------------------------------------------------------- environment


class TensorRTUnavailableError(RuntimeError, ValueError):
    """TensorRT cannot be used here; the message says why and what to do.

    It is also a ``ValueError`` so that ``specdec-export`` reports it like any other bad
    request (exit status 2, one line on stderr) instead of a traceback.
    """


class EngineBuildError(RuntimeError):
    """The ONNX graph could not be turned into a usable engine (parse, build or plugin check failed)."""


class PluginFallbackError(EngineBuildError):
    """The parser or the engine uses the RaggedTreeAttention function body instead of the plugin."""


def _parse_version(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", text)[:3])


def tensorrt_problems() -> list[str]:
    """Every reason TensorRT cannot be used here (empty when it can); no exception, no side effect but imports."""
    problems: list[str] = []
    minimum = ".".join(map(str, MIN_TENSORRT))
    try:
        trt = importlib.import_module("tensorrt")
    except Exception as exc:  # ImportError, or OSError when the wheel's shared libraries are missing
        problems.append(f"the `tensorrt` Python module cannot be imported ({type(exc).__name__}: {exc})")
    else:
        version = str(getattr(trt, "__version__", "0"))
        if _parse_version(version) < MIN_TENSORRT:
            problems.append(
                f"TensorRT {version} is too old: specdec needs >= {minimum} (Python plugins, and "
                "plugins taking precedence over the ONNX function body)"
            )
        else:
            try:
                importlib.import_module("tensorrt.plugin")
            except Exception as exc:
                problems.append(f"TensorRT {version} has no usable `tensorrt.plugin` module ({exc})")
    try:
        if not torch.cuda.is_available():
            build = "a CPU-only build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
            problems.append(
                f"no CUDA GPU is visible (torch {torch.__version__}, {build}): a TensorRT builder "
                "and the plugin's kernel need an NVIDIA GPU and driver"
            )
    except Exception as exc:  # a broken torch install
        problems.append(f"torch cannot query CUDA ({exc})")
    from specdec.plugins.triton_kernel import triton_available

    if not triton_available():
        problems.append("OpenAI Triton cannot be imported: the plugin runs the Triton kernel")
    return problems


def require_tensorrt() -> None:
    """Raise ``TensorRTUnavailableError`` unless TensorRT (>= 10.7), a CUDA GPU and Triton are usable here.

    Called before anything is written, so an export that cannot build an engine fails at once
    with every reason listed, rather than after minutes of ONNX export and validation; and
    before an engine is loaded, so a machine without a GPU gets the same explanation.
    """
    problems = tensorrt_problems()
    if problems:
        reasons = "; ".join(f"({i}) {p}" for i, p in enumerate(problems, 1))
        raise TensorRTUnavailableError(
            f"TensorRT is not usable here: {reasons}. " + _WHAT_TO_DO.format(min=".".join(map(str, MIN_TENSORRT)))
        )


# --------------------------------------------------------------------------------------------- engine checks


def count_plugin_layers(engine_information: str) -> int:
    """Number of RaggedTreeAttention *plugin* layers in an engine inspector JSON (``LayerInformationFormat.JSON``).

    A layer counts when its type is a plugin type (``PluginV3``, ``PluginV2``...) and its record
    names the op (the engine keeps the layer names ``name_plugin_layers`` gives them, and TensorRT's
    detailed record of a plugin layer names the plugin). Layers imported from the function body
    are ordinary layers (Scatter, Gather, MatrixMultiply, Myelin regions...), so they never
    count. The engine must have been built with ``ProfilingVerbosity.DETAILED``: with names only
    the types are unknown and a ``PluginFallbackError`` says so.
    """
    try:
        info = json.loads(engine_information)
    except json.JSONDecodeError as exc:
        raise PluginFallbackError(f"the engine inspector returned no JSON ({exc})") from exc
    layers = info.get("Layers", []) if isinstance(info, dict) else []
    if layers and all(isinstance(layer, str) for layer in layers):
        raise PluginFallbackError(
            "the engine records layer names only (built without ProfilingVerbosity.DETAILED):"
            " its plugin layers cannot be told apart; rebuild with build_engine()"
        )
    needles = (OP_TYPE.lower(), "ragged_tree_attention")
    count = 0
    for layer in layers:
        if not isinstance(layer, dict):
            continue
        kind = f"{layer.get('LayerType', '')} {layer.get('ParameterType', '')}".lower()
        if "plugin" in kind and any(n in json.dumps(layer).lower() for n in needles):
            count += 1
    return count


def assert_plugin_layers(engine: Any, expected: int) -> int:
    """Check ``engine`` runs ``expected`` RaggedTreeAttention plugin layers; return the count.

    The guard against TensorRT's silent fallback: without the plugin registered (or with a
    TensorRT older than 10.7) the parser imports the function body, and the engine still builds
    and runs, just slowly and padded. Uses the engine inspector (kDETAILED verbosity).
    """
    trt = importlib.import_module("tensorrt")
    inspector = engine.create_engine_inspector()
    count = count_plugin_layers(inspector.get_engine_information(trt.LayerInformationFormat.JSON))
    if count != expected:
        raise PluginFallbackError(
            f"the engine has {count} {OP_TYPE} plugin layers, expected {expected} (one per attention layer): "
            f"TensorRT used the standard-op function body instead of the plugin. Register the plugin before "
            f"building/loading (specdec.plugins.trt_plugin.register()), use TensorRT >= "
            f"{'.'.join(map(str, MIN_TENSORRT))}, and check with `polygraphy inspect model model.engine --show layers`."
        )
    return count

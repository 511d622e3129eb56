"""Build a TensorRT engine from an exported ragged-step graph, with the attention bound to the plugin.

The ONNX file written by :mod:`specdec.export.onnx` carries one ``specdec::RaggedTreeAttention``
node per layer (attributes ``plugin_namespace="specdec"``, ``plugin_version="1"``) plus a
standard-op function body. TensorRT's ONNX parser (>= 10.7) binds such a node to a registered
plugin of the same name, namespace and version; when the plugin is *not* registered it silently
imports the function body instead, which builds and runs but is the slow padded path. So a build
here (1) registers the plugin (:mod:`specdec.plugins.trt_plugin`, a Python Quickly-Deployable
Plugin running the OpenAI Triton kernel), (2) parses with ``ENABLE_PLUGIN_OVERRIDE`` where the
parser has that flag, (3) checks the parsed network has one plugin layer per attention node,
(4) builds with one explicit optimization profile covering every dynamic dimension of the ragged
step (``ProfileSpec``), and (5) checks the *serialized* engine again with the engine inspector
(``assert_plugin_layers``), because that is what a later load will run.

The environment check (``require_tensorrt``), the engine check (``assert_plugin_layers``) and
their errors are defined in :mod:`specdec.plugins.trt_plugin`, because the runtime backend runs
them too when it loads an engine; they are re-exported here, where a build needs them.

Nothing here imports ``tensorrt`` at module import time: this module must import (and its
errors must be explainable) on machines without TensorRT or a GPU.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import shlex
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specdec.plugins import trt_plugin
from specdec.plugins.onnx_op import DOMAIN, OP_TYPE, PLUGIN_NAMESPACE, PLUGIN_VERSION
from specdec.plugins.trt_plugin import (
    MIN_TENSORRT,
    EngineBuildError,
    PluginFallbackError,
    TensorRTUnavailableError,
    assert_plugin_layers,
    count_plugin_layers,
    require_tensorrt,
    tensorrt_problems,
)
from specdec.runtime.graph_io import CACHE_INPUT

#: the polygraphy script (data loader + network postprocess): referred to by path, not imported, because it
#: imports this module; it sits in a directory of its own since polygraphy puts the script's directory first
#: on sys.path while importing it, and this directory's onnx.py / tensorrt.py would shadow the real packages
POLYGRAPHY_SCRIPT = Path(__file__).resolve().parent / "scripts" / "polygraphy_glue.py"

DTYPES = ("float32", "float16", "bfloat16")


def _import_tensorrt() -> Any:
    require_tensorrt()
    return importlib.import_module("tensorrt")


# --------------------------------------------------------------------------------------------- profiles


@dataclass(frozen=True)
class DimRange:
    """min / opt / max of one dynamic dimension in an optimization profile."""

    min: int
    opt: int
    max: int

    def __post_init__(self) -> None:
        if not (0 <= self.min <= self.opt <= self.max) or self.max < 1:
            raise ValueError(
                f"a dimension range needs 0 <= min <= opt <= max and max >= 1, got {self.min}/{self.opt}/{self.max}"
            )

    def shifted(self, k: int) -> DimRange:
        """The range of ``dim + k`` (``cu_seqlens`` has B + 1 entries)."""
        return DimRange(max(self.min + k, 0), max(self.opt + k, 0), self.max + k)


# symbolic dimension names as the exporter (and onnx_op.attention_model) write them -> ProfileSpec field
_DIM_ALIASES = {
    "tokens": "tokens",
    "T": "tokens",
    "seqs": "seqs",
    "B": "seqs",
    "max_new": "max_new",
    "S_max": "max_new",
    "rows": "rows",
    "R": "rows",
    "slots": "slots",
    "max_len": "max_len",
}
_SHIFTED_DIM = re.compile(r"^\s*([A-Za-z_]\w*)\s*(?:([+-])\s*(\d+)|_plus_(\d+))\s*$")


@dataclass(frozen=True)
class ProfileSpec:
    """The one optimization profile of a ragged-step engine: a range per dynamic dimension.

    ``tokens`` = T (packed new tokens), ``seqs`` = B (sequences in the pack), ``max_new`` =
    S_max (tree-mask width), ``rows`` = R (logit rows), ``slots`` and ``max_len`` = the KV-cache
    shape. TensorRT sizes its activation memory for the ``max`` values and tunes kernels for the
    ``opt`` values; a step outside the ranges is refused at run time with a clear error.
    """

    tokens: DimRange
    seqs: DimRange
    max_new: DimRange
    rows: DimRange
    slots: DimRange
    max_len: DimRange

    @classmethod
    def derive(
        cls,
        max_batch: int = 16,
        max_len: int = 2048,
        *,
        max_tokens: int | None = None,
        opt_new: int = 8,
        max_slots: int | None = None,
    ) -> ProfileSpec:
        """The profile a ``max_batch`` x ``max_len`` deployment needs.

        The worst step is a prefill of ``max_batch`` prompts of ``max_len`` tokens in one pack
        (the loops prefill every admitted prompt together), so ``max_tokens`` defaults to
        ``max_batch * max_len``; pass a smaller budget to cap activation memory (the logits of
        R rows alone take R x vocab x 4 bytes). ``opt`` is tuned for decode/verify steps:
        ``max_batch`` sequences with ``opt_new`` new tokens each. ``max_slots`` (default
        ``max_batch``) is the KV-cache slot count the backend may allocate.
        """
        for name, value in (("max_batch", max_batch), ("max_len", max_len), ("opt_new", opt_new)):
            if int(value) < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        max_tokens = max_batch * max_len if max_tokens is None else max_tokens
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        slots = max_batch if max_slots is None else max_slots
        if slots < 1:
            raise ValueError(f"max_slots must be >= 1, got {max_slots}")
        opt_new = min(opt_new, max_len, max_tokens)
        opt_tokens = min(max_batch * opt_new, max_tokens)
        return cls(
            tokens=DimRange(1, opt_tokens, max_tokens),
            seqs=DimRange(1, min(max_batch, max_tokens), min(max_batch, max_tokens)),
            max_new=DimRange(1, opt_new, min(max_len, max_tokens)),
            rows=DimRange(1, opt_tokens, max_tokens),
            slots=DimRange(1, slots, slots),
            max_len=DimRange(1, max_len, max_len),
        )

    def range_of(self, dim: str) -> DimRange:
        """The range of a symbolic ONNX dimension (``"tokens"``, ``"seqs + 1"``, ``"B_plus_1"``, ...)."""
        shift = 0
        name = dim.strip()
        match = _SHIFTED_DIM.match(name)
        if match:
            name, sign, amount, plus = match.groups()
            shift = int(plus) if plus is not None else int(amount) * (1 if sign == "+" else -1)
        field = _DIM_ALIASES.get(name)
        if field is None:
            raise ValueError(
                f"no profile range for the symbolic dimension {dim!r}: known are "
                f"{', '.join(sorted(set(_DIM_ALIASES)))} (optionally '+ k')"
            )
        return getattr(self, field).shifted(shift)

    def shapes_for(
        self, inputs: Iterable[tuple[str, Sequence[int | str]]]
    ) -> dict[str, tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]:
        """(min, opt, max) shapes per input; ``inputs`` are (name, dims) with ints or symbolic names."""
        shapes = {}
        for name, dims in inputs:
            lo, mid, hi = [], [], []
            for d in dims:
                if isinstance(d, int) and d >= 0:
                    lo.append(d)
                    mid.append(d)
                    hi.append(d)
                else:
                    r = self.range_of(str(d))
                    lo.append(r.min)
                    mid.append(r.opt)
                    hi.append(r.max)
            shapes[name] = (tuple(lo), tuple(mid), tuple(hi))
        return shapes


def onnx_inputs(onnx_path: str | os.PathLike) -> list[tuple[str, list[int | str], int]]:
    """(name, dims, onnx elem type) of the graph's real inputs; symbolic dims as their names, weights skipped."""
    import onnx

    graph = onnx.load(str(onnx_path), load_external_data=False).graph
    weights = {init.name for init in graph.initializer}
    found = []
    for value in graph.input:
        if value.name in weights:
            continue
        tensor = value.type.tensor_type
        dims: list[int | str] = [
            d.dim_param if d.dim_param else (int(d.dim_value) if d.HasField("dim_value") else "?")
            for d in tensor.shape.dim
        ]
        found.append((value.name, dims, int(tensor.elem_type)))
    return found


def _graph_dtype(inputs: Sequence[tuple[str, list[int | str], int]]) -> str:
    """The floating dtype of the graph's caches (the precision the ONNX was exported in)."""
    from onnx import TensorProto

    names: dict[int, str] = {
        TensorProto.FLOAT: "float32",
        TensorProto.FLOAT16: "float16",
        TensorProto.BFLOAT16: "bfloat16",
    }
    cache = CACHE_INPUT.format(layer=0, kind="key")
    for name, _, elem in inputs:
        if name == cache:
            return names.get(elem, f"onnx type {elem}")
    raise EngineBuildError(f"the graph has no input {cache!r}: not a specdec ragged-step graph")


# --------------------------------------------------------------------------------------------- plugin checks


def attention_nodes(onnx_path: str | os.PathLike) -> tuple[int, list[str]]:
    """(number of RaggedTreeAttention nodes, those whose plugin keys will not match the plugin).

    The parser binds a node to the plugin by op type + ``plugin_namespace`` + ``plugin_version``
    (default "1"); a node with other keys is imported from its function body, silently.
    """
    import onnx

    graph = onnx.load(str(onnx_path), load_external_data=False).graph
    total, unbound = 0, []
    for node in graph.node:
        if node.op_type != OP_TYPE or node.domain != DOMAIN:
            continue
        total += 1
        keys = {a.name: a.s.decode() for a in node.attribute if a.type == onnx.AttributeProto.STRING}
        namespace, version = keys.get("plugin_namespace"), keys.get("plugin_version", "1")
        if namespace != PLUGIN_NAMESPACE or version != PLUGIN_VERSION:
            name = node.name or node.output[0]
            unbound.append(f"{name} (plugin_namespace={namespace!r}, plugin_version={version!r})")
    return total, unbound


# --------------------------------------------------------------------------------------------- build


def _make_logger(trt: Any) -> Any:
    """A TensorRT logger that keeps error messages (for exception texts) and prints warnings and worse."""

    class _Logger(trt.ILogger):
        def __init__(self) -> None:
            trt.ILogger.__init__(self)
            self.errors: list[str] = []

        def log(self, severity: Any, msg: str) -> None:
            if severity in (trt.ILogger.Severity.ERROR, trt.ILogger.Severity.INTERNAL_ERROR):
                self.errors.append(msg)
            if severity in (
                trt.ILogger.Severity.ERROR,
                trt.ILogger.Severity.INTERNAL_ERROR,
                trt.ILogger.Severity.WARNING,
            ):
                print(f"[TensorRT] {msg}", flush=True)

    return _Logger()


def _precision(trt: Any, requested: str | None, graph_dtype: str) -> tuple[bool, Any | None]:
    """(strongly typed?, builder flag to set) for building a ``graph_dtype`` graph at ``requested`` precision."""
    requested = requested or graph_dtype
    if requested not in DTYPES:
        raise ValueError(f"unsupported engine dtype {requested!r}: choose one of {', '.join(DTYPES)}")
    if requested == graph_dtype:
        return True, None  # the precision is in the graph: strong typing keeps it exactly (and TRT 11 only has this)
    flag_name = {"float16": "FP16", "bfloat16": "BF16"}.get(requested)
    if graph_dtype != "float32" or flag_name is None:
        raise EngineBuildError(
            f"cannot build a {requested} engine from a {graph_dtype} graph: export the ONNX in "
            f"{requested} (specdec-export --dtype {requested})"
        )
    if not hasattr(trt.BuilderFlag, flag_name):
        raise EngineBuildError(
            f"TensorRT {trt.__version__} only builds strongly typed networks (no "
            f"BuilderFlag.{flag_name}): export the ONNX in {requested} "
            f"(specdec-export --dtype {requested}) instead of asking for a lower-precision build"
        )
    return False, getattr(trt.BuilderFlag, flag_name)


def _check_graph(onnx_path: Path) -> int:
    """The number of attention nodes, after refusing graphs whose nodes could not bind to the plugin."""
    if not onnx_path.is_file():
        raise EngineBuildError(f"{onnx_path} does not exist")
    expected, unbound = attention_nodes(onnx_path)
    if expected == 0:
        raise EngineBuildError(f"{onnx_path} has no {DOMAIN}::{OP_TYPE} node: not a specdec graph, or it was inlined")
    if unbound:
        raise PluginFallbackError(
            f"{len(unbound)} of the {expected} {OP_TYPE} nodes of {onnx_path} do not name the "
            f"plugin '{PLUGIN_NAMESPACE}' version {PLUGIN_VERSION}, so TensorRT would import "
            f"their function body: {', '.join(unbound[:3])}"
        )
    return expected


def _parse(trt: Any, network: Any, logger: Any, onnx_path: Path, expected: int) -> None:
    """Parse ``onnx_path`` into ``network``, check every attention node became a plugin layer, prepare those."""
    parser = trt.OnnxParser(network, logger)
    if hasattr(trt, "OnnxParserFlag") and hasattr(trt.OnnxParserFlag, "ENABLE_PLUGIN_OVERRIDE"):
        parser.set_flag(trt.OnnxParserFlag.ENABLE_PLUGIN_OVERRIDE)
    if not parser.parse_from_file(str(onnx_path)):
        errors = [str(parser.get_error(i)) for i in range(parser.num_errors)] or logger.errors
        raise EngineBuildError(f"TensorRT's ONNX parser rejected {onnx_path}: " + " | ".join(errors))
    plugin_layers = trt_plugin.plugin_layers(network)
    if len(plugin_layers) != expected:
        raise PluginFallbackError(
            f"the ONNX parser made {len(plugin_layers)} plugin layers for the {expected} {OP_TYPE} nodes of "
            f"{onnx_path}: it imported the function body instead of the plugin '{PLUGIN_NAMESPACE}::{OP_TYPE}' "
            f"version {PLUGIN_VERSION} (TensorRT {trt.__version__}; was the plugin registered in this process?)"
        )
    trt_plugin.cast_bool_inputs(network, plugin_layers)  # BOOL plugin I/O is not guaranteed by TensorRT
    trt_plugin.name_plugin_layers(plugin_layers)  # stable names the engine inspector check can rely on


def _configure(trt: Any, builder: Any, network: Any, shapes: Mapping[str, tuple], precision_flag: Any) -> Any:
    """Builder config: detailed layer records, aliased plugin I/O, precision flag, the one optimization profile."""
    config = builder.create_builder_config()
    config.profiling_verbosity = trt.ProfilingVerbosity.DETAILED
    preview = getattr(getattr(trt, "PreviewFeature", None), "ALIASED_PLUGIN_IO_10_03", None)
    if preview is not None:  # lets the plugin's cache outputs alias its cache inputs (in-place KV write)
        config.set_preview_feature(preview, True)
    if precision_flag is not None:
        config.set_flag(precision_flag)
    trt_profile = builder.create_optimization_profile()
    for i in range(network.num_inputs):
        tensor = network.get_input(i)
        if tensor.is_shape_tensor:
            raise EngineBuildError(f"input {tensor.name!r} became a shape tensor: the graph is not the plugin graph")
        if tensor.name not in shapes:
            raise EngineBuildError(f"TensorRT sees an input {tensor.name!r} the ONNX file does not declare")
        trt_profile.set_shape(tensor.name, *shapes[tensor.name])
    config.add_optimization_profile(trt_profile)
    return config


def build_engine(
    onnx_path: str | os.PathLike,
    engine_path: str | os.PathLike,
    dtype: str | None = None,
    *,
    profile: ProfileSpec | None = None,
) -> Path:
    """Build ``engine_path`` from the exported ``onnx_path`` with the attention running as the plugin.

    ``dtype`` is the engine precision: ``None`` (or the graph's own dtype) builds a strongly typed
    network, keeping exactly the precision the ONNX was exported in; ``"float16"``/``"bfloat16"``
    on a float32 graph sets the builder's precision flag (TensorRT 10.x only; 11 removed weak
    typing). ``profile`` defaults to ``ProfileSpec.derive()`` (16 sequences x 2048 tokens).
    Raises ``TensorRTUnavailableError``, ``EngineBuildError`` or ``PluginFallbackError``; on
    failure nothing is left at ``engine_path``.
    """
    trt = _import_tensorrt()
    onnx_path, engine_path = Path(onnx_path), Path(engine_path)
    expected = _check_graph(onnx_path)
    if not trt_plugin.register():
        raise EngineBuildError(
            f"the {OP_TYPE} TensorRT plugin could not be registered: {trt_plugin.unavailable_reason()}"
        )
    profile = profile or ProfileSpec.derive()
    inputs = onnx_inputs(onnx_path)
    strongly_typed, precision_flag = _precision(trt, dtype, _graph_dtype(inputs))

    logger = _make_logger(trt)
    builder = trt.Builder(logger)
    network = builder.create_network(
        1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED) if strongly_typed else 0
    )
    _parse(trt, network, logger, onnx_path, expected)
    config = _configure(trt, builder, network, profile.shapes_for((n, d) for n, d, _ in inputs), precision_flag)
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise EngineBuildError(f"TensorRT failed to build {onnx_path}: " + (" | ".join(logger.errors) or "no details"))
    runtime = trt.Runtime(logger)  # kept alive while the engine is inspected
    engine = runtime.deserialize_cuda_engine(serialized)
    if engine is None:
        raise EngineBuildError("the freshly built engine does not deserialise: " + " | ".join(logger.errors))
    assert_plugin_layers(engine, expected=expected)

    engine_path.parent.mkdir(parents=True, exist_ok=True)
    partial = engine_path.with_name(engine_path.name + ".partial")
    try:
        with partial.open("wb") as f:
            f.write(serialized)
        partial.replace(engine_path)
    finally:
        partial.unlink(missing_ok=True)
    return engine_path


# --------------------------------------------------------------------------------------------- polygraphy


def _shape_arg(shapes: Mapping[str, tuple[tuple[int, ...], ...]], which: int) -> str:
    # quoted: an unquoted `name:[1]` is a shell glob (it would expand if a file of that name existed)
    return " ".join(shlex.quote(f"{name}:[{','.join(map(str, dims[which]))}]") for name, dims in shapes.items())


def polygraphy_recipe(
    onnx_path: str | os.PathLike,
    *,
    profile: ProfileSpec | None = None,
    atol: float = 1e-3,
    rtol: float = 1e-3,
    plugin_library: str | os.PathLike | None = None,
    slots: int = 4,
    max_len: int = 64,
) -> str:
    """The ``polygraphy run`` command comparing ONNX Runtime (function body) with TensorRT (plugin).

    Both runners get the same ragged packs from ``POLYGRAPHY_SCRIPT``'s ``load_data``
    (:mod:`specdec.export.scripts.polygraphy_glue`; random index inputs would crash any ragged
    kernel), chosen through environment variables on the command line; importing that script
    also registers the Python plugin before TensorRT parses the graph, so ``--plugins`` is only
    needed for a compiled plugin library (``plugin_library``). Its ``postprocess`` applies
    ``build_engine``'s network edits (int32 mask for the plugin, layer names). ``--strongly-typed``
    keeps the graph's precision; loosen ``atol``/``rtol`` for float16 graphs (the export validates
    those at 0.25 on logits).
    """
    profile = profile or ProfileSpec.derive()
    onnx_path = Path(onnx_path)
    inputs = onnx_inputs(onnx_path)
    shapes = profile.shapes_for((name, dims) for name, dims, _ in inputs)
    slots = max(profile.slots.min, min(slots, profile.slots.max))
    max_len = max(profile.max_len.min, min(max_len, profile.max_len.max))
    script = shlex.quote(str(POLYGRAPHY_SCRIPT))
    env = (
        f"SPECDEC_POLYGRAPHY_MODEL={shlex.quote(str(onnx_path))} SPECDEC_POLYGRAPHY_SLOTS={slots} "
        f"SPECDEC_POLYGRAPHY_MAX_LEN={max_len}"
    )
    parts = [
        f"{env} polygraphy run {shlex.quote(str(onnx_path))}",
        "--onnxrt --trt",
        f"--data-loader-script {script}:load_data",
        f"--trt-network-postprocess-script {script}:postprocess",
        "--onnx-flags enable_plugin_override",
        "--preview-features aliased_plugin_io_10_03",
        "--strongly-typed",
        f"--trt-min-shapes {_shape_arg(shapes, 0)}",
        f"--trt-opt-shapes {_shape_arg(shapes, 1)}",
        f"--trt-max-shapes {_shape_arg(shapes, 2)}",
        f"--atol {atol:g} --rtol {rtol:g}",
    ]
    if plugin_library is not None:
        parts.insert(2, f"--plugins {shlex.quote(str(plugin_library))}")
    return " \\\n    ".join(parts)


def polygraphy_inspect_recipe(engine_path: str | os.PathLike) -> str:
    """The ``polygraphy inspect model ENGINE --show layers`` command, run with the Python plugin registered.

    An engine holding a Python plugin deserialises only in a process where the plugin is
    registered, and ``--plugins`` loads shared libraries only; so polygraphy's entry point is
    started from Python after ``register()``. Plugin layers show as ``RaggedTreeAttention.<i>:...``
    with a plugin layer type; a function-body engine shows Scatter/Gather/MatrixMultiply layers
    (or Myelin regions) instead.
    """
    argv = ["polygraphy", "inspect", "model", str(Path(engine_path)), "--show", "layers"]
    code = (
        "import sys; from specdec.plugins import trt_plugin; assert trt_plugin.register(), "
        "trt_plugin.unavailable_reason(); from polygraphy.tools import main; "
        f"sys.argv = {json.dumps(argv)}; sys.exit(main())"
    )  # double quotes: one clean shell quoting
    return f"python -c {shlex.quote(code)}"


__all__: Sequence[str] = (
    "MIN_TENSORRT",
    "POLYGRAPHY_SCRIPT",
    "DimRange",
    "EngineBuildError",
    "PluginFallbackError",
    "ProfileSpec",
    "TensorRTUnavailableError",
    "assert_plugin_layers",
    "attention_nodes",
    "build_engine",
    "count_plugin_layers",
    "polygraphy_inspect_recipe",
    "polygraphy_recipe",
    "require_tensorrt",
    "tensorrt_problems",
)

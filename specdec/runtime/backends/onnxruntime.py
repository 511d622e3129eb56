"""ONNX Runtime backend: runs an exported ragged-step graph with the caches bound in place.

On the CPU the caches are numpy arrays in host memory (``HostKVStorage``: the KV manager's moves
and forks work on them directly, and the process needs no torch); each step binds every
``past_key_values.*`` input and its ``present.*`` output to the same buffer through IOBinding, so
the graph's attention writes the new K/V rows into the cache itself and no full-cache copy happens
per step. The binding is made once per cache and kept (each step rebinds only the packed inputs
and the logits); ``inplace_ok`` records whether ORT really wrote through the bound buffers
(checked by pointer on each binding's first step).

On the CUDA execution provider (``onnxruntime-gpu``, the ``gpu`` extra) the caches are torch CUDA
tensors on the session's device and are bound there (device pointers), so a step moves only its
small packed inputs host to device and the logits rows back: no cache crosses PCIe. There the
caches are torch tensors (imported only then) because the KV manager's compaction and forks run on
them in place on the device.

The session runs the graph as ``ort_fuse`` lowers it for ONNX Runtime (GroupQueryAttention,
fused RMSNorm and RoPE; the file itself is unchanged). A step that GroupQueryAttention's padded
layout cannot hold is split into sub-steps by sequence (``ort_fuse.gqa_groups``), which is the
same computation: only attention mixes rows, and only within a sequence.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from specdec.models.export_meta import HEAD_TOKEN_IDS_FILE, ModelResolutionError, read_head_token_ids
from specdec.runtime.backends import ort_cache_dtype, ort_fuse
from specdec.runtime.backends.host_cache import HostKVStorage
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

if TYPE_CHECKING:
    import onnx
    import onnxruntime

    from specdec.runtime.backends.torch_backend import TorchKVStorage

_NP_DTYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16}
_log = logging.getLogger(__name__)
#: the widest MatMulNBits block whose rows MLAS's int8-activation kernel multiplies alike however many rows share the
#: call (ONNX Runtime 1.32, x86 AVX-512 VNNI: ``benchmarks/results/block_sizes.md``); for wider blocks it multiplies
#: rows in pairs and an odd last row alone, so the backend runs every step on an even row count (``even_rows``)
ROW_INVARIANT_BLOCK = 32
FUSE_ENV = "SPECDEC_ORT_FUSE"  # "0": run the exported graph as it is; "a,b": only these ort_fuse rewrites


class OnnxModelError(RuntimeError):
    """An ONNX file is missing, corrupt, or not a specdec ragged-step graph."""


def graph_head(graph: Path, head_size: int) -> tuple[np.ndarray | None, int]:
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
        raise OnnxModelError(
            f"{graph} has a restricted LM head ({HEAD_TOKEN_IDS_FILE}) but no readable vocab_size in {config}: {exc}"
        ) from exc
    try:
        ids = read_head_token_ids(directory, vocab_size)
    except ModelResolutionError as exc:
        raise OnnxModelError(str(exc)) from exc
    if ids is None or len(ids) != head_size:
        raise OnnxModelError(
            f"{graph}: {HEAD_TOKEN_IDS_FILE} lists {0 if ids is None else len(ids)} token ids "
            f"but the graph's logits have {head_size} columns"
        )
    return ids, vocab_size


def _external_data_folder(proto: Any, graph: Path) -> Path:
    """The folder ORT reads the graph's external data from when the graph is handed over as bytes.

    ORT refuses an external file whose real path lies outside that folder, so a deployment whose
    data file is a symlink (a copy of an export made of links, a mounted volume) would not load from
    the graph's own folder: use the folder the links resolve to, when every external file is found
    there under its own name, and the graph's folder otherwise.
    """
    locations = {
        entry.value for init in proto.graph.initializer for entry in init.external_data if entry.key == "location"
    }
    here = graph.parent.resolve()
    real = {(graph.parent / loc).resolve() for loc in locations}
    folders = {r.parent for r in real}
    if len(folders) == 1 and all(
        (next(iter(folders)) / Path(loc).name).resolve() == (graph.parent / loc).resolve() for loc in locations
    ):
        return next(iter(folders))
    return here


class OrtBackend:
    """A ``Backend`` over an ONNX Runtime session of a ``specdec-export`` graph."""

    #: the graph has no cache_mask input (``graph_io``): a step with KV holes is refused
    supports_cache_mask = False

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        providers: Sequence[Any] | None = None,
        intra_op_threads: int | None = None,
        name: str | None = None,
        spin: bool = True,
        fuse: bool | Sequence[str] | None = None,
        profile_prefix: str | None = None,
        device_id: int = 0,
        cache_dtype: str | None = None,
        row_floor: bool = True,
    ) -> None:
        """``spin``: let the session's idle worker threads spin-wait for the next run (ORT's default).

        Why a draft opens without: its workers spin on after each short draft step and hold the
        cores the target's next step needs, while the target's own steps run back to back and gain
        from spinning (measured: ``benchmarks/results/ort_contention.md``).

        ``fuse``: the ``ort_fuse`` rewrites to apply (True: all, False: none, or their names);
        None reads ``$SPECDEC_ORT_FUSE`` and defaults to all. Off is for comparison and debugging.
        ``profile_prefix`` turns on ORT's per-node profiler (``end_profiling`` writes the JSON).
        ``device_id``: the GPU the CUDA execution provider runs on (a Triton instance's
        ``model_instance_device_id``); ignored on the CPU. ``cache_dtype``: store the KV caches as
        this type ("float16": half the memory of an fp32 graph's, ``ort_cache_dtype``); None keeps
        the graph's own.

        ``row_floor``: where the graph's int8-activation MatMulNBits blocks are wider than ``ROW_INVARIANT_BLOCK``,
        MLAS multiplies rows in pairs and the odd last row of a step with another kernel (its sums round
        differently), so a row's bits would depend on how many rows share its step. Such a graph then runs every
        step on an even row count (``even_rows``): an odd step gets one more row, its last token again, one
        position on (``evened``); that row's logits are not asked for and its K/V land one position past its
        sequence, where the next token overwrites them, as a rejected draft's do. Every row is then multiplied
        in a pair and the graph stays batch-invariant (greedy ``ems`` = ``ar``). A draft model opens without: its
        proposals are verified, never compared.
        """
        import onnxruntime as ort

        self.path = Path(path)
        self.name = name or self.path.stem
        if not self.path.is_file():
            raise OnnxModelError(f"{self.path} does not exist")
        if cache_dtype is not None and cache_dtype not in ort_cache_dtype.CACHE_DTYPES:
            raise ValueError(f"cache_dtype {cache_dtype!r}: choose one of {sorted(ort_cache_dtype.CACHE_DTYPES)}")
        self._providers = providers or default_providers(ort.get_available_providers(), device_id)
        rewrites = _rewrites(fuse, self._providers)
        if cache_dtype is not None and ("attention" not in rewrites or not ort_fuse.gqa_supported()):
            # unfused, every step would cast the whole caches both ways (ort_cache_dtype): keep the graph's type
            _log.warning(
                "%s: attention is not fused here, so the KV caches keep the graph's type instead of %s",
                self.name,
                cache_dtype,
            )
            cache_dtype = None
        self._options: dict[str, Any] = dict(
            intra_op_threads=intra_op_threads, spin=spin, profile_prefix=profile_prefix, cache_dtype=cache_dtype
        )
        self.fuse_report: ort_fuse.FuseReport | None = None
        self.session = self._open(rewrites)
        self.even_rows = row_floor and _rows_in_pairs(self.path)
        self._unfused = None  # opened on the first step the fused graph cannot run (see step)
        inputs = {i.name: i for i in self.session.get_inputs()}
        outputs = {o.name: o for o in self.session.get_outputs()}
        missing = [t.name for t in GRAPH_INPUTS if t.name not in inputs] + [n for n in (LOGITS,) if n not in outputs]
        if missing:
            raise OnnxModelError(f"{self.path} is not a specdec ragged-step graph: missing {missing}")
        self.num_layers = cache_layers(inputs)
        first = inputs[CACHE_INPUT.format(layer=0, kind="key")]
        _, self.num_kv_heads, _, self.head_dim = first.shape
        self.np_dtype = _NP_DTYPES[first.type]
        self.head_size = int(outputs[LOGITS].shape[-1])
        self.head_token_ids, self.vocab_size = graph_head(self.path, self.head_size)
        self._in_names = cache_names(self.num_layers, CACHE_INPUT)
        self._out_names = cache_names(self.num_layers, CACHE_OUTPUT)
        self.device = cache_device(self.session.get_providers(), self._providers)
        self.rows_processed = 0
        self.calls = 0
        self.split_steps = 0  # steps run as several fused sub-steps (GQA's padded layout could not hold them)
        self.unfused_steps = 0  # steps run on the unfused graph (no split could hold them)
        self.view_steps = 0  # long chunks run over the view of their own slot (``_step_over_views``)
        self._views: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # cache -> {slot: its one-slot view}
        self.inplace_ok = True
        #: per session, per cache: the IOBinding with the cache bound in place (``_binding``)
        self._bindings: dict[int, weakref.WeakKeyDictionary] = {}

    def _open(self, rewrites: Sequence[str]) -> onnxruntime.InferenceSession:
        """A session of the graph with ``rewrites`` applied in memory (the weights stay external data)."""
        import onnx
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        if self._options["intra_op_threads"]:
            options.intra_op_num_threads = self._options["intra_op_threads"]
        if not self._options["spin"]:
            options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        if self._options["profile_prefix"]:
            options.enable_profiling = True
            options.profile_file_prefix = self._options["profile_prefix"]
        try:
            model: str | bytes = str(self.path)
            cache_dtype = self._options["cache_dtype"]
            if rewrites or cache_dtype:
                proto = onnx.load(str(self.path), load_external_data=False)
                if rewrites:
                    self.fuse_report = ort_fuse.fuse_model(proto, rewrites)
                if cache_dtype:
                    ort_cache_dtype.retype_caches(proto, cache_dtype)
                first = self._providers[0] if isinstance(self._providers[0], str) else self._providers[0][0]
                _warn_integer_saturation(proto, self.path, first == "CPUExecutionProvider")
                model = proto.SerializeToString()
                options.add_session_config_entry(
                    "session.model_external_initializers_file_folder_path", str(_external_data_folder(proto, self.path))
                )
            return ort.InferenceSession(model, options, providers=self._providers)
        except Exception as exc:  # ORT raises its own Fail/InvalidGraph/... types, onnx a DecodeError
            raise OnnxModelError(f"cannot load {self.path}: {exc}") from exc

    def allocate_cache(self, num_slots: int, max_len: int) -> HostKVStorage | TorchKVStorage:
        """Caches on the session's device: host memory on the CPU EP, the GPU's own memory on the CUDA EP."""
        spare = ort_fuse.SPARE_POSITIONS if self.fuse_report is not None and self.fuse_report.attention else 0
        spare = max(spare, int(self.even_rows))  # an evened step's extra K/V row past the last position
        shape = (self.num_layers, num_slots, int(self.num_kv_heads), max_len, int(self.head_dim))
        if self.device[0] == "cpu":
            return HostKVStorage(*shape, dtype=self.np_dtype, spare=spare)
        try:
            import torch

            from specdec.runtime.backends.torch_backend import TorchKVStorage
        except ImportError as exc:
            raise OnnxModelError(
                f"{self.path}: ONNX Runtime runs this graph on CUDA; its caches live on the device as "
                "torch CUDA tensors, and torch is not installed"
            ) from exc
        if not torch.cuda.is_available():
            raise OnnxModelError(
                f"{self.path}: ONNX Runtime runs this graph on CUDA, but this torch has no CUDA, so "
                "the caches cannot live on the device: install a CUDA build of torch, or run on "
                "the CPU (providers=['CPUExecutionProvider'])"
            )
        dtype = torch.float32 if self.np_dtype == np.float32 else torch.float16
        return TorchKVStorage(*shape, dtype, device=torch.device("cuda", self.device[1]), spare=spare)

    def step(self, batch: PackedBatch, cache: HostKVStorage | TorchKVStorage) -> np.ndarray:
        self.calls += 1
        self.rows_processed += batch.num_tokens
        return self._step(batch, cache)

    def _paired(self, batch: PackedBatch) -> PackedBatch:
        """``batch`` as this graph runs it: on an even row count where it multiplies rows in pairs (``row_floor``)."""
        return evened(batch) if self.even_rows and batch.num_tokens % 2 else batch

    def _step(self, batch: PackedBatch, cache: HostKVStorage | TorchKVStorage) -> np.ndarray:
        batch = self._paired(batch)
        feeds = graph_feeds(batch)
        if self.fuse_report is None or not self.fuse_report.attention:
            return self._run(self.session, feeds, cache)
        past, new = batch.past_lens.tolist(), np.diff(batch.cu_seqlens).tolist()
        if isinstance(cache, HostKVStorage) and (own := ort_fuse.own_slot_chunks(new, cache.num_slots)):
            return self._step_over_views(batch, cache, own)
        groups = ort_fuse.gqa_groups(past, new, cache.buffer_len, cache.num_slots, self.fuse_report.fold)
        if groups is None:  # one sequence fills the whole context next to idle slots: GQA cannot pad it
            if self._unfused is None:
                self._unfused = self._open(())
            self.unfused_steps += 1
            return self._run(self._unfused, feeds, cache)
        if len(groups) == 1:
            return self._run(self.session, feeds, cache)
        self.split_steps += 1
        logits: np.ndarray | None = None
        for seqs in groups:
            part, rows = split_batch(batch, seqs)
            out = self._run(self.session, graph_feeds(self._paired(part)), cache)
            if logits is None:
                logits = np.empty((batch.logits_indices.shape[0], out.shape[1]), dtype=out.dtype)
            logits[rows] = out
        assert logits is not None  # several groups, each of which ran
        return logits

    def _step_over_views(self, batch: PackedBatch, cache: HostKVStorage, own: Sequence[int]) -> np.ndarray:
        """The step with each sequence of ``own`` run alone over the view of its own slot, the others together.

        Same bits as the whole step (attention works within a sequence, and a row's bits do not depend on the
        padded width: ``tests/test_batch_invariance.py``), less work: GQA pads every slot of a step to its widest
        chunk, so a long chunk made each other slot of the cache compute as many query rows
        (``benchmarks/results/slot_views.md``).
        """
        self.view_steps += 1
        views = self._views.setdefault(cache, {})
        logits = np.empty((batch.logits_indices.shape[0], self.head_size), dtype=np.float32)
        for i in own:
            part, rows = split_batch(batch, [i])
            slot = int(part.slot_ids[0])
            if slot not in views:
                views[slot] = cache.slots(slot, 1)
            logits[rows] = self._step(dataclasses.replace(part, slot_ids=np.zeros_like(part.slot_ids)), views[slot])
        rest = [i for i in range(batch.num_seqs) if i not in own]
        if rest:
            part, rows = split_batch(batch, rest)
            logits[rows] = self._step(part, cache)
        return logits

    def _run(
        self, session: onnxruntime.InferenceSession, feeds: dict[str, np.ndarray], cache: HostKVStorage | TorchKVStorage
    ) -> np.ndarray:
        binding, bound = self._binding(session, cache)
        for name, array in feeds.items():
            binding.bind_cpu_input(name, np.ascontiguousarray(array))
        # the logits into a fresh host array (callers keep rows across steps); on CUDA ORT copies only these back
        logits = np.empty((int(feeds["logits_indices"].shape[0]), self.head_size), dtype=np.float32)
        binding.bind_output(LOGITS, "cpu", 0, np.float32, list(logits.shape), logits.ctypes.data)
        session.run_with_iobinding(binding)
        if bound is not None:  # a new binding: did ORT write every cache output through the buffer bound to it?
            outputs = binding.get_outputs()  # the logits first (bound first), then the caches in binding order
            self.inplace_ok = self.inplace_ok and all(o.data_ptr() == p for o, p in zip(outputs[1:], bound))
        return logits

    def _binding(
        self, session: onnxruntime.InferenceSession, cache: HostKVStorage | TorchKVStorage
    ) -> tuple[Any, list[int] | None]:
        """The IOBinding of ``session`` with ``cache`` bound in place, made on first use and kept; for a new one, the
        buffer address of each cache output in the order bound (None for a kept one).

        Why kept: the caches never move, and binding 2 x layers buffers anew every step (and reading every
        output back to find the logits) was a noticeable share of a one-row step
        (``benchmarks/results/runtime_choices.md``). Each step rebinds only the packed inputs and the logits.
        """
        per_session = self._bindings.setdefault(id(session), weakref.WeakKeyDictionary())
        binding = per_session.get(cache)
        if binding is not None:
            return binding, None
        buffers = [*cache.k, *cache.v]
        kind, index = self.device
        if buffers and _device_of(buffers[0]) != self.device:
            raise OnnxModelError(
                f"{self.name}: the caches are on {_device_name(_device_of(buffers[0]))}, the session "
                f"on {_device_name(self.device)} (allocate them with this backend's allocate_cache)"
            )
        binding = session.io_binding()
        binding.bind_output(LOGITS, "cpu")  # first, so that outputs[0] is the logits; each step rebinds it
        outputs = {o.name for o in session.get_outputs()}
        bound = []
        for in_name, out_name, buf in zip(self._in_names, self._out_names, buffers):
            pointer = _pointer(buf)
            binding.bind_input(in_name, kind, index, self.np_dtype, list(buf.shape), pointer)
            binding.bind_output(out_name, kind, index, self.np_dtype, list(buf.shape), pointer)
            bound.append(pointer)
        for out_name, buf in zip(self._out_names, buffers):  # the folded layout's hand-over: the same buffer
            if (folded := ort_fuse.FOLDED_CACHE.format(name=out_name)) in outputs:
                binding.bind_output(folded, kind, index, self.np_dtype, list(buf.shape), _pointer(buf))
                bound.append(_pointer(buf))
        per_session[cache] = binding
        return binding, bound


def _pointer(buffer: Any) -> int:
    """The address of a cache buffer: a numpy array's data, or a torch (CUDA) tensor's."""
    return buffer.ctypes.data if isinstance(buffer, np.ndarray) else buffer.data_ptr()


def _device_name(device: tuple[str, int]) -> str:
    return "cpu" if device[0] == "cpu" else f"{device[0]}:{device[1]}"


def _device_of(buffer: Any) -> tuple[str, int]:
    """("cpu", 0) for a host array, (kind, index) for a torch tensor."""
    if isinstance(buffer, np.ndarray):
        return ("cpu", 0)
    return (buffer.device.type, buffer.device.index or 0)


def default_providers(available: Sequence[str], device_id: int = 0) -> list[str | tuple[str, dict[str, str]]]:
    """CUDA on GPU ``device_id`` when this ONNX Runtime has it (``onnxruntime-gpu``), with the CPU as fallback."""
    providers: list[str | tuple[str, dict[str, str]]] = []
    if "CUDAExecutionProvider" in available:
        providers.append(("CUDAExecutionProvider", {"device_id": str(int(device_id))}))
    providers.append("CPUExecutionProvider")
    return providers


def cache_device(running: Sequence[str], requested: Sequence[Any]) -> tuple[str, int]:
    """Where the caches live, as (kind, index): the CUDA device the session runs on (``device_id``), else the host."""
    if "CUDAExecutionProvider" not in running:
        return ("cpu", 0)
    for provider in requested:
        if isinstance(provider, tuple) and provider[0] == "CUDAExecutionProvider":
            return ("cuda", int(provider[1].get("device_id", 0)))
    return ("cuda", 0)


def _rewrites(fuse: bool | Sequence[str] | None, providers: Sequence[Any]) -> tuple[str, ...]:
    """The ort_fuse rewrites an ``OrtBackend(fuse=...)`` applies.

    By default all of them on the CPU EP; with the CUDA EP all but ``attention``, whose exactness
    (GQA's CUDA kernel with ``query_seqlens`` and a bias) no test here has checked. A list names
    them explicitly, also on CUDA.
    """
    if fuse is None:
        env = os.environ.get(FUSE_ENV, "1").strip().lower()
        if env in ("0", "false", "off", "none", ""):
            return ()
        fuse = True if env in ("1", "true", "on", "all") else [r.strip() for r in env.split(",") if r.strip()]
    cuda = any((p[0] if isinstance(p, tuple) else p) == "CUDAExecutionProvider" for p in providers)
    if fuse is True:
        return tuple(r for r in ort_fuse.REWRITES if r != "attention" or not cuda)
    return tuple(fuse or ())


def evened(batch: PackedBatch) -> PackedBatch:
    """The step with one more row: the last sequence's last token again, one position on, a child of that token
    (``OrtBackend``'s ``row_floor``); no logits of it are asked for."""
    cu = batch.cu_seqlens.copy()
    last = int(cu[-1] - cu[-2])  # the last sequence's rows; the new one is its row ``last``
    mask = np.zeros((batch.num_tokens + 1, max(batch.tree_mask.shape[1], last + 1)), dtype=bool)
    mask[:-1, : batch.tree_mask.shape[1]] = batch.tree_mask
    mask[-1] = mask[-2]
    mask[-1, last] = True
    cu[-1] += 1
    return dataclasses.replace(
        batch,
        input_ids=np.append(batch.input_ids, batch.input_ids[-1]),
        position_ids=np.append(batch.position_ids, batch.position_ids[-1] + 1),
        cu_seqlens=cu,
        tree_mask=mask,
    )


def _rows_in_pairs(path: Path) -> bool:
    """Whether the graph holds an int8-activation MatMulNBits of blocks wider than ``ROW_INVARIANT_BLOCK``."""
    import onnx

    for node in onnx.load(str(path), load_external_data=False).graph.node:
        if node.op_type == "MatMulNBits":
            attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
            if attrs.get("accuracy_level") == 4 and attrs.get("block_size", 0) > ROW_INVARIANT_BLOCK:
                return True
    return False


def split_batch(batch: PackedBatch, seqs: Sequence[int]) -> tuple[PackedBatch, np.ndarray]:
    """The sub-step of sequences ``seqs`` (indices into the batch) and where its logits go in the batch's.

    Every operator but attention works row by row and attention within a sequence, so running
    the sub-steps one after another computes exactly the whole step.
    """
    cu = batch.cu_seqlens.astype(np.int64)
    seq_idx = np.asarray(list(seqs), dtype=np.int64)
    lens = cu[seq_idx + 1] - cu[seq_idx]
    rows = np.concatenate([np.arange(cu[i], cu[i + 1]) for i in seq_idx])
    new_row = np.full(batch.num_tokens, -1, dtype=np.int64)
    new_row[rows] = np.arange(rows.size)
    mapped = new_row[batch.logits_indices.astype(np.int64)]
    where = np.flatnonzero(mapped >= 0)
    sub_cu = np.zeros(len(seq_idx) + 1, dtype=np.int32)
    sub_cu[1:] = np.cumsum(lens)
    part = PackedBatch(
        input_ids=batch.input_ids[rows],
        position_ids=batch.position_ids[rows],
        cu_seqlens=sub_cu,
        past_lens=batch.past_lens[seq_idx],
        slot_ids=batch.slot_ids[seq_idx],
        tree_mask=np.ascontiguousarray(batch.tree_mask[rows][:, : max(int(lens.max()), 1)]),
        logits_indices=mapped[where].astype(np.int32),
    )
    return part, where


def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> set[str] | None:
    """The instruction-set flags of this CPU; None where /proc/cpuinfo is unreadable or lists none."""
    try:
        with open(cpuinfo, encoding="utf-8") as f:
            line = next((line for line in f if line.startswith("flags")), None)
    except OSError:
        return None
    return None if line is None else set(line.partition(":")[2].split())


def has_vnni(cpuinfo: str = "/proc/cpuinfo") -> bool | None:
    """Whether this CPU has VNNI (``avx512_vnni`` or ``avx_vnni``); None where that cannot be read."""
    flags = cpu_flags(cpuinfo)
    return None if flags is None else bool({"avx512_vnni", "avx_vnni"} & flags)


def _warn_integer_saturation(proto: onnx.ModelProto, path: Path, on_cpu: bool, cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Warn when a graph with integer GEMMs (a w8a8 export) runs on an x86 CPU without VNNI; True if it did.

    Why: there MLAS's u8 x s8 kernel adds pairs of products in int16 with saturation (``vpmaddubsw``),
    so a large activation times a large weight can be clipped: the answers stay deterministic and
    row-independent, but are no longer the exact integer products the export was checked with.
    """
    if not on_cpu or has_vnni(cpuinfo) is not False:
        return False
    integer = ("MatMulInteger", "MatMulIntegerToFloat")
    if not any(node.op_type in integer for node in proto.graph.node):
        return False
    _log.warning(
        "%s: this CPU has no VNNI; ONNX Runtime's u8 x s8 integer GEMM may saturate here, so this w8a8 "
        "graph's answers can differ from the exact products it was exported with (prefer --quantize "
        "int4 or int8 on this machine)",
        path,
    )
    return True

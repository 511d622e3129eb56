"""Quantization schemes as strategies: one object per scheme, one interface, built from the flags in one place.

A strategy holds its own settings and answers the same four questions: what each source tensor
becomes (``plan``), which nodes compute a linear layer of the graph (``linear``), which graph the
export's tight check runs (``checked``) and what the manifest records (``describe``). The graph
rewrite (``rewrite.rewrite_graph``) and the export step (``specdec.export.quantize``) are the same
for every scheme. The schemes:

* ``WeightBlocks(4)``, ``WeightBlocks(8)`` (``--quantize int4|int8``): weight-only blocks (of 32 by
  default) in ``MatMulNBits`` (``nbits``), a block-quantized GGUF's own blocks bit for bit, or the
  fp32 weights rounded to nearest (``blocks``) or calibrated (``rounding``), at the activation level
  the flags ask for. int4 and int8 are one scheme at two widths.
* ``W8A8`` (``--quantize w8a8``): the decoder layers' linears as integer-GEMM chains smoothed on
  calibration prompts (``w8a8``, ``calibration``); the LM head and the embedding table are what
  ``WeightBlocks(8)`` makes them (the head multiplies only the rows that need logits, the table is
  gathered).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from specdec.export.quantization.blocks import BLOCK_SIZE, BLOCK_SIZES, BlockQuant, QuantizeError, concat_rows
from specdec.export.quantization.calibration import activation_maxima, activation_moments, calibration_ids
from specdec.export.quantization.nbits import (
    ACTIVATIONS,
    CHECK_LEVEL,
    FP32_ACTIVATIONS,
    INT8_ACTIVATIONS,
    matmul_nbits,
    set_accuracy_level,
    set_level,
)
from specdec.export.quantization.sources import (
    EMBEDDING,
    Runs,
    embedding_block,
    fp32,
    linear_names,
    node_metadata,
    source_blocks,
)
from specdec.export.quantization.w8a8 import (
    LOGIT_ROWS,
    SMOOTH_ALPHA,
    TOKEN_ROWS,
    fold_smoothing,
    fp32_product_copy,
    integer_chain,
    quantize_linear,
    smoothing,
)
from specdec.runtime.backends.onnx_edit import GraphEditor

#: ``--quantize`` choices (``strategy_for``)
STRATEGIES = ("int4", "int8", "w8a8")
#: ``--quantize-from`` choices: where the blocks come from (``strategy_for``)
SOURCES = ("gguf", "fp32", "calibrated")


@dataclass(frozen=True)
class Plan:
    """What each source tensor of a model becomes, decided before the graph is read."""

    blocks: dict[str, BlockQuant]  # MatMulNBits, by source tensor
    kept: dict[str, np.ndarray]  # left fp32 on purpose: their values
    reference: dict[str, np.ndarray]  # the fp32 values of the replaced tensors, which graph rows are matched against
    embedding: BlockQuant | None  # the table gathered from blocks; None: it stays fp32
    table: np.ndarray | None  # its fp32 values (to find the gather that reads it)
    integer: dict[str, np.ndarray] = field(default_factory=dict)  # w8a8 chains: their inputs' calibrated maxima


@dataclass(frozen=True)
class Linear:
    """What a strategy put in place of one linear node: the format it records, and the fp32 weight ``[N, K]`` its
    nodes compute where the plan cannot tell it beforehand (a chain's smoothing depends on the graph's fused weight)."""

    source_format: str
    computed: np.ndarray | None = None


class QuantizationStrategy(ABC):
    """One quantization scheme with its settings; see the module docstring."""

    name: str  # the manifest's ``mode`` and the ``--quantize`` choice
    bits: int  # the width of its weight blocks
    accuracy_level: int  # MatMulNBits' activation level in the shipped graph
    use_gguf: bool  # a block-quantized GGUF's own blocks (else round the fp32 weights to nearest)

    def bind(self, target: Any) -> QuantizationStrategy:
        """This strategy with what the target settles for every graph of its export (``W8A8``: the calibration
        prompts, in the target's tokenizer, since a draft ships none)."""
        return self

    @abstractmethod
    def plan(self, model: Any) -> Plan:
        """What each linear weight (and the embedding table) of ``model`` becomes."""

    @abstractmethod
    def linear(self, g: GraphEditor, node: Any, weight: np.ndarray, runs: Runs, plan: Plan) -> Linear:
        """Emit into ``g`` the nodes computing the linear ``node`` by ``weight [N, K]``, which holds the source rows
        ``runs`` (none of them kept fp32)."""

    @abstractmethod
    def checked(self, graph: Path) -> AbstractContextManager[Path]:
        """The graph as the export's tight check runs it: its stored weights computed exactly (no activation
        rounding), so the check tests the graph and not the rounding."""

    def describe(self, plan: Plan) -> dict:
        """The manifest's summary of the scheme (the rewrite adds what it found in the graph). ``batch_invariant``:
        whether a row's logits are bitwise the same in any step, which greedy ``ems`` = ``ar`` rests on."""
        source = "gguf" if self.use_gguf else "fp32"
        return {"mode": self.name, "bits": self.bits, "fp32_tensors": sorted(plan.kept), "quantize_from": source}

    def finish(self, g: GraphEditor) -> dict:
        """Edits across linears, once every one is replaced (``g``: the rewritten graph); what the manifest adds."""
        return {}


@dataclass(frozen=True)
class WeightBlocks(QuantizationStrategy):
    """Weight-only blocks: every linear layer a MatMulNBits, the embedding gathered from blocks (``nbits``).

    ``use_gguf=False`` rounds the fp32 weights even when the model came from a block-quantized GGUF
    (what a second rounding costs: ``benchmarks/quantize_quality.py``). ``calibrated``: that rounding
    weighs each weight column by its input's second moment on ``calibration`` (``rounding``; default:
    ``calibration.calibration_ids`` in the model's own tokenizer). ``block_size``: weights per block
    (a GGUF's own blocks are 32).
    """

    bits: int
    accuracy_level: int = INT8_ACTIVATIONS
    use_gguf: bool = True
    block_size: int = BLOCK_SIZE
    calibrated: bool = False
    calibration: tuple[tuple[int, ...], ...] | None = None

    def __post_init__(self) -> None:
        if self.bits not in (4, 8):
            raise QuantizeError(f"weight blocks are 4 or 8 bits, not {self.bits}")
        if self.block_size not in BLOCK_SIZES:
            raise QuantizeError(f"block size must be one of {list(BLOCK_SIZES)}, not {self.block_size}")
        if self.calibrated and self.use_gguf:
            raise QuantizeError("calibrated rounding rounds the fp32 weights: it does not keep a GGUF's blocks")

    @property
    def name(self) -> str:  # type: ignore[override]  # read-only here: the width names it
        return f"int{self.bits}"

    def bind(self, target: Any) -> WeightBlocks:
        if not self.calibrated or self.calibration is not None:
            return self
        sequences = calibration_ids(target.tokenizer, target.vocab_size)
        return replace(self, calibration=tuple(tuple(ids) for ids in sequences))

    def plan(self, model: Any, names: Sequence[str] | None = None) -> Plan:
        """The blocks of ``names`` (default: every linear weight) and of the table, less ``fp32_tensors``."""
        names = linear_names(model) if names is None else names
        importance = None
        if self.calibrated:
            sequences = self.calibration or calibration_ids(model.tokenizer, model.vocab_size)
            importance = activation_moments(model, sequences, names)
        blocks = source_blocks(model, self.bits, self.use_gguf, names, self.block_size, importance)
        table = embedding_block(model, self.bits, blocks, self.use_gguf)
        kept = self.fp32_tensors(blocks)
        return Plan(
            blocks={name: block for name, block in blocks.items() if name not in kept},
            kept={name: fp32(model, name) for name in blocks if name in kept},
            reference={name: fp32(model, name) for name in blocks if name not in kept},
            embedding=table,
            table=None if table is None else fp32(model, EMBEDDING),
        )

    def describe(self, plan: Plan) -> dict:
        described = super().describe(plan)
        return {
            **described,
            "quantize_from": "calibrated" if self.calibrated else described["quantize_from"],
            "batch_invariant": self.accuracy_level == INT8_ACTIVATIONS,  # wide blocks: OrtBackend's row_floor
        }

    def fp32_tensors(self, blocks: Mapping[str, BlockQuant]) -> set[str]:
        """The tensors left as fp32 Gemms: at fp32 activations, those wider than asked (8-bit under ``int4``), for
        which MLAS has no fp32-activation kernel (``nbits``). The table is gathered from blocks all the same: a
        gather de-quantizes rows, it multiplies nothing."""
        if self.accuracy_level != FP32_ACTIVATIONS:
            return set()
        return {name for name, block in blocks.items() if block.bits > self.bits}

    def linear(self, g: GraphEditor, node: Any, weight: np.ndarray, runs: Runs, plan: Plan) -> Linear:
        block = concat_rows([plan.blocks[name].take(start, stop) for name, start, stop in runs])
        matmul_nbits(g, node, block, runs, self.accuracy_level)
        return Linear(block.source)

    @contextmanager
    def checked(self, graph: Path) -> Iterator[Path]:
        """The graph itself at fp32 activations, switched back to its level afterwards."""
        set_accuracy_level(graph, CHECK_LEVEL)
        try:
            yield Path(graph)
        finally:
            set_accuracy_level(graph, self.accuracy_level)


@dataclass(frozen=True)
class W8A8(QuantizationStrategy):
    """The decoder layers' linears as integer-GEMM chains (``w8a8``); the head and the table as ``WeightBlocks(8)``.

    ``strength``: SmoothQuant's migration strength. ``calibration``: the token sequences whose
    activations set the smoothing (default: ``calibration.calibration_ids`` in the model's own tokenizer).
    ``integer_head``: the LM head an integer-GEMM chain too (the table stays gathered from blocks). Why it is
    an option: at the rows of a batch of verification chains the head's 8-bit ``MatMulNBits`` is the slowest
    node of a step on CPUs whose integer GEMM is much faster (AMX), and a chain re-rounds the source's blocks
    per channel, so what it costs in agreement with fp32 is measured before it is chosen
    (``benchmarks/results/graph_fidelity.md``).
    """

    strength: float = SMOOTH_ALPHA
    calibration: tuple[tuple[int, ...], ...] | None = None
    use_gguf: bool = True
    integer_head: bool = False
    # constants of this strategy, not settings: class variables where the base declares what every strategy has
    name: ClassVar[str] = "w8a8"  # type: ignore[misc]
    bits: ClassVar[int] = 8  # type: ignore[misc]
    accuracy_level: ClassVar[int] = INT8_ACTIVATIONS  # type: ignore[misc]  # the head's: the chains round their activations by definition

    @property
    def head(self) -> WeightBlocks:
        return WeightBlocks(self.bits, self.accuracy_level, self.use_gguf)

    def bind(self, target: Any) -> W8A8:
        if self.calibration is not None:
            return self
        sequences = calibration_ids(target.tokenizer, target.vocab_size)
        return replace(self, calibration=tuple(tuple(ids) for ids in sequences))

    def plan(self, model: Any) -> Plan:
        names = linear_names(model)
        sequences = self.calibration or calibration_ids(model.tokenizer, model.vocab_size)
        maxima = activation_maxima(model, sequences, names if self.integer_head else names[:-1])
        head = self.head.plan(model, [name for name in names if name not in maxima])
        return replace(head, integer=maxima, reference={**head.reference, **{n: fp32(model, n) for n in maxima}})

    def linear(self, g: GraphEditor, node: Any, weight: np.ndarray, runs: Runs, plan: Plan) -> Linear:
        if not all(name in plan.integer for name, _, _ in runs):
            return self.head.linear(g, node, weight, runs, plan)
        seen = np.max([plan.integer[name] for name, _, _ in runs], axis=0)  # q|k|v, gate|up read one input
        linear = quantize_linear(weight, smoothing(seen, weight, self.strength))
        head = any(name in (EMBEDDING, "lm_head.weight") for name, _, _ in runs)  # its rows are the logit rows
        integer_chain(g, node, linear, node_metadata(runs, self.name), rows=LOGIT_ROWS if head else TOKEN_ROWS)
        return Linear(self.name, linear.effective())

    def describe(self, plan: Plan) -> dict:
        return {**super().describe(plan), "integer_head": self.integer_head, "batch_invariant": True}

    def finish(self, g: GraphEditor) -> dict:
        """Each chain's smoothing folded into its input's producer where exact (``w8a8.fold_smoothing``)."""
        return {"smoothing_folded": fold_smoothing(g)}

    def checked(self, graph: Path) -> AbstractContextManager[Path]:
        """A copy whose chains are Gemms by their effective weights (they have no fp32-activation level to switch
        to), its head at fp32 activations."""
        return fp32_product_copy(graph, lambda g: set_level(g, CHECK_LEVEL))


def strategy_for(
    name: str, activations: str = "int8", source: str = "gguf", block_size: int = BLOCK_SIZE
) -> QuantizationStrategy:
    """The strategy ``--quantize name --quantize-activations activations --quantize-from source
    --quantize-block-size block_size`` asks for: the one place flags become one."""
    if activations not in ACTIVATIONS:
        raise QuantizeError(f"unknown --quantize-activations {activations!r}: choose one of {', '.join(ACTIVATIONS)}")
    if source not in SOURCES:
        raise QuantizeError(f"unknown --quantize-from {source!r}: choose one of {', '.join(SOURCES)}")
    if name == W8A8.name:
        if activations != "int8":
            raise QuantizeError(
                f"--quantize {name} rounds its activations to int8 by definition: "
                f"--quantize-activations {activations} does not apply"
            )
        if source == "calibrated" or block_size != BLOCK_SIZE:
            raise QuantizeError(
                f"--quantize {name} rounds its decoder layers per channel, smoothed on calibration prompts: "
                "--quantize-from calibrated and --quantize-block-size apply to int4 and int8"
            )
        return W8A8(use_gguf=source == "gguf")
    if name in ("int4", "int8"):
        return WeightBlocks(
            int(name.removeprefix("int")),
            ACTIVATIONS[activations],
            use_gguf=source == "gguf",
            block_size=block_size,
            calibrated=source == "calibrated",
        )
    raise QuantizeError(f"unknown --quantize {name!r}: choose one of {', '.join(STRATEGIES)}")

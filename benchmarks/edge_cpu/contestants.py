"""The rows of the edge benchmark: who decodes, how, at which batch size."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from benchmarks.edge_cpu import DRAFTER_LABELS, PRECISION_METHODS, PRECISIONS, SPECDEC_METHODS
from benchmarks.peers.catalog import PeerRow, peer_rows

# -- contestants ---------------------------------------------------------------------------


@dataclass
class Contestant:
    """One row of the table: who decodes, how, at which batch size; ``tags`` are what ``--skip`` matches."""

    label: str
    kind: str  # "peer", "hf" or "specdec"
    batch: int
    tags: tuple[str, ...]
    precision: str | None = None  # specdec: one of PRECISIONS
    method: str | None = None  # specdec: ar / ems
    drafter: str | None = None  # specdec ems: "ngram", "draft" or "hybrid" (n-gram where the context matches)
    lookup: bool = False  # hf: prompt lookup decoding
    kv_cache: str | None = None  # specdec: the KV caches' type when not the export's own (fp16 for int8/int4)
    peer: PeerRow | None = None  # peer: its model, mode and batch (``benchmarks.peers.catalog``)

    @property
    def key(self) -> str:
        return f"{self.label} B={self.batch}"

    @property
    def plain_key(self) -> str | None:
        """The row whose answers this greedy speculation must repeat: the same export's ``ar``, the same peer
        model without its speculation, at the same batch size (None for a row that does not speculate)."""
        if self.method == "ems":
            return f"specdec {self.precision} ar B={self.batch}"
        if self.peer is not None and self.peer.plain_label is not None:
            return f"{self.peer.plain_label} B={self.batch}"
        return None


def contestants(batches: Sequence[int], peers: Sequence[str] = ()) -> list[Contestant]:
    """Every contestant of the comparison, in table order: the peers (``--peers``), HF, specdec's exports."""
    rows = [Contestant(p.label, "peer", p.batch, ("peer", p.model), peer=p) for p in peer_rows(peers, batches)]
    rows += [Contestant("HF fp32", "hf", b, ("hf",)) for b in sorted({1, 8} & set(batches)) or [1]]
    rows.append(Contestant("HF fp32 prompt lookup", "hf", 1, ("hf", "hf-lookup"), lookup=True))
    for precision in PRECISIONS:
        for method, drafter, tag in PRECISION_METHODS.get(precision, SPECDEC_METHODS):
            name = f"specdec {precision} {method}" + (f" {DRAFTER_LABELS[drafter]}" if drafter else "")
            rows += [
                Contestant(name, "specdec", b, ("specdec", precision, tag), precision, method, drafter) for b in batches
            ]
        if precision in ("int8", "int4"):  # what their fp16 caches cost: ar over fp32 caches beside them
            rows += [
                Contestant(
                    f"specdec {precision} ar fp32 caches",
                    "specdec",
                    b,
                    ("specdec", precision, "ar", "fp32-caches"),
                    precision,
                    "ar",
                    kv_cache="float32",
                )
                for b in batches
            ]
    return rows

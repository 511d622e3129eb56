"""The decoding methods, in one table: what each one is, what it needs, where it may run.

Every reader of a method name (``Engine.generate``, the engine service, the CLI, the serving
protocol, the Triton models, the client) asks this table instead of comparing strings, so a
method's needs (a drafter, a draft *model*, beam parameters, a cache with holes) are stated
once. The ``run.method`` label each loop records is its row's ``name``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from specdec.runtime.beams import beam, dsbd
from specdec.runtime.loops import DecodeContext, ar, ems, vanilla
from specdec.runtime.metrics import RunMetrics
from specdec.runtime.sampling import InvalidRequestError

#: what a method drafts with: nothing, a chain from any drafter (model or prompt lookup),
#: or forests that only a draft model can beam-sample
NO_DRAFT, CHAIN_DRAFT, FOREST_DRAFT = "none", "chain", "forest"


@dataclass(frozen=True)
class Method:
    """One decoding method.

    ``drafts``: ``NO_DRAFT``, ``CHAIN_DRAFT`` or ``FOREST_DRAFT``. ``beams``: a request is a
    group of beams and takes ``BeamParams``. ``served``: the Triton endpoint offers it
    (``vanilla`` exists only to measure what EMS-SD saves). ``masks_cache``: its steps leave
    masked holes in the KV cache, which only a backend with ``supports_cache_mask`` runs.
    """

    name: str
    loop: Callable[[DecodeContext], RunMetrics]
    summary: str
    drafts: str = NO_DRAFT
    beams: bool = False
    served: bool = True
    masks_cache: bool = False

    @property
    def uses_drafter(self) -> bool:
        return self.drafts != NO_DRAFT

    @property
    def needs_draft_model(self) -> bool:
        return self.drafts == FOREST_DRAFT


METHODS: dict[str, Method] = {
    m.name: m
    for m in (
        Method("ems", ems, "EMS-SD: ragged drafts and acceptance, no padding", drafts=CHAIN_DRAFT),
        Method("ar", ar, "batched autoregressive decoding (the baseline)"),
        Method(
            "vanilla",
            vanilla,
            "padded multi-sample speculative decoding (the papers' baseline)",
            drafts=CHAIN_DRAFT,
            served=False,
            masks_cache=True,
        ),
        Method("beam", beam, "target-only beam sampling, or beam search when greedy", beams=True),
        Method(
            "dsbd",
            dsbd,
            "DSBD: draft-sampled forests verified in one call, adaptive width",
            drafts=FOREST_DRAFT,
            beams=True,
        ),
    )
}
METHOD_NAMES = tuple(METHODS)
SERVED_METHODS = tuple(name for name, m in METHODS.items() if m.served)
BEAM_METHODS = tuple(name for name, m in METHODS.items() if m.beams)
#: what a request that names no method gets, locally and served
DEFAULT_METHOD = "ems"
#: the method every speed-up is measured against
BASELINE_METHOD = "ar"


def get_method(name: str, *, served: bool = False) -> Method:
    """The table's row for ``name`` (case and surrounding spaces ignored).

    Raises ``InvalidRequestError`` (a ``ValueError``) naming the choices for an unknown name,
    or, with ``served``, for a method the endpoint does not offer.
    """
    key = str(name).strip().lower()
    choices = SERVED_METHODS if served else METHOD_NAMES
    if key not in choices:
        raise InvalidRequestError(f"unknown method {name!r}: choose one of {', '.join(choices)}")
    return METHODS[key]


def beam_method(has_draft_model: bool) -> str:
    """The beam method a server's beam loop runs: the speculative one when a draft model is there."""
    return next(name for name, m in METHODS.items() if m.beams and m.needs_draft_model == has_draft_model)

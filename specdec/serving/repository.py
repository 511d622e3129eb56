"""Writes the Triton model repository of an export: five models, configs rendered from ``protocol``.

Layout (``specdec-export --out DIR`` writes it to ``DIR/triton_repo``; the graphs stay in DIR)::

    triton_repo/
      preprocessing/    Python   text_input -> input_ids
      specdec_engine/   Python   decoupled; the one engine and its ragged batch
      postprocessing/   Python   ids -> text_output (incremental, stateless)
      specdec_stream/   Python   decoupled; preprocessing -> specdec_engine -> postprocessing over BLS
      specdec/          Python   the same pipeline for a unary infer (one complete response)

Why Python entry points and not an ensemble: an ensemble holding a decoupled model is itself
decoupled (so it could not answer a unary ``infer``), and Triton 2.51 does not pass a client's
cancellation on to the models inside an ensemble, so a disconnected stream would keep decoding
to ``max_tokens``. The entry points see their own request cancelled and tell the engine.

``max_batch_size: 0`` everywhere: one request is one prompt (``text_input`` shape [1]) and the
batch is formed by the engine from concurrent requests, not by Triton's batcher.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

from specdec.runtime.config import DEFAULT_NUM_DRAFT_TOKENS, DrafterKind
from specdec.runtime.costs import DraftCosts
from specdec.runtime.draft_length import BatchPrices, prices_text
from specdec.serving import protocol
from specdec.serving.inputs import Limits
from specdec.serving.install import TritonError

REPOSITORY_DIR = "triton_repo"
#: the readiness gate serves nothing; a Python model still declares a tensor
GATE_PROBE = protocol.TensorSpec("probe", "TYPE_INT32", doc="unused: the gate answers no request")
MODELS = protocol.MODELS
#: the class of ``specdec.serving.triton_models`` each model's ``model.py`` serves
_CLASS_OF = {
    protocol.PREPROCESSING_MODEL: "Preprocessing",
    protocol.ENGINE_MODEL: "EngineModel",
    protocol.POSTPROCESSING_MODEL: "Postprocessing",
    protocol.STREAM_MODEL: "StreamModel",
    protocol.UNARY_MODEL: "UnaryModel",
    protocol.READY_MODEL: "ReadinessGate",
}


@dataclass(frozen=True)
class ServingOptions:
    """Settings written into the configs (edit the config.pbtxt ``parameters`` to change them later)."""

    intra_op_threads: int = 0  # ONNX Runtime threads of the engine; 0 = all cores
    num_draft_tokens: int = DEFAULT_NUM_DRAFT_TOKENS  # k when a request does not say
    adaptive_draft: bool = False  # each sequence drafts the k (γ) its acceptance pays for, at most the k above
    # adaptive draft: a verified row's and a draft token's cost in target steps (None: as calibrated at export,
    # else DraftLength's default verify cost and the drafter's own draft cost)
    verify_cost: float | None = None
    draft_cost: float | None = None
    # the same per batch size, for greedy requests (``DraftLength``); set by a calibration whose flat price is used
    verify_by_batch: BatchPrices = ()
    draft_by_batch: BatchPrices = ()
    default_max_tokens: int = 64
    drafter: DrafterKind | None = None  # None = as exported; a kind overrides
    max_concurrency: int = 64  # requests in flight at once per entry point
    #: requests an entry point holds waiting for one of those places; one more is refused at once (UNAVAILABLE)
    max_queue: int = 256
    limits: Limits = field(default_factory=Limits)
    max_batch: int = 0  # sequences the engine decodes together; 0 = the export's KV slots
    #: the most rows one request may add to a step (``Generation.step_rows``): a dsbd request of width 8 and 32 draft
    #: layers adds 2,056 and sets every other request's pace; 0 = no bound
    max_request_rows: int = 512
    #: rows a ragged step may spend on prompt prefills (chunked prefill); 0 = whole prompts. Why 128: an 1,800-token
    #: prompt arriving mid-stream then stretches the running streams' longest gap to ~0.5 s instead of stalling
    #: them 4.3 s, for +13 % on its own first token; 64 halves no gap further and slows everything
    #: (SmolLM2 fp32, 2 cores: benchmarks/results/chunked_prefill.md)
    prefill_budget: int = 128
    #: engine instances per device: each is its own stub process with its own decoding loops and KV caches
    #: (``max_batch`` slots each), and Triton spreads the requests over them
    instances: int = 1
    #: the GPUs the engine instances run on (``instances`` on each), as ``KIND_GPU``; empty: ``KIND_CPU``
    gpus: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "drafter", DrafterKind.parse(self.drafter))
        if self.instances < 1:
            raise ValueError(f"instances must be >= 1, got {self.instances}")
        if any(g < 0 for g in self.gpus) or len(set(self.gpus)) != len(self.gpus):
            raise ValueError(f"gpus must be distinct device ids >= 0, got {list(self.gpus)}")

    def priced(self, measured: DraftCosts) -> ServingOptions:
        """These options with the costs left unset (None) taken from a calibration: what is set explicitly wins
        (and a price set explicitly has no per-batch-size variant)."""
        verify, draft = self.verify_cost is None, self.draft_cost is None
        return replace(
            self,
            verify_cost=measured.verify_cost if verify else self.verify_cost,
            draft_cost=measured.draft_cost if draft else self.draft_cost,
            verify_by_batch=measured.verify_by_batch if verify else (),
            draft_by_batch=measured.draft_by_batch if draft else (),
        )


def _tensor(spec: protocol.TensorSpec, optional: bool | None = None) -> str:
    dims = ", ".join(str(d) for d in spec.dims)
    opt = spec.optional if optional is None else optional
    return (
        f'  {{ name: "{spec.name}" data_type: {spec.dtype} dims: [ {dims} ]' + (" optional: true" if opt else "") + " }"
    )


def _io(kind: str, specs: Iterable[protocol.TensorSpec], optional: bool | None = None) -> str:
    return f"{kind} [\n" + ",\n".join(_tensor(s, optional) for s in specs) + "\n]\n"


def _parameters(params: Mapping[str, object]) -> str:
    return "".join(f'parameters {{ key: "{k}" value: {{ string_value: "{v}" }} }}\n' for k, v in params.items())


def instance_group(count: int = 1, gpus: Iterable[int] = ()) -> str:
    """A config's ``instance_group``: ``count`` instances on the host, or ``count`` on each of ``gpus``."""
    devices = list(gpus)
    if devices:
        return f"instance_group [ {{ kind: KIND_GPU count: {count} gpus: [ {', '.join(map(str, devices))} ] }} ]\n"
    return f"instance_group [ {{ kind: KIND_CPU count: {count} }} ]\n"


def _python_model(
    name: str,
    inputs: Iterable[protocol.TensorSpec],
    outputs: Iterable[protocol.TensorSpec],
    params: Mapping[str, object],
    decoupled: bool = False,
    instances: str = instance_group(),
) -> str:
    text = f'name: "{name}"\nbackend: "python"\nmax_batch_size: 0\n'
    if decoupled:
        text += "model_transaction_policy { decoupled: true }\n"
    text += _io("input", inputs) + _io("output", outputs, optional=False)
    text += instances
    return text + _parameters(params)


def render_configs(export_dir_from_repo: str, options: ServingOptions) -> dict[str, str]:
    """``config.pbtxt`` text of each model; ``export_dir_from_repo`` is the export seen from the repo root."""
    common = {"export_dir": export_dir_from_repo}
    engine = {
        **common,
        "intra_op_threads": options.intra_op_threads,
        "num_draft_tokens": options.num_draft_tokens,
        "default_max_tokens": options.default_max_tokens,
        "drafter": options.drafter.value if options.drafter else "",
        "max_batch": options.max_batch,
        "max_request_rows": options.max_request_rows,
        "adaptive_draft": int(options.adaptive_draft),
        "prefill_budget": options.prefill_budget,
        "verify_cost": "" if options.verify_cost is None else options.verify_cost,
        "draft_cost": "" if options.draft_cost is None else options.draft_cost,
        "verify_cost_by_batch": prices_text(options.verify_by_batch),
        "draft_cost_by_batch": prices_text(options.draft_by_batch),
    }
    entry = {
        "max_concurrency": options.max_concurrency,
        "max_queue": options.max_queue,
        **{name: getattr(options.limits, name) for name in Limits.__dataclass_fields__},
    }
    # each model's inputs, outputs, config parameters, and whether it is decoupled
    models: dict[str, tuple[Iterable[protocol.TensorSpec], Iterable[protocol.TensorSpec], Mapping[str, object], bool]]
    models = {
        protocol.PREPROCESSING_MODEL: (protocol.PREPROCESSING_INPUTS, (protocol.INPUT_IDS,), common, False),
        protocol.ENGINE_MODEL: ((protocol.INPUT_IDS, *protocol.PARAMETERS), protocol.ENGINE_OUTPUTS, engine, True),
        protocol.POSTPROCESSING_MODEL: (protocol.ENGINE_OUTPUTS, protocol.TEXT_OUTPUTS, common, False),
        protocol.STREAM_MODEL: (protocol.CLIENT_INPUTS, protocol.CLIENT_OUTPUTS, entry, True),
        protocol.UNARY_MODEL: (protocol.CLIENT_INPUTS, protocol.CLIENT_OUTPUTS, entry, False),
        protocol.READY_MODEL: ((GATE_PROBE,), (GATE_PROBE,), {}, False),
    }
    engine_group = instance_group(options.instances, options.gpus)
    return {
        name: _python_model(
            name,
            inputs,
            outputs,
            params,
            decoupled,
            engine_group if name == protocol.ENGINE_MODEL else instance_group(),
        )
        for name, (inputs, outputs, params, decoupled) in models.items()
    }


def config_parameters(config: str) -> dict[str, str]:
    """The ``parameters`` of a config.pbtxt text as ``render_configs`` writes them (plain strings)."""
    return dict(re.findall(r'parameters \{ key: "([^"]*)" value: \{ string_value: "([^"]*)" \} \}', config))


def read_parameters(repository: str | os.PathLike[str], model: str = protocol.ENGINE_MODEL) -> dict[str, str]:
    """The parameters of one model of a written repository.

    Why: a benchmark builds the served engine's local twin from the same parameters the server reads.
    """
    return config_parameters((Path(repository) / model / "config.pbtxt").read_text())


def write_repository(
    export_dir: str | os.PathLike[str],
    repository: str | os.PathLike[str] | None = None,
    options: ServingOptions | None = None,
) -> Path:
    """Write (or rewrite) the model repository serving ``export_dir``; returns the repository path.

    The export is referenced by a path relative to the repository, so the pair can be moved
    or copied (e.g. into a container) together.
    """
    export = Path(export_dir).resolve()
    repo = Path(repository) if repository is not None else export / REPOSITORY_DIR
    repo.mkdir(parents=True, exist_ok=True)
    relative = os.path.relpath(export, repo.resolve())
    for model, config in render_configs(relative, options or ServingOptions()).items():
        version = repo / model / "1"
        version.mkdir(parents=True, exist_ok=True)
        (repo / model / "config.pbtxt").write_text(config)
        (version / "model.py").write_text(
            f'"""Triton Python-backend model `{model}` of specdec (see specdec/serving/triton_models.py)."""\n\n'
            f"from specdec.serving.triton_models import {_CLASS_OF[model]} as TritonPythonModel\n\n"
            '__all__ = ["TritonPythonModel"]\n'
        )
    return repo


def missing_models(repo: Path) -> list[str]:
    """The specdec models absent from ``repo``, if any of its models is a specdec model.

    The entry points call the other models over BLS, which Triton cannot check at load time: a
    repository without ``specdec_engine`` would start, then fail every request.
    """
    ours = [
        m
        for m in MODELS
        if (repo / m / "1" / "model.py").is_file()
        and "specdec.serving.triton_models" in (repo / m / "1" / "model.py").read_text(errors="replace")
    ]
    return [m for m in MODELS if m not in ours] if ours else []


class InvalidRepositoryError(TritonError):
    """The model repository is missing or malformed (checked before Triton would fail more obscurely)."""


def validate_repository(path: str | os.PathLike[str]) -> Path:
    """Check the model repository's shape so a typo fails in a second with a clear message.

    Triton itself would start, fail to load, and bury the reason in its log. Every model directory needs
    a ``config.pbtxt`` and at least one numeric version directory.
    """
    repo = Path(path)
    if (repo / "manifest.json").is_file() and (repo / "triton_repo").is_dir():  # an export directory
        repo = repo / "triton_repo"
    if not repo.is_dir():
        raise InvalidRepositoryError(f"model repository {repo} does not exist or is not a directory")
    models = sorted(p for p in repo.iterdir() if p.is_dir() and not p.name.startswith("."))
    if not models:
        raise InvalidRepositoryError(f"model repository {repo} contains no model directories")
    for model in models:
        if not (model / "config.pbtxt").is_file():
            raise InvalidRepositoryError(f"model {model.name!r} in {repo} has no config.pbtxt")
        if not any(v.is_dir() and v.name.isdigit() for v in model.iterdir()):
            raise InvalidRepositoryError(
                f"model {model.name!r} in {repo} has no version directory (e.g. {model / '1'})"
            )
    names = {model.name for model in models}
    missing = missing_models(repo)
    if missing:
        raise InvalidRepositoryError(
            f"specdec model repository {repo} is missing model(s) {', '.join(missing)} "
            "(rewrite it with `specdec-export`, or copy the whole triton_repo)"
        )
    for model in models:
        for needed in re.findall(r'model_name:\s*"([^"]+)"', (model / "config.pbtxt").read_text(errors="replace")):
            if needed not in names:
                raise InvalidRepositoryError(
                    f"ensemble {model.name!r} in {repo} uses model {needed!r}, which is missing from the repository"
                )
    return repo

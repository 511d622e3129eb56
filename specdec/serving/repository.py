"""Writes the Triton model repository of an export: five models, configs rendered from ``protocol``.

Layout (``specdec-export --out DIR`` writes it to ``DIR/triton_repo``; the graphs stay in DIR)::

    triton_repo/
      preprocessing/    Python   text_input -> input_ids
      specdec_engine/   Python   decoupled; the one engine and its ragged batch
      postprocessing/   Python   ids -> text_output (incremental, stateless)
      specdec_stream/   ensemble preprocessing -> specdec_engine -> postprocessing (gRPC streaming)
      specdec/          Python   unary infer: calls specdec_stream with stream=false over BLS

``max_batch_size: 0`` everywhere: one request is one prompt (``text_input`` shape [1]) and the
batch is formed by the engine from concurrent requests, not by Triton's batcher.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from specdec.serving import protocol

REPOSITORY_DIR = "triton_repo"
MODELS = ("preprocessing", "specdec_engine", "postprocessing", "specdec_stream", "specdec")
_CLASS_OF = {"preprocessing": "Preprocessing", "specdec_engine": "EngineModel",
             "postprocessing": "Postprocessing", "specdec": "UnaryModel"}


@dataclass(frozen=True)
class ServingOptions:
    """Settings written into the configs (edit the config.pbtxt ``parameters`` to change them later)."""

    intra_op_threads: int = 0  # ONNX Runtime threads of the engine; 0 = all cores
    num_draft_tokens: int = 4  # k when a request does not say
    default_max_tokens: int = 64
    drafter: str = ""  # "" = as exported; "ngram" or "none" overrides
    max_concurrency: int = 64  # unary requests in flight at once


def _tensor(spec: protocol.TensorSpec, optional: bool | None = None) -> str:
    dims = ", ".join(str(d) for d in spec.dims)
    opt = spec.optional if optional is None else optional
    return (f'  {{ name: "{spec.name}" data_type: {spec.dtype} dims: [ {dims} ]'
            + (" optional: true" if opt else "") + " }")


def _io(kind: str, specs: Iterable[protocol.TensorSpec], optional: bool | None = None) -> str:
    return f"{kind} [\n" + ",\n".join(_tensor(s, optional) for s in specs) + "\n]\n"


def _parameters(params: Mapping[str, object]) -> str:
    return "".join(f'parameters {{ key: "{k}" value: {{ string_value: "{v}" }} }}\n' for k, v in params.items())


def _python_model(name: str, inputs: Iterable[protocol.TensorSpec], outputs: Iterable[protocol.TensorSpec],
                  params: Mapping[str, object], decoupled: bool = False) -> str:
    text = f'name: "{name}"\nbackend: "python"\nmax_batch_size: 0\n'
    if decoupled:
        text += "model_transaction_policy { decoupled: true }\n"
    text += _io("input", inputs) + _io("output", outputs, optional=False)
    text += "instance_group [ { kind: KIND_CPU count: 1 } ]\n"
    return text + _parameters(params)


def _map(kind: str, pairs: Iterable[tuple[str, str]]) -> str:
    return "".join(f'    {kind} {{ key: "{k}" value: "{v}" }}\n' for k, v in pairs)


def _ensemble() -> str:
    engine_inputs = [(protocol.INPUT_IDS.name, "_input_ids"), *((s.name, s.name) for s in protocol.PARAMETERS)]
    engine_outputs = [(s.name, f"_{s.name}") for s in protocol.ENGINE_OUTPUTS]
    post_outputs = [(s.name, s.name) for s in protocol.CLIENT_OUTPUTS]
    steps = [
        ("preprocessing", [(s.name, s.name) for s in (protocol.TEXT_INPUT, protocol.APPLY_CHAT_TEMPLATE)],
         [(protocol.INPUT_IDS.name, "_input_ids")]),
        ("specdec_engine", engine_inputs, engine_outputs),
        ("postprocessing", engine_outputs, post_outputs),
    ]
    text = 'name: "specdec_stream"\nplatform: "ensemble"\nmax_batch_size: 0\n'
    text += _io("input", protocol.CLIENT_INPUTS) + _io("output", protocol.CLIENT_OUTPUTS, optional=False)
    text += "ensemble_scheduling {\n"
    for model, inputs, outputs in steps:
        text += f'  step {{\n    model_name: "{model}"\n    model_version: -1\n'
        text += _map("input_map", inputs) + _map("output_map", outputs) + "  }\n"
    return text + "}\n"


def render_configs(export_dir_from_repo: str, options: ServingOptions) -> dict[str, str]:
    """``config.pbtxt`` text of each model; ``export_dir_from_repo`` is the export seen from the repo root."""
    common = {"export_dir": export_dir_from_repo}
    engine = {**common, "intra_op_threads": options.intra_op_threads, "num_draft_tokens": options.num_draft_tokens,
              "default_max_tokens": options.default_max_tokens, "drafter": options.drafter}
    post_inputs = protocol.ENGINE_OUTPUTS
    return {
        "preprocessing": _python_model("preprocessing", (protocol.TEXT_INPUT, protocol.APPLY_CHAT_TEMPLATE),
                                       (protocol.INPUT_IDS,), common),
        "specdec_engine": _python_model("specdec_engine", (protocol.INPUT_IDS, *protocol.PARAMETERS),
                                        protocol.ENGINE_OUTPUTS, engine, decoupled=True),
        "postprocessing": _python_model("postprocessing", post_inputs, protocol.CLIENT_OUTPUTS, common),
        "specdec_stream": _ensemble(),
        "specdec": _python_model("specdec", protocol.CLIENT_INPUTS, protocol.CLIENT_OUTPUTS,
                                 {"max_concurrency": options.max_concurrency}),
    }


def write_repository(export_dir: str | os.PathLike[str], repository: str | os.PathLike[str] | None = None,
                     options: ServingOptions | None = None) -> Path:
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
        if model in _CLASS_OF:
            (version / "model.py").write_text(
                f'"""Triton Python-backend model `{model}` of specdec (see specdec/serving/triton_models.py)."""\n\n'
                f"from specdec.serving.triton_models import {_CLASS_OF[model]} as TritonPythonModel\n\n"
                '__all__ = ["TritonPythonModel"]\n'
            )
    return repo

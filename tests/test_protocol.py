"""The serving protocol's tables and the model repository written from them, without a server."""

from __future__ import annotations

import importlib.util
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from specdec.serving import protocol, repository, triton_io, triton_models
from specdec.serving.inputs import (
    Limits,
    Prompt,
    parse_prompt,
    parse_stops,
)
from specdec.serving.protocol import as_bytes
from specdec.serving.repository import (
    MODELS,
    ServingOptions,
    config_parameters,
    read_parameters,
    render_configs,
    write_repository,
)

MAX_LEN = 2048
INT32_MAX = 2**31 - 1


def test_every_declared_type_has_a_wire_name_and_a_numpy_type() -> None:
    """The client names each input's type on the wire from the same table the configs are rendered from."""
    specs = {
        *protocol.CLIENT_INPUTS,
        *protocol.ENGINE_OUTPUTS,
        *protocol.CLIENT_OUTPUTS,
        protocol.INPUT_IDS,
    }
    assert {s.dtype for s in specs} == set(protocol.NUMPY_OF) == set(protocol.WIRE_DTYPE)
    assert {s.name: s.wire_dtype for s in protocol.CLIENT_INPUTS}["text_input"] == "BYTES"
    assert protocol.array(protocol.STOP, "\n").tolist() == [b"\n"]  # one stop string is one element
    assert protocol.array(protocol.STOP, ["a", "b"]).tolist() == [b"a", b"b"]
    assert protocol.array(protocol.STREAM, True).dtype == np.bool_


def test_as_bytes_round_trips_through_the_parsers() -> None:
    """What the server sends as BYTES is what a client-side parser (same rules) reads back."""
    text = "héllo 你好 🙂"
    array = as_bytes(text)
    assert array.dtype == object and array.shape == (1,) and array[0] == text.encode()
    assert parse_prompt({"text_input": array}) == Prompt(text)
    assert parse_stops(array) == (text,)


# -- model repository ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Tensor:
    dtype: str
    dims: tuple[int, ...]
    optional: bool


_TENSOR = re.compile(
    r'\{ name: "(?P<name>\w+)" data_type: (?P<dtype>TYPE_\w+) dims: \[ (?P<dims>[-\d, ]+) \]'
    r"(?P<optional> optional: true)? \}"
)


def tensors(config: str, kind: str) -> dict[str, Tensor]:
    """The ``input`` or ``output`` block of a config.pbtxt, in order."""
    block = re.search(rf"^{kind} \[\n(.*?)\n\]$", config, re.M | re.S)
    assert block, f"no {kind} block in\n{config}"
    found = {
        m["name"]: Tensor(m["dtype"], tuple(int(d) for d in m["dims"].split(",")), bool(m["optional"]))
        for m in _TENSOR.finditer(block[1])
    }
    assert len(found) == block[1].count("name:"), f"unparsed {kind} entries in\n{block[1]}"
    return found


def decoupled(config: str) -> bool:
    return re.search(r"model_transaction_policy \{ decoupled: true \}", config) is not None


def spec_tensor(spec: protocol.TensorSpec) -> Tensor:
    return Tensor(spec.dtype, spec.dims, spec.optional)


@pytest.fixture(scope="module")
def configs() -> dict[str, str]:
    return render_configs("..", ServingOptions())


def test_every_model_has_a_named_config(configs: dict[str, str]) -> None:
    """Triton refuses a config whose name differs from its directory; the entry points need all five, the launcher
    the readiness gate."""
    assert set(configs) == set(MODELS)
    assert set(MODELS) == {
        "preprocessing",
        "specdec_engine",
        "postprocessing",
        "specdec_stream",
        "specdec",
        "specdec_ready",
    }
    for model, config in configs.items():
        assert re.search(rf'^name: "{model}"$', config, re.M), model
        assert re.search(r'^backend: "python"$', config, re.M), model
        assert re.search(r"^max_batch_size: 0$", config, re.M), model


def test_only_the_engine_and_the_stream_entry_point_are_decoupled(configs: dict[str, str]) -> None:
    """Those two send several responses per request; the unary model and the pre/post steps answer once."""
    assert {m for m, c in configs.items() if decoupled(c)} == {"specdec_engine", "specdec_stream"}


def test_stream_entry_point_interface_is_the_client_protocol(configs: dict[str, str]) -> None:
    """Clients see exactly the tensors of ``protocol``, with its types, shapes and optionality."""
    stream = configs["specdec_stream"]
    inputs, outputs = tensors(stream, "input"), tensors(stream, "output")
    assert list(inputs) == [s.name for s in protocol.CLIENT_INPUTS]
    assert list(outputs) == [s.name for s in protocol.CLIENT_OUTPUTS]
    for spec in protocol.CLIENT_INPUTS:
        assert inputs[spec.name] == spec_tensor(spec), spec.name
    assert [n for n, t in inputs.items() if not t.optional] == []  # a prompt is one of three inputs
    for spec in protocol.CLIENT_OUTPUTS:
        assert outputs[spec.name] == Tensor(spec.dtype, spec.dims, False), spec.name


def test_unary_model_has_the_stream_models_interface(configs: dict[str, str]) -> None:
    """``specdec`` and ``specdec_stream`` take the same request and give the same answer tensors."""
    for kind in ("input", "output"):
        assert tensors(configs["specdec"], kind) == tensors(configs["specdec_stream"], kind), kind


def test_pipeline_passes_only_tensors_the_next_model_declares(configs: dict[str, str]) -> None:
    """preprocessing -> specdec_engine -> postprocessing as the entry points call them over BLS.

    The prompt inputs go to preprocessing, its outputs and every other client input to the engine, each
    engine response whole to postprocessing, whose outputs are the client's: each hop must name tensors
    the receiving model declares, with the same type and shape, and cover its required inputs.
    """
    client = tensors(configs["specdec_stream"], "input")
    pre_in, pre_out = tensors(configs["preprocessing"], "input"), tensors(configs["preprocessing"], "output")
    engine_in, engine_out = tensors(configs["specdec_engine"], "input"), tensors(configs["specdec_engine"], "output")
    post_in, post_out = tensors(configs["postprocessing"], "input"), tensors(configs["postprocessing"], "output")

    def same_type(a: Tensor, c: Tensor) -> bool:
        return (a.dtype, a.dims) == (c.dtype, c.dims)

    prompt = {s.name for s in protocol.PREPROCESSING_INPUTS}
    assert set(pre_in) == prompt
    assert all(same_type(client[n], pre_in[n]) and client[n].optional == pre_in[n].optional for n in prompt)
    # the entry point answers n itself, and sends the client's prompt_ids as the engine's input_ids
    answered_here = {*prompt, protocol.N.name, protocol.PROMPT_IDS.name}
    to_engine = {**{n: t for n, t in client.items() if n not in answered_here}, **pre_out}
    assert set(to_engine) <= set(engine_in), set(to_engine) - set(engine_in)
    assert all(same_type(t, engine_in[n]) for n, t in to_engine.items())
    assert same_type(client[protocol.PROMPT_IDS.name], engine_in[protocol.INPUT_IDS.name])
    assert set(engine_out) == set(post_in) and all(same_type(t, post_in[n]) for n, t in engine_out.items())
    # the entry point adds each response's choice to what postprocessing makes
    client_out = tensors(configs["specdec_stream"], "output")
    assert {protocol.INDEX.name: client_out.pop(protocol.INDEX.name), **post_out} == {
        protocol.INDEX.name: Tensor(protocol.INDEX.dtype, protocol.INDEX.dims, False),
        **client_out,
    }
    assert [n for n, t in engine_in.items() if not t.optional] == []


def test_serving_options_reach_the_configs() -> None:
    """Each option lands in the parameters of the model that reads it."""
    options = ServingOptions(
        intra_op_threads=3,
        num_draft_tokens=7,
        default_max_tokens=99,
        drafter="ngram",
        max_concurrency=5,
        max_batch=6,
        adaptive_draft=True,
        verify_cost=0.02,
        draft_cost=0.25,
        prefill_budget=64,
        max_queue=9,
        verify_by_batch=((1, 0.01), (8, 0.3)),
        limits=Limits(max_prompt_bytes=1000, max_stop_strings=3, max_stop_bytes=20),
    )
    rendered = render_configs("../x", options)
    assert config_parameters(rendered["specdec_engine"]) == {
        "export_dir": "../x",
        "intra_op_threads": "3",
        "num_draft_tokens": "7",
        "default_max_tokens": "99",
        "drafter": "ngram",
        "max_batch": "6",
        "max_request_rows": "512",
        "adaptive_draft": "1",
        "verify_cost": "0.02",
        "draft_cost": "0.25",
        "verify_cost_by_batch": "1:0.01,8:0.3",
        "draft_cost_by_batch": "",
        "prefill_budget": "64",
    }
    assert config_parameters(render_configs("../x", ServingOptions())["specdec_engine"])["adaptive_draft"] == "0"
    for model in ("specdec", "specdec_stream"):
        assert config_parameters(rendered[model]) == {
            "max_concurrency": "5",
            "max_queue": "9",
            "max_prompt_bytes": "1000",
            "max_prompt_ids": "65536",
            "max_stop_strings": "3",
            "max_stop_bytes": "20",
            "max_stop_token_ids": "64",
            "max_word_bytes": "64",
        }, model
    for model in ("preprocessing", "postprocessing"):
        assert config_parameters(rendered[model]) == {"export_dir": "../x"}, model


#: the Triton Python model class of each model
CLASSES = {
    "preprocessing": "Preprocessing",
    "specdec_engine": "EngineModel",
    "postprocessing": "Postprocessing",
    "specdec_stream": "StreamModel",
    "specdec": "UnaryModel",
    "specdec_ready": "ReadinessGate",
}


def load_model_py(path: Path) -> Any:
    spec = importlib.util.spec_from_file_location(f"model_{path.parent.parent.name}", path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def check_repository(repo: Path, export: Path) -> None:
    assert sorted(p.name for p in repo.iterdir()) == sorted(MODELS)
    assert set(CLASSES) == set(MODELS)
    for model, cls in CLASSES.items():
        assert (repo / model / "config.pbtxt").is_file(), model
        module = load_model_py(repo / model / "1" / "model.py")
        assert module.TritonPythonModel is getattr(triton_models, cls), model
        assert callable(getattr(module.TritonPythonModel, "execute", None)), model
    assert triton_models.StreamModel.streaming and not triton_models.UnaryModel.streaming
    for model in ("preprocessing", "specdec_engine", "postprocessing"):
        value = read_parameters(repo, model)["export_dir"]
        assert not Path(value).is_absolute()  # the pair can be moved together
        assert (repo / value).resolve() == export.resolve(), (model, value)
        # what the Python backend resolves at load: model_repository is <repo>/<model>
        args = {
            "model_repository": str(repo / model),
            "model_config": json.dumps({"parameters": {"export_dir": {"string_value": value}}}),
        }
        assert triton_io.export_dir(args) == export.resolve()


def test_write_repository_default_location(tmp_path: Path) -> None:
    """Without a repository argument it goes to ``EXPORT/triton_repo`` and points back with ``..``."""
    export = tmp_path / "export"
    export.mkdir()
    repo = write_repository(export)
    assert repo == export / repository.REPOSITORY_DIR
    check_repository(repo, export)


def test_write_repository_outside_the_export(tmp_path: Path) -> None:
    """A repository elsewhere (e.g. a shared /models) still finds the export."""
    export = tmp_path / "exports" / "smollm2"
    export.mkdir(parents=True)
    repo = write_repository(export, tmp_path / "serve" / "models")
    check_repository(repo, export)


def test_write_repository_relative_paths(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Paths relative to the working directory are resolved before the export is made relative to the repo."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "out").mkdir()
    repo = write_repository("out", "deploy/repo")
    check_repository(tmp_path / repo, tmp_path / "out")


def test_write_repository_rewrites_in_place(tmp_path: Path) -> None:
    """Writing again (new options) replaces the configs instead of failing on the existing tree."""
    export = tmp_path / "export"
    export.mkdir()
    write_repository(export)
    repo = write_repository(export, options=ServingOptions(num_draft_tokens=9))
    assert read_parameters(repo)["num_draft_tokens"] == "9"
    check_repository(repo, export)

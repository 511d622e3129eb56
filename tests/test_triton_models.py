"""Every Python model of the repository built and run in one process, against a stand-in for Triton's utilities
(``tests/triton_stand_in.py``): parsing, admission, the pipeline over BLS, responses, errors and their codes,
cancellation, without a server. The same requests on a real tritonserver are tests/test_serving.py's.

The export is a tiny random LLaMA with a small byte-level BPE tokenizer, drafting for itself: greedy, it accepts
every draft, so the pipeline's speculation runs too.
"""

from __future__ import annotations

import gc
import json
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import triton_stand_in as stand_in
from fault_hooks import SLOW_SEED
from tensors import b, flag, i32

from specdec.runtime.config import EngineConfig
from specdec.runtime.engine import Engine
from specdec.serving import engine_model, entry_points, pb, protocol
from specdec.serving.control import ABORT, DRAIN, Control
from specdec.serving.repository import ServingOptions, read_parameters, write_repository
from specdec.serving.triton_models import EngineModel, Postprocessing, Preprocessing, StreamModel, UnaryModel

CLASSES = {
    protocol.PREPROCESSING_MODEL: Preprocessing,
    protocol.ENGINE_MODEL: EngineModel,
    protocol.POSTPROCESSING_MODEL: Postprocessing,
    protocol.STREAM_MODEL: StreamModel,
    protocol.UNARY_MODEL: UnaryModel,
}


@pytest.fixture(scope="module", autouse=True)
def _frozen_export(tiny_export: Path) -> Iterator[None]:
    """What is alive once the export is made (the exporter's lazily imported modules and caches, when this module
    runs first) is kept out of the garbage collector's sight while the module runs, as
    ``conftest._frozen_survivors`` does before it: every model's ``finalize`` collects on purpose
    (``triton_io.release_senders``), three times per test here, each a walk over all of those objects. Handed back
    at the end, so the module's own survivors do not outlive it."""
    gc.collect()
    gc.freeze()
    yield
    gc.unfreeze()


@pytest.fixture()
def server(tiny_export: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[stand_in.StandInServer]:
    """Every model of the export's repository, initialized as Triton would, behind one stand-in server."""
    monkeypatch.setenv("SPECDEC_CONTROL_DIR", str(tmp_path))
    monkeypatch.setenv("SPECDEC_FAULT_HOOK", "fault_hooks:slow_marked")
    repo = write_repository(tiny_export, options=ServingOptions(prefill_budget=0))
    routes = stand_in.StandInServer()
    previous = stand_in.install(routes)
    try:
        for name, cls in CLASSES.items():
            model = cls()
            model.initialize(stand_in.model_args(name, str(repo), read_parameters(repo, name)))
            routes.models[name] = model
        yield routes
    finally:
        for model in routes.models.values():
            if hasattr(model, "finalize"):  # Triton calls it where a model has it
                model.finalize()
        pb.use(previous)


def call(
    server: stand_in.StandInServer, model: str = protocol.STREAM_MODEL, **inputs: np.ndarray
) -> list[stand_in.InferenceResponse]:
    request = stand_in.InferenceRequest(model, [stand_in.Tensor(k, v) for k, v in inputs.items()], request_id="c1")
    return list(server.send(request))


def text(responses: list[stand_in.InferenceResponse]) -> str:
    return "".join(r.outputs()["text_output"][0].decode() for r in responses)


def ids(responses: list[stand_in.InferenceResponse], index: int = 0) -> list[int]:
    return [t for r in responses if r.outputs()["index"][0] == index for t in r.outputs()["output_ids"].tolist()]


def error(responses: list[stand_in.InferenceResponse]) -> stand_in.TritonError:
    assert len(responses) == 1 and responses[0].has_error(), responses
    return responses[0].error()  # type: ignore[return-value]


def local(tiny_export: Path) -> Engine:
    return Engine.from_export(tiny_export, EngineConfig(max_batch=4, max_len=128))


def test_every_model_is_built_and_answers_as_the_local_engine(server: stand_in.StandInServer, tiny_export: Path):
    """Text through preprocessing, the engine and postprocessing: the streamed ids and text are the local
    engine's greedy answer, and the unary model's one response holds the same."""
    streamed = call(server, text_input=b("hello there"), max_tokens=i32(12), apply_chat_template=flag(True))
    unary = call(
        server, protocol.UNARY_MODEL, text_input=b("hello there"), max_tokens=i32(12), apply_chat_template=flag(True)
    )
    engine = local(tiny_export)
    want = engine.generate([engine.request("hello there", chat=True, max_tokens=12)], "ar").outputs[0]
    assert ids(streamed) == want.token_ids == ids(unary)
    assert text(streamed) == want.text == text(unary)
    last = streamed[-1].outputs()
    assert last["finish_reason"][0].decode() == want.finish_reason
    assert last["prompt_tokens"][0] == len(want.prompt_ids) and last["completion_tokens"][0] == len(want.token_ids)


def test_a_conversation_and_token_ids_are_prompts_too(server: stand_in.StandInServer, tiny_export: Path) -> None:
    conversation = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]
    by_messages = call(server, messages=b(json.dumps(conversation)), max_tokens=i32(8))
    engine = local(tiny_export)
    prompt = engine.encode("hello there", chat=False)
    by_ids = call(server, prompt_ids=np.asarray(prompt, np.int32), max_tokens=i32(8))
    from specdec.runtime.text import encode_messages

    rendered = encode_messages(engine.tokenizer, conversation)
    want = engine.generate([engine.request(rendered, max_tokens=8), engine.request(prompt, max_tokens=8)], "ar")
    assert ids(by_messages) == want.outputs[0].token_ids and ids(by_ids) == want.outputs[1].token_ids


def test_n_choices_each_carry_their_index_and_seed(server: stand_in.StandInServer) -> None:
    """Choice i samples with seed + i: each is what a request for that seed alone answers."""
    common = dict(text_input=b("hello"), max_tokens=i32(6), temperature=np.array([1.0], np.float32))
    three = call(server, n=i32(3), seed=i32(5), **common)
    assert {r.outputs()["index"][0] for r in three} == {0, 1, 2}
    for index in range(3):
        alone = call(server, seed=i32(5 + index), **common)
        assert ids(three, index) == ids(alone)


def test_logprobs_come_with_each_token_and_its_alternatives(server: stand_in.StandInServer) -> None:
    responses = call(server, text_input=b("hello"), max_tokens=i32(5), logprobs=flag(True), top_logprobs=i32(3))
    logprobs = np.concatenate([r.outputs()["output_logprobs"] for r in responses])
    top_ids = np.concatenate([r.outputs()["top_logprob_ids"] for r in responses])
    tokens = [t for r in responses for t in r.outputs()["output_tokens"].tolist()]
    assert len(logprobs) == len(ids(responses)) == len(tokens) and top_ids.shape == (len(logprobs), 3)
    assert np.all(logprobs <= 0) and top_ids[:, 0].tolist() == ids(responses)  # greedy: the top alternative
    assert b"".join(tokens).decode(errors="replace") == text(responses)


@pytest.mark.parametrize(
    "inputs, message",
    [
        (dict(text_input=b("hi"), max_tokens=i32(0)), "max_tokens"),
        (dict(text_input=b("hi"), temperature=np.array([np.nan], np.float32)), "temperature"),
        (dict(text_input=b("hi"), method=b("nope")), "unknown method"),
        (dict(text_input=b("hi"), method=b("x" * 4_000_000)), "method"),
        (dict(text_input=b("hi"), seed=i32(-1)), "seed"),
        (dict(text_input=b("hi"), top_logprobs=i32(2)), "logprobs"),
        (dict(prompt_ids=np.array([10_000], np.int32)), "outside the vocabulary"),
        (dict(text_input=b("word " * 200)), "context"),
        (dict(messages=b("[{]")), "messages"),
        (dict(text_input=b("hi"), n=i32(17)), "n must be"),
    ],
)
def test_bad_input_is_invalid_argument_wherever_it_is_found(server, inputs, message) -> None:
    """Refused by the entry point, preprocessing or the engine alike: INVALID_ARG naming the input, never a
    traceback, and no value echoed back whole."""
    failure = error(call(server, **inputs))
    assert failure.code() == stand_in.TritonError.INVALID_ARG, failure.message()
    assert message in failure.message() and len(failure.message()) < 500 and "Traceback" not in failure.message()


def test_a_drain_refuses_new_requests_and_an_abort_ends_those_in_flight(server, tmp_path: Path) -> None:
    control = Control(tmp_path)
    control.ask(DRAIN)
    refused = error(call(server, text_input=b("hi")))
    assert refused.code() == stand_in.TritonError.UNAVAILABLE and "draining" in refused.message()
    control.ask(ABORT)
    refused = error(call(server, text_input=b("hi")))
    assert refused.code() == stand_in.TritonError.UNAVAILABLE


def test_a_client_that_goes_away_is_cancelled_in_the_engine(server: stand_in.StandInServer) -> None:
    """The one cancellation path: the entry point sees its client gone and leaves a cancel file that the engine
    instance holding the request takes; the request ends at its next step, its slot freed."""
    inputs = dict(text_input=b("hello"), max_tokens=i32(100), min_tokens=i32(100), seed=i32(SLOW_SEED))
    request = stand_in.InferenceRequest(
        protocol.STREAM_MODEL, [stand_in.Tensor(k, v) for k, v in inputs.items()], request_id="gone"
    )
    responses = server.send(request)
    next(responses)  # the first token arrived: the request is decoding
    request.cancelled.set()
    rest = list(responses)
    engine = server.models[protocol.ENGINE_MODEL]
    assert len(rest) < 99
    deadline = time.monotonic() + 30
    while engine.service.stats().active and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine.service.stats().active == 0 and engine.service.stats().cancelled == 1


# -- what the watchers keep alive ------------------------------------------------------------------------------


class FakeClient:
    """Stands for a ``Client``: a request that is never cancelled."""

    done = False

    def is_cancelled(self) -> bool:
        return False


def _released(ref: weakref.ref, timeout_s: float = 30.0) -> bool:
    """Whether the client is released within ``timeout_s``: generous, as a loaded machine may starve the watcher
    thread for seconds, and the answer comes as soon as it is released."""
    deadline = time.monotonic() + timeout_s
    while ref() is not None and time.monotonic() < deadline:
        time.sleep(entry_points.WATCH_POLL_S)
    return ref() is None


def _watched_then_dropped(add: Callable[[FakeClient], None], drop: Callable[[], None]) -> weakref.ref:
    client = FakeClient()
    ref = weakref.ref(client)
    add(client)
    del client
    time.sleep(5 * entry_points.WATCH_POLL_S)  # polled several times while its request runs
    drop()  # the request ended
    return ref


def test_the_watchers_keep_no_client_after_its_request(server: stand_in.StandInServer) -> None:
    """Triton deletes a decoupled request's response factory only when the Python response sender is destroyed,
    and the factory holds the model: a watcher that keeps the last client it looked at keeps its model from
    unloading (``tritonserver`` then fails its exit timeout)."""
    entry = server.models[protocol.STREAM_MODEL]
    assert entry._watcher.is_alive(), "the watcher died: the check below would hold vacuously"
    ref = _watched_then_dropped(lambda c: entry._active.__setitem__("e1", c), lambda: entry._active.pop("e1"))
    assert _released(ref), "the entry point's watcher still holds the last client it polled"
    engine = server.models[protocol.ENGINE_MODEL]
    assert engine._watcher.is_alive()
    ref = _watched_then_dropped(
        lambda c: engine._streams.__setitem__("r1", engine_model._Stream(c, None)),  # type: ignore[arg-type]
        lambda: engine._streams.pop("r1"),
    )
    assert _released(ref), "the engine's watcher still holds the last client it polled"


def test_finalize_stops_every_thread(tiny_export: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECDEC_CONTROL_DIR", str(tmp_path))
    repo = write_repository(tiny_export, options=ServingOptions())
    previous = stand_in.install()
    try:
        before = threading.active_count()
        entry, engine = StreamModel(), EngineModel()
        entry.initialize(stand_in.model_args(protocol.STREAM_MODEL, str(repo), read_parameters(repo, "specdec_stream")))
        engine.initialize(
            stand_in.model_args(protocol.ENGINE_MODEL, str(repo), read_parameters(repo, "specdec_engine"))
        )
        entry.finalize()
        engine.finalize()
        assert not entry._watcher.is_alive() and not engine._watcher.is_alive() and not engine._sender.is_alive()
        assert threading.active_count() <= before + 2  # the services' loop threads end as their stop returns
    finally:
        pb.use(previous)


def test_a_reloaded_gate_publishes_the_launchers_counts_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each load of the readiness gate meets its predecessor's counters (Triton keeps a family by name): it brings
    them up to the launcher's counts, never adds them again."""
    from specdec.serving.control import Control
    from specdec.serving.gate_model import ReadinessGate

    monkeypatch.setenv("SPECDEC_CONTROL_DIR", str(tmp_path))
    monkeypatch.setattr(stand_in.MetricFamily, "families", {})
    previous = stand_in.install()
    try:
        for reloads in (1, 1, 3):
            Control(tmp_path).record(restarts=2, reloads=reloads)
            gate = ReadinessGate()
            gate.initialize(stand_in.model_args(protocol.READY_MODEL, str(tmp_path), {}))
            gate.finalize()
            published = {name: m[()].value() for name, m in stand_in.MetricFamily.families.items()}
            assert published == {"specdec_server_restarts_total": 2, "specdec_server_reloads_total": reloads}
    finally:
        pb.use(previous)

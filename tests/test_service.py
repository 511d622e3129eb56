"""EngineService: the long-lived serving loop (in-flight batching, streaming, cancel, stop, recovery)."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
import torch

from specdec.models.loading import LoadedModel, load_model, tiny_random
from specdec.runtime.backends.torch_backend import TorchBackend
from specdec.runtime.config import EngineConfig
from specdec.runtime.drafters import NgramDrafter
from specdec.runtime.engine import Engine
from specdec.runtime.request import Request, RequestOutput
from specdec.runtime.sampling import InvalidRequestError, SamplingParams
from specdec.runtime.text import streamable
from specdec.serving.service import EngineService, ServiceStoppedError, StreamEvent

MAX_BATCH, MAX_LEN, EOS = 4, 128, 3
#: how long a test waits for an event that must come: generous, because a passing test never waits it out and
#: a loaded CI machine may take many times the usual second; a request that never finishes still fails
WAIT = 120.0


@pytest.fixture(scope="module")
def model() -> LoadedModel:
    return tiny_random(
        seed=21, vocab_size=64, num_layers=1, hidden_size=32, num_heads=2, num_kv_heads=1, intermediate_size=64
    )


def make_engine(model: LoadedModel, **kwargs) -> Engine:
    return Engine(
        TorchBackend(model),
        NgramDrafter(),
        eos_token_ids=[EOS],
        **kwargs,
        config=EngineConfig(max_batch=MAX_BATCH, max_len=MAX_LEN),
    )


@pytest.fixture
def service(model):
    svc = EngineService(make_engine(model), "ems").start()
    yield svc
    svc.stop(drain=False, timeout=10)


@pytest.fixture(scope="module")
def offline(model) -> Callable[[list[Request]], list[RequestOutput]]:
    """Reference outputs from a separate engine (its own cache) decoding the same requests in one batch."""
    ref = make_engine(model)
    return lambda requests: ref.generate(requests, "ems").outputs


class Recorder:
    """Collects one request's events and checks the stream contract."""

    def __init__(self) -> None:
        self.events: list[StreamEvent] = []
        self.lock = threading.Lock()

    def __call__(self, event: StreamEvent) -> None:
        with self.lock:
            self.events.append(event)

    def check(self) -> RequestOutput:
        finals = [e for e in self.events if e.finished]
        assert len(finals) == 1 and self.events[-1] is finals[0], "exactly one final event, and it is last"
        output = finals[0].output
        assert output is not None
        assert [t for e in self.events for t in e.new_token_ids] == output.token_ids
        if output.text is not None:
            assert "".join(e.text_delta for e in self.events) == output.text
        return output


def prompts(n: int, seed: int = 0) -> list[Request]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        length = 3 + (i * 7) % 20
        ids = torch.randint(4, 64, (length,), generator=gen).tolist()
        out.append(Request(tuple(ids), max_tokens=8 + (i * 13) % 40))
    return out


def test_concurrent_submitters_match_offline_and_share_steps(service, offline) -> None:
    requests = prompts(12)
    expected = offline(requests)
    recorders = [Recorder() for _ in requests]
    handles: dict[int, object] = {}
    barrier = threading.Barrier(4)

    def submitter(k: int) -> None:
        barrier.wait()
        for i in range(k, len(requests), 4):
            handles[i] = service.submit(requests[i], recorders[i])

    threads = [threading.Thread(target=submitter, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in range(len(requests)):
        out = handles[i].result(WAIT)
        assert recorders[i].check() == out
        assert out.token_ids == expected[i].token_ids, f"request {i} differs from offline"
        assert out.finish_reason == expected[i].finish_reason
    stats = service.stats()
    assert stats.submitted == stats.finished == 12 and stats.active == 0 and stats.queued == 0
    assert stats.mean_batch_size > 1


def test_request_joins_running_batch(service, offline) -> None:
    a = Request((5, 6, 7, 8, 9), max_tokens=100)
    b = Request((10, 11, 12), max_tokens=20)
    expected = offline([a, b])
    a_running, b_submitted = threading.Event(), threading.Event()
    rec_a, rec_b = Recorder(), Recorder()

    def on_a(event: StreamEvent) -> None:
        rec_a(event)
        if len(rec_a.events) == 2:
            assert not event.finished
            a_running.set()
            b_submitted.wait(WAIT)  # hold the loop between steps until B is queued

    ha = service.submit(a, on_a)
    assert a_running.wait(WAIT)
    hb = service.submit(b, rec_b)  # from this thread, while A is mid-generation
    b_submitted.set()
    out_a, out_b = ha.result(WAIT), hb.result(WAIT)
    assert rec_a.check() == out_a and rec_b.check() == out_b
    assert out_a.token_ids == expected[0].token_ids and out_b.token_ids == expected[1].token_ids
    # fewer target calls in total than the two took part in: some steps served both
    assert service.stats().steps < out_a.metrics.target_calls + out_b.metrics.target_calls


def test_bad_input_refused_at_submit_and_service_keeps_serving(service, offline) -> None:
    with pytest.raises(InvalidRequestError, match="empty"):
        service.submit(Request(()), Recorder())
    with pytest.raises(InvalidRequestError, match="context holds"):
        service.submit(Request(tuple([5] * MAX_LEN)), Recorder())
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        service.submit(Request((5, 64)), Recorder())
    good = Request((4, 5, 6), max_tokens=10)
    handle = service.submit(good, Recorder())
    with pytest.raises(InvalidRequestError, match="already in flight"):
        service.submit(good, Recorder())
    assert handle.result(WAIT).token_ids == offline([good])[0].token_ids
    assert service.stats().submitted == 1


def test_cancel_mid_stream_frees_the_slot(service, offline) -> None:
    victim = Request((5, 6, 7, 8, 9), max_tokens=100, request_id="victim")  # offline: runs to length
    others = [Request((30 + i, 31, 32), max_tokens=30) for i in range(2)]
    queued_victim = Request((40, 41), max_tokens=10, request_id="queued-victim")
    expected = offline(others)
    started, cancelled = threading.Event(), threading.Event()
    rec_v, rec_q = Recorder(), Recorder()
    recs = [Recorder() for _ in others]

    def on_victim(event: StreamEvent) -> None:
        rec_v(event)
        if len(rec_v.events) == 2:
            started.set()
            cancelled.wait(WAIT)

    hv = service.submit(victim, on_victim)
    handles = [service.submit(r, rec) for r, rec in zip(others, recs)]
    fillers = [service.submit(Request((50, 51, 52), max_tokens=100), Recorder()) for _ in range(MAX_BATCH - 3)]
    assert started.wait(WAIT)
    hq = service.submit(queued_victim, rec_q)  # the batch is full: this one waits in the queue
    assert hq.cancel() and hq.done  # a queued request ends at once
    assert service.cancel("victim")
    cancelled.set()
    out_v, out_q = hv.result(WAIT), hq.result(WAIT)
    assert out_v.finish_reason == "cancelled" and out_q.finish_reason == "cancelled" and out_q.token_ids == []
    assert rec_v.check() == out_v and rec_q.check() == out_q
    assert 0 < len(out_v.token_ids) < 100
    assert not service.cancel("victim")  # already over: no second final event
    for h, rec, exp in zip(handles, recs, expected):
        out = h.result(WAIT)
        assert rec.check() == out and out.token_ids == exp.token_ids
    for f in fillers:
        f.cancel()
    filler_reasons = [f.result(WAIT).finish_reason for f in fillers]
    # every slot is free again: a full batch of new requests runs and matches offline
    fresh = prompts(MAX_BATCH, seed=3)
    outs = [h.result(WAIT) for h in [service.submit(r, Recorder()) for r in fresh]]
    assert [o.token_ids for o in outs] == [o.token_ids for o in offline(fresh)]
    stats = service.stats()
    assert stats.active == 0 and stats.cancelled == 2 + filler_reasons.count("cancelled")


def test_stop_drains_then_refuses(model, offline) -> None:
    svc = EngineService(make_engine(model), "ems").start()
    requests = prompts(6, seed=7)
    handles = [svc.submit(r, Recorder()) for r in requests]
    assert svc.stop(drain=True, timeout=WAIT)
    assert all(h.done for h in handles)
    assert [h.result().token_ids for h in handles] == [o.token_ids for o in offline(requests)]
    with pytest.raises(ServiceStoppedError, match="accepts no new requests"):
        svc.submit(Request((4, 5)), Recorder())


def test_stop_without_drain_cancels_everything(model) -> None:
    svc = EngineService(make_engine(model), "ems").start()
    recs = [Recorder() for _ in range(6)]
    handles = [svc.submit(Request((5, 6, 7), max_tokens=100), rec) for rec in recs]
    assert svc.stop(drain=False, timeout=WAIT)
    for h, rec in zip(handles, recs):
        assert rec.check() == h.result()
    assert svc.stats().finished + svc.stats().cancelled == 6


@pytest.mark.parametrize("failing_calls, lost", [({3}, 0), ({3, 4, 5}, 2)])
def test_a_failed_step_is_retried_per_sequence_and_fails_only_what_fails_again(
    model, offline, failing_calls, lost
) -> None:
    """A target step that raises runs again one sequence at a time: a transient failure loses nothing (the
    answers are exact), one that repeats for a sequence fails that sequence; the loop itself never restarts."""
    engine = make_engine(model)
    real_step, calls = engine.target.step, [0]

    def flaky(batch, storage):
        calls[0] += 1
        if calls[0] in failing_calls:
            raise RuntimeError("injected backend failure")
        return real_step(batch, storage)

    engine.target.step = flaky
    svc = EngineService(engine, "ems").start()
    try:
        requests = [Request((5, 6, 7, i + 8), max_tokens=50) for i in range(2)]
        recs = [Recorder() for _ in requests]
        handles = [svc.submit(r, rec) for r, rec in zip(requests, recs)]
        outs = [h.result(WAIT) for h in handles]
        assert [rec.check() for rec in recs] == outs
        failed = [o for o in outs if o.error]
        assert len(failed) == lost and all("injected backend failure" in o.error for o in failed)
        for out, want in zip(outs, offline(requests)):
            if not out.error:
                assert out.token_ids == want.token_ids
        after = Request((9, 10, 11), max_tokens=15)
        assert svc.generate(after, timeout=WAIT).token_ids == offline([after])[0].token_ids
        stats = svc.stats()
        assert stats.failed == lost and stats.loop_restarts == 0
    finally:
        svc.stop(drain=False, timeout=10)


def test_loop_failure_fails_in_flight_and_keeps_serving(model, offline, caplog) -> None:
    """What no sequence owns (here the scheduler, between steps) restarts the loop: its sequences fail, the
    service serves on."""
    engine = make_engine(model)
    svc = EngineService(engine, "ems")
    real_admit, calls = svc.scheduler.admit, [0]

    def flaky(kv, live):
        calls[0] += 1
        if calls[0] == 3 and live:
            raise RuntimeError("injected scheduler failure")
        return real_admit(kv, live)

    svc.scheduler.admit = flaky
    svc.start()
    try:
        recs = [Recorder() for _ in range(2)]
        handles = [svc.submit(Request((5, 6, 7, i + 8), max_tokens=50), rec) for i, rec in enumerate(recs)]
        for h, rec in zip(handles, recs):
            out = h.result(WAIT)
            assert rec.check() == out and out.error and "injected scheduler failure" in out.error
        after = Request((9, 10, 11), max_tokens=15)
        assert svc.generate(after, timeout=WAIT).token_ids == offline([after])[0].token_ids
        stats = svc.stats()
        assert stats.failed == 2 and stats.loop_restarts == 1
        assert "decoding loop" in caplog.text
    finally:
        svc.stop(drain=False, timeout=10)


def test_stream_text_holds_back_partial_characters_and_stop_prefixes() -> None:
    assert streamable("ab\ufffd", ()) == "ab"
    assert streamable("abxy", ("xyz",)) == "ab"
    assert streamable("abx", ("xyz", "q")) == "ab"
    assert streamable("abc", ("xyz",)) == "abc"


@pytest.fixture(scope="module")
def text_engine() -> Engine:
    tokenizer = load_model("smollm2-135m").tokenizer
    tiny = tiny_random(
        seed=5,
        vocab_size=len(tokenizer),
        num_layers=1,
        hidden_size=16,
        num_heads=2,
        num_kv_heads=1,
        intermediate_size=32,
        tie_word_embeddings=True,
        init_std=1.0,
    )
    return Engine(
        TorchBackend(tiny),
        NgramDrafter(),
        tokenizer=tokenizer,
        eos_token_ids=[tokenizer.eos_token_id],
        config=EngineConfig(max_batch=MAX_BATCH, max_len=MAX_LEN),
    )


@pytest.mark.real_model
def test_text_streaming_with_real_tokenizer(text_engine) -> None:
    prompts_text = ["Hello there, how are you", "Ünïcödé 日本語 text ✓", "one two three one two three"]
    requests = [text_engine.request(p, max_tokens=40) for p in prompts_text]  # peaky model: varied, multi-byte text
    expected = text_engine.generate(requests, "ems").outputs
    # a stop string taken from the middle of one offline answer exercises the hold-back of stop prefixes
    middle = expected[0].text[len(expected[0].text) // 2 :][:3]
    stopped = text_engine.request(prompts_text[0], max_tokens=30, stop=[middle] if middle.strip() else [])
    svc = EngineService(text_engine, "ems").start()
    try:
        recs = [Recorder() for _ in range(4)]
        handles = [svc.submit(r, rec) for r, rec in zip([*requests, stopped], recs)]
        outs = [h.result(WAIT) for h in handles]
        for out, rec in zip(outs, recs):
            assert rec.check() == out and isinstance(out.text, str)
        for rec in recs[:3]:  # text arrives incrementally, not only with the final event
            assert sum(1 for e in rec.events if e.text_delta and not e.finished) >= 1
        for out, exp in zip(outs, expected):
            assert out.token_ids == exp.token_ids and out.text == exp.text
    finally:
        svc.stop(drain=False, timeout=10)


@pytest.mark.real_model
def test_a_caller_that_wants_no_text_gets_the_same_tokens_and_the_loop_never_detokenizes(text_engine) -> None:
    """The Triton engine model works from token ids (postprocessing re-decodes the text): submitted with
    ``text=False``, a request costs the decoding thread no detokenization at all, its events carry no text and
    its output none, and its tokens, finish reasons and stream contract are those of a request that wants text."""
    engine = text_engine.sibling()  # same weights and tokenizer, its own caches, and a decode of its own to count
    decoded: list[int] = []
    real_decode = engine.decode

    def counting_decode(ids) -> str:
        decoded.append(len(ids))
        return real_decode(ids)

    engine.decode = counting_decode

    def requests() -> list[Request]:  # no stop strings: only they make the stopper itself read text
        return [text_engine.request(p, max_tokens=24) for p in ("Hello there, how are you", "Ünïcödé 日本語")]

    with EngineService(engine, "ems") as svc:
        recs = [Recorder() for _ in range(2)]
        silent = [h.result(WAIT) for h in [svc.submit(r, rec, text=False) for r, rec in zip(requests(), recs)]]
        assert decoded == [], "the loop detokenized for callers that want no text"
        for out, rec in zip(silent, recs):
            assert rec.check() == out and out.text is None and len(rec.events) > 1
            assert all(e.text_delta == "" for e in rec.events)
        texts = [svc.generate(r, WAIT) for r in requests()]
        assert decoded, "a caller that wants text gets it decoded"
    assert [o.token_ids for o in silent] == [o.token_ids for o in texts]
    assert [o.finish_reason for o in silent] == [o.finish_reason for o in texts]
    assert all(isinstance(o.text, str) for o in texts)
    queued = EngineService(engine, "ems")  # never started: its requests end cancelled, unadmitted
    quiet, spoken = (queued.submit(r, Recorder(), text=t) for r, t in zip(requests(), (False, True)))
    assert quiet.cancel() and spoken.cancel()
    assert quiet.result(WAIT).text is None and spoken.result(WAIT).text == ""
    queued.stop()


@pytest.mark.parametrize("memory_mode", ["single", "full"])
@pytest.mark.real_model
def test_a_streamed_beam_answer_is_cut_at_a_stop_string_exactly_as_the_whole_answer_would_be(
    text_engine, memory_mode: str
) -> None:
    """A beam request streams the prefix its candidates share, so a stop string can end it mid-search; its answer
    is still the search's best candidate cut by the stopper, as if emitted whole at the end (the search itself
    ignores stop strings), and the stream joins into that answer without ever showing the stop string."""
    from specdec.runtime.request import BeamParams, SeqState, StopChecker

    def request(stop: list[str]) -> Request:
        return text_engine.request(
            "Hello there, how are you", max_tokens=30, stop=stop, beam=BeamParams(width=2, memory_mode=memory_mode)
        )

    whole = text_engine.generate([request([])], "beam").outputs[0]
    stop = whole.text[len(whole.text) // 2 :][:3]
    assert stop.strip(), "the answer's middle has no visible text to stop at"
    cut = SeqState.start(request([stop]), 0)
    StopChecker(text_engine.eos_token_ids, MAX_LEN, text_engine.decode).append(cut, whole.token_ids)
    assert cut.finish_reason == "stop" and len(cut.output_ids) < len(whole.token_ids)
    offline = text_engine.generate([request([stop])], "beam").outputs[0]
    assert offline.token_ids == cut.output_ids and offline.finish_reason == "stop"
    assert [c.token_ids for c in offline.sequences] == [c.token_ids for c in whole.sequences]
    with EngineService(text_engine, "beam") as svc:
        rec = Recorder()
        out = svc.submit(request([stop]), rec).result(WAIT)
    assert rec.check() == out and out.token_ids == cut.output_ids and stop not in out.text
    assert all(stop not in e.text_delta for e in rec.events)


@pytest.mark.parametrize("method", ["ar", "vanilla"])
def test_other_methods_serve_the_same_tokens(model, offline, method) -> None:
    requests = prompts(6, seed=11)
    with EngineService(make_engine(model), method) as svc:
        outs = [h.result(WAIT) for h in [svc.submit(r, Recorder()) for r in requests]]
    assert [o.token_ids for o in outs] == [o.token_ids for o in offline(requests)]
    with pytest.raises(ValueError, match="unknown method"):
        EngineService(make_engine(model), "magic")


def test_a_beam_request_cancelled_mid_run_ends_cancelled_and_frees_its_beams(model) -> None:
    """Beam loops stream only what every candidate shares, maybe nothing for a long while, so they also learn of
    a cancellation between rounds (``is_cancelled``)."""
    from specdec.runtime.drafters import ModelDrafter
    from specdec.runtime.request import BeamParams

    def dsbd_engine() -> Engine:
        return Engine(
            TorchBackend(model),
            ModelDrafter(TorchBackend(model), 8, MAX_LEN),
            eos_token_ids=[EOS],
            config=EngineConfig(max_batch=8, max_len=MAX_LEN, num_draft_tokens=2),
        )

    victim = Request((5, 6, 7, 8), max_tokens=100, request_id="victim", beam=BeamParams(width=4))
    other = Request((9, 10, 11), max_tokens=20, sampling=SamplingParams(1.0, 0, 1.0, 4), beam=BeamParams(width=3))
    expected = dsbd_engine().generate([other], "dsbd").outputs[0]
    svc = EngineService(dsbd_engine(), "dsbd")
    admitted = svc._admitted

    def cancel_on_admit(seqs) -> None:  # the victim holds its slot but has not run a round yet
        admitted(seqs)
        if any(s.request.request_id == "victim" for s in seqs):
            assert svc.cancel("victim")

    svc.scheduler._on_admit = cancel_on_admit
    with svc:
        rec_v, rec_o = Recorder(), Recorder()
        hv, ho = svc.submit(victim, rec_v), svc.submit(other, rec_o)
        out_v, out_o = hv.result(WAIT), ho.result(WAIT)
        assert out_v.finish_reason == "cancelled" and out_v.token_ids == [] and rec_v.check() == out_v
        assert out_o.token_ids == expected.token_ids and rec_o.check() == out_o
        again = svc.generate(Request((12, 13), max_tokens=5, beam=BeamParams(width=2)), WAIT)
        assert len(again.token_ids) >= 1
        stats = svc.stats()
        assert stats.active == 0 and stats.kv_slots == 0 and stats.cancelled == 1 and stats.finished == 2


class FakeClock:
    """The service's clock, moved by the test: a deadline passes exactly when the test says, however slow the
    machine is."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_deadline_ends_live_and_queued_requests_timeout_and_frees_their_slots(model, offline) -> None:
    """A live request past its deadline ends ``timeout`` at the next step with what it streamed (a prefix of its
    answer); a queued one ends at the next ``expire`` with nothing; batch-mates are untouched; every slot is free
    again. The deadline is in the service's clock, moved by the test between steps."""
    clock = FakeClock()
    svc = EngineService(make_engine(model), "ems", clock=clock).start()
    try:
        victim = Request((5, 6, 7, 8, 9), max_tokens=100, request_id="late")
        others = [Request((30 + i, 31, 32), max_tokens=30) for i in range(2)]
        fillers = [Request((50, 51, 52), max_tokens=100, request_id=f"filler-{i}") for i in range(MAX_BATCH - 3)]
        queued = Request((40, 41), max_tokens=10, request_id="late-queued")
        expected = offline([victim, *others])
        started, moved = threading.Event(), threading.Event()
        rec_v = Recorder()

        def on_victim(event: StreamEvent) -> None:
            rec_v(event)
            if len(rec_v.events) == 2:
                started.set()
                moved.wait(WAIT)  # hold the loop between steps while the test moves the clock past the deadline

        with pytest.raises(InvalidRequestError, match="timeout"):
            svc.submit(Request((4, 5)), Recorder(), timeout_s=0)
        hv = svc.submit(victim, on_victim, timeout_s=5.0)
        handles = [svc.submit(r, Recorder(), timeout_s=3600.0) for r in others]
        hf = [svc.submit(r, Recorder()) for r in fillers]
        assert started.wait(WAIT)
        rec_q = Recorder()
        hq = svc.submit(queued, rec_q, timeout_s=5.0)  # the batch is full: it waits in the queue
        clock.now += 10.0
        assert sorted(svc.expire()) == ["late", "late-queued"]  # the queued one ends now, the live one at its step
        assert hq.done and not hv.done
        moved.set()
        out_v, out_q = hv.result(WAIT), hq.result(WAIT)
        assert out_v.finish_reason == "timeout" and out_q.finish_reason == "timeout" and out_q.token_ids == []
        assert rec_v.check() == out_v and rec_q.check() == out_q
        assert 0 < len(out_v.token_ids) < len(expected[0].token_ids)
        assert out_v.token_ids == expected[0].token_ids[: len(out_v.token_ids)]
        for h, exp in zip(handles, expected[1:]):
            assert h.result(WAIT).token_ids == exp.token_ids
        for f in hf:
            f.cancel()
            f.result(WAIT)
        fresh = prompts(MAX_BATCH, seed=5)  # every slot is free again
        outs = [h.result(WAIT) for h in [svc.submit(r, Recorder()) for r in fresh]]
        assert [o.token_ids for o in outs] == [o.token_ids for o in offline(fresh)]
        stats = svc.stats()
        assert stats.timed_out == 2 and stats.active == 0 and stats.kv_slots == 0
    finally:
        svc.stop(drain=False, timeout=10)


def test_the_loop_itself_ends_a_live_request_at_its_deadline(model, offline) -> None:
    """No ``expire`` call: the loop's own check at the step boundary ends a sequence whose deadline passed."""
    clock = FakeClock()
    svc = EngineService(make_engine(model), "ems", clock=clock).start()
    try:
        request = Request((5, 6, 7, 8, 9), max_tokens=100)
        events: list[StreamEvent] = []

        def on_event(event: StreamEvent) -> None:
            events.append(event)
            if len(events) == 2:
                clock.now += 10.0  # from the loop thread, between two steps

        out = svc.submit(request, on_event, timeout_s=5.0).result(WAIT)
        assert out.finish_reason == "timeout" and 0 < len(out.token_ids) < 100
        assert out.token_ids == offline([request])[0].token_ids[: len(out.token_ids)]
        assert svc.stats().timed_out == 1 and svc.stats().kv_slots == 0
    finally:
        svc.stop(drain=False, timeout=10)

"""Contracts of the decoding loops: no padding in ems, in-flight admission, capacity back-pressure,
stop conditions, and bad input that is refused clearly without losing other requests."""

from __future__ import annotations

import numpy as np
import pytest

from specdec.models.errors import DraftMismatchError, ModelResolutionError
from specdec.models.loading import load_model, tiny_random
from specdec.runtime.backends.torch_backend import TorchBackend
from specdec.runtime.config import EngineConfig
from specdec.runtime.drafters import Draft, NgramDrafter
from specdec.runtime.engine import Engine
from specdec.runtime.kv import KVCacheManager
from specdec.runtime.request import Request
from specdec.runtime.sampling import InvalidRequestError, SamplingParams
from specdec.runtime.scheduler import Scheduler


@pytest.fixture(scope="module")
def target():
    return tiny_random(
        seed=21, vocab_size=64, num_layers=1, hidden_size=32, num_heads=2, num_kv_heads=1, intermediate_size=64
    )


class SpyDrafter(NgramDrafter):
    """The n-gram drafter, recording the draft length of every sequence in every call."""

    def __init__(self) -> None:
        super().__init__(max_ngram=2)
        self.calls: list[list[int]] = []

    def propose(self, seqs, ks) -> list[Draft]:
        drafts = super().propose(seqs, ks)
        self.calls.append([len(d.tokens) for d in drafts])
        return drafts


def _repetitive_prompts() -> list[list[int]]:
    return [[1, 2, 3, 4] * 6, [5, 6] * 3, [7, 8, 9] * 10 + [10], [11]]


def test_ems_processes_exactly_the_real_rows_and_vanilla_pads(target) -> None:
    for method in ("ems", "vanilla"):
        spy = SpyDrafter()
        engine = Engine(TorchBackend(target), spy, config=EngineConfig(max_batch=4, max_len=512, num_draft_tokens=5))
        run = engine.generate([Request(p, max_tokens=24) for p in _repetitive_prompts()], method).run
        decode_steps = [s for s in run.steps if s.prefill_rows == 0]
        assert len(decode_steps) == len(spy.calls) > 3
        for step, lengths in zip(decode_steps, spy.calls):
            if method == "ems":
                assert step.batch_size == len(lengths)  # finished samples left the pack
                assert step.rows == sum(1 + k for k in lengths)  # backend's own row counter
                assert step.padded_rows == 0
            else:
                assert step.batch_size == 4  # static batch: finished samples still compute padding
                assert step.rows == step.batch_size * (1 + max(lengths))
        if method == "ems":
            assert run.summary()["target_rows_padded"] == 0
        else:
            assert run.summary()["target_rows_padded"] > 0
        assert any(len(set(lengths)) > 1 for lengths in spy.calls), "draft lengths should differ per sample"


def test_in_flight_admission_and_capacity_backpressure(target) -> None:
    """More requests than slots: the scheduler waits for free slots; outputs do not change."""
    prompts = [[i + 1, i + 2, i + 3] for i in range(7)]
    requests = [Request(p, max_tokens=5 + 3 * i) for i, p in enumerate(prompts)]
    small = Engine(TorchBackend(target), NgramDrafter(), config=EngineConfig(max_batch=2, max_len=128))
    big = Engine(TorchBackend(target), NgramDrafter(), config=EngineConfig(max_batch=8, max_len=128))
    for method in ("ar", "ems"):
        got = small.generate(requests, method)
        want = big.generate(requests, method)
        assert [o.token_ids for o in got.outputs] == [o.token_ids for o in want.outputs]
        assert max(s.batch_size for s in got.run.steps) == 2
        # a request joined while others were mid-generation: a step mixed prefill and decode rows
        if method == "ems":
            assert any(0 < s.prefill_rows < s.rows for s in got.run.steps)


def test_scheduler_waits_when_cache_is_full(target) -> None:
    backend = TorchBackend(target)
    kv = KVCacheManager(backend.allocate_cache(2, 32))
    scheduler = Scheduler(max_batch=8)
    for i in range(3):
        scheduler.submit(Request([1, 2, 3], request_id=f"r{i}"))
    first = scheduler.admit(kv, num_live=0)
    assert len(first) == 2 and scheduler.pending() == 1
    assert scheduler.admit(kv, num_live=2) == []  # full: waits, does not raise
    kv.free(first[0].slot)
    assert [s.request.request_id for s in scheduler.admit(kv, num_live=1)] == ["r2"]


def test_stop_conditions(target) -> None:
    engine = Engine(TorchBackend(target), NgramDrafter(), config=EngineConfig(max_batch=2, max_len=40))
    free = engine.generate([Request([1, 2, 3], max_tokens=30)], "ar").outputs[0]
    eos = free.token_ids[4]
    engine.eos_token_ids = (eos,)
    first = free.token_ids.index(eos)
    for method in ("ar", "vanilla", "ems"):
        out = engine.generate([Request([1, 2, 3], max_tokens=30)], method).outputs[0]
        assert out.token_ids == free.token_ids[: first + 1] and out.finish_reason == "stop"
    engine.eos_token_ids = ()
    # context end: 40 slots, 3 prompt tokens -> at most 37 tokens in total, and the answer says the context ended it
    for method in ("ar", "ems", "beam"):
        out = engine.generate([Request([1, 2, 3], max_tokens=100)], method).outputs[0]
        assert len(out.prompt_ids) + len(out.token_ids) == 40 and out.finish_reason == "context", method
    # max_tokens reached exactly where the context ends too: max_tokens is what the client asked, so "length"
    out = engine.generate([Request([1, 2, 3], max_tokens=37)], "ems").outputs[0]
    assert len(out.token_ids) == 37 and out.finish_reason == "length"


@pytest.mark.parametrize(
    "bad, message",
    [
        (dict(prompt_ids=()), "prompt is empty"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(max_tokens=-3), "max_tokens"),
        (dict(num_draft_tokens=-1), "num_draft_tokens"),
        (dict(stop=("",)), "stop"),
    ],
)
def test_bad_request_fields(bad, message) -> None:
    fields = {"prompt_ids": (1, 2), **bad}
    with pytest.raises(InvalidRequestError, match=message):
        Request(**fields)


@pytest.mark.parametrize(
    "bad, message",
    [
        (dict(temperature=-0.5), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-1), "top_k"),
        (dict(seed=-1), "seed"),
    ],
)
def test_bad_sampling_params(bad, message) -> None:
    with pytest.raises(InvalidRequestError, match=message):
        SamplingParams(**bad)


def test_prompt_longer_than_context_and_bad_ids(target) -> None:
    engine = Engine(TorchBackend(target), None, config=EngineConfig(max_batch=2, max_len=16))
    with pytest.raises(InvalidRequestError, match="context"):
        engine.request(list(range(1, 17)))
    with pytest.raises(InvalidRequestError, match="vocabulary"):
        engine.request([1, 64, 2])
    with pytest.raises(InvalidRequestError, match="tokenizer"):
        engine.request("text needs a tokenizer")
    with pytest.raises(ValueError, match="unknown method"):
        engine.generate([Request([1])], "beam-me-up")


def test_one_bad_request_does_not_lose_the_others(target) -> None:
    engine = Engine(TorchBackend(target), NgramDrafter(), config=EngineConfig(max_batch=4, max_len=32))
    good = [Request([1, 2, 3], max_tokens=6), Request([4, 5], max_tokens=9)]
    alone = engine.generate(good, "ems").outputs
    items = [
        good[0],
        Request(list(range(40)), max_tokens=4),
        InvalidRequestError("prompt 2: top_p must be in (0, 1]"),
        good[1],
    ]
    outputs = engine.generate(items, "ems").outputs
    assert outputs[1].error and "context" in outputs[1].error and outputs[1].token_ids == []
    assert "top_p" in outputs[2].error
    assert outputs[0].token_ids == alone[0].token_ids and outputs[3].token_ids == alone[1].token_ids
    assert outputs[0].error is None and outputs[3].error is None


def test_unknown_preset_and_unreadable_paths(tmp_path) -> None:
    with pytest.raises(ModelResolutionError, match=r"unknown model 'no-such-model'.*smollm2-135m"):
        load_model("no-such-model")
    with pytest.raises(ModelResolutionError, match=r"no config\.json"):
        load_model(tmp_path)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{ not json")
    with pytest.raises(ModelResolutionError, match="cannot read"):
        load_model(broken)
    bad_gguf = tmp_path / "model.gguf"
    bad_gguf.write_bytes(b"not a gguf file")
    with pytest.raises(ModelResolutionError, match="GGUF"):
        load_model(bad_gguf)


def test_draft_with_other_vocabulary_is_refused(target) -> None:
    other = tiny_random(seed=3, vocab_size=65, num_layers=1, hidden_size=32, num_heads=2, num_kv_heads=1)
    with pytest.raises(DraftMismatchError, match=r"vocabulary of 65 tokens.*64"):
        Engine.from_models(target, other)


def test_identical_results_across_repeated_runs(target) -> None:
    """A run leaves no state behind: the KV manager and drafters start fresh each time."""
    engine = Engine(TorchBackend(target), NgramDrafter(), config=EngineConfig(max_batch=3, max_len=64))
    requests = [
        Request([1, 2, 1, 2, 1], max_tokens=12, sampling=SamplingParams(0.8, seed=7)),
        Request([3, 4], max_tokens=12),
    ]
    first = engine.generate(requests, "ems").outputs
    second = engine.generate(requests, "ems").outputs
    assert [o.token_ids for o in first] == [o.token_ids for o in second]
    assert np.array_equal(np.array(first[1].token_ids), np.array(second[1].token_ids))

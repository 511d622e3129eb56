"""The hybrid drafter: prompt lookup where the context matches, the draft model elsewhere, per sequence and step.

Scripted backends (``tests/fakes.py``) make every count exact: which sequences the draft model saw, what each
proposal was, and that the answers are the target's own.
"""

from __future__ import annotations

import pytest
import torch
from fakes import ScriptedBackend, counting
from test_cli import run_json

from specdec.models.loading import tiny_random
from specdec.runtime.config import DrafterKind, EngineConfig
from specdec.runtime.drafters import HybridDrafter, ModelDrafter, NgramDrafter, make_drafter
from specdec.runtime.engine import Engine
from specdec.runtime.request import BeamParams, Request, SeqState

VOCAB = 64


def _seq(tokens: list[int], slot: int = 0) -> SeqState:
    return SeqState.start(Request(tuple(tokens), max_tokens=16), slot)


def test_lookup_drafts_where_the_context_repeats_and_the_model_elsewhere() -> None:
    draft = ScriptedBackend(counting(VOCAB, stride=2), VOCAB)  # the model proposes +2 steps: recognisable
    hybrid = HybridDrafter(NgramDrafter(max_ngram=2, min_ngram=2), ModelDrafter(draft, 4, 64))
    quoting = _seq([7, 8, 9, 10, 30, 7, 8], slot=0)  # "7 8" occurred before, followed by "9 10 30"
    fresh = _seq([1, 2, 3], slot=1)  # no repeated 2-gram
    drafts = hybrid.propose([quoting, fresh], [3, 3])
    assert drafts[0].tokens == [9, 10, 30] and drafts[0].probs is None  # copied from the context
    assert drafts[1].tokens == [5, 7, 9]  # the model's
    assert all(b.num_seqs == 1 for b in draft.batches)  # the model ran for the fresh sequence only
    assert hybrid.propose([quoting, fresh], [0, 0])[0].tokens == []  # k = 0 drafts nothing, from either
    assert draft.calls == 3


def test_greedy_hybrid_ems_equals_ar_and_uses_both_drafters() -> None:
    target = ScriptedBackend(lambda c: c[-3] if len(c) >= 3 and c[-1] == c[-2] else (c[-1] + 1) % VOCAB, VOCAB)
    draft = ScriptedBackend(counting(VOCAB), VOCAB)
    hybrid = make_drafter("hybrid", max_batch=4, max_len=96, ngram=2, min_ngram=2, model=draft)
    engine = Engine(target, hybrid, config=EngineConfig(max_batch=4, max_len=96, num_draft_tokens=4))
    prompts = [[5, 6, 7, 5, 6], [40, 41], [9, 9, 1, 2, 9, 9]]
    requests = [engine.request(p, max_tokens=20) for p in prompts]
    ar = engine.generate(requests, "ar").outputs
    ems = engine.generate(requests, "ems")
    assert [o.token_ids for o in ems.outputs] == [o.token_ids for o in ar]
    assert draft.calls > 0 and ems.run.summary()["draft_tokens"] > 0


def test_a_hybrid_needs_a_draft_model_and_forks_both_halves() -> None:
    with pytest.raises(ValueError, match="needs a draft model"):
        make_drafter("hybrid", max_batch=2, max_len=16)
    draft = ScriptedBackend(counting(VOCAB), VOCAB)
    hybrid = make_drafter("hybrid", max_batch=2, max_len=16, model=draft)
    twin = hybrid.fork()
    assert isinstance(twin, HybridDrafter) and twin.model.backend is draft and twin.model.kv is not hybrid.model.kv
    assert twin.lookup is not hybrid.lookup


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_seeded_hybrid_answers_do_not_depend_on_the_batch(temperature: float) -> None:
    """The choice of drafter depends on a sequence's own tokens only, so its answer is the same alone and in a
    batch (greedy, and seeded sampling on a tiny torch model)."""
    target, draft = tiny_random(seed=1, vocab_size=64), tiny_random(seed=2, vocab_size=64)
    torch.manual_seed(0)
    engine = Engine.from_models(
        target, draft, config=EngineConfig(max_batch=4, max_len=96, num_draft_tokens=3, drafter=DrafterKind.HYBRID)
    )
    assert isinstance(engine.drafter, HybridDrafter)
    prompts = [[3, 4, 5, 3, 4], [10, 11, 12], [7, 7, 7, 7]]
    together = engine.generate(
        [engine.request(p, max_tokens=12, temperature=temperature, seed=i) for i, p in enumerate(prompts)], "ems"
    ).outputs
    for i, p in enumerate(prompts):
        alone = engine.generate([engine.request(p, max_tokens=12, temperature=temperature, seed=i)], "ems")
        assert alone.outputs[0].token_ids == together[i].token_ids
    if temperature == 0.0:
        ar = engine.generate([engine.request(p, max_tokens=12) for p in prompts], "ar").outputs
        assert [o.token_ids for o in together] == [o.token_ids for o in ar]


def test_generate_takes_the_hybrid_drafter_and_stays_exact(tiny_dir, capsys) -> None:
    common = [
        "--target",
        str(tiny_dir),
        "--prompt",
        "one two three one two three",
        "--prompt",
        "Hello there",
        "--max-tokens",
        "10",
    ]
    hybrid = run_json(capsys, *common, "--method", "ems", "--draft", str(tiny_dir), "--drafter", "hybrid")
    ar = run_json(capsys, *common, "--method", "ar")
    assert [o["token_ids"] for o in hybrid["outputs"]] == [o["token_ids"] for o in ar["outputs"]]
    assert hybrid["metrics"]["draft_tokens"] > 0


def test_a_hybrid_export_serves_dsbd_with_its_draft_model(tiny_dir, tmp_path) -> None:
    """The served engine runs dsbd wherever its drafter can beam-sample forests: the draft model alone or inside
    the hybrid drafter (the main job serves a hybrid export and asks for a dsbd answer); prompt lookup cannot."""
    from specdec.export.cli import main as export_main
    from specdec.runtime.drafters import ForestDrafter
    from specdec.runtime.methods import beam_method
    from specdec.serving.engine_model import served_engine
    from specdec.serving.repository import read_parameters

    out = tmp_path / "deploy"
    assert (
        export_main(
            [
                "--target",
                str(tiny_dir),
                "--draft",
                str(tiny_dir),
                "--drafter",
                "hybrid",
                "--out",
                str(out),
                "--max-batch",
                "2",
                "--max-len",
                "128",
            ]
        )
        == 0
    )
    engine = served_engine(out, read_parameters(out / "triton_repo"))
    assert isinstance(engine.drafter, HybridDrafter) and isinstance(engine.drafter, ForestDrafter)
    assert beam_method(isinstance(engine.drafter, ForestDrafter)) == "dsbd"
    assert not isinstance(NgramDrafter(), ForestDrafter)
    request = engine.request(
        "hello there", max_tokens=6, temperature=1.0, seed=3, num_draft_tokens=2, beam=BeamParams(width=2)
    )
    result = engine.sibling().generate([request], "dsbd")
    assert result.outputs[0].error is None and result.outputs[0].token_ids
    assert result.run.summary()["draft_tokens"] > 0  # the forests came from the hybrid drafter's draft model


def test_the_adaptive_length_prices_and_counts_each_proposer_on_its_own() -> None:
    """A lookup's draft tokens are free, the model's cost what the calibration says: with a model too dear to
    pay, lookups still draft and the model never runs (one price for both would stop both), and each proposer's
    verifications are counted apart (``SeqState.draft_stats``)."""
    from specdec.runtime.draft_length import DraftLength

    target = ScriptedBackend(lambda c: c[-3] if len(c) >= 3 and c[-1] == c[-2] else (c[-1] + 1) % VOCAB, VOCAB)
    draft = ScriptedBackend(counting(VOCAB), VOCAB)
    hybrid = make_drafter("hybrid", max_batch=4, max_len=96, ngram=2, min_ngram=2, model=draft)
    dear = DraftLength(draft_cost=1.0, verify_cost=0.05, probe_every=1000)  # a model draft: a whole target step
    engine = Engine(target, hybrid, config=EngineConfig(max_batch=4, max_len=96, num_draft_tokens=4, draft_length=dear))
    prompts = [[5, 6, 7, 5, 6], [40, 41], [9, 9, 1, 2, 9, 9]]
    # the answer that copies its prompt is the longest: the batch is its to shorten (``DraftLength.plan``)
    requests = [engine.request(p, max_tokens=n) for p, n in zip(prompts, (30, 12, 12))]
    ar = engine.generate(requests, "ar").outputs
    ems = engine.generate(requests, "ems")
    assert [o.token_ids for o in ems.outputs] == [o.token_ids for o in ar]
    assert ems.run.summary()["draft_tokens"] > 0 and draft.calls == 0
    assert set(engine.planner.pooled) <= {HybridDrafter.LOOKUP, HybridDrafter.MODEL, ""}
    assert engine.planner.pooled[HybridDrafter.LOOKUP].reached[0] > 0  # lookups verified, counted as lookups
    model = engine.planner.pooled.get(HybridDrafter.MODEL)
    assert model is None or not model.reached  # the model drafted nothing, so nothing was counted for it
    # the negative control: the same hybrid seen as one drafter (the model's price for every token) drafts nothing
    single = Engine(
        target,
        _OnePrice(make_drafter("hybrid", max_batch=4, max_len=96, ngram=2, min_ngram=2, model=draft)),
        config=EngineConfig(max_batch=4, max_len=96, num_draft_tokens=4, draft_length=dear),
    )
    assert single.generate(requests, "ems").run.summary()["draft_tokens"] == 0


class _OnePrice:
    """A hybrid without ``source``: priced and counted as one drafter, as before the policy asked per proposer."""

    def __init__(self, inner: HybridDrafter) -> None:
        self.inner, self.vocab_size, self.relative_cost = inner, inner.vocab_size, inner.relative_cost

    def propose(self, seqs, ks):
        return self.inner.propose(seqs, ks)

    def release(self, seq) -> None:
        self.inner.release(seq)

    def reset(self) -> None:
        self.inner.reset()

    def fork(self) -> _OnePrice:
        return _OnePrice(self.inner.fork())


def test_a_drafter_that_cannot_tell_its_proposer_costs_only_speed(caplog) -> None:
    """``source`` raising prices that sequence as one drafter's; every answer stays the target's own."""
    from specdec.runtime.draft_length import DraftLength

    target = ScriptedBackend(lambda c: c[-3] if len(c) >= 3 and c[-1] == c[-2] else (c[-1] + 1) % VOCAB, VOCAB)
    hybrid = make_drafter(
        "hybrid", max_batch=4, max_len=96, ngram=2, min_ngram=2, model=ScriptedBackend(counting(VOCAB), VOCAB)
    )

    def broken(seq):
        raise RuntimeError("no index")

    hybrid.source = broken  # type: ignore[method-assign]
    engine = Engine(
        target, hybrid, config=EngineConfig(max_batch=4, max_len=96, num_draft_tokens=4, draft_length=DraftLength())
    )
    requests = [engine.request(p, max_tokens=20) for p in ([5, 6, 7, 5, 6], [40, 41])]
    ar = engine.generate(requests, "ar").outputs
    ems = engine.generate(requests, "ems")
    assert [o.token_ids for o in ems.outputs] == [o.token_ids for o in ar] and not any(o.error for o in ems.outputs)
    assert "could not tell the proposer" in caplog.text and set(engine.planner.pooled) == {""}

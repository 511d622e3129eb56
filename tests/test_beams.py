"""Beam decoding in the runtime: the ``beam`` baseline and DSBD on real (tiny) models and real KV caches.

The per-slot law of DSBD is tested on enumerable tables in ``test_dsbd_math.py``. Here the
runtime is held to that verified reference: one DSBD round of the runtime (draft forest as
ragged draft steps, all forests in one packed target call, KV compaction and forks) must
make exactly the draws of :func:`dsbd_reference.dsbd_round` (tests/dsbd_reference.py) run on the same models'
full-prefix distributions with the same RNG stream. Then the properties the issue names:
rows per step, K/V of surviving beams, γ = 0 and draft = target reductions, greedy DSBD =
beam search, and batch independence.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from dsbd_reference import dsbd_round

from specdec.models.loading import LoadedModel, tiny_random
from specdec.runtime.backends.torch_backend import TorchBackend
from specdec.runtime.beams import BeamDecoder, continuation_logprob
from specdec.runtime.config import EngineConfig
from specdec.runtime.context import LoopHooks
from specdec.runtime.draft_length import DraftLength
from specdec.runtime.drafters import ModelDrafter
from specdec.runtime.engine import Engine
from specdec.runtime.packed import SeqWork, pack
from specdec.runtime.request import BeamParams, Request
from specdec.runtime.sampling import InvalidRequestError, SamplingParams
from specdec.runtime.scheduler import Scheduler

VOCAB = 24  # small enough that drafts are often accepted, large enough for distinct beams
PROMPTS = ([3, 1, 4, 1, 5], [9, 2, 6], [5, 3, 5, 8, 9, 7, 9], [2, 7])


@pytest.fixture(scope="module")
def pair() -> tuple[LoadedModel, LoadedModel]:
    """A small-vocabulary target and a different draft (their distributions differ visibly)."""
    return (
        tiny_random(seed=11, vocab_size=VOCAB, name="beam-target"),
        tiny_random(seed=12, vocab_size=VOCAB, name="beam-draft"),
    )


def engine(
    target: LoadedModel,
    draft: LoadedModel | None,
    gamma: int = 3,
    max_batch: int = 16,
    max_len: int = 96,
    eos: tuple[int, ...] = (),
    draft_length: DraftLength | None = None,
) -> Engine:
    """An engine without EOS by default, so rounds end only by verification (as in the reference simulator)."""
    drafter = None if draft is None else ModelDrafter(TorchBackend(draft), max_batch, max_len)
    return Engine(
        TorchBackend(target),
        drafter,
        tokenizer=None,
        eos_token_ids=eos,
        config=EngineConfig(max_batch=max_batch, max_len=max_len, num_draft_tokens=gamma, draft_length=draft_length),
    )


def full_prefix_probs(model: LoadedModel):
    """``prefix -> softmax(logits after prefix)`` (float64) by a from-scratch prefill (no cache reuse)."""
    backend = TorchBackend(model)
    cache = backend.allocate_cache(1, 128)
    memo: dict[tuple[int, ...], np.ndarray] = {}

    def fn(prefix: tuple[int, ...]) -> np.ndarray:
        if prefix not in memo:
            logits = backend.step(pack([SeqWork(0, 0, list(prefix), logits="last")]), cache)[0]
            assert logits.dtype == np.float32  # the backend interface's rows
            shifted = np.exp(logits.astype(np.float64) - logits.max())
            memo[prefix] = shifted / shifted.sum()
        return memo[prefix]

    return fn


def decoder_after_admit(eng: Engine, requests: list[Request], speculative: bool = True) -> BeamDecoder:
    scheduler = Scheduler(eng.max_batch)
    for req in requests:
        scheduler.submit(req)
    decoder = BeamDecoder(eng.context(scheduler), speculative)
    decoder.admit()
    return decoder


@pytest.mark.parametrize(
    ("threshold", "temperature", "adaptive"), [(0.0, 1.0, False), (0.6, 0.7, False), (0.0, 1.0, True), (0.6, 0.7, True)]
)
def test_runtime_rounds_make_exactly_the_reference_draws(
    pair, threshold: float, temperature: float, adaptive: bool
) -> None:
    """Three rounds, 12 seeds: same output beams (tokens and scores) as ``dsbd_round`` with the same RNG.

    Adaptive: the runtime chooses each round's γ from the request's layer passes so far; the reference
    runs the same γ, so every round, whatever its depth (0 included), makes exactly the reference draws.

    No top-k / top-p here: i.i.d. beams are often duplicates, whose joint scores tie exactly in
    the reference and differ in the last bits between two slots of the runtime, and a cut that
    falls on such a tie keeps one pair or both (warping itself is covered by the math tests).
    """
    target, draft = pair
    target_fn, draft_fn = full_prefix_probs(target), full_prefix_probs(draft)
    params = SamplingParams(temperature=temperature, seed=0)
    width, gamma = 3, 3
    eng = engine(target, draft, gamma=gamma, draft_length=DraftLength(verify_cost=0.05) if adaptive else None)
    widths, gammas = set(), set()
    for seed in range(12):
        request = Request(
            PROMPTS[seed % len(PROMPTS)],
            40,
            SamplingParams(temperature, 0, 1.0, seed),
            beam=BeamParams(width=width, threshold=threshold, min_width=1),
        )
        decoder = decoder_after_admit(eng, [request])
        group = decoder.groups[0]
        reference = np.random.default_rng(seed)  # what SamplingParams(seed=seed).make_generator() makes
        beams = [(tuple(request.prompt_ids), 0.0)]
        for _ in range(3):
            used = decoder._gamma(group)  # what round() drafts now (a pure function of the request's past)
            gammas.add(used)
            decoder.round()
            expected = dsbd_round(
                beams,
                target_fn,
                draft_fn,
                params,
                width,
                used,
                width,
                reference,
                threshold=threshold if threshold else None,
                w_min=1,
            )
            got = [(tuple(h.tokens), h.score) for h in group.beams]
            assert [b for b, _ in got] == [b.prefix for b in expected.beams], f"seed {seed}"
            assert [s for _, s in got] == pytest.approx([b.score for b in expected.beams], abs=1e-4)
            assert group.seq.generator.bit_generator.state == reference.bit_generator.state
            widths.add(len(got))
            beams = [(b.prefix, b.score) for b in expected.beams]
    if threshold:
        assert len(widths) > 1, "the dynamic width never changed: the test does not exercise it"
    assert gammas == ({0, 1, 2, 3} if adaptive else {gamma}) or (adaptive and len(gammas) >= 3), gammas


def test_one_target_call_per_round_with_exactly_tail_plus_nodes_rows_and_exact_kv(pair) -> None:
    """Four requests of different widths share each target call; rows = Σ (uncached tail + nodes), no
    padding; afterwards every live beam's target and draft K/V equal a from-scratch prefill."""
    target, draft = pair
    eng = engine(target, draft, gamma=2)
    requests = [
        Request(p, 30, SamplingParams(1.0, 0, 1.0, 50 + i), beam=BeamParams(width=w))
        for i, (p, w) in enumerate(zip(PROMPTS, (1, 2, 3, 4)))
    ]
    decoder = decoder_after_admit(eng, requests)
    assert len(decoder.groups) == 4
    ctx, kv, dkv = decoder.ctx, decoder.ctx.kv, decoder.drafter.kv  # white-box: the draft model's own cache
    fresh_target, fresh_draft = TorchBackend(target), TorchBackend(draft)
    for _ in range(4):
        tails = sum(len(h.tokens) - kv.length(h.slot) for g in decoder.groups for h in g.beams)
        nodes = sum(2 * g.params.width for g in decoder.groups)  # γ layers of W_S nodes each
        beams = sum(len(g.beams) for g in decoder.groups)
        calls, rows = ctx.target.calls, ctx.target.rows_processed
        decoder.round()
        assert ctx.target.calls == calls + 1
        assert ctx.target.rows_processed - rows == tails + nodes
        assert ctx.run.steps[-1].batch_size == beams
        for group in decoder.groups:
            for hyp in group.beams:
                for backend, cache, fresh, length in (
                    (ctx.target, kv.storage, fresh_target, kv.length(hyp.slot)),
                    (decoder.drafter.backend, dkv.storage, fresh_draft, dkv.length(hyp.draft_slot)),
                ):
                    assert length > 0
                    slot = hyp.slot if backend is ctx.target else hyp.draft_slot
                    scratch = fresh.allocate_cache(1, 128)
                    fresh.step(pack([SeqWork(0, 0, hyp.tokens[:length], logits="none")]), scratch)
                    for (k, v), (k0, v0) in zip(cache.read(slot, length), scratch.read(0, length)):
                        np.testing.assert_allclose(k, k0, atol=1e-5, rtol=1e-4)
                        np.testing.assert_allclose(v, v0, atol=1e-5, rtol=1e-4)
    assert kv.num_free + sum(len(g.beams) for g in decoder.groups) == kv.num_slots


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_gamma_zero_is_the_beam_baseline(pair, temperature: float) -> None:
    target, draft = pair
    outs = {}
    for method, gamma in (("beam", 3), ("dsbd", 0)):
        eng = engine(target, draft, gamma=gamma)
        reqs = [
            Request(p, 16, SamplingParams(temperature, 0, 1.0, 7 + i), beam=BeamParams(width=3, num_return_sequences=3))
            for i, p in enumerate(PROMPTS)
        ]
        result = eng.generate(reqs, method)
        outs[method] = [[(c.token_ids, round(c.logprob, 6)) for c in o.sequences] for o in result.outputs]
        if method == "dsbd":
            assert sum(o.metrics.draft_tokens for o in result.outputs) == 0
    assert outs["beam"] == outs["dsbd"]


def test_a_draft_identical_to_the_target_accepts_everything(pair) -> None:
    target, _ = pair
    eng = engine(target, target, gamma=3)
    reqs = [Request(p, 25, SamplingParams(1.0, 0, 1.0, i), beam=BeamParams(width=3)) for i, p in enumerate(PROMPTS)]
    for out in eng.generate(reqs, "dsbd").outputs:
        m = out.metrics
        # every layer passes with its first W drafts: W of W_S = W drafts accepted per layer
        assert m.accepted_draft_tokens == m.draft_tokens
        assert m.target_calls <= 1 + math.ceil(25 / 4)  # γ + 1 = 4 tokens per round


def test_greedy_dsbd_is_exactly_beam_search(pair) -> None:
    """Greedy DSBD outputs what deterministic beam search outputs, with a good and with a poor draft."""
    target, draft = pair
    reqs = lambda: [Request(p, 20, beam=BeamParams(width=3, num_return_sequences=2)) for p in PROMPTS]  # noqa: E731
    base = engine(target, None).generate(reqs(), "beam").outputs
    for d in (draft, target):
        got = engine(target, d, gamma=3).generate(reqs(), "dsbd").outputs
        assert [[c.token_ids for c in o.sequences] for o in got] == [[c.token_ids for c in o.sequences] for o in base]
        if d is target:
            assert all(o.metrics.target_calls < b.metrics.target_calls for o, b in zip(got, base))


def test_adaptive_gamma_keeps_greedy_dsbd_beam_search_and_follows_layer_passes(pair) -> None:
    """γ chosen per request from its own layer passes: greedy DSBD is still exactly beam search; a draft equal
    to the target keeps drafting every layer (all pass) and saves target calls, a different draft is soon
    drafting far less than γ = 3 per round."""
    target, draft = pair
    reqs = lambda: [Request(p, 24, beam=BeamParams(width=3, num_return_sequences=2)) for p in PROMPTS]  # noqa: E731
    base = engine(target, None).generate(reqs(), "beam").outputs
    policy = DraftLength(verify_cost=0.15)
    for d in (draft, target):
        got = engine(target, d, gamma=3, draft_length=policy).generate(reqs(), "dsbd").outputs
        assert [[c.token_ids for c in o.sequences] for o in got] == [[c.token_ids for c in o.sequences] for o in base]
        fixed = engine(target, d, gamma=3).generate(reqs(), "dsbd").outputs
        drafted, drafted_fixed = (sum(o.metrics.draft_tokens for o in outs) for outs in (got, fixed))
        if d is target:
            assert all(o.metrics.accepted_draft_tokens == o.metrics.draft_tokens for o in got)
            # every layer passes, so the policy keeps the full γ (the first round, from one root beam, whose
            # W_S nodes per layer cost three rows each, may skip drafting)
            assert drafted > 0.8 * drafted_fixed
            assert all(o.metrics.target_calls < b.metrics.target_calls for o, b in zip(got, base))
        else:
            assert drafted < drafted_fixed / 2


def test_eos_beams_become_candidates_and_greedy_dsbd_still_equals_beam_search(pair) -> None:
    """With common EOS tokens beams finish at different lengths; a round stops at a layer whose outputs end a
    beam, so greedy DSBD still returns beam search's candidates, best length-normalised first."""
    target, _ = pair
    eos = (0, 1, 2)  # frequent enough under the tiny model that most beams end early
    reqs = lambda: [Request(p, 30, beam=BeamParams(width=3, num_return_sequences=3)) for p in PROMPTS]  # noqa: E731
    base = engine(target, None, eos=eos).generate(reqs(), "beam").outputs
    got = engine(target, target, gamma=3, eos=eos).generate(reqs(), "dsbd").outputs
    assert [[c.token_ids for c in o.sequences] for o in got] == [[c.token_ids for c in o.sequences] for o in base]
    stopped = [c for o in base for c in o.sequences if c.finish_reason == "stop"]
    assert stopped and all(c.token_ids[-1] in eos and len(c.token_ids) < 30 for c in stopped)
    for out in base:
        assert out.finish_reason == out.sequences[0].finish_reason and out.token_ids == out.sequences[0].token_ids
        assert [c.score for c in out.sequences] == sorted((c.score for c in out.sequences), reverse=True)


@pytest.mark.parametrize("adaptive", [False, True])
def test_each_request_of_a_batch_gets_what_it_gets_alone(pair, adaptive: bool) -> None:
    """Also with γ chosen per request from its own layer passes (adaptive): batch-mates never change it."""
    target, draft = pair
    policy = DraftLength(verify_cost=0.05) if adaptive else None

    def requests():
        return [
            Request(p, 18, SamplingParams(0.9, 0, 0.95, 100 + i), beam=BeamParams(width=2 + i % 3, threshold=0.5))
            for i, p in enumerate(PROMPTS)
        ]

    together = engine(target, draft, draft_length=policy).generate(requests(), "dsbd").outputs
    assert max(o.metrics.mean_batch_size for o in together) > 4  # beams of several requests shared calls
    for i, req in enumerate(requests()):
        alone = engine(target, draft, draft_length=policy).generate([req], "dsbd").outputs[0]
        assert alone.token_ids == together[i].token_ids
        assert alone.metrics.beam_widths == together[i].metrics.beam_widths


def test_memory_mode_single_keeps_one_beam_and_still_accepts_several_per_layer(pair) -> None:
    target, draft = pair
    eng = engine(target, draft, gamma=3)
    reqs = [
        Request(p, 20, SamplingParams(1.0, 0, 1.0, i), beam=BeamParams(width=3, memory_mode="single"))
        for i, p in enumerate(PROMPTS)
    ]
    result = eng.generate(reqs, "dsbd")
    assert max(s.batch_size for s in result.run.steps[1:]) <= len(PROMPTS)  # one beam per request
    assert all(o.metrics.accepted_draft_tokens > 0 and len(o.token_ids) == 20 for o in result.outputs)


def test_reported_logprob_is_the_targets_log_likelihood_of_the_answer(pair) -> None:
    """The ranking score's log-likelihood, kept incrementally through forks and trees, equals a fresh rescoring."""
    target, draft = pair
    reqs = [
        Request(p, 14, SamplingParams(1.0, 0, 1.0, 30 + i), beam=BeamParams(width=3, num_return_sequences=3))
        for i, p in enumerate(PROMPTS)
    ]
    scorer = TorchBackend(target)
    for method, d in (("beam", None), ("dsbd", draft)):
        for req, out in zip(reqs, engine(target, d).generate(reqs, method).outputs):
            assert out.metrics.logprob == pytest.approx(out.sequences[0].logprob)
            for cand in out.sequences:
                assert cand.logprob == pytest.approx(
                    continuation_logprob(scorer, req.prompt_ids, cand.token_ids), abs=1e-3
                )
            ranks = [c.score for c in out.sequences]
            assert ranks == sorted(ranks, reverse=True)


def test_bad_beam_parameters_are_named(pair) -> None:
    target, draft = pair
    eng = engine(target, draft, max_batch=4)
    for kwargs, word in (
        ({"width": 0}, "beam_width"),
        ({"width": 2, "min_width": 3}, "dsbd_min_width"),
        ({"threshold": 1.5}, "dsbd_threshold"),
        ({"memory_mode": "tiny"}, "memory_mode"),
        ({"mode": "top"}, "mode"),
        ({"width": 2, "num_return_sequences": 3}, "num_return_sequences"),
    ):
        with pytest.raises(InvalidRequestError, match=word):
            BeamParams(**kwargs)
    out = eng.generate([Request([1, 2], 5, beam=BeamParams(width=5))], "dsbd").outputs[0]
    assert out.error is not None and "beam_width 5" in out.error
    with pytest.raises(ValueError, match="draft model"):
        engine(target, None).generate([Request([1, 2], 5)], "dsbd")


@pytest.mark.parametrize(("method", "memory_mode"), [("beam", "full"), ("dsbd", "full"), ("dsbd", "single")])
def test_tokens_stream_as_soon_as_every_candidate_shares_them_and_the_answer_is_unchanged(
    pair, method: str, memory_mode: str
) -> None:
    """After every round a request has emitted exactly the longest prefix common to its live beams and finished
    candidates (so what streamed is final, and nothing final is held back); the chunks join into the answer that
    ``generate`` returns, and with several rounds to go some of it streamed before the search ended."""
    target, draft = pair
    eos = (0,)

    def requests() -> list[Request]:
        return [
            Request(
                p,
                24,
                SamplingParams(1.0 if i % 2 else 0.0, 0, 1.0, 50 + i),
                request_id=f"r{i}",
                beam=BeamParams(width=3, memory_mode=memory_mode),
            )
            for i, p in enumerate(PROMPTS)
        ]

    want = engine(target, draft, eos=eos).generate(requests(), method).outputs
    eng = engine(target, draft, eos=eos)
    scheduler = Scheduler(eng.max_batch)
    for req in requests():
        scheduler.submit(req)
    chunks: dict[str, list[tuple[int, list[int]]]] = {}
    finished: dict[str, int] = {}
    ctx = eng.context(
        scheduler,
        LoopHooks(
            on_tokens=lambda seq, toks: chunks.setdefault(seq.request.request_id, []).append(
                (len(ctx.run.steps), list(toks))
            ),
            on_finish=lambda seq: finished.__setitem__(seq.request.request_id, len(ctx.run.steps)),
        ),
    )
    decoder = BeamDecoder(ctx, speculative=method == "dsbd")
    ctx.run.method = method
    while ctx.has_work(decoder.groups):
        decoder.admit()
        if decoder.groups:
            decoder.round()
            for group in decoder.groups:
                hyps, seq = group.beams + group.finished, group.seq
                shared = 0
                while all(len(h.tokens) > shared and h.tokens[shared] == hyps[0].tokens[shared] for h in hyps):
                    shared += 1
                assert seq.tokens == hyps[0].tokens[:shared] or seq.finished
        decoder.retire()
    early = 0
    for req, out in zip(requests(), want):
        got = chunks.get(req.request_id, [])
        assert [t for _, toks in got for t in toks] == out.token_ids
        early += sum(len(toks) for step, toks in got if step < finished[req.request_id])
    assert early > 0, "nothing streamed before a search ended"

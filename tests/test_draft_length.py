"""The adaptive draft length: the policy's arithmetic, and that decoding with it stays exact.

Sampling with it is checked in ``test_lossless_sampling.py`` (the enumerated-law test) and its
batch invariance there too; here: the tokens-per-cost choice, the per-depth counts, and greedy
identity with ``ar`` while k really moves (a draft equal to the target drives every sequence to
the cap, an unrelated one to the floor).
"""

from __future__ import annotations

import argparse
from dataclasses import replace

import pytest

from specdec.models.loading import tiny_random
from specdec.runtime.backends.torch_backend import TorchBackend
from specdec.runtime.config import EngineConfig
from specdec.runtime.context import LoopHooks
from specdec.runtime.draft_length import (
    Candidate,
    DraftLength,
    DraftStats,
    batch_prices,
    draft_length_from,
    fixed_shares,
    parse_prices,
    price_at,
    prices_text,
)
from specdec.runtime.draft_planner import AdaptiveDraftLength
from specdec.runtime.drafters import ModelDrafter, NgramDrafter
from specdec.runtime.engine import Engine
from specdec.runtime.request import Request


def test_stats_count_each_depth_only_when_the_drafts_before_it_were_accepted() -> None:
    stats = DraftStats()
    stats.record(3, 1)  # depth 1 accepted, depth 2 rejected, depth 3 never judged on its own
    assert (stats.reached, stats.accepted) == ([1, 1, 0], [1, 0, 0])
    stats.record(1, 1)
    stats.record(4, 4)
    assert (stats.reached, stats.accepted) == ([3, 2, 1, 1], [3, 1, 1, 1])
    assert stats.idle == 0
    stats.record(0, 0)
    stats.record(0, 0)
    assert stats.reached == [3, 2, 1, 1] and stats.idle == 2
    stats.record(1, 0)
    assert stats.idle == 0 and stats.reached == [4, 2, 1, 1]
    stats.record(2, 2, memory=0.5)  # old counts fade before the new one is added
    assert (stats.reached, stats.accepted) == ([3.0, 2.0, 0.5, 0.5], [2.5, 1.5, 0.5, 0.5])
    with pytest.raises(ValueError, match="accepted <= drafted"):
        stats.record(2, 3)


def test_rates_shrink_each_depth_toward_the_one_before() -> None:
    policy = DraftLength(prior_acceptance=0.5, prior_weight=2.0)
    stats = DraftStats([8, 0], [6, 0])
    beta1 = (6 + 2 * 0.5) / (8 + 2)
    assert policy.rates(stats, 3) == pytest.approx([beta1, beta1, beta1])  # no data at depths 2-3: beta1 itself
    assert policy.rates(DraftStats(), 1) == [0.5]


def expected_value(betas: list[float], cost: float) -> float:
    tokens, survive = 1.0, 1.0
    for beta in betas:
        survive *= beta
        tokens += survive
    return tokens / (1 + len(betas) * cost)


@pytest.mark.parametrize("accepted,reached", [(0, 40), (10, 40), (20, 40), (30, 40), (39, 40), (40, 40)])
@pytest.mark.parametrize("cost", [0.0, 0.05, 0.25, 0.6])
def test_choose_maximises_tokens_per_cost_by_brute_force(accepted: int, reached: int, cost: float) -> None:
    """Against the formula evaluated for every k (min_k 0 and 1, cap 6)."""
    stats = DraftStats([reached, accepted, accepted // 2], [accepted, accepted // 2, accepted // 4])
    for min_k in (0, 1):
        policy = DraftLength(draft_cost=cost / 2, verify_cost=cost / 2, min_k=min_k)
        betas = policy.rates(stats, 6)
        values = {k: expected_value(betas[:k], cost) for k in range(min_k, 7)}
        best = max(values.values())
        want = min(k for k, v in values.items() if v >= best * (1 - 1e-9))
        assert policy.choose(stats, 6, draft_cost=99.0) == want  # the policy's own draft_cost wins


def test_choose_follows_acceptance_and_cost() -> None:
    policy = DraftLength(verify_cost=0.15)
    good, bad = DraftStats([50, 48, 47], [48, 47, 46]), DraftStats([50, 5], [5, 1])
    assert policy.choose(good, 6, draft_cost=0.1) == 6
    assert policy.choose(bad, 6, draft_cost=0.1) == 0  # drafting does not pay: stop
    assert DraftLength(verify_cost=0.15, min_k=1).choose(bad, 6, draft_cost=0.1) == 1  # a floor keeps measuring
    assert DraftLength(verify_cost=0.0, min_k=0).choose(bad, 6, draft_cost=0.0) == 6  # free drafts always pay
    assert policy.choose(good, 2, draft_cost=0.1) == 2  # never above the cap
    assert policy.choose(good, 0, draft_cost=0.1) == 0
    assert DraftLength(min_k=3).choose(bad, 2, draft_cost=0.1) == 2  # a cap below the floor wins
    # an expensive draft is worth fewer tokens than a free one at the same acceptance
    middling = DraftStats([50, 30, 20], [30, 20, 12])
    assert policy.choose(middling, 6, draft_cost=0.0) > policy.choose(middling, 6, draft_cost=1.0)


def test_a_sequence_that_stopped_drafting_probes_again() -> None:
    """After ``probe_every`` draft-free steps one draft is tried; its acceptance can bring drafting back."""
    policy = DraftLength(verify_cost=0.15, probe_every=3)
    stats = DraftStats([20], [2])
    chosen = []
    for _ in range(4):
        chosen.append(policy.choose(stats, 4, draft_cost=0.1))
        stats.record(chosen[-1], 0)
    assert chosen == [0, 0, 0, 1]
    for _ in range(40):  # the text turned predictable: every probe and draft is accepted (the first probe after
        k = policy.choose(stats, 4, draft_cost=0.1)  # the failed one waits twice as long: probe_backoff)
        stats.record(k, k, policy.memory)
    assert policy.choose(stats, 4, draft_cost=0.1) == 4
    # without fading, the 18 early rejections still hold k down
    stale = DraftStats([20 + 30], [2 + 30])
    assert policy.choose(stale, 4, draft_cost=0.1) < 4


def test_fruitless_probes_back_off_and_an_accepted_one_resets_the_wait() -> None:
    """Probes whose drafts are rejected in a row wait 8, 16, 32, then 64 steps (probe_backoff 3); an acceptance
    brings the wait back to 8. The steps between probes are counted on the sequence's own history only."""
    policy = DraftLength(verify_cost=0.2, probe_every=8, probe_backoff=3)
    stats = DraftStats([40], [1])  # drafts that never pay: k = 0 but for probes

    def gaps(probes: int, accept: bool = False) -> list[int]:
        out, since = [], 0
        while len(out) < probes:
            k = policy.choose(stats, 4, draft_cost=0.1)
            since += 1
            if k:
                assert k == 1
                out.append(since)
                since = 0
            stats.record(k, k if accept else 0, policy.memory)
        return out

    assert gaps(6) == [9, 17, 33, 65, 65, 65]  # a probe comes on the step after `wait` steps without a draft
    assert stats.misses == 6
    assert gaps(1, accept=True) == [65]
    assert stats.misses == 0
    assert gaps(2) == [9, 17]
    no_backoff = DraftLength(verify_cost=0.2, probe_every=8, probe_backoff=0)
    assert no_backoff.choose(DraftStats([40], [1], idle=8, misses=5), 4, draft_cost=0.1) == 1


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"draft_cost": -0.1}, "draft_cost"),
        ({"verify_cost": -1.0}, "verify_cost"),
        ({"prior_acceptance": 1.5}, "prior_acceptance"),
        ({"prior_weight": 0.0}, "prior_weight"),
        ({"min_k": -1}, "min_k"),
        ({"probe_every": 0}, "probe_every"),
        ({"memory": 0.0}, "memory"),
        ({"probe_backoff": -1}, "probe_backoff"),
    ],
)
def test_bad_settings_are_refused(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        DraftLength(**kwargs)


def test_drafters_state_their_cost() -> None:
    tiny = tiny_random(seed=3, vocab_size=64, num_layers=1)
    assert NgramDrafter.relative_cost == 0.0
    assert 0 < ModelDrafter(TorchBackend(tiny), 1, 16).relative_cost < 1


@pytest.fixture(scope="module")
def tiny_target():
    return tiny_random(seed=11, vocab_size=96, num_layers=2, init_std=0.05)


@pytest.mark.parametrize("draft_kind", ["same", "random", "ngram"])
def test_adaptive_ems_equals_ar_while_k_follows_acceptance(tiny_target, draft_kind: str) -> None:
    """Greedy ems with the policy is token-identical to ar; a draft equal to the target drafts the cap
    every step after the first, an unrelated one soon drafts the floor."""
    backend = TorchBackend(tiny_target)
    draft = {
        "same": lambda: ModelDrafter(TorchBackend(tiny_target), 4, 256),
        "random": lambda: ModelDrafter(TorchBackend(tiny_random(seed=12, vocab_size=96, num_layers=1)), 4, 256),
        "ngram": NgramDrafter,
    }[draft_kind]()
    engine = Engine(
        backend,
        draft,
        config=EngineConfig(max_batch=4, max_len=256, num_draft_tokens=5, draft_length=DraftLength(verify_cost=0.2)),
    )
    prompts = [[5, 6, 7], [9] * 20, [1, 2, 3, 4] * 6, [40]]
    requests = [Request(p, max_tokens=40) for p in prompts]
    ar = engine.generate(requests, "ar")
    ems = engine.generate(requests, "ems")
    assert [o.token_ids for o in ems.outputs] == [o.token_ids for o in ar.outputs]
    steps = ems.run.steps[1:]  # after the prefill
    drafted = [s.draft_tokens for s in steps]
    if draft_kind == "same":
        assert ems.run.summary()["acceptance_rate"] == 1.0
        # k grows from the prior's choice to the cap; the last steps are cut by max_tokens
        assert max(drafted) == 5 * len(prompts) and drafted[0] < drafted[2]
    elif draft_kind == "random":
        assert ems.run.summary()["acceptance_rate"] < 0.2
        # drafting stops (0 drafts) except for probes, 8 steps apart and further after each rejected one
        assert drafted[-1] <= len(prompts) and drafted.count(0) > len(drafted) // 2


# -- prices per batch size ---------------------------------------------------------------------------------


def test_prices_per_batch_size_interpolate_and_round_trip_through_a_config() -> None:
    prices = batch_prices([[4, 0.4], [1, 0.1], [8, 0.6]])  # as a manifest keeps them, in any order
    assert prices == ((1, 0.1), (4, 0.4), (8, 0.6))
    assert [price_at(prices, b) for b in (1, 2, 4, 6, 8, 16)] == pytest.approx([0.1, 0.2, 0.4, 0.5, 0.6, 0.6])
    assert price_at(((2, 0.3),), 1) == 0.3  # below the smallest measured size: its price
    assert parse_prices(prices_text(prices)) == prices and parse_prices("") == ()
    for bad in ("1:0.1,1:0.2", "0:0.1", "2:-1", "two:0.1", "1-0.1"):
        with pytest.raises(ValueError):
            parse_prices(bad)


def test_a_greedy_sequence_is_priced_at_its_batch_size_a_sampled_one_is_not() -> None:
    """Acceptance 0.5: one draft pays at batch 1 (0.2 a draft: 1.5 tokens for 1.2 steps) but not at batch 8 (0.9 a
    draft); the flat prices (the medians a sampled sequence pays) sit between."""
    policy = DraftLength(
        verify_cost=0.3,
        draft_cost=0.1,
        prior_weight=1.0,
        verify_by_batch=((1, 0.1), (8, 0.8)),
        draft_by_batch=((1, 0.1), (8, 0.1)),
    )
    stats = DraftStats([100.0, 50.0], [50.0, 25.0])
    assert policy.prices(0.0, 1) == (0.1, 0.1) and policy.prices(0.0, 8) == (0.1, 0.8)
    assert policy.prices(0.0) == (0.1, 0.3)
    assert policy.choose(stats, 4, draft_cost=0.0, batch=1) >= 1
    assert policy.choose(stats, 4, draft_cost=0.0, batch=8) == 0
    assert policy.choose(stats, 4, draft_cost=0.0) == 1  # flat 0.4 a draft: 1.5 / 1.4 pays
    # without a measured draft price per batch size the drafter's own (prompt lookup: 0) is used
    lookup = DraftLength(verify_cost=0.3, verify_by_batch=((1, 0.1), (8, 0.8)))
    assert lookup.prices(0.0, 8) == (0.0, 0.8) and lookup.prices(0.0) == (0.0, 0.3)


def test_the_loop_prices_greedy_requests_by_the_batch_and_sampled_ones_alone(tiny_target) -> None:
    """In a batch of four, the greedy requests see the batch's (prohibitive) price and stop drafting after their
    prior; the sampled ones, priced alone (free), draft every step; greedy output still equals ar."""
    from specdec.runtime.sampling import SamplingParams

    backend = TorchBackend(tiny_target)
    policy = DraftLength(verify_cost=0.0, draft_cost=0.0, verify_by_batch=((1, 0.0), (4, 5.0)), probe_every=1000)
    engine = Engine(
        backend,
        ModelDrafter(TorchBackend(tiny_target), 4, 256),
        config=EngineConfig(max_batch=4, max_len=256, num_draft_tokens=3, draft_length=policy),
    )
    prompts = [[5, 6, 7], [9] * 20, [1, 2, 3, 4] * 6, [40]]
    greedy = [Request(p, max_tokens=24) for p in prompts]
    sampled = [
        Request(p, max_tokens=24, sampling=SamplingParams(temperature=1.0, seed=i)) for i, p in enumerate(prompts)
    ]
    ems = engine.generate(greedy, "ems")
    assert [o.token_ids for o in ems.outputs] == [o.token_ids for o in engine.generate(greedy, "ar").outputs]
    assert sum(s.draft_tokens for s in ems.run.steps[1:]) == 0  # 1 + 3·0.5 tokens for 1 + 3·5 steps: never
    mixed = engine.generate([*greedy[:2], *sampled[2:]], "ems")
    assert [o.metrics.draft_tokens > 0 for o in mixed.outputs] == [False, False, True, True]
    alone = [engine.generate([r], "ems").outputs[0].token_ids for r in sampled[2:]]
    assert [o.token_ids for o in mixed.outputs[2:]] == alone  # a seeded sampled request: the same in any batch


def test_a_greedy_request_starts_from_the_pooled_acceptance_a_sampled_one_from_the_prior(tiny_target) -> None:
    """After requests whose drafts the target rejected, a new greedy request does not draft in its first step (its
    prior is the pooled acceptance), a fresh engine's does (prior 0.5); a seeded sampled request ignores the pool:
    the same output on either engine. Greedy output equals ar throughout."""
    from specdec.runtime.sampling import SamplingParams

    def engine() -> Engine:
        unrelated = ModelDrafter(TorchBackend(tiny_random(seed=12, vocab_size=96, num_layers=1)), 4, 256)
        return Engine(
            TorchBackend(tiny_target),
            unrelated,
            config=EngineConfig(
                max_batch=4, max_len=256, num_draft_tokens=3, draft_length=DraftLength(verify_cost=0.2, draft_cost=0.1)
            ),
        )

    seasoned, fresh = engine(), engine()
    history = seasoned.generate([Request([3, 1, 4, 1, 5][: 1 + i], max_tokens=30) for i in range(4)], "ems")
    assert history.run.summary()["acceptance_rate"] < 0.2
    planner = seasoned.planner
    assert isinstance(planner, AdaptiveDraftLength)
    assert planner.policy.pooled_prior(planner.pooled[""]) < 0.3  # one draft's break-even: 0.1 + 0.2
    greedy = Request([9, 2, 6, 5], max_tokens=12)
    first_drafts = [e.generate([greedy], "ems").run.steps[1].draft_tokens for e in (seasoned, fresh)]
    assert first_drafts[0] == 0 and first_drafts[1] > 0

    def answer(e: Engine, request: Request, method: str) -> list[int]:
        return e.generate([request], method).outputs[0].token_ids

    assert answer(seasoned, greedy, "ems") == answer(fresh, greedy, "ar")
    sampled = Request([9, 2, 6, 5], max_tokens=12, sampling=SamplingParams(temperature=1.0, seed=7))
    assert answer(seasoned, sampled, "ems") == answer(fresh, sampled, "ems")


# -- a batch nobody waits to join: planned to end soonest ---------------------------------------------------------


def _lookup(accepted: float, budget: int, k_max: int = 4) -> Candidate:
    """A prompt-lookup sequence (its tokens cost nothing) whose drafts were accepted at rate ``accepted`` at every
    depth, over a long history."""
    return Candidate(DraftStats([100.0] * k_max, [100.0 * accepted] * k_max), k_max, 0.0, budget, own_price=True)


def test_the_plan_drafts_only_where_it_ends_the_batch_sooner() -> None:
    policy = DraftLength(verify_by_batch=((1, 0.1), (2, 0.2), (8, 0.8)), probe_every=1000)
    copier, free = _lookup(0.9, 40), _lookup(0.0, 40)
    batch = [copier, free]

    def alone(c: Candidate, batch_size: int) -> int:
        return policy.choose(c.stats, c.k_max, c.draft_cost, batch=batch_size, own_price=True)

    # equal budgets, one that no draft speeds up: the batch lasts 40 steps whatever the other drafts
    assert alone(copier, 2) > 0 and policy.plan(batch, 2) == [0, 0]
    # a sequence whose lookups are accepted but seldom match (one step in ten) binds the batch like one whose are
    # rejected; this step has a match or not, the plan is the same
    seldom = Candidate(copier.stats, 4, 0.0, 40, own_price=True, k_now=4, offer_rate=0.1)
    assert policy.plan([copier, seldom], 2) == [0, 0]
    assert policy.plan([copier, _lookup(0.9, 40)], 2) == [alone(copier, 2)] * 2
    # the free-form answer ends first: the copier is the batch's length, and drafts
    assert policy.plan([copier, _lookup(0.0, 10)], 2)[0] > 0
    # ... unless a prompt still prefilling (floor) outlasts it anyway
    assert policy.plan([copier, _lookup(0.0, 10)], 2, floor=40) == [0, 0]
    # the copier has gone far ahead: it finishes within the batch's length without drafting
    assert policy.plan([_lookup(0.9, 12), _lookup(0.0, 30)], 2) == [0, 0]
    # alone in a batch of 8 behind seven short answers, a sequence pays 1/8 of a row every sequence drafts:
    # acceptance 0.5 does not pay at batch 8's price, it does for the one sequence the batch waits for
    halfway = _lookup(0.5, 40)
    assert alone(halfway, 8) == 0
    assert policy.plan([halfway, *[_lookup(0.0, 5)] * 7], 8)[0] > 0
    # every sequence equally long and all worth drafting: each drafts as priced alone at the batch's size
    copiers = [_lookup(0.9, 40) for _ in range(8)]
    assert policy.plan(copiers, 8) == [alone(c, 8) for c in copiers]


def test_a_lookup_that_ends_its_sequence_sooner_frees_its_share_of_later_steps() -> None:
    """With the steps' fixed shares measured (the edge calibration's at batch 8: 0.40 of a step, a verified row 0.21
    of a sequence's share), a copier beside seven free-form answers as long as it drafts: it still cannot end the
    batch sooner, but each step it no longer runs saves its share of one. Proposals of a draft model get no such
    credit (their saving did not cover the draft steps, ``runtime_choices.md``), nor does anyone unmeasured."""
    prices = {"verify_by_batch": ((1, 0.06), (8, 0.21)), "probe_every": 1000}
    measured = DraftLength(**prices, fixed_by_batch=((1, 0.84), (8, 0.40)))
    unmeasured = DraftLength(**prices)
    copier, free = _lookup(0.9, 40), [_lookup(0.0, 40)] * 7
    assert measured.plan([copier, *free], 8) == [4] + [0] * 7
    assert unmeasured.plan([copier, *free], 8) == [0] * 8
    by_model = Candidate(copier.stats, 4, 0.12, 40)
    assert measured.plan([by_model, *free], 8) == unmeasured.plan([by_model, *free], 8) == [0] * 8
    # a share that nothing is left to save: the whole step fixed, as unmeasured; and a batch past the measured ones
    assert DraftLength(**prices, fixed_by_batch=((8, 1.0),)).plan([copier, *free], 8) == [0] * 8
    assert DraftLength(**prices, fixed_by_batch=((1, 0.84), (4, 0.57))).plan([copier, *free], 8) == [0] * 8
    assert measured.fixed_share(16) == 1.0 and measured.fixed_share(4) == pytest.approx(0.84 - 3 * 0.44 / 7)
    with pytest.raises(ValueError, match="at most 1"):
        DraftLength(fixed_by_batch=((8, 1.5),))


def test_a_plan_without_greedy_sequences_is_empty() -> None:
    """A batch of sampled sequences only leaves the plan no candidate (each is priced alone): it plans nothing."""
    for policy in (DraftLength(), DraftLength(fixed_by_batch=((1, 0.8), (8, 0.4)))):
        assert policy.plan([], 8) == [] and policy.plan([], 8, floor=20) == []


def test_fixed_shares_come_from_the_calibrated_step_times() -> None:
    """A line through the plain step times per batch size: its intercept over the step at each size; fewer than two
    sizes, or times that do not grow with the batch (noise), say nothing to save."""
    line = {"batch_sizes": [1, 4, 8], "plain_ms": [12.0, 18.0, 26.0]}  # 10 + 2 B
    assert fixed_shares(line) == ((1, 0.8333), (4, 0.5556), (8, 0.3846))
    assert fixed_shares({"batch_sizes": [1], "plain_ms": [12.0]}) == fixed_shares({}) == ()
    assert fixed_shares({"batch_sizes": [1, 4, 8], "plain_ms": [177.0, 249.0, 142.0]}) == ((1, 1.0), (4, 1.0), (8, 1.0))
    args = argparse.Namespace(adaptive_draft=True, verify_cost=0.3, draft_cost=None)
    policy = draft_length_from(args, {**line, "verify_cost": 0.2})
    assert policy is not None and policy.fixed_by_batch == fixed_shares(line) and policy.verify_cost == 0.3


@pytest.mark.parametrize("accepted", [0.0, 0.2, 0.5, 0.8, 1.0])
@pytest.mark.parametrize("cost", [0.0, 0.15, 0.6])
def test_a_planned_sequence_alone_chooses_as_priced_alone(accepted: float, cost: float) -> None:
    """One sequence is the whole batch: ending it soonest is its most tokens per cost, ``choose``'s k."""
    policy = DraftLength(verify_cost=cost, draft_cost=0.05, probe_every=1000)
    seq = Candidate(DraftStats([50.0] * 5, [50.0 * accepted] * 5), 5, 0.0, 30)
    assert policy.plan([seq], 1) == [policy.choose(seq.stats, 5, 0.0, batch=1)]


def test_a_sequence_alone_in_its_batch_still_probes() -> None:
    """Drafts that do not pay stop, and a probe is due after ``probe_every`` idle steps: the plan keeps it for a
    sequence alone in its batch (as ``choose`` does), not beside others, whose steps it would lengthen."""
    policy = DraftLength(verify_cost=0.5, draft_cost=0.1)
    idle = DraftStats([50.0], [5.0], idle=8)
    assert policy.choose(idle, 4, 0.0, batch=1) == 1
    assert policy.plan([Candidate(idle, 4, 0.0, 30)], 1) == [1]
    short = Candidate(idle, 4, 0.0, 10)
    assert policy.plan([Candidate(idle, 4, 0.0, 30), short], 2) == [0, 0]
    assert policy.plan([Candidate(idle, 4, 0.0, 30)], 1, floor=40) == [0]  # a prompt still prefilling outlasts it
    assert policy.plan([Candidate(DraftStats([50.0], [5.0], idle=3), 4, 0.0, 30)], 1) == [0]  # not due yet


def test_the_loop_plans_a_batch_nobody_waits_to_join() -> None:
    """Prompt lookup over a target that repeats each prompt's cycle (every lookup accepted) or counts (no lookup
    ever matches): in a batch of both, the copier stops drafting while the counting answer is as long (it sets the
    batch's length; the first step still assumes the pooled share of steps with a match), and drafts when it is
    the longer; with a request waiting for a slot each sequence is priced alone, and the copier drafts either way.
    Every answer equals ar's."""
    from fakes import ScriptedBackend

    vocab = 64
    target = ScriptedBackend(lambda c: c[-4] if c[0] < 32 and len(c) >= 4 else (c[-1] + 1) % vocab, vocab)
    policy = DraftLength(verify_by_batch=((1, 0.1), (2, 0.2)), probe_every=1000)

    def drafted(lengths: tuple[int, ...], max_batch: int = 2, policy: DraftLength = policy) -> list[int]:
        engine = Engine(
            target,
            NgramDrafter(max_ngram=3, min_ngram=2),
            config=EngineConfig(max_batch=max_batch, max_len=96, num_draft_tokens=4, draft_length=policy),
        )
        prompts = [[1, 2, 3, 4, 1, 2, 3, 4], [40, 41, 42], [2, 3, 4, 5, 2, 3, 4, 5]][: len(lengths)]
        requests = [Request(p, max_tokens=n) for p, n in zip(prompts, lengths)]
        ems = engine.generate(requests, "ems")
        assert [o.token_ids for o in ems.outputs] == [o.token_ids for o in engine.generate(requests, "ar").outputs]
        return [o.metrics.draft_tokens for o in ems.outputs]

    tied, longer = drafted((30, 30)), drafted((30, 10))
    assert tied[1] == longer[1] == 0 and tied[0] <= 4 < longer[0]  # at most the first step's k = 4
    # a third request waits for one of the two slots: per-sequence prices, the copier drafts
    queued = drafted((30, 30, 30))
    assert queued[0] > 0 and queued[2] > 0
    # with the steps' fixed shares measured, the tied copier drafts on: each step it no longer runs saves its share
    shares = replace(policy, fixed_by_batch=((1, 0.8), (2, 0.6)))
    tied_measured = drafted((30, 30), policy=shares)
    assert tied_measured[1] == 0 and tied_measured[0] > 4


def test_a_server_loop_prices_each_sequence_alone(monkeypatch) -> None:
    """A server's requests wait for their own answers only (``keep_running``): its loop never plans the batch,
    while a ``generate`` call over the same requests does."""
    from fakes import ScriptedBackend

    from specdec.runtime import loops
    from specdec.runtime.scheduler import Scheduler

    planned: list[int] = []
    real_plan = DraftLength.plan
    monkeypatch.setattr(
        DraftLength, "plan", lambda self, seqs, *a, **k: planned.append(len(seqs)) or real_plan(self, seqs, *a, **k)
    )
    target = ScriptedBackend(lambda c: c[-4] if len(c) >= 4 else (c[-1] + 1) % 64, 64)
    engine = Engine(
        target,
        NgramDrafter(),
        config=EngineConfig(
            max_batch=2, max_len=64, num_draft_tokens=4, draft_length=DraftLength(verify_by_batch=((1, 0.1), (2, 0.2)))
        ),
    )
    requests = [Request([1, 2, 3, 4, 1, 2, 3, 4], max_tokens=12), Request([5, 6, 7, 8, 5, 6], max_tokens=12)]
    engine.generate(requests, "ems")
    assert planned and max(planned) == 2
    planned.clear()
    scheduler = Scheduler(2)
    for request in requests:
        scheduler.submit(request)
    done: list[int] = []
    hooks = LoopHooks(keep_running=lambda: len(done) < 2, on_finish=lambda s: done.append(1))
    ctx = engine.context(scheduler, hooks)
    loops.ems(ctx)
    assert len(done) == 2 and ctx.run.summary()["draft_tokens"] > 0 and planned == []


def test_a_plan_that_fails_prices_each_sequence_alone(monkeypatch, caplog) -> None:
    """A fault in the plan costs only speed: logged, each sequence priced alone, every answer ar's."""
    from fakes import ScriptedBackend

    def broken(self, seqs, *args, **kwargs):
        raise RuntimeError("plan fault")

    monkeypatch.setattr(DraftLength, "plan", broken)
    target = ScriptedBackend(lambda c: c[-4] if len(c) >= 4 else (c[-1] + 1) % 64, 64)
    engine = Engine(
        target,
        NgramDrafter(),
        config=EngineConfig(
            max_batch=2, max_len=64, num_draft_tokens=4, draft_length=DraftLength(verify_by_batch=((1, 0.1), (2, 0.2)))
        ),
    )
    requests = [Request([1, 2, 3, 4, 1, 2, 3, 4], max_tokens=12), Request([5, 6, 7, 8, 5, 6], max_tokens=12)]
    ems = engine.generate(requests, "ems")
    assert [o.error for o in ems.outputs] == [None, None]
    assert [o.token_ids for o in ems.outputs] == [o.token_ids for o in engine.generate(requests, "ar").outputs]
    assert ems.run.summary()["draft_tokens"] > 0 and "plan fault" in caplog.text

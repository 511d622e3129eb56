"""The model-free core of DSBD (``specdec.runtime.dsbd``): beam distribution and the exactness of whole rounds
(how many drafts a layer accepts, and so the dynamic width: ``test_dsbd_acceptance.py``).

Toy models: a 5-token vocabulary, target and draft given by tables that depend on the last
token (deliberately different: per-context TV 0.2-0.5, so layers pass and fail often).

Exactness statement tested (dsbd.md): conditional on the beams entering a layer, every output
slot of the layer is one draw from the target's ``p_beam`` of those beams. Layer 1 always
runs from the round's input beams, so its slots are tested unconditionally (chi-square and
TV, helpers and thresholds of ``test_lossless_sampling``). Later layers (the verified layer 2
and the extra layer drawn when all γ pass) are tested conditionally: rounds are grouped by
the layer's valid parents (prefixes and target scores), and one chi-square statistic is
summed over the groups (degrees of freedom add up for independent groups).

Note what is *not* claimed: the first-layer ancestor of a round's final output beam is not a
``p_beam`` draw even for the ``beam`` baseline (the next layer picks parents in proportion to
their scores: for p_beam = (0.9, 0.1) and W = 2, the ancestor is the first pair w.p. 0.972).

Thresholds. Each chi-square check passes when p > ALPHA = 1e-3. Seeds are fixed so runs are
deterministic; for a random seed a correct implementation fails one check w.p. <= 1e-3, so
the 38 asserted chi-square checks of this file fail together (Bonferroni) for at most ~4 % of
seed choices, the false-alarm rate we accept when a code change re-rolls the random streams.
The TV check of layer-1 slots uses test_lossless_sampling's bound (exceeded w.p. < 1e-4). Negative controls
run the same checks on a wrong implementation and require p < 1e-6.
"""

from __future__ import annotations

import itertools
import math
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import pytest
from dsbd_reference import RoundResult, dsbd_round
from scipy.stats import chi2
from test_lossless_sampling import ALPHA, chi_square_pvalue, total_variation

from specdec.runtime import dsbd
from specdec.runtime.dsbd import (
    Beam,
    LayerVerdict,
    beam_distribution,
    beam_search_step,
    beam_step,
    draft_layer,
    sample_pairs_iid,
    sample_pairs_without_replacement,
)
from specdec.runtime.sampling import SamplingParams, warp

VOCAB = 5
ROUNDS = 20_000
PLAIN = SamplingParams(temperature=1.0)
# on the 10-15 pair joint vectors both cuts bind: top-k drops 4+ pairs, top-p usually more
WARPED = SamplingParams(temperature=1.3, top_k=6, top_p=0.9)
INPUT_BEAMS = (((0,), -0.4), ((3,), -1.3))  # two input beams with different scores


def _tables() -> tuple[np.ndarray, np.ndarray]:
    """Target and draft next-token tables ``[last token, V]`` (float64, read-only: shared by every test)."""
    rng = np.random.default_rng(20240916)
    target = rng.dirichlet(np.full(VOCAB, 0.7), size=VOCAB)
    draft = 0.45 * target + 0.55 * rng.dirichlet(np.full(VOCAB, 0.7), size=VOCAB)
    target.flags.writeable = draft.flags.writeable = False
    return target, draft


TARGET_TABLE, DRAFT_TABLE = _tables()


def target_fn(prefix: tuple[int, ...]) -> np.ndarray:
    return TARGET_TABLE[prefix[-1]]


def draft_fn(prefix: tuple[int, ...]) -> np.ndarray:
    return DRAFT_TABLE[prefix[-1]]


def p_beam_of(parents: Sequence[Beam], params: SamplingParams) -> np.ndarray:
    """The reference law ``[len(parents), V]`` of one slot, from the same definition the baseline uses."""
    scores = np.array([b.score for b in parents], dtype=np.float64)
    table = np.stack([target_fn(b.prefix) for b in parents])
    return beam_distribution(scores, table, params).reshape(len(parents), VOCAB)


# -- running rounds and collecting slot laws -------------------------------------------------


@dataclass
class SlotCounts:
    """Layer-1 counts per slot, and later layers' counts per (layer, slot) and per parent state."""

    first: dict[int, Counter]
    later: dict[tuple[int, int], dict[tuple[Beam, ...], Counter]]
    layers_reached: Counter
    seconds: float


def run_rounds(
    params: SamplingParams, w_s: int, gamma: int, width: int, n: int, seed: int, draft: Callable = draft_fn, **kw
) -> SlotCounts:
    generator = np.random.default_rng(seed)
    memo: dict = {}
    first: dict[int, Counter] = defaultdict(Counter)
    later: dict = defaultdict(lambda: defaultdict(Counter))
    reached: Counter = Counter()
    start = time.perf_counter()
    for _ in range(n):
        result = dsbd_round(INPUT_BEAMS, target_fn, draft, params, w_s, gamma, width, generator, memo=memo, **kw)
        _check_output_beams(result)
        reached[len(result.layers)] += 1
        for j, slot in enumerate(result.layers[0].slots):
            first[j][slot] += 1
        for depth, layer in enumerate(result.layers[1:], start=2):
            for j, slot in enumerate(layer.slots):
                later[depth, j][tuple(layer.parents)][slot] += 1
    return SlotCounts(first, later, reached, time.perf_counter() - start)


def _check_output_beams(result: RoundResult) -> None:
    """The round's output beams are its last layer's slots, prefix extended, scored log p_beam (memoised)."""
    last = result.layers[-1]
    assert len(result.beams) == len(last.slots)
    for beam, (i, v) in zip(result.beams, last.slots):
        assert beam.prefix == (*last.parents[i].prefix, v)
    assert all(layer.passed for layer in result.layers[:-1])


def pooled_conditional_chi_square(
    groups: dict[tuple[Beam, ...], Counter], params: SamplingParams, min_count: int = 20
) -> tuple[float, int]:
    """(p-value, rounds used) of one chi-square summed over parent states.

    Per state, cells with expected count < 5 are pooled, and a pooled cell still under 5 joins
    the smallest other cell. States with fewer than ``min_count`` rounds are left out: that
    selects on the conditioning variable only, so it cannot bias the conditional law. Every
    state, used or not, must only produce outcomes of positive probability.
    """
    statistic, dof, used = 0.0, 0, 0
    for state, counts in groups.items():
        law = p_beam_of(state, params)
        impossible = [k for k in counts if law[k] == 0.0]
        assert not impossible, f"outcomes of probability 0 were drawn: {impossible}"
        n = sum(counts.values())
        if n < min_count:
            continue
        cells = sorted(((law[k] * n, counts.get(k, 0)) for k in zip(*np.nonzero(law))), reverse=True)
        big = [c for c in cells if c[0] >= 5]
        small = [c for c in cells if c[0] < 5]
        bins = [list(c) for c in big]
        if small:
            pooled = [sum(c[0] for c in small), sum(c[1] for c in small)]
            if pooled[0] >= 5 or not bins:
                bins.append(pooled)
            else:
                bins[-1] = [bins[-1][0] + pooled[0], bins[-1][1] + pooled[1]]
        if len(bins) < 2:
            continue
        statistic += sum((obs - exp) ** 2 / exp for exp, obs in bins)
        dof += len(bins) - 1
        used += n
    return float(chi2.sf(statistic, dof)), used


def slot_pvalues(counts: SlotCounts, params: SamplingParams, label: str) -> dict[str, float]:
    """Every check's p-value (layer-1 slots and conditional later slots), printed with TV."""
    out = {}
    law = p_beam_of([Beam(*b) for b in INPUT_BEAMS], params)
    for j, slot_counts in sorted(counts.first.items()):
        pvalue = chi_square_pvalue(slot_counts, law)
        tv, bound = total_variation(slot_counts, law)
        print(
            f"{label} layer 1 slot {j}: n = {sum(slot_counts.values())}, p = {pvalue:.4g}, "
            f"TV = {tv:.4f} (bound {bound:.4f})"
        )
        out[f"layer 1 slot {j}"] = pvalue
        out[f"layer 1 slot {j} TV excess"] = bound - tv
    for (depth, j), groups in sorted(counts.later.items()):
        pvalue, used = pooled_conditional_chi_square(groups, params)
        print(f"{label} layer {depth} slot {j}: {len(groups)} parent states, {used} rounds tested, p = {pvalue:.4g}")
        if used:
            out[f"layer {depth} slot {j}"] = pvalue
    return out


def assert_slots_exact(counts: SlotCounts, params: SamplingParams, label: str) -> None:
    pvalues = slot_pvalues(counts, params, label)
    print(f"{label}: layers reached {dict(sorted(counts.layers_reached.items()))}, {counts.seconds:.1f} s")
    for name, value in pvalues.items():
        if name.endswith("TV excess"):
            assert value > 0, f"{label}: {name[:-7]} TV above its bound"
        else:
            assert value > ALPHA, f"{label}: {name} is not a draw from p_beam (p = {value:.3g})"


# -- the beam distribution -------------------------------------------------------------------


def test_beam_distribution_matches_the_formula() -> None:
    """p_beam ∝ exp(s_b) p(v|b) unwarped, and joint temperature / top-k / top-p on the flat vector."""
    scores = np.array([-0.2, -1.7, -math.inf], dtype=np.float64)  # the third parent is absent
    table = np.stack([TARGET_TABLE[1], TARGET_TABLE[4], TARGET_TABLE[2]])
    joint = (np.exp(scores)[:, None] * table).reshape(-1)
    plain = beam_distribution(scores, table, PLAIN)
    assert plain.dtype == np.float64 and plain.shape == (3 * VOCAB,)
    np.testing.assert_allclose(plain, joint / joint.sum(), rtol=1e-6, atol=1e-12)
    assert plain[2 * VOCAB :].sum() == 0.0
    # the same from logits, shifted per row (log_softmax removes the shift)
    from_logits = beam_distribution(scores, np.log(table) + np.array([[3.0], [-1.0], [0.0]]), PLAIN, logits=True)
    np.testing.assert_allclose(from_logits, plain, rtol=1e-6, atol=1e-12)

    tempered = joint ** (1 / WARPED.temperature)
    order = np.argsort(-tempered)
    kept = np.zeros_like(tempered)
    kept[order[: WARPED.top_k]] = tempered[order[: WARPED.top_k]]
    kept /= kept.sum()
    mass_before = np.cumsum(kept[order]) - kept[order]
    kept[order[mass_before >= WARPED.top_p]] = 0.0
    kept /= kept.sum()
    warped = beam_distribution(scores, table, WARPED)
    np.testing.assert_allclose(warped, kept, rtol=1e-5, atol=1e-9)
    assert 0 < (warped > 0).sum() < WARPED.top_k  # both cuts bound


def test_warping_is_joint_not_per_beam() -> None:
    """A confident high-score beam takes every top-k slot; per-beam warping would keep 2 tokens of each."""
    scores = np.log(np.array([0.9, 0.1], dtype=np.float64))
    table = np.array([[0.5, 0.3, 0.1, 0.05, 0.05], [0.6, 0.1, 0.1, 0.1, 0.1]], dtype=np.float64)
    params = SamplingParams(temperature=1.0, top_k=2)
    joint = beam_distribution(scores, table, params).reshape(2, VOCAB)
    np.testing.assert_allclose(joint[0], [0.625, 0.375, 0, 0, 0], rtol=1e-6)
    assert float(joint[1].sum()) == 0.0
    per_beam = np.stack([warp(np.log(row), params) for row in table]) * np.exp(scores)[:, None]
    assert float(per_beam[1].sum()) > 0.09  # what per-beam warping would have kept
    # temperature also tempers the beam scores: the weaker beam gains weight at T > 1
    hot = beam_distribution(scores, table, SamplingParams(temperature=2.0)).reshape(2, VOCAB)
    assert float(hot[1].sum()) > 0.2  # exp(s)/Σ exp(s) would stay 0.1 under per-beam tempering
    with pytest.raises(ValueError, match="beam_search_step"):
        beam_distribution(scores, table, SamplingParams(temperature=0.0))


def test_beam_search_step_takes_the_top_pairs() -> None:
    scores = np.array([-0.1, -0.5, -3.0], dtype=np.float64)
    table = np.array(
        [[0.5, 0.5, 0.0, 0.0, 0.0], [0.7, 0.1, 0.1, 0.05, 0.05], [1.0, 0.0, 0.0, 0.0, 0.0]], dtype=np.float64
    )
    with np.errstate(divide="ignore"):  # log 0 = -inf: the pairs of probability 0
        log_table = np.log(table)
    joint = scores[:, None] + log_table
    step = beam_search_step(scores, table, 4)
    # ties (0, 0) and (0, 1) go to the lower index; (2, 0) at -3.0 loses to (1, 1) at -2.8
    assert list(zip(step.parents, step.tokens)) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    np.testing.assert_allclose(step.scores, [float(joint[p, t]) for p, t in zip(step.parents, step.tokens)])
    generator = np.random.default_rng(0)
    state = generator.bit_generator.state
    again = beam_step(scores, log_table, SamplingParams(temperature=0.0), 4, generator)
    assert again == step
    assert generator.bit_generator.state == state  # beam search draws nothing
    with pytest.raises(ValueError, match="width"):
        beam_search_step(scores, table, 9)  # only 8 pairs have positive probability


def test_beam_step_draws_and_scores() -> None:
    """iid mode: each slot ~ p_beam (chi-square), scores log p_beam; without replacement: distinct pairs."""
    scores = np.array([-0.4, -1.3], dtype=np.float64)
    logits = np.log(np.stack([TARGET_TABLE[0], TARGET_TABLE[3]]))
    law = beam_distribution(scores, logits, WARPED, logits=True)
    generator = np.random.default_rng(5)
    counts: Counter = Counter()
    for _ in range(3000):
        step = beam_step(scores, logits, WARPED, 3, generator)
        for b, v, s in zip(*step):
            counts[b, v] += 1
            assert s == math.log(float(law[b * VOCAB + v]))
    pvalue = chi_square_pvalue(counts, law.reshape(2, VOCAB))
    print(f"beam_step iid slots: p = {pvalue:.4g}")
    assert pvalue > ALPHA
    # iid mode is sample_pairs_iid on p_beam: the same pairs from the same stream
    a, b = np.random.default_rng(6), np.random.default_rng(6)
    step = beam_step(scores, logits, WARPED, 3, a)
    assert [p * VOCAB + t for p, t in zip(step.parents, step.tokens)] == sample_pairs_iid(law, 3, b).tolist()
    assert a.bit_generator.state == b.bit_generator.state
    distinct = beam_step(scores, logits, WARPED, 3, generator, mode="without_replacement")
    assert len(set(zip(distinct.parents, distinct.tokens))) == 3
    # without replacement is sample_pairs_without_replacement on p_beam (its law: test below)
    for seed in range(50):
        a, b = np.random.default_rng(seed), np.random.default_rng(seed)
        step = beam_step(scores, logits, WARPED, 3, a, mode="without_replacement")
        flat = sample_pairs_without_replacement(law, 3, b).tolist()
        assert [p * VOCAB + t for p, t in zip(step.parents, step.tokens)] == flat
        assert step.scores == [math.log(float(law[x])) for x in flat]
        assert a.bit_generator.state == b.bit_generator.state
    with pytest.raises(ValueError, match="distinct"):
        beam_step(scores, logits, WARPED, int((law > 0).sum()) + 1, generator, mode="without_replacement")


def test_sample_pairs_iid_and_draft_layer() -> None:
    p = np.array([0.0, 0.5, 0.0, 0.5], dtype=np.float64)
    draws = sample_pairs_iid(p, 400, np.random.default_rng(1))
    assert draws.shape == (400,) and draws.dtype == np.int64 and set(draws.tolist()) == {1, 3}
    assert sample_pairs_iid(p, 0, np.random.default_rng(1)).shape == (0,)
    nodes = draft_layer(np.array([0.0, 1.0, 0.0], dtype=np.float64), 3, np.random.default_rng())
    assert nodes == [1, 1, 1]  # with replacement: a point mass repeats
    # without replacement: distinct, never a pair of probability 0, the whole support when n is its size
    for seed in range(100):
        drawn = sample_pairs_without_replacement(SUCCESSIVE_P, 5, np.random.default_rng(seed))
        assert drawn.dtype == np.int64 and sorted(drawn.tolist()) == [0, 1, 3, 4, 5]
    assert SUCCESSIVE_P[2] == 0.0 and SUCCESSIVE_P.flags.writeable is False  # the input is left as it was


SUCCESSIVE_P = np.array([0.5, 0.2, 0.0, 0.15, 0.1, 0.05])
SUCCESSIVE_P.flags.writeable = False


def _ordered_law(p: np.ndarray, n: int, successive: bool) -> np.ndarray:
    """Exact law ``[len(p)] * n`` of ``n`` distinct draws: successive sampling (each draw from the rest,
    renormalised), or (``successive=False``) i.i.d. draws conditioned on being distinct."""
    law = np.zeros([p.size] * n)
    for seq in itertools.permutations(np.flatnonzero(p).tolist(), n):
        mass, left = 1.0, 1.0
        for x in seq:
            mass *= p[x] / left if successive else p[x]
            left -= p[x]
        law[seq] = mass
    return law / law.sum()


@pytest.mark.statistical
def test_sampling_without_replacement_is_successive_sampling() -> None:
    """The ordered triples of 20,000 draws fit the successive-sampling law (torch.multinomial's without
    replacement, which it replaces) and reject the law of i.i.d. draws conditioned on being distinct."""
    generator = np.random.default_rng(31)
    counts = Counter(
        tuple(sample_pairs_without_replacement(SUCCESSIVE_P, 3, generator).tolist()) for _ in range(ROUNDS)
    )
    pvalue = chi_square_pvalue(counts, _ordered_law(SUCCESSIVE_P, 3, successive=True))
    tv, bound = total_variation(counts, _ordered_law(SUCCESSIVE_P, 3, successive=True))
    wrong = chi_square_pvalue(counts, _ordered_law(SUCCESSIVE_P, 3, successive=False))
    print(
        f"without replacement: p = {pvalue:.4g}, TV = {tv:.4f} (bound {bound:.4f}); "
        f"against i.i.d.-given-distinct: p = {wrong:.3g}"
    )
    assert pvalue > ALPHA and tv < bound
    assert wrong < 1e-6


# -- per-slot exactness of whole rounds ------------------------------------------------------

EXACT_CASES = {
    "plain W=W_S=2": (PLAIN, 2, 2),
    "warped W=W_S=2": (WARPED, 2, 2),
    "plain W=2 W_S=3": (PLAIN, 3, 2),  # unaccepted drafts: invalid parents at layer 2
    "warped W=2 W_S=3": (WARPED, 3, 2),
    "plain W=W_S=3": (PLAIN, 3, 3),
}


@pytest.mark.parametrize("case", list(EXACT_CASES))
@pytest.mark.statistical
def test_every_output_slot_is_a_p_beam_draw(case: str) -> None:
    """The acceptance test: γ = 2, 20,000 rounds, every slot of every layer against p_beam."""
    params, w_s, width = EXACT_CASES[case]
    counts = run_rounds(params, w_s, gamma=2, width=width, n=ROUNDS, seed=100 + list(EXACT_CASES).index(case))
    # every path is exercised often: failures at layers 1 and 2, and full passes with the extra layer
    assert min(counts.layers_reached[k] for k in (1, 2, 3)) > 1000, counts.layers_reached
    assert_slots_exact(counts, params, case)


@pytest.mark.statistical
def test_dynamic_width_rounds_are_exact() -> None:
    """With the width chosen per layer from (pb, q), slots are still p_beam draws."""
    counts = run_rounds(PLAIN, 3, gamma=2, width=3, n=ROUNDS // 2, seed=77, threshold=0.4, w_min=1)
    assert_slots_exact(counts, PLAIN, "dynamic width t=0.4 W_S=3")


# -- negative controls -----------------------------------------------------------------------


def _min_pvalue(counts: SlotCounts, params: SamplingParams, label: str) -> float:
    pvalues = slot_pvalues(counts, params, label)
    return min(v for k, v in pvalues.items() if not k.endswith("TV excess"))


@pytest.mark.statistical
def test_check_rejects_drafts_drawn_without_replacement(monkeypatch: pytest.MonkeyPatch) -> None:
    def without_replacement(q_beam: np.ndarray, n: int, generator: np.random.Generator) -> list[int]:
        return sample_pairs_without_replacement(q_beam, n, generator).tolist()

    monkeypatch.setattr(dsbd, "draft_layer", without_replacement)
    # enough rounds that the control rejects for any seed, not for a lucky one: with 10,000 rounds the smallest
    # p-value stayed above 1e-6 for 3 of 20 seeds; with 20,000 the largest over 20 seeds was 3e-13
    counts = run_rounds(PLAIN, 2, gamma=2, width=2, n=ROUNDS, seed=11)
    pvalue = _min_pvalue(counts, PLAIN, "drafts without replacement")
    assert pvalue < 1e-6


@pytest.mark.statistical
def test_check_rejects_dropping_invalid_parent_drafts(monkeypatch: pytest.MonkeyPatch) -> None:
    real = dsbd.verify_layer

    def drop_invalid(pb, q_beam, nodes, mask, width, generator) -> LayerVerdict:
        vocab = pb.size // mask.size
        keep = [i for i, x in enumerate(nodes) if mask[x // vocab]]
        verdict = real(pb, q_beam, [nodes[i] for i in keep], mask, width, generator)
        return LayerVerdict([keep[i] for i in verdict.accepted], verdict.passed, verdict.outputs)

    monkeypatch.setattr(dsbd, "verify_layer", drop_invalid)
    # the bias shows at layer 2 only; with 5,000 rounds its p-value stayed above 1e-6 for about 1 seed in 10
    # (torch's and numpy's streams alike), with 10,000 the largest over 30 seeds was 2e-19
    counts = run_rounds(PLAIN, 3, gamma=2, width=2, n=ROUNDS // 2, seed=12)
    pvalue = _min_pvalue(counts, PLAIN, "invalid-parent drafts dropped")
    assert pvalue < 1e-6


@pytest.mark.statistical
def test_check_rejects_the_upside_down_ratio(monkeypatch: pytest.MonkeyPatch) -> None:
    """The paper's printed ratio, min(1, q/p'), instead of min(1, p'/q)."""

    def upside_down(pb, q_beam, nodes, mask, width, generator) -> LayerVerdict:
        vocab = pb.size // mask.size
        current, accepted = pb, []
        for position, x in enumerate(nodes):
            if mask[x // vocab] and generator.random() * float(current[x]) < float(q_beam[x]):
                accepted.append(position)
                if len(accepted) == width:
                    return LayerVerdict(accepted, True, [nodes[i] for i in accepted])
                current = pb
            else:
                current = dsbd._residual(current, q_beam)
        outputs = [nodes[i] for i in accepted] + [dsbd.sample(current, generator)]
        outputs += sample_pairs_iid(pb, width - len(outputs), generator).tolist()
        return LayerVerdict(accepted, False, outputs)

    monkeypatch.setattr(dsbd, "verify_layer", upside_down)
    counts = run_rounds(PLAIN, 2, gamma=2, width=2, n=ROUNDS // 10, seed=13)
    assert _min_pvalue(counts, PLAIN, "upside-down ratio") < 1e-6


# -- reductions ------------------------------------------------------------------------------


@pytest.mark.parametrize("params", [PLAIN, WARPED], ids=["plain", "warped"])
def test_gamma_zero_round_is_beam_step(params: SamplingParams) -> None:
    """Without drafts a round is one target-only beam step: the same draws under the same seed."""
    scores = np.array([s for _, s in INPUT_BEAMS], dtype=np.float64)
    logits = np.log(np.stack([target_fn(p) for p, _ in INPUT_BEAMS]))
    for seed in range(200):
        result = dsbd_round(INPUT_BEAMS, target_fn, draft_fn, params, 2, 0, 3, np.random.default_rng(seed))
        step = beam_step(scores, logits, params, 3, np.random.default_rng(seed))
        assert [b.prefix for b in result.beams] == [(*INPUT_BEAMS[p][0], t) for p, t in zip(step.parents, step.tokens)]
        assert [b.score for b in result.beams] == step.scores
        assert len(result.layers) == 1 and result.layers[0].drafted == 0


@pytest.mark.parametrize("params", [PLAIN, WARPED], ids=["plain", "warped"])
@pytest.mark.parametrize("width", [2, 3])
def test_draft_equal_to_target_accepts_every_node(params: SamplingParams, width: int) -> None:
    """q_beam == p_beam exactly at every layer (same tables, same parents, same scores): ratio 1."""
    generator = np.random.default_rng(width)
    memo: dict = {}
    for _ in range(500):
        result = dsbd_round(INPUT_BEAMS, target_fn, target_fn, params, width, 3, width, generator, memo=memo)
        assert [layer.accepted for layer in result.layers] == [width] * 3 + [0]
        assert all(len(b.prefix) == 1 + 4 for b in result.beams)
    # with W < W_S the unaccepted drafts' children are invalid parents, so later layers can fail
    passed_first = [
        dsbd_round(INPUT_BEAMS, target_fn, target_fn, params, 3, 2, 2, generator).layers[0].passed for _ in range(100)
    ]
    assert all(passed_first)

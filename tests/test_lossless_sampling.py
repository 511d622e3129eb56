"""Acceptance test: speculative sampling through the real decoding loops is lossless.

A 12-token target makes the law of the first tokens enumerable: the exact joint law of the
first four generated tokens (12**4 cells) comes from the Hugging Face reference model
(``LoadedModel.to_hf()``, independent of the runtime's backends: the one use of torch here) and
the sampler's own warping. ``Engine.generate`` then decodes 20,000 seeded requests and the empirical law is
compared with the exact one.

Why four tokens with ``num_draft_tokens=2``: ``k_i`` is capped at ``max_tokens - generated - 1``
and the first token always comes from the prefill, so with four tokens the second step
verifies a full chain of two drafts (tokens 2-3, bonus token 4), and a rejection leads to a
one-draft step and then a draft-free step. Every path of the verifier shows up in the law
of tokens 1-3 or 2-4, the two marginals tested (1,728 cells each).

Thresholds. Each chi-square test (cells with expected count < 5 pooled) passes when its
p-value exceeds ``ALPHA = 1e-3``: the seeds are fixed so every run is deterministic, and a
correct sampler fails one such check for at most 0.1 % of seed choices, the false-alarm
rate we accept when a code change re-rolls the random streams. The total-variation check
uses E[TV] <= 1/2 * sum_i sqrt(p_i (1 - p_i) / n) (Jensen) plus the McDiarmid slack
sqrt(ln(1e4) / (2 n)) (one sample moves TV by at most 1/n), so a correct sampler exceeds
it with probability below 1e-4. The negative controls show the same checks on the same
samples reject the draft model's own law, and on fewer samples reject a subtly wrong
verifier, by many orders of magnitude.
"""

from __future__ import annotations

import itertools
import math
import time
from collections import Counter

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from specdec.models.loading import LoadedModel, tiny_random
from specdec.runtime import context
from specdec.runtime.config import DrafterKind, EngineConfig
from specdec.runtime.draft_length import DraftLength, DraftStats
from specdec.runtime.engine import Engine
from specdec.runtime.request import Request
from specdec.runtime.sampling import SamplingParams, sample, warp

ALPHA = 1e-3
VOCAB = 12
NUM_TOKENS = 4
NUM_SAMPLES = 20_000
MAX_BATCH = 1000
# every token of the vocabulary occurs in the prompt, so the n-gram drafter always proposes
PROMPT = (3, 7, 1, 0, 9, 4, 11, 2, 8, 5, 10, 6, 3, 7)
PLAIN = SamplingParams(temperature=1.0)
# both cuts bind for this target: top-k removes tokens top-p alone would keep in about 3/4
# of the enumerated contexts, and top-p cuts inside the top 6 in all of them
WARPED = SamplingParams(temperature=1.3, top_k=6, top_p=0.9)
_TINY = dict(
    vocab_size=VOCAB,
    num_layers=1,
    hidden_size=32,
    num_heads=2,
    num_kv_heads=1,
    intermediate_size=64,
    max_position_embeddings=64,
)


@pytest.fixture(scope="module")
def target() -> LoadedModel:
    # init_std 0.4 makes the 12-way distributions peaky enough that 20,000 samples cover
    # most of the joint law's mass in cells with expected count >= 5
    return tiny_random(seed=11, init_std=0.4, name="lossless-target", **_TINY)


@pytest.fixture(scope="module")
def draft() -> LoadedModel:
    """Same seed, smaller init: related to the target but clearly different.

    Per-token TV(p, q) is about 0.1-0.2 and the 3-token TV about 0.3, so the verifier
    accepts most drafts but rejects thousands: acceptance, residual resampling and bonus
    tokens all occur often. (An unrelated seed is rejected almost always, which would leave
    the acceptance path nearly untested.)
    """
    return tiny_random(seed=11, init_std=0.32, name="lossless-draft", **_TINY)


# -- exact laws ----------------------------------------------------------------------------


def exact_joint(model: LoadedModel, params: SamplingParams, n: int = NUM_TOKENS) -> np.ndarray:
    """The exact law ``[V] * n`` of the first ``n`` sampled tokens after ``PROMPT``.

    ``model.to_hf()`` is the Hugging Face reference model (torch in, torch out), or any callable of the same
    shape whose ``logits`` may also be numpy (``test_quantize``'s graph); they become float32 numpy, the rows
    the runtime's backends hand the sampler.
    """
    conts = torch.tensor(list(itertools.product(range(VOCAB), repeat=n - 1)), dtype=torch.int64)
    ids = torch.cat([torch.tensor(PROMPT).expand(len(conts), -1), conts], dim=1)
    with torch.no_grad():
        out = model.to_hf()(ids).logits[:, len(PROMPT) - 1 :]  # [V^(n-1), n, V]
        logits = torch.as_tensor(out).float().numpy()
    probs = warp(logits, params).astype(np.float64)
    probs = (probs / probs.sum(-1, keepdims=True)).reshape(*[VOCAB] * (n - 1), n, VOCAB)
    logits = logits.reshape(*[VOCAB] * (n - 1), n, VOCAB)
    joint = np.ones([VOCAB] * n)
    for j in range(n):
        # law of token j given tokens < j: any continuation beyond j gives the same row
        index = (*[slice(None)] * j, *[0] * (n - 1 - j), j)
        reachable = np.ravel(joint.sum(axis=tuple(range(j, n))) > 0)  # contexts of positive probability
        _assert_warp_well_conditioned(logits[index].reshape(-1, VOCAB)[reachable], params)
        row = probs[index]  # [V] * (j + 1)
        joint = joint * row.reshape(*row.shape, *[1] * (n - 1 - j))
    return joint


def _assert_warp_well_conditioned(logits: np.ndarray, params: SamplingParams) -> None:
    """No top-k or top-p decision within 1e-4 of its threshold in any reachable context.

    The runtime's logits differ from the reference model's by rounding (~1e-6); this margin
    makes sure that cannot change which tokens the warping keeps, so the enumerated law is
    the one the runtime samples from.
    """
    scores = -np.sort(-(logits.astype(np.float64) / params.temperature), axis=-1)  # descending
    if 0 < params.top_k < VOCAB:
        assert float((scores[:, params.top_k - 1] - scores[:, params.top_k]).min()) > 1e-4
        scores[:, params.top_k :] = -math.inf
    if params.top_p < 1.0:
        exp = np.exp(scores - scores[:, :1])
        probs = exp / exp.sum(axis=-1, keepdims=True)
        mass_before = np.cumsum(probs, axis=-1) - probs
        assert float(np.abs(mass_before - params.top_p).min()) > 1e-4


# -- running the engine --------------------------------------------------------------------


def generate_samples(
    target: LoadedModel,
    draft: LoadedModel | str,
    method: str,
    params: SamplingParams,
    n: int,
    seed0: int,
    num_draft_tokens: int = 2,
    draft_length: DraftLength | None = None,
    max_tokens: int = NUM_TOKENS,
    hybrid: bool = False,
) -> tuple[Counter, float, float]:
    """(counts of the first NUM_TOKENS outputs, acceptance rate, seconds) over ``n`` seeded requests."""
    engine = Engine.from_models(
        target,
        None if isinstance(draft, str) else draft,
        config=EngineConfig(
            max_batch=MAX_BATCH,
            max_len=32,
            num_draft_tokens=num_draft_tokens,
            draft_length=draft_length,
            drafter=DrafterKind.HYBRID if hybrid else DrafterKind.parse(draft) if isinstance(draft, str) else None,
        ),
    )
    requests = [
        Request(
            PROMPT,
            max_tokens=max_tokens,
            sampling=SamplingParams(params.temperature, params.top_k, params.top_p, seed=seed0 + i),
        )
        for i in range(n)
    ]
    start = time.perf_counter()
    result = engine.generate(requests, method)
    seconds = time.perf_counter() - start
    assert all(o.error is None and len(o.token_ids) == max_tokens for o in result.outputs)
    drafted = sum(o.metrics.draft_tokens for o in result.outputs)
    accepted = sum(o.metrics.accepted_draft_tokens for o in result.outputs)
    return Counter(tuple(o.token_ids[:NUM_TOKENS]) for o in result.outputs), accepted / max(drafted, 1), seconds


def marginal_counts(counts: Counter, keep: slice) -> Counter:
    out: Counter = Counter()
    for tokens, c in counts.items():
        out[tokens[keep]] += c
    return out


def chi_square_pvalue(counts: Counter, law: np.ndarray) -> float:
    """Goodness of fit of ``counts`` (keyed by index tuples of ``law``), expected < 5 pooled."""
    n = sum(counts.values())
    impossible = {k: c for k, c in counts.items() if law[k] == 0.0}
    assert not impossible, f"outcomes of probability 0 were drawn: {impossible}"
    p = law.ravel() / law.sum()
    observed = np.zeros(p.size)
    for k, c in counts.items():
        observed[np.ravel_multi_index(k, law.shape)] = c
    expected = p * n
    big, small = expected >= 5, (expected < 5) & (p > 0)
    f_obs, f_exp = list(observed[big]), list(expected[big])
    if small.any():
        f_obs.append(observed[small].sum())
        f_exp.append(expected[small].sum())
    return float(chisquare(f_obs, f_exp).pvalue)


def total_variation(counts: Counter, law: np.ndarray) -> tuple[float, float]:
    """(TV between the empirical and exact laws, the bound a correct sampler stays under)."""
    n = sum(counts.values())
    p = law / law.sum()
    empirical = np.zeros(law.shape)
    for k, c in counts.items():
        empirical[k] = c / n
    tv = 0.5 * float(np.abs(empirical - p).sum())
    bound = 0.5 * float(np.sqrt(p * (1 - p) / n).sum()) + math.sqrt(math.log(1e4) / (2 * n))
    return tv, bound


def assert_lossless(counts: Counter, law: np.ndarray, label: str) -> None:
    """Tokens 1-3 and tokens 2-4 each fit the exact law (chi-square and TV)."""
    for keep, axis in ((slice(0, 3), 3), (slice(1, 4), 0)):
        marginal, exact = marginal_counts(counts, keep), law.sum(axis=axis)
        pvalue = chi_square_pvalue(marginal, exact)
        tv, bound = total_variation(marginal, exact)
        print(
            f"{label} tokens {keep.start + 1}-{keep.stop}: chi-square p = {pvalue:.4g}, "
            f"TV = {tv:.4f} (bound {bound:.4f})"
        )
        assert pvalue > ALPHA, f"{label}: tokens {keep.start + 1}-{keep.stop} do not follow the target's law"
        assert tv < bound


# -- the tests -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def plain_law(target: LoadedModel) -> np.ndarray:
    return exact_joint(target, PLAIN)


@pytest.fixture(scope="module")
def ems_plain_samples(target: LoadedModel, draft: LoadedModel) -> Counter:
    counts, acceptance, seconds = generate_samples(target, draft, "ems", PLAIN, NUM_SAMPLES, seed0=0)
    print(f"ems/draft plain: {NUM_SAMPLES} requests in {seconds:.1f} s, acceptance {acceptance:.3f}")
    assert 0.5 < acceptance < 0.95  # both acceptance and rejection are exercised thousands of times
    return counts


@pytest.mark.statistical
def test_ems_draft_model_sampling_is_lossless(ems_plain_samples: Counter, plain_law: np.ndarray) -> None:
    assert_lossless(ems_plain_samples, plain_law, "ems/draft T=1")


@pytest.mark.statistical
def test_ems_hybrid_drafter_sampling_is_lossless(
    target: LoadedModel, draft: LoadedModel, plain_law: np.ndarray
) -> None:
    """Prompt lookup where the prompt's 2-grams recur (always at the first step: the prompt ends with its first
    2-gram), the draft model elsewhere: a point-mass q and the model's q mixed within one request's steps."""
    counts, acceptance, seconds = generate_samples(target, draft, "ems", PLAIN, NUM_SAMPLES, seed0=50_000, hybrid=True)
    print(f"ems/hybrid plain: {NUM_SAMPLES} requests in {seconds:.1f} s, acceptance {acceptance:.3f}")
    assert 0.05 < acceptance < 0.95
    assert_lossless(counts, plain_law, "ems/hybrid T=1")


@pytest.mark.statistical
def test_ems_draft_model_warped_sampling_is_lossless(target: LoadedModel, draft: LoadedModel) -> None:
    law = exact_joint(target, WARPED)
    counts, acceptance, seconds = generate_samples(target, draft, "ems", WARPED, NUM_SAMPLES, seed0=10**6)
    print(f"ems/draft warped: {seconds:.1f} s, acceptance {acceptance:.3f}")
    assert 0.3 < acceptance < 0.95
    assert_lossless(counts, law, "ems/draft T=1.3 top_k=6 top_p=0.9")


@pytest.mark.statistical
def test_ems_ngram_sampling_is_lossless(target: LoadedModel, plain_law: np.ndarray) -> None:
    counts, acceptance, seconds = generate_samples(target, "ngram", "ems", PLAIN, NUM_SAMPLES, seed0=2 * 10**6)
    print(f"ems/ngram plain: {seconds:.1f} s, acceptance {acceptance:.3f}")
    assert 0.02 < acceptance < 0.95  # point-mass drafts are accepted sometimes, rejected mostly
    assert_lossless(counts, plain_law, "ems/ngram T=1")


class RecordedLength(DraftLength):
    """The adaptive policy, counting its (cap, chosen k) decisions in ``CHOSEN``."""

    def choose(
        self,
        stats: DraftStats,
        k_max: int,
        draft_cost: float,
        rows: float = 1.0,
        batch: int | None = None,
        prior: float | None = None,
        own_price: bool = False,
    ) -> int:
        assert batch is None and prior is None  # sampled sequences: priced alone, from the fixed prior
        k = super().choose(stats, k_max, draft_cost, rows, batch=batch, prior=prior, own_price=own_price)
        CHOSEN[(k_max, k)] += 1
        return k


CHOSEN: Counter = Counter()


@pytest.mark.statistical
def test_ems_adaptive_draft_length_sampling_is_lossless(
    target: LoadedModel, draft: LoadedModel, plain_law: np.ndarray
) -> None:
    """k chosen from each request's own acceptance so far (which depends on its earlier random draws) keeps
    the law exact. Requests run 8 tokens so the budget does not fix k inside the first four: the prior
    gives k = 1 at the first step, then an accepted draft raises the next step's k to 2 and a rejected
    one keeps 1, so both choices under the same cap occur thousands of times."""
    CHOSEN.clear()
    policy = RecordedLength(verify_cost=0.15)  # + the model drafter's 0.1 per draft
    counts, acceptance, seconds = generate_samples(
        target, draft, "ems", PLAIN, NUM_SAMPLES, seed0=5 * 10**6, draft_length=policy, max_tokens=2 * NUM_TOKENS
    )
    print(f"ems/draft adaptive: {seconds:.1f} s, acceptance {acceptance:.3f}, choices {dict(CHOSEN)}")
    assert CHOSEN[(2, 1)] > 1000 and CHOSEN[(2, 2)] > 1000
    assert_lossless(counts, plain_law, "ems/draft adaptive k T=1")


@pytest.mark.statistical
def test_vanilla_draft_model_sampling_is_lossless(
    target: LoadedModel, draft: LoadedModel, plain_law: np.ndarray
) -> None:
    counts, acceptance, seconds = generate_samples(target, draft, "vanilla", PLAIN, NUM_SAMPLES, seed0=3 * 10**6)
    print(f"vanilla/draft plain: {seconds:.1f} s, acceptance {acceptance:.3f}")
    assert_lossless(counts, plain_law, "vanilla/draft T=1")


@pytest.mark.statistical
def test_check_rejects_the_draft_models_own_law(
    ems_plain_samples: Counter, draft: LoadedModel, plain_law: np.ndarray
) -> None:
    """Negative control: the same samples are far from the draft's law, and the check says so."""
    draft_law = exact_joint(draft, PLAIN)
    assert 0.5 * np.abs(draft_law - plain_law).sum() > 0.1
    for keep, axis in ((slice(0, 3), 3), (slice(1, 4), 0)):
        marginal = marginal_counts(ems_plain_samples, keep)
        pvalue = chi_square_pvalue(marginal, draft_law.sum(axis=axis))
        tv, bound = total_variation(marginal, draft_law.sum(axis=axis))
        print(f"ems samples vs the draft's law, tokens {keep.start + 1}-{keep.stop}: p = {pvalue:.3g}, TV = {tv:.3f}")
        assert pvalue < 1e-12
        assert tv > 2 * bound


@pytest.mark.statistical
def test_check_rejects_a_subtly_wrong_verifier(
    target: LoadedModel, draft: LoadedModel, plain_law: np.ndarray, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Negative control through the real loop: resampling a rejected draft from p instead of
    norm(max(0, p - q)) (a classic bug) is caught with a quarter of the samples."""

    def resample_from_p(drafts, draft_probs, target_probs, generator):
        out = []
        for j, x in enumerate(drafts):
            qx = 1.0 if draft_probs is None else float(draft_probs[j, x])
            if generator.random() * qx < float(target_probs[j, x]):
                out.append(int(x))
                continue
            return [*out, sample(target_probs[j], generator)]
        return [*out, sample(target_probs[len(drafts)], generator)]

    monkeypatch.setattr(context, "verify_sampling", resample_from_p)
    counts, _, _ = generate_samples(target, draft, "ems", PLAIN, NUM_SAMPLES // 4, seed0=4 * 10**6)
    pvalues = [
        chi_square_pvalue(marginal_counts(counts, keep), plain_law.sum(axis=axis))
        for keep, axis in ((slice(0, 3), 3), (slice(1, 4), 0))
    ]
    print(f"resample-from-p bug, tokens 1-3 and 2-4: p = {pvalues[0]:.3g}, {pvalues[1]:.3g}")
    assert min(pvalues) < 1e-6


# -- per-request random streams ------------------------------------------------------------


@pytest.fixture(scope="module")
def rng_engine() -> Engine:
    """A 128-token pair with a draft model; small batch so late requests join a running pack."""
    kw = dict(vocab_size=128, num_layers=1, hidden_size=32, num_heads=2, num_kv_heads=1, intermediate_size=64)
    target = tiny_random(seed=5, init_std=0.2, name="rng-target", **kw)
    draft = tiny_random(seed=6, init_std=0.2, name="rng-draft", **kw)
    return Engine.from_models(target, draft, config=EngineConfig(max_batch=4, max_len=96, num_draft_tokens=3))


NEEDLE_PROMPT = (5, 17, 99, 3, 42, 8)


def _needle(seed: int = 1234) -> Request:
    return Request(NEEDLE_PROMPT, max_tokens=20, sampling=SamplingParams(0.9, seed=seed))


def _neighbours(count: int, offset: int) -> list[Request]:
    gen = np.random.default_rng(offset)
    out = []
    for i in range(count):
        prompt = tuple(int(t) for t in gen.integers(0, 128, size=int(gen.integers(1, 30))))
        sampling = (
            SamplingParams(0.0)
            if i % 3 == 0
            else SamplingParams(0.5 + 0.2 * (i % 4), top_k=int(gen.integers(0, 50)), seed=offset + i)
        )
        out.append(
            Request(
                prompt,
                max_tokens=int(gen.integers(1, 30)),
                sampling=sampling,
                num_draft_tokens=None if i % 2 else int(gen.integers(0, 6)),
            )
        )
    return out


@pytest.fixture(params=["fixed k", "adaptive k", "adaptive k, prompt lookup", "adaptive k, hybrid"])
def rng_engine_k(rng_engine: Engine, request: pytest.FixtureRequest):
    """The engine with a fixed k, or with the adaptive draft length (k from each request's own history); with
    drafters that tell what they offer (``OfferingDrafter``), whose greedy neighbours' batches are planned
    (``DraftLength.plan``) beside the sampled request."""
    from specdec.runtime.drafters import HybridDrafter, NgramDrafter

    model = rng_engine.drafter
    if request.param.endswith("prompt lookup"):
        rng_engine.drafter = NgramDrafter(max_ngram=2, min_ngram=1)
    elif request.param.endswith("hybrid"):
        rng_engine.drafter = HybridDrafter(NgramDrafter(max_ngram=2, min_ngram=1), model)
    # the planner learns what the drafter can tell it when it is made: after the drafter
    rng_engine.reconfigure(draft_length=None if request.param == "fixed k" else DraftLength(verify_cost=0.1))
    yield rng_engine
    rng_engine.drafter = model
    rng_engine.reconfigure(draft_length=None)


def test_seeded_request_output_does_not_depend_on_its_batch(rng_engine_k: Engine) -> None:
    rng_engine = rng_engine_k
    alone = rng_engine.generate([_needle()], "ems").outputs[0].token_ids
    assert len(alone) == 20
    first = rng_engine.generate([_needle(), *_neighbours(9, 100)], "ems").outputs[0].token_ids
    middle_reqs = [*_neighbours(3, 200), _needle(), *_neighbours(3, 300)]
    middle = rng_engine.generate(middle_reqs, "ems").outputs[3].token_ids
    # admitted only after earlier requests finish: prefilled in the same pack as others' verification
    late_reqs = [*_neighbours(10, 400), _needle()]
    late = rng_engine.generate(late_reqs, "ems").outputs[-1].token_ids
    assert first == alone
    assert middle == alone
    assert late == alone


def test_same_seed_repeats_and_different_seeds_differ(rng_engine_k: Engine) -> None:
    rng_engine = rng_engine_k
    outs = rng_engine.generate([_needle(7), _needle(7), _needle(8), *_neighbours(3, 500), _needle(7)], "ems").outputs
    assert outs[0].token_ids == outs[1].token_ids == outs[-1].token_ids
    assert outs[0].token_ids != outs[2].token_ids
    others = {tuple(o.token_ids) for o in rng_engine.generate([_needle(s) for s in range(10, 20)], "ems").outputs}
    assert len(others) == 10

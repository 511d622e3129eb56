"""Draft models with a restricted-vocabulary LM head (K rows for the K listed target tokens).

Such a draft reads every target token but proposes only tokens of its head, with q = 0
elsewhere. Greedy decoding must stay token-identical to ``ar`` and sampling lossless (the
residual max(0, p - q) covers tokens outside the head), on the torch and the ONNX Runtime
backends, and the head map must survive save/load and export.
"""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest
import torch
from test_exactness import assert_same_as_ar, make_prompts
from test_lossless_sampling import _TINY as LOSSLESS_TINY
from test_lossless_sampling import (
    NUM_SAMPLES,
    PLAIN,
    VOCAB,
    assert_lossless,
    chi_square_pvalue,
    exact_joint,
    generate_samples,
    marginal_counts,
)

from specdec.export.cli import main as export_main
from specdec.export.validate import max_logit_error
from specdec.models.errors import ModelResolutionError
from specdec.models.export_meta import HEAD_TOKEN_IDS_FILE
from specdec.models.loading import LoadedModel, load_model, restrict_head, save_model, tiny_random
from specdec.models.manifest import read_manifest
from specdec.runtime.backends.onnxruntime import OrtBackend
from specdec.runtime.backends.torch_backend import TorchBackend
from specdec.runtime.config import DrafterKind, EngineConfig
from specdec.runtime.drafters import ModelDrafter
from specdec.runtime.engine import Engine
from specdec.runtime.request import Request, SeqState
from specdec.runtime.sampling import SamplingParams, warp

GREEDY_VOCAB = 96
EVEN = list(range(0, GREEDY_VOCAB, 2))  # K = V / 2: the target's argmax falls on both sides of the head
MAX_TOKENS = (30, 9, 25, 1, 20, 14)


def _head_set(model: LoadedModel) -> set[int]:
    return set(model.head_token_ids.tolist())


# -- the representation --------------------------------------------------------------------


def test_restrict_head_takes_rows_of_the_lm_head_or_the_tied_embeddings() -> None:
    full = tiny_random(seed=3, vocab_size=32, num_layers=1, hidden_size=16, num_heads=2, num_kv_heads=1)
    small = restrict_head(full, [9, 1, 30, 4])  # any order in, ascending out
    assert small.head_token_ids.dtype == torch.long and small.head_token_ids.tolist() == [1, 4, 9, 30]
    assert small.vocab_size == 32 and small.config.tie_word_embeddings is False
    assert torch.equal(small.state_dict["lm_head.weight"], full.state_dict["lm_head.weight"][[1, 4, 9, 30]])
    assert small.state_dict["model.embed_tokens.weight"].shape[0] == 32
    assert full.head_token_ids is None and full.state_dict["lm_head.weight"].shape[0] == 32  # untouched
    tied = tiny_random(
        seed=3, vocab_size=32, num_layers=1, hidden_size=16, num_heads=2, num_kv_heads=1, tie_word_embeddings=True
    )
    from_tied = restrict_head(tied, [2, 5])
    assert torch.equal(from_tied.state_dict["lm_head.weight"], tied.state_dict["model.embed_tokens.weight"][[2, 5]])
    assert tied.config.tie_word_embeddings is True and from_tied.config.tie_word_embeddings is False
    again = restrict_head(small, [4, 30])
    assert torch.equal(again.state_dict["lm_head.weight"], full.state_dict["lm_head.weight"][[4, 30]])
    for bad in ([], [1, 1], [0, 32], [-1], [[1, 2]]):
        with pytest.raises(ValueError):
            restrict_head(full, bad)
    with pytest.raises(ValueError, match="subset"):
        restrict_head(small, [2])
    # the torch backend scores exactly the head's rows of the full model
    ids = [3, 17, 8, 30]
    from specdec.runtime.packed import SeqWork, pack

    a, b = TorchBackend(full), TorchBackend(small)
    assert (b.vocab_size, b.head_size) == (32, 4) and b.head_token_ids.dtype == np.int64
    assert np.array_equal(b.head_token_ids, small.head_token_ids.numpy())
    want = a.step(pack([SeqWork(0, 0, ids)]), a.allocate_cache(1, 8))[:, b.head_token_ids]
    assert np.allclose(b.step(pack([SeqWork(0, 0, ids)]), b.allocate_cache(1, 8)), want, atol=1e-6)


def test_save_load_round_trip_keeps_the_head_map(tmp_path) -> None:
    model = restrict_head(tiny_random(seed=4, vocab_size=48, num_layers=1), range(0, 48, 3))
    out = save_model(model, tmp_path / "draft")
    assert json.loads((out / HEAD_TOKEN_IDS_FILE).read_text()) == list(range(0, 48, 3))
    loaded = load_model(out)
    assert torch.equal(loaded.head_token_ids, model.head_token_ids) and loaded.head_token_ids.dtype == torch.long
    assert loaded.config.vocab_size == 48 and loaded.config.tie_word_embeddings is False
    assert sorted(loaded.state_dict) == sorted(model.state_dict)
    assert all(torch.equal(loaded.state_dict[k], v) for k, v in model.state_dict.items())
    logits = loaded.to_hf()(torch.tensor([[1, 2, 3]])).logits  # an independent reference with a K-column head
    assert logits.shape == (1, 3, 16)
    (out / HEAD_TOKEN_IDS_FILE).write_text(json.dumps(list(range(0, 48, 2))))  # 24 ids for 16 rows
    with pytest.raises(ModelResolutionError, match="16 rows"):
        load_model(out)
    (out / HEAD_TOKEN_IDS_FILE).write_text("[3, 1]")
    with pytest.raises(ModelResolutionError, match="ascending"):
        load_model(out)


def test_a_target_with_a_restricted_head_is_refused() -> None:
    model = tiny_random(seed=4, vocab_size=48, num_layers=1)
    with pytest.raises(ValueError, match="only a draft"):
        Engine.from_models(restrict_head(model, range(10)), model)
    with pytest.raises(ValueError, match="only a draft"):
        Engine(TorchBackend(restrict_head(model, range(10))))


# -- greedy: identical to ar ---------------------------------------------------------------


@pytest.fixture(scope="module")
def greedy_target() -> LoadedModel:
    return tiny_random(seed=11, vocab_size=GREEDY_VOCAB, num_layers=2, init_std=0.05)


def test_greedy_ems_and_vanilla_with_a_restricted_draft_equal_ar(greedy_target: LoadedModel) -> None:
    # the target's own body with half its head: drafts agree wherever the target's argmax is in the head
    draft = restrict_head(greedy_target, EVEN)
    engine = Engine.from_models(greedy_target, draft, config=EngineConfig(max_batch=4, max_len=256, num_draft_tokens=4))
    proposed: list[int] = []
    propose = engine.drafter.propose

    def spy(seqs, ks):
        drafts = propose(seqs, ks)
        proposed.extend(t for d in drafts for t in d.tokens)
        return drafts

    engine.drafter.propose = spy
    requests = [Request(p, max_tokens=m) for p, m in zip(make_prompts(GREEDY_VOCAB), MAX_TOKENS)]
    reference = engine.generate(requests, "ar")
    produced = Counter(t for o in reference.outputs for t in o.token_ids)
    outside = sum(c for t, c in produced.items() if t % 2)
    assert outside >= 10 and sum(produced.values()) - outside >= 10  # argmax falls on both sides of the head
    for method in ("ems", "vanilla"):
        result = engine.generate(requests, method)
        assert_same_as_ar(engine.target, reference, result, f"{method}/restricted draft")
        summary = result.run.summary()
        assert summary["accepted_draft_tokens"] > 0 and summary["acceptance_rate"] < 1.0
    assert proposed and set(proposed) <= _head_set(draft)


def test_sampled_draft_probs_cover_the_full_vocabulary_and_vanish_off_the_head(greedy_target: LoadedModel) -> None:
    draft = restrict_head(greedy_target, EVEN)
    head = draft.head_token_ids.numpy()
    drafter = ModelDrafter(TorchBackend(draft), max_batch=2, max_len=64)
    assert drafter.vocab_size == GREEDY_VOCAB
    params = [SamplingParams(1.0, seed=1), SamplingParams(1.3, top_k=7, top_p=0.8, seed=2)]
    seqs = [
        SeqState.start(Request((5, 6, 7, 8, 9)[: 3 + i], max_tokens=10, sampling=p), i) for i, p in enumerate(params)
    ]
    drafts = drafter.propose(seqs, [4, 3])
    hf = draft.to_hf()
    for seq, d, p in zip(seqs, drafts, params):
        assert d.probs.shape == (len(d.tokens), GREEDY_VOCAB)
        assert np.allclose(d.probs.sum(-1), np.ones(len(d.tokens)), atol=1e-6)
        off = np.ones(GREEDY_VOCAB, dtype=bool)
        off[head] = False
        assert float(np.abs(d.probs[:, off]).max()) == 0.0
        assert all(t in _head_set(draft) and float(d.probs[j, t]) > 0 for j, t in enumerate(d.tokens))
        # q over the head is the warped law of the reference model's K logits, at each draft position
        ids = torch.tensor([seq.tokens + d.tokens[:-1]])
        with torch.no_grad():
            logits = hf(ids).logits[0, len(seq.tokens) - 1 :]
        assert np.allclose(d.probs[:, head], warp(logits.numpy(), p), atol=1e-5)


# -- sampling: lossless --------------------------------------------------------------------

LOSSLESS_HEAD = (0, 2, 3, 5, 8, 9)  # K = 6 of 12 tokens; the target puts about half its mass outside


@pytest.fixture(scope="module")
def lossless_target() -> LoadedModel:
    return tiny_random(seed=11, init_std=0.4, name="lossless-target", **LOSSLESS_TINY)


@pytest.fixture(scope="module")
def lossless_draft() -> LoadedModel:
    """The draft of test_lossless_sampling (same seed, smaller init) with half of its head cut off."""
    return restrict_head(tiny_random(seed=11, init_std=0.32, name="lossless-draft", **LOSSLESS_TINY), LOSSLESS_HEAD)


@pytest.fixture(scope="module")
def lossless_plain_law(lossless_target: LoadedModel) -> np.ndarray:
    return exact_joint(lossless_target, PLAIN)


@pytest.mark.statistical
def test_ems_sampling_with_a_restricted_draft_is_lossless(
    lossless_target: LoadedModel, lossless_draft: LoadedModel, lossless_plain_law: np.ndarray
) -> None:
    """The end-to-end check of test_lossless_sampling (same ALPHA and TV bound, same reasoning).

    Only T = 1 runs end to end (20 s); that the warped q of a restricted head is the warped
    law of its K logits is checked exactly above, and the verifier does not care how q came about.
    """
    outside = [t for t in range(VOCAB) if t not in LOSSLESS_HEAD]
    assert lossless_plain_law.sum(axis=(1, 2, 3))[outside].sum() > 0.2  # the first token is often off the head
    counts, acceptance, seconds = generate_samples(
        lossless_target, lossless_draft, "ems", PLAIN, NUM_SAMPLES, seed0=7 * 10**6
    )
    print(f"ems/restricted draft T=1: {seconds:.1f} s, acceptance {acceptance:.3f}")
    assert 0.2 < acceptance < 0.9  # acceptance, residual resampling and off-head tokens all occur thousands of times
    assert sum(c for k, c in counts.items() if k[1] not in LOSSLESS_HEAD) > 1000
    assert_lossless(counts, lossless_plain_law, "ems/restricted draft T=1")


@pytest.mark.statistical
def test_check_rejects_q_scattered_to_the_wrong_columns(
    lossless_target: LoadedModel,
    lossless_draft: LoadedModel,
    lossless_plain_law: np.ndarray,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Negative control: q placed in columns 0..K-1 instead of at the head's token ids (a
    forgotten map) is caught with a quarter of the samples."""

    def first_columns(self, q: np.ndarray) -> np.ndarray:
        full = np.zeros((q.shape[0], self.vocab_size), dtype=q.dtype)
        full[:, : q.shape[1]] = q
        return full

    monkeypatch.setattr(ModelDrafter, "_full_vocab", first_columns)
    counts, _, _ = generate_samples(lossless_target, lossless_draft, "ems", PLAIN, NUM_SAMPLES // 4, seed0=8 * 10**6)
    pvalues = [
        chi_square_pvalue(marginal_counts(counts, keep), lossless_plain_law.sum(axis=axis))
        for keep, axis in ((slice(0, 3), 3), (slice(1, 4), 0))
    ]
    print(f"q in the wrong columns, tokens 1-3 and 2-4: p = {pvalues[0]:.3g}, {pvalues[1]:.3g}")
    assert min(pvalues) < 1e-6


# -- export --------------------------------------------------------------------------------

EXPORT_TARGET = "tiny-random:seed=9,num_layers=2,hidden_size=32,num_heads=2,num_kv_heads=1,intermediate_size=64"


@pytest.fixture(scope="module")
def restricted_export(tmp_path_factory) -> tuple[LoadedModel, LoadedModel, object]:
    """(target, restricted draft, export dir): the ONNX export of the pair through specdec-export --draft DIR."""
    root = tmp_path_factory.mktemp("restricted")
    target = load_model(EXPORT_TARGET)
    draft = restrict_head(target, range(0, 128, 2))  # the target's body: drafts are often accepted
    save_model(draft, root / "draft-src")
    out = root / "deploy"
    assert (
        export_main(
            [
                "--target",
                EXPORT_TARGET,
                "--draft",
                str(root / "draft-src"),
                "--out",
                str(out),
                "--max-batch",
                "4",
                "--max-len",
                "128",
            ]
        )
        == 0
    )
    return target, draft, out


def test_onnx_export_of_a_restricted_draft_matches_torch(restricted_export) -> None:
    _, draft, out = restricted_export
    manifest = read_manifest(out)
    assert manifest["draft"]["vocab_size"] == 128 and manifest["draft"]["head_size"] == 64
    assert manifest["target"]["head_size"] == 128
    assert f"draft/{HEAD_TOKEN_IDS_FILE}" in manifest["draft"]["files"]
    assert manifest["draft"]["validation_max_abs_logit_error"] < 1e-4
    backend = OrtBackend(out / manifest["draft"]["graph"])
    assert (backend.vocab_size, backend.head_size) == (128, 64)
    assert np.array_equal(backend.head_token_ids, draft.head_token_ids.numpy())
    assert max_logit_error(TorchBackend(draft), backend, num_slots=5, max_len=48, seed=1) < 1e-4


def test_engine_from_export_with_a_restricted_draft_equals_torch_ar(restricted_export) -> None:
    target, draft, out = restricted_export
    ort_engine = Engine.from_export(out)
    assert isinstance(ort_engine.drafter, ModelDrafter)
    assert np.array_equal(ort_engine.drafter.head_token_ids, draft.head_token_ids.numpy())
    torch_engine = Engine.from_models(target, config=EngineConfig(max_batch=4, max_len=128, drafter=DrafterKind.NONE))
    g = torch.Generator().manual_seed(1)
    requests = [
        Request(torch.randint(0, 128, (n,), generator=g).tolist(), max_tokens=m)
        for n, m in ((1, 12), (40, 20), (7, 3), (60, 16))
    ]
    want = [o.token_ids for o in torch_engine.generate(requests, "ar").outputs]
    got = ort_engine.generate(requests, "ems")
    assert [o.token_ids for o in got.outputs] == want
    assert got.run.summary()["accepted_draft_tokens"] > 0
    assert any(t % 2 for ids in want for t in ids)  # some target tokens lie outside the head


def test_torch_backend_export_keeps_the_head_map(tmp_path) -> None:
    target = load_model(EXPORT_TARGET)
    save_model(restrict_head(target, range(0, 128, 2)), tmp_path / "draft-src")
    out = tmp_path / "deploy"
    assert (
        export_main(
            [
                "--target",
                EXPORT_TARGET,
                "--draft",
                str(tmp_path / "draft-src"),
                "--out",
                str(out),
                "--backend",
                "torch",
                "--max-batch",
                "2",
                "--max-len",
                "64",
            ]
        )
        == 0
    )
    engine = Engine.from_export(out)
    assert engine.drafter.head_token_ids.tolist() == list(range(0, 128, 2))
    requests = [Request([5, 6, 7, 5, 6], max_tokens=10)]
    assert engine.generate(requests, "ems").outputs[0].token_ids == engine.generate(requests, "ar").outputs[0].token_ids

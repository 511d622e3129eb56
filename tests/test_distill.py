"""``specdec distill`` on a tiny random target with a small trained tokenizer: data, training, resume, loading."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from specdec.distill import objective
from specdec.distill.data import greedy_parts, split_records
from specdec.distill.net import DraftNet, init_draft
from specdec.distill.prompts import builtin_prompts, load_prompts, pre_query_ids, self_prompts
from specdec.distill.records import Record, collect_data
from specdec.distill.settings import DistillSettings
from specdec.distill.train import distill
from specdec.models.drafts import is_draft_dir, load_draft
from specdec.models.errors import DraftLoadError
from specdec.models.loading import LoadedModel, load_model, save_model, tiny_random
from specdec.runtime.config import EngineConfig
from specdec.runtime.engine import Engine


def _tiny_target(path: Path, eos_boost: float | None = None) -> Path:
    """A tiny random target with a small byte-level BPE tokenizer with a chat template (``fakes.small_tokenizer``;
    no test here needs SmolLM2's own ids), saved at ``path``.

    ``eos_boost``: make it end a turn now and then, as a chat model does. Hidden dimension 0 is held
    constant (every embedding has 1.0 there and no layer writes to it), so after the final norm it acts as
    a bias, and EOS's head row reads only that dimension: a fixed EOS logit that, at 2.4, sits just under
    the typical top logit (measured: the prefix's top logits are 14-16 and the EOS logit is 5.6 per unit).
    """
    from fakes import small_tokenizer

    tokenizer = small_tokenizer()
    tiny = tiny_random(
        seed=11,
        vocab_size=len(tokenizer),
        num_layers=3,
        hidden_size=32,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=64,
        tie_word_embeddings=False,
    )
    tiny.config.eos_token_id = tokenizer.eos_token_id
    # a random model is nearly uniform over its vocabulary: give it a language of 400 tokens with sharp, context-
    # dependent preferences, so there is something to teach and a head of the frequent tokens covers it
    generator = torch.Generator().manual_seed(3)
    head = torch.zeros_like(tiny.state_dict["lm_head.weight"])
    common = torch.randperm(len(tokenizer), generator=generator)[:400]
    head[common] = torch.randn(400, head.shape[1], generator=generator)
    if eos_boost is not None:
        sd = tiny.state_dict
        sd["model.embed_tokens.weight"][:, 0] = 1.0
        for i in range(3):
            sd[f"model.layers.{i}.self_attn.o_proj.weight"][0] = 0.0
            sd[f"model.layers.{i}.mlp.down_proj.weight"][0] = 0.0
        head[tokenizer.eos_token_id] = 0.0
        head[tokenizer.eos_token_id, 0] = eos_boost
    tiny.state_dict["lm_head.weight"] = head
    save_model(LoadedModel(path.name, tiny.config, tiny.state_dict, tokenizer, "test"), path)
    return path


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _tiny_target(tmp_path_factory.mktemp("models") / "tiny-target")


@pytest.fixture(scope="module")
def tiny_chat_target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _tiny_target(tmp_path_factory.mktemp("models") / "tiny-chat-target", eos_boost=2.4)


def _settings(target: Path, out: Path, **kw: object) -> DistillSettings:
    base = dict(
        target=str(target),
        out=str(out),
        layers=1,
        head_size=600,
        samples=12,
        max_new_tokens=16,
        heldout=0.25,
        teacher_k=16,
        batch=4,
        lr=3e-3,
        steps=30,
        minutes=None,
        shard_size=4,
        checkpoint_s=0.0,
    )
    return DistillSettings(**{**base, **kw})


def test_distillation_lowers_held_out_kl_and_writes_a_loadable_draft(tiny_target: Path, tmp_path: Path) -> None:
    out = tmp_path / "draft"
    manifest = distill(_settings(tiny_target, out, validate_s=0.0), command="test")
    before, after = manifest["metrics"]["before"], manifest["metrics"]["after"]
    assert after["kl_on_head"] < 0.9 * before["kl_on_head"], (before, after)
    assert after["expected_acceptance"] > before["expected_acceptance"]
    assert manifest["steps"] == 30 and manifest["head_size"] == 600
    assert is_draft_dir(out)
    # the draft stores only its own weights: no copy of the target's embeddings
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        assert "model.embed_tokens.weight" not in names and f.get_tensor("lm_head.weight").shape[0] == 600
        assert all(f.get_tensor(n).dtype == torch.float16 for n in names)
    target = load_model(tiny_target)
    draft = load_draft(out, target)
    assert draft.head_token_ids is not None and len(draft.head_token_ids) == 600
    # a restricted-head draft keeps greedy speculation exact
    engine = Engine.from_models(target, draft, config=EngineConfig(max_batch=4, max_len=256, num_draft_tokens=3))
    reqs = [engine.request(p, chat=True, max_tokens=12) for p in ("Hi there", "Tell me about bees", "2+2?")]
    want = engine.generate(reqs, "ar").outputs
    got = engine.generate(reqs, "ems")
    assert [o.token_ids for o in got.outputs] == [o.token_ids for o in want]
    assert got.run.summary()["draft_tokens"] > 0
    # and the command line takes the distilled directory as --draft
    from specdec.cli import main

    assert (
        main(
            [
                "generate",
                "--target",
                str(tiny_target),
                "--draft",
                str(out),
                "--prompt",
                "Hi there",
                "--chat",
                "--max-tokens",
                "8",
                "--json",
            ]
        )
        == 0
    )


def test_a_draft_for_another_target_is_refused(tiny_target: Path, tmp_path: Path) -> None:
    out = tmp_path / "draft"
    distill(_settings(tiny_target, out, steps=1, samples=4), command="test")
    tokenizer = load_model(tiny_target).tokenizer
    other = tiny_random(
        seed=12,
        vocab_size=len(tokenizer),
        num_layers=3,
        hidden_size=32,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=64,
        tie_word_embeddings=True,
    )
    other = LoadedModel("other-target", other.config, other.state_dict, tokenizer, "test")
    with pytest.raises(DraftLoadError, match=r"distilled for target 'tiny-target'.*not for 'other-target'"):
        load_draft(out, other)
    (out / "head_token_ids.json").unlink()
    with pytest.raises(DraftLoadError, match="not a complete distilled draft"):
        load_draft(out, load_model(tiny_target))


def test_an_interrupted_run_resumes(tiny_target: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "draft"
    real_loss = objective.distill_loss
    calls = {"n": 0}

    def interrupted(*args: object, **kwargs: object) -> object:
        calls["n"] += 1
        if calls["n"] == 6:
            raise KeyboardInterrupt
        return real_loss(*args, **kwargs)

    monkeypatch.setattr(objective, "distill_loss", interrupted)
    with pytest.raises(KeyboardInterrupt):
        distill(_settings(tiny_target, out, steps=12), command="test")
    shards = sorted((out / ".work" / "data").glob("shard-*.pt"))
    assert len(shards) == 3  # 12 prompts in shards of 4: the data was complete before training
    stamps = [s.stat().st_mtime_ns for s in shards]
    saved = torch.load(out / ".work" / "checkpoint.pt", weights_only=False)
    assert saved["state"]["step"] == 5

    monkeypatch.setattr(objective, "distill_loss", real_loss)
    calls["resumed"] = 0

    def counting(*args: object, **kwargs: object) -> object:
        calls["resumed"] += 1
        return real_loss(*args, **kwargs)

    monkeypatch.setattr(objective, "distill_loss", counting)
    manifest = distill(_settings(tiny_target, out, steps=12), command="test")
    assert calls["resumed"] == 7  # steps 6..12 only
    assert manifest["steps"] == 12
    assert [s.stat().st_mtime_ns for s in shards] == stamps  # the data was not generated again
    assert json.loads((out / "specdec_draft.json").read_text())["steps"] == 12


def test_the_kept_weights_are_the_best_validated_step(tiny_target: Path, tmp_path: Path) -> None:
    """Validated after every step, the draft written is the step with the lowest validation loss: its loss,
    recomputed from the written (fp16) weights on the validation split, is the manifest's and not above the
    validation loss of the last step's weights."""
    out = tmp_path / "draft"
    # a rate high enough to overshoot: at 0.3 the validation loss bottoms out within the first steps (step 3 here)
    # and stays well above that minimum for the rest of the 20. At 3e-2 it wobbles but mostly keeps falling, so
    # whether the last step was the best depended on the sampled data (it was, once the sampler's RNG changed)
    settings = _settings(tiny_target, out, steps=20, lr=0.3, validate_s=0.0)
    manifest = distill(settings, command="test")
    assert 0 <= manifest["kept_step"] < 20  # deterministic (seeded, one thread): the last step is not the best
    target = load_model(tiny_target)
    records = [
        r
        for r in collect_data(
            target,
            out / ".work",
            load_prompts(settings),
            shard_size=4,
            max_new_tokens=16,
            temperature=1.0,
            teacher_k=16,
            seed=0,
        )
        if r.positions
    ]
    _, valid, _ = split_records(records, settings)
    kept = DraftNet(load_draft(out, target))
    assert objective.validation_loss(kept, valid, target.vocab_size) == pytest.approx(
        manifest["validation_loss"], rel=1e-3
    )
    last = DraftNet(load_draft(out, target))
    last.load_state_dict(torch.load(out / ".work" / "checkpoint.pt", weights_only=False)["net"])
    assert manifest["validation_loss"] <= objective.validation_loss(last, valid, target.vocab_size) + 1e-6


def test_grouped_generation_keeps_prompts_and_seeds_and_completes_short_shards(
    tiny_target: Path, tmp_path: Path
) -> None:
    """Shards generated together (continuous batching over a group) hold the same continuations, in the same
    prompt order, as shards generated one by one; a shard left short by a smaller earlier ``--samples`` is
    generated again when the prompt list grows, and the complete shards are not touched; a smaller
    ``--samples`` later takes exactly its prefix of the data."""
    target = load_model(tiny_target)
    prompts = builtin_prompts()[:10]
    kw = dict(shard_size=4, max_new_tokens=12, temperature=1.0, teacher_k=8, seed=5)
    alone = collect_data(target, tmp_path / "alone", prompts, group=1, **kw)
    grouped = collect_data(target, tmp_path / "grouped", prompts, group=3, max_batch=3, **kw)
    assert [len(torch.load(p, weights_only=False)) for p in sorted((tmp_path / "grouped" / "data").glob("*.pt"))] == [
        4,
        4,
        2,
    ]
    assert len({tuple(r.tokens[: r.positions[0]]) for r in alone}) == 10  # ten different prompts, in order:
    assert [r.tokens[: r.positions[0]] for r in grouped] == [r.tokens[: r.positions[0]] for r in alone]
    assert [r.tokens for r in grouped] == [r.tokens for r in alone]  # each continuation by its own seed
    shards = sorted((tmp_path / "grouped" / "data").glob("*.pt"))
    stamps = [s.stat().st_mtime_ns for s in shards[:2]]
    more = collect_data(target, tmp_path / "grouped", builtin_prompts()[:12], group=3, **kw)
    assert len(more) == 12 and len(torch.load(shards[2], weights_only=False)) == 4
    assert [s.stat().st_mtime_ns for s in shards[:2]] == stamps
    assert [r.tokens for r in more[:10]] == [r.tokens for r in grouped]  # the regenerated shard starts the same
    fewer = collect_data(target, tmp_path / "grouped", builtin_prompts()[:6], group=3, **kw)
    assert [r.tokens for r in fewer] == [r.tokens for r in more[:6]]  # a smaller --samples takes a prefix


def test_greedy_continuations_follow_their_prompts_split_and_are_evaluated_apart(
    tiny_target: Path, tmp_path: Path
) -> None:
    """Without ``--greedy-data`` only the held-out prompts are continued greedily, to be evaluated; with it every
    distinct prompt is, each greedy continuation lands in its prompt's split (no held-out prompt is trained on), and
    a checkpoint of the other kind of run is refused rather than resumed."""
    from specdec.runtime.text import encode_text

    settings = _settings(tiny_target, tmp_path / "plain", steps=2)
    manifest = distill(settings, command="test")
    greedy = manifest["metrics"]["heldout_greedy"]
    assert greedy["after"]["positions"] > 0 and greedy["before"]["positions"] == greedy["after"]["positions"]
    assert manifest["data"]["greedy_train_sequences"] == 0
    target = load_model(tiny_target)
    prompts = load_prompts(settings)
    records = [
        r
        for r in collect_data(
            target,
            tmp_path / "plain" / ".work",
            prompts,
            shard_size=4,
            max_new_tokens=16,
            temperature=1.0,
            teacher_k=16,
            seed=0,
        )
        if r.positions
    ]
    parts = split_records(records, settings)
    prompt_of = {tuple(encode_text(target.tokenizer, p, chat=True)): p for p in prompts}
    held_prompts = {prompt_of[tuple(r.tokens[: r.positions[0]])] for r in parts[0]}
    plain = collect_data(
        target,
        tmp_path / "plain" / ".work",
        sorted(held_prompts, key=prompts.index),
        shard_size=4,
        max_new_tokens=16,
        temperature=0.0,
        teacher_k=16,
        seed=0,
        subdir="heldout-greedy",
    )
    assert len(plain) == len(held_prompts) == manifest["data"]["heldout_greedy_sequences"]
    # a greedy continuation is the target's argmax at every step
    assert all(r.top_ids[:, 0].tolist() == r.tokens[r.positions[0] :] for r in plain)

    with_greedy = _settings(tiny_target, tmp_path / "greedy", steps=2, greedy_data=True)
    manifest = distill(with_greedy, command="test")
    assert manifest["data"]["greedy_train_sequences"] > 0
    # the same held-out prompts, so the same greedy continuations are evaluated
    assert manifest["metrics"]["heldout_greedy"]["after"]["positions"] == greedy["after"]["positions"]
    everything = greedy_parts(target, tmp_path / "greedy" / ".work", prompts, parts[:2], with_greedy)
    assert sum(map(len, everything)) == len(set(prompts))
    for part, greedy_part in zip(parts, everything):
        keys = {tuple(r.tokens[: r.positions[0]]) for r in part}
        assert {tuple(r.tokens[: r.positions[0]]) for r in greedy_part} <= keys
    with pytest.raises(DraftLoadError, match="--greedy-data"):
        distill(_settings(tiny_target, tmp_path / "greedy", steps=3, greedy_data=False), command="test")


def test_cached_data_of_other_settings_or_prompts_is_not_reused(tiny_target: Path, tmp_path: Path) -> None:
    """A cache generated at another temperature is refused with the difference named; a shard continuing other
    prompts (another ``--prompts`` file) is generated again instead of being trained on."""
    target = load_model(tiny_target)
    kw = dict(shard_size=2, max_new_tokens=6, teacher_k=4, seed=1)
    prompts = builtin_prompts()[:4]
    first = collect_data(target, tmp_path, prompts, temperature=1.0, **kw)
    with pytest.raises(DraftLoadError, match=r"temperature: 1\.0 there, 0\.5 now"):
        collect_data(target, tmp_path, prompts, temperature=0.5, **kw)
    other = [prompts[0], prompts[1], "Something else entirely", prompts[3]]
    again = collect_data(target, tmp_path, other, temperature=1.0, **kw)
    assert [r.tokens for r in again[:2]] == [r.tokens for r in first[:2]]  # the first shard is reused
    from specdec.runtime.text import encode_text

    ids = encode_text(target.tokenizer, "Something else entirely", chat=True)
    assert again[2].tokens[: len(ids)] == ids


def test_records_are_split_by_prompt_and_the_schedule_warms_up_then_decays() -> None:
    """A prompt sampled twice lands wholly in one split; the learning-rate factor rises over the warm-up and
    ends the budget at 10%."""

    def record(prompt: int, n: int) -> Record:
        return Record([prompt, prompt, 7, 8, 9][: 2 + n], list(range(2, 2 + n)), torch.zeros(n, 1), torch.zeros(n, 1))

    records = [record(p, 1 + (i % 3)) for i, p in enumerate(list(range(20)) * 3)]  # 20 prompts, 3 samples each
    held, valid, train = split_records(records, DistillSettings(heldout=0.1, valid=0.1, seed=4))
    prompts = [{r.tokens[0] for r in part} for part in (held, valid, train)]
    assert not (prompts[0] & prompts[1] or prompts[0] & prompts[2] or prompts[1] & prompts[2])
    assert len(held) + len(valid) + len(train) == 60 and len(held) >= 6 and len(valid) >= 6
    with pytest.raises(ValueError, match="too few"):
        split_records(records[:2], DistillSettings())
    factor = objective.lr_factor
    assert factor(0, 0.0, 10) == pytest.approx(0.1) and factor(9, 0.0, 10) == pytest.approx(1.0)
    assert factor(500, 0.5, 10) == pytest.approx(0.55) and factor(900, 1.0, 10) == pytest.approx(0.1)


def test_the_target_writes_its_own_requests_each_ended_by_it_distinct_and_resumable(
    tiny_chat_target: Path, tmp_path: Path
) -> None:
    """Self-written prompts continue the chat template where a user's message starts; only turns the target
    ended itself (EOS) with enough words are kept, without repeats; a larger count later extends the same list
    (candidates are seeded by index, so an interrupted run draws what an uninterrupted one would); other
    settings, and a tokenizer without a chat template, are refused."""
    import copy

    from specdec.runtime.text import encode_text

    target = load_model(tiny_chat_target)
    prefix = pre_query_ids(target.tokenizer)
    for prompt in ("Hi there", "Tell me about bees"):
        ids = encode_text(target.tokenizer, prompt, chat=True)
        assert ids[: len(prefix)] == prefix and len(ids) > len(prefix)
    kw = dict(seed=0, max_tokens=24, block=16)
    first = self_prompts(target, tmp_path / "a", 4, **kw)
    assert len(first) == len(set(first)) == 4 and all(len(p.split()) >= 3 for p in first)
    more = self_prompts(target, tmp_path / "a", 8, **kw)
    assert more[:4] == first and len(set(more)) == 8
    assert self_prompts(target, tmp_path / "b", 8, **kw) == more  # in one go: the same list
    with pytest.raises(DraftLoadError, match="other settings"):
        self_prompts(target, tmp_path / "a", 8, seed=1, max_tokens=24, block=16)
    # a one-token turn is either EOS alone (no words) or cut off: neither is a request
    with pytest.raises(ValueError, match="wrote only 0 usable requests"):
        self_prompts(target, tmp_path / "c", 1, seed=0, max_tokens=1, block=16, min_words=1)
    with pytest.raises(ValueError, match="--self-prompts must be >= 0"):
        self_prompts(target, tmp_path / "d", -1, seed=0)
    plain = copy.deepcopy(target.tokenizer)
    plain.chat_template = None
    with pytest.raises(ValueError, match="chat template"):
        pre_query_ids(plain)


def test_self_prompts_get_their_own_split_and_a_grown_run_continues_its_checkpoint(
    tiny_chat_target: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Adding self-written prompts to a finished run: the built-in prompts keep their split (the same held-out
    records, so the draft was never trained on them), the new prompts are split on their own and reported apart,
    the run continues from its checkpoint with its head, the best-step choice starts over on the new validation
    set, and the manifest lists both commands."""
    out = tmp_path / "draft"
    first = distill(_settings(tiny_chat_target, out, steps=4, greedy_data=True), command="first")
    head = (out / "head_token_ids.json").read_text()
    real_loss, calls = objective.distill_loss, {"n": 0}

    def counting(*args: object, **kwargs: object) -> object:
        calls["n"] += 1
        return real_loss(*args, **kwargs)

    monkeypatch.setattr(objective, "distill_loss", counting)
    grown = distill(_settings(tiny_chat_target, out, steps=8, greedy_data=True, self_prompts=8), command="grown")
    assert calls["n"] == 4 and grown["steps"] == 8 and grown["kept_step"] == 8
    assert grown["commands"] == ["first", "grown"] and grown["command"] == "grown"
    assert (out / "head_token_ids.json").read_text() == head
    assert grown["data"]["self_prompts"] == 8 and grown["data"]["self_prompt_heldout_sequences"] >= 1
    for name in ("before", "heldout_greedy"):  # the same built-in held-out records, and the same initialisation
        old = first["metrics"][name] if name == "before" else first["metrics"][name]["before"]
        new = grown["metrics"][name] if name == "before" else grown["metrics"][name]["before"]
        assert new == pytest.approx(old)
    assert grown["metrics"]["after"]["positions"] == first["metrics"]["after"]["positions"]
    for name in ("self_prompts", "self_prompts_greedy"):
        assert grown["metrics"][name]["after"]["positions"] > 0
    # a checkpoint written before commands were recorded takes the command from the manifest it left
    ckpt = out / ".work" / "checkpoint.pt"
    saved = torch.load(ckpt, weights_only=False)
    del saved["state"]["commands"]
    torch.save(saved, ckpt)
    again = distill(_settings(tiny_chat_target, out, steps=9, greedy_data=True, self_prompts=8), command="third")
    assert again["commands"] == ["grown", "third"] and calls["n"] == 5


def test_a_grown_draft_starts_as_its_source_and_a_shared_head_is_not_stored(tiny_target: Path, tmp_path: Path) -> None:
    """``--init-from``: new layers start as exact no-ops, so the grown draft's logits are its source's; with
    ``--share-head`` the head is the target's own rows, frozen and not written; the finished run's checkpoint is
    kept aside, not overwritten or refused; the lineage of commands is kept; and speculation stays exact."""
    out = tmp_path / "draft"
    distill(_settings(tiny_target, out, steps=6), command="first")
    target = load_model(tiny_target)
    source = load_draft(out, target)
    ids = torch.as_tensor([[5, 17, 99, 300, 7, 42, 1000, 12]])
    mask = torch.ones_like(ids)
    grown = init_draft(target, 3, source.head_token_ids, grow=source)
    with torch.no_grad():
        want = DraftNet(source)(ids, mask)
        assert torch.equal(DraftNet(grown)(ids, mask), want)
    assert grown.extra["init_layers"] == [0, 1, "draft 0"]  # new layers from the target, the source's last last
    shared = DraftNet(init_draft(target, 3, source.head_token_ids, share_head=True, grow=source))
    rows = target.state_dict["lm_head.weight"][source.head_token_ids]
    assert not shared.head.requires_grad and torch.equal(shared.head.detach(), rows)
    with pytest.raises(ValueError, match="as many or more"):
        init_draft(target, 1, source.head_token_ids, grow=grown)
    fewer = init_draft(target, 2, source.head_token_ids[::2], grow=source)  # a head of half its rows
    with torch.no_grad():
        assert torch.equal(DraftNet(fewer)(ids, mask), want[..., ::2])

    elsewhere = tmp_path / "elsewhere"  # an --init-from that is no draft fails before any data is generated
    with pytest.raises(DraftLoadError, match="not a complete distilled draft"):
        distill(_settings(tiny_target, elsewhere, layers=2, init_from=str(tmp_path / "missing")), command="typo")
    assert not (elsewhere / ".work" / "data").exists()
    with pytest.raises(DraftLoadError, match="--init-from"):  # another architecture without --init-from
        distill(_settings(tiny_target, out, layers=2, steps=4), command="refused")
    smaller = distill(
        _settings(tiny_target, out, layers=2, head_size=400, init_from=str(out), steps=4), command="smaller head"
    )
    assert (out / ".work" / "checkpoint-1-layers-step-6.pt").is_file()
    assert smaller["head_size"] == 400 and not smaller["shared_head"] and smaller["grown_from"]["steps"] == 6
    assert set(load_draft(out, target).head_token_ids.tolist()) < set(source.head_token_ids.tolist())
    settings = _settings(tiny_target, out, layers=3, share_head=True, init_from=str(out), steps=4, validate_s=0.0)
    manifest = distill(settings, command="grow")
    assert (out / ".work" / "checkpoint-2-layers-step-4.pt").is_file()
    assert manifest["commands"] == ["first", "smaller head", "grow"] and manifest["shared_head"]
    assert manifest["layers"] == 3 and manifest["steps"] == 4 and manifest["head_size"] == 400
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in set(f.keys()) and "model.layers.2.mlp.down_proj.weight" in set(f.keys())
    draft = load_draft(out, target)
    assert torch.equal(draft.state_dict["lm_head.weight"], target.state_dict["lm_head.weight"][draft.head_token_ids])
    engine = Engine.from_models(target, draft, config=EngineConfig(max_batch=4, max_len=256, num_draft_tokens=3))
    reqs = [engine.request(p, chat=True, max_tokens=12) for p in ("Hi there", "Tell me about bees")]
    got = engine.generate(reqs, "ems")
    assert [o.token_ids for o in got.outputs] == [o.token_ids for o in engine.generate(reqs, "ar").outputs]
    assert got.run.summary()["draft_tokens"] > 0
    # the grown run's own checkpoint now resumes (no second renaming), and --init-from is not read again
    again = distill(
        _settings(tiny_target, out, layers=3, share_head=True, init_from=str(tmp_path / "gone"), steps=5),
        command="grow",
    )
    assert again["steps"] == 5 and again["commands"] == ["first", "smaller head", "grow"]
    assert len(list((out / ".work").glob("checkpoint-*.pt"))) == 2


def test_a_fresh_draft_with_a_shared_head_trains_its_layers_only(tiny_target: Path, tmp_path: Path) -> None:
    """``--share-head`` from scratch: the layers learn (held-out KL falls) while the head stays the target's rows,
    which are neither written nor changed, and the loaded draft drafts exactly."""
    out = tmp_path / "draft"
    manifest = distill(_settings(tiny_target, out, share_head=True, validate_s=0.0), command="shared")
    before, after = manifest["metrics"]["before"], manifest["metrics"]["after"]
    assert manifest["shared_head"] and after["kl_on_head"] < 0.9 * before["kl_on_head"], (before, after)
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in set(f.keys())
    target = load_model(tiny_target)
    draft = load_draft(out, target)
    assert torch.equal(draft.state_dict["lm_head.weight"], target.state_dict["lm_head.weight"][draft.head_token_ids])
    engine = Engine.from_models(target, draft, config=EngineConfig(max_batch=2, max_len=256, num_draft_tokens=3))
    reqs = [engine.request(p, chat=True, max_tokens=12) for p in ("Hi there", "2+2?")]
    assert [o.token_ids for o in engine.generate(reqs, "ems").outputs] == [
        o.token_ids for o in engine.generate(reqs, "ar").outputs
    ]


@pytest.mark.real_model
def test_the_shipped_smollm2_draft_is_small_sound_and_made_for_its_target(smollm2: LoadedModel) -> None:
    """The package's draft: at most 25 MB of fp16 weights of its own (no copy of the target's embeddings), a
    restricted head that always contains EOS, a manifest recording the command and the held-out metrics, made for
    this very target (checksum), and greedy-identical to ar when it drafts."""
    from safetensors import safe_open

    from specdec.models.drafts import SHIPPED_DRAFTS, load_pair

    root = SHIPPED_DRAFTS["smollm2-135m-draft"]
    assert (root / "model.safetensors").stat().st_size <= 25_000_000
    with safe_open(str(root / "model.safetensors"), "pt") as f:
        assert "model.embed_tokens.weight" not in set(f.keys())
        assert all(f.get_tensor(n).dtype == torch.float16 for n in f.keys())
    manifest = json.loads((root / "specdec_draft.json").read_text())
    assert manifest["command"].startswith("specdec distill --target smollm2-135m")
    assert manifest["commands"][-1] == manifest["command"]  # every command that trained it, in order
    assert all(c.startswith("specdec distill --target smollm2-135m") for c in manifest["commands"])
    assert manifest["target"]["checksum"] == smollm2.checksum()
    metrics = manifest["metrics"]
    for after in (
        metrics["after"],
        *(metrics[k]["after"] for k in ("heldout_greedy", "self_prompts", "self_prompts_greedy")),
    ):
        assert after["positions"] > 0 and 0 < after["greedy_agreement"] <= 1
        assert 0 < after["expected_acceptance"] <= 1
    target, draft = load_pair("smollm2-135m", "smollm2-135m-draft")
    assert draft.head_token_ids is not None and set(target.eos_token_ids) <= set(draft.head_token_ids.tolist())
    engine = Engine.from_models(target, draft, config=EngineConfig(max_batch=2, max_len=256, num_draft_tokens=3))
    requests = [engine.request(p, chat=True, max_tokens=16) for p in ("Write a haiku about tea.", "What is DNA?")]
    got = engine.generate(requests, "ems")
    assert [o.token_ids for o in got.outputs] == [o.token_ids for o in engine.generate(requests, "ar").outputs]
    assert got.run.summary()["accepted_draft_tokens"] > 0

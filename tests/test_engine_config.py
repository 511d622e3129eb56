"""The engine's settings (``specdec.runtime.config``): one default each, resolved from an export's manifest or a
model's positions, validated with the field named, and shared whole by an engine's sibling; an engine refuses to
change what shaped its caches and backends.

An engine here runs over ``fakes.ScriptedBackend``: what is tested is the settings, not a model.
"""

from __future__ import annotations

import dataclasses

import pytest
from fakes import ScriptedBackend, counting

from specdec.runtime.config import (
    DEFAULT_MAX_BATCH,
    DEFAULT_MAX_LEN,
    DEFAULT_NUM_DRAFT_TOKENS,
    NAMES,
    DrafterKind,
    EngineConfig,
)
from specdec.runtime.draft_length import DraftLength
from specdec.runtime.draft_planner import AdaptiveDraftLength, FixedDraftLength
from specdec.runtime.drafters import NgramDrafter
from specdec.runtime.engine import Engine
from specdec.runtime.request import Request

# -- defaults and resolution ------------------------------------------------------------------------------------


def test_every_setting_has_one_default_and_sizes_wait_to_be_resolved() -> None:
    config = EngineConfig()
    assert (config.max_batch, config.max_len) == (None, None)  # "as the model or export says"
    assert config.num_draft_tokens == DEFAULT_NUM_DRAFT_TOKENS == 4
    assert config.drafter is None and config.draft_length is None and config.prefill_budget is None
    assert config.kv_cache_dtype is None and config.threads is None and config.torch_threads is None
    assert config.device_id == 0
    with pytest.raises(RuntimeError, match="max_batch is unresolved"):
        _ = config.max_batch_set
    with pytest.raises(RuntimeError, match="max_len is unresolved"):
        _ = config.max_len_set
    resolved = config.resolved()
    assert (resolved.max_batch_set, resolved.max_len_set) == (DEFAULT_MAX_BATCH, DEFAULT_MAX_LEN) == (16, 2048)


def test_resolution_takes_the_config_then_the_artifact_then_the_default() -> None:
    assert EngineConfig(max_batch=3).resolved(max_batch=8, max_len=64) == EngineConfig(max_batch=3, max_len=64)
    assert EngineConfig().resolved(max_batch=8) == EngineConfig(max_batch=8, max_len=DEFAULT_MAX_LEN)
    assert EngineConfig(max_len=100).resolved(max_len=64).max_len == 100
    untouched = EngineConfig(num_draft_tokens=2, prefill_budget=32, threads=1)
    assert dataclasses.replace(untouched.resolved(), max_batch=None, max_len=None) == untouched


def test_a_manifest_fills_what_the_config_leaves_unset() -> None:
    manifest = {"max_batch": 8, "max_len": 512, "kv_cache_dtype": "float16"}
    config = EngineConfig().from_manifest(manifest)
    assert (config.max_batch, config.max_len, config.kv_cache_dtype) == (8, 512, "float16")
    own = EngineConfig(max_batch=2, max_len=128, kv_cache_dtype="float32").from_manifest(manifest)
    assert (own.max_batch, own.max_len, own.kv_cache_dtype) == (2, 128, "float32")
    # a manifest written by hand or by an older export: numbers as text, sizes missing or empty
    assert EngineConfig().from_manifest({"max_batch": "4", "max_len": "256"}).max_batch == 4
    bare = EngineConfig().from_manifest({"max_batch": "", "max_len": 0})
    assert (bare.max_batch, bare.max_len, bare.kv_cache_dtype) == (DEFAULT_MAX_BATCH, DEFAULT_MAX_LEN, None)


@pytest.mark.parametrize(
    "positions,config,want",
    [
        (512, EngineConfig(), 512),  # a short-context model: its positions
        (131072, EngineConfig(), DEFAULT_MAX_LEN),  # a long-context one: capped by the default
        (None, EngineConfig(), DEFAULT_MAX_LEN),  # a config without the field
        (512, EngineConfig(max_len=4096), 4096),  # the caller's own choice wins
    ],
)
def test_a_models_positions_give_the_context_unless_the_config_says(
    positions: int | None, config: EngineConfig, want: int
) -> None:
    resolved = config.for_model(positions)
    assert resolved.max_len == want and resolved.max_batch == DEFAULT_MAX_BATCH


# -- validation ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"max_batch": 0}, "max_batch"),
        ({"max_batch": -2}, "max_batch"),
        ({"max_batch": 1.5}, "max_batch"),
        ({"max_batch": "8"}, "max_batch"),
        ({"max_len": 0}, "max_len"),
        ({"max_len": 1}, "max_len must be >= 2"),
        ({"prefill_budget": 0}, "prefill_budget"),
        ({"threads": 0}, "threads"),
        ({"torch_threads": -1}, "torch_threads"),
        ({"num_draft_tokens": -1}, "num_draft_tokens"),
        ({"num_draft_tokens": 2.0}, "num_draft_tokens"),
        ({"device_id": -1}, "device_id"),
        ({"drafter": "bigram"}, "unknown drafter 'bigram'"),
    ],
)
def test_a_bad_setting_is_refused_naming_its_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        EngineConfig(**kwargs)


def test_zero_drafts_and_the_smallest_sizes_are_settings_not_errors() -> None:
    config = EngineConfig(max_batch=1, max_len=2, num_draft_tokens=0, prefill_budget=1, threads=1, torch_threads=1)
    assert (config.max_batch, config.max_len, config.num_draft_tokens) == (1, 2, 0)


def test_a_config_is_frozen() -> None:
    config = EngineConfig(max_batch=4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.max_batch = 8
    assert dataclasses.replace(config, max_batch=8).max_batch == 8 and config.max_batch == 4


# -- drafter kinds ------------------------------------------------------------------------------------------------


def test_drafter_kinds_parse_from_text_and_pass_through() -> None:
    assert NAMES == ("model", "ngram", "hybrid", "none")
    assert [DrafterKind.parse(name) for name in NAMES] == list(DrafterKind)
    assert DrafterKind.parse("  Hybrid ") is DrafterKind.HYBRID  # as a CLI flag or a config parameter writes it
    assert DrafterKind.parse(DrafterKind.NGRAM) is DrafterKind.NGRAM
    assert DrafterKind.parse(None) is None  # "as the artifact offers"
    assert EngineConfig(drafter="ngram").drafter is DrafterKind.NGRAM  # a config holds the kind, never text
    assert [kind for kind in DrafterKind if kind.needs_model] == [DrafterKind.MODEL, DrafterKind.HYBRID]


@pytest.mark.parametrize("value", ["", "n-gram", "lookup", "models"])
def test_an_unknown_drafter_names_every_choice(value: str) -> None:
    with pytest.raises(ValueError) as info:
        DrafterKind.parse(value)
    assert repr(value) in str(info.value) and "choose one of model, ngram, hybrid, none" in str(info.value)


# -- an engine keeps it, its sibling shares it --------------------------------------------------------------------


def _engine(config: EngineConfig | None = None) -> Engine:
    return Engine(ScriptedBackend(counting(64), 64), NgramDrafter(), config=config)


def test_an_engine_resolves_its_config_and_sizes_its_caches_by_it() -> None:
    engine = _engine()
    assert engine.config == EngineConfig().resolved()
    assert (engine.max_batch, engine.max_len) == (DEFAULT_MAX_BATCH, DEFAULT_MAX_LEN)
    small = _engine(EngineConfig(max_batch=2, max_len=32))
    assert (small.storage.num_slots, small.storage.max_len) == (2, 32)
    assert isinstance(small.planner, FixedDraftLength)
    assert isinstance(_engine(EngineConfig(draft_length=DraftLength())).planner, AdaptiveDraftLength)


def test_a_sibling_shares_the_settings_and_owns_its_caches_and_learning() -> None:
    config = EngineConfig(max_batch=2, max_len=32, num_draft_tokens=3, draft_length=DraftLength(), prefill_budget=8)
    engine = _engine(config)
    sibling = engine.sibling()
    assert sibling.config == engine.config == config
    assert sibling.target is engine.target  # the same weights
    assert sibling.storage is not engine.storage and sibling.drafter is not engine.drafter
    assert isinstance(sibling.planner, AdaptiveDraftLength) and sibling.planner is not engine.planner
    answer = sibling.generate([Request([5, 6, 7, 5, 6], max_tokens=6)], "ems").outputs[0]
    assert answer.token_ids == [7, 8, 9, 10, 11, 12]  # the scripted target counts on
    planner = engine.planner
    assert isinstance(planner, AdaptiveDraftLength) and planner.pooled == {}  # its sibling's run taught it nothing


@pytest.mark.parametrize(
    "change",
    [
        {"max_batch": 4},
        {"max_len": 64},
        {"kv_cache_dtype": "float16"},
        {"threads": 2},
        {"torch_threads": 2},
        {"device_id": 1},
        {"drafter": DrafterKind.NGRAM},
    ],
)
def test_reconfigure_refuses_what_shaped_the_caches_or_backends(change: dict) -> None:
    engine = _engine(EngineConfig(max_batch=2, max_len=32))
    before = engine.config
    with pytest.raises(ValueError, match=f"{next(iter(change))} shape the engine's caches or backends"):
        engine.reconfigure(**change, num_draft_tokens=1)
    assert engine.config is before  # nothing of a refused change is applied


def test_reconfigure_changes_the_rest_from_the_next_run_on() -> None:
    engine = _engine(EngineConfig(max_batch=2, max_len=32))
    engine.reconfigure(num_draft_tokens=2, prefill_budget=4)
    assert (engine.config.num_draft_tokens, engine.config.prefill_budget) == (2, 4)
    assert (engine.max_batch, engine.max_len) == (2, 32)
    engine.reconfigure(draft_length=DraftLength(verify_cost=0.3))
    planner = engine.planner
    assert isinstance(planner, AdaptiveDraftLength) and planner.policy.verify_cost == 0.3
    engine.reconfigure(draft_length=None)
    assert isinstance(engine.planner, FixedDraftLength)
    with pytest.raises(ValueError, match="num_draft_tokens"):  # validated like a new config
        engine.reconfigure(num_draft_tokens=-1)
    assert engine.config.num_draft_tokens == 2

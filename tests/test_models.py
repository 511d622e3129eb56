"""Model resolution: presets, local directories, tiny-random specs, save/load round trips."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from specdec.models.errors import ModelResolutionError
from specdec.models.loading import LoadedModel, load_model, save_model, tiny_random
from specdec.models.presets import PRESETS
from specdec.runtime.backends.torch_backend import TorchBackend
from specdec.runtime.packed import SeqWork, pack


@pytest.fixture(autouse=True)
def _private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing these tests do may write into the user's model cache."""
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "specdec-cache"))


def test_unknown_name_lists_presets() -> None:
    with pytest.raises(ModelResolutionError) as err:
        load_model("no-such-model")
    msg = str(err.value)
    assert "no-such-model" in msg
    for name in PRESETS:
        assert name in msg
    assert "tiny-random" in msg


def test_missing_hub_preset_fails_fast_and_says_what_to_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # online it would be downloaded (tests/test_hub_download.py)
    start = time.perf_counter()
    with pytest.raises(ModelResolutionError) as err:
        load_model("llama-7b")
    assert time.perf_counter() - start < 5.0
    msg = str(err.value)
    assert "meta-llama/Llama-2-7b-hf" in msg
    assert "offline mode is on" in msg and "hf download meta-llama/Llama-2-7b-hf" in msg
    assert "--target /path/to/Llama-2-7b-hf" in msg  # what to pass instead


def test_nonexistent_path(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere" / "model"
    with pytest.raises(ModelResolutionError, match="nowhere"):
        load_model(missing)
    with pytest.raises(ModelResolutionError):
        load_model("./definitely/not/here")


def test_file_that_is_not_a_model(tmp_path: Path) -> None:
    path = tmp_path / "weights.bin"
    path.write_bytes(b"\x00" * 64)
    with pytest.raises(ModelResolutionError, match=r"neither a \.gguf file nor a Hugging Face model directory"):
        load_model(path)


def test_corrupt_gguf_file(tmp_path: Path) -> None:
    path = tmp_path / "broken.gguf"
    path.write_bytes(b"GGUF" + b"\x07" * 256)
    with pytest.raises(ModelResolutionError, match="cannot read GGUF file"):
        load_model(path)


def test_directory_without_config(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ModelResolutionError, match=r"no config\.json"):
        load_model(tmp_path)


def test_unreadable_config(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{ this is not json")
    with pytest.raises(ModelResolutionError, match="cannot read"):
        load_model(tmp_path)


def test_corrupt_weights(tmp_path: Path) -> None:
    out = save_model(tiny_random(seed=1, vocab_size=16, num_layers=1), tmp_path / "m")
    (out / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ModelResolutionError, match="cannot read the weights"):
        load_model(out)


def test_non_llama_architecture_is_refused(tmp_path: Path) -> None:
    from transformers import GPT2Config

    GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50).save_pretrained(tmp_path)
    with pytest.raises(ModelResolutionError, match="'gpt2' is not a LLaMA-family architecture"):
        load_model(tmp_path)


def test_sliding_window_is_refused(tmp_path: Path) -> None:
    from transformers import MistralConfig

    MistralConfig(
        num_hidden_layers=1,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=50,
        sliding_window=16,
    ).save_pretrained(tmp_path)
    with pytest.raises(ModelResolutionError, match="sliding-window"):
        load_model(tmp_path)


# -- tiny-random specs -------------------------------------------------------------------


def test_tiny_random_spec_parses() -> None:
    model = load_model("tiny-random:vocab_size=16,num_layers=1")
    assert model.config.vocab_size == 16
    assert model.config.num_hidden_layers == 1
    assert model.vocab_size == 16
    assert model.name == "tiny-random:vocab_size=16,num_layers=1"
    assert model.state_dict["model.embed_tokens.weight"].shape[0] == 16
    assert not any(k.startswith("model.layers.1.") for k in model.state_dict)
    assert model.tokenizer is None


def test_tiny_random_plain_and_init_std() -> None:
    plain = load_model("tiny-random")
    assert plain.config.vocab_size == 128
    wide = load_model("tiny-random:init_std=0.5,seed=3")
    assert wide.config.initializer_range == 0.5


def test_tiny_random_is_seeded() -> None:
    a = load_model("tiny-random:seed=4,vocab_size=32")
    b = load_model("tiny-random:seed=4,vocab_size=32")
    c = load_model("tiny-random:seed=5,vocab_size=32")
    assert a.state_dict.keys() == b.state_dict.keys()
    assert all(torch.equal(a.state_dict[k], b.state_dict[k]) for k in a.state_dict)
    assert not torch.equal(a.state_dict["model.embed_tokens.weight"], c.state_dict["model.embed_tokens.weight"])


@pytest.mark.parametrize("spec", ["tiny-random:vocab_size=abc", "tiny-random:bogus=3", "tiny-random:seed"])
def test_tiny_random_bad_options(spec: str) -> None:
    with pytest.raises(ModelResolutionError, match="tiny-random"):
        load_model(spec)


# -- save / load ----------------------------------------------------------------------


@pytest.mark.parametrize("tied", [False, True])
def test_save_then_load_round_trips_exactly(tmp_path: Path, tied: bool) -> None:
    model = tiny_random(seed=11, vocab_size=48, num_layers=2, tie_word_embeddings=tied, init_std=0.1)
    out = save_model(model, tmp_path / "saved")
    assert (out / "config.json").is_file()
    loaded = load_model(out)
    assert loaded.name == "saved"
    assert sorted(loaded.state_dict) == sorted(model.state_dict)
    assert ("lm_head.weight" in loaded.state_dict) is not tied
    for name, tensor in model.state_dict.items():
        assert loaded.state_dict[name].dtype == tensor.dtype
        assert torch.equal(loaded.state_dict[name], tensor), name
    for key in (
        "vocab_size",
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "tie_word_embeddings",
        "rms_norm_eps",
    ):
        assert getattr(loaded.config, key) == getattr(model.config, key), key
    ids = [1, 5, 9, 30, 47]
    a, b = TorchBackend(model), TorchBackend(loaded)
    assert np.array_equal(
        a.step(pack([SeqWork(0, 0, ids)]), a.allocate_cache(1, 8)),
        b.step(pack([SeqWork(0, 0, ids)]), b.allocate_cache(1, 8)),
    )


def test_save_overwrites_and_leaves_no_temporaries(tmp_path: Path) -> None:
    first = tiny_random(seed=1, vocab_size=16, num_layers=1)
    second = tiny_random(seed=2, vocab_size=16, num_layers=1)
    save_model(first, tmp_path / "m")
    save_model(second, tmp_path / "m")
    loaded = load_model(tmp_path / "m")
    assert torch.equal(loaded.state_dict["model.embed_tokens.weight"], second.state_dict["model.embed_tokens.weight"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]
    marker = json.loads((tmp_path / "m" / "specdec_complete.json").read_text())
    assert marker["name"] == second.name


def test_save_and_load_keep_rope_scaling(tmp_path: Path) -> None:
    rope = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,
    }
    model = tiny_random(seed=3, vocab_size=32, num_layers=1, rope_scaling=rope, init_std=0.1)
    loaded = load_model(save_model(model, tmp_path / "rope"))
    ids = list(range(32)) * 2
    a, b = TorchBackend(model), TorchBackend(loaded)
    assert torch.equal(a.inv_freq, b.inv_freq)
    assert np.array_equal(
        a.step(pack([SeqWork(0, 0, ids)]), a.allocate_cache(1, 64)),
        b.step(pack([SeqWork(0, 0, ids)]), b.allocate_cache(1, 64)),
    )


def test_checksum_ignores_a_listed_tied_head() -> None:
    """A fresh GGUF conversion lists the tied head, the cached one does not: the same model, one checksum."""
    model = tiny_random(seed=3, vocab_size=32, num_layers=1, tie_word_embeddings=True)
    listed = dict(model.state_dict, **{"lm_head.weight": model.state_dict["model.embed_tokens.weight"].clone()})
    with_head = LoadedModel(model.name, model.config, listed, None, "test")
    without = LoadedModel(
        model.name, model.config, {k: v for k, v in listed.items() if k != "lm_head.weight"}, None, "test"
    )
    assert with_head.checksum() == without.checksum()
    other = tiny_random(seed=4, vocab_size=32, num_layers=1, tie_word_embeddings=True)
    assert other.checksum() != without.checksum()

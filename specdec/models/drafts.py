"""Draft models as artifacts: the shipped drafts, distilled draft directories, and the pair check.

A distilled draft directory (``specdec distill --out``) holds the draft's own weights (fp16),
its config, its restricted head map and a manifest naming the target it was distilled for; the
target's embeddings (and, with ``--share-head``, its head rows) are not stored and are taken
from the target at load time, so a draft only loads beside the target it was made for.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from specdec.models.errors import DraftLoadError, DraftMismatchError
from specdec.models.loading import LoadedModel, load_model, restrict_head

DRAFT_MANIFEST = "specdec_draft.json"
HEAD_FILE = "head_token_ids.json"
WEIGHTS = "model.safetensors"
FORMAT = 1


def save_draft(draft: LoadedModel, out: Path, manifest: dict[str, Any]) -> None:
    """The draft's own weights in fp16 (not the target's embeddings, nor a shared head), config, head map, manifest."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    target_owned = {"model.embed_tokens.weight"} | ({"lm_head.weight"} if manifest.get("shared_head") else set())
    own = {k: v.detach().to(torch.float16).contiguous() for k, v in draft.state_dict.items() if k not in target_owned}
    save_file(own, str(out / WEIGHTS))
    draft.config.to_json_file(str(out / "config.json"))
    if draft.head_token_ids is None:
        raise ValueError(f"{draft.name}: a distilled draft stores its restricted head's token ids, and it has none")
    (out / HEAD_FILE).write_text(json.dumps(draft.head_token_ids.tolist()))
    (out / DRAFT_MANIFEST).write_text(json.dumps(manifest, indent=2))


#: drafts shipped inside the package, by name (``--draft smollm2-135m-draft``)
SHIPPED_DRAFTS = {"smollm2-135m-draft": Path(__file__).parent.parent / "drafts" / "smollm2-135m"}


def is_draft_dir(path: str | Path) -> bool:
    return (Path(path) / DRAFT_MANIFEST).is_file()


def shipped_draft_for(target: LoadedModel) -> str | None:
    """The name of a shipped draft distilled for exactly this target (same weights checksum), if there is one."""
    for name, path in SHIPPED_DRAFTS.items():
        try:
            made_for = json.loads((path / DRAFT_MANIFEST).read_text()).get("target", {})
        except (OSError, ValueError):
            continue
        if made_for.get("checksum") == target.checksum():
            return name
    return None


def resolve_draft(spec: str | Path, target: LoadedModel) -> LoadedModel:
    """A draft for ``target`` from a shipped name, a distilled directory, or anything ``load_model`` takes."""
    path = SHIPPED_DRAFTS.get(str(spec), Path(spec))
    if is_draft_dir(path):
        return load_draft(path, target)
    if str(spec) in SHIPPED_DRAFTS:
        raise DraftLoadError(f"the shipped draft {spec!r} is missing from this installation ({path})")
    return load_model(spec)


def load_pair(target: str | Path, draft: str | Path) -> tuple[LoadedModel, LoadedModel]:
    """The target and a draft for it (shipped name, distilled directory or model), checked compatible."""
    target_model = load_model(target)
    draft_model = resolve_draft(draft, target_model)
    check_draft_compatible(target_model, draft_model)
    return target_model, draft_model


def load_draft(path: str | Path, target: LoadedModel, dtype: torch.dtype = torch.float32) -> LoadedModel:
    """A distilled draft for ``target``: its weights plus the target's embeddings; refuses another target's."""
    from safetensors.torch import load_file
    from transformers import LlamaConfig

    root = Path(path)
    try:
        manifest = json.loads((root / DRAFT_MANIFEST).read_text())
        weights = load_file(str(root / WEIGHTS))
        head = torch.as_tensor(json.loads((root / HEAD_FILE).read_text()), dtype=torch.long)
        config = LlamaConfig.from_json_file(str(root / "config.json"))
    except (OSError, ValueError) as exc:
        raise DraftLoadError(f"{root} is not a complete distilled draft: {exc}") from exc
    made_for = manifest.get("target", {})
    if made_for.get("checksum") != target.checksum():
        raise DraftLoadError(
            f"draft {root} was distilled for target {made_for.get('name')!r} (checksum {made_for.get('checksum')}), "
            f"not for {target.name!r} (checksum {target.checksum()}): distill a draft for this target"
        )
    sd = {k: v.to(dtype) for k, v in weights.items()}
    sd["model.embed_tokens.weight"] = target.state_dict["model.embed_tokens.weight"].to(dtype)
    if manifest.get("shared_head"):  # the target's own head rows (``--share-head``): not stored with the draft
        sd["lm_head.weight"] = restrict_head(target, head).state_dict["lm_head.weight"].to(dtype)
    if "lm_head.weight" not in sd:
        raise DraftLoadError(f"{root} is not a complete distilled draft: its weights have no lm_head.weight")
    return LoadedModel(
        f"{made_for.get('name')}-draft",
        config,
        sd,
        target.tokenizer,
        str(root),
        {"head_token_ids": head, "draft_manifest": manifest},
    )


def check_draft_compatible(target: LoadedModel, draft: LoadedModel) -> None:
    """A draft must share the target's token ids, or its proposals mean nothing.

    A draft with a restricted-vocabulary head (``draft.head_token_ids``) is compatible: it
    still reads every target id and proposes only ids inside its head. The target itself
    must score every token, since the verifier needs p over the whole vocabulary.
    """
    if target.head_token_ids is not None:
        raise ValueError(
            f"target {target.name!r} has a restricted LM head ({len(target.head_token_ids)} of "
            f"{target.vocab_size} tokens): only a draft may restrict its head"
        )
    if draft.vocab_size != target.vocab_size:
        raise DraftMismatchError(
            f"draft {draft.name!r} has a vocabulary of {draft.vocab_size} tokens but target "
            f"{target.name!r} has {target.vocab_size}: a draft model must use the target's tokenizer"
        )
    if (
        target.tokenizer is not None
        and draft.tokenizer is not None
        and (target.tokenizer.get_vocab() != draft.tokenizer.get_vocab())
    ):
        raise DraftMismatchError(
            f"draft {draft.name!r} and target {target.name!r} have the same vocabulary size but "
            "different tokenizers: a draft model must use the target's tokenizer"
        )

"""Reading what an exported model is besides its graph, without torch: head map, tokenizer, end-of-sequence ids.

Why a module of its own: an engine over an ONNX Runtime export needs the tokenizer, the ids that end
a generation and a restricted draft head's map, but not the model code, and ``transformers``'
``AutoConfig`` alone imports torch (about 200 MB resident; ``benchmarks/results/edge_cpu.md``). This
module reads ``config.json`` as JSON and the tokenizer with ``PreTrainedTokenizerFast``, which needs only
the ``tokenizers`` library; ``loading`` (the torch side: weights, conversions) shares its validators.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from specdec.models.errors import ModelResolutionError

HEAD_TOKEN_IDS_FILE = "head_token_ids.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")


def check_head_token_ids(
    ids: Sequence[int] | np.ndarray | Any, vocab_size: int, rows: int | None = None, where: str = "head_token_ids"
) -> np.ndarray:
    """``ids`` as a validated 1-D ascending int64 array of distinct ids in ``[0, vocab_size)``.

    ``rows`` is the LM head's row count when known: a map of another length would silently
    give logits columns the wrong meaning, so it is refused here rather than decoded wrong.
    """
    a = np.asarray(ids)
    if a.ndim != 1 or a.size == 0 or not np.issubdtype(a.dtype, np.integer):
        raise ValueError(f"{where}: need a non-empty 1-D list of integer token ids, got shape {a.shape} of {a.dtype}")
    a = a.astype(np.int64)
    if int(a.min()) < 0 or int(a.max()) >= vocab_size:
        raise ValueError(f"{where}: token ids must lie in [0, {vocab_size}), got {int(a.min())}..{int(a.max())}")
    if a.size > 1 and not bool((a[1:] > a[:-1]).all()):
        raise ValueError(f"{where}: token ids must be distinct and in ascending order")
    if rows is not None and a.size != rows:
        raise ValueError(f"{where}: {a.size} token ids for an LM head of {rows} rows")
    return a


def read_head_token_ids(directory: str | os.PathLike, vocab_size: int | None = None) -> np.ndarray | None:
    """The head map saved in a model directory (``HEAD_TOKEN_IDS_FILE``), or None for a full head."""
    path = Path(directory) / HEAD_TOKEN_IDS_FILE
    if not path.is_file():
        return None
    try:
        ids = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ModelResolutionError(f"{path} is corrupt: {exc}") from exc
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ModelResolutionError(f"{path} must hold a JSON list of integer token ids")
    try:
        return check_head_token_ids(
            ids, vocab_size if vocab_size is not None else max(ids, default=0) + 1, where=str(path)
        )
    except ValueError as exc:
        raise ModelResolutionError(str(exc)) from exc


def eos_token_ids(config_eos: Any, generation_eos: Any, tokenizer: Any) -> tuple[int, ...]:
    """All ids that end a generation: the config's, the generation config's and the tokenizer's."""
    ids: set[int] = set()
    for src in (config_eos, generation_eos):
        if isinstance(src, int):
            ids.add(src)
        elif isinstance(src, (list, tuple)):
            ids.update(int(x) for x in src)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return tuple(sorted(ids))


def generation_eos(directory: Path) -> Any:
    """``eos_token_id`` of the directory's ``generation_config.json``, or None."""
    gen = directory / "generation_config.json"
    return json.loads(gen.read_text()).get("eos_token_id") if gen.is_file() else None


def load_tokenizer(directory: Path) -> Any:
    """An exported part's tokenizer, or None where it has none.

    A ``tokenizer.json`` (what every fast tokenizer saves, and so every export) is read by
    ``PreTrainedTokenizerFast`` with the directory's special tokens and chat template, without
    torch: the file holds the normaliser, pre-tokenizer and post-processor the exported tokenizer
    was saved with, so it encodes as that tokenizer did (``tests/test_export_meta.py`` checks it
    against ``AutoTokenizer``). Anything else goes through ``AutoTokenizer``.
    """
    if not any((directory / f).is_file() for f in TOKENIZER_FILES):
        return None
    try:
        if (directory / "tokenizer.json").is_file():
            from transformers import PreTrainedTokenizerFast

            return PreTrainedTokenizerFast.from_pretrained(str(directory))
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(directory))
    except Exception as exc:
        raise ModelResolutionError(f"cannot read the tokenizer in {directory}: {exc}") from exc


@dataclass
class ExportMetadata:
    """An exported model part without weights: its config (``config.json`` as a mapping) and tokenizer."""

    name: str
    config: Mapping[str, Any]
    tokenizer: Any
    eos_token_ids: tuple[int, ...]
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def vocab_size(self) -> int:
        return int(self.config["vocab_size"])


def load_export_metadata(path: str | os.PathLike, part: str = "target") -> ExportMetadata:
    """Config and tokenizer of an exported model, without weights (the graph carries them).

    The part's config and tokenizer files are checked against the manifest first: the served pre- and
    postprocessing models read nothing else of an export, so this is where an edited tokenizer is caught.
    """
    from specdec.models.manifest import ExportDirError, read_manifest, verify_part

    root = Path(path)
    try:
        verify_part(root, read_manifest(root, verify=False), part, weights=False)
    except ExportDirError as exc:
        raise ModelResolutionError(str(exc)) from exc
    directory = root / part
    try:
        config = json.loads((directory / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ModelResolutionError(f"cannot read {directory / 'config.json'}: {exc}") from exc
    tokenizer = load_tokenizer(directory)
    return ExportMetadata(
        part,
        config,
        tokenizer,
        eos_token_ids(config.get("eos_token_id"), generation_eos(directory), tokenizer),
        {"export_dir": str(root)},
    )

"""The settings of one ``specdec distill`` run, shared by every step of the recipe.

Why a module of its own: the data split, the training loop and the command line all read the
same settings, and each of them sits above this module, so none has to import another for them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from specdec.models.presets import DEFAULT_TARGET


@dataclass
class DistillSettings:
    """Every knob of the recipe; ``add_distill_args`` exposes them as flags with these defaults."""

    target: str = DEFAULT_TARGET
    out: str = "draft"
    layers: int = 2
    head_size: int = 8192
    samples: int = 400
    max_new_tokens: int = 128
    temperature: float = 1.0
    teacher_k: int = 32
    batch: int = 8
    lr: float = 1e-3
    warmup: int = 100
    weight_decay: float = 0.01
    steps: int | None = None
    minutes: float | None = 10.0
    seed: int = 0
    heldout: float = 0.05
    valid: float = 0.05
    validate_s: float = 300.0
    shard_size: int = 32
    prompts_file: str | None = None
    text_file: str | None = None
    greedy_data: bool = False
    self_prompts: int = 0
    share_head: bool = False
    init_from: str | None = None
    checkpoint_s: float = 60.0
    extra: dict[str, Any] = field(default_factory=dict)

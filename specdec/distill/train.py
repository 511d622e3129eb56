"""The training run: resume or start, train within the budget, keep the best step, write the draft.

Why resumable: a CPU run takes hours, so the optimisation is bounded by ``--minutes`` or
``--steps`` and checkpointed (``OUT/.work/checkpoint.pt``) so an interrupted run resumes where
it stopped, and a finished run given more data or more ``--steps`` continues from its checkpoint.
Output: ``OUT/model.safetensors`` (the draft's own weights, fp16), ``config.json``,
``head_token_ids.json`` and ``specdec_draft.json`` (command, data size, seed, metrics and the
target's checksum: loading the draft for another target fails clearly).
"""

from __future__ import annotations

import json
import math
import random
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from specdec.distill import objective
from specdec.distill.data import distill_data
from specdec.distill.net import DraftNet, check_growable, init_draft, select_head
from specdec.distill.records import Record
from specdec.distill.settings import DistillSettings
from specdec.models.drafts import DRAFT_MANIFEST, FORMAT, load_draft, save_draft
from specdec.models.errors import DraftLoadError
from specdec.models.loading import LoadedModel, load_model


def _train(
    net: DraftNet,
    optimizer: torch.optim.Optimizer,
    train: Sequence[Record],
    valid: Sequence[Record],
    settings: DistillSettings,
    state: dict[str, Any],
    best_net: dict[str, torch.Tensor] | None,
    save: Callable[[dict[str, torch.Tensor] | None], None],
) -> dict[str, torch.Tensor] | None:
    """The optimisation loop, resuming from ``state``; returns the weights with the best validation loss."""
    vocab_size = int(net.model.config.vocab_size)
    params = [p for p in net.parameters() if p.requires_grad]
    budget_s = settings.minutes * 60 if settings.minutes else math.inf
    max_steps = settings.steps if settings.steps is not None else math.inf
    rng = random.Random(settings.seed + state["step"])
    bar = tqdm(
        total=None if max_steps == math.inf else int(max_steps), initial=state["step"], desc="distill", unit="step"
    )
    last_save = last_valid = time.monotonic()
    start = time.monotonic() - state["elapsed"]

    def keep_if_best() -> None:
        nonlocal best_net
        loss = objective.validation_loss(net, valid, vocab_size)
        if state["best"] is None or loss < state["best"]["valid_loss"]:
            state["best"] = {"valid_loss": loss, "step": state["step"]}
            best_net = {k: v.detach().clone() for k, v in net.state_dict().items()}

    net.train()
    while state["step"] < max_steps and state["elapsed"] < budget_s:
        progress = max(state["elapsed"] / budget_s, state["step"] / max_steps)
        for group in optimizer.param_groups:
            group["lr"] = settings.lr * objective.lr_factor(state["step"], progress, settings.warmup)
        loss, _ = objective.distill_loss(net, rng.sample(train, min(settings.batch, len(train))), vocab_size)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        state["step"] += 1
        state["elapsed"] = time.monotonic() - start
        bar.update()
        bar.set_postfix(loss=f"{loss.item():.3f}", minutes=f"{state['elapsed'] / 60:.1f}")
        if time.monotonic() - last_valid > settings.validate_s:
            keep_if_best()
            last_valid = time.monotonic()
        if time.monotonic() - last_save > settings.checkpoint_s:
            save(best_net)
            last_save = time.monotonic()
    bar.close()
    keep_if_best()
    save(best_net)
    return best_net


def distill(settings: DistillSettings, command: str = "") -> dict[str, Any]:
    """Run (or resume, or continue on more data) the recipe; returns the manifest written to ``OUT/specdec_draft.json``.

    A rerun whose data grew (more ``--samples``, ``--self-prompts``) continues the checkpoint
    it finds: the head chosen by the first run is kept (the weights were trained for it), the
    "before" metrics are measured again on the new held-out sets with the untrained
    initialisation, and the best-checkpoint choice starts over, since validation losses on
    two different validation sets cannot be compared. Every command that trained the draft
    is listed in the manifest, in order, so the draft can be reproduced.
    """
    torch.manual_seed(settings.seed)
    out = Path(settings.out)
    work = out / ".work"
    work.mkdir(parents=True, exist_ok=True)
    target = load_model(settings.target)
    # a checkpoint or --init-from that cannot be used fails now, not after hours of data generation
    ckpt = work / "checkpoint.pt"
    saved, grow = _starting_point(ckpt, settings, target)
    data = distill_data(settings, target, work)
    train, valid, held = data.train, data.valid, data.held
    if saved is not None:
        head_ids = saved["head_ids"]
    else:  # a grown draft's layers were trained for its tokens: keep them, or the most frequent of them
        head_ids = select_head(
            train,
            settings.head_size,
            target.vocab_size,
            target.eos_token_ids,
            within=grow.head_token_ids if grow is not None else None,
        )
    draft = init_draft(target, settings.layers, head_ids, share_head=settings.share_head, grow=grow)
    net = DraftNet(draft)
    optimizer = torch.optim.AdamW(
        [p for p in net.parameters() if p.requires_grad], lr=settings.lr, weight_decay=settings.weight_decay
    )
    state: dict[str, Any] = {
        "step": 0,
        "elapsed": 0.0,
        "before": None,
        "best": None,
        "commands": [],
        "grown_from": None,
    }
    if grow is not None:  # the lineage: whoever reproduces this draft runs the grown one's commands first
        made = grow.extra["draft_manifest"]
        state["commands"] = list(made.get("commands") or [made.get("command", "")])
        state["grown_from"] = {
            "layers": made.get("layers"),
            "steps": made.get("steps"),
            "train_minutes": made.get("train_minutes_total", made.get("train_minutes")),
        }
    best_net: dict[str, torch.Tensor] | None = None
    if saved is not None:
        state = {**state, **saved["state"]}
        state.pop("greedy_before", None)  # a checkpoint from before the held-out sets were keyed by name
        if not state["commands"] and (out / DRAFT_MANIFEST).is_file():  # nor did it list commands: the manifest
            state["commands"] = [json.loads((out / DRAFT_MANIFEST).read_text()).get("command", "")]
        if state.get("data_key") != data.key:  # the data grew: see the docstring
            state.update(before=None, best=None)
        else:
            best_net = saved.get("best_net")
    if state["before"] is None:  # still the untrained initialisation here
        state["before"] = {name: objective.evaluate(net, target, part) for name, part in held.items()}
    state["data_key"] = data.key
    if not state["commands"] or state["commands"][-1] != command:
        state["commands"].append(command)
    if saved is not None:
        net.load_state_dict(saved["net"])
        optimizer.load_state_dict(saved["optimizer"])
        print(f"resuming at step {state['step']} ({state['elapsed'] / 60:.1f} min trained)", file=sys.stderr)
    best_net = _train(
        net,
        optimizer,
        train,
        valid,
        settings,
        state,
        best_net,
        lambda best: _checkpoint(ckpt, net, optimizer, state, head_ids, settings, best),
    )
    if best_net is not None:
        net.load_state_dict(best_net)  # the step with the lowest validation loss, not merely the last
    net.eval()
    after = {name: objective.evaluate(net, target, part) for name, part in held.items()}
    metrics: dict[str, Any] = {
        name: {"before": state["before"][name], "after": after[name]} for name in held if name != "heldout"
    }
    trained = net.export(draft)
    manifest = {
        "specdec_draft": FORMAT,
        "command": command,
        "commands": state["commands"],
        "target": {"name": target.name, "checksum": target.checksum(), "vocab_size": target.vocab_size},
        "layers": settings.layers,
        "init_layers": draft.extra.get("init_layers"),
        "head_size": len(head_ids),
        "shared_head": settings.share_head,
        "grown_from": state["grown_from"],
        "data": {
            "sequences": len(data.records),
            "train_sequences": len(train),
            "heldout_sequences": len(held["heldout"]),
            "validation_sequences": len(valid),
            "teacher_positions": sum(len(r.positions) for r in data.records),
            "teacher_k": settings.teacher_k,
            "temperature": settings.temperature,
            "text_file": settings.text_file,
            "greedy_data": settings.greedy_data,
            "greedy_train_sequences": data.greedy_train,
            "heldout_greedy_sequences": len(held["heldout_greedy"]),
            "self_prompts": data.self_prompts,
            "self_prompt_heldout_sequences": len(held.get("self_prompts", [])),
        },
        "seed": settings.seed,
        "steps": state["step"],
        "train_minutes": round(state["elapsed"] / 60, 2),
        "train_minutes_total": round(
            state["elapsed"] / 60 + ((state["grown_from"] or {}).get("train_minutes") or 0), 2
        ),
        "batch": settings.batch,
        "lr": settings.lr,
        "warmup": settings.warmup,
        "weight_decay": settings.weight_decay,
        "kept_step": state["best"]["step"],
        "validation_loss": state["best"]["valid_loss"],
        "metrics": {"before": state["before"]["heldout"], "after": after["heldout"], **metrics},
    }
    save_draft(trained, out, manifest)
    return manifest


def _starting_point(
    ckpt: Path, settings: DistillSettings, target: LoadedModel
) -> tuple[dict[str, Any] | None, LoadedModel | None]:
    """Where training starts: (this run's checkpoint, or else the draft to grow from, if any).

    A checkpoint of another architecture is refused, unless ``--init-from`` says to grow a new
    draft: then it is kept aside under its layers and step, and the draft grows from there.
    """
    saved = torch.load(ckpt, weights_only=True) if ckpt.is_file() else None
    arch = {"layers": settings.layers, "greedy_data": settings.greedy_data, "share_head": settings.share_head}
    if saved is not None and {k: saved.get(k, False) for k in arch} != arch:
        if not settings.init_from:
            raise DraftLoadError(
                f"{ckpt} belongs to a different run (--layers, --greedy-data or --share-head "
                f"differ): remove {ckpt}, or grow a new draft from a finished one with --init-from"
            )
        kept = ckpt.with_name(f"checkpoint-{saved['layers']}-layers-step-{saved['state']['step']}.pt")
        ckpt.replace(kept)  # the finished run's state stays on disk; this run starts from --init-from
        print(f"{ckpt} belongs to the draft being grown: kept as {kept.name}", file=sys.stderr)
        saved = None
    grow = load_draft(settings.init_from, target) if settings.init_from and saved is None else None
    if grow is not None:
        check_growable(int(grow.config.num_hidden_layers), settings.layers)
    return saved, grow


def _checkpoint(
    path: Path,
    net: DraftNet,
    optimizer: torch.optim.Optimizer,
    state: dict,
    head_ids: torch.Tensor,
    settings: DistillSettings,
    best_net: dict[str, torch.Tensor] | None,
) -> None:
    """Write the run's state atomically: an interruption leaves the previous checkpoint, never half of one."""
    tmp = path.with_suffix(".tmp")
    torch.save(
        {
            "net": net.state_dict(),
            "optimizer": optimizer.state_dict(),
            "state": state,
            "head_ids": head_ids,
            "layers": settings.layers,
            "greedy_data": settings.greedy_data,
            "share_head": settings.share_head,
            "best_net": best_net,
        },
        tmp,
    )
    tmp.replace(path)

"""The ``specdec distill`` command line: flags in (:class:`~specdec.distill.settings.DistillSettings`), summary out."""

from __future__ import annotations

import argparse
import sys

from specdec.distill.settings import DistillSettings
from specdec.models.errors import DraftLoadError, ModelResolutionError


def add_distill_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The flags of ``specdec distill``, with the defaults of :class:`DistillSettings` (one source of them)."""
    d = DistillSettings()
    parser.add_argument("--target", default=d.target, help="preset, Hugging Face directory or .gguf file")
    parser.add_argument("--out", required=True, help="output directory (also holds .work/ for resuming)")
    parser.add_argument("--prompts", dest="prompts_file", help="JSON list of strings or one prompt per line")
    parser.add_argument("--text", dest="text_file", help="plain documents to add (teacher on every position)")
    parser.add_argument("--samples", type=int, default=d.samples, help="prompts to continue")
    parser.add_argument(
        "--greedy-data", action="store_true", help="also train on one greedy continuation per distinct prompt"
    )
    parser.add_argument(
        "--self-prompts",
        type=int,
        default=d.self_prompts,
        help="add this many requests written by the (chat) target itself to the prompts",
    )
    parser.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens)
    parser.add_argument("--layers", type=int, default=d.layers)
    parser.add_argument("--head-size", type=int, default=d.head_size, help="tokens in the draft's LM head")
    parser.add_argument(
        "--share-head",
        action="store_true",
        help="use the target's own LM head rows as the draft's head: frozen, and not stored",
    )
    parser.add_argument(
        "--init-from",
        metavar="DRAFT_DIR",
        help="grow a finished draft (its layers first and last, new layers in between starting as "
        "no-ops, its head tokens) instead of starting from target layers",
    )
    parser.add_argument("--teacher-k", type=int, default=d.teacher_k, help="teacher log-probs kept per position")
    parser.add_argument("--batch", type=int, default=d.batch, help="sequences per training step")
    parser.add_argument("--lr", type=float, default=d.lr, help="peak learning rate (warm-up, then cosine to 10%%)")
    parser.add_argument("--weight-decay", type=float, default=d.weight_decay)
    parser.add_argument("--minutes", type=float, default=d.minutes, help="training time budget (all runs)")
    parser.add_argument("--steps", type=int, help="training steps (overrides --minutes)")
    parser.add_argument("--seed", type=int, default=d.seed)
    return parser


def distill_main(args: argparse.Namespace) -> int:
    """Run the recipe from parsed flags; a bad target, draft or setting is an error message and exit 2, not a trace."""
    settings = DistillSettings(**{k: v for k, v in vars(args).items() if k in DistillSettings.__dataclass_fields__})
    if settings.steps is not None:
        settings.minutes = None
    try:
        from specdec.distill.train import distill  # torch: loaded for this command only, not by `specdec`'s parser

        manifest = distill(settings, command=" ".join(["specdec", "distill", *sys.argv[2:]]))
    except (ModelResolutionError, DraftLoadError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    before, after = manifest["metrics"]["before"], manifest["metrics"]["after"]
    print(
        f"draft written to {settings.out}: {manifest['layers']} layers, head {manifest['head_size']} tokens, "
        f"{manifest['steps']} steps in {manifest['train_minutes']} min on "
        f"{manifest['data']['teacher_positions']} teacher positions"
    )
    greedy = manifest["metrics"]["heldout_greedy"]
    for name in ("greedy_agreement", "expected_acceptance", "kl_on_head"):
        print(
            f"  held-out {name:20s} {before[name]:.4f} -> {after[name]:.4f}   "
            f"(greedy continuations: {greedy['before'][name]:.4f} -> {greedy['after'][name]:.4f})"
        )
    if "self_prompts" in manifest["metrics"]:
        own, own_greedy = manifest["metrics"]["self_prompts"], manifest["metrics"]["self_prompts_greedy"]
        for name in ("greedy_agreement", "expected_acceptance"):
            print(
                f"  self-written prompts {name:20s} {own['before'][name]:.4f} -> {own['after'][name]:.4f}   "
                f"(greedy continuations: {own_greedy['before'][name]:.4f} -> {own_greedy['after'][name]:.4f})"
            )
    return 0

"""The ``specdec`` command: ``generate`` (local decoding), ``bench``, ``serve`` (Triton), ``client`` and ``deploy``."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from specdec.models.errors import DraftLoadError, DraftMismatchError, ModelResolutionError
from specdec.models.presets import DEFAULT_TARGET
from specdec.runtime.config import (
    DEFAULT_MAX_BATCH,
    DEFAULT_MAX_LEN,
    DEFAULT_NUM_DRAFT_TOKENS,
    DrafterKind,
    EngineConfig,
)
from specdec.runtime.config import NAMES as DRAFTER_NAMES
from specdec.runtime.costs import calibrate_engine
from specdec.runtime.draft_length import add_draft_length_args, check_draft_length_args, draft_length_from
from specdec.runtime.engine import Engine, GenerationResult
from specdec.runtime.methods import BASELINE_METHOD, DEFAULT_METHOD, METHOD_NAMES, METHODS, Method, get_method
from specdec.runtime.prompts import read_prompts
from specdec.runtime.request import BEAM_MODES, MEMORY_MODES, BeamParams, Request
from specdec.runtime.sampling import InvalidRequestError


def build_engine(args: argparse.Namespace) -> Engine:
    engine = _open_engine(args)
    if args.calibrate:  # price the adaptive draft length on this machine's backends
        costs = calibrate_engine(engine)
        engine.reconfigure(draft_length=draft_length_from(args, costs.as_dict()))
        print(
            f"calibrated: a draft token costs {costs.draft_cost} and a verified row {costs.verify_cost} "
            f"of a target step; the policy uses {engine.config.draft_length}",
            file=sys.stderr,
        )
    return engine


def engine_config(args: argparse.Namespace, measured: dict[str, Any] | None = None) -> EngineConfig:
    """The engine settings ``specdec generate``'s options ask for (``measured``: costs an export calibrated)."""
    method = get_method(args.method)
    drafter = DrafterKind.parse(args.drafter) if method.uses_drafter else DrafterKind.NONE
    return EngineConfig(
        max_batch=args.max_batch,
        max_len=args.max_len,
        num_draft_tokens=args.num_draft_tokens,
        draft_length=draft_length_from(args, measured),
        drafter=drafter,
        torch_threads=1,
    )


def _open_engine(args: argparse.Namespace) -> Engine:
    if (Path(args.target) / "manifest.json").is_file() and not args.draft:
        from specdec.models.manifest import ExportDirError, read_manifest

        try:
            # an export calibrated at export time (--calibrate) carries the costs measured there
            measured = read_manifest(Path(args.target), verify=False).get("calibration")
            return Engine.from_export(args.target, engine_config(args, measured))
        except ExportDirError as exc:
            raise ModelResolutionError(str(exc)) from exc
    from specdec.models.loading import load_model  # the torch side: only a model that is not an export

    target = load_model(args.target)
    config = engine_config(args)
    if args.draft and DrafterKind.parse(args.drafter) not in (None, *DrafterKind.with_model()):
        raise SystemExit("error: --draft PATH goes with no --drafter or --drafter hybrid, not ngram|none")
    return Engine.from_models(target, _draft_model(get_method(args.method), target, args, config), config)


def _draft_model(method: Method, target: Any, args: argparse.Namespace, config: EngineConfig) -> Any:
    """The draft model ``method`` runs with: ``--draft``, else the target's shipped draft where a model is needed
    (dsbd's forests, the hybrid drafter); None for a method that does not draft or drafts by prompt lookup."""
    from specdec.models.drafts import resolve_draft, shipped_draft_for

    if not method.uses_drafter:
        return None
    if args.draft:
        return resolve_draft(args.draft, target)
    wants_model = config.drafter is not None and config.drafter.needs_model
    if not method.needs_draft_model and not wants_model:
        return None
    shipped = shipped_draft_for(target) if config.drafter in (None, *DrafterKind.with_model()) else None
    if shipped is None:
        needs = (
            f"the {config.drafter.value} drafter needs a draft model"
            if wants_model and config.drafter is not None
            else f"{method.name} needs a draft model that samples the forest"
        )
        raise ValueError(
            f"{needs}, and {target.name!r} has no shipped draft: pass --draft (a preset, a directory "
            "or a distilled draft)"
        )
    return resolve_draft(shipped, target)


def _beam_params(args: argparse.Namespace, method: str) -> BeamParams | None:
    """The beam options, for the beam methods only (the others ignore them)."""
    if not METHODS[method].beams:
        return None
    return BeamParams(
        width=args.beam_width,
        min_width=args.dsbd_min_width,
        threshold=args.dsbd_threshold,
        mode=args.beam_mode,
        memory_mode=args.memory_mode,
        num_return_sequences=args.num_return_sequences,
        length_penalty=args.length_penalty,
    )


def _requests(
    engine: Engine, prompts: Sequence[str], args: argparse.Namespace, method: str | None = None
) -> list[Request | Exception]:
    """A request per prompt, or the error that refused it (``Engine.generate`` answers it in its place)."""
    items: list[Request | Exception] = []
    for i, prompt in enumerate(prompts):
        try:
            items.append(
                engine.request(
                    prompt,
                    chat=args.chat,
                    max_tokens=args.max_tokens,
                    temperature=args.temperature,
                    top_k=args.top_k,
                    top_p=args.top_p,
                    seed=None if args.seed is None else args.seed + i,
                    stop=args.stop or (),
                    request_id=f"prompt-{i}",
                    beam=_beam_params(args, method or args.method),
                )
            )
        except InvalidRequestError as exc:
            items.append(InvalidRequestError(f"prompt {i}: {exc}"))
    return items


def _print_human(prompts: Sequence[str], result: GenerationResult, baseline: GenerationResult | None) -> None:
    for i, (prompt, out) in enumerate(zip(prompts, result.outputs)):
        print(f"\n[{i}] {prompt}")
        if out.error:
            print(f"    ERROR: {out.error}")
            continue
        m = out.metrics
        print(f"--> {out.text!r}")
        print(
            f"    tokens={m.generated_tokens} finish={out.finish_reason} acceptance={m.acceptance_rate:.2f} "
            f"accepted/draft={m.accepted_draft_tokens}/{m.draft_tokens} target_calls={m.target_calls}"
            + (
                f" beams/round={m.beam_widths} logprob/token={m.logprob / max(1, len(out.token_ids)):.3f}"
                if m.beam_widths and m.logprob is not None
                else ""
            )
        )
        for rank, cand in enumerate(out.sequences[1:], start=2):
            print(f"    #{rank} (logprob {cand.logprob:.2f}): {cand.token_ids}")
    s = result.run.summary()
    print(
        f"\n{s['method']}: {s['generated_tokens']} tokens in {s['wall_seconds']:.2f} s = "
        f"{s['tokens_per_second']:.1f} tok/s, acceptance {s['acceptance_rate']:.2f}, "
        f"mean accepted length {s['mean_accepted_length']:.2f}, target calls {s['target_calls']}, "
        f"mean batch {s['mean_batch_size']:.2f}"
    )
    if baseline is not None:
        b = baseline.run.summary()
        same = all(a.token_ids == r.token_ids for a, r in zip(baseline.outputs, result.outputs) if not r.error)
        print(f"ar:  {b['generated_tokens']} tokens in {b['wall_seconds']:.2f} s = {b['tokens_per_second']:.1f} tok/s")
        print(
            f"speed-up of {s['method']} over ar: {s['tokens_per_second'] / max(b['tokens_per_second'], 1e-9):.2f}x"
            + ("  (outputs identical)" if same else "  (outputs differ: sampling)")
        )


def cmd_generate(args: argparse.Namespace) -> int:
    try:
        engine = build_engine(args)
    except (ModelResolutionError, DraftMismatchError, DraftLoadError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    prompts = read_prompts(args)
    items = _requests(engine, prompts, args)
    try:
        result = engine.generate(items, args.method, progress=not args.json)
    except ValueError as exc:  # a method this engine cannot run (e.g. dsbd over the n-gram drafter)
        print(f"error: {exc}", file=sys.stderr)
        return 2
    baseline = None
    if args.compare_ar and args.method != BASELINE_METHOD:
        baseline = engine.generate(
            _requests(engine, prompts, args, BASELINE_METHOD), BASELINE_METHOD, progress=not args.json
        )
    if args.json:
        doc = {
            "outputs": [
                {
                    "text": o.text,
                    "token_ids": o.token_ids,
                    "finish_reason": o.finish_reason,
                    "metrics": o.metrics.as_dict(),
                    **({"error": o.error} if o.error else {}),
                    **({"sequences": [asdict(c) for c in o.sequences]} if o.sequences else {}),
                }
                for o in result.outputs
            ],
            "metrics": result.run.summary(),
        }
        if baseline is not None:
            doc["baseline"] = baseline.run.summary()
            doc["speedup_over_ar"] = round(
                result.run.summary()["tokens_per_second"] / max(baseline.run.summary()["tokens_per_second"], 1e-9), 4
            )
        print(json.dumps(doc))
    else:
        _print_human(prompts, result, baseline)
    return 1 if any(o.error for o in result.outputs) else 0


def add_generate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default=DEFAULT_TARGET, help="preset, Hugging Face directory or .gguf file")
    p.add_argument("--draft", help="draft model (preset, directory or .gguf); default: the n-gram drafter")
    p.add_argument(
        "--drafter",
        choices=DRAFTER_NAMES,
        help="ngram: prompt lookup (the default without --draft); hybrid: prompt lookup where the context "
        "matches, the draft model (--draft, or the target's shipped one) elsewhere; none",
    )
    p.add_argument(
        "--method",
        choices=METHOD_NAMES,
        default=DEFAULT_METHOD,
        help="; ".join(f"{m.name}: {m.summary}" for m in METHODS.values()),
    )
    p.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    p.add_argument("--prompts-file", help="JSON list of strings, or one prompt per line")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument(
        "--num-draft-tokens",
        type=int,
        default=DEFAULT_NUM_DRAFT_TOKENS,
        help="draft length k (with --adaptive-draft: the most)",
    )
    add_draft_length_args(p)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, help="seed of the first prompt; prompt i uses seed + i")
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    p.add_argument("--chat", action="store_true", help="apply the tokenizer's chat template")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.add_argument("--compare-ar", action="store_true", help="also run ar and print the speed-up")
    beam = p.add_argument_group("beam and dsbd")
    beam.add_argument(
        "--beam-width",
        type=int,
        default=2,
        help="beams per step (beam); draft width W_S and largest output width (dsbd)",
    )
    beam.add_argument(
        "--dsbd-threshold",
        type=float,
        default=0.0,
        help="dsbd dynamic width: largest K with P(layer of width K passes) >= t (0 = fixed width)",
    )
    beam.add_argument("--dsbd-min-width", type=int, default=1, help="dsbd: smallest width W_min")
    beam.add_argument(
        "--beam-mode",
        choices=BEAM_MODES,
        default="iid",
        help="beam: draw pairs i.i.d. (the law dsbd reproduces) or without replacement",
    )
    beam.add_argument(
        "--memory-mode",
        choices=MEMORY_MODES,
        default="full",
        help="single: keep one beam per round (one KV sequence per request)",
    )
    beam.add_argument("--num-return-sequences", type=int, default=1)
    beam.add_argument("--length-penalty", type=float, default=1.0, help="candidates ranked by logprob / length ** this")
    p.add_argument(
        "--max-batch", type=int, help=f"sequences decoded together (default the export's, else {DEFAULT_MAX_BATCH})"
    )
    p.add_argument(
        "--max-len",
        type=int,
        help=f"KV-cache length per sequence (default the export's, else {DEFAULT_MAX_LEN} within the model's context)",
    )


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    if args_list[:2] == ["bench", "beams"]:  # DSBD vs beam vs ems: speed against quality
        from specdec.bench.beams import main as beams_main

        return beams_main(args_list[2:])
    if args_list[:1] == ["bench"]:  # its options belong to the benchmark's own parser
        from specdec.bench.ems import main as bench_main

        return bench_main(args_list[1:])
    parser = argparse.ArgumentParser(prog="specdec", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help=f"decode prompts locally ({', '.join(METHOD_NAMES)})")
    add_generate_args(gen)
    gen.set_defaults(func=cmd_generate)
    sub.add_parser(
        "bench",
        help="the EMS-SD vs vanilla vs ar benchmark (`specdec bench --help`); "
        "`specdec bench beams`: DSBD vs beam vs ems",
    )
    from specdec.deploy.balancer import add_balancer_args, balancer_main
    from specdec.deploy.kubernetes_cli import add_kubernetes_args, kubernetes_main
    from specdec.distill.cli import add_distill_args, distill_main
    from specdec.serving.client import add_client_args, client_main
    from specdec.serving.serve import add_serve_args, serve_main

    deploy = sub.add_parser("deploy", help="deployment recipes for `specdec serve` replicas").add_subparsers(
        dest="recipe", required=True
    )
    # (parent, name, help, its arguments, what runs it): each subcommand's parser lives beside its code
    for parent, name, help_text, add_args, run in (
        (sub, "serve", "run Triton Inference Server on a model repository", add_serve_args, serve_main),
        (sub, "distill", "train a cheap draft model for a target (resumable)", add_distill_args, distill_main),
        (sub, "client", "send prompts to a running `specdec serve` over gRPC", add_client_args, client_main),
        (
            deploy,
            "kubernetes",
            "render Kubernetes (and KServe) YAML for an export",
            add_kubernetes_args,
            kubernetes_main,
        ),
        (
            deploy,
            "balancer",
            "run HAProxy in front of replicas (gRPC, readiness health checks)",
            add_balancer_args,
            balancer_main,
        ),
    ):
        command = parent.add_parser(name, help=help_text)
        add_args(command)
        command.set_defaults(func=run)
    args = parser.parse_args(args_list)
    if args.command == "generate":
        check_draft_length_args(gen, args)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())

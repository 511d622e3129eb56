"""``specdec deploy kubernetes EXPORT_DIR --out DIR``: render the manifests of ``specdec.deploy.kubernetes`` to files.

Apart from the rendering so that the objects stay readable on their own; the layout of ``DIR`` is in the
rendering module's docstring.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import yaml  # a dependency of transformers

from specdec.deploy import kubernetes
from specdec.deploy.kubernetes import DeployError, ExportSource, KubernetesOptions, PvcSource, Rendered, render


def write(rendered: Rendered, out: str | Path) -> list[Path]:
    """One YAML file per object (named by its kind); the KServe route and the adapter rule in sub-folders."""
    root = Path(out)
    files = [(root / f"{o['kind'].lower()}.yaml", o) for o in rendered.workload]
    files += [(root / "kserve" / f"{o['kind'].lower()}.yaml", o) for o in rendered.kserve]
    files.append((root / "prometheus-adapter" / "rules.yaml", rendered.adapter_rules))
    for path, doc in files:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(
            "# rendered by `specdec deploy kubernetes` (docs/deployment-kubernetes.md)\n"
            + yaml.safe_dump(doc, sort_keys=False)
        )
    return [path for path, _ in files]


def _label(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"{text!r}: expected KEY=VALUE")
    return key, value


def add_kubernetes_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Options of ``specdec deploy kubernetes`` (kept here so cli.py only wires the subcommand)."""
    d = KubernetesOptions()
    parser.add_argument("export_dir", type=Path, help="the export (`specdec-export --out DIR`, with its triton_repo)")
    parser.add_argument("--out", type=Path, required=True, help="directory the YAML files are written to")
    parser.add_argument("--name", default=d.name, help=f"name of every object (default {d.name})")
    parser.add_argument("--namespace", default=d.namespace, help=f"namespace (default {d.namespace})")
    parser.add_argument(
        "--image",
        default=d.image,
        help=f"server image (default {d.image}; it must have specdec installed: build FROM it)",
    )
    parser.add_argument("--replicas", type=int, default=d.replicas, help="replicas, the autoscaler's floor (default 1)")
    parser.add_argument("--max-replicas", type=int, default=d.max_replicas, help="the autoscaler's ceiling (default 4)")
    parser.add_argument("--gpus", type=int, default=d.gpus, help="nvidia.com/gpu per pod (default 0: CPU)")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--pvc",
        metavar="CLAIM[:SUB_PATH]",
        help="a PersistentVolumeClaim holding the export directory (at SUB_PATH of the volume)",
    )
    source.add_argument(
        "--export-in-pod",
        action="store_true",
        help="an init container runs specdec-export into an emptyDir (the manifest's command "
        "unless --export-arg is given)",
    )
    parser.add_argument(
        "--export-arg",
        action="append",
        metavar="ARG",
        help="an option of the in-pod specdec-export (repeatable; e.g. --export-arg=--target "
        "--export-arg=smollm2-135m)",
    )
    parser.add_argument("--export-image", help="the init container's image (default: --image)")
    parser.add_argument(
        "--target-utilization",
        type=float,
        default=d.target_utilization,
        help="share of the engine's batch kept in flight per pod by the autoscaler (default 0.75)",
    )
    parser.add_argument(
        "--drain-timeout",
        type=float,
        default=d.drain_timeout_s,
        help=f"specdec serve --drain-timeout in the pod (default {d.drain_timeout_s:g})",
    )
    parser.add_argument(
        "--exit-timeout",
        type=int,
        default=d.exit_timeout_s,
        help=f"specdec serve --exit-timeout in the pod (default {d.exit_timeout_s})",
    )
    parser.add_argument(
        "--ready-timeout",
        type=float,
        default=d.ready_timeout_s,
        help=f"specdec serve --ready-timeout, which the startup probe allows (default {d.ready_timeout_s:g})",
    )
    parser.add_argument("--pre-stop", type=int, default=d.pre_stop_s, help="preStop sleep in seconds (default 5)")
    parser.add_argument("--cpu", help="CPU request of the server container (e.g. 4)")
    parser.add_argument("--memory", help="memory request and limit of the server container (e.g. 8Gi)")
    parser.add_argument("--shm-size", default=d.shm_size, help=f"size of the pod's /dev/shm (default {d.shm_size})")
    parser.add_argument("--admin-key-secret", help="a Secret whose key admin-key holds the management APIs' key")
    parser.add_argument(
        "--openai-key-secret", help="a Secret whose key openai-api-key holds the OpenAI API's key (default: no key)"
    )
    parser.add_argument(
        "--monitor-label",
        action="append",
        type=_label,
        default=[],
        metavar="KEY=VALUE",
        help="a label of the ServiceMonitor (repeatable; e.g. release=prometheus)",
    )
    return parser


def options_from(args: argparse.Namespace) -> KubernetesOptions:
    """The rendering options of parsed ``specdec deploy kubernetes`` arguments."""
    if args.pvc:
        claim, _, sub_path = args.pvc.partition(":")
        source: PvcSource | ExportSource = PvcSource(claim, sub_path.strip("/"))
        if args.export_arg or args.export_image:
            raise DeployError("--export-arg and --export-image go with --export-in-pod, not --pvc")
    else:
        source = ExportSource(None if args.export_arg is None else tuple(args.export_arg), args.export_image)
    return KubernetesOptions(
        name=args.name,
        namespace=args.namespace,
        image=args.image,
        replicas=args.replicas,
        max_replicas=args.max_replicas,
        gpus=args.gpus,
        source=source,
        target_utilization=args.target_utilization,
        drain_timeout_s=args.drain_timeout,
        exit_timeout_s=args.exit_timeout,
        ready_timeout_s=args.ready_timeout,
        pre_stop_s=args.pre_stop,
        shm_size=args.shm_size,
        cpu=args.cpu,
        memory=args.memory,
        admin_key_secret=args.admin_key_secret,
        openai_key_secret=args.openai_key_secret,
        monitor_labels=tuple(args.monitor_label),
    )


def kubernetes_main(args: argparse.Namespace | Sequence[str] | None = None) -> int:
    """Render and write the manifests; exit 2 with the reason when the export or an option cannot work."""
    if not isinstance(args, argparse.Namespace):
        parser = add_kubernetes_args(
            argparse.ArgumentParser(
                prog="specdec deploy kubernetes",
                description=kubernetes.__doc__,
                formatter_class=argparse.RawDescriptionHelpFormatter,
            )
        )
        args = parser.parse_args(None if args is None else list(args))
    try:
        options = options_from(args)
        rendered = render(args.export_dir, options)
    except DeployError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for path in write(rendered, args.out):
        print(path)
    print(
        f"apply: kubectl apply -f {args.out}   (or the KServe route: kubectl apply -f {args.out / 'kserve'})",
        file=sys.stderr,
    )
    return 0

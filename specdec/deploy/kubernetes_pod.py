"""What every pod of a specdec deployment runs: the options, the ``specdec serve`` container, its probes and volumes.

Shared by the plain route (``specdec.deploy.kubernetes``) and the KServe one (``specdec.deploy.kserve``). Every value
that another part of the stack must agree with is taken from where it is defined: ports and the drain, exit and
ready timeouts from ``specdec serve``'s own option defaults (``add_serve_args``), the health paths from
``specdec.serving.server`` and ``specdec.serving.openai.process``, the metrics path from ``TritonServer``.
"""

from __future__ import annotations

import argparse
import math
import posixpath
import re
import shlex
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlparse

from specdec.serving.openai.process import API_KEY_ENV as OPENAI_KEY_ENV
from specdec.serving.openai.process import READY_PATH as OPENAI_READY_PATH
from specdec.serving.serve import add_serve_args
from specdec.serving.server import LIVE_PATH, READY_PATH, TritonServer

#: the NGC release of tritonserver 2.51, the server the repository's models are written and tested against
TRITON_TAG = "24.10"
DEFAULT_IMAGE = f"nvcr.io/nvidia/tritonserver:{TRITON_TAG}-py3"
#: container and Service port names: ``grpc`` lets a mesh (Istio, Linkerd) pick HTTP/2 by name, ``metrics`` is what
#: the ServiceMonitor scrapes, ``openai`` is the OpenAI-compatible API (HTTP/1.1)
GRPC_PORT, HTTP_PORT, METRICS_PORT, OPENAI_PORT = "grpc", "http", "metrics", "openai"
#: the Service's appProtocol of each port (``kubernetes.io/h2c``: gRPC is HTTP/2 in cleartext here)
APP_PROTOCOL = {GRPC_PORT: "kubernetes.io/h2c", HTTP_PORT: "http", METRICS_PORT: "http", OPENAI_PORT: "http"}
MODELS_MOUNT = "/models"
#: where the init container exports inside the emptyDir (``specdec-export`` renames its partial directory into
#: place, which a mount point itself does not allow)
POD_EXPORT_DIR = f"{MODELS_MOUNT}/export"
GPU_RESOURCE = "nvidia.com/gpu"
ADMIN_KEY_ENV, ADMIN_KEY_SECRET_KEY = "SPECDEC_ADMIN_KEY", "admin-key"
OPENAI_KEY_SECRET_KEY = "openai-api-key"
PROBE_PERIOD_S = 10
#: seconds the grace period keeps beyond preStop + drain + Triton's exit: the abort's settle (5 s in
#: ``TritonServer.drain``) and the cleanup of the stubs' shared memory
GRACE_MARGIN_S = 10
#: the Python-backend stubs exchange tensors through /dev/shm, which a container gets only 64 MiB of by default
DEFAULT_SHM_SIZE = "1Gi"
_DNS_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_LONGEST_SUFFIX = "-runtime"


class DeployError(ValueError):
    """The export or the options cannot make a working deployment; the message names the problem."""


def serve_defaults() -> argparse.Namespace:
    """``specdec serve``'s defaults, read from its own parser (ports, drain/exit/ready timeouts)."""
    return add_serve_args(argparse.ArgumentParser(add_help=False)).parse_args(["MODEL_REPOSITORY"])


_SERVE = serve_defaults()


#: the path of Triton's Prometheus endpoint, as ``specdec serve`` itself reads it
METRICS_PATH = urlparse(TritonServer().metrics_url).path


@dataclass(frozen=True)
class PvcSource:
    """The export (its ``triton_repo`` inside) lies on a PersistentVolumeClaim, at ``sub_path`` of the volume.

    More than one replica needs a claim that several nodes can mount (ReadOnlyMany or ReadWriteMany).
    """

    claim: str
    sub_path: str = ""


@dataclass(frozen=True)
class ExportSource:
    """An init container runs ``specdec-export`` into an emptyDir before the server starts.

    ``args``: the export's options; None repeats the command recorded in the export's manifest (which
    must then name presets, not paths of this machine). ``image``: None uses the server's image.
    """

    args: tuple[str, ...] | None = None
    image: str | None = None


@dataclass(frozen=True)
class KubernetesOptions:
    """What the rendered objects are named and sized by; timeouts default to ``specdec serve``'s."""

    name: str = "specdec"
    namespace: str = "default"
    image: str = DEFAULT_IMAGE
    replicas: int = 1
    max_replicas: int = 4  # the autoscaler's ceiling; its floor is ``replicas``
    gpus: int = 0  # nvidia.com/gpu per pod; 0 = CPU
    source: PvcSource | ExportSource = field(default_factory=ExportSource)
    #: the share of the engine's batch (sequences decoded together) the autoscaler keeps in flight per pod
    target_utilization: float = 0.75
    drain_timeout_s: float = _SERVE.drain_timeout
    exit_timeout_s: int = _SERVE.exit_timeout
    ready_timeout_s: float = _SERVE.ready_timeout
    pre_stop_s: int = 5  # the endpoint leaves the Service's endpoints before the drain refuses requests
    shm_size: str = DEFAULT_SHM_SIZE
    cpu: str | None = None  # requests (and the memory limit) of the server container, when given
    memory: str | None = None
    admin_key_secret: str | None = None  # a Secret whose key ``admin-key`` is the management APIs' key
    openai_key_secret: str | None = None  # a Secret whose key ``openai-api-key`` is the OpenAI API's key
    monitor_labels: tuple[tuple[str, str], ...] = ()  # e.g. (("release", "prometheus"),) for kube-prometheus-stack
    scrape_interval: str = "15s"


def grace_period_s(options: KubernetesOptions) -> int:
    """``terminationGracePeriodSeconds``: the preStop sleep, the drain, Triton's own exit, and a margin.

    The kubelet counts the preStop hook inside the grace period, and SIGTERM reaches ``specdec serve`` only
    after it; past the grace period the kubelet kills the pod, cutting short requests the drain still allowed.
    """
    return math.ceil(options.pre_stop_s + options.drain_timeout_s + options.exit_timeout_s) + GRACE_MARGIN_S


def check_options(options: KubernetesOptions) -> None:
    """Raise ``DeployError`` for the first option a cluster would refuse, or that cannot work."""
    if not _DNS_LABEL.match(options.name) or len(options.name) + len(_LONGEST_SUFFIX) > 63:
        raise DeployError(
            f"name {options.name!r} must be a DNS label (lowercase letters, digits and '-', starting "
            f"with a letter) of at most {63 - len(_LONGEST_SUFFIX)} characters"
        )
    if not _DNS_LABEL.match(options.namespace) or len(options.namespace) > 63:
        raise DeployError(f"namespace {options.namespace!r} must be a DNS label (lowercase letters, digits, '-')")
    if not options.image or any(c.isspace() for c in options.image):
        raise DeployError(f"image {options.image!r} must be a non-empty image reference without spaces")
    if options.replicas < 1:
        raise DeployError(f"replicas must be at least 1, got {options.replicas}")
    if options.max_replicas < options.replicas:
        raise DeployError(f"max_replicas ({options.max_replicas}) must be at least replicas ({options.replicas})")
    if options.gpus < 0:
        raise DeployError(f"gpus must be >= 0 (0 = CPU), got {options.gpus}")
    if not 0 < options.target_utilization <= 1:
        raise DeployError(f"target_utilization must be in (0, 1], got {options.target_utilization}")
    for label, value in (
        ("drain_timeout_s", options.drain_timeout_s),
        ("exit_timeout_s", options.exit_timeout_s),
        ("pre_stop_s", options.pre_stop_s),
    ):
        if value < 0:
            raise DeployError(f"{label} must be >= 0, got {value}")
    if options.ready_timeout_s <= 0:
        raise DeployError(f"ready_timeout_s must be > 0, got {options.ready_timeout_s}")
    _check_source(options.source)
    for key, _ in options.monitor_labels:
        if not key:
            raise DeployError("a monitor label needs a key (KEY=VALUE)")


def _check_source(source: PvcSource | ExportSource) -> None:
    if isinstance(source, PvcSource):
        if not _DNS_SUBDOMAIN.match(source.claim) or len(source.claim) > 253:
            raise DeployError(f"claim {source.claim!r} must be a PersistentVolumeClaim name (a DNS subdomain)")
        if posixpath.isabs(source.sub_path) or ".." in source.sub_path.split("/"):
            raise DeployError(f"sub_path {source.sub_path!r} must be relative to the volume, without '..'")


def export_args(manifest: dict[str, Any], source: ExportSource, out: str = POD_EXPORT_DIR) -> list[str]:
    """The init container's ``specdec-export`` options: the given ones, else the manifest's command, out in the pod.

    A recorded ``--target``/``--draft`` that is a path of the machine that exported cannot be found in the pod,
    so it is refused here rather than failing in the cluster.
    """
    if source.args is not None:
        args = list(source.args)
    else:
        recorded = shlex.split(manifest.get("command", ""))
        if not recorded:
            raise DeployError("the export's manifest records no command: pass the export options explicitly")
        args = recorded[1:] if recorded[0].endswith("specdec-export") else recorded
        for flag in ("--target", "--draft"):
            value = _option(args, flag)
            if value is not None and ("/" in value or value.startswith(".")):
                raise DeployError(
                    f"the export was made from {flag} {value}, a path the pod does not have: pass "
                    "the export options explicitly (a preset), or serve the export from a claim"
                )
    cleaned: list[str] = []
    skip = False
    for arg in args:
        if skip:
            skip = False
        elif arg == "--out":
            skip = True
        elif not (arg.startswith("--out=") or arg == "--force"):
            cleaned.append(arg)
    return [*cleaned, "--out", out, "--force"]  # --force: a retried init container finds its own output


def _option(args: Sequence[str], flag: str) -> str | None:
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


def pod_labels(options: KubernetesOptions) -> dict[str, str]:
    return {"app.kubernetes.io/name": "specdec", "app.kubernetes.io/instance": options.name}


def meta(options: KubernetesOptions, name: str | None = None, **extra: Any) -> dict[str, Any]:
    return {"name": name or options.name, "namespace": options.namespace, "labels": pod_labels(options), **extra}


def serve_args(model_path: str, options: KubernetesOptions) -> list[str]:
    """``specdec serve``'s arguments in the pod: every interface, and the timeouts the probes and grace rely on."""
    return [
        model_path,
        "--host",
        "0.0.0.0",
        "--grpc-port",
        str(_SERVE.grpc_port),
        "--http-port",
        str(_SERVE.http_port),
        "--metrics-port",
        str(_SERVE.metrics_port),
        "--openai-port",
        str(_SERVE.openai_port),
        "--drain-timeout",
        f"{options.drain_timeout_s:g}",
        "--exit-timeout",
        str(options.exit_timeout_s),
        "--ready-timeout",
        f"{options.ready_timeout_s:g}",
    ]


#: every port ``specdec serve`` opens, by the name the container, the Service and the monitor give it
PORTS = (
    (GRPC_PORT, _SERVE.grpc_port),
    (HTTP_PORT, _SERVE.http_port),
    (METRICS_PORT, _SERVE.metrics_port),
    (OPENAI_PORT, _SERVE.openai_port),
)
#: the pod's readiness: the OpenAI frontend's, which is 200 only while Triton is ready (it asks Triton over gRPC),
#: the frontend answers, and no drain is under way (Triton's own stays 200 while ``specdec serve`` drains)
OPENAI_READINESS = (OPENAI_READY_PATH, OPENAI_PORT)


def probes(
    options: KubernetesOptions, http_port: str | int, readiness: tuple[str, str | int] | None = None
) -> dict[str, Any]:
    """Readiness on ``readiness`` (path, port; default Triton's ``READY_PATH`` on ``http_port``); startup and
    liveness on Triton's ``LIVE_PATH``, each allowing a whole cold load.

    Why liveness waits as long as a load: ``specdec serve`` supervises the server itself and restarts tritonserver
    when its engine dies (the ports close while the models load again); it exits, and so restarts the
    container, only when that fails, so liveness is there for a server that hangs, not for one that reloads.
    Past ``--ready-timeout`` ``specdec serve`` gives up by itself, so the probes allow one period more.
    """
    load = math.ceil(options.ready_timeout_s / PROBE_PERIOD_S) + 1
    ready_path, ready_port = readiness or (READY_PATH, http_port)
    return {
        "startupProbe": {
            "httpGet": {"path": LIVE_PATH, "port": http_port},
            "periodSeconds": PROBE_PERIOD_S,
            "failureThreshold": load,
        },
        "readinessProbe": {
            "httpGet": {"path": ready_path, "port": ready_port},
            "periodSeconds": 5,
            "failureThreshold": 2,
        },
        "livenessProbe": {
            "httpGet": {"path": LIVE_PATH, "port": http_port},
            "periodSeconds": PROBE_PERIOD_S,
            "failureThreshold": load,
        },
    }


def container_resources(options: KubernetesOptions) -> dict[str, dict[str, Any]]:
    resources: dict[str, dict[str, Any]] = {}
    if options.cpu:
        resources.setdefault("requests", {})["cpu"] = options.cpu
    if options.memory:  # memory is not compressible: the request is the limit, so the pod is never OOM-ranked
        resources.setdefault("requests", {})["memory"] = options.memory
        resources.setdefault("limits", {})["memory"] = options.memory
    if options.gpus:
        resources.setdefault("requests", {})[GPU_RESOURCE] = options.gpus
        resources.setdefault("limits", {})[GPU_RESOURCE] = options.gpus
    return resources


def server_container(
    options: KubernetesOptions,
    model_path: str,
    name: str,
    ports: Sequence[dict[str, Any]],
    http_port: str | int,
    readiness: tuple[str, str | int] | None = None,
) -> dict[str, Any]:
    container: dict[str, Any] = {
        "name": name,
        "image": options.image,
        "command": ["specdec", "serve"],
        "args": serve_args(model_path, options),
        "ports": list(ports),
        **probes(options, http_port, readiness),
        "lifecycle": {"preStop": {"exec": {"command": ["sleep", str(options.pre_stop_s)]}}},
        "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
    }
    resources = container_resources(options)
    if resources:
        container["resources"] = resources
    secrets = (
        (ADMIN_KEY_ENV, options.admin_key_secret, ADMIN_KEY_SECRET_KEY),
        (OPENAI_KEY_ENV, options.openai_key_secret, OPENAI_KEY_SECRET_KEY),
    )
    env = [
        {"name": var, "valueFrom": {"secretKeyRef": {"name": secret, "key": key}}}
        for var, secret, key in secrets
        if secret
    ]
    if env:
        container["env"] = env
    return container


def init_container(options: KubernetesOptions, manifest: dict[str, Any], mount: str) -> dict[str, Any]:
    """``specdec-export`` into the emptyDir mounted at ``mount`` (at its ``export`` folder)."""
    assert isinstance(options.source, ExportSource)
    out = POD_EXPORT_DIR.replace(MODELS_MOUNT, mount, 1)
    return {
        "name": "export",
        "image": options.source.image or options.image,
        "command": ["specdec-export"],
        "args": export_args(manifest, options.source, out),
        "volumeMounts": [{"name": "models", "mountPath": mount}],
        "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
    }


def pod_volumes(options: KubernetesOptions) -> list[dict[str, Any]]:
    """The models' volume (the claim, read-only, or the init container's emptyDir) and a memory-backed /dev/shm."""
    source = options.source
    models: dict[str, Any] = (
        {"persistentVolumeClaim": {"claimName": source.claim, "readOnly": True}}
        if isinstance(source, PvcSource)
        else {"emptyDir": {}}
    )
    shm = {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": options.shm_size}}
    return [{"name": "models", **models}, shm]


def gpu_tolerations(options: KubernetesOptions) -> dict[str, Any]:
    """GPU node pools are commonly tainted ``nvidia.com/gpu:NoSchedule``; a GPU pod tolerates that taint."""
    if not options.gpus:
        return {}
    return {"tolerations": [{"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}]}


def model_path(options: KubernetesOptions) -> str:
    """Where ``specdec serve`` finds the export in the plain route's pod."""
    if isinstance(options.source, PvcSource):
        return posixpath.join(MODELS_MOUNT, options.source.sub_path) if options.source.sub_path else MODELS_MOUNT
    return POD_EXPORT_DIR

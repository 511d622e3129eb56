"""Plain Kubernetes manifests for one export: ``specdec deploy kubernetes EXPORT_DIR --out DIR``.

What is rendered, and where it lands under ``--out``::

    deployment.yaml  service.yaml  poddisruptionbudget.yaml  servicemonitor.yaml  horizontalpodautoscaler.yaml
    kserve/servingruntime.yaml  kserve/inferenceservice.yaml      (the KServe alternative: apply one route, not both)
    prometheus-adapter/rules.yaml                                  (a rule for the adapter's config, not an object)

``kubectl apply -f DIR`` applies the plain route only (it does not descend into the two sub-folders).

Why the container runs ``specdec serve`` and not ``tritonserver``: only ``specdec serve`` drains (Triton counts
no in-flight work for the decoupled Python models and would unload ``postprocessing`` under open streams, see
``specdec.serving.control``) and only it notices a dead engine stub, which Triton reports ready until a request
fails. The Python-backend models import ``specdec`` either way, so the image must have specdec installed: the
default names the NGC Triton image of the release the repository targets (2.51), which an image built ``FROM``
it with ``pip install specdec-toolkit[serve]`` extends.

Every value that another part of the stack must agree with is taken from where it is defined: ports and the
drain, exit and ready timeouts from ``specdec serve``'s own option defaults (``add_serve_args``), the metric the
autoscaler reads from ``specdec.serving.control``, the entry models from ``specdec.serving.protocol``, the engine's
batch from the export's repository and manifest, the metrics path from ``TritonServer``. Only the names this
module introduces (port names, labels, mount points) and Triton's health endpoints are written here.
"""

from __future__ import annotations

import argparse
import math
import posixpath
import re
import shlex
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from specdec.models.manifest import FORMAT_VERSION, ExportDirError, read_manifest
from specdec.serving import protocol
from specdec.serving.control import INFLIGHT_METRIC
from specdec.serving.install import TritonError
from specdec.serving.repository import REPOSITORY_DIR, read_parameters
from specdec.serving.serve import add_serve_args
from specdec.serving.server import LIVE_PATH, READY_PATH, TritonServer, validate_repository

#: the NGC release of tritonserver 2.51, the server the repository's models are written and tested against
TRITON_TAG = "24.10"
DEFAULT_IMAGE = f"nvcr.io/nvidia/tritonserver:{TRITON_TAG}-py3"
#: Triton's health endpoints (KServe v2 protocol): ready = every model loaded; live = the process answers
#: container and Service port names: ``grpc`` lets a mesh (Istio, Linkerd) pick HTTP/2 by name, ``metrics`` is what
#: the ServiceMonitor scrapes
GRPC_PORT, HTTP_PORT, METRICS_PORT = "grpc", "http", "metrics"
#: the Service's appProtocol of each port (``kubernetes.io/h2c``: gRPC is HTTP/2 in cleartext here)
APP_PROTOCOL = {GRPC_PORT: "kubernetes.io/h2c", HTTP_PORT: "http", METRICS_PORT: "http"}
MODELS_MOUNT = "/models"
#: where the init container exports inside the emptyDir (``specdec-export`` renames its partial directory into
#: place, which a mount point itself does not allow)
POD_EXPORT_DIR = f"{MODELS_MOUNT}/export"
#: KServe's storage initializer unpacks ``storageUri`` here
KSERVE_MODELS_MOUNT = "/mnt/models"
GPU_RESOURCE = "nvidia.com/gpu"
ADMIN_KEY_ENV, ADMIN_KEY_SECRET_KEY = "SPECDEC_ADMIN_KEY", "admin-key"
PROBE_PERIOD_S = 10
#: seconds the grace period keeps beyond preStop + drain + Triton's exit: the abort's settle (5 s in
#: ``TritonServer.drain``) and the cleanup of the stubs' shared memory
GRACE_MARGIN_S = 10
#: the Python-backend stubs exchange tensors through /dev/shm, which a container gets only 64 MiB of by default
DEFAULT_SHM_SIZE = "1Gi"
KSERVE_FORMAT = "specdec"  # the model format the ServingRuntime declares (an export of this version)
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
    monitor_labels: tuple[tuple[str, str], ...] = ()  # e.g. (("release", "prometheus"),) for kube-prometheus-stack
    scrape_interval: str = "15s"


@dataclass(frozen=True)
class Rendered:
    """The objects of one rendering: the plain route, the KServe route, and the Prometheus adapter's rule."""

    workload: list[dict[str, Any]]
    kserve: list[dict[str, Any]]
    adapter_rules: dict[str, Any]


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


def engine_batch(export_dir: Path) -> int:
    """Sequences the served engine decodes together: the repository's ``max_batch``, else the export's KV slots."""
    configured = int(read_parameters(export_dir / REPOSITORY_DIR).get("max_batch") or 0)
    return configured or int(read_manifest(export_dir, verify=False)["max_batch"])


def inflight_target(export_dir: Path, options: KubernetesOptions) -> int:
    """The in-flight requests per pod the autoscaler aims at: ``target_utilization`` of the engine's batch.

    Why in-flight requests (``specdec_inflight_requests``) and not the KV-slot queue (``specdec_queued_requests``):
    the HPA sizes a deployment as current replicas x metric / target, which is right only for a metric that grows
    in proportion to the load. In-flight requests do (arrival rate x latency), from the first request on; the
    queue stays 0 until every KV slot is taken and then grows without bound, so it would scale only once
    requests already wait, and could not say by how much. A target below the batch leaves the head-room for a
    burst while new pods load their models.
    """
    return max(1, math.floor(options.target_utilization * engine_batch(export_dir)))


def _check_export(export_dir: Path) -> dict[str, Any]:
    try:
        repo = validate_repository(export_dir)
        if repo.resolve() != (export_dir / REPOSITORY_DIR).resolve():
            raise DeployError(f"{export_dir} is a bare repository: pass the export directory that holds it")
        manifest = read_manifest(export_dir, verify=False)
    except (TritonError, ExportDirError, FileNotFoundError) as exc:
        raise DeployError(f"{export_dir} is not a specdec export with its Triton repository: {exc}") from exc
    missing = [m for m in protocol.MODELS if not (repo / m / "config.pbtxt").is_file()]
    if missing:
        raise DeployError(f"the repository of {export_dir} lacks model(s) {', '.join(missing)}")
    return manifest


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


def _labels(options: KubernetesOptions) -> dict[str, str]:
    return {"app.kubernetes.io/name": "specdec", "app.kubernetes.io/instance": options.name}


def _meta(options: KubernetesOptions, name: str | None = None, **extra: Any) -> dict[str, Any]:
    return {"name": name or options.name, "namespace": options.namespace, "labels": _labels(options), **extra}


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
        "--drain-timeout",
        f"{options.drain_timeout_s:g}",
        "--exit-timeout",
        str(options.exit_timeout_s),
        "--ready-timeout",
        f"{options.ready_timeout_s:g}",
    ]


#: every port ``specdec serve`` opens, by the name the container, the Service and the monitor give it
PORTS = ((GRPC_PORT, _SERVE.grpc_port), (HTTP_PORT, _SERVE.http_port), (METRICS_PORT, _SERVE.metrics_port))


def _probes(options: KubernetesOptions, http_port: str | int) -> dict[str, Any]:
    """Readiness on ``READY_PATH``; startup and liveness on ``LIVE_PATH``, each allowing a whole cold load.

    Why liveness waits as long as a load: ``specdec serve`` supervises the server itself and restarts tritonserver
    when its engine dies (the ports close while the models load again); it exits, and so restarts the
    container, only when that fails, so liveness is there for a server that hangs, not for one that reloads.
    Past ``--ready-timeout`` ``specdec serve`` gives up by itself, so the probes allow one period more.
    """
    load = math.ceil(options.ready_timeout_s / PROBE_PERIOD_S) + 1
    return {
        "startupProbe": {
            "httpGet": {"path": LIVE_PATH, "port": http_port},
            "periodSeconds": PROBE_PERIOD_S,
            "failureThreshold": load,
        },
        "readinessProbe": {
            "httpGet": {"path": READY_PATH, "port": http_port},
            "periodSeconds": 5,
            "failureThreshold": 2,
        },
        "livenessProbe": {
            "httpGet": {"path": LIVE_PATH, "port": http_port},
            "periodSeconds": PROBE_PERIOD_S,
            "failureThreshold": load,
        },
    }


def _resources(options: KubernetesOptions) -> dict[str, dict[str, Any]]:
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


def _server_container(
    options: KubernetesOptions, model_path: str, name: str, ports: Sequence[dict[str, Any]], http_port: str | int
) -> dict[str, Any]:
    container: dict[str, Any] = {
        "name": name,
        "image": options.image,
        "command": ["specdec", "serve"],
        "args": serve_args(model_path, options),
        "ports": list(ports),
        **_probes(options, http_port),
        "lifecycle": {"preStop": {"exec": {"command": ["sleep", str(options.pre_stop_s)]}}},
        "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
    }
    resources = _resources(options)
    if resources:
        container["resources"] = resources
    if options.admin_key_secret:
        container["env"] = [
            {
                "name": ADMIN_KEY_ENV,
                "valueFrom": {"secretKeyRef": {"name": options.admin_key_secret, "key": ADMIN_KEY_SECRET_KEY}},
            }
        ]
    return container


def _init_container(options: KubernetesOptions, manifest: dict[str, Any], mount: str) -> dict[str, Any]:
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


def _pod_volumes(options: KubernetesOptions) -> list[dict[str, Any]]:
    """The models' volume (the claim, read-only, or the init container's emptyDir) and a memory-backed /dev/shm."""
    source = options.source
    models: dict[str, Any] = (
        {"persistentVolumeClaim": {"claimName": source.claim, "readOnly": True}}
        if isinstance(source, PvcSource)
        else {"emptyDir": {}}
    )
    shm = {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": options.shm_size}}
    return [{"name": "models", **models}, shm]


def _gpu_tolerations(options: KubernetesOptions) -> dict[str, Any]:
    """GPU node pools are commonly tainted ``nvidia.com/gpu:NoSchedule``; a GPU pod tolerates that taint."""
    if not options.gpus:
        return {}
    return {"tolerations": [{"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}]}


def model_path(options: KubernetesOptions) -> str:
    """Where ``specdec serve`` finds the export in the plain route's pod."""
    if isinstance(options.source, PvcSource):
        return posixpath.join(MODELS_MOUNT, options.source.sub_path) if options.source.sub_path else MODELS_MOUNT
    return POD_EXPORT_DIR


def deployment(options: KubernetesOptions, manifest: dict[str, Any]) -> dict[str, Any]:
    """The server pods. Rolling updates add a pod before one drains (``maxUnavailable: 0``): no capacity dip."""
    ports = [{"name": port, "containerPort": number, "protocol": "TCP"} for port, number in PORTS]
    container = _server_container(options, model_path(options), "specdec", ports, HTTP_PORT)
    models = {"name": "models", "mountPath": MODELS_MOUNT}
    container["volumeMounts"] = [
        {**models, "readOnly": True} if isinstance(options.source, PvcSource) else models,
        {"name": "dshm", "mountPath": "/dev/shm"},
    ]
    pod: dict[str, Any] = {
        "terminationGracePeriodSeconds": grace_period_s(options),
        "containers": [container],
        "volumes": _pod_volumes(options),
        **_gpu_tolerations(options),
    }
    if isinstance(options.source, ExportSource):
        pod["initContainers"] = [_init_container(options, manifest, MODELS_MOUNT)]
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _meta(options),
        "spec": {
            "replicas": options.replicas,
            "selector": {"matchLabels": _labels(options)},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            "template": {"metadata": {"labels": _labels(options)}, "spec": pod},
        },
    }


def service(options: KubernetesOptions) -> dict[str, Any]:
    """One ClusterIP Service over the three ports, each named and with its appProtocol.

    gRPC holds one HTTP/2 connection per client, which kube-proxy balances once, at connect: spreading the
    calls over pods needs a gRPC-aware balancer (a mesh, or Gateway API's GRPCRoute), which reads the name or
    the appProtocol of the ``grpc`` port.
    """
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(options),
        "spec": {
            "type": "ClusterIP",
            "selector": _labels(options),
            "ports": [
                {"name": port, "port": number, "targetPort": port, "protocol": "TCP", "appProtocol": APP_PROTOCOL[port]}
                for port, number in PORTS
            ],
        },
    }


def pod_disruption_budget(options: KubernetesOptions) -> dict[str, Any]:
    """At most one pod evicted at a time (each drains first); ``maxUnavailable`` so a single replica can still move."""
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _meta(options),
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": _labels(options)}},
    }


def service_monitor(options: KubernetesOptions) -> dict[str, Any]:
    """Prometheus (the operator's) scrapes every pod behind the Service on its ``metrics`` port."""
    labels = {**_labels(options), **dict(options.monitor_labels)}
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "ServiceMonitor",
        "metadata": {"name": options.name, "namespace": options.namespace, "labels": labels},
        "spec": {
            "selector": {"matchLabels": _labels(options)},
            "namespaceSelector": {"matchNames": [options.namespace]},
            "endpoints": [{"port": METRICS_PORT, "path": METRICS_PATH, "interval": options.scrape_interval}],
        },
    }


def horizontal_pod_autoscaler(options: KubernetesOptions, target: int) -> dict[str, Any]:
    """Scale on the in-flight requests per pod (``inflight_target`` says why); scale down one pod per grace period.

    Removing a pod drains it for up to the grace period, so dropping faster than one per grace period would
    take away capacity that is still answering requests.
    """
    return {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": _meta(options),
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": options.name},
            "minReplicas": options.replicas,
            "maxReplicas": options.max_replicas,
            "metrics": [
                {
                    "type": "Pods",
                    "pods": {
                        "metric": {"name": INFLIGHT_METRIC},
                        "target": {"type": "AverageValue", "averageValue": str(target)},
                    },
                }
            ],
            "behavior": {
                "scaleUp": {"stabilizationWindowSeconds": 0},
                "scaleDown": {
                    "stabilizationWindowSeconds": 300,
                    "policies": [{"type": "Pods", "value": 1, "periodSeconds": min(1800, grace_period_s(options))}],
                },
            },
        },
    }


def adapter_rules() -> dict[str, Any]:
    """The Prometheus adapter rule that serves ``INFLIGHT_METRIC`` per pod to the HPA (the sum over entry models).

    Both entry points report the gauge with their own ``model`` label; a pod's load is their sum.
    """
    return {
        "rules": [
            {
                "seriesQuery": f'{INFLIGHT_METRIC}{{namespace!="",pod!=""}}',
                "resources": {"overrides": {"namespace": {"resource": "namespace"}, "pod": {"resource": "pod"}}},
                "name": {"matches": f"^{INFLIGHT_METRIC}$", "as": INFLIGHT_METRIC},
                "metricsQuery": "sum(<<.Series>>{<<.LabelMatchers>>}) by (<<.GroupBy>>)",
            }
        ]
    }


def serving_runtime(options: KubernetesOptions, mount: str) -> dict[str, Any]:
    """KServe's runtime: the same ``specdec serve`` container, on the one HTTP port a Knative service may expose.

    Knative routes a single port (named ``http1`` for HTTP/1, ``h2c`` for HTTP/2); HTTP serves the unary
    ``specdec`` model. gRPC streaming (``specdec_stream``) needs the plain route, or KServe's RawDeployment mode.
    """
    ports = [{"name": "http1", "containerPort": _SERVE.http_port, "protocol": "TCP"}]
    container = _server_container(options, mount, "kserve-container", ports, _SERVE.http_port)
    container.pop("resources", None)  # the InferenceService's model spec sizes the container
    container["volumeMounts"] = [{"name": "dshm", "mountPath": "/dev/shm"}]
    return {
        "apiVersion": "serving.kserve.io/v1alpha1",
        "kind": "ServingRuntime",
        "metadata": _meta(options, f"{options.name}-runtime"),
        "spec": {
            "annotations": {
                "prometheus.kserve.io/port": str(_SERVE.metrics_port),
                "prometheus.kserve.io/path": METRICS_PATH,
            },
            "supportedModelFormats": [{"name": KSERVE_FORMAT, "version": str(FORMAT_VERSION), "autoSelect": True}],
            "protocolVersions": ["v2"],
            "multiModel": False,
            "containers": [container],
            "volumes": [v for v in _pod_volumes(options) if v["name"] == "dshm"],
        },
    }


def inference_service(options: KubernetesOptions, manifest: dict[str, Any], target: int) -> dict[str, Any]:
    """KServe's InferenceService of the export; its annotation names the models clients call.

    Storage: a claim becomes ``storageUri: pvc://CLAIM/SUB_PATH`` (KServe mounts it at /mnt/models); the
    in-pod export becomes the predictor's init container writing to an emptyDir mounted there. Concurrency
    scaling aims at the same in-flight requests per pod as the HPA.
    """
    model: dict[str, Any] = {
        "modelFormat": {"name": KSERVE_FORMAT, "version": str(FORMAT_VERSION)},
        "runtime": f"{options.name}-runtime",
        "protocolVersion": "v2",
    }
    resources = _resources(options)
    if resources:
        model["resources"] = resources
    predictor: dict[str, Any] = {
        "minReplicas": options.replicas,
        "maxReplicas": options.max_replicas,
        "scaleMetric": "concurrency",
        "scaleTarget": target,
        "terminationGracePeriodSeconds": grace_period_s(options),
        **_gpu_tolerations(options),
    }
    source = options.source
    if isinstance(source, PvcSource):
        model["storageUri"] = f"pvc://{source.claim}" + (f"/{source.sub_path}" if source.sub_path else "")
    else:
        model["volumeMounts"] = [{"name": "models", "mountPath": KSERVE_MODELS_MOUNT}]
        predictor["volumes"] = [{"name": "models", "emptyDir": {}}]
        predictor["initContainers"] = [_init_container(options, manifest, KSERVE_MODELS_MOUNT)]
    predictor["model"] = model
    entry = f"{protocol.UNARY_MODEL},{protocol.STREAM_MODEL}"
    return {
        "apiVersion": "serving.kserve.io/v1beta1",
        "kind": "InferenceService",
        "metadata": _meta(options, annotations={"specdec/entry-models": entry}),
        "spec": {"predictor": predictor},
    }


def kserve_model_path(options: KubernetesOptions) -> str:
    """Where the KServe runtime's ``specdec serve`` finds the export (storage initializer or init container)."""
    return (
        KSERVE_MODELS_MOUNT
        if isinstance(options.source, PvcSource)
        else POD_EXPORT_DIR.replace(MODELS_MOUNT, KSERVE_MODELS_MOUNT, 1)
    )


def render(export_dir: str | Path, options: KubernetesOptions | None = None) -> Rendered:
    """Every object of the deployment of ``export_dir`` (an export with its ``triton_repo``), checked first.

    The export is read here (its repository's models, its engine batch, its recorded export command), not
    copied: the cluster gets it from the claim or makes it again in the init container.
    """
    options = options or KubernetesOptions()
    check_options(options)
    export = Path(export_dir)
    manifest = _check_export(export)
    target = inflight_target(export, options)
    workload = [
        deployment(options, manifest),
        service(options),
        pod_disruption_budget(options),
        service_monitor(options),
        horizontal_pod_autoscaler(options, target),
    ]
    kserve = [serving_runtime(options, kserve_model_path(options)), inference_service(options, manifest, target)]
    return Rendered(workload, kserve, adapter_rules())

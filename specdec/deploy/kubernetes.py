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

The pod's container, probes and volumes are ``specdec.deploy.kubernetes_pod``'s (shared with the KServe route,
``specdec.deploy.kserve``). Every value that another part of the stack must agree with is taken from where it is
defined: ports and the drain, exit and ready timeouts from ``specdec serve``'s own option defaults
(``add_serve_args``), the metric the autoscaler reads from ``specdec.serving.control``, the entry models from
``specdec.serving.protocol``, the engine's batch from the export's repository and manifest, the health paths from
``specdec.serving.server`` (Triton's) and ``specdec.serving.openai.process`` (the OpenAI frontend's), the metrics
path from ``TritonServer``. Only the names these modules introduce (port names, labels, mount points) are written
here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specdec.deploy.kserve import KSERVE_MODELS_MOUNT, inference_service, kserve_model_path, serving_runtime
from specdec.deploy.kubernetes_pod import (
    APP_PROTOCOL,
    HTTP_PORT,
    LIVE_PATH,
    METRICS_PATH,
    METRICS_PORT,
    MODELS_MOUNT,
    OPENAI_PORT,
    OPENAI_READINESS,
    POD_EXPORT_DIR,
    PORTS,
    READY_PATH,
    DeployError,
    ExportSource,
    KubernetesOptions,
    PvcSource,
    check_options,
    export_args,
    gpu_tolerations,
    grace_period_s,
    init_container,
    meta,
    model_path,
    pod_labels,
    pod_volumes,
    server_container,
)
from specdec.models.manifest import ExportDirError, read_manifest
from specdec.serving import protocol
from specdec.serving.control import INFLIGHT_METRIC
from specdec.serving.install import TritonError
from specdec.serving.repository import REPOSITORY_DIR, read_parameters, validate_repository

#: what the tests and the CLI read from here, defined in the pod and KServe modules
__all__ = [
    "KSERVE_MODELS_MOUNT",
    "LIVE_PATH",
    "METRICS_PATH",
    "MODELS_MOUNT",
    "OPENAI_PORT",
    "POD_EXPORT_DIR",
    "READY_PATH",
    "DeployError",
    "ExportSource",
    "KubernetesOptions",
    "PvcSource",
    "Rendered",
    "export_args",
    "render",
]


@dataclass(frozen=True)
class Rendered:
    """The objects of one rendering: the plain route, the KServe route, and the Prometheus adapter's rule."""

    workload: list[dict[str, Any]]
    kserve: list[dict[str, Any]]
    adapter_rules: dict[str, Any]


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


def deployment(options: KubernetesOptions, manifest: dict[str, Any]) -> dict[str, Any]:
    """The server pods. Rolling updates add a pod before one drains (``maxUnavailable: 0``): no capacity dip."""
    ports = [{"name": port, "containerPort": number, "protocol": "TCP"} for port, number in PORTS]
    container = server_container(options, model_path(options), "specdec", ports, HTTP_PORT, OPENAI_READINESS)
    models = {"name": "models", "mountPath": MODELS_MOUNT}
    container["volumeMounts"] = [
        {**models, "readOnly": True} if isinstance(options.source, PvcSource) else models,
        {"name": "dshm", "mountPath": "/dev/shm"},
    ]
    pod: dict[str, Any] = {
        "terminationGracePeriodSeconds": grace_period_s(options),
        "containers": [container],
        "volumes": pod_volumes(options),
        **gpu_tolerations(options),
    }
    if isinstance(options.source, ExportSource):
        pod["initContainers"] = [init_container(options, manifest, MODELS_MOUNT)]
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": meta(options),
        "spec": {
            "replicas": options.replicas,
            "selector": {"matchLabels": pod_labels(options)},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            "template": {"metadata": {"labels": pod_labels(options)}, "spec": pod},
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
        "metadata": meta(options),
        "spec": {
            "type": "ClusterIP",
            "selector": pod_labels(options),
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
        "metadata": meta(options),
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": pod_labels(options)}},
    }


def service_monitor(options: KubernetesOptions) -> dict[str, Any]:
    """Prometheus (the operator's) scrapes every pod behind the Service on its ``metrics`` port."""
    labels = {**pod_labels(options), **dict(options.monitor_labels)}
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "ServiceMonitor",
        "metadata": {"name": options.name, "namespace": options.namespace, "labels": labels},
        "spec": {
            "selector": {"matchLabels": pod_labels(options)},
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
        "metadata": meta(options),
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

"""The KServe route of a specdec deployment: a ServingRuntime running ``specdec serve`` and an InferenceService.

The alternative to the plain Deployment (``specdec.deploy.kubernetes``): apply one route, not both.
"""

from __future__ import annotations

from typing import Any

from specdec.deploy.kubernetes_pod import (
    _SERVE,
    METRICS_PATH,
    MODELS_MOUNT,
    POD_EXPORT_DIR,
    KubernetesOptions,
    PvcSource,
    container_resources,
    gpu_tolerations,
    grace_period_s,
    init_container,
    meta,
    pod_volumes,
    server_container,
)
from specdec.models.manifest import FORMAT_VERSION
from specdec.serving import protocol

#: KServe's storage initializer unpacks ``storageUri`` here
KSERVE_MODELS_MOUNT = "/mnt/models"
KSERVE_FORMAT = "specdec"  # the model format the ServingRuntime declares (an export of this version)


def serving_runtime(options: KubernetesOptions, mount: str) -> dict[str, Any]:
    """KServe's runtime: the same ``specdec serve`` container, on the one HTTP port a Knative service may expose.

    Knative routes a single port (named ``http1`` for HTTP/1, ``h2c`` for HTTP/2); HTTP serves the unary
    ``specdec`` model. gRPC streaming (``specdec_stream``) needs the plain route, or KServe's RawDeployment mode.
    """
    ports = [{"name": "http1", "containerPort": _SERVE.http_port, "protocol": "TCP"}]
    container = server_container(options, mount, "kserve-container", ports, _SERVE.http_port)
    container.pop("resources", None)  # the InferenceService's model spec sizes the container
    container["volumeMounts"] = [{"name": "dshm", "mountPath": "/dev/shm"}]
    return {
        "apiVersion": "serving.kserve.io/v1alpha1",
        "kind": "ServingRuntime",
        "metadata": meta(options, f"{options.name}-runtime"),
        "spec": {
            "annotations": {
                "prometheus.kserve.io/port": str(_SERVE.metrics_port),
                "prometheus.kserve.io/path": METRICS_PATH,
            },
            "supportedModelFormats": [{"name": KSERVE_FORMAT, "version": str(FORMAT_VERSION), "autoSelect": True}],
            "protocolVersions": ["v2"],
            "multiModel": False,
            "containers": [container],
            "volumes": [v for v in pod_volumes(options) if v["name"] == "dshm"],
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
    resources = container_resources(options)
    if resources:
        model["resources"] = resources
    predictor: dict[str, Any] = {
        "minReplicas": options.replicas,
        "maxReplicas": options.max_replicas,
        "scaleMetric": "concurrency",
        "scaleTarget": target,
        "terminationGracePeriodSeconds": grace_period_s(options),
        **gpu_tolerations(options),
    }
    source = options.source
    if isinstance(source, PvcSource):
        model["storageUri"] = f"pvc://{source.claim}" + (f"/{source.sub_path}" if source.sub_path else "")
    else:
        model["volumeMounts"] = [{"name": "models", "mountPath": KSERVE_MODELS_MOUNT}]
        predictor["volumes"] = [{"name": "models", "emptyDir": {}}]
        predictor["initContainers"] = [init_container(options, manifest, KSERVE_MODELS_MOUNT)]
    predictor["model"] = model
    entry = f"{protocol.UNARY_MODEL},{protocol.STREAM_MODEL}"
    return {
        "apiVersion": "serving.kserve.io/v1beta1",
        "kind": "InferenceService",
        "metadata": meta(options, annotations={"specdec/entry-models": entry}),
        "spec": {"predictor": predictor},
    }


def kserve_model_path(options: KubernetesOptions) -> str:
    """Where the KServe runtime's ``specdec serve`` finds the export (storage initializer or init container)."""
    return (
        KSERVE_MODELS_MOUNT
        if isinstance(options.source, PvcSource)
        else POD_EXPORT_DIR.replace(MODELS_MOUNT, KSERVE_MODELS_MOUNT, 1)
    )

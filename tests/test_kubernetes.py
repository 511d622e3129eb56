"""``specdec deploy kubernetes``: every rendered object validated offline, and the values that must agree agree.

Validators (nothing is downloaded: both run from files on this machine):

* Deployment, Service, PodDisruptionBudget, HorizontalPodAutoscaler: ``kubernetes-validate`` (its bundled
  JSON schemas of the Kubernetes API, strict: an unknown field is an error), against the oldest and the newest
  Kubernetes release it ships.
* ServiceMonitor, ServingRuntime, InferenceService: ``jsonschema`` against the ``openAPIV3Schema`` of the
  official CRDs (``tests/data/crd_schemas``, README there), made strict the way the API server's field
  validation is: an object schema with properties and no ``x-kubernetes-preserve-unknown-fields`` admits no
  other field. Their ``metadata`` (which a CRD schema leaves open) is checked against the core ObjectMeta.
  The CRDs' CEL rules (``x-kubernetes-validations``) are not evaluated.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any, ClassVar

import jsonschema
import kubernetes_validate
import pytest
import yaml
from kubernetes_validate.utils import all_versions

from specdec.cli import main
from specdec.deploy import kubernetes as k8s
from specdec.deploy.kubernetes import DeployError, ExportSource, KubernetesOptions, PvcSource, render
from specdec.deploy.kubernetes_cli import kubernetes_main
from specdec.export.cli import main as export_main
from specdec.models.manifest import read_manifest
from specdec.serving import control, pb, protocol, triton_metrics
from specdec.serving.openai.process import API_KEY_ENV
from specdec.serving.openai.process import READY_PATH as OPENAI_READY_PATH
from specdec.serving.serve import add_serve_args
from specdec.serving.server import TritonServer

CRD_DIR = Path(__file__).parent / "data" / "crd_schemas"
K8S_VERSIONS = (all_versions()[0], all_versions()[-1])
OPTIONS = {
    "in-pod export, CPU": KubernetesOptions(),
    "claim, GPU": KubernetesOptions(
        name="smol",
        namespace="llm",
        replicas=2,
        max_replicas=6,
        gpus=1,
        source=PvcSource("models", "exports/smol"),
        cpu="4",
        memory="8Gi",
        admin_key_secret="specdec-admin",
        openai_key_secret="specdec-openai",
        monitor_labels=(("release", "prometheus"),),
    ),
}


@pytest.fixture(scope="module")
def export(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real export of a tiny random model made from a preset (so the in-pod export can repeat its command)."""
    out = tmp_path_factory.mktemp("k8s") / "export"
    argv = [
        "--target",
        "tiny-random:seed=3,num_layers=1",
        "--out",
        str(out),
        "--backend",
        "torch",
        "--max-batch",
        "8",
        "--max-len",
        "64",
    ]
    assert export_main(argv) == 0  # the manifest records this argv, as the in-pod export repeats it
    return out


def _strict(node: Any) -> Any:
    """A CRD schema with the API server's strict field validation: no field its schema does not name."""
    if isinstance(node, list):
        return [_strict(v) for v in node]
    if not isinstance(node, dict):
        return node
    node = {k: _strict(v) for k, v in node.items()}
    if (
        node.get("type") == "object"
        and "properties" in node
        and "additionalProperties" not in node
        and not node.get("x-kubernetes-preserve-unknown-fields")
    ):
        node["additionalProperties"] = False
    return node


def _crd_validators() -> dict[tuple[str, str], jsonschema.Draft4Validator]:
    """(apiVersion, kind) -> a validator of its CRD's schema (OpenAPI v3.0 schemas are draft-4 JSON Schema)."""
    found = {}
    for path in sorted(CRD_DIR.glob("*.json")):
        crd = json.loads(path.read_text())
        found[(f"{crd['group']}/{crd['version']}", crd["kind"])] = jsonschema.Draft4Validator(
            _strict(crd["openAPIV3Schema"])
        )
    return found


CRDS = _crd_validators()


def validate(obj: dict[str, Any]) -> str:
    """Validate one object by whichever validator owns its kind; returns which one (an unknown kind fails)."""
    key = (obj["apiVersion"], obj["kind"])
    if key in CRDS:
        CRDS[key].validate(obj)
        kubernetes_validate.validate(
            {"apiVersion": "v1", "kind": "ConfigMap", "metadata": obj["metadata"]}, K8S_VERSIONS[-1], strict=True
        )
        return "crd"
    for version in K8S_VERSIONS:
        kubernetes_validate.validate(obj, version, strict=True)  # SchemaNotFoundError for a kind it lacks
    return "core"


def _objects(export: Path, options: KubernetesOptions) -> dict[str, dict[str, Any]]:
    rendered = render(export, options)
    return {o["kind"]: o for o in [*rendered.workload, *rendered.kserve]}


@pytest.mark.parametrize("case", sorted(OPTIONS))
def test_every_object_validates_against_the_api_schemas(export: Path, case: str) -> None:
    objects = _objects(export, OPTIONS[case])
    owners = {kind: validate(obj) for kind, obj in objects.items()}
    assert owners == {
        "Deployment": "core",
        "Service": "core",
        "PodDisruptionBudget": "core",
        "HorizontalPodAutoscaler": "core",
        "ServiceMonitor": "crd",
        "ServingRuntime": "crd",
        "InferenceService": "crd",
    }


@pytest.mark.parametrize(
    ("kind", "path", "value"),
    [
        ("Deployment", ("spec", "replica"), 1),  # a typo of replicas
        ("Deployment", ("spec", "template", "spec", "containers", 0, "ports", 0, "containerPort"), "8001"),
        ("Service", ("spec", "ports", 0, "targetport"), "grpc"),
        ("ServiceMonitor", ("spec", "endpoints", 0, "prot"), "metrics"),
        ("ServingRuntime", ("spec", "containers", 0, "imagee"), "x"),
        ("InferenceService", ("spec", "predictor", "scaleMetric"), "tokens"),
        ("InferenceService", ("metadata", "labels"), ["not", "a", "map"]),
    ],
)
def test_the_validators_refuse_a_broken_object(export: Path, kind: str, path: tuple, value: object) -> None:
    """Negative control: each validator sees deep into its object (a container port, an endpoint, metadata)."""
    obj = _objects(export, OPTIONS["claim, GPU"])[kind]
    node = obj
    for step in path[:-1]:
        node = node[step]
    node[path[-1]] = value
    with pytest.raises(jsonschema.ValidationError):
        validate(obj)


def _container(objects: dict[str, dict[str, Any]]) -> dict[str, Any]:
    return objects["Deployment"]["spec"]["template"]["spec"]["containers"][0]


def test_ports_timeouts_and_grace_agree_with_specdec_serve(export: Path) -> None:
    options = OPTIONS["claim, GPU"]
    objects = _objects(export, options)
    container = _container(objects)
    assert container["command"] == ["specdec", "serve"]
    served = add_serve_args(argparse.ArgumentParser()).parse_args(container["args"])  # serve's own parser
    assert Path(served.model_repository) == Path(k8s.MODELS_MOUNT) / "exports/smol"
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {
        "grpc": served.grpc_port,
        "http": served.http_port,
        "metrics": served.metrics_port,
        "openai": served.openai_port,
    }
    assert not served.no_openai
    secrets = {e["name"]: e["valueFrom"]["secretKeyRef"]["name"] for e in container["env"]}
    assert secrets == {"SPECDEC_ADMIN_KEY": "specdec-admin", API_KEY_ENV: "specdec-openai"}
    defaults = add_serve_args(argparse.ArgumentParser()).parse_args(["repo"])
    assert (served.grpc_port, served.http_port, served.metrics_port, served.openai_port) == (
        defaults.grpc_port,
        defaults.http_port,
        defaults.metrics_port,
        defaults.openai_port,
    )
    service = {p["name"]: p for p in objects["Service"]["spec"]["ports"]}
    assert {name: (p["port"], p["targetPort"]) for name, p in service.items()} == {n: (v, n) for n, v in ports.items()}
    assert service["grpc"]["appProtocol"] == "kubernetes.io/h2c"
    assert objects["ServiceMonitor"]["spec"]["endpoints"][0]["port"] in service
    assert objects["ServiceMonitor"]["spec"]["selector"]["matchLabels"] == objects["Service"]["spec"]["selector"]
    pod = objects["Deployment"]["spec"]["template"]["spec"]
    pre_stop = int(container["lifecycle"]["preStop"]["exec"]["command"][-1])
    assert pod["terminationGracePeriodSeconds"] >= pre_stop + served.drain_timeout + served.exit_timeout + 5
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] > served.ready_timeout  # a cold load fits
    runtime = objects["ServingRuntime"]["spec"]["containers"][0]
    assert add_serve_args(argparse.ArgumentParser()).parse_args(runtime["args"]).drain_timeout == served.drain_timeout
    assert (
        objects["InferenceService"]["spec"]["predictor"]["terminationGracePeriodSeconds"]
        == pod["terminationGracePeriodSeconds"]
    )


def test_probe_paths_are_the_ones_specdec_serve_waits_on(export: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Startup and liveness ask Triton's live endpoint; the Deployment's readiness asks the OpenAI frontend's (ready
    only while Triton is, and not while draining), KServe's (one port) what ``TritonServer.is_ready`` asks."""
    asked = []

    def urlopen(url: str, timeout: float) -> None:
        asked.append(url)
        raise OSError("no server here")

    monkeypatch.setattr("urllib.request.urlopen", urlopen)
    server = TritonServer()
    assert not server.is_ready()
    objects = _objects(export, KubernetesOptions())
    container = _container(objects)
    assert container["readinessProbe"]["httpGet"] == {"path": OPENAI_READY_PATH, "port": "openai"}
    assert objects["ServingRuntime"]["spec"]["containers"][0]["readinessProbe"]["httpGet"] == {
        "path": k8s.READY_PATH,
        "port": server.http_port,
    }
    assert asked == [f"{server.http_url}{k8s.READY_PATH}"]
    assert container["livenessProbe"]["httpGet"]["path"] == k8s.LIVE_PATH == "/v2/health/live"
    assert server.metrics_url.endswith(k8s.METRICS_PATH)


class _Family:
    COUNTER, GAUGE = "counter", "gauge"
    made: ClassVar[list[str]] = []

    def __init__(self, name: str, description: str, kind: str) -> None:
        self.made.append(name)

    def Metric(self, labels: dict[str, str]) -> _Family:
        return self

    def set(self, value: float) -> None:
        pass


def test_the_autoscaler_reads_a_metric_the_entry_points_export(export: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pb, "utils", type("pb_utils", (), {"MetricFamily": _Family}))
    _Family.made.clear()
    triton_metrics.InflightGauge(protocol.STREAM_MODEL).set(3)
    rendered = render(export, KubernetesOptions())
    hpa = next(o for o in rendered.workload if o["kind"] == "HorizontalPodAutoscaler")
    metric = hpa["spec"]["metrics"][0]["pods"]
    assert _Family.made == [metric["metric"]["name"]]
    exposition = f'{metric["metric"]["name"]}{{model="specdec"}} 2\n{metric["metric"]["name"]}{{model="x"}} 3\n'
    assert control.inflight_from_metrics(exposition) == 5  # what the drain waits on is what the HPA reads
    assert rendered.adapter_rules["rules"][0]["name"]["as"] == metric["metric"]["name"]
    slots = read_manifest(export, verify=False)["max_batch"]
    assert metric["target"] == {"type": "AverageValue", "averageValue": str(math.floor(0.75 * slots))}
    isvc = rendered.kserve[1]["spec"]["predictor"]
    assert (isvc["scaleMetric"], isvc["scaleTarget"]) == ("concurrency", math.floor(0.75 * slots))


def test_kserve_objects_name_the_repository_and_each_other(export: Path) -> None:
    objects = _objects(export, OPTIONS["claim, GPU"])
    runtime, isvc = objects["ServingRuntime"], objects["InferenceService"]
    model = isvc["spec"]["predictor"]["model"]
    assert model["runtime"] == runtime["metadata"]["name"]
    assert model["modelFormat"] in [
        {k: f[k] for k in ("name", "version")} for f in runtime["spec"]["supportedModelFormats"]
    ]
    assert model["protocolVersion"] in runtime["spec"]["protocolVersions"]
    assert model["storageUri"] == "pvc://models/exports/smol"
    repository = {p.name for p in (export / "triton_repo").iterdir() if (p / "config.pbtxt").is_file()}
    entry = isvc["metadata"]["annotations"]["specdec/entry-models"].split(",")
    assert set(entry) <= repository and set(protocol.MODELS) == repository
    stream = (export / "triton_repo" / protocol.STREAM_MODEL / "config.pbtxt").read_text()
    assert entry == [protocol.UNARY_MODEL, protocol.STREAM_MODEL] and "decoupled: true" in stream
    assert runtime["spec"]["containers"][0]["args"][0] == k8s.KSERVE_MODELS_MOUNT


def test_the_init_container_repeats_the_export(export: Path) -> None:
    objects = _objects(export, KubernetesOptions())
    init = objects["Deployment"]["spec"]["template"]["spec"]["initContainers"][0]
    assert init["command"] == ["specdec-export"]
    assert init["args"][:2] == ["--target", "tiny-random:seed=3,num_layers=1"]
    assert init["args"][-3:] == ["--out", k8s.POD_EXPORT_DIR, "--force"] and init["args"].count("--out") == 1
    assert _container(objects)["args"][0] == k8s.POD_EXPORT_DIR
    kserve_init = objects["InferenceService"]["spec"]["predictor"]["initContainers"][0]
    assert kserve_init["args"][-3:-1] == ["--out", f"{k8s.KSERVE_MODELS_MOUNT}/export"]
    assert objects["ServingRuntime"]["spec"]["containers"][0]["args"][0] == f"{k8s.KSERVE_MODELS_MOUNT}/export"
    explicit = ExportSource(("--target", "smollm2-135m", "--out", "elsewhere"), image="registry/specdec:1")
    init = _objects(export, KubernetesOptions(source=explicit))["Deployment"]["spec"]["template"]["spec"][
        "initContainers"
    ][0]
    assert init["args"] == ["--target", "smollm2-135m", "--out", k8s.POD_EXPORT_DIR, "--force"]
    assert init["image"] == "registry/specdec:1"


def test_an_export_from_a_local_path_is_not_repeated_in_the_pod(export: Path) -> None:
    manifest = {"command": "specdec-export --target /home/me/model --out deploy"}
    with pytest.raises(DeployError, match="--target /home/me/model, a path the pod does not have"):
        k8s.export_args(manifest, ExportSource())
    assert k8s.export_args(manifest, ExportSource(("--target", "smollm2-135m"))) == [
        "--target",
        "smollm2-135m",
        "--out",
        k8s.POD_EXPORT_DIR,
        "--force",
    ]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (KubernetesOptions(name="Specdec"), "must be a DNS label"),
        (KubernetesOptions(name="x" * 60), "at most 55 characters"),
        (KubernetesOptions(namespace="my_ns"), "namespace 'my_ns'"),
        (KubernetesOptions(image="bad image"), "without spaces"),
        (KubernetesOptions(replicas=0), "replicas must be at least 1"),
        (KubernetesOptions(replicas=3, max_replicas=2), r"max_replicas \(2\) must be at least replicas \(3\)"),
        (KubernetesOptions(gpus=-1), "gpus must be >= 0"),
        (KubernetesOptions(target_utilization=1.5), r"target_utilization must be in \(0, 1\]"),
        (KubernetesOptions(drain_timeout_s=-1), "drain_timeout_s must be >= 0"),
        (KubernetesOptions(source=PvcSource("Models")), "PersistentVolumeClaim name"),
        (KubernetesOptions(source=PvcSource("models", "../etc")), "without '..'"),
    ],
)
def test_bad_options_are_refused_with_the_reason(export: Path, options: KubernetesOptions, message: str) -> None:
    with pytest.raises(DeployError, match=message):
        render(export, options)


def test_a_directory_that_is_not_an_export_is_refused(export: Path, tmp_path: Path) -> None:
    with pytest.raises(DeployError, match="is not a specdec export"):
        render(tmp_path)
    with pytest.raises(DeployError, match="bare repository"):
        render(export / "triton_repo")


def test_the_command_writes_one_file_per_object(
    export: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "manifests"
    assert (
        kubernetes_main(
            [
                str(export),
                "--out",
                str(out),
                "--pvc",
                "models:smol",
                "--gpus",
                "1",
                "--monitor-label",
                "release=prometheus",
            ]
        )
        == 0
    )
    written = sorted(str(p.relative_to(out)) for p in out.rglob("*.yaml"))
    assert written == [
        "deployment.yaml",
        "horizontalpodautoscaler.yaml",
        "kserve/inferenceservice.yaml",
        "kserve/servingruntime.yaml",
        "poddisruptionbudget.yaml",
        "prometheus-adapter/rules.yaml",
        "service.yaml",
        "servicemonitor.yaml",
    ]
    for path in out.rglob("*.yaml"):
        doc = yaml.safe_load(path.read_text())
        if "kind" in doc:
            validate(doc)
    deployment = yaml.safe_load((out / "deployment.yaml").read_text())
    assert deployment["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"] == {"nvidia.com/gpu": 1}
    assert kubernetes_main([str(export), "--out", str(out), "--pvc", "models", "--export-arg=--target"]) == 2
    assert "--export-arg and --export-image go with --export-in-pod" in capsys.readouterr().err
    assert kubernetes_main([str(tmp_path), "--out", str(out), "--export-in-pod"]) == 2
    assert "is not a specdec export" in capsys.readouterr().err
    assert main(["deploy", "kubernetes", str(export), "--out", str(tmp_path / "again"), "--export-in-pod"]) == 0
    assert (tmp_path / "again" / "deployment.yaml").is_file()

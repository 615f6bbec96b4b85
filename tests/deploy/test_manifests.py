"""Every object the chart renders is valid for the API that serves it: Kubernetes' own kinds
and pod templates against the schemas kubernetes-validate ships (strict: unknown fields
refused), the RayJob against KubeRay's CRD, the monitors against prometheus-operator's CRDs
(tests/deploy/schemas)."""

from __future__ import annotations

import copy
import json
import os

import jsonschema
import kubernetes_validate
import pytest

from tests.deploy.chart import needs_helm, render_list

pytestmark = needs_helm
SCHEMAS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "schemas")
CRDS = {("ray.io/v1", "RayJob"): "rayjob.json",
        ("monitoring.coreos.com/v1", "ServiceMonitor"): "servicemonitor.json",
        ("monitoring.coreos.com/v1", "PodMonitor"): "podmonitor.json"}
# The oldest Kubernetes the chart supports (Chart.yaml kubeVersion: gRPC probes are GA from
# 1.27) and the newest kubernetes-validate knows.
K8S_VERSIONS = ("1.27.0", kubernetes_validate.utils.latest_version())
SETTINGS = {
    "defaults": (),
    "everything on": ("serviceMonitor.enabled=true", "podMonitor.enabled=true",
                      "rayAuth.secretName=ray-token", "models.persistentVolumeClaim=weights",
                      "imagePullSecrets[0].name=registry", "config.prefill.replicas=2",
                      "gpuWorkers.replicas=2", "gpuWorkers.gpusPerPod=2",
                      "extraEnv[0].name=UCX_TLS", "extraEnv[0].value=tcp",
                      "networkPolicy.clients[0].podSelector.matchLabels.role=client"),
    "TLS, no HTTP, colocated": ("config.security.tls_cert=/c/tls.crt",
                                "config.security.tls_key=/c/tls.key", "router.httpPort=0",
                                "config.mode=colocated", "config.decode.device=cpu",
                                "config.decode.num_gpus=0", "rayAuth.mode=disabled"),
    "no probes, policy or metrics": ("router.probes.enabled=false", "networkPolicy.enabled=false",
                                     "job.submissionMode=K8sJobMode",
                                     "config.metrics.enabled=false"),
}


def closed(schema):
    """The CRD schema refusing fields it does not name, as `kubectl apply` (strict field
    validation) does, where it does not say otherwise."""
    schema = copy.deepcopy(schema)

    def walk(node):
        if isinstance(node, dict):
            if ("properties" in node and "additionalProperties" not in node
                    and not node.get("x-kubernetes-preserve-unknown-fields")):
                node["additionalProperties"] = False
            for key, value in node.items():
                if key != "enum":
                    walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(schema)
    return schema


def crd_validator(api_version: str, kind: str) -> jsonschema.Draft202012Validator:
    with open(os.path.join(SCHEMAS, CRDS[(api_version, kind)])) as f:
        schema = closed(json.load(f))
    schema["properties"]["metadata"] = {"type": "object"}  # checked as ObjectMeta below
    return jsonschema.Draft202012Validator(schema)


def pod_templates(obj: dict) -> list[dict]:
    """The pod templates inside a RayJob (the CRD files leave them to the Kubernetes schema)."""
    cluster = obj["spec"]["rayClusterSpec"]
    groups = [cluster["headGroupSpec"], *cluster.get("workerGroupSpecs", [])]
    return [g["template"] for g in groups]


def k8s_validate(obj: dict, version: str) -> None:
    kubernetes_validate.validate(obj, version, strict=True)


def as_k8s(kind: str, metadata: dict, **fields) -> dict:
    """A core v1 object around `fields`: how a custom object's metadata and pod templates
    are checked against the Kubernetes schema."""
    return {"apiVersion": "v1", "kind": kind, "metadata": metadata, **fields}


@pytest.mark.parametrize("name", list(SETTINGS))
def test_rendered_objects_validate(name):
    docs = render_list(*SETTINGS[name])
    kinds = set()
    for obj in docs:
        kinds.add(obj["kind"])
        key = (obj["apiVersion"], obj["kind"])
        for version in K8S_VERSIONS:
            if key in CRDS:
                k8s_validate(as_k8s("ConfigMap", obj["metadata"]), version)
                for tpl in pod_templates(obj) if obj["kind"] == "RayJob" else ():
                    k8s_validate(as_k8s("PodTemplate", obj["metadata"], template=tpl), version)
            else:
                k8s_validate(obj, version)
        if key in CRDS:
            errors = [f"{'/'.join(map(str, e.absolute_path))}: {e.message}"
                      for e in crd_validator(*key).iter_errors(obj)]
            assert not errors, (obj["kind"], errors)
    assert {"RayJob", "ConfigMap", "Service"} <= kinds


def test_the_validators_refuse_what_the_servers_would():
    """Negative controls: a misspelt RayJob field, a bad auth mode, a pod template field that
    does not exist, a monitor without its selector."""
    docs = {d["kind"]: d for d in render_list("serviceMonitor.enabled=true")}
    job = copy.deepcopy(docs["RayJob"])
    job["spec"]["rayClusterSpec"]["authOption"] = {"mode": "token"}
    assert not crd_validator("ray.io/v1", "RayJob").is_valid(job)
    job = copy.deepcopy(docs["RayJob"])
    job["spec"]["rayClusterSpec"]["authOptions"]["mode"] = "password"
    assert not crd_validator("ray.io/v1", "RayJob").is_valid(job)
    tpl = copy.deepcopy(pod_templates(docs["RayJob"])[0])
    tpl["spec"]["containers"][0]["readinessProbe"]["grpc"]["port"] = "grpc"  # must be a number
    with pytest.raises(kubernetes_validate.ValidationError):
        k8s_validate(as_k8s("PodTemplate", {"name": "x"}, template=tpl), K8S_VERSIONS[0])
    monitor = copy.deepcopy(docs["ServiceMonitor"])
    del monitor["spec"]["selector"]
    assert not crd_validator("monitoring.coreos.com/v1", "ServiceMonitor").is_valid(monitor)
    service = copy.deepcopy(docs["Service"])
    service["spec"]["ports"][0]["portt"] = 1
    with pytest.raises(kubernetes_validate.ValidationError):
        k8s_validate(service, K8S_VERSIONS[-1])

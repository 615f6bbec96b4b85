"""The Helm chart (deploy/helm/tandem) renders, lints, and hands the router a config that
`cluster.config` accepts; bad values and a config booking more GPUs than the workers have are
refused; probes, Ray auth, metrics ports, monitors, the NetworkPolicy and Triton's kernel cache
render as documented."""

from __future__ import annotations

import json
import os
from dataclasses import fields, is_dataclass
from typing import get_args, get_type_hints

import pytest
import yaml

import cluster.config as C
from cluster.config import load_config
from tests.deploy.chart import CHART, ROOT, helm, lint, needs_helm, render

pytestmark = needs_helm
# colocated mode as the chart can serve it: one engine on the head pod's CPUs
COLOCATED = ("config.mode=colocated", "config.decode.device=cpu", "config.decode.num_gpus=0")


def router_config(docs: dict[str, dict], tmp_path) -> object:
    path = tmp_path / "config.yaml"
    path.write_text(docs["ConfigMap"]["data"]["config.yaml"])
    return load_config(path)


def test_chart_lints():
    done = lint()
    assert done.returncode == 0, done.stdout + done.stderr


def test_default_render_serves_the_router_from_the_head(tmp_path):
    docs = render()
    assert set(docs) == {"ConfigMap", "Service", "RayJob", "NetworkPolicy"}
    cfg = router_config(docs, tmp_path)
    assert (cfg.router.host, cfg.router.port, cfg.ray_address) == ("0.0.0.0", 50051, "auto")
    assert cfg.router.http and cfg.router.http_port == 8000
    assert (cfg.metrics.host, cfg.metrics.port_base) == ("0.0.0.0", 9400)
    assert cfg.prefill.num_gpus == cfg.decode.num_gpus == 1 and cfg.mode == "disaggregated"

    job = docs["RayJob"]["spec"]
    assert job["entrypoint"] == "tandem serve --config /etc/tandem/config.yaml"
    assert job["shutdownAfterJobFinishes"] is False
    head = job["rayClusterSpec"]["headGroupSpec"]["template"]
    (container,) = head["spec"]["containers"]
    assert {"mountPath": "/etc/tandem", "name": "config", "readOnly": True} in \
        container["volumeMounts"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert (ports["grpc"], ports["http"], ports["metrics"]) == (50051, 8000, 9400)

    svc = docs["Service"]["spec"]
    assert svc["selector"].items() <= head["metadata"]["labels"].items()
    assert {p["name"]: (p["port"], p["targetPort"]) for p in svc["ports"]} == {
        "grpc": (50051, "grpc"), "http": (8000, "http"), "metrics": (9400, "metrics")}
    (workers,) = job["rayClusterSpec"]["workerGroupSpecs"]
    res = workers["template"]["spec"]["containers"][0]["resources"]
    assert res["limits"]["nvidia.com/gpu"] == res["requests"]["nvidia.com/gpu"] == 2
    assert workers["replicas"] == workers["minReplicas"] == workers["maxReplicas"] == 1
    assert workers["template"]["metadata"]["labels"]["app.kubernetes.io/component"] != "head"


def test_values_reach_the_config_and_the_pods(tmp_path):
    values = tmp_path / "values.yaml"
    values.write_text(yaml.safe_dump({
        "router": {"port": 7000},
        "gpuWorkers": {"replicas": 2, "gpusPerPod": 1},
        "models": {"persistentVolumeClaim": "weights"},
        "config": {"model": {"path": "/models/llama.gguf"},
                   "decode": {"replicas": 1, "num_gpus": 0.5},
                   "prefill": {"replicas": 2, "num_gpus": 0.5},
                   "transfer": {"ipc_across_gpus": True}},
    }))
    docs = render(values=str(values))
    cfg = router_config(docs, tmp_path)
    assert cfg.model.path == "/models/llama.gguf" and cfg.router.port == 7000
    assert cfg.prefill.replicas == 2 and cfg.transfer.ipc_across_gpus
    spec = docs["RayJob"]["spec"]["rayClusterSpec"]
    for tpl in (spec["headGroupSpec"]["template"], spec["workerGroupSpecs"][0]["template"]):
        mounts = tpl["spec"]["containers"][0]["volumeMounts"]
        assert {"mountPath": "/models", "name": "models", "readOnly": True} in mounts
        claims = [v["persistentVolumeClaim"]["claimName"] for v in tpl["spec"]["volumes"]
                  if "persistentVolumeClaim" in v]
        assert claims == ["weights"]
    assert docs["Service"]["spec"]["ports"][0]["port"] == 7000


def test_a_config_booking_more_gpus_than_the_workers_have_is_refused():
    done = helm("template", "demo", CHART, "--set", "config.decode.replicas=2")
    assert done.returncode != 0
    assert "config books 3 GPUs" in done.stderr and "have 2" in done.stderr
    # Colocated mode: one engine on the head pod, which has no GPU.
    done = helm("template", "demo", CHART, "--set", "config.mode=colocated")
    assert done.returncode != 0 and "on the head pod, which has no GPU" in done.stderr
    assert "RayJob" in render(*COLOCATED)


def test_a_metrics_port_base_without_room_for_the_node_actors_is_refused():
    """The server refuses metrics ports past 65535 at start; the chart refuses to render them."""
    done = helm("template", "demo", CHART, "--set", "metrics.portBase=65535")
    assert done.returncode != 0
    assert "metrics.portBase=65535 leaves no room" in done.stderr and "65536" in done.stderr
    assert "RayJob" in render("metrics.portBase=65533")  # prefill-0 and decode-0 fit


def test_the_image_matches_the_chart_and_copies_what_exists():
    """deploy/Dockerfile (not built here: no Docker) installs the Ray the chart names, and
    every path it copies exists, as do the sources the package needs."""
    text = open(os.path.join(ROOT, "deploy", "Dockerfile")).read()
    values = yaml.safe_load(open(os.path.join(CHART, "values.yaml")))
    assert f"ARG RAY_VERSION={values['rayVersion']}" in text
    copied = [line.split()[1] for line in text.splitlines() if line.startswith("COPY ")]
    assert copied and all(os.path.exists(os.path.join(ROOT, p)) for p in copied), copied
    import tomllib

    packages = tomllib.load(open(os.path.join(ROOT, "pyproject.toml"), "rb"))[
        "tool"]["setuptools"]["packages"]["find"]["include"]
    assert {p.rstrip("*") for p in packages} <= set(copied)


def test_the_images_command_serves_on_every_interface():
    """The Dockerfile's CMD: a valid config whose gRPC, HTTP and metrics ports listen beyond
    the container's loopback, on the ports it exposes."""
    import json

    from cluster.config import apply_overrides, load_config

    text = open(os.path.join(ROOT, "deploy", "Dockerfile")).read().replace("\\\n", " ")
    cmd = json.loads(next(line for line in text.splitlines() if line.startswith("CMD "))[4:])
    assert cmd[:2] == ["tandem", "serve"]
    args = dict(zip(cmd[2::2], cmd[3::2]))
    sets = [v for k, v in zip(cmd[2::2], cmd[3::2]) if k == "--set"]
    cfg = apply_overrides(load_config(args["--config"].replace("/opt/tandem/", ROOT + "/")), sets)
    assert args["--host"] == "0.0.0.0" and cfg.metrics.host == "0.0.0.0"
    exposed = {int(p) for line in text.splitlines() if line.startswith("EXPOSE ")
               for p in line.split()[1:]}
    ports = {cfg.router.port, cfg.router.http_port, *cfg.metrics_ports().values()}
    assert ports <= exposed, ports - exposed


@pytest.mark.parametrize("setting, message", [
    ("config.mode=nonsense", "config.mode must be one of"),
    ("router.port=-1", "router.port: Must be greater than or equal to 1"),
    ("router.httpPort=70000", "router.httpPort: Must be less than or equal to 65535"),
    ("router.port=abc", "router.port: Invalid type. Expected: integer, given: string"),
    ("config.decode.replicas=0", "config.decode.replicas: Must be greater than or equal to 1"),
    ("config.decode.replica=2", "Additional property replica is not allowed"),
    ("config.router.port=7000", "Additional property port is not allowed"),  # the chart's
    ("config.speculation.num_tokens=17", "config.speculation.num_tokens: Must be less than"),
    ("rayAuth.mode=none", "rayAuth.mode must be one of"),
    ("serviceMonitor.interval=often", "serviceMonitor.interval: Does not match pattern"),
    ("tritonCache.mountPath=cache", "tritonCache.mountPath: Does not match pattern"),
    ("tritonCache.size=1Gi", "Additional property size is not allowed"),
    # what cluster/config.py refuses at start, refused at install
    ("config.model.block_size=3", "config.model.block_size must be one of"),
    ("config.decode.resources.CPU=1", 'Property name of "CPU" does not match'),
    ("config.security.tls_key=/tls/key.pem", "Has a dependency on tls_cert"),
])
def test_bad_values_fail_lint(setting, message):
    done = lint(setting)
    assert done.returncode != 0 and message in done.stdout, done.stdout


def test_gpus_are_a_share_of_one_or_whole_ones():
    def ok(value: str) -> bool:
        return helm("lint", "--strict", CHART, "--set-json",
                    f"config.decode.num_gpus={value}").returncode == 0

    assert ok("0.5") and ok("2") and not ok("1.5")


def _json_types(hint) -> set[str]:
    names = {int: "integer", float: "number", bool: "boolean", str: "string", dict: "object",
             type(None): "null"}
    return {names[t] for t in (get_args(hint) or (hint,))}


def test_the_schema_follows_cluster_config():
    """values.schema.json's `config` has cluster/config.py's keys (less those the chart sets),
    with the same JSON types and choices."""
    schema = json.load(open(os.path.join(CHART, "values.schema.json")))["properties"]["config"]
    chart_sets = {"ray_address", "router.host", "router.port", "router.http", "router.http_port",
                  "metrics.host", "metrics.port_base"}
    choices = {"mode": C.MODES, "model.dtype": C.DTYPES, "prefill.device": C.DEVICES,
               "decode.device": C.DEVICES, "speculation.method": C.SPEC_METHODS,
               "transfer.transport": C.TRANSPORTS, "transfer.progress_mode": C.PROGRESS_MODES,
               "transfer.pull_engine": C.PULL_ENGINES,
               "model.block_size": tuple(1 << i for i in range(11))}  # config: powers of two

    def check(cls, node, prefix):
        hints = get_type_hints(cls)
        keys = {f.name for f in fields(cls)} - {k.removeprefix(prefix) for k in chart_sets}
        assert set(node["properties"]) == keys and node["additionalProperties"] is False, prefix
        for key in keys:
            sub, hint = node["properties"][key], hints[key]
            if is_dataclass(hint):
                check(hint, sub, f"{key}.")
                continue
            types = {t for alt in sub.get("oneOf", sub.get("anyOf", [sub])) for t in
                     ([alt["type"]] if isinstance(alt["type"], str) else alt["type"])}
            assert types == _json_types(hint), prefix + key
            assert tuple(sub.get("enum", ())) == choices.get(prefix + key, ()), prefix + key

    check(C.ClusterConfig, schema, "")


def test_the_router_is_probed_with_grpc_health():
    head = render()["RayJob"]["spec"]
    assert head["submissionMode"] == "SidecarMode"  # KubeRay submits before the head is ready
    (container,) = head["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["grpc"] == {"port": 50051}, probe
    # Health behind TLS or a token: Kubernetes' gRPC probe can do neither, so TCP.
    for settings in (("config.security.tls_cert=/certs/tls.crt",
                      "config.security.tls_key=/certs/tls.key"),
                     ("config.security.health_open=false",)):
        c = _head_container(render(*settings))
        assert c["readinessProbe"]["tcpSocket"] == {"port": "grpc"} and "grpc" not in \
            c["readinessProbe"], settings
    assert "readinessProbe" not in _head_container(render("router.probes.enabled=false"))
    done = helm("template", "demo", CHART, "--set", "job.submissionMode=K8sJobMode")
    assert done.returncode != 0 and "SidecarMode" in done.stderr


def _head_container(docs):
    (c,) = docs["RayJob"]["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"][
        "containers"]
    return c


def test_ray_token_auth_comes_from_kuberay():
    spec = render()["RayJob"]["spec"]["rayClusterSpec"]
    assert spec["authOptions"] == {"mode": "token"}
    spec = render("rayAuth.secretName=ray-token")["RayJob"]["spec"]["rayClusterSpec"]
    assert spec["authOptions"] == {"mode": "token", "secretName": "ray-token"}
    spec = render("rayAuth.mode=disabled")["RayJob"]["spec"]["rayClusterSpec"]
    assert spec["authOptions"] == {"mode": "disabled"}


def _worker_ports(docs) -> dict[str, int]:
    (group,) = docs["RayJob"]["spec"]["rayClusterSpec"]["workerGroupSpecs"]
    container = group["template"]["spec"]["containers"][0]
    return {p["name"]: p["containerPort"] for p in container.get("ports", [])}


def test_each_node_actor_has_its_metrics_port_on_the_workers(tmp_path):
    """The worker pods name a port for every node actor, numbered as cluster/config.py numbers
    them, and the PodMonitor and the NetworkPolicy name the same ports."""
    docs = render("config.prefill.replicas=2", "gpuWorkers.gpusPerPod=3",
                  "podMonitor.enabled=true", "serviceMonitor.enabled=true")
    expected = router_config(docs, tmp_path).metrics_ports()
    assert expected.pop("router") == 9400
    assert _worker_ports(docs) == expected == {"prefill-0": 9401, "prefill-1": 9402,
                                               "decode-0": 9403}
    endpoints = docs["PodMonitor"]["spec"]["podMetricsEndpoints"]
    assert [e["port"] for e in endpoints] == list(expected)
    assert docs["ServiceMonitor"]["spec"]["endpoints"][0]["port"] == "metrics"
    assert docs["ServiceMonitor"]["spec"]["selector"]["matchLabels"].items() <= \
        docs["Service"]["metadata"]["labels"].items()
    rules = docs["NetworkPolicy"]["spec"]["ingress"]
    scraped = [r for r in rules if {"port": "metrics", "protocol": "TCP"} in r.get("ports", [])]
    assert [p["port"] for p in scraped[0]["ports"]] == ["metrics", *expected]
    # Colocated: the engine runs in the router, so no node ports and no PodMonitor.
    docs = render(*COLOCATED, "podMonitor.enabled=true")
    assert _worker_ports(docs) == {} and "PodMonitor" not in docs
    # Metrics off: no metrics port anywhere.
    docs = render("config.metrics.enabled=false", "serviceMonitor.enabled=true")
    assert _worker_ports(docs) == {} and "ServiceMonitor" not in docs
    assert "metrics" not in {p["name"] for p in docs["Service"]["spec"]["ports"]}


def test_the_network_policy_opens_only_the_public_ports():
    docs = render()
    policy = docs["NetworkPolicy"]["spec"]
    head_labels = docs["RayJob"]["spec"]["rayClusterSpec"]["headGroupSpec"]["template"][
        "metadata"]["labels"]
    assert policy["podSelector"]["matchLabels"].items() <= head_labels.items()
    assert policy["policyTypes"] == ["Ingress"]
    internal, public, metrics, operator = policy["ingress"]
    assert "ports" not in internal and all("podSelector" in p for p in internal["from"])
    assert public == {"ports": [{"port": "grpc", "protocol": "TCP"},
                                {"port": "http", "protocol": "TCP"}]}  # from anywhere
    assert metrics["from"] == [{"namespaceSelector": {"matchLabels": {
        "kubernetes.io/metadata.name": "monitoring"}}, "podSelector": {}}]
    assert operator["ports"] == [{"port": 8265, "protocol": "TCP"}]
    # HTTP off: not in the config, the pod, the Service or the policy.
    docs = render("router.httpPort=0")
    assert yaml.safe_load(docs["ConfigMap"]["data"]["config.yaml"])["router"]["http"] is False
    assert "http" not in {p["name"] for p in docs["Service"]["spec"]["ports"]}
    assert "http" not in {p["name"] for p in _head_container(docs)["ports"]}
    assert docs["NetworkPolicy"]["spec"]["ingress"][1]["ports"] == [
        {"port": "grpc", "protocol": "TCP"}]
    assert "NetworkPolicy" not in render("networkPolicy.enabled=false")


def _cache_volumes(template: dict) -> tuple[list, list]:
    """(mounts, volumes) named triton-cache in a pod template."""
    spec = template["spec"]
    mounts = [m for m in spec["containers"][0]["volumeMounts"] if m["name"] == "triton-cache"]
    return mounts, [v for v in spec["volumes"] if v["name"] == "triton-cache"]


def _templates(docs) -> tuple[dict, dict]:
    spec = docs["RayJob"]["spec"]["rayClusterSpec"]
    return spec["headGroupSpec"]["template"], spec["workerGroupSpecs"][0]["template"]


def test_tritons_kernel_cache_is_a_volume_where_the_engines_run(tmp_path):
    """By default an emptyDir on the GPU workers at tritonCache.mountPath, which the config
    names as engine.triton_cache_dir; an existing claim instead where given; on the head in
    colocated mode (its engine runs in the router); nothing with the cache off."""
    path = "/var/cache/tandem/triton"
    docs = render()
    assert router_config(docs, tmp_path).engine.triton_cache_dir == path
    head, workers = _templates(docs)
    assert _cache_volumes(head) == ([], [])
    assert _cache_volumes(workers) == ([{"name": "triton-cache", "mountPath": path}],
                                       [{"name": "triton-cache", "emptyDir": {"sizeLimit": "4Gi"}}])
    docs = render("tritonCache.persistentVolumeClaim=kernels", "tritonCache.mountPath=/kc")
    assert router_config(docs, tmp_path).engine.triton_cache_dir == "/kc"
    _, volumes = _cache_volumes(_templates(docs)[1])
    assert volumes == [{"name": "triton-cache", "persistentVolumeClaim": {"claimName": "kernels"}}]
    head, workers = _templates(render(*COLOCATED))
    assert _cache_volumes(head)[0] == [{"name": "triton-cache", "mountPath": path}]
    assert _cache_volumes(workers) == ([], [])
    docs = render("tritonCache.enabled=false", "config.engine.triton_cache_dir=/own")
    assert router_config(docs, tmp_path).engine.triton_cache_dir == "/own"
    assert all(_cache_volumes(t) == ([], []) for t in _templates(docs))
    # A config naming another directory while the chart mounts one is refused, not overridden.
    done = helm("template", "demo", CHART, "--set", "config.engine.triton_cache_dir=/elsewhere")
    assert done.returncode != 0 and "tritonCache.mountPath" in done.stderr

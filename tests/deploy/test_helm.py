"""The Helm chart (deploy/helm/tandem) renders, lints, and hands the router a config that
`cluster.config` accepts; a config booking more GPUs than the workers have is refused."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import yaml

from cluster.config import load_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CHART = os.path.join(ROOT, "deploy", "helm", "tandem")
HELM = shutil.which("helm", path=os.path.dirname(sys.executable)) or shutil.which("helm")
pytestmark = pytest.mark.skipif(HELM is None, reason="helm not installed (dev extra helm-binary)")


def helm(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([HELM, *args], capture_output=True, text=True, timeout=60)


def render(*sets: str, values: str | None = None) -> dict[str, dict]:
    args = ["template", "demo", CHART]
    for s in sets:
        args += ["--set", s]
    if values:
        args += ["-f", values]
    done = helm(*args)
    assert done.returncode == 0, done.stderr
    docs = [d for d in yaml.safe_load_all(done.stdout) if d]
    return {d["kind"]: d for d in docs}


def router_config(docs: dict[str, dict], tmp_path) -> object:
    path = tmp_path / "config.yaml"
    path.write_text(docs["ConfigMap"]["data"]["config.yaml"])
    return load_config(path)


def test_chart_lints():
    done = helm("lint", "--strict", CHART)
    assert done.returncode == 0, done.stdout + done.stderr


def test_default_render_serves_the_router_from_the_head(tmp_path):
    docs = render()
    assert set(docs) == {"ConfigMap", "Service", "RayJob"}
    cfg = router_config(docs, tmp_path)
    assert (cfg.router.host, cfg.router.port, cfg.ray_address) == ("0.0.0.0", 50051, "auto")
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
    assert ports["grpc"] == 50051 and ports["metrics"] == 9400

    svc = docs["Service"]["spec"]
    assert svc["selector"].items() <= head["metadata"]["labels"].items()
    assert {p["name"]: p["targetPort"] for p in svc["ports"]} == {"grpc": "grpc",
                                                                  "metrics": "metrics"}
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
    # Colocated mode books the decode section only.
    assert "RayJob" in render("config.mode=colocated", "config.decode.replicas=2")


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

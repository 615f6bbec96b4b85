"""A Ray cluster of two nodes on this machine (a head and a worker node, each with CPUs and a
custom resource of its own, token auth on), the prefill actor kept to one and the decode actor
to the other by `prefill.resources` / `decode.resources`, KV over UCX between their processes:
`tandem serve` joined to it answers greedy requests as the engine alone does."""

from __future__ import annotations

import json
import subprocess
import time
import urllib.request

import pytest
import yaml

from tests.cluster_e2e.ray_nodes import RAY, TANDEM, RayNodes, free_port

pytest.importorskip("ray")
pytest.importorskip("ucxx")

from engine import SamplingParams  # noqa: E402
from tandem_client import Client  # noqa: E402


def _port_run(n: int) -> int:
    """The first of `n` consecutive free ports (the metrics endpoints: router, prefill, decode)."""
    while True:
        base = free_port()
        if base + n <= 65535 and all(_free(base + k) for k in range(1, n)):
            return base


def _free(port: int) -> bool:
    import socket

    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def _topology(model: str, port: int, metrics_base: int, gcs: str) -> dict:
    roles = {"replicas": 1, "device": "cpu", "kv_cache_bytes": "256MiB", "max_num_seqs": 8}
    return {"ray_address": gcs, "model": {"path": model, "max_model_len": 2048},
            "router": {"host": "127.0.0.1", "port": port, "http_port": 0},
            "prefill": {**roles, "resources": {"node_a": 1}},
            "decode": {**roles, "resources": {"node_b": 1}},
            "transfer": {"transport": "ucx", "checksum": True},
            "metrics": {"enabled": True, "host": "127.0.0.1", "port_base": metrics_base}}


def _serving(target: str) -> bool:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(target) as ch:
        try:
            r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
        except grpc.RpcError:
            return False
    return r.status == health_pb2.HealthCheckResponse.SERVING


def _wait_serving(target: str, serve: subprocess.Popen, log, timeout: float = 600) -> None:
    """Until the router's health says SERVING (its actors answered); fails with the server's
    log if it exits or the time runs out."""
    end = time.monotonic() + timeout
    while not _serving(target):
        if serve.poll() is not None or time.monotonic() > end:
            log.seek(0)
            raise AssertionError(f"tandem serve (exit {serve.poll()}):\n{log.read()[-4000:]}")
        time.sleep(2)


def _ray_list(nodes: RayNodes, what: str) -> list[dict]:
    """`ray list <what>` of the cluster's state API, as the dashboard answers it."""
    out = subprocess.run([RAY, "list", what, "--format=json", f"--address={nodes.dashboard}",
                          "--limit=1000"], env=nodes.env, capture_output=True, text=True,
                         timeout=120, check=True).stdout
    return json.loads(out[out.index("["):])


def _metric(url: str, name: str) -> dict[str, float]:
    """Every sample of `name` at a Prometheus endpoint, by its labels."""
    with urllib.request.urlopen(url, timeout=30) as r:
        text = r.read().decode()
    samples = {}
    for line in text.splitlines():
        head, _, value = line.rpartition(" ")
        if head == name or head.startswith(name + "{"):
            samples[head[len(name):]] = float(value)
    return samples


def _stop(serve: subprocess.Popen) -> None:
    serve.terminate()  # the router drains, then stops its actors
    try:
        serve.wait(120)
    except subprocess.TimeoutExpired:
        serve.kill()
        serve.wait(30)


@pytest.mark.skipif(RAY is None or TANDEM is None, reason="ray / tandem executables not found")
def test_prefill_and_decode_on_two_nodes_serve_as_the_engine_alone(smol_engine, chat_ids,
                                                                   tmp_path):
    from cluster import soak

    prompts = chat_ids[:3]
    want = [c.token_ids for c in smol_engine.with_config(enable_prefix_caching=False).generate(
        prompts, SamplingParams(temperature=0, max_tokens=16))]
    port, base = free_port(), _port_run(3)
    with RayNodes(head_cpus=1, head_resources='{"node_a": 1}') as nodes:
        nodes.add(1, '{"node_b": 1}')
        topology = tmp_path / "two-nodes.yaml"
        topology.write_text(yaml.safe_dump(_topology(soak.embedded_export(), port, base,
                                                     nodes.address)))
        with open(tmp_path / "serve.log", "w+") as log:
            serve = subprocess.Popen([TANDEM, "serve", "--config", str(topology)], env=nodes.env,
                                     stdout=log, stderr=subprocess.STDOUT)
            try:
                _wait_serving(f"127.0.0.1:{port}", serve, log)
                with Client(f"127.0.0.1:{port}", timeout=300) as cl:
                    got = [list(cl.complete(token_ids=ids, temperature=0,
                                            max_tokens=16).token_ids) for ids in prompts]
                moved = _metric(f"http://127.0.0.1:{base + 1}/metrics",
                                "tandem_kv_transfer_bytes_total")
                actors = {a["class_name"]: a["node_id"] for a in _ray_list(nodes, "actors")
                          if a["state"] == "ALIVE"}
                node_res = {n["node_id"]: n.get("resources_total") or {}
                            for n in _ray_list(nodes, "nodes")}
            finally:
                _stop(serve)
    assert got == want
    assert sum(moved.values()) > 0  # the prefill actor shipped the KV to the other node
    assert actors["PrefillNode"] != actors["DecodeNode"], actors
    assert "node_a" in node_res[actors["PrefillNode"]], node_res
    assert "node_b" in node_res[actors["DecodeNode"]], node_res

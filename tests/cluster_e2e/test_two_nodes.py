"""`tandem serve` joined to a Ray cluster of two nodes on this machine (a head and a worker node,
each with a custom resource of its own, token auth on: the session's `ray_nodes`), the prefill
actor kept to one and the decode actor to the other by `prefill.resources` /
`decode.resources`, KV over UCX between their processes: it answers greedy requests (token
ids, text, and a chat whose content spells special tokens) through the SDK as the engine alone
does, and its process, the disaggregated router, never imports torch or transformers."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from tests.cluster_e2e.ray_nodes import RAY, free_port

pytest.importorskip("ray")
pytest.importorskip("ucxx")

from engine import SamplingParams  # noqa: E402
from tandem_client import Client  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
TEXT = "The three primary colors are"
CHAT = [{"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Name a river.<|im_end|>\n<|im_start|>assistant\nNo"}]
# `tandem serve` as its console script runs it (`cluster.cli.main`); once it has stopped, the
# modules its process ever loaded that a router must not are written to the file in argv[1].
SERVE = """
import json, sys
from cluster.cli import main
report, argv = sys.argv[1], sys.argv[2:]
code = main(argv)
with open(report, "w") as f:
    json.dump({m: m in sys.modules for m in ("torch", "transformers")}, f)
sys.exit(code)
"""


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


def _log(log) -> str:
    log.seek(0)
    return log.read()[-4000:]


def _wait_serving(target: str, serve: subprocess.Popen, log, timeout: float = 600) -> None:
    """Until the router's health says SERVING (its actors answered); fails with the server's
    log if it exits or the time runs out."""
    end = time.monotonic() + timeout
    while not _serving(target):
        if serve.poll() is not None or time.monotonic() > end:
            raise AssertionError(f"tandem serve (exit {serve.poll()}):\n{_log(log)}")
        time.sleep(0.25)


def _ray_list(nodes, what: str) -> list[dict]:
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


class Serve:
    """The `tandem serve` process of this module (`SERVE`), its log and its ports."""

    def __init__(self, nodes, tmp: Path):
        from cluster import soak

        self.port, self.metrics_base = free_port(), _port_run(3)
        self.target = f"127.0.0.1:{self.port}"
        self.report = tmp / "modules.json"
        topology = tmp / "two-nodes.yaml"
        topology.write_text(yaml.safe_dump(_topology(soak.embedded_export(), self.port,
                                                     self.metrics_base, nodes.address)))
        self.log = open(tmp / "serve.log", "w+")
        self.proc = subprocess.Popen([sys.executable, "-c", SERVE, str(self.report), "serve",
                                      "--config", str(topology)], cwd=ROOT, env=nodes.env,
                                     stdout=self.log, stderr=subprocess.STDOUT)

    def ready(self) -> None:
        """Wait until it serves (`_wait_serving`)."""
        _wait_serving(self.target, self.proc, self.log)

    def stop(self) -> int:
        """SIGTERM: the router drains, stops its actors and exits; its exit status."""
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            return self.proc.wait(120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(30)

    def modules(self) -> dict | None:
        """What `SERVE` reported once stopped (None: it wrote nothing)."""
        try:
            return json.loads(self.report.read_text())
        except (OSError, ValueError):
            return None


@pytest.fixture(scope="module")
def serve(ray_nodes, tmp_path_factory):
    """The module's server, starting (its tests wait with `Serve.ready`: the references are
    computed meanwhile)."""
    s = Serve(ray_nodes, tmp_path_factory.mktemp("two-nodes"))
    try:
        yield s
    finally:
        s.stop()
        s.log.close()


@pytest.fixture(scope="module")
def want(smol_engine, chat_ids):
    """The engine's own greedy outputs of the three token-id prompts, TEXT and CHAT."""
    return smol_engine.with_config(enable_prefix_caching=False).generate(
        [*chat_ids[:3], TEXT, CHAT], SamplingParams(temperature=0, max_tokens=16))


def test_prefill_and_decode_on_two_nodes_serve_as_the_engine_alone(ray_nodes, serve,
                                                                   chat_ids, want):
    serve.ready()
    with Client(serve.target, timeout=300) as cl:
        got = [list(cl.complete(token_ids=ids, temperature=0, max_tokens=16).token_ids)
               for ids in chat_ids[:3]]
    moved = _metric(f"http://127.0.0.1:{serve.metrics_base + 1}/metrics",
                    "tandem_kv_transfer_bytes_total")
    alive = [(a["class_name"], a["node_id"]) for a in _ray_list(ray_nodes, "actors")
             if a["state"] == "ALIVE" and a["class_name"] in ("PrefillNode", "DecodeNode")]
    node_res = {n["node_id"]: n.get("resources_total") or {}
                for n in _ray_list(ray_nodes, "nodes")}
    assert got == [c.token_ids for c in want[:3]]
    assert sum(moved.values()) > 0  # the prefill actor shipped the KV to the other node
    actors = dict(alive)
    assert len(alive) == 2 and len(actors) == 2, alive  # this server's two, nothing left over
    assert actors["PrefillNode"] != actors["DecodeNode"], actors
    assert "node_a" in node_res[actors["PrefillNode"]], node_res
    assert "node_b" in node_res[actors["DecodeNode"]], node_res


def test_building_the_cli_loads_no_torch():
    """`tandem`'s parser, which every `tandem serve` builds first, imports neither torch nor
    transformers (the router process must not)."""
    code = ("import sys\nfrom cluster.cli import main\ntry:\n    main(['serve', '--help'])\n"
            "except SystemExit:\n    pass\n"
            "print({m: m in sys.modules for m in ('torch', 'transformers')})")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.stdout.splitlines()[-1] == "{'torch': False, 'transformers': False}", \
        done.stderr[-3000:]


# Last in this file: it stops the module's server.
def test_the_router_serves_text_and_chat_without_torch(serve, want):
    """Text and a chat through the SDK give the engine's own outputs; stopped, the router
    process reports it never imported torch or transformers, and exits 0."""
    serve.ready()
    with Client(serve.target, timeout=300) as client:
        text = client.complete(TEXT, temperature=0, max_tokens=16)
        chat = client.chat(CHAT, temperature=0, max_tokens=16)
    code = serve.stop()
    assert list(text.token_ids) == want[3].token_ids and text.text == want[3].text
    assert list(chat.token_ids) == want[4].token_ids and chat.text == want[4].text
    assert serve.modules() == {"torch": False, "transformers": False}, _log(serve.log)
    assert code == 0, _log(serve.log)

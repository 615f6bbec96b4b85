"""Node actors and `tandem serve` against a Ray head of this module's own, token auth on
(`tests.cluster_e2e.ray_nodes.RayNodes`), its processes started without OMP_NUM_THREADS, as a
user's `ray start` would be:

- an actor whose engine runs on the CPU computes with the actor's CPUs, though it books none
  (Ray then sets OMP_NUM_THREADS=1 in it), or with the OMP_NUM_THREADS a runtime_env gives;
- `tandem serve` joining without the token says what to set at once, and `join` with the
  token still connects."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from engine import affinity
from tests.cluster_e2e import ray_nodes
from tests.cluster_e2e.ray_nodes import client_env

pytest.importorskip("ray")

# A driver that starts the cluster with the launcher (`cluster.launcher.start`), its node
# classes made to build a tiny random engine in the actor, and prints each actor's torch
# threads: in the actor's own thread and on its engine loop's. argv: the Ray address, then the
# job's runtime_env as JSON.
DRIVER = r"""
import json, os, sys

import ray

from cluster import launcher
from decode_node.node import DecodeNode
from prefill_node.node import PrefillNode


def tiny(cls):
    class Tiny(cls):  # made in __main__, so Ray ships it by value
        def __init__(self, *args):
            from engine import Engine
            from engine.testing import tiny_engine

            Engine.from_pretrained = classmethod(lambda c, model, **kw: tiny_engine(0, **kw))
            super().__init__(*args)

        async def threads(self):
            import torch

            engine = await self.loop.call(lambda e: torch.get_num_threads())
            return {"actor": torch.get_num_threads(), "engine": engine,
                    "cpus": len(os.sched_getaffinity(0)), "env": os.environ.get("OMP_NUM_THREADS")}

    return Tiny


launcher.PrefillNode, launcher.DecodeNode = tiny(PrefillNode), tiny(DecodeNode)
ray.init(address=sys.argv[1], runtime_env=json.loads(sys.argv[2]), log_to_driver=False)
cluster = launcher.start(None, {"device": "cpu", "num_blocks": 64}, transport="local",
                         metrics=False)
print(json.dumps(ray.get([a.threads.remote() for a in cluster.prefills + cluster.decodes])))
cluster.shutdown()
"""


def _no_omp(env: dict | None = None) -> dict:
    """`client_env` without OMP_NUM_THREADS: processes started as a user would start them."""
    env = client_env(env)
    env.pop("OMP_NUM_THREADS", None)
    return env


@pytest.fixture(scope="module")
def head():
    if ray_nodes.RAY is None or ray_nodes.TANDEM is None:
        pytest.skip("ray / tandem executables not found")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ray_nodes, "client_env", _no_omp)  # the head's processes and workers
        with ray_nodes.RayNodes(head_cpus=1) as nodes:
            yield nodes


def _driver(nodes, runtime_env: dict) -> list[dict]:
    env = {**_no_omp(), "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": nodes.token_path}
    run = subprocess.run([sys.executable, "-c", DRIVER, nodes.address, json.dumps(runtime_env)],
                         env=env, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.splitlines()[-1])


def test_cpu_actors_compute_with_their_cpus(head):
    seen = _driver(head, {})
    assert len(seen) == 2, seen
    for s in seen:
        assert s["env"] == "1"  # Ray's, for an actor that books no CPUs
        assert s["actor"] == s["engine"] == s["cpus"], s
        assert s["engine"] > 1 or s["cpus"] == 1


def test_cpu_actors_take_the_runtime_envs_omp_num_threads(head):
    seen = _driver(head, {"env_vars": {"OMP_NUM_THREADS": "3"}})
    assert [(s["actor"], s["engine"]) for s in seen] == [(3, 3)] * 2, seen


def test_serve_without_the_token_is_told_what_to_set_at_once(head, tmp_path):
    config = tmp_path / "topology.yaml"
    config.write_text(f"ray_address: {head.address}\nmetrics:\n  enabled: false\n")
    started = time.monotonic()
    run = subprocess.run([ray_nodes.TANDEM, "serve", "--config", str(config)], env=_no_omp(),
                         capture_output=True, text=True, timeout=120)
    took = time.monotonic() - started
    assert run.returncode == 2, run.stderr[-3000:]
    assert run.stderr.splitlines()[-1].startswith(
        f"error: the Ray cluster at {head.address} checks a token this process did not send:"
        " set RAY_AUTH_MODE=token"), run.stderr[-3000:]
    assert took < 15, (took, run.stderr[-3000:])  # Ray's own retries alone take 20 s


def test_join_with_the_token_connects(head):
    code = ("import ray, sys\nfrom cluster.launcher import join\njoin(sys.argv[1])\n"
            "print(ray.cluster_resources().get('CPU'))")
    env = {**_no_omp(), "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": head.token_path}
    run = subprocess.run([sys.executable, "-c", code, head.address], env=env,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split()[-1] == "1.0", run.stdout


def test_cpu_threads_resolves_a_count():
    assert affinity.cpu_threads(3) == 3
    assert affinity.cpu_threads(0) >= 1
    assert affinity.use_cpu_threads("cuda:0", 3) is None
    assert affinity.use_cpu_threads("cpu", None) is None

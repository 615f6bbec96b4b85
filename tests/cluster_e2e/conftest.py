"""The Ray instance and the disaggregated cluster the cluster tests share."""

from __future__ import annotations

import os

import pytest

from tests.cluster_e2e.ray_nodes import NODE_GPUS, RAY, TANDEM, RayNodes, torch_threads
from tests.helpers import background


@pytest.fixture(scope="session")
def session_ray():
    """One local Ray instance for the session (the cluster's actors, the GPU probes), its
    worker processes started with `torch_threads()` torch threads and the node's `NODE_GPUS`."""
    ray = pytest.importorskip("ray")
    # The raylet, and so every worker it starts, takes its environment from this process at
    # `ray.init`; this process keeps its own.
    env = {"CUDA_VISIBLE_DEVICES": NODE_GPUS, "OMP_NUM_THREADS": str(torch_threads())}
    kept = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        ray.init(address="local", num_cpus=max(2, os.cpu_count() or 2),
                 num_gpus=len(NODE_GPUS.split(",")), include_dashboard=False,
                 log_to_driver=os.environ.get("TANDEM_RAY_LOGS") == "1")
    finally:
        for k, v in kept.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module", autouse=True)
def shared_cores():
    """This process's torch threads while a cluster test file runs: its references are computed
    while the actors may be busy, so it takes its share of the cores (`torch_threads`) too."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(torch_threads())
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def served_cluster(session_ray):
    """Ray prefill and decode actors, KV over UCX with checksums, the gRPC router
    (`cluster.soak.Served`), over the embedded model exported to safetensors once: the same
    weights and outputs, loaded in seconds, so a killed actor is back quickly. Every test
    leaves it serving. (`tandem serve` loading the GGUF itself:
    tests/cluster/test_serve_drain.py.)"""
    pytest.importorskip("ucxx")
    from cluster import soak

    s = soak.Served(soak.embedded_export())
    yield s
    s.close()


def _start_nodes() -> RayNodes:
    """The head with the custom resource node_a, and a worker node with node_b."""
    nodes = RayNodes(head_cpus=2, head_resources='{"node_a": 1}')
    try:
        nodes.add(1, '{"node_b": 1}')
    except BaseException:
        nodes.close()
        raise
    return nodes


@pytest.fixture(scope="session", autouse=True)
def ray_nodes_starting(request):
    """`ray_nodes`' cluster, starting on a thread from the session's first cluster test on
    where some test of the session uses it: its `ray start` processes come up while the tests
    before that one run. The future of the started `RayNodes` (None where no test uses it or
    the executables are missing); stopped at the end of the session."""
    wanted = RAY is not None and TANDEM is not None and any(
        "ray_nodes" in getattr(item, "fixturenames", ()) for item in request.session.items)
    if not wanted:
        yield None
        return
    future = background(_start_nodes, name="ray-nodes")
    yield future
    if future.exception() is None:  # (waits for the start to end either way)
        future.result().close()


@pytest.fixture(scope="session")
def ray_nodes(ray_nodes_starting):
    """A Ray cluster of `ray start` processes of the session's own, token auth on
    (`RayNodes`): a head with the custom resource node_a and a worker node with node_b, once
    both are up. test_ray_job submits to it, test_two_nodes places one actor on each node;
    each stops what it started there."""
    if ray_nodes_starting is None:
        pytest.skip("ray / tandem executables not found")
    return ray_nodes_starting.result()

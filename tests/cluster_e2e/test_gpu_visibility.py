"""What a node actor sees of its node's GPUs under real Ray, without GPUs: Ray is told the node
has four (it trusts the number) and pins each GPU actor to its own by CUDA_VISIBLE_DEVICES,
unless the launcher's options keep them all visible (`transfer.ipc_across_gpus`); then
`node_device` finds the actor's own GPU by index. The node is the session's Ray instance,
started with CUDA_VISIBLE_DEVICES of its own, as on a shared host (`ray_nodes.NODE_GPUS`)."""

from __future__ import annotations

import pytest

from tests.cluster_e2e.ray_nodes import NODE_GPUS

pytest.importorskip("ray")


def _probe_class():
    """The probe actor's class, made here so that Ray ships it by value (the workers cannot
    import this test module)."""

    class Probe:
        def seen(self):
            import os

            import ray
            import torch

            from node_common import node

            torch.cuda.set_device = lambda index: None  # no GPU here: only the choice counts
            return {"visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
                    "ids": [str(i) for i in ray.get_gpu_ids()],
                    "device": node.node_device("cuda")}

    return Probe


def test_actors_see_every_gpu_of_the_node_only_when_asked(session_ray):
    ray = session_ray
    from cluster.launcher import actor_options

    P = ray.remote(_probe_class())
    actors = [P.options(**actor_options(1, False)).remote()] + \
        [P.options(**actor_options(1, True)).remote() for _ in range(2)]
    try:
        pinned, *shared = ray.get([a.seen.remote() for a in actors], timeout=240)
    finally:  # their GPUs free again for whatever runs next on this instance
        for a in actors:
            ray.kill(a)
    # Pinned: Ray narrows CUDA_VISIBLE_DEVICES to the actor's GPU; "cuda" is that one.
    assert pinned["visible"] == pinned["ids"][0] and pinned["device"] == "cuda"
    # Shared: the node's four stay visible; each actor runs on its own, by index among them.
    gpus = NODE_GPUS.split(",")
    assert all(s["visible"] == NODE_GPUS for s in shared)
    ids = [s["ids"][0] for s in shared]
    assert len(set(ids)) == 2 and set(ids) <= set(gpus)
    assert [s["device"] for s in shared] == [f"cuda:{gpus.index(i)}" for i in ids]

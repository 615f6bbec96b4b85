"""GPU placement of the node actors: every GPU of the node visible (`ipc_across_gpus`), each
actor on its own by index."""

from __future__ import annotations

import pytest

from cluster.config import ClusterConfig, ConfigError, apply_overrides
from cluster.launcher import actor_options
from node_common import node
from node_common.node import NOSET_ENV, gpu_index, node_device


def test_gpu_index_follows_the_nodes_numbering():
    assert gpu_index(1, None) == 1 and gpu_index("3", "") == 3
    assert gpu_index("6", "4,6,7") == 1  # Ray's ids are the node's CUDA_VISIBLE_DEVICES entries
    assert gpu_index("GPU-ab", "GPU-cd, GPU-ab") == 1
    with pytest.raises(RuntimeError, match="does not list"):
        gpu_index("2", "0,1")


def test_node_device_picks_the_actors_own_gpu(monkeypatch):
    import ray
    import torch

    set_to = []
    monkeypatch.setattr(ray, "get_gpu_ids", lambda: ["7", "5"])
    monkeypatch.setattr(torch.cuda, "set_device", set_to.append)
    monkeypatch.delenv(NOSET_ENV, raising=False)
    assert node_device("cuda") == "cuda"  # Ray pinned it: "cuda" is its only GPU
    monkeypatch.setenv(NOSET_ENV, "1")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    assert node_device("cuda") == "cuda:1" and set_to == [1]  # the lowest id Ray gave it
    assert node_device("cpu") == "cpu" and node_device("cuda:0") == "cuda:0"
    monkeypatch.setattr(ray, "get_gpu_ids", lambda: [])
    assert node_device("cuda") == "cuda"
    assert node.on_own_gpu({"dtype": "x"}) == {"dtype": "x"}


def test_actor_options_keep_the_node_gpus_visible_only_when_asked():
    assert "runtime_env" not in actor_options(1.0)
    assert "runtime_env" not in actor_options(0.0, True)  # a CPU actor: nothing to see
    opts = actor_options(0.5, True)
    assert opts["runtime_env"] == {"env_vars": {NOSET_ENV: "1"}} and opts["num_gpus"] == 0.5


def test_ipc_across_gpus_needs_an_ipc_path():
    cfg = apply_overrides(ClusterConfig(), ["transfer.ipc_across_gpus=true"])
    assert cfg.transfer.ipc_across_gpus and "ipc_across_gpus" not in \
        cfg.transfer.transport_kwargs()
    assert apply_overrides(ClusterConfig(), ["transfer.pull=false",
                                             "transfer.ipc_across_gpus=true"]).transfer.push
    with pytest.raises(ConfigError, match="ipc_across_gpus needs pull or push"):
        apply_overrides(ClusterConfig(), ["transfer.pull=false", "transfer.push=false",
                                          "transfer.ipc_across_gpus=true"])


def test_net_devices_reach_every_actors_ucx():
    opts = actor_options(0.5, True, net_devices="lo")
    assert opts["runtime_env"] == {"env_vars": {NOSET_ENV: "1", "UCX_NET_DEVICES": "lo"}}
    assert actor_options(0.0, net_devices="eth0")["runtime_env"] == {
        "env_vars": {"UCX_NET_DEVICES": "eth0"}}
    cfg = apply_overrides(ClusterConfig(), ["transfer.net_devices=eth1"])
    assert cfg.transfer.net_devices == "eth1"

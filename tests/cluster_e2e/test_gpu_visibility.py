"""What a node actor sees of its node's GPUs under real Ray, without GPUs: Ray is told the node
has four (it trusts the number) and pins each GPU actor to its own by CUDA_VISIBLE_DEVICES,
unless the launcher's options keep them all visible (`transfer.ipc_across_gpus`); then
`node_device` finds the actor's own GPU by index."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SCRIPT = """
import json, os
import ray
from cluster.launcher import actor_options
from node_common import node

os.environ["CUDA_VISIBLE_DEVICES"] = "4,5,6,7"  # the node's own restriction, as on a shared host
ray.init(address="local", num_cpus=1, num_gpus=4, include_dashboard=False,
         log_to_driver=False)

class Probe:
    def seen(self):
        import torch
        torch.cuda.set_device = lambda index: None  # no GPU here: only the choice is checked
        return {"visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
                "ids": [str(i) for i in ray.get_gpu_ids()], "device": node.node_device("cuda")}

P = ray.remote(Probe)
pinned = P.options(**actor_options(1, False)).remote()
shared = [P.options(**actor_options(1, True)).remote() for _ in range(2)]
out = ray.get([pinned.seen.remote()] + [a.seen.remote() for a in shared])
print("RESULT " + json.dumps(out))
ray.shutdown()
"""


def test_actors_see_every_gpu_of_the_node_only_when_asked():
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "PYTHONPATH": ROOT}
    env.pop("RAY_ADDRESS", None)
    env.pop("CUDA_VISIBLE_DEVICES", None)
    done = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT "))
    pinned, *shared = json.loads(line.removeprefix("RESULT "))
    # Pinned: Ray narrows CUDA_VISIBLE_DEVICES to the actor's GPU; "cuda" is that one.
    assert pinned["visible"] == pinned["ids"][0] and pinned["device"] == "cuda"
    # Shared: the node's four stay visible; each actor runs on its own, by index among them.
    assert all(s["visible"] == "4,5,6,7" for s in shared)
    ids = [s["ids"][0] for s in shared]
    assert len(set(ids)) == 2 and set(ids) <= {"4", "5", "6", "7"}
    assert [s["device"] for s in shared] == [f"cuda:{'4567'.index(i)}" for i in ids]

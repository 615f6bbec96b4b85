"""The soak's faults: what each one does to the in-process cluster, when each is injected, and
when the streams it hit are moving again."""

from __future__ import annotations

import asyncio
import os
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cluster.soak import SoakConfig
    from cluster.soak_cluster import Served
    from cluster.soak_workload import Record

FAULTS = ("decode", "prefill", "router", "ucx")


def _pid(node) -> int:
    return os.getpid()


def kill_actor(actor, timeout: float = 600.0) -> dict:
    """Kill a node actor (Ray restarts it) and wait until its new process answers."""
    import ray
    from ray.exceptions import GetTimeoutError, RayActorError

    before = ray.get(actor.__ray_call__.remote(_pid), timeout=60)
    ray.kill(actor, no_restart=False)
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            if ray.get(actor.__ray_call__.remote(_pid), timeout=10) != before:
                return {"pid": before}
        except (RayActorError, GetTimeoutError):
            pass
        time.sleep(0.1)
    raise TimeoutError(f"the actor did not come back within {timeout:g} s")


def inject(served: Served, kind: str) -> dict:
    """Inject one fault into `served` and return once it has recovered (blocking)."""
    import ray

    c = served.cluster
    if kind == "decode":
        return kill_actor(c.decodes[0])
    if kind == "prefill":
        return kill_actor(c.prefills[0])
    if kind == "router":
        served.restart_router()
        return {}
    if kind == "ucx":
        return {"links": sum(ray.get([p.drop_links.remote() for p in c.prefills], timeout=60))}
    raise ValueError(f"unknown fault {kind!r} (one of {FAULTS})")


def schedule(cfg: SoakConfig) -> list[tuple[float, str]]:
    """(seconds after the start, kind) of every fault, evenly spread over the run."""
    kinds = [k for _ in range(cfg.rounds) for k in cfg.faults]
    return [(cfg.seconds * (i + 1) / (len(kinds) + 1), k) for i, k in enumerate(kinds)]


async def injector(served: Served | None, plan, clock, records: list[Record],
                    faults: list[dict]) -> None:
    """Each fault at its time, but only once the streams live at the one before have moved
    on (`flowing`): a fault on top of the last one's recovery would measure neither."""
    loop = asyncio.get_running_loop()
    for at, kind in plan:
        await asyncio.sleep(max(0.0, at - clock()))
        f = {"kind": kind, "at_s": round(clock(), 3)}
        faults.append(f)
        try:
            f.update(await loop.run_in_executor(None, inject, served, kind))
        except Exception as e:  # noqa: BLE001 - recorded: the soak goes on
            f["error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[-1:]}"[:300]
        f["recovered_s"] = round(clock() - f["at_s"], 3)
        f["resumed_s"] = await flowing(records, f["at_s"], clock)


async def flowing(records: list[Record], t: float, clock, timeout: float = 300.0
                   ) -> float | None:
    """Seconds from `t` until every stream live at `t` had a chunk again (or ended), the
    largest; returns once each has had two (or ended): after a move the first chunk comes
    from the prefill actor, the second through the decode actor, so the next fault does not
    fall into the end of this one (None: not within `timeout`)."""
    live = [r for r in records if r.start <= t and (r.end is None or r.end >= t)]
    after = lambda r, k: ([x for x in r.times if x > t][k:k + 1] or [r.end])[0]
    end = clock() + timeout
    while any(after(r, 1) is None for r in live):
        if clock() > end:
            return None
        await asyncio.sleep(0.05)
    return round(max((after(r, 0) for r in live), default=t) - t, 3)

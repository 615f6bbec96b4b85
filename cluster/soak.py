"""`tandem soak`: concurrent streams through the real SDK for minutes while actors are killed,
the router restarted and UCX links dropped; each stream is then checked against a fault-free
run of its request, each actor for KV blocks left in use. Writes one JSON file.

Streams are greedy over a seeded prompt pool, so each request has one right output."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import json
import os
import platform
import random
import subprocess
import sys
import time
from dataclasses import dataclass

from cluster.soak_cluster import (
    ENGINE_KW,
    SPEC_TOKENS,
    Served,
    embedded_export,
    engine_kwargs,
    settled_stats,
)
from cluster.soak_faults import FAULTS, inject, injector, kill_actor, schedule
from cluster.soak_report import clean, compare, count, pauses, report, summary
from cluster.soak_workload import Item, Record, make_pool, worker

__all__ = ["ENGINE_KW", "FAULTS", "SPEC_TOKENS", "Item", "Record", "Served", "SoakConfig",
           "clean", "cmd_soak", "compare", "embedded_export", "engine_kwargs", "inject",
           "kill_actor", "make_pool", "pauses", "report", "schedule", "settled_stats", "soak",
           "summary"]


@dataclass(frozen=True)
class SoakConfig:
    """What a soak runs: how many streams for how long, which faults, which requests."""

    streams: int = 64
    seconds: float = 300.0
    cancel_fraction: float = 0.25
    seed: int = 0
    faults: tuple[str, ...] = FAULTS
    rounds: int = 1  # each fault this many times, spread over the run
    prompts: int = 24  # distinct requests in the pool
    min_tokens: int = 8
    max_tokens: int = 48
    drain_s: float = 180.0  # streams still running at the end get this long to finish
    progress_s: float = 10.0  # between progress lines (0: none)


def soak(target: str, cfg: SoakConfig, served: Served | None = None) -> dict:
    """Run the soak against `target` (faults only with `served`, the cluster behind it) and
    return the results."""
    return asyncio.run(_soak(target, cfg, served))


async def _soak(target: str, cfg: SoakConfig, served: Served | None) -> dict:
    from tandem_client import AsyncClient

    pool = make_pool(cfg.prompts, cfg.seed, cfg.min_tokens, cfg.max_tokens)
    plan = schedule(cfg) if served is not None else []
    records: list[Record] = []
    faults: list[dict] = []
    t0 = time.monotonic()
    clock = lambda: time.monotonic() - t0
    # A router restart takes well under a second; 30 retries of up to 2 s wait out far more.
    async with AsyncClient(target, timeout=900, retries=30, backoff=0.1,
                           max_backoff=2.0) as client:
        faulting = asyncio.ensure_future(injector(served, plan, clock, records, faults))
        running = lambda: clock() < cfg.seconds or not faulting.done()
        workers = [asyncio.ensure_future(worker(
            client, pool, cfg, random.Random(cfg.seed * 100_003 + w), clock, running, records))
            for w in range(cfg.streams)]
        ticker = asyncio.ensure_future(_progress(cfg, clock, records, faults, len(plan)))
        await faulting
        _, hung = await asyncio.wait(workers, timeout=max(0.0, cfg.seconds - clock())
                                     + cfg.drain_s)
        for w in hung:  # still streaming after the drain: cut, and counted as hung
            w.cancel()
        await asyncio.gather(*workers, return_exceptions=True)
        ticker.cancel()
        soak_s = clock()
        for rec in records:
            if rec.outcome == "running":
                rec.outcome = "hung"
        actors = None
        if served is not None:  # (name, stats) of every actor once the cancels have landed
            c = served.cluster
            names = [f"prefill{i}" for i in range(len(c.prefills))] + \
                [f"decode{i}" for i in range(len(c.decodes))]
            stats = await asyncio.get_running_loop().run_in_executor(None, settled_stats, c, 300)
            actors = list(zip(names, stats))
        used = sorted({r.item for r in records})  # at most the pool: all at once if it fits
        refs = await _references(client, pool, used, max(cfg.streams, len(used)))
    return report(cfg, pool, records, faults, refs, actors, soak_s)


async def _progress(cfg: SoakConfig, clock, records: list[Record], faults: list[dict],
                    planned: int) -> None:
    """A status line every `cfg.progress_s` seconds, on stderr."""
    if cfg.progress_s <= 0:
        return
    tty = sys.stderr.isatty()
    while True:
        await asyncio.sleep(cfg.progress_s if not tty else min(cfg.progress_s, 2.0))
        counts = count(r.outcome for r in records)
        live = counts.pop("running", 0)
        line = (f"soak {clock():6.0f}/{cfg.seconds:.0f} s | {len(records) - live} streams done "
                f"{dict(sorted(counts.items()))} | {live} live | "
                f"{sum(len(r.tokens) for r in records)} tokens | faults {len(faults)}/{planned}"
                + (f" (last: {faults[-1]['kind']})" if faults else ""))
        print(f"\r{line}" if tty else line, end="" if tty else "\n", file=sys.stderr,
              flush=True)


async def _references(client, pool: list[Item], used: list[int], width: int) -> dict:
    """item -> (tokens, text) of a fault-free greedy run of it, `width` at a time (or the
    error it failed with)."""
    from tandem_client.errors import TandemError

    sem = asyncio.Semaphore(max(1, width))

    async def one(i):
        async with sem:
            try:
                done = await client.complete(**pool[i].kwargs())
                return i, (list(done.token_ids), done.text)
            except TandemError as e:
                return i, e

    return dict(await asyncio.gather(*(one(i) for i in used)))


def environment(argv: list[str]) -> dict:
    """The command line, machine, date and git commit of this run."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

    def git(*args):
        try:
            return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True,
                                  timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return None

    return {"command": "tandem " + " ".join(argv),
            "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(),
                        "python": platform.python_version(), "processor": platform.processor()},
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "git_commit": git("rev-parse", "HEAD"),
            "git_dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}


def add_parser(sub) -> None:
    """Register `tandem soak` on the CLI's subparsers."""
    p = sub.add_parser("soak", help="concurrent streams for minutes while faults are injected; "
                                    "checks outputs and KV leaks, writes JSON",
                       description=__doc__.split("\n\n")[0])
    from cluster.subcommands import grpc_address

    p.add_argument("--address", default=None, type=grpc_address,
                   help="a running server to stream from (no faults: they need this process's "
                        "cluster; default: start one here)")
    p.add_argument("--streams", type=int, default=64, help="concurrent streams")
    p.add_argument("--minutes", type=float, default=5.0)
    p.add_argument("--cancel-fraction", type=float, default=0.25,
                   help="share of streams the client cancels part-way")
    p.add_argument("--faults", default=",".join(FAULTS),
                   help=f"comma-separated, from {','.join(FAULTS)}; 'none' for none")
    p.add_argument("--fault-rounds", type=int, default=1, help="times each fault is injected")
    p.add_argument("--prompts", type=int, default=24, help="distinct requests in the pool")
    p.add_argument("--min-tokens", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default=None,
                   help="HF folder or .gguf (default: the embedded SmolLM2, exported once to "
                        "safetensors under ~/.cache/tandem so restarts take seconds)")
    p.add_argument("--kv-cache-mb", type=int, default=256, help="KV cache of each actor")
    p.add_argument("--replicas", type=int, default=1,
                   help="prefill and decode actors each (faults kill the first of a role)")
    p.add_argument("--device", default="cpu", help="the actors' device: cpu or cuda")
    p.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16"),
                   help="the actors' dtype (default: float32 on the CPU, bfloat16 on a GPU)")
    p.add_argument("--gpu-share", type=float, default=None,
                   help="GPU share each actor books from Ray (default on a GPU: one GPU split "
                        "over all 2 x --replicas actors)")
    p.add_argument("--deterministic", action=argparse.BooleanOptionalAction, default=None,
                   help="engine.deterministic on the actors (default: on a GPU, where only "
                        "this mode makes a moved stream's output equal the fault-free run)")
    p.add_argument("--out", default=None,
                   help="JSON file (default: bench/results/soak_<date>.json)")
    p.set_defaults(fn=cmd_soak)


def placement(args) -> tuple[str, str, float]:
    """(device, dtype, GPU share per actor) of the soak's actors."""
    from cluster.engine_args import unusable_device

    if why := unusable_device(args.device):  # CUDA without one: the actors waited forever
        raise ValueError(why)
    gpu = args.device.startswith("cuda")
    dtype = args.dtype or ("bfloat16" if gpu else "float32")
    share = args.gpu_share
    if share is None:  # Ray takes fractions to four decimals
        share = int(10_000 / (2 * args.replicas)) / 10_000 if gpu else 0.0
    if not 0 <= share <= 1 or gpu != (share > 0):
        raise ValueError(f"--gpu-share must be in (0, 1] on a GPU, 0 on the CPU; got {share}")
    return args.device, dtype, share


def _config(args) -> SoakConfig:
    faults = () if args.faults.strip() in ("", "none") else tuple(
        k.strip() for k in args.faults.split(","))
    bad = sorted(set(faults) - set(FAULTS))
    if bad:
        raise ValueError(f"--faults: unknown {bad}; pick from {list(FAULTS)}")
    if not 0 <= args.cancel_fraction <= 1:
        raise ValueError("--cancel-fraction must be in [0, 1]")
    if getattr(args, "replicas", 1) < 1:
        raise ValueError("--replicas must be >= 1")
    if (args.streams < 1 or not args.minutes > 0 or args.prompts < 1
            or not 1 <= args.min_tokens <= args.max_tokens):
        raise ValueError("want --streams >= 1, --minutes > 0, --prompts >= 1, 1 <= --min-tokens "
                         "<= --max-tokens")
    return SoakConfig(streams=args.streams, seconds=args.minutes * 60,
                      cancel_fraction=args.cancel_fraction, seed=args.seed, faults=faults,
                      rounds=args.fault_rounds, prompts=args.prompts,
                      min_tokens=args.min_tokens, max_tokens=args.max_tokens)


def _out(args) -> str:
    """The JSON file the soak writes, its folder made now: a path it cannot write is refused
    before the soak, not after its minutes."""
    from cluster.subcommands import unwritable

    out = args.out or os.path.join("bench", "results", "soak_" + datetime.datetime.now()
                                   .strftime("%Y%m%d-%H%M%S") + ".json")
    if os.path.isdir(out):
        raise ValueError(f"--out {out}: a folder; name the JSON file")
    if why := unwritable(os.path.dirname(os.path.abspath(out))):
        raise ValueError(f"--out {out}: {why}")
    return out


def cmd_soak(args) -> int:
    try:
        cfg = _config(args)
        device, dtype, share = placement(args)
        out = _out(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    env = environment(getattr(args, "argv", sys.argv[1:]))
    served = None
    if args.address is None:
        print("starting the cluster…", file=sys.stderr, flush=True)
        model = args.model or embedded_export()
        det = args.deterministic if args.deterministic is not None else share > 0
        engine = engine_kwargs(args.kv_cache_mb, device, dtype, share, det)
        served = Served(model, engine, replicas=args.replicas, gpus=share)
        env["cluster"] = {"model": model, "engine": {**engine, "deterministic": det,
                                                     "spec": f"eagle3, {SPEC_TOKENS} drafts"},
                          "gpu_share_per_actor": share,
                          "transport": "ucx, checksums on", "prefill": args.replicas,
                          "decode": args.replicas}
    elif cfg.faults:
        print("note: --address: no faults (they need the cluster of this process)",
              file=sys.stderr)
        cfg = dataclasses.replace(cfg, faults=())
    try:
        result = {**env, **soak(served.target if served else args.address, cfg, served)}
    finally:
        if served is not None:
            served.close()
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
        f.write("\n")
    print(f"\n{summary(result)}\nwrote {out}", file=sys.stderr)
    return 0 if clean(result) else 1


if __name__ == "__main__":
    ap = argparse.ArgumentParser(prog="tandem")
    add_parser(ap.add_subparsers(dest="cmd", required=True))
    a = ap.parse_args(["soak", *sys.argv[1:]])
    a.argv = ["soak", *sys.argv[1:]]
    sys.exit(a.fn(a))

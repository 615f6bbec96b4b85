"""`tandem soak`: many concurrent streams through the real SDK for minutes while faults are
injected (the decode actor killed, the prefill actor killed, the router restarted, the prefill
side's UCX links dropped), then every stream is checked against a fault-free run of the same
request and every actor for KV blocks left in use. Writes one JSON file.

Streams are greedy, over a pool of prompts drawn with a fixed seed, so each request has one
right output: the pool is run again on the cluster after the soak, fault-free, and that is the
reference (greedy fp32 on the CPU is deterministic, and disaggregated output equals colocated:
tests/cluster_e2e/test_disaggregated.py)."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import difflib
import hashlib
import json
import os
import platform
import random
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

FAULTS = ("decode", "prefill", "router", "ucx")
# Small KV settings for a CPU: 256 MiB of cache per actor, no prefix caching (its blocks would
# make a request's output depend on what ran before), EAGLE-3 with three drafts.
ENGINE_KW = {"enable_prefix_caching": False, "kv_cache_bytes": 256 << 20, "max_model_len": 2048}
SPEC_TOKENS = 3
TOPICS = ("the sea", "a lighthouse", "volcanoes", "bread", "chess", "the moon", "rivers",
          "a lost key", "bees", "trains", "winter", "a robot", "maps", "tea", "clocks",
          "owls", "glass", "deserts", "music", "a small town")
TASKS = ("Write a short story about {}.", "Explain {} to a ten-year-old.",
         "List five facts about {}.", "Write a poem about {}.", "Describe {} in detail.",
         "What would a scientist say about {}?", "Give advice to someone who loves {}.")


def engine_kwargs(kv_cache_mb: int = 256) -> dict:
    """The actors' engine settings (`ENGINE_KW`, with EAGLE-3 at `SPEC_TOKENS` drafts)."""
    from engine.config import SpecConfig

    return {**ENGINE_KW, "kv_cache_bytes": kv_cache_mb << 20,
            "spec": SpecConfig(num_tokens=SPEC_TOKENS, dynamic=False)}


def embedded_export(cache: str | None = None) -> str:
    """The embedded SmolLM2 GGUF exported once to an HF folder (fp32 safetensors, config,
    tokenizer): the same model, tokens and outputs, loaded in ~2 s instead of ~27 s (parsing
    the GGUF's metadata dominates), so a killed actor is back in seconds. The folder keeps the
    model's name, which picks its shipped EAGLE-3 head."""
    import tempfile

    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoTokenizer

    from engine import loader

    ck = loader.embedded_checkpoint()
    st = os.stat(os.path.join(ck.folder, ck.gguf_file))
    key = hashlib.sha256(f"{ck.gguf_file}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()
    root = os.path.join(cache or os.environ.get("XDG_CACHE_HOME")
                        or os.path.expanduser("~/.cache"), "tandem", f"export-{key[:12]}")
    out = os.path.join(root, loader.EMBEDDED_NAME)
    if os.path.isfile(os.path.join(out, "model.safetensors")):
        return out
    os.makedirs(root, exist_ok=True)
    tmp = tempfile.mkdtemp(dir=root)  # renamed into place whole: a racing export loses cleanly
    AutoConfig.from_pretrained(ck.folder, **ck.hf_kwargs()).save_pretrained(tmp)
    AutoTokenizer.from_pretrained(ck.folder, **ck.hf_kwargs()).save_pretrained(tmp)
    sd = loader.load_state_dict(ck, torch.float32)
    sd.pop("lm_head.weight", None)  # tied to the embedding
    save_file({k: v.contiguous() for k, v in sd.items()}, os.path.join(tmp, "model.safetensors"))
    try:
        os.rename(tmp, out)
    except OSError:  # another process finished first
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return out


def settled_stats(cluster, tries: int = 100) -> list[dict]:
    """Every actor's stats once nothing runs and every block is free (cancels land
    asynchronously), or the last stats seen."""
    import ray

    for _ in range(tries):
        stats = ray.get([a.stats.remote() for a in cluster.prefills + cluster.decodes])
        if all(s["blocks_free"] == s["blocks_total"] and s["running"] == 0 for s in stats):
            break
        threading.Event().wait(0.1)
    return stats


class Served:
    """What `tandem serve` runs, in this process: the disaggregated cluster (Ray prefill and
    decode actors, KV over UCX with checksums) and the gRPC router on its own event-loop thread,
    which `restart_router` can kill and bring back on the same port."""

    def __init__(self, model: str | None = None, engine_kw: dict | None = None, *,
                 host: str = "127.0.0.1", port: int = 0, replicas: int = 1):
        import ray

        from cluster import launcher
        from cluster.config import TransferSection

        self._own_ray = not ray.is_initialized()
        self.cluster = launcher.start(model, engine_kw or engine_kwargs(), transport="ucx",
                                      transport_kwargs=TransferSection(
                                          checksum=True).transport_kwargs(),
                                      prefill_replicas=replicas, decode_replicas=replicas)
        self.host = host
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True, name="soak-router").start()
        self.service, self.server, self.port = self._call(self._boot(port))

    @property
    def target(self) -> str:
        return f"{self.host}:{self.port}"

    async def _boot(self, port: int):
        from router.server import GenerationService, start_server

        service = GenerationService(self.cluster.backend)
        server, bound = await start_server(service, self.host, port)
        return service, server, bound

    def _call(self, coro, timeout: float = 60.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def restart_router(self) -> None:
        """Stop the gRPC server at once (its calls break off, UNAVAILABLE) and start a new one
        on the same port over the same backend: a router that died and came back."""
        self._call(self.server.stop(0))
        self.service.close()
        self.service, self.server, port = self._call(self._boot(self.port))
        if port != self.port:
            raise RuntimeError(f"the router came back on port {port}, not {self.port}")

    def close(self) -> None:
        import ray

        self._call(self.server.stop(0))
        self.service.close()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.cluster.shutdown()
        if self._own_ray:
            ray.shutdown()


# --- the workload -------------------------------------------------------------------------


@dataclass(frozen=True)
class Item:
    """One request of the pool: a chat prompt and its length (greedy, EOS ignored)."""

    messages: tuple
    max_tokens: int

    def kwargs(self) -> dict:
        return {"messages": [dict(m) for m in self.messages], "temperature": 0,
                "max_tokens": self.max_tokens, "ignore_eos": True}


def make_pool(n: int, seed: int, min_tokens: int, max_tokens: int) -> list[Item]:
    """`n` chat requests drawn with `seed`: a task about a topic, plus a few more words."""
    rng = random.Random(seed)
    pool = []
    for _ in range(n):
        words = " ".join(rng.choices(TOPICS, k=rng.randint(0, 8)))
        text = rng.choice(TASKS).format(rng.choice(TOPICS)) + (f" Mention {words}." if words
                                                                else "")
        pool.append(Item(((("role", "user"), ("content", text)),),
                         rng.randint(min_tokens, max_tokens)))
    return pool


@dataclass
class Record:
    """One stream as the client saw it (times in seconds since the soak started)."""

    item: int
    cancel_after: int | None  # the client cancels once it has this many tokens
    start: float
    times: list[float] = field(default_factory=list)  # arrival of each chunk
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    end: float | None = None
    outcome: str = "running"  # completed, cancelled, finish_<reason>, truncated, a status code
    detail: str = ""

    def gaps(self) -> list[tuple[float, float]]:
        """(from, to) of each wait for the next chunk, the first from the call's start."""
        marks = [self.start, *self.times]
        return list(zip(marks, marks[1:]))


@dataclass(frozen=True)
class SoakConfig:
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


def _outcome(finish: str | None) -> str:
    if finish is None:
        return "truncated"  # the stream ended without its final chunk
    return "completed" if finish in ("length", "stop") else f"finish_{finish}"


async def _stream(client, item: Item, rec: Record, clock) -> None:
    """Run one request, recording its chunks; cancel it at `rec.cancel_after` tokens."""
    from tandem_client.errors import TandemError

    stream = client.generate(**item.kwargs())
    finish = None
    try:
        async for chunk in stream:
            rec.times.append(clock())
            rec.tokens += chunk.token_ids
            rec.text += chunk.text
            finish = chunk.finish_reason or finish
            if rec.cancel_after is not None and finish is None and \
                    len(rec.tokens) >= rec.cancel_after:
                stream.cancel()
                rec.outcome = "cancelled"
                break
        else:
            rec.outcome = _outcome(finish)
    except TandemError as e:
        rec.outcome, rec.detail = e.code.name, str(e)[:300]
    finally:
        rec.end = clock()


async def _worker(client, pool: list[Item], cfg: SoakConfig, rng: random.Random, clock,
                  running, records: list[Record]) -> None:
    """Streams one after another while `running()`."""
    while running():
        i = rng.randrange(len(pool))
        cancel = rng.random() < cfg.cancel_fraction and pool[i].max_tokens > 1
        rec = Record(i, rng.randint(1, pool[i].max_tokens - 1) if cancel else None, clock())
        records.append(rec)
        await _stream(client, pool[i], rec, clock)


# --- faults -------------------------------------------------------------------------------


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


async def _injector(served: Served | None, plan, clock, records: list[Record],
                    faults: list[dict]) -> None:
    """Each fault at its time, but only once the streams live at the one before have moved
    on (`_flowing`): a fault on top of the last one's recovery would measure neither."""
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
        f["resumed_s"] = await _flowing(records, f["at_s"], clock)


async def _flowing(records: list[Record], t: float, clock, timeout: float = 300.0
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


# --- the run ------------------------------------------------------------------------------


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
        injector = asyncio.ensure_future(_injector(served, plan, clock, records, faults))
        running = lambda: clock() < cfg.seconds or not injector.done()
        workers = [asyncio.ensure_future(_worker(
            client, pool, cfg, random.Random(cfg.seed * 100_003 + w), clock, running, records))
            for w in range(cfg.streams)]
        ticker = asyncio.ensure_future(_progress(cfg, clock, records, faults, len(plan)))
        await injector
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
        refs = await _references(client, pool, sorted({r.item for r in records}), cfg.streams)
    return report(cfg, pool, records, faults, refs, actors, soak_s)


async def _progress(cfg: SoakConfig, clock, records: list[Record], faults: list[dict],
                    planned: int) -> None:
    """A status line every `cfg.progress_s` seconds, on stderr."""
    if cfg.progress_s <= 0:
        return
    tty = sys.stderr.isatty()
    while True:
        await asyncio.sleep(cfg.progress_s if not tty else min(cfg.progress_s, 2.0))
        counts = _count(r.outcome for r in records)
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


# --- the report ---------------------------------------------------------------------------


def _count(values) -> dict[str, int]:
    out: dict[str, int] = {}
    for v in values:
        out[v] = out.get(v, 0) + 1
    return out


def compare(got: list[int], want: list[int], whole: bool) -> tuple[int, int, bool]:
    """(lost, duplicated, differs) of a stream's tokens against the reference's: lost are
    reference tokens missing from the stream, duplicated are stream tokens the reference does
    not have there (token-level diff). A stream that ended early (`whole` False) is held to
    the reference's head only: the tail it never asked for is not lost."""
    ops = difflib.SequenceMatcher(None, want, got, autojunk=False).get_opcodes()
    if not whole and ops and ops[-1][0] == "delete" and ops[-1][2] == len(want):
        ops = ops[:-1]
    lost = sum(i2 - i1 for op, i1, i2, _, _ in ops if op == "delete")
    dup = sum(j2 - j1 for op, _, _, j1, j2 in ops if op == "insert")
    return lost, dup, any(op != "equal" for op, *_ in ops)


def _pct(xs: list[float], q: float) -> float | None:
    """The q-th percentile (linear between ranks), None of nothing."""
    if not xs:
        return None
    xs = sorted(xs)
    k = (len(xs) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return round(xs[lo] + (xs[hi] - xs[lo]) * (k - lo), 4)


def pauses(records: list[Record], faults: list[dict], end: float) -> tuple[list[dict], dict]:
    """Per fault, over the streams live during its outage (from the fault until the actor is
    back and the streams live at it have moved on): each one's longest wait for its next
    chunk among the waits that overlap the time until the next fault (P50, P99); and the
    same statistic for the streams that lived through no outage, as the baseline."""
    windows = [(f["at_s"], f["at_s"] + max(f.get("recovered_s") or 0, f.get("resumed_s") or 0))
               for f in faults]
    out, faulted = [], set()
    for k, (t, until) in enumerate(windows):
        nxt = windows[k + 1][0] if k + 1 < len(windows) else float("inf")
        live = [r for r in records if r.start <= until and
                (r.end if r.end is not None else end) >= t]
        worst = []
        for r in live:
            faulted.add(id(r))
            gaps = [b - a for a, b in r.gaps() if b > t and a < nxt]
            if gaps:
                worst.append(max(gaps))
        out.append({"live_streams": len(live), "pause_p50_s": _pct(worst, 50),
                    "pause_p99_s": _pct(worst, 99), "pause_max_s": _pct(worst, 100)})
    calm = [max(b - a for a, b in r.gaps()) for r in records if id(r) not in faulted and r.times]
    return out, {"streams": len(calm), "pause_p50_s": _pct(calm, 50),
                 "pause_p99_s": _pct(calm, 99)}


def report(cfg: SoakConfig, pool: list[Item], records: list[Record], faults: list[dict],
           refs: dict, actors: list[tuple[str, dict]] | None, soak_s: float) -> dict:
    """The results as JSON-ready data (the caller adds the command line and machine)."""
    lost = dup = compared = 0
    differing, unreferenced = [], 0
    for r in records:
        ref = refs.get(r.item)
        if not isinstance(ref, tuple):
            unreferenced += 1
            continue
        whole = r.outcome == "completed"
        n_lost, n_dup, differs = compare(r.tokens, ref[0], whole)
        text_ok = r.text == ref[1] if whole else ref[1].startswith(r.text)
        lost, dup, compared = lost + n_lost, dup + n_dup, compared + 1
        if differs or not text_ok:
            differing.append({"item": r.item, "outcome": r.outcome, "lost": n_lost,
                              "duplicated": n_dup, "text_matches": text_ok,
                              "got": r.tokens[:64], "want": ref[0][:64]})
    per_fault, calm = pauses(records, faults, soak_s)
    leaks = None if actors is None else [
        {"actor": name, "blocks_in_use": s["blocks_total"] - s["blocks_free"],
         **{k: s[k] for k in ("blocks_total", "running", "held", "reserved", "waiting")
            if k in s}}
        for name, s in actors]
    completed = [r for r in records if r.outcome == "completed"]
    return {
        "config": dataclasses.asdict(cfg), "soak_s": round(soak_s, 2),
        "streams": len(records), "outcomes": _count(r.outcome for r in records),
        "failures": [{"item": r.item, "outcome": r.outcome, "detail": r.detail}
                     for r in records if r.detail][:20],
        "tokens": {"received": sum(len(r.tokens) for r in records),
                   "per_s": round(sum(len(r.tokens) for r in records) / max(soak_s, 1e-9), 2),
                   "lost": lost, "duplicated": dup},
        "compared_streams": compared, "completed_streams": len(completed),
        "outputs_differing": len(differing),
        "differing_completed": sum(d["outcome"] == "completed" for d in differing),
        "differing": differing[:10], "unreferenced_streams": unreferenced,
        "reference": {"how": "each pool request run again on the cluster after the soak, "
                             "fault-free, greedy", "requests": len(refs),
                      "failed": {str(i): str(e)[:200] for i, e in refs.items()
                                 if not isinstance(e, tuple)}},
        "leaked_blocks": None if leaks is None else sum(x["blocks_in_use"] for x in leaks),
        "actors": leaks, "faults": [{**f, **p} for f, p in zip(faults, per_fault)],
        "no_fault_baseline": calm,
        "pool": [{"prompt": dict(it.messages[0])["content"], "max_tokens": it.max_tokens}
                 for it in pool],
    }


def clean(result: dict) -> bool:
    """No lost or duplicated token, no output differing from the fault-free run, no block
    left in use."""
    return (result["tokens"]["lost"] == 0 and result["tokens"]["duplicated"] == 0
            and result["outputs_differing"] == 0 and not result["leaked_blocks"])


# --- the command --------------------------------------------------------------------------


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
    p.add_argument("--address", default=None,
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
    p.add_argument("--out", default=None,
                   help="JSON file (default: bench/results/soak_<date>.json)")
    p.set_defaults(fn=cmd_soak)


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
    if args.streams < 1 or args.minutes <= 0 or not 1 <= args.min_tokens <= args.max_tokens:
        raise ValueError("want --streams >= 1, --minutes > 0, 1 <= --min-tokens <= --max-tokens")
    return SoakConfig(streams=args.streams, seconds=args.minutes * 60,
                      cancel_fraction=args.cancel_fraction, seed=args.seed, faults=faults,
                      rounds=args.fault_rounds, prompts=args.prompts,
                      min_tokens=args.min_tokens, max_tokens=args.max_tokens)


def cmd_soak(args) -> int:
    try:
        cfg = _config(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    env = environment(getattr(args, "argv", sys.argv[1:]))
    served = None
    if args.address is None:
        print("starting the cluster…", file=sys.stderr, flush=True)
        model = args.model or embedded_export()
        served = Served(model, engine_kwargs(args.kv_cache_mb), replicas=args.replicas)
        env["cluster"] = {"model": model, "engine": {**ENGINE_KW, "kv_cache_bytes":
                                                     args.kv_cache_mb << 20,
                                                     "spec": f"eagle3, {SPEC_TOKENS} drafts"},
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
    out = args.out or os.path.join("bench", "results", "soak_" + datetime.datetime.now()
                                   .strftime("%Y%m%d-%H%M%S") + ".json")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
        f.write("\n")
    print(f"\n{summary(result)}\nwrote {out}", file=sys.stderr)
    return 0 if clean(result) else 1


def summary(r: dict) -> str:
    """A few lines of the results."""
    lines = [f"{r['streams']} streams in {r['soak_s']:.0f} s: {r['outcomes']}",
             f"tokens {r['tokens']['received']} ({r['tokens']['per_s']}/s), lost "
             f"{r['tokens']['lost']}, duplicated {r['tokens']['duplicated']}, outputs differing "
             f"{r['outputs_differing']} of {r['compared_streams']}, leaked blocks "
             f"{r['leaked_blocks']}"]
    for f in r["faults"]:
        lines.append(f"  {f['kind']:8s} at {f['at_s']:6.1f} s: back in {f['recovered_s']:.1f} s,"
                     f" streams moving again after {f['resumed_s']} s,"
                     f" {f['live_streams']} live, pause P50 {f['pause_p50_s']} s P99 "
                     f"{f['pause_p99_s']} s" + (f" ERROR {f['error']}" if "error" in f else ""))
    return "\n".join(lines)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(prog="tandem")
    add_parser(ap.add_subparsers(dest="cmd", required=True))
    a = ap.parse_args(["soak", *sys.argv[1:]])
    a.argv = ["soak", *sys.argv[1:]]
    sys.exit(a.fn(a))

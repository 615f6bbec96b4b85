"""UCX sweep: figure 4's KV transfer (GPU 0 -> GPU 1, two processes) under many settings, in
one run, with the peer-copy baseline and a per-phase breakdown of where a transfer's time goes.

    PYTHONPATH=/tmp/site:$PWD python3 -m bench.ucx_sweep --out $OUT      # on a 2-GPU host
    python -m bench.ucx_sweep --cpu-smoke --out /tmp/sweep                 # plumbing, any host
    python -m bench.ucx_sweep --list                                       # the plan, no run

UCX (and ucxx) read their settings once per process, so every configuration runs in a fresh
child process pair: this script starts `python -m bench.ucx_sweep --child SPEC`, which spawns
the receiver (`kvtransfer.bench.spawn_receiver`, the same machinery as figure 4's UCX row) and
times `send_blocks` with `kvtransfer.bench.measure` for every size and layer-chunk count, plus
the bare UCX baseline (`kvtransfer.bench.measure_raw`: one buffer, no header, gather or
scatter). Each child has a wall-clock limit and its whole process group is killed past it, so a
hang costs one configuration, not the run; configurations run in priority order and the ones
that no longer fit in `--budget` seconds are recorded as skipped. After the single-setting
variants, a `combined` configuration merges every setting that beat the default.

One JSON, `<out>/ucx_sweep.json`, is rewritten after every configuration: the command line,
date, GPUs, versions, every number, each child's log tail and UCX's protocol choices
(`UCX_PROTO_INFO=y` in the default configuration).

Beside each configuration's staged rows, its pull rows (`pull`: GPU caches, the receiver
copies out of the sender's cache through CUDA IPC, UCX carrying header and ack; the summary
lists them apart, per size against the peer copy, with the header's and the ack's times).

Phases of one transfer (ms since `send_blocks` began, medians over the timed repetitions; the
receiver's stamps use the same monotonic clock, one host): `path` telescopes to the total:
gather (first chunk gathered and its send posted) + first_chunk (until the receiver has chunk 0:
header handling, rendezvous, the copy) + rest_chunks (until the last chunk is in) + scatter
(the last scatter and the wait for all of them) + rx_tail (receiver bookkeeping before the ack)
+ ack (the ack's trip back). Diagnostics beside it: header_in (when the receiver saw the
header), wire_last (last chunk: send posted -> in), sends_done (every send complete).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from types import SimpleNamespace
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

MIB, GIB = 1 << 20, 1 << 30
GPU_SIZES = [16 * MIB, 256 * MIB, GIB]
GPU_CHUNKS = [1, 4, 8, 16]
SMOKE_SIZES = [1 * MIB, 4 * MIB]
SMOKE_CHUNKS = [1, 4]
GOAL_VS_PEER = 0.8
BETTER = 1.03  # a variant "wins" when its score beats the default's by this factor
LOG_TAIL = 4000
PROTO_LINES = 300
RAW_TIMEOUT_S = 10.0


@dataclass
class Config:
    """One child process pair: UCX / ucxx environment, progress mode and what to measure."""

    name: str
    env: dict[str, str] = field(default_factory=dict)
    progress: str = "thread"
    why: str = ""
    chunks: list[int] | None = None  # None: the plan's default
    sizes: list[int] | None = None
    reps: int | None = None
    raw_pieces: list[int] | None = None
    timeout: float = 35.0
    kind: str = "ucx"  # "ucx" or "baseline"

    def settings(self) -> dict[str, str]:
        """What distinguishes it from the default: env plus the progress mode."""
        out = dict(self.env)
        if self.progress != "thread":
            out["progress"] = self.progress
        return out


def parse_config(spec: str) -> Config:
    """`NAME:KEY=VALUE,KEY=VALUE` -> Config (the --extra flag). `progress=MODE` sets the ucxx
    progress mode; every other key is an environment variable (UCX_*, UCXPY_*)."""
    name, sep, rest = spec.partition(":")
    name = name.strip()
    if not name or not sep:
        raise ValueError(f"want NAME:KEY=VALUE[,KEY=VALUE...], got {spec!r}")
    cfg = Config(name=name, why="--extra")
    for item in filter(None, (x.strip() for x in rest.split(","))):
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise ValueError(f"{spec!r}: {item!r} is not KEY=VALUE")
        key, value = key.strip(), value.strip()
        if key == "progress":
            if value not in ("thread", "thread-polling", "blocking", "polling"):
                raise ValueError(f"{spec!r}: unknown progress mode {value!r}")
            cfg.progress = value
        else:
            cfg.env[key] = value
    return cfg


def gpu_plan() -> list[Config]:
    """Every configuration, most informative first (the budget cuts from the end)."""
    return [
        Config("baseline", kind="baseline", timeout=60.0,
               why="peer copy cuda:0 -> cuda:1 and the in-process transport, same sizes"),
        Config("default", env={"UCX_PROTO_INFO": "y"},
               why="as figure 4 runs (UCX_PROTO_INFO only prints the protocol choices)"),
        Config("thread_polling", progress="thread-polling",
               why="ucxx progress thread busy-polls instead of waiting on the worker's fd"),
        Config("no_delayed_submission", env={"UCXPY_ENABLE_DELAYED_SUBMISSION": "0"},
               why="post sends/receives from the caller's thread, not via the progress thread"),
        Config("rndv_put", env={"UCX_RNDV_SCHEME": "put_zcopy"},
               why="the sender pushes (cuda_ipc put), as a peer copy does"),
        Config("one_rail", env={"UCX_MAX_RNDV_RAILS": "1"},
               why="no splitting a rendezvous across two lanes"),
        Config("tls_ipc_sm", env={"UCX_TLS": "cuda_ipc,cuda_copy,sm,self"},
               why="only NVLink IPC, cuda_copy and shared memory"),
        Config("no_shm_pipeline", env={"UCX_RNDV_PIPELINE_SHM_ENABLE": "n"},
               why="no two-stage shared-memory pipeline for GPU to GPU"),
        Config("rndv_get", env={"UCX_RNDV_SCHEME": "get_zcopy"},
               why="the receiver pulls (cuda_ipc get), forced"),
        Config("put_polling_1rail", progress="thread-polling",
               env={"UCX_RNDV_SCHEME": "put_zcopy", "UCX_MAX_RNDV_RAILS": "1"},
               why="a likely-good mix, in case the combined one below does not fit"),
        # "combined" (from the winners above) is inserted here by run_plan
        Config("no_ipc_cache", env={"UCX_CUDA_IPC_CACHE": "n"},
               why="what the IPC handle cache is worth (expected slower)"),
        Config("no_memtype_cache", env={"UCX_MEMTYPE_CACHE": "n"},
               why="memory-type detection by a driver query on every send"),
        Config("frag_64m", env={"UCX_RNDV_FRAG_SIZE": "host:4M,cuda:64M"},
               why="bigger fragments should UCX pick a pipelined protocol"),
        Config("tcp", env={"UCX_TLS": "tcp,cuda_copy,self"}, chunks=[1],
               sizes=[16 * MIB, 256 * MIB], reps=3, raw_pieces=[1], timeout=40.0,
               why="no NVLink: staged through host memory over TCP (the cross-host floor)"),
    ]


def smoke_plan() -> list[Config]:
    return [
        Config("baseline", kind="baseline", timeout=60.0, why="host copy, in-process transport"),
        Config("default", env={"UCX_PROTO_INFO": "y"}, why="shared memory on the host"),
        Config("tcp", env={"UCX_TLS": "tcp,self"}, chunks=[1], reps=2, raw_pieces=[1],
               why="the environment reaches the child: TCP must differ from shared memory"),
    ]


def select(plan: list[Config], only: list[str] | None) -> list[Config]:
    """Keep the named configurations (baseline always: every ratio needs it), in plan order."""
    if not only:
        return plan
    unknown = set(only) - {c.name for c in plan} - {"combined"}
    if unknown:
        raise ValueError(f"unknown configurations {sorted(unknown)}; "
                         f"have {[c.name for c in plan]} and combined")
    return [c for c in plan if c.name in only or c.kind == "baseline"]


# ---- aggregation (pure) ---------------------------------------------------------------------


def _med(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def trace_path(t: dict[str, Any]) -> dict[str, float] | None:
    """One transfer's timeline (`UcxConnection.last_trace`) as telescoping phases (s) that sum
    to its total, plus diagnostics; None without the receiver's stamps."""
    rx = t.get("rx")
    if not rx or not t.get("ready") or not rx.get("landed"):
        return None
    ready, landed = t["ready"], rx["landed"]
    path = {"gather": ready[0], "first_chunk": landed[0] - ready[0],
            "rest_chunks": landed[-1] - landed[0], "scatter": rx["synced"] - landed[-1],
            "rx_tail": rx["ack"] - rx["synced"], "ack": t["acked"] - rx["ack"]}
    diag = {"header_in": rx["header"], "wire_last": landed[-1] - ready[-1],
            "sends_done": t["sent"], "total": t["acked"]}
    return {**path, **diag}


def _medians_ms(rows: list[dict[str, float]]) -> dict[str, float] | None:
    """Median of each key over rows of seconds, in ms; None without rows."""
    if not rows:
        return None
    return {k: round(_med([r[k] for r in rows]) * 1e3, 3) for k in rows[0]}


def phase_summary(traces: list[dict[str, Any]]) -> dict[str, float] | None:
    """Median of each phase over transfers, in ms."""
    return _medians_ms([p for p in map(trace_path, traces) if p])


def pull_phases(traces: list[dict[str, Any]]) -> dict[str, float] | None:
    """Medians (ms since `send_blocks` began) of a pull's milestones: the header in at the
    receiver, its ack sent (early: once the copy is queued), the ack in at the sender (after
    which it waited on the receiver's event) and the total."""
    return _medians_ms([{"header_in": t["rx"]["header"], "rx_ack": t["rx"]["ack"],
                         "total": t["acked"]}
                        for t in traces if (t.get("rx") or {}).get("ack") is not None])


def best_rows(rows: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """Per size: the chunk count with the highest median GB/s."""
    out: dict[int, dict[str, Any]] = {}
    for r in rows:
        b = r["bytes"]
        if b not in out or r["median_gb_s"] > out[b]["median_gb_s"]:
            out[b] = r
    return out


def peer_by_size(baseline: dict[str, Any] | None) -> dict[int, float]:
    rows = (baseline or {}).get("peer_copy") or []
    return {r["bytes"]: r["gb_s"] for r in rows if r.get("gb_s")}


def score(rows: list[dict[str, Any]], ref_rows: list[dict[str, Any]]) -> float | None:
    """Geometric mean over the sizes both measured of best GB/s relative to `ref_rows`."""
    mine, ref = best_rows(rows), best_rows(ref_rows)
    common = [b for b in mine if b in ref and ref[b]["median_gb_s"] > 0]
    if not common:
        return None
    prod = 1.0
    for b in common:
        prod *= mine[b]["median_gb_s"] / ref[b]["median_gb_s"]
    return round(prod ** (1 / len(common)), 4)


def combine(results: list[dict[str, Any]], ref: str = "default",
            better: float = BETTER) -> tuple[dict[str, str], list[str]]:
    """Merge the settings of every configuration that beat `ref` by `better`: best score
    first, a key already set by a better one is not overridden. Returns (settings, names)."""
    by = {r["name"]: r for r in results if r.get("status") == "ok" and r.get("rows")}
    if ref not in by:
        return {}, []
    ranked = sorted(((score(r["rows"], by[ref]["rows"]) or 0.0, n) for n, r in by.items()
                     if n != ref and r.get("settings")), reverse=True)
    merged: dict[str, str] = {}
    used = []
    for s, name in ranked:
        if s < better:
            break
        fresh = {k: v for k, v in by[name]["settings"].items() if k not in merged}
        if fresh:
            merged.update(fresh)
            used.append(name)
    return merged, used


def config_from_settings(name: str, settings: dict[str, str], why: str) -> Config:
    s = dict(settings)
    return Config(name, progress=s.pop("progress", "thread"), env=s, why=why)


def summarize(results: list[dict[str, Any]], baseline: dict[str, Any] | None) -> dict[str, Any]:
    """Per configuration and size: the best chunk count, its GB/s and ratio to peer copy;
    per size: the best configuration; each configuration's score against the default."""
    peer = peer_by_size(baseline)
    ref = next((r for r in results if r["name"] == "default" and r.get("rows")), None)
    by_config: dict[str, Any] = {}
    best: dict[str, Any] = {}
    for r in results:
        if not r.get("rows"):
            continue
        entry = {}
        for b, row in sorted(best_rows(r["rows"]).items()):
            vs = round(row["median_gb_s"] / peer[b], 3) if peer.get(b) else None
            entry[str(b)] = {"gb_s": row["median_gb_s"], "median_ms": row["median_ms"],
                             "chunks": row["chunks"], "vs_peer": vs}
            cur = best.get(str(b))
            if cur is None or row["median_gb_s"] > cur["gb_s"]:
                best[str(b)] = {"config": r["name"], "chunks": row["chunks"],
                                "gb_s": row["median_gb_s"], "vs_peer": vs}
        by_config[r["name"]] = {
            "best": entry,
            "score_vs_default": score(r["rows"], ref["rows"]) if ref else None}
        for kind in ("push", "pull"):  # the IPC rows, by the path they took
            mine = [p for p in r.get("pull") or [] if p.get("path") == kind]
            if mine:
                by_config[r["name"]][kind] = {
                    str(p["bytes"]): {"gb_s": p["median_gb_s"], "median_ms": p["median_ms"],
                                      "vs_peer": round(p["median_gb_s"] / peer[p["bytes"]], 3)
                                      if peer.get(p["bytes"]) else None,
                                      "phases_ms": p.get("phases_ms")} for p in mine}
    top = max((int(b) for b in best), default=None)
    goal = None
    if top is not None:
        vs = best[str(top)]["vs_peer"]
        goal = {"bytes": top, "target_vs_peer": GOAL_VS_PEER, "best_vs_peer": vs,
                "config": best[str(top)]["config"], "met": vs is not None and vs >= GOAL_VS_PEER}
    return {"peer_gb_s": {str(b): v for b, v in sorted(peer.items())},
            "by_config": by_config, "best": best, "goal": goal}


# ---- the child: one configuration ------------------------------------------------------------


def child_layout(gpu: bool):
    """Figure 4's block layout (Llama-3.1-8B shape: 2 MiB per 16-token bf16 block); on the
    host a narrow one so a smoke run moves a few MiB in several blocks."""
    from kvtransfer.layout import BlockLayout

    return BlockLayout("bench", "bfloat16", 16, 32, 8, 128 if gpu else 16, 0)


def child_versions() -> dict[str, Any]:
    import torch

    out: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                           "cuda": torch.version.cuda, "platform": platform.platform()}
    try:
        import ucxx

        out["ucxx"] = ucxx.__version__
        out["ucx"] = ".".join(map(str, ucxx.get_ucx_version()))
    except Exception as e:  # noqa: BLE001 - a missing library is a fact to record
        out["ucxx"] = f"not importable: {type(e).__name__}: {e}"
    if torch.cuda.is_available():
        n = torch.cuda.device_count()
        out["gpus"] = [torch.cuda.get_device_name(i) for i in range(n)]
        if n >= 2:
            out["peer_access_0_1"] = torch.cuda.can_device_access_peer(0, 1)
            out["peer_access_1_0"] = torch.cuda.can_device_access_peer(1, 0)
    return out


def child_baseline(spec: dict[str, Any]) -> dict[str, Any]:
    from bench import suite

    layout = child_layout(spec["gpu"])
    src, dst = spec["devices"]
    sizes, reps = spec["sizes"], spec["reps"]
    out = {"versions": child_versions(), "devices": spec["devices"]}
    out["peer_copy"] = suite.peer_copy(src, dst, sizes, reps)
    counts = sorted({max(1, s // layout.block_bytes) for s in sizes})
    try:
        out["local_transport"] = suite.local_transport(layout, src, dst, counts, reps)
    except Exception:  # noqa: BLE001 - the peer copy is what the ratios need
        out["local_transport_error"] = traceback.format_exc()
    return out


def child_ucx(spec: dict[str, Any], partial: Any = None) -> dict[str, Any]:
    """`partial(out)` (optional) is called after every size, so a child killed for time
    still leaves what it measured."""
    from kvtransfer import bench as kvb

    layout = child_layout(spec["gpu"])
    tx_dev, rx_dev = spec["devices"]
    sizes = spec["sizes"]
    blocks = {s: max(1, s // layout.block_bytes) for s in sizes}
    progress = spec["progress"]
    t0 = time.perf_counter()
    # The receiver process starts (imports, CUDA, UCX) while this one does the same.
    with ThreadPoolExecutor(1) as pool:
        # The receiver offers to pull (`kvtransfer.ipc`); the staged rows' sender declines.
        started = pool.submit(kvb.spawn_receiver, layout, max(blocks.values()), "worker",
                              progress=progress, device=rx_dev)
        versions = child_versions()
        import torch

        if str(tx_dev).startswith("cuda"):
            torch.cuda.set_device(tx_dev)
            torch.empty(1, device=tx_dev)  # the context, before the clock starts
        proc, pipe, address = started.result()
    out: dict[str, Any] = {"versions": versions, "startup_s": round(time.perf_counter() - t0, 2),
                           "rows": [], "raw": [], "pull": []}
    loop = asyncio.new_event_loop()  # ucxx binds to the first loop that uses it: keep one
    try:
        for s in sizes:
            # The staged path (gather, chunks, scatter), whose settings this sweep explores
            # (UCX messages: the receiver offers no pull, `kvtransfer.ipc`).
            ns = SimpleNamespace(blocks=blocks[s], chunks=spec["chunks"], checksum=False,
                                 progress=progress, reps=spec["reps"], device=tx_dev,
                                 trace=True, direct=[False], ipc=False)
            for row in loop.run_until_complete(kvb.measure(ns, layout, address)):
                traces = row.pop("traces", [])
                row["phases_ms"] = phase_summary(traces)
                if traces:  # the transfer nearest the median, whole
                    mid = sorted(traces, key=lambda t: t["acked"])[len(traces) // 2]
                    row["trace_median"] = mid
                out["rows"].append(row)
                if partial is not None:
                    partial(out)
                print(f"[sweep child] {s >> 10} KiB chunks={row['chunks']}: "
                      f"{row['median_gb_s']} GB/s {row['median_ms']} ms "
                      f"phases={row['phases_ms']}", flush=True)
            # The IPC paths (GPU caches: the sender copies into the receiver's cache, or the
            # receiver out of the sender's; UCX carries header and ack) under the same
            # setting: their control latency. Rows in "pull", each with the path it took.
            ns.ipc, ns.direct, ns.chunks = None, [None], [1]
            for ns.push in (None, False):
                for row in loop.run_until_complete(kvb.measure(ns, layout, address)):
                    row["phases_ms"] = pull_phases(row.pop("traces", []))
                    out["pull"].append(row)
                    if partial is not None:
                        partial(out)
                    print(f"[sweep child] {s >> 10} KiB {row['path']}: {row['median_gb_s']} "
                          f"GB/s {row['median_ms']} ms phases={row['phases_ms']}", flush=True)
            ns.push = None
        try:
            out["raw"] = loop.run_until_complete(asyncio.wait_for(kvb.measure_raw(
                address, tx_dev, sizes, spec["raw_pieces"], spec["reps"]), RAW_TIMEOUT_S))
        except Exception:  # noqa: BLE001 - the transport rows still count
            out["raw_error"] = traceback.format_exc()
    finally:
        if "raw_error" in out:  # its server may be stuck mid-request: no orderly stop
            proc.kill()
            proc.join(5)
        else:
            kvb.stop_receiver(proc, pipe, layout, timeout=10)
    out["measure_s"] = round(time.perf_counter() - t0 - out["startup_s"], 2)
    return out


def child_main(spec_path: str, result_path: str) -> int:
    with open(spec_path) as f:
        spec = json.load(f)

    def partial(out: dict[str, Any]) -> None:
        tmp = result_path + ".tmp"
        with open(tmp, "w") as f:
            json.dump({**out, "status": "partial"}, f, default=str)
        os.replace(tmp, result_path)

    try:
        res = (child_baseline(spec) if spec["kind"] == "baseline"
               else child_ucx(spec, partial))
        res["status"] = "ok"
    except Exception:  # noqa: BLE001
        res = {"status": "error", "error": traceback.format_exc()}
        print(res["error"], flush=True)
    with open(result_path, "w") as f:
        json.dump(res, f, default=str)
    return 0 if res["status"] == "ok" else 1


def child_exit(rc: int) -> None:
    """Leave without interpreter teardown: the result is written, and a UCX or CUDA teardown
    that blocks must not turn a finished configuration into a timeout."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


# ---- the parent: plan, children, budget, JSON ----------------------------------------------


def proto_lines(text: str, limit: int = PROTO_LINES) -> list[str]:
    """UCX's protocol-selection tables (UCX_PROTO_INFO=y) without the log prefix ([time]
    [host:pid:thread]): each distinct table once, those about GPU memory first."""
    tables: list[list[str]] = []
    for ln in text.splitlines():
        row = re.sub(r"^\[[^\]]*\]\s*\[[^\]]*\]\s*", "", ln).rstrip()
        if not row.lstrip().startswith(("|", "+")):
            continue
        if "ucp_context" in row or not tables:  # a table's title row
            tables.append([])
        tables[-1].append(row)
    distinct = list({"\n".join(t): t for t in tables}.values())
    distinct.sort(key=lambda t: "cuda" not in t[0].lower())  # stable: GPU tables first
    return [row for t in distinct for row in t][:limit]


def run_child(cfg: Config, spec: dict[str, Any], timeout: float, work: str) -> dict[str, Any]:
    """One configuration in its own process group, killed whole past `timeout` seconds."""
    base = os.path.join(work, cfg.name)
    with open(base + ".spec.json", "w") as f:
        json.dump(spec, f)
    env = {**os.environ, "UCX_WARN_UNUSED_ENV_VARS": "n", **cfg.env}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [env.get("PYTHONPATH"), ROOT]))
    cmd = [sys.executable, "-m", "bench.ucx_sweep", "--child", base + ".spec.json",
           "--result", base + ".result.json"]
    t0 = time.perf_counter()
    with open(base + ".log", "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout)
            status = None
        except subprocess.TimeoutExpired:
            rc, status = None, "timeout"
        finally:  # the receiver (a grandchild) shares the group: never leave it behind
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
    seconds = time.perf_counter() - t0
    with open(base + ".log", errors="replace") as f:
        text = f.read()
    res: dict[str, Any] = {}
    if os.path.exists(base + ".result.json"):  # a killed child may have left partial rows
        with open(base + ".result.json") as f:
            res = json.load(f)
    status = status or res.get("status") or f"error (exit {rc}, no result)"
    res.update({"name": cfg.name, "kind": cfg.kind, "why": cfg.why, "env": cfg.env,
                "progress": cfg.progress, "settings": cfg.settings(), "status": status,
                "rc": rc, "seconds": round(seconds, 1), "timeout_s": round(timeout, 1),
                "log_tail": text[-LOG_TAIL:]})
    if "UCX_PROTO_INFO" in cfg.env:
        res["proto_info"] = proto_lines(text)
    return res


def child_spec(cfg: Config, gpu: bool, args: argparse.Namespace) -> dict[str, Any]:
    sizes = cfg.sizes or (SMOKE_SIZES if not gpu else args.sizes)
    return {"kind": cfg.kind, "gpu": gpu,
            "devices": ["cuda:0", "cuda:1"] if gpu else ["cpu", "cpu"],
            "sizes": sizes, "chunks": cfg.chunks or (GPU_CHUNKS if gpu else SMOKE_CHUNKS),
            "reps": cfg.reps or args.reps, "progress": cfg.progress,
            "raw_pieces": cfg.raw_pieces or ([1, 8] if gpu else [1, 4])}


def host_facts() -> dict[str, Any]:
    """GPU topology as the driver reports it (no CUDA context in this process)."""
    out: dict[str, Any] = {"python": platform.python_version(), "platform": platform.platform(),
                           "cpus": os.cpu_count()}
    for key, cmd in (("nvidia_smi", ["nvidia-smi", "--query-gpu=index,name,driver_version,"
                                     "memory.total,pcie.link.gen.current",
                                     "--format=csv,noheader"]),
                     ("nvidia_smi_topo", ["nvidia-smi", "topo", "-m"])):
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=10)
            out[key] = (p.stdout or p.stderr).strip()[-3000:]
        except Exception as e:  # noqa: BLE001 - no driver tools: say so
            out[key] = f"unavailable: {type(e).__name__}"
    return out


def command_line() -> str:
    import shlex

    return shlex.join([os.path.basename(sys.executable), "-m", "bench.ucx_sweep"]
                      + sys.argv[1:])


def gpu_count() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # noqa: BLE001
        return 0


def print_summary(doc: dict[str, Any]) -> None:
    s = doc.get("summary") or {}
    peer = s.get("peer_gb_s", {})
    print(f"[sweep] peer copy GB/s: {peer}", flush=True)
    for r in doc["configs"]:
        mine = s.get("by_config", {}).get(r["name"]) or {}
        cells = " ".join(f"{int(b) >> 20}MiB={v['gb_s']}({v['vs_peer']}x,c{v['chunks']})"
                         for b, v in mine.get("best", {}).items())
        ipc = "".join(f" | {kind} " + " ".join(f"{int(b) >> 20}MiB={v['gb_s']}({v['vs_peer']}x)"
                                               for b, v in mine[kind].items())
                      for kind in ("push", "pull") if mine.get(kind))
        print(f"[sweep] {r['name']:<22} {r['status']:<8} {r.get('seconds', 0):6.1f}s {cells}"
              + ipc, flush=True)
    print(f"[sweep] best: {json.dumps(s.get('best'))}", flush=True)
    print(f"[sweep] goal: {json.dumps(s.get('goal'))}", flush=True)


def run_plan(args: argparse.Namespace) -> dict[str, Any]:
    t_start = time.perf_counter()
    deadline = t_start + args.budget
    n = gpu_count()
    gpu = n >= 2 and not args.cpu_smoke
    plan = gpu_plan() if gpu else smoke_plan()
    plan += [parse_config(x) for x in args.extra]
    plan = select(plan, args.only)
    want_combined = gpu and (not args.only or "combined" in args.only) and not args.no_combined
    doc: dict[str, Any] = {
        "name": "ucx_sweep", "command": command_line(), "argv": sys.argv,
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "mode": "gpu" if gpu else "cpu-smoke",
        "note": None if gpu else (f"{n} GPU(s) here: host buffers and tiny sizes, numbers "
                                  "mean nothing; this checks the plumbing"),
        "budget_s": args.budget, "host": host_facts(),
        "layout": child_layout(gpu).to_dict(), "block_bytes": child_layout(gpu).block_bytes,
        "configs": [], "skipped": []}
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "ucx_sweep.json")
    baseline: dict[str, Any] | None = None

    def save() -> None:
        doc["summary"] = summarize([r for r in doc["configs"] if r["kind"] == "ucx"],
                                   baseline)
        doc["elapsed_s"] = round(time.perf_counter() - t_start, 1)
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(doc, f, indent=1, default=str)
            f.write("\n")
        os.replace(tmp, path)

    queue = list(plan)
    combined_at = next((i for i, c in enumerate(queue) if c.name == "no_ipc_cache"), len(queue))
    with tempfile.TemporaryDirectory(prefix="ucx_sweep_") as work:
        i = 0
        while True:
            if want_combined and i == combined_at:  # after the single-setting variants
                want_combined = False
                settings, used = combine([r for r in doc["configs"] if r["kind"] == "ucx"])
                doc["combined_from"] = used
                if len(used) >= 2:  # one winner alone was measured already
                    queue.insert(i, config_from_settings(
                        "combined", settings, f"every winner merged: {', '.join(used)}"))
            if i >= len(queue):
                break
            cfg = queue[i]
            i += 1
            left = deadline - time.perf_counter() - args.reserve
            if left < args.min_config_s:
                doc["skipped"].append({"name": cfg.name, "why": f"budget: {left:.0f}s left"})
                print(f"[sweep] skip {cfg.name}: {left:.0f}s left", flush=True)
                continue
            timeout = min(cfg.timeout, left)
            print(f"[sweep] {cfg.name}: {cfg.why} (env {cfg.env}, progress {cfg.progress}, "
                  f"limit {timeout:.0f}s)", flush=True)
            res = run_child(cfg, child_spec(cfg, gpu, args), timeout, work)
            print(f"[sweep] {cfg.name}: {res['status']} in {res['seconds']}s", flush=True)
            if res["status"] != "ok":
                print(res["log_tail"][-1500:], flush=True)
            if cfg.kind == "baseline":
                baseline = res
                doc["baseline"] = res
                doc["versions"] = res.get("versions")
            else:
                doc["configs"].append(res)
            save()
    save()
    print_summary(doc)
    print(f"[sweep] wrote {path} in {doc['elapsed_s']}s", flush=True)
    return doc


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.ucx_sweep",
                                description=__doc__.splitlines()[0])
    p.add_argument("--out", default="bench/results", help="folder for ucx_sweep.json")
    p.add_argument("--budget", type=float, default=185.0,
                   help="seconds for the whole run; configurations that no longer fit are "
                        "skipped (default 185)")
    p.add_argument("--reserve", type=float, default=3.0, help="seconds kept for writing")
    p.add_argument("--min-config-s", type=float, default=12.0,
                   help="do not start a configuration with less than this left")
    p.add_argument("--reps", type=int, default=7, help="timed transfers per point")
    p.add_argument("--sizes", type=lambda s: [int(x) for x in s.split(",")],
                   default=GPU_SIZES, help="bytes per transfer, comma-separated (GPU)")
    p.add_argument("--cpu-smoke", action="store_true",
                   help="host buffers, tiny sizes, 2 configurations (automatic without 2 GPUs)")
    p.add_argument("--only", type=lambda s: [x for x in s.split(",") if x],
                   help="comma-separated configuration names (baseline always runs)")
    p.add_argument("--extra", action="append", default=[], metavar="NAME:K=V,K=V",
                   help="an extra configuration, e.g. mine:UCX_RNDV_SCHEME=put_zcopy,"
                        "progress=thread-polling (repeatable)")
    p.add_argument("--no-combined", action="store_true",
                   help="skip the configuration merged from the winners")
    p.add_argument("--list", action="store_true", help="print the plan and exit")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        child_exit(child_main(args.child, args.result))
    if args.list:
        gpu = gpu_count() >= 2 and not args.cpu_smoke
        plan = select((gpu_plan() if gpu else smoke_plan())
                      + [parse_config(x) for x in args.extra], args.only)
        for c in plan:
            print(json.dumps({**asdict(c), "spec": child_spec(c, gpu, args)}))
        return 0
    doc = run_plan(args)
    ok = [r for r in doc["configs"] if r["status"] == "ok"]
    return 0 if ok and (doc.get("baseline") or {}).get("status") == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())

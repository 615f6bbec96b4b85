"""Figure 5's workload and its prefill process: background decode streams, long prompts
arriving on a clock and the inter-token latency summary (shared by the colocated, in-process
and separate-process runs), and the prefill engine in a spawned process shipping its KV over
UCX into blocks the decode engine reserved, as the nodes do."""

from __future__ import annotations

import os
import statistics
import time
import traceback

from bench.common import SETTINGS_ENV, is_cuda, lazy_torch, precapture, random_engine, rnd
from engine.testing import llama8b_shape

FIG5_CHILD_TIMEOUT_S = 120.0  # the prefill process: start, build, warm, connect


FIG5_UCX_TIMEOUT_S = 60.0


def pct(xs: list[float], q: float):
    """Nearest-rank percentile (q in 0..100)."""
    import math

    if not xs:
        return None
    ys = sorted(xs)
    return ys[max(0, math.ceil(q / 100 * len(ys)) - 1)]


def itl_summary(gaps_s: list[float]) -> dict:
    ms = [g * 1e3 for g in gaps_s]
    return {"count": len(ms), "p50_ms": rnd(pct(ms, 50)), "p90_ms": rnd(pct(ms, 90)),
            "p99_ms": rnd(pct(ms, 99)), "max_ms": rnd(max(ms) if ms else None),
            "mean_ms": rnd(statistics.mean(ms) if ms else None)}


class Workload:
    """Background decode streams that keep running, and long prompts arriving on a clock.
    Records when each background stream got each token (host time after the step)."""

    def __init__(self, args, vocab: int):
        import random

        from engine import SamplingParams

        rng = random.Random(0)
        self.streams, self.arrivals = args.fig5_streams, args.fig5_arrivals
        self.interval = args.fig5_interval_ms / 1e3
        self.short = [[rng.randrange(vocab) for _ in range(args.fig5_short_len)]
                      for _ in range(self.streams)]
        self.long = [[rng.randrange(vocab) for _ in range(args.fig5_prompt_len)]
                     for _ in range(self.arrivals)]
        self.bg_params = SamplingParams(temperature=0, max_tokens=args.fig5_max_steps,
                                        ignore_eos=True)
        self.long_params = SamplingParams(temperature=0, max_tokens=args.fig5_long_tokens,
                                          ignore_eos=True)
        self.stamps: dict[str, list[float]] = {f"bg{i}": [] for i in range(self.streams)}
        self.arrived: dict[str, float] = {}
        self.first: dict[str, float] = {}  # long request -> time of its first token
        self.done: dict[str, float] = {}  # long request -> time it finished decoding
        self.tokens: dict[str, list[int]] = {}  # long request -> its output tokens
        self.t0 = None
        self.check_kv = bool(getattr(args, "fig5_check_kv", False))

    def record(self, outs, t: float) -> None:
        for o in outs:
            rid = o.request_id
            if rid in self.stamps and o.token_ids:
                self.stamps[rid].append(t)
            elif rid in self.arrived:
                self.tokens.setdefault(rid, []).extend(o.token_ids)
                if rid not in self.first and o.token_ids:
                    self.first[rid] = t
                if o.finished:
                    self.done[rid] = t

    def warm(self) -> bool:
        return all(len(v) >= 8 for v in self.stamps.values())

    def due(self, now: float) -> list[tuple[str, list[int]]]:
        """Long prompts whose arrival time has come and that were not added yet."""
        out = []
        for i in range(len(self.arrived), self.arrivals):
            rid = f"long{i}"
            if now < self.t0 + i * self.interval:
                break
            self.arrived[rid] = now
            out.append((rid, self.long[i]))
        return out

    def finished(self) -> bool:
        return len(self.done) == self.arrivals

    def summary(self, t_end: float) -> dict:
        quiet, busy = [], []
        for ts in self.stamps.values():
            for a, b in zip(ts, ts[1:]):
                (busy if self.t0 <= b <= t_end else quiet if b < self.t0 else []).append(b - a)
        ttft = [self.first[r] - self.arrived[r] for r in self.first]
        return {"itl_while_prompts_arrive": itl_summary(busy),
                "itl_before_arrivals": itl_summary(quiet),
                "window_s": rnd(t_end - self.t0),
                "long_ttft_ms": {"p50": rnd(pct([x * 1e3 for x in ttft], 50)),
                                 "max": rnd(max(ttft) * 1e3 if ttft else None),
                                 "all": [rnd(x * 1e3, 1) for x in ttft]},
                "background_tokens_in_window": len(busy),
                "background_tokens_per_stream": {r: len(ts) for r, ts in self.stamps.items()}}


FIG5_SMOKE = {"fig5_model": "tiny", "fig5_streams": 2, "fig5_short_len": 32,
              "fig5_arrivals": 2, "fig5_prompt_len": 128, "fig5_interval_ms": 50.0,
              "fig5_long_tokens": 8, "fig5_max_steps": 400, "fig5_step_limit": 2000,
              "fig5_check_kv": True}


def fig5_model(args, prompt_len: int):
    from engine.config import tiny_config

    need = max(prompt_len + args.fig5_long_tokens, args.fig5_short_len + args.fig5_max_steps)
    max_pos = -(-(need + 64) // 256) * 256
    if args.fig5_model == "tiny":
        return tiny_config(max_position=max_pos, vocab_size=256, name="tiny (random)")
    return llama8b_shape(max_position=max_pos)


def fig5_blocks(args) -> int:
    per_bg = -(-(args.fig5_short_len + args.fig5_max_steps + 16) // 16)
    per_long = -(-(args.fig5_prompt_len + args.fig5_long_tokens + 16) // 16)
    # + one long prompt's worth: the transport warm-up transfer lands in reserved blocks
    return args.fig5_streams * per_bg + (args.fig5_arrivals + 1) * per_long + 64


def fig5_devices(args) -> tuple[str, str]:
    """(decode, prefill): the decode engine (and the colocated one) on GPU 0, the prefill
    engine on GPU 1; on a CPU both are the CPU (a smoke test of the mechanics)."""
    return ("cuda:0", "cuda:1") if is_cuda(args) else (args.device, args.device)


def weights_fingerprint(eng) -> list[float]:
    """A strided sample of every weight, summed per tensor: equal lists mean the two engines
    (built in two processes from the same seed) hold the same random weights."""
    torch = lazy_torch()
    with torch.no_grad():
        return [float(p.detach().reshape(-1)[::4099].double().sum())
                for p in eng.model.parameters()]


def kv_checksum(kv, ids) -> int:
    """Exact, order-sensitive fingerprint of blocks `ids` of a KV tensor (all layers, K and
    V): the raw bits as 16-bit integers, summed per block, weighted by the block's position.
    (Random tiny models decode nearly the same tokens from any context: equal outputs alone
    would not show that the right KV arrived.)"""
    torch = lazy_torch()
    idx = torch.tensor(list(ids), dtype=torch.long, device=kv.device)
    bits = kv.index_select(2, idx).view(torch.int16).to(torch.int64)
    per_block = bits.sum(dim=(0, 1, 3, 4, 5))
    weight = torch.arange(1, len(ids) + 1, dtype=torch.int64, device=kv.device)
    return int((per_block * weight).sum())


def warm_engine(eng, w: Workload, batch_sizes) -> str:
    """Capture the decode graphs and JIT the prefill kernels once, outside the measurement."""
    note = precapture(eng, batch_sizes)  # with the split-KV variants: 8k contexts
    eng.generate([w.long[0]], w.long_params)
    return note


def start_background(eng, w: Workload) -> int:
    """Start the background decode streams and step them until warm (32 steps at least);
    the measured window starts now. Returns the steps taken."""
    for i, p in enumerate(w.short):
        eng.add_request(p, w.bg_params, request_id=f"bg{i}")
    steps = 0
    while not w.warm() or steps < 32:
        w.record(eng.step(), time.perf_counter())
        steps += 1
    w.t0 = time.perf_counter()
    return steps


def transfer_summary(rows: list[dict]) -> dict:
    if not rows:
        return {"count": 0}
    secs = [r["seconds"] for r in rows]
    total_b, total_s = sum(r["bytes"] for r in rows), sum(secs)
    out = {"count": len(rows), "bytes_total": total_b, "seconds_total": rnd(total_s, 4),
           "median_ms": rnd(statistics.median(secs) * 1e3),
           "max_ms": rnd(max(secs) * 1e3),
           "gb_s_overall": rnd(total_b / total_s / 1e9, 2) if total_s else None}
    paths = [r["path"] for r in rows if r.get("path")]
    if paths:  # how the blocks travelled (kvtransfer's pull, direct or staged path)
        out["paths"] = {p: paths.count(p) for p in sorted(set(paths))}
    checked = [r["kv_identical"] for r in rows if r.get("kv_identical") is not None]
    out["kv_identical"] = f"{sum(checked)}/{len(checked)}" if checked else "not checked"
    if rows[0].get("first_token_to_admit_ms") is not None:
        lat = [r["first_token_to_admit_ms"] for r in rows]
        out["first_token_to_admit_ms"] = {"p50": rnd(pct(lat, 50)), "max": rnd(max(lat))}
    return out


def fig5_ucx_problem(kind: str):
    """None when the UCX path can run in this process, else why not."""
    if kind == "in-process":
        return "--fig5-transport in-process"
    try:
        from kvtransfer import wire  # imports ucxx, after kvtransfer set UCX's environment
    except Exception as e:  # noqa: BLE001
        return f"ucxx not importable ({type(e).__name__}: {e})"
    bound = next(iter(getattr(wire, "_bound_loop", ())), None)
    if bound is not None and bound.is_closed():
        return "ucxx is bound to an event loop of this process that was closed"
    return None


class UcxLoop:
    """The event loop this process's UCX transports run on, driven from another thread (ucxx
    with thread progress serves one loop per process: a fresh one, or the loop an earlier
    figure bound it to, run here on a thread while figure 5 needs it)."""

    def __init__(self):
        import asyncio
        import threading

        from kvtransfer import wire

        bound = next(iter(getattr(wire, "_bound_loop", ())), None)
        self._thread = None
        self.loop = bound or asyncio.new_event_loop()
        if self.loop.is_running():  # someone else drives it already: share
            return
        self._thread = threading.Thread(target=self.loop.run_forever, name="fig5-ucx",
                                        daemon=True)
        self._thread.start()

    def submit(self, coro):
        import asyncio

        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro, timeout: float | None = FIG5_UCX_TIMEOUT_S):
        return self.submit(coro).result(timeout)

    def close(self) -> None:
        """Stop driving the loop; it stays open (ucxx stays bound to it for this process, so
        a later figure 5 in this process can drive it again)."""
        if self._thread is None:
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self._thread = None


def fig5_prefill_main(pipe, args, device: str) -> None:
    """The prefill process (spawned): the prefill engine on `device`, a UCX sender connected
    to the decode process, and a loop that prefills what the parent sends (hold=True), ships
    each request's blocks into the blocks the decode side reserved and reports the hand-off."""
    if os.environ.get(SETTINGS_ENV):  # the parent's --set values
        from bench.suite import apply_inherited
        apply_inherited()
    try:
        msg = pipe.recv()  # ("go", decode address): waits here while the parent runs colocated
        if msg[0] == "go":
            _prefill_serve(pipe, args, device, msg[1])
        else:  # stopped before it started
            pipe.send(("bye", {"started": False}))
    except (EOFError, BrokenPipeError, KeyboardInterrupt):
        pass  # the parent is gone or gave up: nothing left to report to
    except BaseException:  # noqa: BLE001 - the parent re-raises it with this traceback
        try:
            pipe.send(("error", traceback.format_exc()))
        except Exception:  # noqa: BLE001
            pass
        raise SystemExit(1) from None


def _prefill_serve(pipe, args, device: str, address: dict) -> None:
    from kvtransfer import LoopThread
    from kvtransfer.factory import make_transport
    from kvtransfer.layout import BlockLayout

    torch = lazy_torch()
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    else:  # a CPU smoke test: the decode process has the cores, do not fight it for them
        torch.set_num_threads(1)
    mcfg = fig5_model(args, args.fig5_prompt_len)
    t0 = time.perf_counter()
    pre = random_engine(args, mcfg, fig5_blocks(args), device=device)
    w = Workload(args, mcfg.vocab_size)
    graphs = warm_engine(pre, w, (1,))
    built_s = time.perf_counter() - t0
    lt = LoopThread("fig5-prefill-ucx")  # ucxx's loop in this process, driven from here
    if device.startswith("cuda"):  # that thread's CUDA calls go to this process's GPU too
        lt.run(_use_device(device), 30)
    tx = make_transport("ucx", BlockLayout.from_engine_config(pre.config))
    conn = None
    try:
        conn = lt.run(tx.connect(address), FIG5_UCX_TIMEOUT_S)
        pipe.send(("ready", {"pid": os.getpid(), "device": device, "graphs": graphs,
                             "build_and_warm_s": rnd(built_s, 1),
                             "fingerprint": weights_fingerprint(pre)}))
        _prefill_loop(pipe, pre, w, lt, conn)
    finally:
        if conn is not None:
            lt.run(conn.close(), 10)
        lt.run(tx.close(), 10)
        lt.close()


def _prefill_loop(pipe, pre, w: Workload, lt, conn) -> None:
    def stats_of(st, t_first: float, checksum=None) -> dict:
        return {"blocks": st.num_blocks, "bytes": st.bytes, "seconds": st.seconds,
                "first_token_at": t_first, "sent_at": time.perf_counter(),
                "src_checksum": checksum, "path": st.path}

    check = w.check_kv

    dst: dict[str, list[int]] = {}
    sending: dict = {}  # rid -> (send_blocks future, Handoff, first token time, checksum)
    shipped = 0
    stopping = False
    while not stopping or sending:
        idle = not pre.has_unfinished() and not sending
        while pipe.poll(0.0005 if idle else 0):
            idle = False
            msg = pipe.recv()
            if msg[0] == "prefill":
                _, rid, i, blocks = msg
                dst[rid] = blocks
                pre.add_request(w.long[i], w.long_params, request_id=rid, hold=True)
            elif msg[0] == "warm":  # one transfer before timing: UCX sets up its paths
                st = lt.run(_warm_send(conn, pre, msg[1]), FIG5_UCX_TIMEOUT_S)
                pipe.send(("warmed", stats_of(st, time.perf_counter())))
            elif msg[0] == "stop":
                stopping = True
                for rid in list(pre.seqs):
                    pre.abort(rid)
        if pre.has_unfinished():
            outs = pre.step()
            t = time.perf_counter()
            for o in outs:
                if o.token_ids or o.finished:
                    pipe.send(("out", o.request_id, list(o.token_ids), t,
                               o.finished and not o.handoff))
                if o.handoff:
                    rid = o.request_id
                    h = pre.export_handoff(rid)
                    src = pre.held_blocks(rid)
                    blocks = dst.pop(rid)
                    src = src[: len(blocks)]
                    fut = lt.submit(conn.send_blocks(rid, pre.kv_cache, src, blocks))
                    sending[rid] = (fut, h, t, kv_checksum(pre.kv_cache, src) if check else None)
        for rid, (fut, h, t, checksum) in list(sending.items()):
            if fut.done():
                del sending[rid]
                pre.release(rid)  # the lease ends with the receiver's ack
                st = fut.result(0)  # a failed transfer fails the figure
                shipped += st.bytes
                pipe.send(("handoff", rid, h, stats_of(st, t, checksum)))
    pipe.send(("bye", {"bytes_shipped": shipped, "held_left": len(pre.held)}))


async def _use_device(device: str) -> None:
    lazy_torch().cuda.set_device(device)


async def _warm_send(conn, pre, blocks: list[int]):
    """Blocks 0..n of the prefill cache (whatever they hold) into the decode side's blocks
    reserved as "warm": the decode side releases them unread."""
    return await conn.send_blocks("warm", pre.kv_cache, list(range(len(blocks))), blocks)


class PrefillProcess:
    """Parent's handle on the spawned prefill process; `close()` always leaves no child."""

    def __init__(self, args, device: str):
        import multiprocessing as mp

        ctx = mp.get_context("spawn")  # never fork a process that holds CUDA / UCX state
        self.pipe, theirs = ctx.Pipe()
        self.proc = ctx.Process(target=fig5_prefill_main, args=(theirs, args, device),
                                name="fig5-prefill", daemon=True)
        self.proc.start()
        theirs.close()
        self.bye = None

    def send(self, msg) -> None:
        self.pipe.send(msg)

    def _check(self, msg):
        if msg[0] == "error":
            raise RuntimeError(f"the prefill process failed:\n{msg[1]}")
        return msg

    def messages(self) -> list:
        """What the child sent so far (never blocks); raises if it failed or died."""
        out = []
        while self.pipe.poll(0):
            out.append(self._check(self.pipe.recv()))
        if not out and not self.proc.is_alive():
            raise RuntimeError(f"the prefill process died (exit code {self.proc.exitcode})")
        return out

    def expect(self, kind: str, timeout: float):
        """Wait for the child's next message, which must be `kind`."""
        deadline = time.perf_counter() + timeout
        while not self.pipe.poll(0.05):
            if not self.proc.is_alive() and not self.pipe.poll(0):
                raise RuntimeError(f"the prefill process died (exit code {self.proc.exitcode})")
            if time.perf_counter() > deadline:
                raise TimeoutError(f"no {kind!r} from the prefill process in {timeout:.0f}s")
        msg = self._check(self.pipe.recv())
        if msg[0] != kind:
            raise RuntimeError(f"prefill process said {msg[0]!r}, expected {kind!r}")
        return msg

    def close(self, timeout: float = 30.0) -> int | None:
        """Ask the child to stop (it finishes the sends in flight and says bye), then make
        sure it is gone: joined, or killed."""
        if self.proc.is_alive():
            try:
                self.send(("stop",))
                deadline = time.perf_counter() + timeout
                while self.bye is None and time.perf_counter() < deadline:
                    if self.pipe.poll(0.05):
                        msg = self.pipe.recv()  # late outputs are dropped; an error is kept
                        if msg[0] == "bye":
                            self.bye = msg[1]
                        elif msg[0] == "error":
                            self.bye = {"error": msg[1]}
                    elif not self.proc.is_alive():
                        break
            except Exception as e:  # noqa: BLE001 - a dead or stuck child is killed below
                self.bye = {"error": f"{type(e).__name__}: {e}"}
        self.proc.join(timeout if self.bye is not None else 1)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(10)
        self.pipe.close()
        return self.proc.exitcode

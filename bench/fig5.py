"""Figure 5: inter-token latency of running decodes while long prompts arrive, colocated
(one engine) against disaggregated (a prefill engine in its own process, KV over UCX, as
deployed). Run through `bench/suite.py` (`--figures 5`)."""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import traceback

from bench.common import (
    _torch,
    free_memory,
    is_cuda,
    llama8b_shape,
    log,
    precapture,
    random_engine,
    ratio,
    rnd,
)

# ---- figure 5: inter-token latency, colocated vs disaggregated ------------------------------


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
FIG5_CHILD_TIMEOUT_S = 120.0  # the prefill process: start, build, warm, connect
FIG5_UCX_TIMEOUT_S = 60.0


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
    torch = _torch()
    with torch.no_grad():
        return [float(p.detach().reshape(-1)[::4099].double().sum())
                for p in eng.model.parameters()]


def kv_checksum(kv, ids) -> int:
    """Exact, order-sensitive fingerprint of blocks `ids` of a KV tensor (all layers, K and
    V): the raw bits as 16-bit integers, summed per block, weighted by the block's position.
    (Random tiny models decode nearly the same tokens from any context: equal outputs alone
    would not show that the right KV arrived.)"""
    torch = _torch()
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


def run_colocated(eng, w: Workload, step_limit: int, deadline_s: float) -> dict:
    steps = start_background(eng, w)
    while not w.finished() and steps < step_limit and time.perf_counter() - w.t0 < deadline_s:
        for rid, p in w.due(time.perf_counter()):
            eng.add_request(p, w.long_params, request_id=rid)
        w.record(eng.step(), time.perf_counter())
        steps += 1
    t_end = time.perf_counter()
    for rid in list(eng.seqs):
        eng.abort(rid)
    out = w.summary(t_end)
    out["steps"] = steps
    out["complete"] = w.finished()
    return out


# -- the product path: prefill engine in its own process, KV over UCX -------------------------


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

    torch = _torch()
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
    _torch().cuda.set_device(device)


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


def run_disaggregated_process(args, pp: PrefillProcess, ucx: UcxLoop, rx, dec, w: Workload,
                              step_limit: int, deadline_s: float) -> dict:
    """This process is the decode node (and the router's clock): on each arrival it reserves
    blocks on `dec` and asks the prefill process to prefill into them; the prefill process
    ships the KV over UCX and sends the Handoff; `dec` admits it once `rx` says the blocks
    landed. The background streams decode on `dec` throughout; this loop is the one measured."""
    plen = args.fig5_prompt_len
    pending: dict = {}  # rid -> (future of rx.recv_blocks, Handoff, transfer stats)
    reserved: dict[str, list[int]] = {}
    transfers: list[dict] = []

    def handle(msg) -> None:
        kind, rid = msg[0], msg[1]
        if kind == "out":  # the long request's first token, straight from prefill
            _, _, toks, t, finished = msg
            w.tokens.setdefault(rid, []).extend(toks)
            if toks and rid not in w.first:
                w.first[rid] = t
            if finished:  # done at its first token: nothing will arrive
                w.done[rid] = t
                dec.release(rid)
        elif kind == "handoff":
            _, _, h, st = msg
            pending[rid] = (ucx.submit(rx.recv_blocks(rid, FIG5_UCX_TIMEOUT_S)), h, st)
        else:
            raise RuntimeError(f"unexpected message from the prefill process: {msg[:2]}")

    steps = start_background(dec, w)
    while not w.finished() and steps < step_limit and time.perf_counter() - w.t0 < deadline_s:
        for rid, _ in w.due(time.perf_counter()):
            reserved[rid] = dec.reserve(rid, plen)
            pp.send(("prefill", rid, int(rid.removeprefix("long")), reserved[rid]))
        for msg in pp.messages():
            handle(msg)
        for rid, (fut, h, st) in list(pending.items()):
            if fut.done():
                del pending[rid]
                fut.result()  # a transfer the receiver failed fails the figure
                same = None
                if w.check_kv:  # before admit: decoding appends to the last block
                    blocks = reserved[rid][: st["blocks"]]
                    same = kv_checksum(dec.kv_cache, blocks) == st["src_checksum"]
                dec.admit(h)
                t = time.perf_counter()
                transfers.append({"request_id": rid, "blocks": st["blocks"],
                                  "bytes": st["bytes"], "seconds": rnd(st["seconds"], 5),
                                  "gb_s": rnd(st["bytes"] / max(st["seconds"], 1e-9) / 1e9, 2),
                                  "first_token_to_admit_ms": rnd(
                                      (t - st["first_token_at"]) * 1e3),
                                  "kv_identical": same, "path": st.get("path")})
        if dec.has_unfinished():
            w.record(dec.step(), time.perf_counter())
            steps += 1
        else:
            time.sleep(0.0002)
    t_end = time.perf_counter()
    for rid in list(dec.seqs) + list(dec.reserved):
        dec.abort(rid)
    for rid, (fut, _, _) in pending.items():
        fut.cancel()
        rx.inbox.discard(rid)
    out = w.summary(t_end)
    out["decode_steps"] = steps
    out["complete"] = w.finished()
    out["kv_transfers"] = transfer_summary(transfers)
    out["kv_transfer_rows"] = transfers
    return out


def fig5_process_row(args, res: dict, dec, w: Workload, pp: PrefillProcess, dev_prefill: str,
                     batches) -> tuple[dict, Workload]:
    """Start the UCX receiver on `dec`'s cache, let the prefill process build and connect,
    warm the link with one transfer, then measure. Everything it started is closed here."""
    from kvtransfer.factory import make_transport
    from kvtransfer.layout import BlockLayout

    torch = _torch()
    layout = BlockLayout.from_engine_config(dec.config)
    ucx = UcxLoop()
    rx = make_transport("ucx", layout, dec.kv_cache)
    started = False
    try:
        ucx.run(rx.start())
        started = True
        pp.send(("go", rx.address))  # the child builds its engine while we warm ours
        res["graphs"]["decode"] = warm_engine(dec, w, batches)
        ready = pp.expect("ready", FIG5_CHILD_TIMEOUT_S)[1]
        res["graphs"]["prefill"] = ready["graphs"]
        same = ready.pop("fingerprint") == weights_fingerprint(dec)
        res["prefill_process"] = {**ready, "weights_identical_to_decode": same}
        log(f"fig 5: prefill process {ready['pid']} ready on {dev_prefill} "
            f"({ready['build_and_warm_s']} s); same weights: {same}")
        blocks = dec.reserve("warm", args.fig5_prompt_len)
        pp.send(("warm", blocks))
        warm = pp.expect("warmed", FIG5_UCX_TIMEOUT_S)[1]
        ucx.run(rx.recv_blocks("warm", FIG5_UCX_TIMEOUT_S))
        dec.release("warm")
        res["prefill_process"]["warmup_transfer"] = {
            "blocks": warm["blocks"], "bytes": warm["bytes"],
            "ms": rnd(warm["seconds"] * 1e3)}
        if torch.device(dec.config.device).type == "cuda":
            torch.cuda.synchronize(dec.config.device)
        log("fig 5: disaggregated (separate processes, UCX)")
        w2 = Workload(args, dec.config.model.vocab_size)
        row = run_disaggregated_process(args, pp, ucx, rx, dec, w2, args.fig5_step_limit,
                                        args.fig5_deadline_s)
        row["path"] = "processes+ucx"
        return row, w2
    finally:
        exitcode = pp.close()
        res.setdefault("prefill_process", {}).update(exit_code=exitcode, bye=pp.bye)
        if started:
            try:
                ucx.run(rx.close(), 15)
            except Exception as e:  # noqa: BLE001
                res["prefill_process"]["receiver_close"] = f"{type(e).__name__}: {e}"
        ucx.close()


# -- the in-process variant: both engines in this process, KV by a plain copy ---------------


def run_disaggregated(args, pre, dec, w: Workload, step_limit: int,
                      deadline_s: float) -> dict:
    """Both engines in this process (sharing its GIL): the prefill engine in this thread, the
    decode engine on its own thread (own GPU). Long prompts prefill on `pre` (hold=True),
    their KV blocks are copied into blocks reserved on `dec`, and `dec` admits them; the
    background streams decode on `dec` throughout."""
    import concurrent.futures
    import queue
    import threading

    torch = _torch()
    ctrl: queue.SimpleQueue = queue.SimpleQueue()
    stop = threading.Event()
    failure: list[BaseException] = []
    counter = {"steps": 0}
    dec_dev = torch.device(dec.config.device)
    block_bytes = dec.kv_cache[:, :, 0].numel() * dec.kv_cache.element_size()

    def decode_loop():
        try:
            if dec_dev.type == "cuda":
                torch.cuda.set_device(dec_dev)
            while not stop.is_set():
                while True:
                    try:
                        fn, fut = ctrl.get_nowait()
                    except queue.Empty:
                        break
                    try:
                        fut.set_result(fn(dec))
                    except Exception as e:  # noqa: BLE001
                        fut.set_exception(e)
                if dec.has_unfinished() and counter["steps"] < step_limit:
                    w.record(dec.step(), time.perf_counter())
                    counter["steps"] += 1
                else:
                    time.sleep(0.0002)
        except BaseException as e:  # noqa: BLE001
            failure.append(e)

    def on_decode(fn, wait: bool = True):
        fut: concurrent.futures.Future = concurrent.futures.Future()
        ctrl.put((fn, fut))
        return fut.result(timeout=120) if wait else fut

    side = torch.cuda.Stream(device=dec_dev) if dec_dev.type == "cuda" else None
    copies, admits = [], []

    def hand_off(rid: str) -> None:
        h = pre.export_handoff(rid)
        src = pre.held_blocks(rid)
        dst = on_decode(lambda e: e.reserve(rid, h.num_computed))
        t0 = time.perf_counter()
        copy_kv(pre.kv_cache, dec.kv_cache, src[: len(dst)], dst, side)
        secs = time.perf_counter() - t0
        same = (kv_checksum(pre.kv_cache, src[: len(dst)]) == kv_checksum(dec.kv_cache, dst)
                if w.check_kv else None)
        copies.append({"request_id": rid, "blocks": len(dst), "bytes": len(dst) * block_bytes,
                       "seconds": rnd(secs, 5),
                       "gb_s": rnd(len(dst) * block_bytes / max(secs, 1e-9) / 1e9, 2),
                       "kv_identical": same})
        pre.release(rid)
        admits.append(on_decode(lambda e: e.admit(h), wait=False))

    for i, p in enumerate(w.short):
        dec.add_request(p, w.bg_params, request_id=f"bg{i}")
    old = sys.getswitchinterval()
    sys.setswitchinterval(0.0005)  # two busy Python threads: hand the GIL over quickly
    th = threading.Thread(target=decode_loop, name="bench-decode", daemon=True)
    th.start()
    try:
        while not (w.warm() and counter["steps"] >= 32):
            if failure or not th.is_alive():
                raise RuntimeError("decode thread died") from (failure[0] if failure else None)
            time.sleep(0.001)
        w.t0 = time.perf_counter()
        while (not w.finished() and counter["steps"] < step_limit
               and time.perf_counter() - w.t0 < deadline_s):
            if failure:
                raise RuntimeError("decode thread failed") from failure[0]
            for rid, p in w.due(time.perf_counter()):
                pre.add_request(p, w.long_params, request_id=rid, hold=True)
            if pre.has_unfinished():
                outs = pre.step()
                t = time.perf_counter()
                for o in outs:
                    w.tokens.setdefault(o.request_id, []).extend(o.token_ids)
                    if o.token_ids and o.request_id not in w.first:
                        w.first[o.request_id] = t
                    if o.handoff:
                        hand_off(o.request_id)
                    elif o.finished:  # finished at its first token: nothing to hand off
                        w.done[o.request_id] = t
            else:
                time.sleep(0.0005)
        t_end = time.perf_counter()
    finally:
        stop.set()
        th.join(timeout=60)
        sys.setswitchinterval(old)
    for f in admits:
        if f.done():
            f.result()  # an admit that raised
    if failure:
        raise RuntimeError("decode thread failed") from failure[0]
    for rid in list(dec.seqs) + list(dec.reserved):
        dec.abort(rid)
    for rid in list(pre.seqs) + list(pre.held):
        pre.abort(rid)
    out = w.summary(t_end)
    out["decode_steps"] = counter["steps"]
    out["complete"] = w.finished()
    out["kv_transfers"] = transfer_summary(copies)
    out["kv_transfer_rows"] = copies
    out["path"] = "in-process"
    return out


def copy_kv(src_kv, dst_kv, src_ids, dst_ids, stream=None) -> None:
    """Blocks src_ids of src_kv into blocks dst_ids of dst_kv (all layers, K and V), on a side
    stream of the destination GPU so the decode engine's own stream never waits on it."""
    import contextlib

    torch = _torch()
    ctx = torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
    with ctx:
        data = src_kv.index_select(2, torch.tensor(src_ids, device=src_kv.device))
        data = data.to(dst_kv.device, non_blocking=True)
        dst_kv.index_copy_(2, torch.tensor(dst_ids, device=dst_kv.device), data)
    if stream is not None:
        stream.synchronize()


def fig5_in_process_row(args, res: dict, dec, w: Workload, dev_prefill: str, batches):
    """The one-process variant: a prefill engine on `dev_prefill` built here with `dec`'s
    weights, the decode engine on its own thread of this process."""
    import contextlib

    torch = _torch()
    on_dev = (torch.cuda.device(dev_prefill) if dev_prefill.startswith("cuda")
              else contextlib.nullcontext())
    with on_dev, torch.no_grad():
        pre = random_engine(args, dec.config.model, dec.num_blocks, device=dev_prefill)
        for a, b in zip(pre.model.parameters(), dec.model.parameters()):
            a.copy_(b)  # the same weights as the decode (and colocated) engine
        res["graphs"]["in_process_prefill"] = warm_engine(pre, w, (1,))
    res["graphs"]["in_process_decode"] = warm_engine(dec, w, batches)
    log("fig 5: disaggregated (one process, in-process copy)")
    w2 = Workload(args, dec.config.model.vocab_size)
    row = run_disaggregated(args, pre, dec, w2, args.fig5_step_limit, args.fig5_deadline_s)
    return row, w2


FIG5_PATHS = {
    "processes+ucx":
        "separate processes: the prefill engine in a spawned process on {prefill}, the decode "
        "engine in this one on {decode}; on each arrival this process reserves blocks on the "
        "decode engine (Engine.reserve), the prefill process prefills (hold=True), ships the "
        "request's KV blocks into them over UCX (kvtransfer UcxTransport, worker address, as "
        "prefill_node/decode_node do), releases its copy on the receiver's ack and sends the "
        "Handoff; the decode engine admits it once its receiver says the blocks landed. The "
        "link is warmed by one transfer before timing",
    "in-process":
        "one process (engines share the GIL): the prefill engine on {prefill} in the main "
        "thread, the decode engine on {decode} on its own thread; KV by an in-process copy "
        "(index_select, device copy, index_copy on a side stream of the decode device), no "
        "UCX, no second process",
}


def fig_itl_disagg(args, res: dict) -> None:
    torch = _torch()
    if getattr(args, "fig5_smoke", False):
        args = argparse.Namespace(**{**vars(args), **FIG5_SMOKE})
    if is_cuda(args) and torch.cuda.device_count() < 2:
        res["skipped"] = "needs 2 GPUs"
        return
    dev_dec, dev_pre = fig5_devices(args)  # CPU: a smoke test of the mechanics
    why_not_ucx = fig5_ucx_problem(args.fig5_transport)
    if why_not_ucx and args.fig5_transport == "ucx":
        raise RuntimeError(f"--fig5-transport ucx: {why_not_ucx}")
    main_path = "in-process" if why_not_ucx else "processes+ucx"
    mcfg = fig5_model(args, args.fig5_prompt_len)
    nb = fig5_blocks(args)
    limit = args.fig5_step_limit
    batches = list(range(1, args.fig5_streams + args.fig5_arrivals + 1))
    res["config"] = {
        "smoke": bool(getattr(args, "fig5_smoke", False)),
        "model": mcfg.name, "dtype": args.dtype, "background_streams": args.fig5_streams,
        "background_prompt_tokens": args.fig5_short_len, "long_prompts": args.fig5_arrivals,
        "long_prompt_tokens": args.fig5_prompt_len, "long_max_tokens": args.fig5_long_tokens,
        "arrival_interval_ms": args.fig5_interval_ms, "num_blocks": nb,
        "step_limit": limit, "deadline_s": args.fig5_deadline_s,
        "kv_checksums": bool(args.fig5_check_kv),
        "speculation": "none",
        "devices": {"colocated": dev_dec, "prefill": dev_pre, "decode": dev_dec},
        "itl": "gaps between successive tokens of the background streams (host time after "
               "each decode step), for gaps ending between the first arrival and the last long "
               "request's finish",
        "disaggregated_path": main_path,
        "transport": FIG5_PATHS[main_path].format(prefill=dev_pre, decode=dev_dec),
        "ucx_unavailable": why_not_ucx}
    if main_path == "processes+ucx":
        res["config"]["clock"] = ("TTFT and transfer latencies mix timestamps of the two "
                                  "processes: time.perf_counter, one system-wide monotonic "
                                  "clock on Linux")
        extra = args.fig5_in_process_row
        res["config"]["in_process_row"] = FIG5_PATHS["in-process"].format(
            prefill=dev_pre, decode=dev_dec) if extra else "skipped (--no-fig5-in-process-row)"
    # Spawned now: it imports while the colocated run goes, and waits for "go" to build.
    pp = PrefillProcess(args, dev_pre) if main_path == "processes+ucx" else None
    try:
        log(f"fig 5: building engines ({mcfg.name}, {nb} blocks each)")
        base = random_engine(args, mcfg, nb, device=dev_dec)
        res["config"]["max_num_batched_tokens"] = base.config.max_num_batched_tokens
        res["config"]["attention_backend"] = base.config.backend_name
        w = Workload(args, mcfg.vocab_size)
        res["graphs"] = {"colocated": warm_engine(base, w, batches)}
        log("fig 5: colocated")
        res["colocated"] = co = run_colocated(base, w, limit, args.fig5_deadline_s)
        log(f"fig 5: colocated ITL {co['itl_while_prompts_arrive']}")
        dec = base.with_config()  # same weights, fresh KV cache and queues
        base = None
        free_memory()
        rows = {}
        if pp is not None:
            rows["disaggregated"] = fig5_process_row(args, res, dec, w, pp, dev_pre, batches)
            pp = None
            if args.fig5_in_process_row:
                dec = dec.with_config()
                free_memory()
                rows["disaggregated_in_process"] = fig5_in_process_row(
                    args, res, dec, w, dev_pre, batches)
        else:
            rows["disaggregated"] = fig5_in_process_row(args, res, dec, w, dev_pre, batches)
            rows["disaggregated"][0]["path"] = f"in-process (fallback: {why_not_ucx})"
    finally:
        if pp is not None:  # an error before the process row took it over
            pp.close(timeout=5)
    dec = None
    free_memory()
    for key, (row, _) in rows.items():
        res[key] = row
    c = co["itl_while_prompts_arrive"]
    res["ratios"] = {"colocated_p99_over_idle_p99": ratio(
        c["p99_ms"], co["itl_before_arrivals"]["p99_ms"])}
    for key, (row, w2) in rows.items():
        d = row["itl_while_prompts_arrive"]
        log(f"fig 5: {key} ({row['path']}) ITL {d}; KV {row['kv_transfers']}")
        same = [w.tokens.get(r) == w2.tokens.get(r) for r in w.tokens]
        row["long_outputs_identical_to_colocated"] = f"{sum(same)}/{len(same)}"
        row["long_tokens_per_request"] = {r: len(t) for r, t in sorted(w2.tokens.items())}
        row["p99_over_idle_p99"] = ratio(d["p99_ms"], row["itl_before_arrivals"]["p99_ms"])
        res["ratios"][f"p99_itl_colocated_over_{key}"] = ratio(c["p99_ms"], d["p99_ms"])
        res["ratios"][f"p50_itl_colocated_over_{key}"] = ratio(c["p50_ms"], d["p50_ms"])
        res["ratios"][f"long_ttft_p50_{key}_over_colocated"] = ratio(
            row["long_ttft_ms"]["p50"], co["long_ttft_ms"]["p50"])
    main = res["disaggregated"]
    res["long_outputs_identical_colocated_vs_disaggregated"] = \
        main["long_outputs_identical_to_colocated"]
    res["goals"] = {"disaggregated_path": main["path"],
                    "disaggregated_p99_over_idle_p99": main["p99_over_idle_p99"],
                    "disaggregated_p99_at_most_1.2x_idle": (
                        None if main["p99_over_idle_p99"] is None
                        else main["p99_over_idle_p99"] <= 1.2)}
    if not all(r[0]["complete"] for r in rows.values()) or not co["complete"]:
        res["warning"] = ("a run hit --fig5-step-limit or --fig5-deadline-s before every long "
                          "request finished")


def plot_itl(plt, res):
    fig, ax = plt.subplots(figsize=(7, 4))
    names = [n for n in ("colocated", "disaggregated", "disaggregated_in_process") if n in res]
    labels = {"colocated": "colocated", "disaggregated": res["disaggregated"]["path"],
              "disaggregated_in_process": "in-process"}
    for i, key in enumerate(("p50_ms", "p99_ms")):
        vals = [res[n]["itl_while_prompts_arrive"][key] or 0 for n in names]
        ax.bar([j + 0.4 * i for j in range(len(names))], vals, width=0.4,
               label=key.replace("_ms", ""))
    ax.set_xticks([j + 0.2 for j in range(len(names))], [labels[n] for n in names])
    ax.set_yscale("log")
    ax.set_ylabel("inter-token latency, ms")
    ax.legend()
    ax.set_title(f"fig 5: {res['config']['long_prompts']} x "
                 f"{res['config']['long_prompt_tokens']}-token prompts arriving")
    return fig

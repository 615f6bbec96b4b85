"""Figure 5's product path: the prefill engine in a spawned process, its KV shipped over UCX
into blocks the decode engine in this process reserved, as the nodes do."""

from __future__ import annotations

import os
import time
import traceback

from bench.common import lazy_torch, log, random_engine, rnd
from bench.fig5_workload import (
    Workload,
    fig5_blocks,
    fig5_model,
    kv_checksum,
    start_background,
    transfer_summary,
    warm_engine,
    weights_fingerprint,
)

FIG5_CHILD_TIMEOUT_S = 120.0  # the prefill process: start, build, warm, connect


FIG5_UCX_TIMEOUT_S = 60.0


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


def run_disaggregated_process(args, pp: PrefillProcess, ucx: UcxLoop, rx, dec, w: Workload,
                              step_limit: int, deadline_s: float) -> dict:
    """This process is the decode node and the router's clock: each arrival reserves blocks on
    `dec` and asks the prefill process to fill them over UCX; `dec` admits it once `rx` says
    the blocks landed. Background streams decode on `dec` throughout; this loop is measured."""
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

    torch = lazy_torch()
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

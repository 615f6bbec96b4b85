"""UCX transport on ucxx: shared memory on one host, TCP (or RDMA) between hosts.

Two ways to reach a receiver, both over the same tagged protocol (see `wire`):
- `mode="worker"` (default): the address is the receiver's UCX worker address, exchanged out
  of band (through Ray). Endpoint error handling is off on both sides, which is what lets UCX
  pick shared memory (sm/cma) on one host. The sender puts its own worker address in the
  hello so the receiver can open the reverse endpoint for replies and acks.
- `mode="listener"`: the address is host:port of a UCX listener (TCP connection setup). UCX
  requires error handling on for these endpoints here (off is refused as "asymmetric").

A request is: header (request id, dst ids, layer chunks or direct runs, extras spec) -> the
payload -> extras blob -> optional crc32 trailer; then the receiver acks, and the sender returns
on the ack. The payload takes one of four paths, per request:
- push (`ipc`): where both caches are on GPUs of one host and the sender sees the receiver's
  GPU, no payload message at all: the sender copies the blocks into the receiver's cache
  (mapped once per link through CUDA IPC, exported in the hello reply) on its own stream right
  after its writes, then sends the header naming an event after the copy; the receiver acks at
  once and hands the blocks on once that event has fired;
- pull (`ipc`): the same, the other way round, where only the receiver sees the other's GPU
  (or push is off): the header names the sender's blocks and the receiver copies them out of
  the sender's cache (mapped once per link) on its own stream;
otherwise `wire.plan_direct` picks:
- staged: one message per layer chunk of blocks gathered into a staging buffer; the receiver
  scatters each chunk into its kv_cache as it lands;
- direct: where the src and dst ids run in step (`wire.block_runs`) and the messages are large,
  one message per (layer, K/V, run) straight from the sender's cache into the receiver's, with
  no copy on either side. The sender posts them with the header, so the data does not wait
  for the header's trip: UCX holds an early rendezvous until the receive is posted.

Whatever a peer sends is checked before it is used (`wire.check_*`). A message that is
malformed, larger than the buffer posted for it, or undecodable is dropped, logged and counted
(`dropped_messages`); the request it still names fails at once on both ends (an error ack, an
error in the inbox), and the loop goes on. `healthy` turns False only where a receive loop dies
of something else. A sender refuses, before sending anything, a request id longer than
`MAX_REQUEST_ID_BYTES` or a header larger than the receiver's buffer (`RequestTooLarge`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import Any

import torch
import ucxx

from kvtransfer import ipc, staging, wire
from kvtransfer.base import Extras, OnReceive, TransferError, Transport, check_block_ids
from kvtransfer.ipc import DEFAULT_ENGINE  # `ipc` names an argument below
from kvtransfer.ipc import ENGINES as PULL_ENGINES
from kvtransfer.layout import BlockLayout, LayoutMismatch, check_compatible
from kvtransfer.ucx_send import UcxConnection

log = logging.getLogger(__name__)
MODES = ("worker", "listener")


class UcxTransport(Transport):
    """A UCX end. Receivers call `start()`; senders only `connect()`. `mode` is how this end
    receives (the kind of address it publishes); a sender follows the receiver's address.

    `progress_mode` is process-wide in ucxx (the first transport decides); see
    `wire.ensure_ucx`. `thread` (default) is the only mode that idles at ~0 CPU, and it was also
    the fastest here (2.5 GB/s vs 1.3 for `blocking`, 93 MiB between two processes). It binds
    ucxx to one event loop per process.
    """

    def __init__(self, layout: BlockLayout, kv_cache: torch.Tensor | None = None,
                 on_receive: OnReceive | None = None, *, mode: str = "worker",
                 host: str = "127.0.0.1", port: int = 0, num_chunks: int = 1,
                 checksum: bool = False,
                 timeout: float = 30.0, progress_mode: str = "thread",
                 direct: bool | None = None, ipc: bool | None = None,
                 pull_engine: str = DEFAULT_ENGINE, push: bool | None = None,
                 pull: bool | None = None):
        super().__init__(layout, kv_cache, on_receive)
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        self.mode, self.host, self.port = mode, host, port
        self.num_chunks, self.checksum, self.timeout = num_chunks, checksum, timeout
        self.direct = direct  # None: per request by message size; False: always staged
        # None: copy through CUDA IPC (push or pull, `push` / `pull` below) wherever both ends
        # can (as a receiver: offer it; as a sender: use it); False: UCX messages only.
        self.ipc = ipc
        # Whose copy engines move a pull between two GPUs (`kvtransfer.ipc.pull`): as a
        # receiver, its default; as a sender, what it asks the receiver for.
        if pull_engine not in PULL_ENGINES:
            raise ValueError(f"pull_engine must be one of {PULL_ENGINES}, got {pull_engine!r}")
        self.pull_engine = pull_engine
        # None: where `ipc` allows it, a sender writes the blocks into the receiver's cache
        # itself (as a receiver: offer the cache; as a sender: take the offer); False: never.
        self.push = push
        self.pull = pull  # the same for the pull (the receiver copies); False: never
        self._imports: dict[tuple[int, int], torch.Tensor] = {}  # (link, export) -> peer cache
        self._events: dict[int, list[torch.cuda.Event]] = {}  # link -> early-ack events
        # (link, handle) -> a sender's opened "blocks written" event (`_land_pull`)
        self._peer_events: dict[tuple[int, str], torch.cuda.Event] = {}
        self._cache_exports: dict[tuple[bool, int], dict[str, Any]] = {}  # `_export`
        self._progress_mode = progress_mode
        self._id = wire.new_id()
        self._listener: Any = None
        self._self_ep: Any = None  # to wake our own pending receives on close
        self._links: dict[int, Any] = {}  # link id -> endpoint to that sender
        self._endpoints: list[Any] = []
        self._tasks: set[asyncio.Task] = set()
        self._conns: list[UcxConnection] = []
        self._started = self._closed = False
        self._dropped = 0  # malformed messages this end's loops dropped (`dropped_messages`)
        self.failure: str | None = None  # why a receive loop died (`healthy`)
        self.pool = staging.StagingPool()

    @property
    def healthy(self) -> bool:
        """False once a receive loop (the accept loop, a link's serve loop) has ended by an
        unexpected exception or been cancelled while this transport was open (`failure` says
        why; that link's or every new sender then waits out its timeout), and once closed. A
        malformed message never ends a loop: it is dropped and counted in `dropped_messages`."""
        return self.failure is None and not self._closed

    @property
    def dropped_messages(self) -> int:
        """Malformed, oversized or undecodable messages dropped at this end: hellos, headers
        and trailers it received, and acks its links received."""
        return self._dropped + sum(c.dropped_messages for c in self._conns)

    @property
    def address(self) -> dict[str, Any]:
        if not self._started:
            raise RuntimeError("start() the transport before asking for its address")
        if self.mode == "worker":
            return {"kind": "ucx", "mode": "worker", "id": self._id,
                    "worker": wire.worker_address_hex()}
        return {"kind": "ucx", "mode": "listener", "host": self.host, "port": self._listener.port}

    async def start(self) -> None:
        if self.kv_cache is None:
            raise ValueError("a receiver needs a kv_cache")
        wire.ensure_ucx(self._progress_mode)
        self._self_ep = await wire.endpoint_to_worker(wire.worker_address_hex())
        if self.mode == "worker":
            self._spawn(self._accept_loop(), loop="accept loop")
        else:
            self._listener = ucxx.create_listener(self._on_endpoint, port=self.port,
                                                  endpoint_error_handling=True)
        self._started = True

    async def connect(self, peer_address: dict[str, Any]) -> UcxConnection:
        if peer_address.get("kind") != "ucx" or peer_address.get("mode") not in MODES:
            raise ValueError(f"not a UCX transport address: {peer_address!r}")
        wire.ensure_ucx(self._progress_mode)
        link = wire.new_id()
        hello = {"op": "hello", "link": link, "layout": self.layout.to_dict(),
                 "pid": os.getpid()}
        reply = asyncio.ensure_future(wire.recv_ctrl(wire.tag(link, 0, wire.HELLO_REPLY)))
        if peer_address["mode"] == "worker":
            ep = await wire.endpoint_to_worker(peer_address["worker"])
            hello["reply_to"] = wire.worker_address_hex()
            await wire.send(ep, wire.encode(hello), wire.tag(peer_address["id"], 0, wire.HELLO))
        else:
            ep = await ucxx.create_endpoint(peer_address["host"], peer_address["port"],
                                            endpoint_error_handling=True)
            await ep.send(wire.encode(hello))  # the endpoint's own tag: unique to this pair
        peer = peer_address.get("host") or peer_address["id"]
        try:
            msg = await asyncio.wait_for(reply, self.timeout)
            wire.require(msg, wire.REPLY_FIELDS)
            peer_layout = BlockLayout.from_dict(msg["layout"])
        except asyncio.TimeoutError:
            self._endpoints.append(ep)
            raise ConnectionError(f"no handshake reply within {self.timeout}s from "
                                  f"{peer}") from None
        except (wire.MalformedMessage, TypeError) as e:  # not a reply this end can read
            self._endpoints.append(ep)
            self._dropped += 1
            raise ConnectionError(f"malformed handshake reply from {peer}: {e}") from None
        if not msg["ok"]:
            self._endpoints.append(ep)
            try:
                check_compatible(self.layout, peer_layout)
            except LayoutMismatch as e:
                raise LayoutMismatch(f"{e} (the receiver refused the handshake)",
                                     e.fields) from None
            raise LayoutMismatch(msg.get("error") or "the receiver refused the handshake")
        conn = UcxConnection(ep, link, self.layout, peer_layout, msg["num_blocks"], self.pool,
                             num_chunks=self.num_chunks, checksum=self.checksum,
                             timeout=self.timeout, direct=self.direct,
                             pull_from=msg.get("pull_from", [])
                             if self.ipc is not False and self.pull is not False else [],
                             peer_pid=msg.get("pid"), pull_engine=self.pull_engine)
        if conn.pull_from and msg.get("probe_event"):
            conn.offer_early_ack(msg["gpu"], msg["probe_event"])
        if msg.get("push_to") and self.ipc is not False and self.push is not False:
            conn.offer_push(msg["push_to"])
        self._conns.append(conn)
        return conn

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for conn in self._conns:
            await conn.close()
        if self._self_ep is not None:
            stop = wire.encode({"op": "stop"})
            if self.mode == "worker":
                await wire.send(self._self_ep, stop, wire.tag(self._id, 0, wire.HELLO))
            for link in list(self._links):
                await wire.send(self._self_ep, stop, wire.tag(link, 0, wire.HEADER))
        if self._listener is not None:
            self._listener.close()
        # A transfer whose sender vanished mid-way would wait forever: give it a grace period.
        tasks = set(self._tasks)
        _, pending = await asyncio.wait(tasks, timeout=min(self.timeout, 5.0)) if tasks else (
            (), ())
        for t in pending:
            t.cancel()
        for ep in self._endpoints + ([self._self_ep] if self._self_ep else []):
            wire.drop(ep)
        self._endpoints.clear()
        # IPC events and mapped caches go now, by reference count, not in the cyclic GC
        # (`UcxConnection.close`).
        self._events.clear()
        self._peer_events.clear()
        self._imports.clear()
        self._cache_exports.clear()

    def _spawn(self, coro: Any, loop: str | None = None) -> None:
        """Run `coro` until close; a receive `loop` (named) that dies makes this end unhealthy."""
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        if loop is not None:
            task.add_done_callback(lambda t: self._loop_ended(loop, t))

    def _loop_ended(self, loop: str, task: asyncio.Task) -> None:
        """A loop returns only on close or its sender's bye; anything else is a death."""
        if self._closed or not (task.cancelled() or task.exception() is not None):
            return
        exc = None if task.cancelled() else task.exception()
        why = "cancelled" if exc is None else f"{type(exc).__name__}: {wire.excerpt(str(exc))}"
        self.failure = self.failure or f"{loop} died ({why})"
        log.error("kvtransfer: receive %s died while serving (%s); its senders will time out",
                  loop, why, exc_info=exc)

    def _drop(self, what: str, err: wire.MalformedMessage) -> None:
        """Count and log a malformed message that is dropped; the loop goes on."""
        self._dropped += 1
        log.error("kvtransfer: dropped a malformed %s: %s", what, err)

    def _stopping(self, msg: dict[str, Any]) -> bool:
        """Our own close() stops the loops; a "stop" from anyone else is malformed."""
        return msg.get("op") == "stop" and self._closed

    async def _accept_loop(self) -> None:
        """Worker mode: hellos from any sender arrive on this transport's own tag."""
        while True:
            try:
                hello = await wire.recv_ctrl(wire.tag(self._id, 0, wire.HELLO))
                if self._stopping(hello):
                    return
                wire.check_hello(hello, worker_mode=True)
            except wire.MalformedMessage as e:
                self._drop("hello", e)
                continue
            try:
                ep = await wire.endpoint_to_worker(hello["reply_to"])
                await self._admit(ep, hello)
            except Exception:  # one sender that cannot be answered must not stop the others
                log.exception("kvtransfer: could not answer the hello of link %#x",
                              hello["link"])

    async def _on_endpoint(self, ep: Any) -> None:
        """Listener mode: the hello comes on the new endpoint's own tag."""
        try:
            hello = await wire.recv_ctrl(None, ep=ep)
            wire.check_hello(hello, worker_mode=False)
        except wire.MalformedMessage as e:
            self._drop("hello", e)
            wire.drop(ep)
            return
        try:
            await self._admit(ep, hello)
        except Exception:  # the sender went away meanwhile
            log.exception("kvtransfer: could not answer the hello of link %#x", hello["link"])

    async def _admit(self, ep: Any, hello: dict[str, Any]) -> None:
        """Receiver half of the handshake (`hello` passed `wire.check_hello`): refuse a
        mismatched layout, or a link id already in use, before any data."""
        self._endpoints.append(ep)
        link = hello["link"]
        reply: dict[str, Any] = {"ok": True, "layout": self.layout.to_dict(),
                                 "num_blocks": self.num_blocks}
        try:
            if link in self._links:
                raise ValueError(f"link id {link:#x} is already in use")
            check_compatible(self.layout, BlockLayout.from_dict(hello["layout"]))
        except Exception as e:  # a mismatch, or a layout that is not one
            reply.update(ok=False, error=wire.clip(str(e)))
            log.warning("kvtransfer: refused a sender: %s", wire.excerpt(str(e), 500))
        if reply["ok"]:
            if self.ipc is not False:
                reply["pull_from"] = ipc.readable(self.kv_cache) if self.pull is not False else []
                reply["pid"] = os.getpid()  # a sender in this process exports by reference
                if reply["pull_from"] and self.kv_cache.is_cuda:
                    # A sender that can open this event may take the ack of a pull as soon as
                    # the copy is queued, and wait on an event for its end (`ipc.EVENTS_PER_LINK`).
                    try:
                        probe = ipc.event_handle(self._link_event(link, 0))
                        reply.update(gpu=ipc.domain(self.kv_cache), probe_event=probe)
                    except Exception:  # noqa: BLE001 - no early acks: plain ones still work
                        log.warning("kvtransfer: no IPC events here, no early acks",
                                    exc_info=True)
                if self.push is not False and (self.kv_cache.is_cuda or ipc.HOST_PULL):
                    try:  # the sender may write the blocks into this cache itself
                        reply["push_to"] = {"gpu": ipc.domain(self.kv_cache), "spec": self._export(
                            same_process=hello.get("pid") == os.getpid())}
                    except Exception:  # noqa: BLE001 - no push: pull or messages still work
                        log.warning("kvtransfer: cannot export the cache, no push",
                                    exc_info=True)
            self._links[link] = ep
            self._spawn(self._serve(link, ep), loop=f"serve loop of link {link:#x}")
        await wire.send(ep, wire.encode(reply), wire.tag(link, 0, wire.HELLO_REPLY))

    async def _serve(self, link: int, ep: Any) -> None:
        """One sender's headers, in arrival order; each request then lands on its own. Ends
        on the sender's "bye" or our close(); a header that cannot be used is dropped."""
        try:
            while True:
                try:
                    hdr = await wire.recv_ctrl(wire.tag(link, 0, wire.HEADER), wire.CTRL_HEADER)
                    if hdr.get("op") == "bye" or self._stopping(hdr):
                        return
                    wire.check_header(hdr, self.layout.num_layers)
                except wire.MalformedMessage as e:
                    self._drop(f"header on link {link:#x}", e)
                    self._spawn(self._refuse(link, ep, e))
                    continue
                self._spawn(self._receive(link, ep, hdr))
        finally:
            self._forget(link)

    async def _refuse(self, link: int, ep: Any, err: wire.MalformedMessage) -> None:
        """Fail the request a malformed header still names, where it does: in the inbox (its
        request id) and to its sender (an error ack on its seq), so neither waits out a
        timeout."""
        error = f"malformed header: {err}"
        if err.request_id is not None:
            self._deliver(err.request_id, TransferError(f"{err.request_id}: {error}"))
        if err.seq is not None:
            await self._ack(ep, link, err.seq, error, None)

    def _forget(self, link: int) -> None:
        """Drop a link that is no longer served, with its IPC events and mapped caches."""
        self._links.pop(link, None)
        for key in [k for k in self._imports if k[0] == link]:
            del self._imports[key]
        self._events.pop(link, None)
        for key in [k for k in self._peer_events if k[0] == link]:
            del self._peer_events[key]

    async def _receive(self, link: int, ep: Any, hdr: dict[str, Any]) -> None:
        stamps: dict[str, Any] | None = (
            {"header": time.perf_counter(), "landed": []} if hdr.get("trace") else None)
        seq, rid = hdr["seq"], hdr["request_id"]
        kv, error, extras, ipc_failed = self.kv_cache, None, {}, False
        try:
            blob = torch.empty(hdr["extras_nbytes"], dtype=torch.uint8)
            extra_recv = asyncio.ensure_future(ucxx.recv(
                blob.numpy(), wire.tag(link, seq, wire.EXTRAS))) if blob.numel() else None
            trailer = asyncio.ensure_future(wire.recv_ctrl(wire.tag(link, seq, wire.TRAILER))
                                            ) if hdr["checksum"] else None
            try:  # still drain the payload on bad ids, so nothing lingers in UCX's queues
                check_block_ids(hdr["dst"], hdr["dst"], self.num_blocks, self.num_blocks)
            except ValueError as e:
                error = str(e)
            if hdr.get("push"):
                land = self._land_push
            elif hdr.get("pull"):
                land = self._land_pull
            else:
                land = self._land_direct if hdr.get("direct") else self._land_chunks
            try:
                error, sums = await land(link, hdr, error, stamps)
            except ipc.IpcUnavailable as e:  # the sender sends it again as UCX messages
                error, sums, ipc_failed = f"ipc: {e}", [], True
            if extra_recv is not None:
                await extra_recv
            if trailer is not None:
                sent = await trailer
                wire.require(sent, {"crc": list})
                if sent["crc"] != sums + [wire.crc(blob)]:
                    error = error or "checksum mismatch: payload corrupted in flight"
            extras = wire.unpack_extras(hdr["extras"], blob, kv.device)
        except wire.MalformedMessage as e:  # the trailer
            self._drop(f"trailer of {wire.excerpt(rid)}", e)
            error = error or f"malformed trailer: {e}"
        except Exception as e:
            error = error or f"{type(e).__name__}: {e}"
        if not ipc_failed:
            self._deliver(rid, extras if error is None else TransferError(f"{rid}: {error}"))
        if not hdr.get("acked"):  # else an early ack already went out (`_land_pull`)
            await self._ack(ep, link, seq, error, stamps, ipc_failed=ipc_failed)

    def _deliver(self, rid: str, result: Extras | TransferError) -> None:
        """Hand a request's outcome to the inbox; a failing `on_receive` is logged, so the
        sender still gets its ack."""
        try:
            self.inbox.put(rid, result)
        except Exception:  # noqa: BLE001 - the node's callback; the loop must go on
            log.exception("kvtransfer: on_receive failed for %s", wire.excerpt(rid))

    async def _land_chunks(self, link: int, hdr: dict[str, Any], error: str | None,
                           stamps: dict[str, Any] | None) -> tuple[str | None, list[int]]:
        """Staged path: each layer chunk lands in a staging buffer and is scattered into the
        cache as soon as it is in. Returns the error (if any) and the chunks' crc32s."""
        kv, seq, dst, chunks = self.kv_cache, hdr["seq"], hdr["dst"], hdr["chunks"]
        layer_bytes = len(dst) * self.layout.block_bytes // self.layout.num_layers
        # On a GPU: scatters on the staging stream, after what the engine queued so far (the
        # blocks were free before the reservation); "landed" waits for them alone.
        stream = staging.copy_stream(kv.device)
        staging.after_current(stream)
        with torch.cuda.stream(stream):
            bufs = [self.pool.take((hi - lo) * layer_bytes, kv.device) for lo, hi in chunks]
        # Post every receive at once; scatter each chunk as soon as it is in.
        recvs = [asyncio.ensure_future(ucxx.recv(wire.as_buffer(b),
                                                 wire.tag(link, seq, wire.CHUNK + i)))
                 for i, b in enumerate(bufs)]
        ids = None
        if error is None:
            with torch.cuda.stream(stream):
                ids = staging.block_ids(dst, kv.device)  # once, for every chunk
        for layers, buf, r in zip(chunks, bufs, recvs):
            await r
            if stamps is not None:
                stamps["landed"].append(time.perf_counter())
            if error is None:
                with torch.cuda.stream(stream):  # never held across an await
                    staging.scatter(kv, layers, ids, buf.view(kv.dtype))
        scattered = staging.mark(stream)
        if stamps is not None:
            stamps["scattered"] = time.perf_counter()
        sums = [wire.crc(b) for b in bufs] if hdr["checksum"] else []
        if scattered is not None:
            scattered.synchronize()  # "landed" must mean readable by the engine
        if stamps is not None:
            stamps["synced"] = time.perf_counter()
        for buf in bufs:  # every receive and scatter has completed: nothing uses them
            self.pool.give(buf)
        return error, sums

    async def _land_direct(self, link: int, hdr: dict[str, Any], error: str | None,
                           stamps: dict[str, Any] | None) -> tuple[str | None, list[int]]:
        """Direct path: every (layer, K/V, run) message lands in place in the cache. The
        blocks were free before the reservation, but kernels the engine queued earlier may
        still touch them: receive only once the device has run what was queued so far."""
        kv, seq = self.kv_cache, hdr["seq"]
        runs = [(int(d), int(k)) for d, k in hdr["direct"]]
        if error is None and [d + i for d, k in runs for i in range(k)] != hdr["dst"]:
            error = "the direct runs do not spell the dst block ids"
        if error is not None:  # drain into one scratch buffer, one message at a time
            step = kv[0, 0, 0].numel() * kv.element_size()
            scratch = self.pool.take(max(k for _, k in runs) * step, kv.device)
            for i in range(2 * kv.shape[0] * len(runs)):  # wire order: layer, K/V, run
                k = runs[i % len(runs)][1]
                await ucxx.recv(wire.as_buffer(scratch[:k * step]),
                                wire.tag(link, seq, wire.CHUNK + i))
            self.pool.give(scratch)
            return error, []
        await staging.wait_queued(kv.device)  # queued engine work may still touch the blocks
        views = wire.direct_views(kv, runs)
        recvs = [ucxx.recv(wire.as_buffer(v), wire.tag(link, seq, wire.CHUNK + i))
                 for i, v in enumerate(views)]
        await asyncio.gather(*recvs)
        if stamps is not None:
            stamps["landed"].append(time.perf_counter())
            stamps["scattered"] = stamps["synced"] = stamps["landed"][-1]
        return error, [wire.crc(v) for v in views] if hdr["checksum"] else []

    async def _land_pull(self, link: int, hdr: dict[str, Any], error: str | None,
                         stamps: dict[str, Any] | None) -> tuple[str | None, list[int]]:
        """Pull path: copy the sender's blocks out of its cache (mapped through CUDA IPC on
        the first request of the link) on the staging stream, after what the engine queued so
        far (the dst blocks were free before the reservation) and, on a GPU, after the sender's
        "ready" event (its writes of the blocks; a sender without one waited for them before
        it sent the header). The sender holds its blocks until the ack."""
        kv, pull = self.kv_cache, hdr["pull"]
        key = (link, int(pull["export"]))
        if key not in self._imports:
            if pull.get("spec") is None:
                raise ipc.IpcUnavailable("the sender's cache was never exported on this link")
            self._imports[key] = ipc.open_export(pull["spec"])
        src_kv = self._imports[key]
        src, dst = [int(i) for i in pull["src"]], hdr["dst"]
        if error is None:
            try:
                check_block_ids(src, dst, src_kv.shape[2], self.num_blocks)
            except ValueError as e:
                error = str(e)
        if error is not None:
            return error, []
        runs = wire.block_runs(src, dst)
        stream = staging.copy_stream(kv.device)
        staging.after_current(stream)
        if pull.get("ready") and stream is not None:
            # The sender did not wait for its own writes: its event marks them, and the copy
            # waits for it on the GPU (a failure to open it: the sender sends messages).
            stream.wait_event(self._peer_event(link, pull["gpu"], pull["ready"]))
        try:
            engine = pull.get("engine") or self.pull_engine
            ipc.pull(kv, src_kv, runs, stream,
                     engine if engine in ipc.ENGINES else ipc.DEFAULT_ENGINE)
        except Exception as e:  # the sender sends the request again as messages
            raise ipc.IpcUnavailable(f"copy failed: {type(e).__name__}: {e}") from e
        early: asyncio.Future | None = None  # the early ack's send
        handle = None
        if hdr.get("early_ack") and not hdr["checksum"] and stream is not None:
            try:  # recorded after the copy on the staging stream: covers earlier ones too
                ev = self._link_event(link, hdr["seq"])
                ev.record(stream)
                handle = ipc.event_handle(ev)
            except Exception:  # noqa: BLE001 - then the plain ack, once the copy is done
                log.warning("kvtransfer: no early ack for %s", hdr["request_id"], exc_info=True)
        if handle is not None:
            # The ack travels while the copy runs; the sender waits on the event for its end.
            # Not awaited yet: the copy's end is waited for meanwhile.
            hdr["acked"] = True
            early = asyncio.ensure_future(self._ack(self._links[link], link, hdr["seq"], None,
                                                    stamps, event=handle))
        await self._copied(staging.mark(stream), early, stamps)
        return error, wire.run_sums(kv, runs, 1) if hdr["checksum"] else []

    async def _land_push(self, link: int, hdr: dict[str, Any], error: str | None,
                         stamps: dict[str, Any] | None) -> tuple[str | None, list[int]]:
        """Push path: the sender has queued the copy into this cache on its own stream (the
        dst blocks were free before the reservation: nothing queued here touches them) and
        names an event after it. Without checksums, ack at once (the sender waits on its own
        event); then wait for that event, off the loop, before the blocks go to the inbox."""
        kv, push, seq = self.kv_cache, hdr["push"], hdr["seq"]
        done = self._peer_event(link, push["gpu"], push["done"]) if push.get("done") else None
        early = None
        if error is None and not hdr["checksum"]:
            hdr["acked"] = True
            early = asyncio.ensure_future(self._ack(self._links[link], link, seq, None, stamps))
        await self._copied(done, early, stamps)
        if error is not None or not hdr["checksum"]:
            return error, []
        # cut by the runs the sender cut its checksums by
        return error, wire.run_sums(kv, wire.block_runs(push["src"], hdr["dst"]), 1)

    @staticmethod
    async def _copied(event: torch.cuda.Event | None, early: asyncio.Future | None,
                      stamps: dict[str, Any] | None) -> None:
        """Until an IPC copy's `event` has fired (off the loop: the others progress) and its
        `early` ack (if any) has gone out; then stamp it landed."""
        await staging.wait_event(event)
        if early is not None:
            await early
        if stamps is not None:
            stamps["landed"].append(time.perf_counter())
            stamps["scattered"] = stamps["synced"] = stamps["landed"][-1]

    async def _ack(self, ep: Any, link: int, seq: int, error: str | None,
                   stamps: dict[str, Any] | None, **more: Any) -> None:
        """A request's ack: ok or the error (cut to fit the sender's buffer), the receiver's
        stamps when traced, and `more` (`ipc_failed`, an early ack's `event`). A sender that
        is gone is only logged: its lease expires on its own."""
        reply: dict[str, Any] = {"ok": error is None, "ipc_failed": False, **more,
                                 "error": None if error is None else wire.clip(error)}
        if stamps is not None:
            stamps["ack"] = time.perf_counter()
            reply["t"] = stamps
        try:
            await wire.send(ep, wire.encode(reply), wire.tag(link, seq, wire.ACK))
        except Exception:  # noqa: BLE001
            log.warning("kvtransfer: could not ack request %d of link %#x", seq, link,
                        exc_info=True)

    def _export(self, same_process: bool) -> dict[str, Any]:
        """This receiver's cache as `ipc.export` describes it, made once (per cache and kind)
        for all links: each CUDA export takes a slot of torch's IPC reference counts."""
        key = (same_process, self.kv_cache.data_ptr())
        if key not in self._cache_exports:
            self._cache_exports[key] = ipc.export(self.kv_cache, same_process=same_process)
        return self._cache_exports[key]

    def _link_event(self, link: int, seq: int) -> torch.cuda.Event:
        """One of a link's early-ack events, in turn (made on first use)."""
        return ipc.pooled_event(self._events.setdefault(link, []), seq, self.kv_cache.device)

    def _peer_event(self, link: int, gpu: str, handle: str) -> torch.cuda.Event:
        """A sender's event (opened once per link and handle); `IpcUnavailable` if it can't."""
        key = (link, handle)
        if key not in self._peer_events:
            self._peer_events[key] = ipc.open_event(gpu, handle)
        return self._peer_events[key]

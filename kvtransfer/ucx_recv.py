"""The receiving half of a UCX link: where a request's payload lands in the receiver's cache
(staged chunks, direct messages, or a CUDA IPC pull or push), and what each link maps for IPC."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import torch
import ucxx

from kvtransfer import ipc, staging, wire
from kvtransfer.base import Extras, check_block_ids
from kvtransfer.layout import BLOCKS_DIM, BlockLayout

log = logging.getLogger(__name__)
# Sends a request's ack before its payload is done (`hdr["acked"]` set); takes the ack's extra
# fields (an IPC event's handle).
EarlyAck = Callable[..., Awaitable[None]]
Landed = tuple["str | None", list[int]]  # the error (if any), the checksums of what landed


class Landing:
    """A receiver's cache and the ways a request's blocks land in it. Holds each link's mapped
    peer caches and IPC events until `forget` or `clear`: dropped by reference count there,
    since torch's event destructor releases the GIL, which the cyclic GC must not run into."""

    def __init__(self, layout: BlockLayout, kv_cache: torch.Tensor, pool: staging.StagingPool,
                 pull_engine: str):
        self.layout, self.kv_cache, self.pool, self.pull_engine = (layout, kv_cache, pool,
                                                                   pull_engine)
        self.dropped = 0  # malformed trailers received
        self._imports: dict[tuple[int, int], torch.Tensor] = {}  # (link, export) -> peer cache
        self._events: dict[int, list[torch.cuda.Event]] = {}  # link -> early-ack events
        # (link, handle) -> a sender's opened "blocks written" event (`_pull`)
        self._peer_events: dict[tuple[int, str], torch.cuda.Event] = {}
        self._cache_exports: dict[tuple[bool, int], dict[str, Any]] = {}  # `_export`

    @property
    def num_blocks(self) -> int:
        return self.kv_cache.shape[BLOCKS_DIM]

    def offers(self, link: int, same_process: bool, push: bool, pull: bool) -> dict[str, Any]:
        """The IPC fields of a hello reply: the GPUs a pull may read from, the event a sender
        probes for early acks, this cache for a sender to push into (each where it works)."""
        kv, reply = self.kv_cache, {}
        reply["pull_from"] = ipc.readable(kv) if pull else []
        if reply["pull_from"] and kv.is_cuda:
            # A sender that can open this event may take the ack of a pull as soon as the copy
            # is queued, and wait on an event for its end (`ipc.EVENTS_PER_LINK`).
            try:
                probe = ipc.event_handle(self._link_event(link, 0))
                reply.update(gpu=ipc.domain(kv), probe_event=probe)
            except Exception:  # noqa: BLE001 - no early acks: plain ones still work
                log.warning("kvtransfer: no IPC events here, no early acks", exc_info=True)
        if push and (kv.is_cuda or ipc.HOST_PULL):
            try:  # the sender may write the blocks into this cache itself
                reply["push_to"] = {"gpu": ipc.domain(kv), "spec": self._export(same_process)}
            except Exception:  # noqa: BLE001 - no push: pull or messages still work
                log.warning("kvtransfer: cannot export the cache, no push", exc_info=True)
        return reply

    async def receive(self, link: int, hdr: dict[str, Any], stamps: dict[str, Any] | None,
                      early_ack: EarlyAck) -> tuple[str | None, Extras, bool]:
        """Land one request (`hdr` passed `wire.check_header`): its payload, extras and
        checksum trailer. Returns the error (if any), the extras, and whether an IPC path
        failed (the sender then sends it again as UCX messages)."""
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
            try:
                if hdr.get("push"):
                    error, sums = await self._push(link, hdr, error, stamps, early_ack)
                elif hdr.get("pull"):
                    error, sums = await self._pull(link, hdr, error, stamps, early_ack)
                elif hdr.get("direct"):
                    error, sums = await self._direct(link, hdr, error, stamps)
                else:
                    error, sums = await self._chunks(link, hdr, error, stamps)
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
            self.dropped += 1
            log.error("kvtransfer: dropped a malformed trailer of %s: %s", wire.excerpt(rid), e)
            error = error or f"malformed trailer: {e}"
        except Exception as e:
            error = error or f"{type(e).__name__}: {e}"
        return error, extras, ipc_failed

    async def _chunks(self, link: int, hdr: dict[str, Any], error: str | None,
                      stamps: dict[str, Any] | None) -> Landed:
        """Staged path: each layer chunk lands in a staging buffer and is scattered into the
        cache as soon as it is in."""
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

    async def _direct(self, link: int, hdr: dict[str, Any], error: str | None,
                      stamps: dict[str, Any] | None) -> Landed:
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

    async def _pull(self, link: int, hdr: dict[str, Any], error: str | None,
                    stamps: dict[str, Any] | None, early_ack: EarlyAck) -> Landed:
        """Pull path: copy the sender's blocks out of its cache (mapped on the link's first
        request) on the staging stream, after what the engine queued so far and the sender's
        "ready" event, if any. The sender holds its blocks until the ack."""
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
            early = asyncio.ensure_future(early_ack(event=handle))
        await self._copied(staging.mark(stream), early, stamps)
        return error, wire.run_sums(kv, runs, 1) if hdr["checksum"] else []

    async def _push(self, link: int, hdr: dict[str, Any], error: str | None,
                    stamps: dict[str, Any] | None, early_ack: EarlyAck) -> Landed:
        """Push path: the sender has queued the copy into this cache on its own stream (the
        dst blocks were free, so nothing queued here touches them) and names an event after
        it. Without checksums, ack at once; then wait for that event before the inbox."""
        kv, push = self.kv_cache, hdr["push"]
        done = self._peer_event(link, push["gpu"], push["done"]) if push.get("done") else None
        early = None
        if error is None and not hdr["checksum"]:
            early = asyncio.ensure_future(early_ack())
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

    def _export(self, same_process: bool) -> dict[str, Any]:
        """This cache as `ipc.export` describes it, made once per kind for all links: each
        CUDA export takes a slot of torch's IPC reference counts."""
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

    def forget(self, link: int) -> None:
        """Drop a link's mapped caches and IPC events."""
        for key in [k for k in self._imports if k[0] == link]:
            del self._imports[key]
        self._events.pop(link, None)
        for key in [k for k in self._peer_events if k[0] == link]:
            del self._peer_events[key]

    def clear(self) -> None:
        """Drop every mapped cache, IPC event and export (the transport closes)."""
        self._events.clear()
        self._peer_events.clear()
        self._imports.clear()
        self._cache_exports.clear()

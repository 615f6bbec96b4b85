"""The sending half of a UCX link: gather blocks per layer chunk and send them (or copy them
into the receiver's cache, or name them for a receiver that pulls them itself), wait for the
ack."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Sequence
from typing import Any

import torch

from kvtransfer import ipc, staging, wire
from kvtransfer.base import Connection, Extras, TransferError, TransferStats
from kvtransfer.layout import BlockLayout

log = logging.getLogger(__name__)
# Room kept in a push's header for the fields `_push` adds once its copy is queued (an IPC
# event handle, a GPU name): the header's size is checked before, so a header the receiver
# would drop never has a copy queued into its cache.
PUSH_FIELDS_BYTES = 512


class UcxConnection(Connection):
    """A handshaken link to one `UcxTransport` receiver; safe for concurrent `send_blocks`.

    With `trace` on, every `send_blocks` leaves its timeline in `last_trace` (see
    `_trace_record`): the sender's own stamps plus the receiver's, which it returns in the ack.
    Both sides stamp `time.perf_counter()`, one system-wide monotonic clock on Linux, so the
    receiver's stamps are only meaningful when it runs on the same host.
    """

    def __init__(self, ep: Any, link: int, layout: BlockLayout, peer_layout: BlockLayout,
                 peer_num_blocks: int, pool: staging.StagingPool, *, num_chunks: int = 1,
                 checksum: bool = False, timeout: float = 30.0, trace: bool = False,
                 direct: bool | None = None, pull_from: Sequence[str] = (),
                 peer_pid: int | None = None, pull_engine: str = ipc.DEFAULT_ENGINE):
        super().__init__(layout, peer_layout, peer_num_blocks)
        self._ep, self._link, self._seq, self._pool = ep, link, 0, pool
        self.num_chunks, self.checksum, self.timeout = num_chunks, checksum, timeout
        self.direct = direct
        self.last_path = ""  # "push", "pull", "direct" or "staged": how the last payload went
        # Where the receiver offers to pull from (`kvtransfer.ipc.readable`: the GPUs it sees);
        # emptied when a pull fails, so the link keeps to UCX messages from then on.
        self.pull_from = set(pull_from)
        self.pull_engine = pull_engine  # asked of the receiver (`kvtransfer.ipc.pull`)
        self._same_process = peer_pid == os.getpid()
        self._exports: dict[tuple[int, int], int] = {}  # (data_ptr, numel) -> export id
        # The receiver's GPU, where this process can open its events: pulls are acked as soon
        # as the copy is queued, and the sender waits on the receiver's event for its end.
        self.early_ack_gpu: str | None = None
        self._events: dict[str, torch.cuda.Event] = {}  # handle -> opened receiver event
        # device index -> this link's "blocks written" events (`_ready_event`); None: this
        # process could not make one, so a pull waits for the writes on the host
        self._ready: dict[int, list[torch.cuda.Event]] | None = {}
        # The receiver's cache, mapped (`offer_push`): this end copies the blocks into it.
        self.push_dst: torch.Tensor | None = None
        self._pushed: dict[int, list[torch.cuda.Event]] = {}  # device -> "copied" events
        self.trace, self.last_trace = trace, None
        self.dropped_messages = 0  # malformed acks received (each failed its request)
        self._closed = False

    async def send_blocks(self, request_id: str, kv_cache: torch.Tensor,
                          src_block_ids: Sequence[int], dst_block_ids: Sequence[int],
                          extras: Extras | None = None) -> TransferStats:
        if self._closed:
            raise TransferError("connection closed")
        self.check(request_id, kv_cache, src_block_ids, dst_block_ids, extras)
        push = bool(src_block_ids) and self._can_push(kv_cache)
        pull = None if push or not src_block_ids else self._pull_spec(kv_cache, src_block_ids)
        try:
            return await self._send_blocks(request_id, kv_cache, src_block_ids, dst_block_ids,
                                           extras, pull, push)
        except _IpcRefused as e:
            self._no_ipc(f"the receiver could not {'take the push' if push else 'pull'} ({e})")
            return await self._send_blocks(request_id, kv_cache, src_block_ids, dst_block_ids,
                                           extras, None, False)

    @property
    def last_direct(self) -> bool:
        """Whether the last `send_blocks` went direct."""
        return self.last_path == "direct"

    def offer_push(self, offer: dict[str, Any]) -> None:
        """Take the receiver's offer to write into its cache (`push_to` of the hello reply),
        if this process can map it."""
        try:
            self.push_dst = ipc.open_export(offer["spec"])
        except ipc.IpcUnavailable as e:
            log.info("kvtransfer: no push on this link: %s", e)

    def _can_push(self, kv: torch.Tensor) -> bool:
        dst = self.push_dst
        return (dst is not None and kv.is_contiguous() and kv.is_cuda == dst.is_cuda
                and kv.dtype == dst.dtype)

    def _push(self, kv: torch.Tensor, src: list[int], dst: list[int], seq: int
              ) -> tuple[dict[str, Any], torch.cuda.Event | None]:
        """Queue the copy of the blocks into the receiver's cache, on this device's staging
        stream after what this thread's stream has queued (their writes); return the header's
        push field (the src ids, by whose runs the receiver cuts its checksums, and the handle
        of an event after the copy) and that event (None on the host: the copy is done).
        `_IpcRefused` if it cannot: the request then goes as messages."""
        stream = staging.copy_stream(kv.device)
        staging.after_current(stream)
        try:
            ipc.copy_runs(self.push_dst, kv, wire.block_runs(src, dst), stream)
            if stream is None:
                return {"src": src}, None
            ev = _record(self._pushed, seq, stream)
            return {"src": src, "done": ipc.event_handle(ev), "gpu": ipc.domain(kv)}, ev
        except Exception as e:  # noqa: BLE001 - whatever CUDA refuses: UCX messages
            raise _IpcRefused(f"push failed: {type(e).__name__}: {e}") from e

    def offer_early_ack(self, gpu: str, probe_event: str) -> None:
        """Take the receiver's early acks if this process can open its events (tried on the
        handshake's probe event); without checksums only (those compare after the copy)."""
        try:
            self._events[probe_event] = ipc.open_event(gpu, probe_event)
        except ipc.IpcUnavailable as e:
            log.info("kvtransfer: no early acks on this link: %s", e)
            return
        self.early_ack_gpu = gpu

    async def _wait_event(self, handle: str) -> None:
        ev = self._events.get(handle)
        if ev is None:
            ev = self._events[handle] = ipc.open_event(self.early_ack_gpu, handle)
        await staging.wait_event(ev)

    def _ready_event(self, kv: torch.Tensor, seq: int) -> str | None:
        """The handle of an IPC event recorded after what this thread's stream has queued so
        far (the writes of the blocks), on the staging stream: the receiver's copy waits for
        it on the GPU, so the header need not wait for it on the host. None where this
        process cannot make one."""
        if self._ready is None:
            return None
        try:
            stream = staging.copy_stream(kv.device)
            staging.after_current(stream)
            return ipc.event_handle(_record(self._ready, seq, stream))
        except Exception as e:  # noqa: BLE001 - the host waits for the writes instead
            log.info("kvtransfer: no ready events on this link: %s: %s", type(e).__name__, e)
            self._ready = None
            return None

    def _no_ipc(self, why: str) -> None:
        log.warning("kvtransfer: %s; sending UCX messages on this link from now on", why)
        self.pull_from.clear()
        self.push_dst = None

    def _pull_spec(self, kv: torch.Tensor, src: Sequence[int]) -> dict[str, Any] | None:
        """The header's pull field (the blocks, and the cache's export the first time), or
        None where the receiver cannot pull from this cache."""
        if not self.pull_from or not kv.is_contiguous() or ipc.domain(kv) not in self.pull_from:
            return None
        key = (kv.data_ptr(), kv.numel())
        spec = None
        if key not in self._exports:
            try:
                spec = ipc.export(kv, same_process=self._same_process)
            except Exception as e:  # noqa: BLE001 - whatever torch refuses: send messages
                self._no_ipc(f"could not export the cache ({type(e).__name__}: {e})")
                return None
            self._exports[key] = len(self._exports) + 1
        return {"export": self._exports[key], "src": [int(i) for i in src], "spec": spec,
                "engine": self.pull_engine}

    async def _send_blocks(self, request_id: str, kv_cache: torch.Tensor,
                           src_block_ids: Sequence[int], dst_block_ids: Sequence[int],
                           extras: Extras | None, pull: dict[str, Any] | None,
                           push: bool = False) -> TransferStats:
        self._seq += 1
        seq, n, t0 = self._seq, len(src_block_ids), time.perf_counter()
        stamps: dict[str, Any] | None = {"t0": t0, "ready": []} if self.trace else None
        num_layers = self.layout.num_layers
        src, dst = [int(i) for i in src_block_ids], [int(i) for i in dst_block_ids]
        runs = None if pull or push else wire.plan_direct(
            src, dst, num_layers, self.layout.block_bytes // (2 * num_layers), self.direct,
            wire.direct_min_bytes(kv_cache.device))
        self.last_path = path = ("push" if push else "pull" if pull else
                                 "direct" if runs else "staged")
        if pull and kv_cache.is_cuda:
            ready = self._ready_event(kv_cache, seq)
            if ready is not None:
                pull = {**pull, "ready": ready, "gpu": ipc.domain(kv_cache)}
        chunks = (wire.layer_chunks(num_layers, self.num_chunks)
                  if n and not (runs or pull or push) else [])
        spec, blob = wire.pack_extras(extras or {})
        hdr = {"op": "send", "seq": seq, "request_id": request_id, "dst": dst,
               "chunks": chunks, "direct": [[d, k] for _, d, k in runs] if runs else None,
               "extras": spec, "extras_nbytes": blob.numel(),
               "checksum": bool(self.checksum), "trace": bool(self.trace),
               "pull": pull, "push": {"src": src} if push else None,
               "early_ack": bool(pull) and self.early_ack_gpu is not None and not self.checksum}
        # Refused before any message or copy: the receiver would drop a header larger than
        # its buffer, and this request would wait out its timeout.
        header = wire.encode_header(hdr, PUSH_FIELDS_BYTES if push else 0)
        copied = None
        if push:
            hdr["push"], copied = self._push(kv_cache, src, dst, seq)
            header = wire.encode(hdr)
        ack = asyncio.ensure_future(wire.recv_ctrl(self._tag(seq, wire.ACK)))
        bufs: list[torch.Tensor] = []
        try:
            # pull: the receiver reads the blocks once the header is in (GPU caches: after the
            # ready event), so they must be written by then; push: the copy is queued
            if pull and not pull.get("ready"):
                await staging.wait_queued(kv_cache.device)
            if (pull or push) and stamps is not None:
                stamps["ready"].append(time.perf_counter())
            # Not awaited on its own: the header travels while the blocks are gathered, and
            # its completion is awaited with the chunks'.
            sends = [self._send(header, 0, wire.HEADER)]
            await asyncio.sleep(0)  # post it now, ahead of the payload
            if pull or push:
                more, sums = [], (wire.run_sums(kv_cache, wire.block_runs(src, dst), 0)
                                  if self.checksum else [])
            elif runs:
                more, sums = await self._send_direct(seq, kv_cache, runs, stamps)
            else:
                more, sums = await self._send_payload(seq, kv_cache, src, chunks, bufs, stamps)
            sends += more
            if blob.numel():
                sends.append(self._send(blob.numpy(), seq, wire.EXTRAS))
            sums.append(wire.crc(blob))
            if self.checksum:
                sends.append(self._send(wire.encode({"crc": sums}), seq, wire.TRAILER))
            await asyncio.wait_for(asyncio.gather(*sends), self.timeout)
            if stamps is not None:
                stamps["sent"] = time.perf_counter()
            for buf in bufs:  # sent: UCX no longer reads them
                self._pool.give(buf)
            reply = await asyncio.wait_for(ack, self.timeout)
            wire.check_ack(reply)
            if reply.get("event"):  # an early ack: the receiver's copy may still run
                await asyncio.wait_for(self._wait_event(reply["event"]), self.timeout)
            if copied is not None:  # this end's copy: the src blocks are read until it ends
                await asyncio.wait_for(staging.wait_event(copied), self.timeout)
        except asyncio.TimeoutError:
            raise TransferError(f"{request_id}: no ack within {self.timeout}s") from None
        except wire.MalformedMessage as e:  # the receiver answered what cannot be read
            self.dropped_messages += 1
            raise TransferError(f"{request_id}: malformed ack: {e}") from None
        except Exception as e:  # UCX errors: the link broke; the lease must end all the same
            raise TransferError(f"{request_id}: {type(e).__name__}: {e}") from e
        finally:
            ack.cancel()  # no-op once done; on failure, stop waiting for an ack
            # A failed push ends only with its copy, which reads the src blocks and writes
            # the dst ones: the caller frees both once this returns.
            await staging.wait_event(copied)
        t1 = time.perf_counter()
        if stamps is not None:
            self.last_trace = _trace_record(stamps, t1, reply.get("t"), len(chunks))
        if reply.get("ipc_failed"):
            raise _IpcRefused(reply["error"])
        if not reply["ok"]:
            raise TransferError(f"{request_id}: the receiver failed it: {reply['error']}")
        return TransferStats(request_id, n, n * self.layout.block_bytes, blob.numel(), t1 - t0,
                             path)

    async def _send_payload(self, seq: int, kv: torch.Tensor, src: Sequence[int],
                            chunks: list[tuple[int, int]], bufs: list[torch.Tensor],
                            stamps: dict[str, Any] | None = None
                            ) -> tuple[list[asyncio.Future], list[int]]:
        """Gather each layer chunk into a staging buffer and send it; return the sends and
        crc32s. The buffers go to `bufs`: the caller returns them to the pool once sent.

        On a GPU every gather is queued at once on the staging stream (after the work already
        queued on the current stream), each followed by an event; chunk i is sent as soon as
        its own event fires, while later gathers still run: UCX reads the buffer directly, so
        it must be complete, but nothing else need be. On the host a gather is synchronous, so
        chunk i+1 is gathered while chunk i is on the wire."""
        stream = staging.copy_stream(kv.device)
        staging.after_current(stream)
        layer_bytes = len(src) * self.layout.block_bytes // self.layout.num_layers
        with torch.cuda.stream(stream):
            idx = staging.block_ids(src, kv.device)
        ready: list[tuple[torch.Tensor, torch.cuda.Event | None]] = []

        def stage(lo: int, hi: int) -> None:
            with torch.cuda.stream(stream):  # never held across an await
                bufs.append(self._pool.take((hi - lo) * layer_bytes, kv.device))
                data = staging.gather(kv, (lo, hi), idx, bufs[-1])
            ready.append((data, staging.mark(stream)))

        if stream is not None:
            for lo, hi in chunks:
                stage(lo, hi)
        sends, sums = [], []
        for i, (lo, hi) in enumerate(chunks):
            if stream is None:
                stage(lo, hi)
            data, done = ready[i]
            if done is not None:
                done.synchronize()
            if stamps is not None:
                stamps["ready"].append(time.perf_counter())
            if self.checksum:
                sums.append(wire.crc(data))
            sends.append(self._send(wire.as_buffer(data), seq, wire.CHUNK + i))
            await asyncio.sleep(0)  # let UCX progress the sends already posted
        return sends, sums

    async def _send_direct(self, seq: int, kv: torch.Tensor, runs: list[tuple[int, int, int]],
                           stamps: dict[str, Any] | None = None
                           ) -> tuple[list[asyncio.Future], list[int]]:
        """Send every (layer, K/V, run) range straight from the cache: no staging copy. UCX
        reads the cache itself, so first wait for what the caller's stream has queued (the
        prefill that wrote these blocks); the caller holds the blocks until the ack."""
        await staging.wait_queued(kv.device)
        if stamps is not None:
            stamps["ready"].append(time.perf_counter())
        views = wire.direct_views(kv, [(s, k) for s, _, k in runs])
        sends, sums = [], []
        for i, view in enumerate(views):
            if self.checksum:
                sums.append(wire.crc(view))
            sends.append(self._send(wire.as_buffer(view), seq, wire.CHUNK + i))
        await asyncio.sleep(0)
        return sends, sums

    def _tag(self, seq: int, kind: int) -> int:
        return wire.tag(self._link, seq, kind)

    def _send(self, buf: Any, seq: int, kind: int) -> asyncio.Future:
        return asyncio.ensure_future(wire.send(self._ep, buf, self._tag(seq, kind)))

    async def close(self) -> None:
        """Tell the receiver this link is done (it stops serving it), then drop the endpoint."""
        if self._closed:
            return
        self._closed = True
        try:
            await asyncio.wait_for(
                wire.send(self._ep, wire.encode({"op": "bye"}), self._tag(0, wire.HEADER)),
                self.timeout)
        except Exception:  # the receiver is already gone: nothing to say goodbye to
            log.debug("kvtransfer: bye not delivered", exc_info=True)
        wire.drop(self._ep)
        # Dropped here, by reference count: left to the cyclic GC (a link sits in reference
        # cycles), torch's event destructor releases the GIL mid-collection, and GPU runs
        # crashed the process in GC (design.md, kvtransfer).
        self._events.clear()
        self._pushed.clear()
        if self._ready:
            self._ready.clear()
        self.push_dst = None


def _record(pools: dict[int, list[torch.cuda.Event]], seq: int, stream: torch.cuda.Stream
            ) -> torch.cuda.Event:
    """Record the link's IPC event for `seq` (`ipc.pooled_event`, from the pool of `stream`'s
    device) on `stream`, and return it."""
    ev = ipc.pooled_event(pools.setdefault(stream.device.index, []), seq, stream.device)
    ev.record(stream)
    return ev


class _IpcRefused(Exception):
    """A push or pull could not go through (a copy refused here, or the receiver could not map
    this sender's cache or open its event): the request must go as messages."""


def _trace_record(stamps: dict[str, Any], t1: float, rx: dict[str, Any] | None,
                  num_chunks: int) -> dict[str, Any]:
    """One transfer's timeline in seconds since `send_blocks` began. Sender: `ready[i]` chunk
    i gathered (its send posted right after), `sent` every send complete, `acked` the ack in.
    Receiver (`rx`, None if it sent no stamps): `header` the header in, `landed[i]` chunk i
    in, `scattered` the last scatter queued, `synced` the scatters complete, `ack` about to
    send the ack."""
    t0 = stamps["t0"]
    rel = (lambda v: [x - t0 for x in v] if isinstance(v, list) else v - t0)
    out: dict[str, Any] = {"chunks": num_chunks, "ready": rel(stamps["ready"]),
                           "sent": rel(stamps.get("sent", t1)), "acked": t1 - t0}
    out["rx"] = None if rx is None else {k: rel(v) for k, v in rx.items()}
    return out


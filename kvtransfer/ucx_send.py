"""The sending half of a UCX link: gather blocks per layer chunk and send them (or copy them
into the receiver's cache, or name them for a receiver that pulls them itself), wait for the
ack."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from typing import Any

import torch

from kvtransfer import ipc, staging, wire
from kvtransfer.base import Connection, Extras, TransferError, TransferStats
from kvtransfer.layout import BlockLayout
from kvtransfer.ucx_send_ipc import IpcRefused, SendIpc

log = logging.getLogger(__name__)
# Room kept in a push's header for the fields `SendIpc.push` adds once its copy is queued (an IPC
# event handle, a GPU name): the header's size is checked before, so a header the receiver
# would drop never has a copy queued into its cache.
PUSH_FIELDS_BYTES = 512


class UcxConnection(Connection):
    """A handshaken link to one `UcxTransport` receiver; safe for concurrent `send_blocks`.
    With `trace` on, each `send_blocks` leaves its timeline, the receiver's stamps included, in
    `last_trace`; both ends stamp `time.perf_counter()`, so they compare only on one host."""

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
        self.ipc_link = SendIpc(pull_from, peer_pid, pull_engine)
        self.trace, self.last_trace = trace, None
        self.dropped_messages = 0  # malformed acks received (each failed its request)
        self._closed = False

    async def send_blocks(self, request_id: str, kv_cache: torch.Tensor,
                          src_block_ids: Sequence[int], dst_block_ids: Sequence[int],
                          extras: Extras | None = None) -> TransferStats:
        if self._closed:
            raise TransferError("connection closed")
        self.check(request_id, kv_cache, src_block_ids, dst_block_ids, extras)
        link = self.ipc_link
        push = bool(src_block_ids) and link.can_push(kv_cache)
        pull = None if push or not src_block_ids else link.pull_spec(kv_cache, src_block_ids)
        try:
            return await self._send_blocks(request_id, kv_cache, src_block_ids, dst_block_ids,
                                           extras, pull, push)
        except IpcRefused as e:
            link.disable(f"the receiver could not {'take the push' if push else 'pull'} ({e})")
            return await self._send_blocks(request_id, kv_cache, src_block_ids, dst_block_ids,
                                           extras, None, False)

    @property
    def last_direct(self) -> bool:
        """Whether the last `send_blocks` went direct."""
        return self.last_path == "direct"

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
            ready = self.ipc_link.ready_event(kv_cache, seq)
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
               "early_ack": bool(pull) and self.ipc_link.early_ack_gpu is not None
               and not self.checksum}
        # Refused before any message or copy: the receiver would drop a header larger than
        # its buffer, and this request would wait out its timeout.
        header = wire.encode_header(hdr, PUSH_FIELDS_BYTES if push else 0)
        copied = None
        if push:
            hdr["push"], copied = self.ipc_link.push(kv_cache, src, dst, seq)
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
                await asyncio.wait_for(self.ipc_link.wait_event(reply["event"]), self.timeout)
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
            raise IpcRefused(reply["error"])
        if not reply["ok"]:
            raise TransferError(f"{request_id}: the receiver failed it: {reply['error']}")
        return TransferStats(request_id, n, n * self.layout.block_bytes, blob.numel(), t1 - t0,
                             path)

    async def _send_payload(self, seq: int, kv: torch.Tensor, src: Sequence[int],
                            chunks: list[tuple[int, int]], bufs: list[torch.Tensor],
                            stamps: dict[str, Any] | None = None
                            ) -> tuple[list[asyncio.Future], list[int]]:
        """Gather each layer chunk into a staging buffer (kept in `bufs` until sent) and send
        it; return the sends and crc32s. On a GPU all gathers are queued at once and chunk i
        goes as soon as its own is done; on the host chunk i+1 is gathered while i is sent."""
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
        self.ipc_link.clear()


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


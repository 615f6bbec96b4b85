"""The sending side of a UCX link's CUDA IPC paths: the receiver's offers (to pull from this
cache, to take pushes into its own, to ack early), and the IPC events that order the copies."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any

import torch

from kvtransfer import ipc, staging, wire

log = logging.getLogger(__name__)


class IpcRefused(Exception):
    """A push or pull could not go through (a copy refused here, or the receiver could not map
    this sender's cache or open its event): the request must go as messages."""


class SendIpc:
    """What one link may do through CUDA IPC; `disable` falls back to UCX messages for good."""

    def __init__(self, pull_from: Sequence[str] = (), peer_pid: int | None = None,
                 pull_engine: str = ipc.DEFAULT_ENGINE):
        # Where the receiver offers to pull from (`ipc.readable`: the GPUs it sees).
        self.pull_from = set(pull_from)
        self.pull_engine = pull_engine  # asked of the receiver (`ipc.pull`)
        self.same_process = peer_pid == os.getpid()
        self.exports: dict[tuple[int, int], int] = {}  # (data_ptr, numel) -> export id
        # The receiver's GPU, where this process can open its events: pulls are acked as soon
        # as the copy is queued, and the sender waits on the receiver's event for its end.
        self.early_ack_gpu: str | None = None
        self._events: dict[str, torch.cuda.Event] = {}  # handle -> opened receiver event
        # device index -> this link's "blocks written" events (`ready_event`); None: this
        # process could not make one, so a pull waits for the writes on the host
        self.ready: dict[int, list[torch.cuda.Event]] | None = {}
        # The receiver's cache, mapped (`offer_push`): this end copies the blocks into it.
        self.push_dst: torch.Tensor | None = None
        self._pushed: dict[int, list[torch.cuda.Event]] = {}  # device -> "copied" events

    def offer_push(self, offer: dict[str, Any]) -> None:
        """Take the receiver's offer to write into its cache (`push_to` of the hello reply),
        if this process can map it."""
        try:
            self.push_dst = ipc.open_export(offer["spec"])
        except ipc.IpcUnavailable as e:
            log.info("kvtransfer: no push on this link: %s", e)

    def offer_early_ack(self, gpu: str, probe_event: str) -> None:
        """Take the receiver's early acks if this process can open its events (tried on the
        handshake's probe event); without checksums only (those compare after the copy)."""
        try:
            self._events[probe_event] = ipc.open_event(gpu, probe_event)
        except ipc.IpcUnavailable as e:
            log.info("kvtransfer: no early acks on this link: %s", e)
            return
        self.early_ack_gpu = gpu

    def disable(self, why: str) -> None:
        log.warning("kvtransfer: %s; sending UCX messages on this link from now on", why)
        self.pull_from.clear()
        self.push_dst = None

    def can_push(self, kv: torch.Tensor) -> bool:
        dst = self.push_dst
        return (dst is not None and kv.is_contiguous() and kv.is_cuda == dst.is_cuda
                and kv.dtype == dst.dtype)

    def push(self, kv: torch.Tensor, src: list[int], dst: list[int], seq: int
             ) -> tuple[dict[str, Any], torch.cuda.Event | None]:
        """Queue the copy of the blocks into the receiver's cache on the staging stream, after
        their writes; return the header's push field and an event after the copy (None on the
        host: done). `IpcRefused` if it cannot: the request then goes as messages."""
        stream = staging.copy_stream(kv.device)
        staging.after_current(stream)
        try:
            ipc.copy_runs(self.push_dst, kv, wire.block_runs(src, dst), stream)
            if stream is None:
                return {"src": src}, None
            ev = _record(self._pushed, seq, stream)
            return {"src": src, "done": ipc.event_handle(ev), "gpu": ipc.domain(kv)}, ev
        except Exception as e:  # noqa: BLE001 - whatever CUDA refuses: UCX messages
            raise IpcRefused(f"push failed: {type(e).__name__}: {e}") from e

    def pull_spec(self, kv: torch.Tensor, src: Sequence[int]) -> dict[str, Any] | None:
        """The header's pull field (the blocks, and the cache's export the first time), or
        None where the receiver cannot pull from this cache."""
        if not self.pull_from or not kv.is_contiguous() or ipc.domain(kv) not in self.pull_from:
            return None
        key = (kv.data_ptr(), kv.numel())
        spec = None
        if key not in self.exports:
            try:
                spec = ipc.export(kv, same_process=self.same_process)
            except Exception as e:  # noqa: BLE001 - whatever torch refuses: send messages
                self.disable(f"could not export the cache ({type(e).__name__}: {e})")
                return None
            self.exports[key] = len(self.exports) + 1
        return {"export": self.exports[key], "src": [int(i) for i in src], "spec": spec,
                "engine": self.pull_engine}

    def ready_event(self, kv: torch.Tensor, seq: int) -> str | None:
        """The handle of an IPC event after the blocks' writes, which the receiver's copy waits
        for on the GPU, so the header need not wait on the host; None where there is none."""
        if self.ready is None:
            return None
        try:
            stream = staging.copy_stream(kv.device)
            staging.after_current(stream)
            return ipc.event_handle(_record(self.ready, seq, stream))
        except Exception as e:  # noqa: BLE001 - the host waits for the writes instead
            log.info("kvtransfer: no ready events on this link: %s: %s", type(e).__name__, e)
            self.ready = None
            return None

    async def wait_event(self, handle: str) -> None:
        """Until the receiver's event `handle` (an early-acked copy's end) has fired."""
        ev = self._events.get(handle)
        if ev is None:
            ev = self._events[handle] = ipc.open_event(self.early_ack_gpu, handle)
        await staging.wait_event(ev)

    def clear(self) -> None:
        """Drop the link's events and mapped cache by reference count, not in the cyclic GC (a
        link sits in reference cycles): torch's CUDA event destructor releases the GIL, and
        another thread running in the middle of a collection can crash the process."""
        self._events.clear()
        self._pushed.clear()
        if self.ready:
            self.ready.clear()
        self.push_dst = None


def _record(pools: dict[int, list[torch.cuda.Event]], seq: int, stream: torch.cuda.Stream
            ) -> torch.cuda.Event:
    """Record the link's IPC event for `seq` (`ipc.pooled_event`, from the pool of `stream`'s
    device) on `stream`, and return it."""
    ev = ipc.pooled_event(pools.setdefault(stream.device.index, []), seq, stream.device)
    ev.record(stream)
    return ev

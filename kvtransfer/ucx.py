"""UCX transport on ucxx: shared memory on one host, TCP (or RDMA) between hosts.

A receiver publishes its worker address (`mode="worker"`) or a listener's host:port. A request
is a header, payload (`ucx_recv`), extras and an optional crc32 trailer, then an ack; a
malformed message is dropped, counted and fails its request.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import Any

import torch
import ucxx

from kvtransfer import staging, wire
from kvtransfer.base import Extras, OnReceive, TransferError, Transport
from kvtransfer.ipc import DEFAULT_ENGINE  # `ipc` names an argument below
from kvtransfer.ipc import ENGINES as PULL_ENGINES
from kvtransfer.layout import BlockLayout, LayoutMismatch, check_compatible
from kvtransfer.ucx_recv import Landing
from kvtransfer.ucx_send import UcxConnection

log = logging.getLogger(__name__)
MODES = ("worker", "listener")


class UcxTransport(Transport):
    """A UCX end. Receivers call `start()`; senders only `connect()`. `mode` is how this end
    receives (the kind of address it publishes); a sender follows the receiver's address.
    `progress_mode` is process-wide in ucxx (`wire.ensure_ucx`); "thread" idles at no CPU."""

    def __init__(self, layout: BlockLayout, kv_cache: torch.Tensor | None = None,
                 on_receive: OnReceive | None = None, *, mode: str = "worker",
                 host: str = "127.0.0.1", port: int = 0, num_chunks: int = 1,
                 checksum: bool = False, timeout: float = 30.0, progress_mode: str = "thread",
                 direct: bool | None = None, ipc: bool | None = None,
                 pull_engine: str = DEFAULT_ENGINE, push: bool | None = None,
                 pull: bool | None = None):
        super().__init__(layout, kv_cache, on_receive)
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        self.mode, self.host, self.port = mode, host, port
        self.num_chunks, self.checksum, self.timeout = num_chunks, checksum, timeout
        self.direct = direct  # None: per request by message size; False: always staged
        # None: copy through CUDA IPC wherever both ends can (a receiver offers, a sender
        # takes), by push (the sender copies) or pull (the receiver copies); False: never.
        self.ipc, self.push, self.pull = ipc, push, pull
        if pull_engine not in PULL_ENGINES:
            raise ValueError(f"pull_engine must be one of {PULL_ENGINES}, got {pull_engine!r}")
        self.pull_engine = pull_engine  # whose copy engines move a pull (`ipc.pull`)
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
        self._landing = Landing(layout, kv_cache, self.pool, pull_engine)

    @property
    def healthy(self) -> bool:
        """False once closed, or once a receive loop died while open (`failure` says why):
        its senders then wait out their timeouts. A malformed message never ends a loop."""
        return self.failure is None and not self._closed

    @property
    def dropped_messages(self) -> int:
        """Malformed, oversized or undecodable hellos, headers, trailers and acks dropped."""
        return (self._dropped + self._landing.dropped
                + sum(c.dropped_messages for c in self._conns))

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
        else:  # UCX refuses listener endpoints without error handling ("asymmetric")
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
        if conn.ipc_link.pull_from and msg.get("probe_event"):
            conn.ipc_link.offer_early_ack(msg["gpu"], msg["probe_event"])
        if msg.get("push_to") and self.ipc is not False and self.push is not False:
            conn.ipc_link.offer_push(msg["push_to"])
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
        self._landing.clear()

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
                reply["pid"] = os.getpid()  # a sender in this process exports by reference
                reply.update(self._landing.offers(link, hello.get("pid") == os.getpid(),
                                                  push=self.push is not False,
                                                  pull=self.pull is not False))
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
        """Fail the request a malformed header still names, in the inbox and to its sender (an
        error ack), so neither waits out a timeout."""
        error = f"malformed header: {err}"
        if err.request_id is not None:
            self._deliver(err.request_id, TransferError(f"{err.request_id}: {error}"))
        if err.seq is not None:
            await self._ack(ep, link, err.seq, error, None)

    def _forget(self, link: int) -> None:
        """Drop a link that is no longer served, with its IPC events and mapped caches."""
        self._links.pop(link, None)
        self._landing.forget(link)

    async def _receive(self, link: int, ep: Any, hdr: dict[str, Any]) -> None:
        """Land one request, hand its outcome to the inbox and ack it (unless acked early)."""
        stamps: dict[str, Any] | None = (
            {"header": time.perf_counter(), "landed": []} if hdr.get("trace") else None)
        seq, rid = hdr["seq"], hdr["request_id"]

        def early_ack(**more: Any) -> Any:
            hdr["acked"] = True
            return self._ack(ep, link, seq, None, stamps, **more)

        error, extras, ipc_failed = await self._landing.receive(link, hdr, stamps, early_ack)
        if not ipc_failed:
            self._deliver(rid, extras if error is None else TransferError(f"{rid}: {error}"))
        if not hdr.get("acked"):
            await self._ack(ep, link, seq, error, stamps, ipc_failed=ipc_failed)

    def _deliver(self, rid: str, result: Extras | TransferError) -> None:
        """Hand a request's outcome to the inbox; a failing `on_receive` is only logged."""
        try:
            self.inbox.put(rid, result)
        except Exception:  # noqa: BLE001 - the node's callback; the loop must go on
            log.exception("kvtransfer: on_receive failed for %s", wire.excerpt(rid))

    async def _ack(self, ep: Any, link: int, seq: int, error: str | None,
                   stamps: dict[str, Any] | None, **more: Any) -> None:
        """A request's ack: ok or the error, the stamps when traced, and `more` (`ipc_failed`,
        an early ack's `event`). A sender that is gone is only logged: its lease expires."""
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

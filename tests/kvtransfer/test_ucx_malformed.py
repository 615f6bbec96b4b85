"""Receive loops that cannot die: malformed, oversized, truncated or undecodable messages on
real UCX endpoints are dropped and counted, the request they name fails at once, the loops go
on serving; senders refuse what a receiver could not take; `healthy` says when a loop died."""

from __future__ import annotations

import asyncio
import struct
import time

import numpy as np
import pytest
import torch

from kvtransfer import MAX_REQUEST_ID_BYTES, RequestTooLarge, TransferError
from tests.kvtransfer.conftest import random_kv, tiny_layout

pytest.importorskip("ucxx", reason="ucxx-cu12 is not installed: UCX transport untested")

import ucxx  # noqa: E402

from kvtransfer import wire  # noqa: E402
from kvtransfer.ucx import UcxTransport  # noqa: E402

LAYOUT = tiny_layout()


def _raw(data: bytes) -> np.ndarray:
    return np.frombuffer(data, dtype=np.uint8).copy()


def _framed(body: bytes) -> np.ndarray:
    """`body` behind a correct length prefix, as `wire.encode` frames JSON."""
    return _raw(struct.pack("<I", len(body)) + body)


# What a broken or hostile peer might put on a receiver's control tags.
GARBAGE = {
    "oversized": lambda: _raw(b"x" * (wire.CTRL_HEADER + 1)),  # UCX truncates: nothing lands
    "random bytes": lambda: _raw(bytes(range(256)) * 4),
    "truncated json": lambda: _framed(b'{"op":"send","seq":1,"request_id":"r","dst":[1,'),
    "length past the end": lambda: _raw(struct.pack("<I", 1 << 30) + b"{}"),
    "not an object": lambda: _framed(b"[1, 2, 3]"),
    "deep nesting": lambda: _framed(b"[" * 100_000 + b"]" * 100_000),
    "stop from a stranger": lambda: wire.encode({"op": "stop"}),
    "header without fields": lambda: wire.encode({"op": "send"}),
}


async def _until(predicate, timeout: float = 5.0) -> None:
    """Until `predicate()` holds (the receive loops run on their own); fail after `timeout`."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


async def _transfer_works(rx: UcxTransport, conn, rid: str) -> None:
    """A normal request on `conn` lands in `rx` (a dead loop would fail it: no ack)."""
    src = random_kv(LAYOUT, seed=3)
    await conn.send_blocks(rid, src, [1, 2], [5, 6])
    await rx.recv_blocks(rid, timeout=5)
    assert torch.equal(rx.kv_cache[:, :, [5, 6]], src[:, :, [1, 2]])


@pytest.mark.parametrize("kind", sorted(GARBAGE))
def test_serve_loop_survives_garbage_header(ucx_loop, kind):
    """Sent straight on a link's header tag: dropped, counted, and the same receiver serves
    the next request on that link; nothing lands in the cache or the inbox."""

    async def go():
        async with UcxTransport(LAYOUT, random_kv(LAYOUT, seed=1)) as rx:
            tx = UcxTransport(LAYOUT, timeout=5)
            conn = await tx.connect(rx.address)
            before = rx.kv_cache.clone()
            await wire.send(conn._ep, GARBAGE[kind](), conn._tag(0, wire.HEADER))
            await _until(lambda: rx.dropped_messages == 1)
            assert rx.healthy and torch.equal(rx.kv_cache, before)
            await _transfer_works(rx, conn, "after")
            assert rx.dropped_messages == 1 and rx.healthy
            await tx.close()

    ucx_loop.run(go(), timeout=60)


@pytest.mark.parametrize("hello", [
    {"op": "hello", "link": 7, "layout": LAYOUT.to_dict()},  # no reply_to
    # an address of another UCX version: handed to UCX, it aborts the process
    {"op": "hello", "link": 7, "layout": LAYOUT.to_dict(), "reply_to": "ff" * 200},
    {"op": "hello", "link": 1 << 40, "layout": LAYOUT.to_dict(), "reply_to": "20"},
    {"op": "stop"},
], ids=["no reply_to", "foreign address", "link past 32 bits", "stop from a stranger"])
def test_accept_loop_survives_garbage_hello(ucx_loop, hello):
    """Worker mode: hellos (and raw garbage) on the receiver's own tag are dropped and
    counted; a real sender still connects and transfers afterwards."""

    async def go():
        async with UcxTransport(LAYOUT, random_kv(LAYOUT, seed=1)) as rx:
            ep = await wire.endpoint_to_worker(rx.address["worker"])
            hello_tag = wire.tag(rx.address["id"], 0, wire.HELLO)
            await wire.send(ep, wire.encode(hello), hello_tag)
            await wire.send(ep, GARBAGE["oversized"](), hello_tag)
            await _until(lambda: rx.dropped_messages == 2)
            wire.drop(ep)
            tx = UcxTransport(LAYOUT, timeout=5)
            await _transfer_works(rx, await tx.connect(rx.address), "after")
            assert rx.healthy
            await tx.close()

    ucx_loop.run(go(), timeout=60)


def test_listener_drops_garbage_hello(ucx_loop):
    """Listener mode: garbage as a new endpoint's hello is dropped and counted; the listener
    still admits a real sender."""

    async def go():
        async with UcxTransport(LAYOUT, random_kv(LAYOUT, seed=1), mode="listener") as rx:
            ep = await ucxx.create_endpoint(rx.address["host"], rx.address["port"],
                                            endpoint_error_handling=True)
            await ep.send(GARBAGE["random bytes"]())
            await _until(lambda: rx.dropped_messages == 1)
            tx = UcxTransport(LAYOUT, timeout=5)
            await _transfer_works(rx, await tx.connect(rx.address), "after")
            assert rx.healthy
            wire.drop(ep)
            await tx.close()

    ucx_loop.run(go(), timeout=60)


def test_malformed_header_fails_its_request_at_once(ucx_loop):
    """A header that names its request (seq, request id) but cannot be used fails that
    request on both sides at once: the sender gets an error ack, not a timeout, and
    `recv_blocks` raises; the link then carries the next request."""

    async def go():
        async with UcxTransport(LAYOUT, random_kv(LAYOUT, seed=1)) as rx:
            tx = UcxTransport(LAYOUT, timeout=20)
            conn = await tx.connect(rx.address)
            send = conn._send

            def bad_chunks(buf, seq, kind):  # layer chunks past the layout's 3 layers
                if kind == wire.HEADER:
                    buf = wire.encode({**wire.decode(buf), "chunks": [[0, 99]]})
                return send(buf, seq, kind)

            conn._send = bad_chunks
            t0 = time.monotonic()
            with pytest.raises(TransferError, match="malformed header: layer chunks"):
                await conn.send_blocks("bad", random_kv(LAYOUT), [1], [2])
            assert time.monotonic() - t0 < 5  # the ack came, not the timeout
            with pytest.raises(TransferError, match="malformed header"):
                await rx.recv_blocks("bad", timeout=5)
            conn._send = send
            await _transfer_works(rx, conn, "after")
            assert rx.dropped_messages == 1 and rx.healthy
            await tx.close()

    ucx_loop.run(go(), timeout=60)


@pytest.mark.parametrize("ack", [_raw(b"\x00" * (wire.CTRL_SMALL + 1)), wire.encode({"ok": 1}),
                                 _framed(b"not json")],
                         ids=["oversized", "ok not a bool", "not json"])
def test_malformed_ack_fails_the_request_at_once(ucx_loop, ack):
    """A receiver that answers what cannot be read: the sender fails that request at once
    with a clear error, counts it, and the link carries the next request."""

    async def go():
        async with UcxTransport(LAYOUT, random_kv(LAYOUT, seed=1)) as rx:
            tx = UcxTransport(LAYOUT, timeout=20)
            conn = await tx.connect(rx.address)
            real_ack = rx._ack

            async def garbage_ack(ep, link, seq, *args, **kwargs):
                await wire.send(ep, ack, wire.tag(link, seq, wire.ACK))

            rx._ack = garbage_ack
            t0 = time.monotonic()
            with pytest.raises(TransferError, match="bad: malformed ack"):
                await conn.send_blocks("bad", random_kv(LAYOUT), [1], [2])
            assert time.monotonic() - t0 < 5
            assert conn.dropped_messages == tx.dropped_messages == 1
            rx._ack = real_ack
            await _transfer_works(rx, conn, "after")
            await tx.close()

    ucx_loop.run(go(), timeout=60)


@pytest.mark.parametrize("reply", [{"ok": True, "layout": LAYOUT.to_dict()},
                                   {"ok": True, "layout": {"model": 1}, "num_blocks": 8}],
                         ids=["no num_blocks", "layout missing fields"])
def test_malformed_handshake_reply_fails_the_connect_at_once(ucx_loop, reply):
    """A peer that answers the hello with what cannot be read: `connect` raises a clear
    ConnectionError at once (not after its timeout) and the sender counts it."""

    async def go():
        tx = UcxTransport(LAYOUT, timeout=20)
        wire.ensure_ucx("thread")
        fake = {"kind": "ucx", "mode": "worker", "id": wire.new_id(),
                "worker": wire.worker_address_hex()}  # this process plays the receiver

        async def answer():
            hello = await wire.recv_ctrl(wire.tag(fake["id"], 0, wire.HELLO))
            ep = await wire.endpoint_to_worker(hello["reply_to"])
            await wire.send(ep, wire.encode(reply), wire.tag(hello["link"], 0, wire.HELLO_REPLY))
            wire.drop(ep)

        peer = asyncio.ensure_future(answer())
        t0 = time.monotonic()
        with pytest.raises(ConnectionError, match="malformed handshake reply"):
            await tx.connect(fake)
        assert time.monotonic() - t0 < 5 and tx.dropped_messages == 1
        await peer
        await tx.close()

    ucx_loop.run(go(), timeout=60)


def test_sender_refuses_what_the_receiver_cannot_take(ucx_loop, monkeypatch):
    """An overlong request id, or a header naming more blocks than the receiver's buffer
    holds, is refused before anything is sent, naming the size and the limit; the longest
    request id (in UTF-8 bytes) still goes."""
    sent = []

    async def go():
        async with UcxTransport(LAYOUT, random_kv(LAYOUT, num_blocks=512, seed=1)) as rx:
            tx = UcxTransport(LAYOUT, timeout=5)
            conn = await tx.connect(rx.address)
            send = conn._send
            conn._send = lambda *a: sent.append(a) or send(*a)
            src = random_kv(LAYOUT, num_blocks=512)
            with pytest.raises(RequestTooLarge, match=f"{2 * MAX_REQUEST_ID_BYTES + 2} bytes"
                               f".* {MAX_REQUEST_ID_BYTES} bytes"):
                await conn.send_blocks("é" * (MAX_REQUEST_ID_BYTES + 1), src, [1], [2])
            monkeypatch.setattr(wire, "CTRL_HEADER", 1024)
            with pytest.raises(RequestTooLarge, match=r"\(300 blocks\).* 1024-byte buffer"):
                await conn.send_blocks("many", src, list(range(300)), list(range(300)))
            assert sent == []
            monkeypatch.undo()
            await _transfer_works(rx, conn, "é" * (MAX_REQUEST_ID_BYTES // 2))
            assert rx.dropped_messages == 0
            await tx.close()

    ucx_loop.run(go(), timeout=60)
    assert issubclass(RequestTooLarge, TransferError) and issubclass(RequestTooLarge, ValueError)


def test_healthy_until_a_loop_dies(ucx_loop, monkeypatch):
    """`healthy` holds while serving (and through dropped messages) and turns False when a
    serve loop dies of an error that is not a malformed message (here a receive that raises),
    with `failure` saying which loop and why; closed, a transport is not healthy."""

    async def go():
        sender_only = UcxTransport(LAYOUT)
        assert sender_only.healthy
        async with UcxTransport(LAYOUT, random_kv(LAYOUT, seed=1)) as rx:
            tx = UcxTransport(LAYOUT, timeout=5)
            conn = await tx.connect(rx.address)
            assert rx.healthy and rx.failure is None
            header_tag = conn._tag(0, wire.HEADER)
            recv_ctrl = wire.recv_ctrl

            async def broken_header_recv(t, *args, **kwargs):
                if t == header_tag:
                    raise RuntimeError("worker gone")
                return await recv_ctrl(t, *args, **kwargs)

            monkeypatch.setattr(wire, "recv_ctrl", broken_header_recv)
            await _transfer_works(rx, conn, "last")  # its loop then posts the broken receive
            await _until(lambda: not rx.healthy)
            assert "serve loop" in rx.failure and "RuntimeError" in rx.failure
            await tx.close()
        assert not rx.healthy

    ucx_loop.run(go(), timeout=60)


def test_failing_on_receive_still_acks(ucx_loop):
    """A node's `on_receive` that raises is logged; the sender still gets its ack and the
    loop serves the next request."""
    seen = []

    def on_receive(rid, result):
        seen.append(rid)
        raise RuntimeError("node bug")

    async def go():
        async with UcxTransport(LAYOUT, random_kv(LAYOUT, seed=1), on_receive=on_receive) as rx:
            tx = UcxTransport(LAYOUT, timeout=5)
            conn = await tx.connect(rx.address)
            for rid in ("a", "b"):
                await conn.send_blocks(rid, random_kv(LAYOUT), [1], [2])
            assert rx.healthy
            await tx.close()

    ucx_loop.run(go(), timeout=60)
    assert seen == ["a", "b"]


@pytest.mark.parametrize("hdr,seq,rid", [
    ({"op": "send", "seq": 3, "request_id": "r"}, 3, "r"),  # fields missing: still answerable
    ({"op": "send", "seq": 3, "request_id": "r" * 300, "dst": []}, 3, None),
    ({"op": "send", "seq": True, "request_id": "r"}, None, "r"),  # a bool is no seq
    ({"op": "send", "seq": -1, "request_id": 5}, None, None),
])
def test_check_header_names_what_can_be_answered(hdr, seq, rid):
    with pytest.raises(wire.MalformedMessage) as err:
        wire.check_header(hdr, num_layers=3)
    assert (err.value.seq, err.value.request_id) == (seq, rid)


@pytest.mark.parametrize("buf", [b"", b"\x05\x00\x00\x00{}", b"\x02\x00\x00\x00\xff\xfe",
                                 b"\x04\x00\x00\x00null"])
def test_decode_refuses_what_is_not_an_object(buf):
    with pytest.raises(wire.MalformedMessage):
        wire.decode(bytearray(buf))


def test_excerpt_escapes_and_cuts():
    text = wire.excerpt("evil\nline\x1b[31m" + "x" * 10_000)
    assert "\n" not in text and "\x1b" not in text and len(text) < 100
    clipped = wire.clip("e" * 10_000)
    assert clipped.endswith("(10000 chars)") and len(clipped) < wire.MAX_ERROR_CHARS + 50

"""Wire format of the UCX transport: tags, control messages, byte views, extras packing.

Every message is tagged `link id (32 bits) | request seq (24) | kind (8)`; the link id is
random per connection, so one receiver tells senders and requests apart. Control messages are
length-prefixed JSON, checked before use; what cannot be read raises `MalformedMessage`.
"""

from __future__ import annotations

import asyncio
import atexit
import json
import math
import reprlib
import secrets
import struct
import threading
import zlib
from typing import Any

import numpy as np
import torch
import ucxx
from ucxx.exceptions import UCXMessageTruncatedError

from kvtransfer.base import RequestTooLarge, check_request_id
from kvtransfer.layout import dtype_from_name, dtype_name

HELLO, HELLO_REPLY, HEADER, ACK, EXTRAS, TRAILER = range(6)
CHUNK = 16  # chunk i of a request's payload travels with kind CHUNK + i
MAX_CHUNKS = 256 - CHUNK
CTRL_SMALL = 64 << 10  # hello, replies, acks, trailers
CTRL_HEADER = 1 << 20  # a header carries the dst block ids: ~7 bytes each as JSON
MAX_ERROR_CHARS = 2000  # an error string in an ack is cut to this: acks must fit CTRL_SMALL


class MalformedMessage(ValueError):
    """A control message that cannot be used: larger than the buffer posted for it (UCX then
    delivers nothing), not length-prefixed JSON, not an object, or missing or mistyping a
    field. `seq` and `request_id` are set where a header still names its request, so the
    receiver can answer it with an error."""

    def __init__(self, reason: str, seq: int | None = None, request_id: str | None = None):
        super().__init__(reason)
        self.seq, self.request_id = seq, request_id


def excerpt(value: Any, limit: int = 80) -> str:
    """Untrusted `value` fit for a log line or an error: its repr (quotes and control
    characters escaped), strings cut to about `limit` characters, containers to a few items."""
    r = reprlib.Repr()
    r.maxstring = r.maxother = r.maxlong = limit
    r.maxlist = r.maxdict = 6
    r.maxlevel = 3
    return r.repr(value)


def tag(link: int, seq: int, kind: int) -> int:
    return (link << 32) | ((seq & 0xFFFFFF) << 8) | kind


def new_id() -> int:
    """A random non-zero 32-bit link id."""
    return secrets.randbits(32) | 1


_bound_loop: list[asyncio.AbstractEventLoop] = []  # the loop ucxx delivers completions to


def ensure_ucx(progress_mode: str) -> None:
    """Initialise ucxx once per process, from the running loop, and make that loop progress it.
    In `thread` mode completions arrive through ucxx's notifier thread, bound to this loop:
    every transport of a process must run on it (`LoopThread` from synchronous code). Other
    modes busy-yield on every pending receive, so an idle receiver spins a whole core."""
    loop = asyncio.get_running_loop()
    try:
        ucxx.init(progress_mode=progress_mode,
                  enable_python_future=progress_mode.startswith("thread"))
    except RuntimeError:
        pass  # already initialised in this process (its first caller chose the mode)
    else:
        _bound_loop.append(loop)
        # ucxx's notifier thread is not a daemon and never stops by itself: without this the
        # interpreter hangs at exit. Registered to run before non-daemon threads are joined.
        getattr(threading, "_register_atexit", atexit.register)(ucxx.stop_notifier_thread)
    if _bound_loop and _bound_loop[0] is not loop and _progress_mode().startswith("thread"):
        raise RuntimeError("ucxx (thread progress) is bound to the event loop that first used "
                           "it; run every UcxTransport of a process on that loop")
    ucxx.continuous_ucx_progress()


def _progress_mode() -> str:
    ctx = ucxx.core._ctx  # the process's ucxx context: read-only peek at its progress mode
    return "" if ctx is None else ctx.progress_mode


def worker_address_hex() -> str:
    return ucxx.get_worker_address().tobytes().hex()


async def endpoint_to_worker(address_hex: str) -> Any:
    """Endpoint to a worker whose address came out of band. Error handling must stay off:
    with it on, UCX refuses shared memory ("no peer failure handler") and falls back to TCP."""
    addr = ucxx.get_ucx_address_from_buffer(bytes.fromhex(address_hex))
    return await ucxx.create_endpoint_from_worker_address(addr, endpoint_error_handling=False)


def encode(msg: dict[str, Any]) -> np.ndarray:
    data = json.dumps(msg, separators=(",", ":")).encode()
    return np.frombuffer(struct.pack("<I", len(data)) + data, dtype=np.uint8).copy()


def decode(buf: bytearray | np.ndarray) -> dict[str, Any]:
    """The JSON object `encode` made; `MalformedMessage` for anything else."""
    raw = memoryview(buf).cast("B")
    if len(raw) < 4:
        raise MalformedMessage(f"{len(raw)} bytes: shorter than the length prefix")
    (n,) = struct.unpack_from("<I", raw)
    if n > len(raw) - 4:
        raise MalformedMessage(f"length prefix says {n} bytes, {len(raw) - 4} follow it")
    body = bytes(raw[4:4 + n])
    try:
        msg = json.loads(body)
    except (ValueError, RecursionError) as e:  # bad UTF-8 or JSON, nesting past the stack
        raise MalformedMessage(f"not JSON ({type(e).__name__}): {excerpt(body)}") from None
    if not isinstance(msg, dict):
        raise MalformedMessage(f"not a JSON object: {excerpt(msg)}")
    return msg


async def recv_ctrl(t: int | None, size: int = CTRL_SMALL, ep: Any = None) -> dict[str, Any]:
    """Receive one control message on this process's worker (any sender) with tag `t`, or,
    given `ep`, on that endpoint's own tag. `MalformedMessage` if it was larger than `size`
    (UCX reports the truncation and delivers nothing; the tag stays usable) or undecodable."""
    buf = bytearray(size)
    try:
        await (ucxx.recv(buf, t) if ep is None else ep.recv(buf))
    except UCXMessageTruncatedError:
        raise MalformedMessage(f"larger than the {size} bytes posted for it") from None
    return decode(buf)


# The fields each control message must carry, with their JSON types; None: may be absent or
# null. `int` never accepts a bool.
HELLO_FIELDS = {"link": int, "layout": dict, "reply_to": (str, None), "pid": (int, None)}
REPLY_FIELDS = {"ok": bool, "layout": dict, "num_blocks": int, "error": (str, None),
                "pull_from": (list, None), "pid": (int, None), "gpu": (str, None),
                "probe_event": (str, None), "push_to": (dict, None)}
HEADER_FIELDS = {"seq": int, "request_id": str, "dst": list, "chunks": list,
                 "direct": (list, None), "extras": list, "extras_nbytes": int,
                 "checksum": bool, "trace": (bool, None), "pull": (dict, None),
                 "push": (dict, None), "early_ack": (bool, None)}
ACK_FIELDS = {"ok": bool, "error": (str, None), "ipc_failed": (bool, None),
              "event": (str, None), "t": (dict, None)}


def _has_type(value: Any, kinds: type | tuple) -> bool:
    kinds = kinds if isinstance(kinds, tuple) else (kinds,)
    if value is None:
        return None in kinds
    if isinstance(value, bool):
        return bool in kinds
    return isinstance(value, tuple(k for k in kinds if k is not None))


def require(msg: dict[str, Any], fields: dict[str, type | tuple]) -> None:
    """`MalformedMessage` unless every field of `msg` named in `fields` has its type. The
    messages of these checks do not say which kind of message: their callers do."""
    for name, kinds in fields.items():
        if not _has_type(msg.get(name), kinds):
            got = excerpt(msg[name]) if name in msg else "missing"
            raise MalformedMessage(f"field {name!r} is {got}")


def check_hello(hello: dict[str, Any], worker_mode: bool) -> None:
    """A sender's hello: a 32-bit link id, a layout, and (worker mode) where to reply."""
    if hello.get("op") != "hello":
        raise MalformedMessage(f"op is {excerpt(hello.get('op'))}")
    require(hello, HELLO_FIELDS)
    if not 0 < hello["link"] < 1 << 32:
        raise MalformedMessage(f"link id {excerpt(hello['link'])} is not 32 bits")
    if worker_mode and not _worker_address(hello.get("reply_to")):
        raise MalformedMessage(f"reply_to {excerpt(hello.get('reply_to'))} is not a worker "
                               "address of this UCX version")


def _worker_address(text: Any) -> bool:
    """Whether `text` may go to UCX as a worker address: hex, starting with this UCX's
    address version byte (UCX asserts on another version, which aborts the process)."""
    try:
        raw = bytes.fromhex(text)
    except (TypeError, ValueError):
        return False
    return raw[:1] == bytes.fromhex(worker_address_hex()[:2])


def check_header(hdr: dict[str, Any], num_layers: int) -> None:
    """A request's header, for a cache of `num_layers` layers (its layer chunks and direct
    runs must fit the tag space). Where its seq and request id are sound, the
    `MalformedMessage` names them, so the receiver can fail that request at once."""
    try:
        if hdr.get("op") != "send":
            raise MalformedMessage(f"op is {excerpt(hdr.get('op'))}")
        require(hdr, HEADER_FIELDS)
        check_request_id(hdr["request_id"])
        if hdr["seq"] < 0 or hdr["extras_nbytes"] < 0:
            raise MalformedMessage(f"seq {excerpt(hdr['seq'])} or extras_nbytes "
                                   f"{excerpt(hdr['extras_nbytes'])} is negative")
        if not all(_has_type(i, int) for i in hdr["dst"]):
            raise MalformedMessage(f"dst ids not all ints: {excerpt(hdr['dst'])}")
        chunks, runs = hdr["chunks"], hdr.get("direct") or []
        if not (_int_pairs(chunks) and len(chunks) <= MAX_CHUNKS
                and all(0 <= lo < hi <= num_layers for lo, hi in chunks)):
            raise MalformedMessage(f"layer chunks {excerpt(chunks)} do not fit "
                                   f"{num_layers} layers and {MAX_CHUNKS} tags")
        if not (_int_pairs(runs) and 2 * num_layers * len(runs) <= MAX_CHUNKS
                and all(d >= 0 and k > 0 for d, k in runs)):
            raise MalformedMessage(f"direct runs {excerpt(runs)} are not (start, length) "
                                   f"pairs that fit {MAX_CHUNKS} tags")
    except (MalformedMessage, RequestTooLarge) as e:
        raise MalformedMessage(str(e), *_sound_request(hdr)) from None


def _int_pairs(value: list[Any]) -> bool:
    return all(isinstance(p, list) and len(p) == 2 and all(_has_type(x, int) for x in p)
               for p in value)


def _sound_request(hdr: dict[str, Any]) -> tuple[int | None, str | None]:
    """A header's seq and request id, each None where it cannot be answered by."""
    seq, rid = hdr.get("seq"), hdr.get("request_id")
    try:
        check_request_id(rid)
    except (TypeError, RequestTooLarge):
        rid = None
    return (seq if _has_type(seq, int) and seq >= 0 else None), rid


def check_ack(ack: dict[str, Any]) -> None:
    """A receiver's ack: ok, its error, and the receiver's stamps (numbers) when traced."""
    require(ack, ACK_FIELDS)
    for v in (ack.get("t") or {}).values():
        if not all(_has_type(x, (int, float)) for x in (v if isinstance(v, list) else [v])):
            raise MalformedMessage(f"stamp {excerpt(v)} is not a number")


def clip(error: str) -> str:
    """An error string cut to `MAX_ERROR_CHARS`, so the ack carrying it fits `CTRL_SMALL`."""
    if len(error) <= MAX_ERROR_CHARS:
        return error
    return f"{error[:MAX_ERROR_CHARS]}... ({len(error)} chars)"


def encode_header(hdr: dict[str, Any], reserve: int = 0) -> np.ndarray:
    """A request's header on the wire; `RequestTooLarge` where it (plus `reserve` bytes of
    fields still to come) would not fit the receiver's `CTRL_HEADER` buffer."""
    buf = encode(hdr)
    if buf.nbytes + reserve > CTRL_HEADER:
        raise RequestTooLarge(f"{excerpt(hdr['request_id'])}: a header of "
                              f"{buf.nbytes + reserve} bytes ({len(hdr['dst'])} blocks) does "
                              f"not fit the receiver's {CTRL_HEADER}-byte buffer")
    return buf


async def send(ep: Any, buf: Any, t: int) -> None:
    await ep.send(buf, tag=t, force_tag=True)


def drop(ep: Any) -> None:
    """Close an endpoint, flushing what was sent; give up after a second (a dead peer)."""
    ep.abort(period=10**9)


def as_buffer(t: torch.Tensor) -> Any:
    """The bytes of a contiguous tensor as UCX sees them: numpy on the host (bf16 has no
    numpy dtype, hence the uint8 view), the CUDA tensor itself on a GPU."""
    flat = t.reshape(-1).view(torch.uint8)
    return flat if flat.is_cuda else flat.numpy()


def crc(t: torch.Tensor) -> int:
    return zlib.crc32(t.reshape(-1).view(torch.uint8).cpu().numpy())


def layer_chunks(num_layers: int, num_chunks: int) -> list[tuple[int, int]]:
    """Split the layer dimension into `num_chunks` near-equal [lo, hi) ranges."""
    k = max(1, min(num_chunks, num_layers, MAX_CHUNKS))
    step = math.ceil(num_layers / k)
    return [(lo, min(lo + step, num_layers)) for lo in range(0, num_layers, step)]


# A direct transfer sends each (layer, K/V, run of consecutive blocks) straight from the
# sender's cache into the receiver's, with no gather or scatter: it pays once messages are large
# enough that UCX's cost per message is below copying the bytes twice (bench/README.md).
DIRECT_MIN_BYTES = {"cuda": 16 << 20, "cpu": 1 << 20}


def direct_min_bytes(device: torch.device | str) -> int:
    """The mean message size from which a request on this device goes direct."""
    return DIRECT_MIN_BYTES["cuda" if torch.device(device).type == "cuda" else "cpu"]


def block_runs(src: list[int], dst: list[int]) -> list[tuple[int, int, int]]:
    """(src_start, dst_start, length) of the maximal runs where both id lists count up by one
    together: each run is one contiguous range of every layer's K and V in both caches."""
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst):
        if runs and s == runs[-1][0] + runs[-1][2] and d == runs[-1][1] + runs[-1][2]:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((s, d, 1))
    return runs


def plan_direct(src: list[int], dst: list[int], num_layers: int, layer_block_bytes: int,
                direct: bool | None, min_bytes: int = DIRECT_MIN_BYTES["cpu"]
                ) -> list[tuple[int, int, int]] | None:
    """The runs of a direct transfer, or None to gather into staging buffers instead.
    `direct`: None decides by the mean message size (`min_bytes`, see `direct_min_bytes`),
    True whenever the messages fit the tag space, False never. `layer_block_bytes`: one block
    of one layer's K (or V)."""
    if not src or direct is False:
        return None
    runs = block_runs(src, dst)
    messages = 2 * num_layers * len(runs)
    if messages > MAX_CHUNKS:
        return None
    if direct is None and len(src) * 2 * num_layers * layer_block_bytes < messages * min_bytes:
        return None
    return runs


def direct_views(kv: torch.Tensor, runs: list[tuple[int, int]]) -> list[torch.Tensor]:
    """The contiguous pieces of a direct transfer in wire order (layer, K/V, run), each
    `kv[layer, kv, start:start + length]`; `runs` are (start, length) on this side."""
    return [kv[layer, j, start:start + n] for layer in range(kv.shape[0]) for j in (0, 1)
            for start, n in runs]


def run_sums(kv: torch.Tensor, runs: list[tuple[int, int, int]], side: int) -> list[int]:
    """crc32 of each piece (layer, K/V, run) of `kv` that block runs (s, d, k) read (side 0,
    the sender's cache) or write (side 1, the receiver's), in wire order: what the two ends of
    a push or pull compare."""
    return [crc(v) for v in direct_views(kv, [(r[side], r[2]) for r in runs])]


def pack_extras(extras: dict[str, torch.Tensor]) -> tuple[list[Any], torch.Tensor]:
    """(spec, blob): one host byte buffer for all extras, and how to cut it up again."""
    spec, parts = [], []
    for name, t in extras.items():
        parts.append(t.detach().contiguous().cpu().reshape(-1).view(torch.uint8))
        spec.append([name, dtype_name(t.dtype), list(t.shape)])
    blob = torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)
    return spec, blob


def unpack_extras(spec: list[Any], blob: torch.Tensor,
                  device: torch.device) -> dict[str, torch.Tensor]:
    out, off = {}, 0
    for name, dt, shape in spec:
        dtype = dtype_from_name(dt)
        n = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        # clone(): a uint8 slice at an odd offset cannot be viewed as a wider dtype.
        out[name] = blob[off:off + n].clone().view(dtype).reshape(shape).to(device)
        off += n
    if off != blob.numel():
        raise ValueError(f"extras spec covers {off} bytes, blob has {blob.numel()}")
    return out

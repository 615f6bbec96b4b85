"""Same-host GPU to GPU: one end copies the blocks between the two caches through a CUDA IPC
mapping, one `cudaMemcpy2DAsync` per run of blocks, avoiding UCX's per-message rendezvous.
Push: the sender copies into the receiver's cache; pull: the receiver copies out. Failures fall
back to UCX messages; `HOST_PULL` lets CPU tests run the protocol in one process.
"""

from __future__ import annotations

import ctypes
import os
import weakref
from typing import Any

import torch

from kvtransfer import staging
from kvtransfer.layout import BLOCKS_DIM, dtype_from_name, dtype_name

HOST_PULL = False


class IpcUnavailable(RuntimeError):
    """This process cannot read the peer's cache (GPU not visible, handle refused)."""


def gpu_uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


def visible_gpus() -> list[str]:
    """UUIDs of the GPUs this process sees; empty without CUDA."""
    if not torch.cuda.is_available():
        return []
    return [gpu_uuid(i) for i in range(torch.cuda.device_count())]


def domain(kv: torch.Tensor) -> str:
    """Where a cache lives, as a receiver names what it can read: a GPU's UUID, or this
    process for a host tensor."""
    return gpu_uuid(kv.device.index) if kv.is_cuda else f"host:{os.getpid()}"


def readable(kv: torch.Tensor) -> list[str]:
    """The domains a receiver holding `kv` offers to pull from: the GPUs it sees, for a CUDA
    cache; this process, for a host cache with `HOST_PULL` on; else none."""
    if kv.is_cuda:
        try:
            return visible_gpus()
        except Exception:  # noqa: BLE001 - no offer; the handshake must not fail on it
            return []
    return [domain(kv)] if HOST_PULL else []


# Tensors this process exported, by IPC handle: a receiver in the same process maps nothing
# (CUDA refuses to open a handle in the process that made it) and reads the tensor itself.
# Weak: an engine's cache is not kept alive for a link that may never use it again.
_exported: weakref.WeakValueDictionary[str, torch.Tensor] = weakref.WeakValueDictionary()


def export(kv: torch.Tensor, same_process: bool = False) -> dict[str, Any]:
    """A JSON-able description of `kv` that another process on this host can map (a CUDA
    tensor) or this process can find again (a host tensor, or any tensor for a receiver in
    this process: no CUDA IPC handle, whose reference count no one would ever release)."""
    if not kv.is_contiguous():
        raise ValueError("only a contiguous cache can be exported")
    if same_process or not kv.is_cuda:
        key = f"ref:{kv.data_ptr()}"  # found again by reference, in this process
        _exported[key] = kv
        return {"pid": os.getpid(), "handle": key}
    storage = kv.untyped_storage()
    (device, handle, size, offset, ref_handle, ref_offset, event_handle,
     event_sync) = storage._share_cuda_()
    _exported[handle.hex()] = kv
    return {"pid": os.getpid(), "uuid": gpu_uuid(device), "handle": handle.hex(),
            "size": int(size), "offset": int(offset), "ref_handle": ref_handle.hex(),
            "ref_offset": int(ref_offset),
            "event_handle": event_handle.hex() if event_handle else None,
            "event_sync": bool(event_sync), "dtype": dtype_name(kv.dtype),
            "shape": list(kv.shape), "stride": list(kv.stride()),
            "storage_offset": kv.storage_offset()}


def open_export(spec: dict[str, Any]) -> torch.Tensor:
    """Map an `export` of another process; raises `IpcUnavailable` where it cannot."""
    if spec["pid"] == os.getpid():
        kv = _exported.get(spec["handle"])
        if kv is None:
            raise IpcUnavailable("an export of this process that it no longer holds")
        return kv
    try:
        device = visible_gpus().index(spec["uuid"])
    except ValueError:
        raise IpcUnavailable(f"GPU {spec['uuid']} is not visible to this process") from None
    try:
        storage = torch.UntypedStorage._new_shared_cuda(
            device, bytes.fromhex(spec["handle"]), spec["size"], spec["offset"],
            bytes.fromhex(spec["ref_handle"]), spec["ref_offset"],
            bytes.fromhex(spec["event_handle"]) if spec["event_handle"] else b"",
            spec["event_sync"])
        dtype = dtype_from_name(spec["dtype"])
        out = torch.empty(0, dtype=dtype, device=f"cuda:{device}")
        return out.set_(storage, spec["storage_offset"], spec["shape"], spec["stride"])
    except Exception as e:  # whatever CUDA or torch refuses: the sender falls back
        raise IpcUnavailable(f"could not map the peer's cache: {type(e).__name__}: {e}"
                             ) from None


# ---- events: the sender learns a pull is done without waiting for a message ----------------

# IPC events per link and direction, reused in turn (`pooled_event`): a peer that waits on one
# whose newer record is already queued waits longer, never shorter, as long as every record
# of the pool goes to one stream (the device's staging stream, or the receiver's).
EVENTS_PER_LINK = 8


def pooled_event(pool: list[torch.cuda.Event], seq: int, device: torch.device
                 ) -> torch.cuda.Event:
    """Event `seq % EVENTS_PER_LINK` of `pool` (made on first use, on `device`)."""
    i = seq % EVENTS_PER_LINK
    while len(pool) <= i:
        pool.append(new_event(device))
    return pool[i]


def new_event(device: torch.device) -> torch.cuda.Event:
    """An event another process can open (`open_event`), created on `device`; it lives as
    long as the process (`_immortal`)."""
    ev = _immortal(torch.cuda.Event(interprocess=True))
    with torch.cuda.device(device):
        ev.record(torch.cuda.current_stream(device))
    return ev


def _immortal(ev: torch.cuda.Event) -> torch.cuda.Event:
    """Never free `ev`: torch's Event destructor releases the GIL in cudaEventDestroy, and an
    event freed by the cyclic collector while other threads run Python (staging workers, UCX's
    notifier) crashes the process. IPC events are a few per link and die with the process."""
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(ev))
    return ev


# IPC events by handle, made or opened in this process (kept for its life, as `_immortal`).
_local_events: dict[str, torch.cuda.Event] = {}


def event_handle(ev: torch.cuda.Event) -> str:
    """`ev`'s IPC handle, as hex (asked of CUDA once per event: a pooled event is named in
    every request's header, and its handle never changes)."""
    handle = getattr(ev, "_tandem_ipc_handle", None)
    if handle is None:
        handle = bytes(ev.ipc_handle()).hex()
        _local_events[handle] = ev
        try:
            ev._tandem_ipc_handle = handle  # type: ignore[attr-defined]
        except AttributeError:  # an event type without attributes: asked again next time
            pass
    return handle


def open_event(uuid: str, handle: str) -> torch.cuda.Event:
    """Open an event of the GPU `uuid` made by `new_event` in another process (or this
    one); `IpcUnavailable` where it cannot."""
    if handle in _local_events:
        return _local_events[handle]
    try:
        device = visible_gpus().index(uuid)
    except ValueError:
        raise IpcUnavailable(f"GPU {uuid} is not visible to this process") from None
    try:
        ev = torch.cuda.Event.from_ipc_handle(device, bytes.fromhex(handle))
    except Exception as e:
        raise IpcUnavailable(f"could not open the peer's event: {type(e).__name__}: {e}"
                             ) from None
    _local_events[handle] = _immortal(ev)
    return ev


# ---- the copies --------------------------------------------------------------------------------

_MEMCPY_DEFAULT = 4  # cudaMemcpyDefault: direction from the (unified) addresses
MAX_PITCH = 1 << 31  # cudaDevAttrMaxPitch on current GPUs: a larger cache copies row by row
_cudart_lib: list[Any] = []


def _cudart() -> Any:
    """The CUDA runtime torch already loaded (found in this process's mappings), or None."""
    if not _cudart_lib:
        lib = None
        try:
            with open("/proc/self/maps") as f:
                paths = {line.split()[-1] for line in f if "libcudart.so" in line}
            for path in sorted(paths):
                lib = ctypes.CDLL(path)
                lib.cudaMemcpy2DAsync.argtypes = [
                    ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t,
                    ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
                lib.cudaMemcpy2DAsync.restype = ctypes.c_int
                lib.cudaGetLastError.restype = ctypes.c_int
                break
        except (OSError, AttributeError):
            lib = None
        _cudart_lib.append(lib)
    return _cudart_lib[0]


_peers: set[tuple[int, int]] = set()


def _peer_access(a: torch.device, b: torch.device) -> None:
    """Peer access between two devices, both ways, so the copy engines move the bytes over
    NVLink rather than through host memory: torch enables it on a first copy between them."""
    key = (a.index, b.index)
    if key not in _peers:
        for x, y in ((a, b), (b, a)):
            torch.empty(1, device=x).copy_(torch.empty(1, device=y))
        _peers.add(key)


ENGINES = ("dst", "src")
DEFAULT_ENGINE = "dst"  # a receiver's own choice (`UcxTransport(pull_engine=...)`)


def pull(dst: torch.Tensor, src: torch.Tensor, runs: list[tuple[int, int, int]],
         stream: torch.cuda.Stream | None, engine: str = DEFAULT_ENGINE) -> int:
    """Queue on `stream` (None on the host: synchronous) `dst[:, :, d:d+k] = src[:, :, s:s+k]`
    for each (s, d, k) in `runs`, one 2-D copy per run; return how many copies it queued.
    `engine`: whose copy engines move the bytes between two GPUs, "dst" (on `stream`) or "src"
    (on `src`'s staging stream, fenced by events so `stream` still orders them)."""
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
    if engine == "src" and dst.is_cuda and src.is_cuda and src.device != dst.device:
        on = staging.copy_stream(src.device)
        on.wait_event(staging.mark(stream))
        calls = copy_runs(dst, src, runs, on)
        stream.wait_event(staging.mark(on))
        return calls
    return copy_runs(dst, src, runs, stream)


def copy_runs(dst: torch.Tensor, src: torch.Tensor, runs: list[tuple[int, int, int]],
              stream: torch.cuda.Stream | None) -> int:
    """Queue on `stream` (a stream of either cache's device: that GPU's copy engines run the
    copies; None on the host, where they are synchronous) `dst[:, :, d:d+k] = src[:, :,
    s:s+k]` for each (s, d, k) in `runs`, one 2-D copy a run; returns the copy calls."""
    if (dst.shape[:BLOCKS_DIM] != src.shape[:BLOCKS_DIM]
            or dst.shape[BLOCKS_DIM + 1:] != src.shape[BLOCKS_DIM + 1:] or dst.dtype != src.dtype):
        raise ValueError(f"cache shapes differ: {tuple(src.shape)} {src.dtype} vs "
                         f"{tuple(dst.shape)} {dst.dtype}")
    rows = dst.shape[0] * dst.shape[1]
    block = dst.stride(BLOCKS_DIM) * dst.element_size()
    dpitch = dst.stride(1) * dst.element_size()
    spitch = src.stride(1) * src.element_size()
    if not dst.is_contiguous() or not src.is_contiguous():
        raise ValueError("both caches must be contiguous")
    # The copies below work on raw addresses: a run past either cache would write anywhere.
    if any(s < 0 or d < 0 or k < 1 or s + k > src.shape[BLOCKS_DIM] or
           d + k > dst.shape[BLOCKS_DIM] for s, d, k in runs):
        raise ValueError(f"block runs out of range: {runs} for {src.shape[BLOCKS_DIM]} -> "
                         f"{dst.shape[BLOCKS_DIM]} blocks")
    if not dst.is_cuda:
        for s, d, k in runs:
            dst[:, :, d:d + k].copy_(src[:, :, s:s + k])
        return len(runs)
    if src.device != dst.device:
        _peer_access(dst.device, src.device)
    lib = _cudart() if max(dpitch, spitch) < MAX_PITCH else None
    calls = 0
    with torch.cuda.device(stream.device):
        for s, d, k in runs:
            if lib is not None:
                err = lib.cudaMemcpy2DAsync(
                    dst.data_ptr() + d * block, dpitch, src.data_ptr() + s * block, spitch,
                    k * block, rows, _MEMCPY_DEFAULT, stream.cuda_stream)
                if err == 0:
                    calls += 1
                    continue
                lib.cudaGetLastError()  # clear it, or torch's next launch check reports it
            # No runtime found or the 2-D copy refused: one copy per (layer, K/V) row.
            with torch.cuda.stream(stream):
                for layer in range(dst.shape[0]):
                    for j in (0, 1):
                        dst[layer, j, d:d + k].copy_(src[layer, j, s:s + k], non_blocking=True)
            calls += rows
    return calls

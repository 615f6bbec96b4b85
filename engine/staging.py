"""Host→device staging without stalls: int64 host arrays copied to the device through a ring
of pinned host buffers, so the copy is asynchronous; a slot is reused only after its copy
finished (an event per slot)."""

from __future__ import annotations

import numpy as np
import torch


class HostStager:
    """Copies int64 host arrays to the device through a ring of pinned buffers."""

    def __init__(self, device: str, size: int, slots: int = 16, ahead: bool = True):
        """`ahead`: pin every slot now (else at `pin`, or each at its first use: a graph set
        made before its graphs are wanted pins nothing until then, ~0.25 ms a slot). Slots
        grown for a larger request are pinned again each at its first use."""
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.size = size
        # Zeroed, never uninitialized: `GraphSet._fill` leaves parts of a slot as they were.
        self.host: list[torch.Tensor | None] = [None] * slots
        self.events = [torch.cuda.Event() if self.cuda else None for _ in range(slots)]
        self.used = [False] * slots
        self.i = 0
        self._out: list[torch.Tensor | None] = [None] * slots  # pinned buffers for `fetch`
        self._out_events = [torch.cuda.Event() if self.cuda else None for _ in range(slots)]
        self._out_i = 0
        if ahead:
            self.pin()

    def slot(self, n: int) -> tuple[torch.Tensor, int]:
        """A pinned host buffer of at least n elements that no pending copy still reads."""
        if n > self.size:  # grow every slot; rare (a larger prefill chunk than seen before)
            self.size = max(n, 2 * self.size)
            self.host, self.used = [None] * len(self.host), [False] * len(self.host)
        i = self.i
        self.i = (i + 1) % len(self.host)
        if self.cuda and self.used[i]:
            self.events[i].synchronize()
        self.pin(i)
        return self.host[i], i

    def pin(self, i: int | None = None) -> None:
        """Make slot i's buffer (None: every slot's) where it has none yet."""
        for j in range(len(self.host)) if i is None else (i,):
            if self.host[j] is None:
                self.host[j] = torch.zeros(self.size, dtype=torch.int64, pin_memory=self.cuda)

    def copy(self, i: int, src: torch.Tensor, dst: torch.Tensor) -> None:
        dst.copy_(src, non_blocking=True)
        if self.cuda:
            self.events[i].record(torch.cuda.current_stream(dst.device))
            self.used[i] = True

    def fetch(self, t: torch.Tensor):
        """Start copying int64 device tensor t to the host without waiting; returns a callable
        that waits for the copy and gives t's values as a list. At most `slots` - 1 fetches
        may be outstanding."""
        if not self.cuda:
            return t.tolist
        n = t.numel()
        i = self._out_i
        self._out_i = (i + 1) % len(self._out)
        buf = self._out[i]
        if buf is None or buf.numel() < n:
            buf = self._out[i] = torch.empty(max(n, 1024), dtype=torch.int64, pin_memory=True)
        dst = buf[:n]
        dst.copy_(t.reshape(-1), non_blocking=True)
        ev = self._out_events[i]  # (its last fetch, `slots` fetches ago, was read)
        ev.record(torch.cuda.current_stream(t.device))

        def wait() -> list[int]:
            ev.synchronize()
            return dst.tolist()

        return wait

    def index(self, values: list[int]) -> torch.Tensor:
        """Integers (row indices, token ids) as an int64 device tensor, without a sync."""
        return self.to_device(np.asarray(values, dtype=np.int64))

    def to_device(self, arr: np.ndarray) -> torch.Tensor:
        """A new device tensor holding arr (int64)."""
        n = arr.shape[0]
        if not self.cuda:
            return torch.from_numpy(np.ascontiguousarray(arr, dtype=np.int64))
        host, i = self.slot(n)
        host.numpy()[:n] = arr
        out = torch.empty(n, dtype=torch.int64, device=self.device)
        self.copy(i, host[:n], out)
        return out

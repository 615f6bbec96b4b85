"""Packed step inputs and CUDA graphs for fixed-shape steps.

Each step's metadata is packed into one int64 buffer, staged through a ring of pinned host
buffers (`engine.staging`) so the copy is asynchronous. `GraphSet` captures a forward once per
(batch bucket, longest query, long-context flag) and replays it as one launch; padding
sequences have no queries and padding rows skip the KV store (slot -1), so they never touch
real requests.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from engine import collector
from engine.attention import AttentionMetadata
from engine.attention.triton_backend import long_context
from engine.staging import HostStager

BATCH_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)


def bucket_for(n: int, buckets: Sequence[int]) -> int | None:
    """The smallest bucket that holds n, or None."""
    return next((b for b in buckets if b >= n), None)


class PackedInputs:
    """Host-side description of one packed forward, in the order the model wants it."""

    __slots__ = ("ids", "pos", "slots", "starts", "lens", "tables", "max_query_len")

    def __init__(self, ids, pos, slots, starts, lens, tables, max_query_len):
        self.ids, self.pos, self.slots = ids, pos, slots
        self.starts, self.lens, self.tables = starts, lens, tables
        self.max_query_len = max_query_len

    @property
    def num_seqs(self) -> int:
        return len(self.lens)

    def take(self, lo: int, hi: int) -> PackedInputs:
        """Sequences lo..hi-1 alone: their rows, query starts from 0, block tables."""
        r0, r1 = int(self.starts[lo]), int(self.starts[hi])
        starts = self.starts[lo : hi + 1] - r0
        return PackedInputs(self.ids[r0:r1], self.pos[r0:r1], self.slots[r0:r1], starts,
                            self.lens[lo:hi], self.tables[lo:hi], int(np.diff(starts).max()))

    @property
    def num_tokens(self) -> int:
        return len(self.ids)


def table_array(tables: Sequence[Sequence[int]]) -> np.ndarray:
    """Block tables of different lengths as one zero-padded int64 [n, longest] array."""
    tab = np.zeros((len(tables), max(map(len, tables))), dtype=np.int64)
    for r, t in enumerate(tables):
        tab[r, : len(t)] = t
    return tab


class TableRows:
    """`table_array` for the overlapped steps of one pipeline, kept from step to step: a running
    sequence's block table only grows at the end, so a row whose list is the one seen last time
    only copies the entries it lacks. The returned array is rewritten by the next call: stage it
    before then."""

    def __init__(self) -> None:
        self.arr = np.zeros((0, 0), dtype=np.int64)
        self.lists: list = []
        self.lens: list[int] = []

    def __call__(self, tables: Sequence[list[int]]) -> np.ndarray:
        n, width = len(tables), max(map(len, tables))
        arr = self.arr
        if n > arr.shape[0] or width > arr.shape[1]:
            arr = self.arr = np.zeros((max(n, 2 * arr.shape[0]), max(width, 2 * arr.shape[1])),
                                      dtype=np.int64)
            self.lists, self.lens = [], []
        lists, lens = self.lists, self.lens
        for r, t in enumerate(tables):
            m = len(t)
            if r < len(lists) and lists[r] is t and lens[r] <= m:
                if m > lens[r]:
                    arr[r, lens[r] : m] = t[lens[r] :]
                    lens[r] = m
                continue
            arr[r, :m] = t
            arr[r, m:] = 0
            if r < len(lists):
                lists[r], lens[r] = t, m
            else:
                lists.append(t)
                lens.append(m)
        return arr[:n, :width]


def pack_next(seqs, tab: np.ndarray, block_size: int) -> PackedInputs:
    """One row per sequence at position len(seq) (the token the step in flight emits), its
    KV slot from the block table `tab`, context len(seq) + 1; token ids left 0 for the device
    to fill in from the step in flight."""
    b = len(seqs)
    pos = np.fromiter((len(s) for s in seqs), np.int64, b)
    slots = tab[np.arange(b), pos // block_size] * block_size + pos % block_size
    return PackedInputs(np.zeros(b, np.int64), pos, slots, np.arange(b + 1, dtype=np.int64),
                        pos + 1, tab, 1)


def pack(ids: list[int], pos: list[int], tables: list[list[int]], qlens: list[int],
         block_size: int) -> PackedInputs:
    """Token ids and positions per packed row, each sequence's block table and query count."""
    p = np.asarray(pos, dtype=np.int64)
    starts = np.zeros(len(qlens) + 1, dtype=np.int64)
    np.cumsum(qlens, out=starts[1:])
    seq_of_row = np.repeat(np.arange(len(qlens)), qlens)
    tab = table_array(tables)
    slots = tab[seq_of_row, p // block_size] * block_size + p % block_size
    lens = p[starts[1:] - 1] + 1
    return PackedInputs(np.asarray(ids, dtype=np.int64), p, slots, starts, lens, tab,
                        max(qlens))


# Every int64 segment of a staged buffer starts at a multiple of this many elements (16
# bytes): Triton specializes a kernel on each pointer's 16-byte alignment, so views aligned
# by chance would compile new kernel variants (a stall of every stream) mid-serving.
ALIGN = 2


def aligned_offsets(sizes: Sequence[int]) -> tuple[list[int], int]:
    """Start of each segment of these sizes, every start a multiple of ALIGN, and the total."""
    offs, o = [], 0
    for s in sizes:
        offs.append(o)
        o += -(-s // ALIGN) * ALIGN
    return offs, o


def to_device(inp: PackedInputs, stager: HostStager):
    """(ids, positions, meta) as device tensors for an eager forward; each one a 16-byte
    aligned view of one staged buffer."""
    n, b = inp.num_tokens, inp.num_seqs
    parts = [inp.ids, inp.pos, inp.slots, inp.starts, inp.lens, inp.tables.reshape(-1)]
    o, total = aligned_offsets([len(p) for p in parts])
    flat = np.zeros(total, dtype=np.int64)
    for start, p in zip(o, parts):
        flat[start: start + len(p)] = p
    dev = stager.to_device(flat)
    ids, pos, slots = dev[o[0]:o[0] + n], dev[o[1]:o[1] + n], dev[o[2]:o[2] + n]
    meta = AttentionMetadata(
        slot_mapping=slots, query_start=dev[o[3]:o[3] + b + 1], seq_lens=dev[o[4]:o[4] + b],
        block_tables=dev[o[5]:o[5] + inp.tables.size].view(b, -1),
        max_query_len=inp.max_query_len,
        max_seq_len=int(inp.lens.max()), query_start_cpu=inp.starts.tolist(),
        seq_lens_cpu=inp.lens.tolist())
    return ids, pos, meta


class GraphSet:
    """CUDA graphs of `fn(ids, pos, meta, *extras) -> tuple[Tensor, ...]`, one per
    (batch bucket, longest query, long-context flag), replayed on static buffers.

    `extras` are per-row device tensors (e.g. the hidden state a draft step consumes), given
    as (row width, dtype) pairs; they are copied device-to-device into static buffers."""

    captures = 0  # graphs captured by any set so far (a step that captured is not timed)

    def __init__(self, fn: Callable, device: str, max_batch: int, query_lens: Sequence[int],
                 max_blocks: int, extras: Sequence[tuple[int, torch.dtype]] = (),
                 pool=None, buckets: Sequence[int] = BATCH_BUCKETS, pad_queries: bool = False,
                 wants: Callable[[int, int, int], bool] | None = None):
        """`pad_queries`: a batch whose longest query falls between captured lengths replays the
        next longer one (prefill chunks); otherwise it must be one of `query_lens` exactly.
        `wants(q, lo, hi)`: whether batches of lo..hi sequences may run queries of q, for the
        graphs captured ahead (`pending`; None: all); any other is captured when first run."""
        self.fn, self.device = fn, torch.device(device)
        self.wants = wants
        self.pad_queries = pad_queries
        self.buckets = tuple(b for b in buckets if b < max_batch) + (max_batch,)
        self.query_lens = tuple(sorted(set(query_lens)))
        self.max_batch, self.max_blocks = max_batch, max_blocks
        tm = max_batch * max(self.query_lens)
        # Layout of the static int64 buffer; block tables last so a prefix copy covers a bucket.
        offs, self.size = aligned_offsets([tm, tm, tm, max_batch + 1, max_batch,
                                           max_batch * max_blocks])
        self.off = dict(zip(("ids", "pos", "slots", "starts", "lens", "tables"), offs))
        self.buf = torch.zeros(self.size, dtype=torch.int64, device=self.device)
        self.extras = [torch.zeros(tm, w, dtype=dt, device=self.device) for w, dt in extras]
        self.stager = HostStager(device, self.size, ahead=False)  # pinned at capture
        self.graphs: dict[tuple[int, int, bool], tuple[torch.cuda.CUDAGraph, tuple]] = {}
        # Buckets above this many sequences replay their short-context graph for long
        # contexts too: no attention backend splits there (None: every bucket has both).
        self.long_max_batch: int | None = None
        # Off CUDA the same static-buffer path runs eagerly (tests the padding on the CPU).
        self.capturable = self.device.type == "cuda"
        self.pool = (pool or torch.cuda.graph_pool_handle()) if self.capturable else None
        self._stream: torch.cuda.Stream | None = None  # capture stream, made on first capture
        self._view_cache: dict[tuple, tuple] = {}  # `_views`
        self._out_cache: dict[tuple, tuple] = {}  # (bucket, rows) -> a graph's outputs cut

    def _views(self, b: int, q: int, long: bool):
        """The bucket's static inputs as the graph's function takes them (ids, positions,
        metadata, extras): views of fixed buffers, made once per bucket (each slice is a
        torch call, several microseconds of the host's step)."""
        key = (b, q, long)
        got = self._view_cache.get(key)
        if got is None:
            got = self._view_cache[key] = self._make_views(b, q, long)
        return got

    def _make_views(self, b: int, q: int, long: bool):
        o, n = self.off, b * q
        buf = self.buf
        meta = AttentionMetadata(
            slot_mapping=buf[o["slots"]: o["slots"] + n],
            query_start=buf[o["starts"]: o["starts"] + b + 1],
            seq_lens=buf[o["lens"]: o["lens"] + b],
            block_tables=buf[o["tables"]: o["tables"] + b * self.max_blocks].view(b, -1),
            max_query_len=q, max_seq_len=long_context(self.device) + 1 if long else 0)
        extras = [e[:n] for e in self.extras]
        return buf[o["ids"]: o["ids"] + n], buf[o["pos"]: o["pos"] + n], meta, extras

    def _fill(self, inp: PackedInputs, b: int, q: int) -> None:
        """Stage inp into the static buffer of bucket (b sequences, q queries at most each).

        Real sequences keep their own query counts; rows past the real tokens skip the KV store, and
        padded sequences have no queries or context, so attention returns at once for them."""
        o = self.off
        n_used = o["tables"] + b * self.max_blocks
        host, i = self.stager.slot(n_used)
        h = host.numpy()
        real, rows = inp.num_seqs, inp.num_tokens
        n = b * q
        h[o["ids"]: o["ids"] + rows] = inp.ids
        h[o["pos"]: o["pos"] + rows] = inp.pos
        h[o["slots"]: o["slots"] + rows] = inp.slots
        if rows < n:  # padding rows (a full bucket has none)
            h[o["ids"] + rows: o["ids"] + n] = 0
            h[o["pos"] + rows: o["pos"] + n] = 0
            h[o["slots"] + rows: o["slots"] + n] = -1
        h[o["starts"]: o["starts"] + real + 1] = inp.starts
        h[o["lens"]: o["lens"] + real] = inp.lens
        if real < b:
            h[o["starts"] + real + 1: o["starts"] + b + 1] = rows
            h[o["lens"] + real: o["lens"] + b] = 0
        # The real sequences' entries, and zeros for padded sequences. A real row's entries
        # past its own table keep what this ring slot last held there: no kernel reads past a
        # sequence's context.
        tab = h[o["tables"]: o["tables"] + b * self.max_blocks].reshape(b, self.max_blocks)
        tab[:real, : inp.tables.shape[1]] = inp.tables
        if real < b:
            tab[real:] = 0
        self.stager.copy(i, host[:n_used], self.buf[:n_used])

    def supports(self, inp: PackedInputs) -> bool:
        q = inp.max_query_len
        fits = q <= self.query_lens[-1] if self.pad_queries else q in self.query_lens
        return fits and inp.num_seqs <= self.max_batch and inp.tables.shape[1] <= self.max_blocks

    def supports_split(self, inp: PackedInputs) -> bool:
        """Whether `run_split` replays inp: a set padding its queries whose longest query and block
        table fit, and whose padded rows stay within twice inp's rows (or one longest chunk), since
        padding many decodes to a prompt's length costs more than launching from Python."""
        if not (self.pad_queries and inp.max_query_len <= self.query_lens[-1]
                and inp.tables.shape[1] <= self.max_blocks):
            return False
        padded = sum(bucket_for(hi - lo, self.buckets)
                     * self._query_level(int(np.diff(inp.starts[lo : hi + 1]).max()))
                     for lo, hi in self._groups(inp))
        return padded <= max(2 * inp.num_tokens, self.query_lens[-1])

    def _groups(self, inp: PackedInputs) -> list[tuple[int, int]]:
        """inp's sequences max_batch at a time, as (first, past the last)."""
        n = inp.num_seqs
        return [(lo, min(lo + self.max_batch, n)) for lo in range(0, n, self.max_batch)]

    def run_split(self, inp: PackedInputs, extras: Sequence[torch.Tensor] = ()) -> tuple:
        """`run` over inp's sequences max_batch at a time, the outputs concatenated row by
        row: several arrivals prefilled together (more than a captured chunk holds) replay
        graphs instead of launching every kernel of the model from Python, which would stall
        every stream. `extras` are per-row, as for `run`."""
        if inp.num_seqs <= self.max_batch:
            return self.run(inp, extras)
        parts = []
        for lo, hi in self._groups(inp):
            r0, r1 = int(inp.starts[lo]), int(inp.starts[hi])
            out = self.run(inp.take(lo, hi), [e[r0:r1] for e in extras])
            # A graph's outputs live in its pool, which the next group's replay overwrites.
            parts.append([x.clone() for x in out] if hi < inp.num_seqs else out)
        return tuple(torch.cat(xs) for xs in zip(*parts))

    def _query_level(self, q: int) -> int:
        return next(x for x in self.query_lens if x >= q) if self.pad_queries else q

    def pending(self, batch_sizes: Sequence[int] | None = None, long_context: bool = False
                ) -> list[tuple[int, int, bool]]:
        """(bucket, query length, long-context) keys not captured yet that batches of
        `batch_sizes` (None: every bucket) would replay, largest first so smaller graphs reuse
        its memory; the long-context (split-KV) variants too when `long_context`."""
        buckets = self.buckets if batch_sizes is None else \
            {bucket_for(b, self.buckets) for b in batch_sizes} - {None}
        kinds = (False, True) if long_context else (False,)
        lows = dict(zip(self.buckets, (1, *(x + 1 for x in self.buckets[:-1]))))
        return [(b, q, long) for long in kinds for b in sorted(buckets, reverse=True)
                for q in reversed(self.query_lens)
                if (b, q, long) not in self.graphs and (not long or self._splits(b))
                and (self.wants is None or self.wants(q, lows[b], b))]

    def _splits(self, b: int) -> bool:
        return self.long_max_batch is None or b <= self.long_max_batch

    def long_variant(self, b: int, max_len: int) -> bool:
        """Whether bucket b with contexts up to max_len keys runs its split-KV graph: past
        `long_context` keys, for buckets few enough sequences to split."""
        return max_len > long_context(self.device) and self._splits(b)

    def capture(self, b: int, q: int, long: bool = False) -> None:
        """Capture (off CUDA: register for eager runs) the graph of one bucket."""
        GraphSet.captures += 1
        self.stager.pin()  # start-up work, not the first replays
        if not self.capturable:
            self.graphs[(b, q, long)] = (None, None)
            return
        with torch.cuda.device(self.device), collector.paused():
            self._capture_on_device(b, q, long)

    def _capture_on_device(self, b: int, q: int, long: bool) -> None:
        self.buf.zero_()
        o = self.off
        self.buf[o["slots"]: o["slots"] + b * q] = -1
        self.buf[o["starts"]: o["starts"] + b + 1] = torch.arange(b + 1, device=self.device) * q
        self.buf[o["lens"]: o["lens"] + b] = q
        ids, pos, meta, extras = self._views(b, q, long)
        if self._stream is None:
            # Our own side stream on this set's device: torch.cuda.graph's default one is made
            # on whichever device captured first, so another GPU's engine would capture on it.
            self._stream = torch.cuda.Stream(device=self.device)
        stream = self._stream
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            # One run outside the graph compiles its kernels and makes what is built on first use.
            self.fn(ids, pos, meta, *extras)
        torch.cuda.current_stream().wait_stream(stream)
        # Fresh views for the capture: nothing a backend may have cached on the warm-up's
        # metadata outside the graph is captured (the graph would read a tensor freed with
        # that metadata, or values of the capture's rows rather than the replay's).
        ids, pos, meta, extras = self._views(b, q, long)
        g = torch.cuda.CUDAGraph()
        # capture_begin / capture_end around the forward, as `torch.cuda.graph` does, without
        # its device-wide synchronize, collection and emptying of the device and pinned-host
        # caches before every capture (warm-up allocations would go back to the driver and come
        # again for each of hundreds of graphs); `capture` pauses the collector instead.
        # thread_local: other threads (a UCX progress thread moving KV) may use CUDA meanwhile.
        with torch.cuda.stream(stream):
            g.capture_begin(self.pool, capture_error_mode="thread_local")
            try:
                out = self.fn(ids, pos, meta, *extras)
            finally:
                g.capture_end()
        # Launched once now, on the stream that replays it: a graph's first launch uploads it
        # (else paid by the first request); same static inputs, so the warm-up run's writes.
        torch.cuda.current_stream().wait_stream(stream)
        g.replay()
        self.graphs[(b, q, long)] = (g, out)

    def run(self, inp: PackedInputs, extras: Sequence[torch.Tensor] = (),
            prepare: Callable | None = None) -> tuple:
        """Replay the bucket for inp; returns the graph's outputs cut to inp's rows.
        `prepare(ids, pos, meta)`, when given, may overwrite the staged inputs on the device
        (views of the bucket's static buffers) before the replay."""
        q = self._query_level(inp.max_query_len)
        b = bucket_for(inp.num_seqs, self.buckets)
        long = self.long_variant(b, int(inp.lens.max()))  # the split-KV attention variant
        if (b, q, long) not in self.graphs:
            self.capture(b, q, long)
        self._fill(inp, b, q)
        rows = inp.num_tokens
        for dst, src in zip(self.extras, extras):
            dst[:rows].copy_(src)
        g, out = self.graphs[(b, q, long)]
        if prepare is not None:
            ids, pos, meta, _ = self._views(b, q, long)
            prepare(ids, pos, meta)
        if g is None:
            ids, pos, meta, extras = self._views(b, q, long)
            out = self.fn(ids, pos, meta, *extras)
            return tuple(x[:rows] for x in out)
        g.replay()
        # A graph's outputs are static buffers: their cuts to a row count are made once.
        cut = self._out_cache.get((b, q, long, rows))
        if cut is None:
            cut = self._out_cache[(b, q, long, rows)] = tuple(x[:rows] for x in out)
        return cut


def graph_time_us(fn: Callable[[int], object], reps: int, iters: int = 10) -> float:
    """GPU microseconds per call of fn(i), i = 0..reps-1, the calls captured into one CUDA
    graph on a side stream (compiled first, outside the capture) and replayed `iters` times;
    the best of three. Used to choose kernels on the GPU at hand and by the benchmarks."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(min(reps, 2)):
            fn(i)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"):
        for i in range(reps):
            fn(i)
    graph.replay()
    return replay_us(graph, iters) / reps


def replay_us(graph: torch.cuda.CUDAGraph, iters: int, tries: int = 3) -> float:
    """GPU microseconds per replay of a captured graph: `iters` replays back to back between
    two events, the best of `tries` (the host launches faster than the replays run)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(tries):
        start.record()
        for _ in range(iters):
            graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3 / iters)
    return best

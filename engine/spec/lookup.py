"""Drafting from the context on the device: `ngram.ngram_search` inside the fused step.

With `SpecConfig.context_drafts` a greedy EAGLE-3 step also drafts what followed the latest
earlier copy of the current suffix. Since the next step launches before the host reads tokens,
every forward writes its token ids into a per-KV-slot store (`store_tokens`) that `lookup`
searches on the device.
"""

from __future__ import annotations

import logging
import threading

import torch

from engine.attention.triton_backend import cdiv, next_pow2, no_specialize, triton, triton_available
from engine.spec import ngram

if triton_available():
    import triton.language as tl

log = logging.getLogger(__name__)
LOOKUP_BLOCK = 512  # candidate positions a lookup program compares at once
STORE_BLOCK = 256  # rows a store program writes: one kernel variant for every row count


# Per CUDA device, the thread compiling `_store_kernel` (`compile_store_ahead`), joined before
# its first launch (None once joined).
_compiling: dict[str, threading.Thread | None] = {}
_compiling_lock = threading.Lock()


def needs_token_store(spec) -> bool:
    """Whether an engine of this `SpecConfig` (or None) drafts from the context on the device."""
    return spec is not None and spec.context_drafts and spec.method == "eagle3"


def token_store(num_slots: int, device) -> torch.Tensor:
    """Token ids by KV slot, plus one spare element for rows that store no KV."""
    store = torch.zeros(num_slots + 1, dtype=torch.int64, device=device)
    compile_store_ahead(store.device)
    return store


def compile_store_ahead(device) -> None:
    """On CUDA, start compiling `_store_kernel` on another thread (once per device): only
    speculative engines launch it, and compiled on a first `generate`'s path (kernel and C
    launcher, about 0.2 s cold) it would slow that call against an engine without speculation.
    `Engine.from_pretrained` calls it before loading the weights, so it is done long before."""
    device = torch.device(device)
    if device.type != "cuda" or not triton_available():
        return
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    with _compiling_lock:
        if str(device) in _compiling:
            return
        # Any int64 tensors will do: the kernel specializes on dtypes and the store's alignment.
        store = torch.zeros(2, dtype=torch.int64, device=device)
        ids = torch.zeros(1, dtype=torch.int64, device=device)
        # Not a daemon: an exit meanwhile waits for it rather than stopping it inside Triton's
        # C++ compiler.
        t = threading.Thread(target=_compile_store, args=(store, ids),
                             name="store-kernel-compile")
        _compiling[str(device)] = t
        t.start()


def _compile_store(store: torch.Tensor, ids: torch.Tensor) -> None:
    """Compile `_store_kernel` as `store_tokens` launches it and build its launcher, loading
    nothing on the device (a module load beside another thread's graph capture could break
    the capture); the first launch then finds both in Triton's caches."""
    try:
        from triton.runtime import driver

        with torch.cuda.device(store.device):
            k = _store_kernel.warmup(store, ids, ids, 1, store.shape[0] - 1, BLOCK=STORE_BLOCK,
                                     num_warps=4, grid=(1,))
            launcher = getattr(driver.active, "launcher_cls", None)
            if k is not None and launcher is not None:
                launcher(k.src, k.metadata)
    except Exception as e:  # noqa: BLE001 - the first launch compiles it instead
        log.warning("compiling the token store kernel ahead failed: %r", e)


def _await_compile(device: torch.device) -> None:
    key = str(device)
    t = _compiling.get(key)
    if t is not None:
        t.join()
        _compiling[key] = None


def store_tokens(store: torch.Tensor, ids: torch.Tensor, slots: torch.Tensor,
                 kernel: bool | None = None) -> None:
    """store[slot] = id for every row whose slot is >= 0. `kernel` (default: on CUDA with
    Triton): one Triton launch."""
    n = ids.shape[0]
    if n == 0:
        return
    if kernel is None:
        kernel = ids.is_cuda and triton_available()
    if kernel:
        _await_compile(store.device)
        _store_kernel[(cdiv(n, STORE_BLOCK),)](store, ids, slots, n, store.shape[0] - 1,
                                               BLOCK=STORE_BLOCK, num_warps=4)
        return
    idx = torch.where(slots[:n] >= 0, slots[:n], store.shape[0] - 1)
    store.index_copy_(0, idx, ids.to(store.dtype))


def lookup(store: torch.Tensor, tables: torch.Tensor, block_size: int, known: torch.Tensor,
           bonus: torch.Tensor, live: torch.Tensor, k: int, max_n: int, min_n: int,
           kernel: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per sequence (row of `tables`), over its history (the first `known` tokens in the store,
    then `bonus`): (lens [b], tokens [b, k]), the k tokens `ngram.ngram_search` would give;
    lens 0 where nothing matches or `live` is false. `kernel` (default: CUDA with Triton)."""
    b = tables.shape[0]
    if kernel is None:
        kernel = known.is_cuda and triton_available()
    loops = ngram.CONTINUE_LOOPS
    if kernel:
        lens = torch.empty(b, dtype=torch.int64, device=known.device)
        toks = torch.empty(b, max(k, 1), dtype=torch.int64, device=known.device)
        _lookup_kernel[(b,)](store, tables, known, bonus, live, lens, toks, tables.stride(0),
                             tables.shape[1], known.stride(0), bonus.stride(0),
                             toks.stride(0), block_size, k, LOOPS=loops, MAX_N=max_n,
                             MIN_N=min_n,
                             NP=next_pow2(max_n, 2), KP=next_pow2(max(k, 1), 2),
                             BLOCK=LOOKUP_BLOCK, num_warps=4)
        return lens, toks[:, :k]
    return _lookup_torch(store, tables, block_size, known, bonus, live, k, max_n, min_n, loops)


def _lookup_torch(store, tables, block_size, known, bonus, live, k, max_n, min_n, loops=True):
    b, width = tables.shape
    dev = known.device
    p = torch.arange(width * block_size, device=dev)
    slot = tables.gather(1, (p // block_size)[None].expand(b, -1)) * block_size + p % block_size
    hist = torch.where(p[None] == known[:, None], bonus[:, None], store[slot])
    length = known + 1  # history length, the bonus token last
    suffix = hist.gather(1, (length[:, None] - 1 - torch.arange(max_n, device=dev)[None])
                         .clamp(min=0))
    e = p[None]  # candidate ends: the copy's continuation starts at e
    match = (e >= 1) & (e <= length[:, None] - 1)
    best = torch.full((b,), -1, dtype=torch.int64, device=dev)
    best_n = torch.zeros(b, dtype=torch.int64, device=dev)
    for j in range(max_n):
        shifted = torch.cat([torch.full((b, j + 1), -1, dtype=hist.dtype, device=dev),
                             hist[:, : hist.shape[1] - j - 1]], dim=1)  # hist[e - 1 - j]
        match = match & (e - 1 - j >= 0) & (shifted == suffix[:, j : j + 1])
        if j + 1 >= min_n:
            last = torch.where(match, e, -1).amax(dim=1)
            found = last >= 0
            best = torch.where(found, last, best)  # a longer match replaces a shorter one
            best_n = torch.where(found, j + 1, best_n)
    ok = (best_n > 0) & live
    start = best.clamp(min=0)
    period = (length - start).clamp(min=1)  # past the present the copy repeats itself
    lens = torch.where(ok, k if loops else torch.clamp(period, max=k), 0)
    t = torch.arange(k, device=dev)
    at = (start[:, None] + t[None] % period[:, None]).clamp(max=hist.shape[1] - 1)
    toks = torch.where(t[None] < lens[:, None], hist.gather(1, at), 0)
    return lens, toks


if triton_available():

    # Every forward stores its rows, at row counts and slice offsets that vary by the step:
    # specialized on their values or alignment, the kernel would compile anew while serving.
    @triton.jit(**no_specialize(["n", "spare"], ["IDS", "SLOTS"]))
    def _store_kernel(STORE, IDS, SLOTS, n, spare, BLOCK: tl.constexpr):
        r = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = r < n
        s = tl.load(SLOTS + r, mask=ok, other=-1)
        t = tl.load(IDS + r, mask=ok, other=0)
        tl.store(STORE + tl.where(s >= 0, s, spare), t, mask=ok)

    @triton.jit
    def _hist(STORE, TABLES, row, width, bs, p, known, bonus, ok):
        """Token at history position p (masked by ok): the bonus at p == known, else the
        store's token at p's slot."""
        col = tl.minimum(tl.maximum(p, 0) // bs, width - 1)
        blk = tl.load(TABLES + row + col, mask=ok, other=0).to(tl.int64)
        t = tl.load(STORE + blk * bs + tl.maximum(p, 0) % bs, mask=ok & (p != known), other=-1)
        return tl.where(p == known, bonus, t)

    @triton.jit
    def _lookup_kernel(STORE, TABLES, KNOWN, BONUS, LIVE, LENS, TOKS, t_stride, width,
                       k_stride, b_stride, o_stride, bs, k, LOOPS: tl.constexpr,
                       MAX_N: tl.constexpr,
                       MIN_N: tl.constexpr, NP: tl.constexpr, KP: tl.constexpr,
                       BLOCK: tl.constexpr):
        """`lookup` for one sequence: scan every candidate end e in blocks, keep per suffix
        length n the latest e whose n tokens before it equal the suffix's."""
        b = tl.program_id(0)
        row = b.to(tl.int64) * t_stride
        known = tl.load(KNOWN + b * k_stride)
        bonus = tl.load(BONUS + b * b_stride)
        length = known + 1
        jr = tl.arange(0, NP)
        sp = length - 1 - jr
        suffix = _hist(STORE, TABLES, row, width, bs, sp, known, bonus, (jr < MAX_N) & (sp >= 0))
        best = tl.full((NP,), -1, tl.int64)
        for start in range(0, length, BLOCK):
            e = start + tl.arange(0, BLOCK)
            match = (e >= 1) & (e <= length - 1)
            for j in tl.static_range(MAX_N):
                s_j = tl.sum(tl.where(jr == j, suffix, 0))
                pj = e - 1 - j
                match = match & (pj >= 0)
                h = _hist(STORE, TABLES, row, width, bs, pj, known, bonus, match)
                match = match & (h == s_j)
                if j + 1 >= MIN_N:
                    last = tl.max(tl.where(match, e, -1).to(tl.int64))
                    best = tl.maximum(best, tl.where(jr == j, last, -1))
        n_idx = tl.max(tl.where(best >= 0, jr, -1))
        e_best = tl.sum(tl.where(jr == n_idx, best, 0))
        live = tl.load(LIVE + b) != 0
        ok = (n_idx >= 0) & live
        period = tl.maximum(length - e_best, 1)
        if LOOPS:
            n_tok = tl.where(ok, k, 0)
        else:
            n_tok = tl.where(ok, tl.minimum(period, k), 0)
        t = tl.arange(0, KP)
        p = e_best + t % period  # past the present: the loop again
        tok = _hist(STORE, TABLES, row, width, bs, p, known, bonus, t < n_tok)
        tl.store(LENS + b, n_tok)
        tl.store(TOKS + b * o_stride + t, tl.where(t < n_tok, tok, 0), mask=t < k)

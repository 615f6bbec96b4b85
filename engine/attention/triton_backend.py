"""Triton attention over the paged KV cache: one store kernel, one attention kernel.

The attention kernel serves prefill chunks, decode and K+1-token verify alike: sequence i has
`q_len` causal queries at the end of a `seq_len`-token context, with grouped-query heads packed
into the query tile. Launches are shape-static given (num_seqs, max_query_len), so they can be
captured in CUDA graphs; a slot of -1 in `slot_mapping` skips the store (padding rows). CPU
tests run under `TRITON_INTERPRET=1` in fp32/fp16 (the interpreter is wrong for bf16).
"""

from __future__ import annotations

import os

import torch

from engine.attention.base import AttentionBackend, AttentionMetadata

try:  # Triton is optional: the torch backend needs nothing beyond torch.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where triton is absent
    triton = None
    tl = None


# Keys per split of the split-KV path, and the context length past which a batch with too few
# (KV head, sequence) programs to fill the GPU takes it. Below it one pass is faster; a single
# split and one pass reduce in the same order, so a row rounds the same on both sides.
SPLIT_KEYS = 128
# Off CUDA (Triton's interpreter: CPU tests) every program costs about the same whatever its
# work, so splits there only multiply programs: 1024-key splits keep engine-level CPU tests
# on the one-pass kernel below 1024 keys (kernel tests pick their own split size).
INTERPRETER_SPLIT_KEYS = 1024


# The draft head's attention (`draft_attention`): its numbers need match no other path's, so
# it takes smaller tiles than the target's, which run a chained draft step faster.
DRAFT_SPLIT_KEYS = 64
DRAFT_MIN_TILE = 16

# Deterministic mode's one tile shape (rows, keys per inner step, warps), never chosen from
# the batch or the device, so every launch compiles the same kernel and rounds a row alike.
DETERMINISTIC_TILE = (64, 64, 8)


def draft_attention(device: torch.device) -> dict:
    """`TritonAttention` keyword arguments for a draft head's layer on `device`."""
    return {"split_keys": DRAFT_SPLIT_KEYS if device.type == "cuda" else None,
            "min_tile": DRAFT_MIN_TILE}


def long_context(device: torch.device) -> int:
    """Keys per split by default on `device`, and the context past which a batch of few
    sequences takes the split-KV path: CUDA graph buckets are captured once per side of it."""
    return SPLIT_KEYS if device.type == "cuda" else INTERPRETER_SPLIT_KEYS


def triton_available() -> bool:
    return triton is not None


# Programmatic dependent launch (Hopper+): kernels with a USE_PDL switch may start while the one
# before still runs and wait (`gdc_wait`) before reading its results. None: on where supported;
# False: off (TANDEM_PDL=0).
PDL: bool | None = False if os.environ.get("TANDEM_PDL", "").lower() in ("0", "off", "false") \
    else None
_PDL_SUPPORT: dict[int, bool] = {}


def pdl_supported(device: torch.device) -> bool:
    """Compute capability 9+ and a Triton with grid dependency control and `launch_pdl`."""
    if device.type != "cuda" or not triton_available():
        return False
    i = device.index if device.index is not None else torch.cuda.current_device()
    if i not in _PDL_SUPPORT:
        try:
            from triton.backends.nvidia.compiler import CUDAOptions
            opts = "launch_pdl" in CUDAOptions.__dataclass_fields__
        except Exception:  # another backend layout: no PDL
            opts = False
        _PDL_SUPPORT[i] = (opts and hasattr(tl.extra.cuda, "gdc_wait")
                           and torch.cuda.get_device_capability(i)[0] >= 9)
    return _PDL_SUPPORT[i]


def pdl_args(t: torch.Tensor, always: bool = False) -> dict:
    """Launch arguments of a kernel with a USE_PDL switch for tensor t's device (always: pass
    USE_PDL=False too, for kernels without a default)."""
    on = PDL is not False and pdl_supported(t.device)
    if on:
        return {"USE_PDL": True, "launch_pdl": True}
    return {"USE_PDL": False} if always else {}


def _no_hooks(hook) -> bool:
    """A Triton launch hook slot holding nothing to call: None, or an empty `HookChain`."""
    return hook is None or (hasattr(hook, "calls") and not hook.calls)


class FastLaunch:
    """Launches a Triton kernel that runs outside CUDA graphs on the host's critical path and
    specializes on none of its int or pointer arguments: after the first JIT launch of a key
    (device, constexprs), later ones call the compiled launcher directly, skipping Triton's
    costly argument binding. Falls back to the JIT launch when launch hooks are set or the
    launcher's calling convention is not the expected one (Triton 3.3+)."""

    def __init__(self, fn) -> None:
        self.fn = fn
        self.compiled: dict = {}
        self.fast = 0  # launches that skipped the JIT's binding
        self.why: str | None = None  # why the last launch did not (None: it did, or first)
        try:
            from triton import knobs
            from triton.runtime import driver
            self._knobs, self._driver = knobs.runtime, driver
        except Exception:  # an older Triton: always the JIT's launch
            self._knobs = self._driver = None

    def __call__(self, key, grid: tuple[int, ...], args: tuple, **options) -> None:
        """Launch fn[grid](*args, **options); `args` every parameter in order, constexprs
        included; `key` (device index first) whatever decides the compiled variant: the
        constexprs and the dtypes that may vary."""
        k = self.compiled.get(key)
        kn = self._knobs
        if k is not None:
            if _no_hooks(kn.launch_enter_hook) and _no_hooks(kn.launch_exit_hook):
                stream = self._driver.active.get_current_stream(key[0])
                g = tuple(grid) + (1, 1)
                k.run(g[0], g[1], g[2], stream, k.function, k.packed_metadata, None, None,
                      None, *args)
                self.fast += 1
                return
            self.why = "launch hooks set"
        k = self.fn[grid](*args, **options)
        if kn is None:
            self.why = "no triton.knobs"
        elif hasattr(k, "run") and hasattr(k, "packed_metadata"):
            self.compiled[key] = k
        else:
            self.why = f"the JIT returned {type(k).__name__}"


if triton is not None:

    @triton.jit
    def _store_kv_kernel(K, V, KC, VC, slots, stride_kt, stride_vt, stride_cs,
                         ROW: tl.constexpr, BLOCK: tl.constexpr):
        """Token t's K and V rows ([kv_heads * head_dim]) into cache slot slots[t]."""
        t = tl.program_id(0)
        slot = tl.load(slots + t)
        if slot >= 0:
            offs = tl.arange(0, BLOCK)
            mask = offs < ROW
            k = tl.load(K + t * stride_kt + offs, mask=mask)
            v = tl.load(V + t * stride_vt + offs, mask=mask)
            tl.store(KC + slot * stride_cs + offs, k.to(KC.dtype.element_ty), mask=mask)
            tl.store(VC + slot * stride_cs + offs, v.to(VC.dtype.element_ty), mask=mask)

    @triton.jit
    def _load_queries(Q, row0, q0, q_len, ctx, kvh, stride_qt, stride_qh, G: tl.constexpr,
                      HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr):
        """A tile of query rows from row0: row r is query token r // G of head kvh*G + r % G.
        Also returns each row's token, head, validity, the head-dim lanes and the absolute
        position of each row's query."""
        rows = row0 + tl.arange(0, BLOCK_M)
        t = rows // G
        head = kvh * G + rows % G
        row_ok = t < q_len
        d = tl.arange(0, BLOCK_D)
        d_ok = d < HEAD_DIM
        q = tl.load(Q + (q0 + t)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                    mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        return q, t, head, row_ok, d, d_ok, ctx - q_len + t

    @triton.jit
    def _attend_keys(q, q_pos, m_i, l_i, acc, start, end, KC, VC, table, kvh, d, d_ok,
                     qk_scale, stride_cb, stride_cs, stride_ch, PAGE: tl.constexpr,
                     BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
        """Online-softmax update of (max, sum, acc) with keys [start, min(start+BLOCK_N, end))
        of one sequence (`table`: its block-table row), causal against each row's q_pos."""
        k_pos = start + tl.arange(0, BLOCK_N)
        k_ok = k_pos < end
        page = tl.load(table + k_pos // PAGE, mask=k_ok, other=0)
        off = page.to(tl.int64) * stride_cb + (k_pos % PAGE) * stride_cs + kvh * stride_ch
        kv_mask = k_ok[:, None] & d_ok[None, :]
        k = tl.load(KC + off[:, None] + d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(VC + off[:, None] + d[None, :], mask=kv_mask, other=0.0)  # with K's
        s = tl.dot(q, tl.trans(k).to(q.dtype), input_precision=PRECISION) * qk_scale
        visible = (k_pos[None, :] <= q_pos[:, None]) & k_ok[None, :]
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype),
                                            input_precision=PRECISION)
        return m_new, l_i, acc

    # Integer arguments that change from launch to launch (a block table's width, the split
    # partials' strides, which follow the token count) are not specialized on: Triton
    # compiles a variant whenever such a value turns 1 or a multiple of 16, and a compile
    # in the middle of serving stalls every stream.
    @triton.jit(do_not_specialize=["stride_bt"])
    def _paged_attention_kernel(
        Q, KC, VC, Out, query_start, seq_lens, block_tables, scale,
        stride_qt, stride_qh, stride_ot, stride_oh,
        stride_cb, stride_cs, stride_ch, stride_bt,
        G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
        PAGE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        PRECISION: tl.constexpr, USE_PDL: tl.constexpr = False,
    ):
        tile = tl.program_id(0)
        kvh = tl.program_id(1)
        b = tl.program_id(2)
        # The launch's metadata is never written by the kernel before (the KV store): read
        # it while that kernel still runs.
        q0 = tl.load(query_start + b)
        q_len = tl.load(query_start + b + 1) - q0
        ctx = tl.load(seq_lens + b)
        if USE_PDL:  # launched while the kernel before runs: wait for its results
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        if tile * BLOCK_M < q_len * G:
            q, t, head, row_ok, d, d_ok, q_pos = _load_queries(
                Q, tile * BLOCK_M, q0, q_len, ctx, kvh, stride_qt, stride_qh,
                G, HEAD_DIM, BLOCK_D, BLOCK_M)
            # Keys this tile can see: up to the position of its last real query. An earlier
            # row finds the keys past its own position masked: its max stays, the rescale is
            # exp2(0) = 1 and it adds zeros, so it rounds as it would at the end of the context.
            last_t = tl.minimum((tile * BLOCK_M + BLOCK_M - 1) // G, q_len - 1)
            kv_end = ctx - q_len + last_t + 1
            m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
            l_i = tl.zeros([BLOCK_M], tl.float32)
            acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
            qk_scale = scale * 1.4426950408889634  # exp2 domain
            for start in range(0, kv_end, BLOCK_N):
                m_i, l_i, acc = _attend_keys(
                    q, q_pos, m_i, l_i, acc, start, kv_end, KC, VC, block_tables + b * stride_bt,
                    kvh, d, d_ok, qk_scale, stride_cb, stride_cs, stride_ch,
                    PAGE, BLOCK_N, PRECISION)
            out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
            tl.store(Out + (q0 + t)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
                     out.to(Out.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


    @triton.jit(do_not_specialize=["stride_bt", "stride_as", "stride_at", "stride_ms",
                                   "stride_mt"])
    def _paged_attention_split_kernel(
        Q, KC, VC, ACC, ML, query_start, seq_lens, block_tables, scale,
        stride_qt, stride_qh, stride_cb, stride_cs, stride_ch, stride_bt,
        stride_as, stride_at, stride_ah, stride_ms, stride_mt,
        G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
        PAGE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        SPLIT_KEYS: tl.constexpr, PRECISION: tl.constexpr, USE_PDL: tl.constexpr = False,
    ):
        """Split-KV (flash-decoding) for short query counts: split s covers keys
        [s * SPLIT_KEYS, (s + 1) * SPLIT_KEYS) and writes unnormalized partials (acc, max, sum).
        Program (p, kv head, seq) takes splits p, p + P, ...; the partition depends on SPLIT_KEYS
        alone, so a row's partials do not depend on the batch around it."""
        pid = tl.program_id(0)
        kvh = tl.program_id(1)
        b = tl.program_id(2)
        programs = tl.num_programs(0)
        table = block_tables + b * stride_bt
        q0 = tl.load(query_start + b)  # launch metadata: the kernel before never writes it
        q_len = tl.load(query_start + b + 1) - q0
        ctx = tl.load(seq_lens + b)
        if USE_PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        q, t, head, row_ok, d, d_ok, q_pos = _load_queries(
            Q, 0, q0, q_len, ctx, kvh, stride_qt, stride_qh, G, HEAD_DIM, BLOCK_D, BLOCK_M)
        qk_scale = scale * 1.4426950408889634
        for split in range(pid, tl.cdiv(ctx, SPLIT_KEYS), programs):
            lo = split * SPLIT_KEYS
            hi = tl.minimum(lo + SPLIT_KEYS, ctx)
            m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
            l_i = tl.zeros([BLOCK_M], tl.float32)
            acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
            for start in range(lo, hi, BLOCK_N):
                m_i, l_i, acc = _attend_keys(
                    q, q_pos, m_i, l_i, acc, start, hi, KC, VC, table, kvh, d, d_ok,
                    qk_scale, stride_cb, stride_cs, stride_ch, PAGE, BLOCK_N, PRECISION)
            base_t = (q0 + t)
            tl.store(ACC + split * stride_as + base_t[:, None] * stride_at
                     + head[:, None] * stride_ah + d[None, :], acc,
                     mask=row_ok[:, None] & d_ok[None, :])
            ml = ML + split * stride_ms + base_t * stride_mt + head * 2
            tl.store(ml, m_i, mask=row_ok)
            tl.store(ml + 1, l_i, mask=row_ok)

    @triton.jit(do_not_specialize=["stride_as", "stride_at", "stride_ms", "stride_mt"])
    def _split_reduce_kernel(ACC, ML, Out, query_start, seq_lens,
                             stride_as, stride_at, stride_ah, stride_ms, stride_mt,
                             stride_ot, stride_oh, SPLIT_KEYS: tl.constexpr,
                             HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                             CHUNK: tl.constexpr = 8, USE_PDL: tl.constexpr = False):
        """Program (i, head, seq) combines the partials of query token i of the sequence for
        one head: the largest max, then the rescaled sums and accumulators added in split
        order. The loads of CHUNK splits go out together, not one round trip per split; a
        split past the sequence's adds nothing."""
        i = tl.program_id(0)
        h = tl.program_id(1)
        b = tl.program_id(2)
        q0 = tl.load(query_start + b)  # launch metadata: no kernel before writes it
        q_len = tl.load(query_start + b + 1) - q0
        ctx = tl.load(seq_lens + b)
        if USE_PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        if i < q_len:
            n = tl.cdiv(ctx, SPLIT_KEYS)
            d = tl.arange(0, BLOCK_D)
            d_ok = d < HEAD_DIM
            ml = ML + (q0 + i) * stride_mt + h * 2
            part = ACC + (q0 + i) * stride_at + h * stride_ah + d
            m = float("-inf")
            c = tl.arange(0, CHUNK)
            for s0 in range(0, n, CHUNK):
                m = tl.maximum(m, tl.max(tl.load(ml + (s0 + c) * stride_ms, mask=s0 + c < n,
                                                 other=float("-inf"))))
            m_safe = tl.where(m == float("-inf"), 0.0, m)
            acc = tl.zeros([BLOCK_D], tl.float32)
            l_sum = 0.0
            for s0 in range(0, n, CHUNK):
                ok = s0 + c < n
                w = tl.exp2(tl.load(ml + (s0 + c) * stride_ms, mask=ok, other=float("-inf"))
                            - m_safe)
                ls = tl.load(ml + (s0 + c) * stride_ms + 1, mask=ok, other=0.0)
                parts = tl.load(part[None, :] + (s0 + c)[:, None] * stride_as,
                                mask=ok[:, None] & d_ok[None, :], other=0.0)
                for j in tl.static_range(CHUNK):  # in split order (picking one is exact)
                    wj = tl.sum(tl.where(c == j, w, 0.0))
                    l_sum += tl.sum(tl.where(c == j, ls, 0.0)) * wj
                    acc += wj * tl.sum(tl.where((c == j)[:, None], parts, 0.0), 0)
            out = acc / tl.where(l_sum == 0.0, 1.0, l_sum)
            tl.store(Out + (q0 + i) * stride_ot + h * stride_oh + d,
                     out.to(Out.dtype.element_ty), mask=d_ok)


def next_pow2(n: int, lo: int = 16) -> int:
    return max(lo, 1 << (max(n, 1) - 1).bit_length())


class TritonAttention(AttentionBackend):
    """Paged attention in Triton: prefill, decode and verify through one kernel.

    With `deterministic`, every launch takes the one-pass kernel with `DETERMINISTIC_TILE`,
    so a row's keys reduce in fixed steps from key 0 in one order whatever shares its launch
    or tile (fixed-size splits instead would need a split kernel for prefill tiles too). The
    cost: without split-KV a long context in a small batch runs on few programs, so its
    decode attention time grows with its length where split-KV spreads it over the GPU.
    """

    name = "triton"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
                 split_keys: int | None = None, min_tile: int = 32, deterministic: bool = False):
        if triton is None:
            raise RuntimeError("the triton attention backend needs the `triton` package")
        super().__init__(num_heads, num_kv_heads, head_dim, block_size, deterministic)
        if num_heads % num_kv_heads:
            raise ValueError(f"{num_heads} heads do not group over {num_kv_heads} KV heads")
        self.group = num_heads // num_kv_heads
        # Keys per split of the split-KV path: fixed, so a sequence's partition never depends
        # on how many queries it brings (decode and verify reduce in the same order). None:
        # the device's `long_context`.
        self.split_keys = split_keys
        # Fewest rows a program's tile holds (`tile_m`): 32 keeps the target's decode and
        # verify rows rounding alike; the draft head, whose numbers no other path must
        # match, takes 16 (`draft_attention`).
        self.min_tile = min_tile

    def store_kv(self, k, v, kv_cache, meta: AttentionMetadata) -> None:
        t = k.shape[0]
        if t == 0:
            return
        row = self.num_kv_heads * self.head_dim
        k = k.reshape(t, row)
        v = v.reshape(t, row)
        kc, vc = kv_cache[0], kv_cache[1]
        _store_kv_kernel[(t,)](k, v, kc, vc, meta.slot_mapping, k.stride(0), v.stride(0),
                               kc.stride(1), ROW=row, BLOCK=next_pow2(row))

    def keys_per_split(self, device: torch.device) -> int:
        return self.split_keys if self.split_keys is not None else long_context(device)

    def block_n(self, device: torch.device) -> int:
        """Keys per inner step (both kernels): 4 pages, 16 to 64, within a split (one
        128-key step per split was slower)."""
        if self.deterministic:
            return DETERMINISTIC_TILE[1]
        return max(16, min(64, 4 * self.block_size, self.keys_per_split(device)))

    def tile_m(self, max_query_len: int) -> int:
        """Rows per program: enough for one step's grouped heads, between 32 and 64, so decode and
        verify share one tile shape and a row reduces in the same order in both (greedy
        speculation stays token-identical to no speculation)."""
        if self.deterministic:
            return DETERMINISTIC_TILE[0]
        return min(64, max(self.min_tile, next_pow2(max_query_len * self.group)))

    def warps(self, block_m: int) -> int:
        """Warps per program for a tile of block_m rows."""
        if self.deterministic:
            return DETERMINISTIC_TILE[2]
        return 4 if block_m <= 32 else 8

    def max_split_seqs(self, device: torch.device) -> int:
        """The most sequences a batch may hold and still take the split-KV path."""
        if self.deterministic:
            return 0
        return (sm_count(device) - 1) // self.num_kv_heads

    def use_split(self, meta: AttentionMetadata, device: torch.device) -> int:
        """Number of splits for this launch (0: the one-pass kernel). Split only for contexts
        past `split_keys`, when one tile holds all of a sequence's queries and (KV head,
        sequence) programs alone would leave most of the GPU idle; the split count covers the
        block table's capacity, so it is static for a captured batch bucket."""
        if (self.deterministic or meta.block_tables is None
                or meta.max_query_len * self.group > 64
                or meta.max_seq_len <= self.keys_per_split(device)):
            return 0
        if meta.num_seqs > self.max_split_seqs(device):
            return 0
        capacity = meta.block_tables.shape[1] * self.block_size
        splits = -(-capacity // self.keys_per_split(device))
        return splits if splits > 1 else 0

    def split_programs(self, splits: int, num_seqs: int, device: torch.device) -> int:
        """Programs per (KV head, sequence) of a split launch: about four per multiprocessor
        in all (fewer leave too few loads in flight), each taking every P-th split."""
        per = -(-4 * sm_count(device) // (self.num_kv_heads * num_seqs))
        return max(1, min(splits, per))

    def attend(self, q, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        out = torch.empty_like(q)
        if q.shape[0] == 0:
            return out
        kc, vc = kv_cache[0], kv_cache[1]  # [blocks, block, kv_heads, d]
        splits = self.use_split(meta, q.device)
        if splits:
            return self._attend_split(q, kc, vc, out, meta, splits)
        block_m = self.tile_m(meta.max_query_len)
        grid = (triton.cdiv(meta.max_query_len * self.group, block_m), self.num_kv_heads,
                meta.num_seqs)
        precision = "ieee" if q.dtype == torch.float32 else "tf32"
        _paged_attention_kernel[grid](
            q, kc, vc, out, meta.query_start, meta.seq_lens, meta.block_tables, self.scale,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1),
            kc.stride(0), kc.stride(1), kc.stride(2), meta.block_tables.stride(0),
            G=self.group, HEAD_DIM=self.head_dim, BLOCK_D=next_pow2(self.head_dim),
            PAGE=self.block_size, BLOCK_M=block_m, BLOCK_N=self.block_n(q.device),
            PRECISION=precision, num_warps=self.warps(block_m), **pdl_args(q),
        )
        return out

    def _attend_split(self, q, kc, vc, out, meta: AttentionMetadata, splits: int):
        t, h, dim = q.shape
        acc = torch.empty(splits, t, h, dim, dtype=torch.float32, device=q.device)
        ml = torch.empty(splits, t, h, 2, dtype=torch.float32, device=q.device)
        block_m = self.tile_m(meta.max_query_len)
        precision = "ieee" if q.dtype == torch.float32 else "tf32"
        programs = self.split_programs(splits, meta.num_seqs, q.device)
        # Tiles, key blocks and warps as the one-pass kernel's: a context within one split
        # reduces in the same order on both paths.
        _paged_attention_split_kernel[(programs, self.num_kv_heads, meta.num_seqs)](
            q, kc, vc, acc, ml, meta.query_start, meta.seq_lens, meta.block_tables, self.scale,
            q.stride(0), q.stride(1), kc.stride(0), kc.stride(1), kc.stride(2),
            meta.block_tables.stride(0), acc.stride(0), acc.stride(1), acc.stride(2),
            ml.stride(0), ml.stride(1),
            G=self.group, HEAD_DIM=self.head_dim, BLOCK_D=next_pow2(self.head_dim),
            PAGE=self.block_size, BLOCK_M=block_m, BLOCK_N=self.block_n(q.device),
            SPLIT_KEYS=self.keys_per_split(q.device), PRECISION=precision,
            num_warps=self.warps(block_m), **pdl_args(q),
        )
        _split_reduce_kernel[(meta.max_query_len, self.num_heads, meta.num_seqs)](
            acc, ml, out, meta.query_start, meta.seq_lens,
            acc.stride(0), acc.stride(1), acc.stride(2), ml.stride(0), ml.stride(1),
            out.stride(0), out.stride(1), SPLIT_KEYS=self.keys_per_split(q.device),
            HEAD_DIM=self.head_dim, BLOCK_D=next_pow2(self.head_dim), num_warps=1,
            **pdl_args(q),
        )
        return out


_SMS: dict[str, int] = {}


def sm_count(device: torch.device) -> int:
    """Multiprocessors of the device (the CPU interpreter: 8, so tests take the split path)."""
    key = str(device)
    if key not in _SMS:
        _SMS[key] = (torch.cuda.get_device_properties(device).multi_processor_count
                     if device.type == "cuda" else 8)
    return _SMS[key]

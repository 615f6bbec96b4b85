"""Triton kernels of the paged attention backend (`triton_backend.TritonAttention`): the KV
store; the default mode's one-pass and split-KV attention and their reduce; the deterministic
mode's fixed-split attention and the in-order fold of its partials."""

from __future__ import annotations

try:  # Triton is optional: the torch backend needs nothing beyond torch.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where triton is absent
    triton = None
    tl = None

if triton is not None:

    @triton.jit
    def store_kv_kernel(K, V, KC, VC, slots, stride_kt, stride_vt, stride_cs,
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
    def _sequence(query_start, seq_lens, b, USE_PDL: tl.constexpr):
        """(first query token, query count, context length) of sequence b. The launch's
        metadata is never written by the kernel before (the KV store): read it while that
        kernel still runs, then (PDL) wait for that kernel's results."""
        q0 = tl.load(query_start + b)
        q_len = tl.load(query_start + b + 1) - q0
        ctx = tl.load(seq_lens + b)
        if USE_PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        return q0, q_len, ctx

    @triton.jit
    def _tile_keys(tile, q_len, ctx, G: tl.constexpr, BLOCK_M: tl.constexpr):
        """Keys a row tile can see: up to the position of its last real query."""
        last_t = tl.minimum((tile * BLOCK_M + BLOCK_M - 1) // G, q_len - 1)
        return ctx - q_len + last_t + 1

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
    def paged_attention_kernel(
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
        q0, q_len, ctx = _sequence(query_start, seq_lens, b, USE_PDL)
        if tile * BLOCK_M < q_len * G:
            q, t, head, row_ok, d, d_ok, q_pos = _load_queries(
                Q, tile * BLOCK_M, q0, q_len, ctx, kvh, stride_qt, stride_qh,
                G, HEAD_DIM, BLOCK_D, BLOCK_M)
            # Keys this tile can see: up to the position of its last real query. An earlier
            # row finds the keys past its own position masked: its max stays, the rescale is
            # exp2(0) = 1 and it adds zeros, so it rounds as it would at the end of the context.
            kv_end = _tile_keys(tile, q_len, ctx, G, BLOCK_M)
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
    def paged_attention_split_kernel(
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
        q0, q_len, ctx = _sequence(query_start, seq_lens, b, USE_PDL)
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
    def split_reduce_kernel(ACC, ML, Out, query_start, seq_lens,
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
        q0, q_len, ctx = _sequence(query_start, seq_lens, b, USE_PDL)
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

    @triton.jit
    def _fold(m_run, l_run, acc_run, m_s, l_s, acc_s):
        """Adds one split's partial (max, sum, acc: [R], [R], [R, D]) to the running ones of
        the splits before it. Both kernels below fold through here with explicit fmas, so a
        row's combine rounds the same whichever of them runs it."""
        m_new = tl.maximum(m_run, m_s)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        a = tl.exp2(m_run - m_safe)
        b = tl.exp2(m_s - m_safe)
        return m_new, tl.fma(l_run, a, l_s * b), tl.fma(acc_run, a[:, None], acc_s * b[:, None])

    @triton.jit
    def _normalize(l_sum, acc):
        return acc / tl.where(l_sum == 0.0, 1.0, l_sum)[:, None]

    @triton.jit(do_not_specialize=["programs", "stride_bt", "stride_as", "stride_at",
                                   "stride_ms", "stride_mt"])
    def fixed_split_attention_kernel(
        Q, KC, VC, Out, ACC, ML, query_start, seq_lens, block_tables, scale, programs,
        stride_qt, stride_qh, stride_ot, stride_oh, stride_cb, stride_cs, stride_ch, stride_bt,
        stride_as, stride_at, stride_ah, stride_ms, stride_mt,
        G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
        PAGE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        SPLIT_KEYS: tl.constexpr, PRECISION: tl.constexpr, USE_PDL: tl.constexpr = False,
    ):
        """The deterministic mode's attention, prefill tiles and decode rows alike: split s
        covers keys [s * SPLIT_KEYS, (s + 1) * SPLIT_KEYS), reduced in BLOCK_N-key steps from
        its start, and the splits fold in order 0, 1, 2, ... Program (tile * programs + p, kv
        head, seq) takes splits p, p + programs, ... of its row tile. One program per tile
        (`programs` 1) folds them itself and writes the output; more write each split's
        partial (acc, max, sum) for `fold_splits_kernel`, which folds them alike."""
        pid = tl.program_id(0)
        kvh = tl.program_id(1)
        b = tl.program_id(2)
        tile = pid // programs
        q0, q_len, ctx = _sequence(query_start, seq_lens, b, USE_PDL)
        if tile * BLOCK_M < q_len * G:
            q, t, head, row_ok, d, d_ok, q_pos = _load_queries(
                Q, tile * BLOCK_M, q0, q_len, ctx, kvh, stride_qt, stride_qh,
                G, HEAD_DIM, BLOCK_D, BLOCK_M)
            # Keys up to the tile's last real query; a split or step past a row's own
            # position leaves its max, sum and acc as they were (bit for bit).
            kv_end = _tile_keys(tile, q_len, ctx, G, BLOCK_M)
            qk_scale = scale * 1.4426950408889634
            table = block_tables + b * stride_bt
            m_run = tl.full([BLOCK_M], float("-inf"), tl.float32)
            l_run = tl.zeros([BLOCK_M], tl.float32)
            acc_run = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
            for split in range(pid % programs, tl.cdiv(kv_end, SPLIT_KEYS), programs):
                lo = split * SPLIT_KEYS
                hi = tl.minimum(lo + SPLIT_KEYS, kv_end)
                m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
                l_i = tl.zeros([BLOCK_M], tl.float32)
                acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
                for start in range(lo, hi, BLOCK_N):
                    m_i, l_i, acc = _attend_keys(
                        q, q_pos, m_i, l_i, acc, start, hi, KC, VC, table, kvh, d, d_ok,
                        qk_scale, stride_cb, stride_cs, stride_ch, PAGE, BLOCK_N, PRECISION)
                if programs == 1:
                    m_run, l_run, acc_run = _fold(m_run, l_run, acc_run, m_i, l_i, acc)
                else:
                    tl.store(ACC + split * stride_as + (q0 + t)[:, None] * stride_at
                             + head[:, None] * stride_ah + d[None, :], acc,
                             mask=row_ok[:, None] & d_ok[None, :])
                    ml = ML + split * stride_ms + (q0 + t) * stride_mt + head * 2
                    tl.store(ml, m_i, mask=row_ok)
                    tl.store(ml + 1, l_i, mask=row_ok)
            if programs == 1:
                tl.store(Out + (q0 + t)[:, None] * stride_ot + head[:, None] * stride_oh
                         + d[None, :], _normalize(l_run, acc_run).to(Out.dtype.element_ty),
                         mask=row_ok[:, None] & d_ok[None, :])

    @triton.jit(do_not_specialize=["stride_as", "stride_at", "stride_ms", "stride_mt"])
    def fold_splits_kernel(ACC, ML, Out, query_start, seq_lens,
                           stride_as, stride_at, stride_ah, stride_ms, stride_mt,
                           stride_ot, stride_oh, SPLIT_KEYS: tl.constexpr,
                           HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                           CHUNK: tl.constexpr = 8, USE_PDL: tl.constexpr = False):
        """Program (i, head, seq) folds the partials of query token i of the sequence for one
        head in split order, up to the split of the row's own position, as a one-row tile
        through `_fold`. The loads of CHUNK splits go out together; a split past the row's
        adds nothing."""
        i = tl.program_id(0)
        h = tl.program_id(1)
        b = tl.program_id(2)
        q0, q_len, ctx = _sequence(query_start, seq_lens, b, USE_PDL)
        if i < q_len:
            n = tl.cdiv(ctx - q_len + i + 1, SPLIT_KEYS)  # through the row's own position
            d = tl.arange(0, BLOCK_D)
            d_ok = d < HEAD_DIM
            ml = ML + (q0 + i) * stride_mt + h * 2
            part = ACC + (q0 + i) * stride_at + h * stride_ah + d
            c = tl.arange(0, CHUNK)
            m_run = tl.full([1], float("-inf"), tl.float32)
            l_run = tl.zeros([1], tl.float32)
            acc_run = tl.zeros([1, BLOCK_D], tl.float32)
            for s0 in range(0, n, CHUNK):
                ok = s0 + c < n
                ms = tl.load(ml + (s0 + c) * stride_ms, mask=ok, other=float("-inf"))
                ls = tl.load(ml + (s0 + c) * stride_ms + 1, mask=ok, other=0.0)
                parts = tl.load(part[None, :] + (s0 + c)[:, None] * stride_as,
                                mask=ok[:, None] & d_ok[None, :], other=0.0)
                for j in tl.static_range(CHUNK):  # picking split j out of the chunk is exact
                    m_run, l_run, acc_run = _fold(
                        m_run, l_run, acc_run, tl.sum(tl.where(c == j, ms, 0.0)[None, :], 1),
                        tl.sum(tl.where(c == j, ls, 0.0)[None, :], 1),
                        tl.sum(tl.where((c == j)[:, None], parts, 0.0), 0)[None, :])
            tl.store(Out + (q0 + i) * stride_ot + h * stride_oh + d[None, :],
                     _normalize(l_run, acc_run).to(Out.dtype.element_ty), mask=d_ok[None, :])

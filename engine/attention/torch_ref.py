"""Reference attention in plain torch: gathers each sequence's blocks, runs SDPA; CPU-ready."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.attention.base import AttentionBackend, AttentionMetadata


class TorchAttention(AttentionBackend):
    """Correct first, simple always; the oracle other backends are tested against. With
    `deterministic`, every query row attends on its own, never batched with others."""

    name = "torch"

    def store_kv(self, k, v, kv_cache, meta: AttentionMetadata) -> None:
        flat = kv_cache.view(2, -1, self.num_kv_heads, self.head_dim)
        flat[0].index_copy_(0, meta.slot_mapping, k.to(kv_cache.dtype))
        flat[1].index_copy_(0, meta.slot_mapping, v.to(kv_cache.dtype))

    def attend(self, q, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        if meta.max_query_len == 1 and q.is_cuda and not self.deterministic:
            return self._decode_batched(q, kv_cache, meta)
        starts = meta.query_start_cpu or meta.query_start.tolist()
        lens = meta.seq_lens_cpu or meta.seq_lens.tolist()
        out = torch.empty_like(q)
        bs = self.block_size
        attend_seq = self._rows if self.deterministic else self._sdpa
        for i, ctx in enumerate(lens):
            q0, q1 = starts[i], starts[i + 1]
            blocks = meta.block_tables[i, : -(-ctx // bs)]
            k = kv_cache[0, blocks].flatten(0, 1)[:ctx]  # [ctx, kvh, d]
            v = kv_cache[1, blocks].flatten(0, 1)[:ctx]
            out[q0:q1] = attend_seq(q[q0:q1], k, v, ctx)
        return out

    def _rows(self, q, k, v, ctx):
        """Each query row on its own over the keys up to its position: the call a one-token
        decode makes, so a row rounds alike in every batch, verify or prefill chunk (one SDPA
        call per row, slow for long prefills)."""
        first = ctx - q.shape[0]
        return torch.cat([self._sdpa(q[i:i + 1], k[:first + i + 1], v[:first + i + 1],
                                     first + i + 1) for i in range(q.shape[0])])

    def _decode_batched(self, q, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        """All sequences decode one token: one padded SDPA instead of a Python loop. Used on
        GPUs only; on the CPU the loop keeps results independent of batch composition."""
        k = kv_cache[0][meta.block_tables].flatten(1, 2).transpose(1, 2)  # [B, kvh, S, d]
        v = kv_cache[1][meta.block_tables].flatten(1, 2).transpose(1, 2)
        pos = torch.arange(k.shape[2], device=q.device)
        mask = (pos[None, :] < meta.seq_lens[:, None])[:, None, None, :]
        o = F.scaled_dot_product_attention(q.unsqueeze(2), k.to(q.dtype), v.to(q.dtype),
                                           attn_mask=mask, scale=self.scale,
                                           enable_gqa=self.num_heads != self.num_kv_heads)
        return o.squeeze(2)

    def _sdpa(self, q, k, v, ctx):
        qlen = q.shape[0]
        qh, kh, vh = (x.transpose(0, 1).unsqueeze(0).to(q.dtype) for x in (q, k, v))
        if qlen == 1:
            mask = None  # one query sees the whole context
        else:
            # Query i sits at position ctx - qlen + i and sees keys up to there.
            qpos = torch.arange(ctx - qlen, ctx, device=q.device)[:, None]
            mask = torch.arange(ctx, device=q.device)[None, :] <= qpos
        o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=self.scale,
                                           enable_gqa=self.num_heads != self.num_kv_heads)
        return o[0].transpose(0, 1)

"""The attention-backend boundary: every kernel family (torch reference, Triton) implements this."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """Per-forward description of a packed variable-length batch over the paged KV cache.

    Sequence i owns query rows `query_start[i]:query_start[i+1]`; after this forward its
    context is `seq_lens[i]` tokens, the last `query_len` of which are the queries (so
    prefill chunks, decode steps and K+1-token verify steps are the same case).
    """

    slot_mapping: torch.Tensor  # [T] int64: cache slot (block * block_size + offset) per token
    query_start: torch.Tensor  # [B+1] int32, cumulative query lengths
    seq_lens: torch.Tensor  # [B] int32, context length including this forward's tokens
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with 0
    max_query_len: int
    max_seq_len: int
    query_start_cpu: list[int] | None = None
    seq_lens_cpu: list[int] | None = None

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]


class AttentionBackend(ABC):
    """Stores new K/V into the paged cache and attends over it, causally per sequence."""

    name: str = "base"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
                 deterministic: bool = False):
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.head_dim, self.block_size = head_dim, block_size
        self.scale = head_dim**-0.5
        # Each query row reduces in one fixed order whatever shares the launch
        # (`EngineConfig.deterministic`); the model's other kernels follow this flag too.
        self.deterministic = deterministic

    @abstractmethod
    def store_kv(self, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                 meta: AttentionMetadata) -> None:
        """Write k, v ([T, kv_heads, head_dim]) into kv_cache ([2, blocks, block, kv_heads, d])."""

    @abstractmethod
    def attend(self, q: torch.Tensor, kv_cache: torch.Tensor,
               meta: AttentionMetadata) -> torch.Tensor:
        """q: [T, heads, head_dim] → [T, heads, head_dim], reading K/V from the cache."""

    def max_split_seqs(self, device: torch.device) -> int:
        """The most sequences a batch may hold and still take a split-KV path (0: none)."""
        return 0

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        self.store_kv(k, v, kv_cache, meta)
        return self.attend(q, kv_cache, meta)

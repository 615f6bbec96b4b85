"""The block layout both ends of a transfer must share, and the handshake check over it."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, fields
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from engine.config import EngineConfig

# Bump when the meaning of the KV tensor changes in a way the other fields cannot show
# (dimension order, what a draft slot holds, the wire format of a transfer).
LAYOUT_VERSION = 1
# The dimension order the engine allocates: [layers, K/V, blocks, block_size, kv_heads, head_dim].
BLOCKS_DIM = 2


class LayoutMismatch(ValueError):
    """The peer's KV blocks are laid out differently: copying them would corrupt the cache."""

    def __init__(self, message: str, fields: tuple[str, ...] = ()):
        super().__init__(message)
        self.fields = fields


def dtype_name(dtype: torch.dtype) -> str:
    """'torch.bfloat16' -> 'bfloat16': the spelling used on the wire."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    """Inverse of `dtype_name`; refuses anything that is not a torch dtype."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


@dataclass(frozen=True)
class BlockLayout:
    """What one KV block looks like: equal layouts (same `compat_hash`) can swap raw bytes."""

    model: str
    dtype: str
    block_size: int
    num_layers: int  # target + draft layers: the first dimension of the KV tensor
    num_kv_heads: int
    head_dim: int
    num_draft_layers: int = 0
    version: int = LAYOUT_VERSION

    def __post_init__(self) -> None:
        dtype_from_name(self.dtype)
        if min(self.block_size, self.num_layers, self.num_kv_heads, self.head_dim) <= 0:
            raise ValueError(f"layout dimensions must be positive: {self}")
        if not 0 <= self.num_draft_layers <= self.num_layers:
            raise ValueError("num_draft_layers must be in 0..num_layers")

    @classmethod
    def from_engine_config(cls, cfg: EngineConfig) -> BlockLayout:
        """The layout of the KV tensor `engine.runner.allocate_kv_cache` builds for `cfg`."""
        m = cfg.model
        return cls(model=m.name, dtype=dtype_name(cfg.dtype), block_size=cfg.block_size,
                   num_layers=cfg.num_kv_layers, num_kv_heads=m.num_kv_heads,
                   head_dim=m.head_dim, num_draft_layers=cfg.num_draft_layers)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> BlockLayout:
        """Rebuild from `to_dict()` output (the handshake payload); unknown keys are refused."""
        names = {f.name for f in fields(cls)}
        extra = set(d) - names
        if extra:
            raise LayoutMismatch(f"peer layout has unknown fields {sorted(extra)}", tuple(extra))
        return cls(**d)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def compat_hash(self) -> str:
        """sha256 hex of a canonical JSON encoding: stable across processes and versions."""
        blob = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()

    @property
    def torch_dtype(self) -> torch.dtype:
        return dtype_from_name(self.dtype)

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.torch_dtype).element_size()

    @property
    def block_bytes(self) -> int:
        """Bytes of one block across all layers, K and V: what one block id costs to ship."""
        return (self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim
                * self.itemsize)

    def kv_shape(self, num_blocks: int) -> tuple[int, ...]:
        """Shape of a whole KV tensor of `num_blocks` blocks in this layout."""
        return (self.num_layers, 2, num_blocks, self.block_size, self.num_kv_heads,
                self.head_dim)

    def check_tensor(self, kv: torch.Tensor) -> None:
        """Refuse a KV tensor that does not have this layout (any number of blocks)."""
        if kv.dim() != 6 or kv.dtype != self.torch_dtype or (
                kv.shape[:2] + kv.shape[3:] != self.kv_shape(0)[:2] + self.kv_shape(0)[3:]):
            raise LayoutMismatch(
                f"KV tensor {tuple(kv.shape)} {dtype_name(kv.dtype)} does not match layout "
                f"{self.kv_shape(kv.shape[BLOCKS_DIM] if kv.dim() == 6 else -1)} {self.dtype}")
        if not kv.is_contiguous():
            raise ValueError("the KV tensor must be contiguous")


def check_compatible(local: BlockLayout, peer: BlockLayout) -> None:
    """Raise `LayoutMismatch` naming every differing field, before a single byte moves."""
    if local.compat_hash() == peer.compat_hash():
        return
    a, b = local.to_dict(), peer.to_dict()
    diff = tuple(k for k in a if a[k] != b[k])
    detail = "; ".join(f"{k}: {a[k]!r} (local) != {b[k]!r} (peer)" for k in diff)
    raise LayoutMismatch(f"KV layout mismatch with peer: {detail}", diff)

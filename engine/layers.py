"""Small building blocks shared by the target model and draft heads."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from engine.config import RopeConfig


def whole(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """fn(x): all rows in one call."""
    return fn(x)


def rowwise(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """fn of each row of x ([T, ...]) alone, each a fresh [1, ...] tensor, concatenated: a row's
    result then does not depend on how many rows x holds nor on what they hold (a GEMM's
    blocking, a thread split and where a vectorized loop's tail falls follow the row count;
    a BLAS kernel may follow the input's address)."""
    if x.shape[0] == 0:
        return fn(x)
    return torch.cat([fn(x[i:i + 1].clone()) for i in range(x.shape[0])])


class RMSNorm(nn.Module):
    """RMS norm computed in fp32, scaled in the input dtype (the Llama convention)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """Inverse frequencies for default, linear and llama3 rotary scaling."""
    exps = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv = 1.0 / (rope.theta**exps)
    if rope.type == "linear":
        return inv / rope.factor
    if rope.type == "llama3":
        low_wavelen = rope.original_max_position / rope.low_freq_factor
        high_wavelen = rope.original_max_position / rope.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / rope.factor, inv)
        smooth = (rope.original_max_position / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    return inv


class Rotary(nn.Module):
    """cos/sin tables for every position up to max_position, indexed per token."""

    def __init__(self, rope: RopeConfig, head_dim: int, max_position: int):
        super().__init__()
        inv = rope_inv_freq(rope, head_dim)
        freqs = torch.arange(max_position, dtype=torch.float32)[:, None] * inv[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, positions: torch.Tensor, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Rotate each x ([T, heads, head_dim]) by its token's position."""
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        return tuple(
            x * cos.to(x.dtype) + _rotate_half(x) * sin.to(x.dtype) for x in xs
        )


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

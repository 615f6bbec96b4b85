"""Token selection: greedy, temperature, top-k, top-p; each request draws from its own RNG.

In the deterministic mode (`EngineConfig.deterministic`) a sampled token is a pure function of
the request's seed, the token's index in the sequence and the logits at that position:
Gumbel-max with noise hashed from (seed, index, token id), so it is the same whatever shares the
batch, however many drafts are verified with it, on whichever engine the request decodes."""

from __future__ import annotations

import functools
import random

import torch

from engine.sequence import SamplingParams

_M32 = 0xFFFFFFFF


def new_generator(seed: int | None, device: str | torch.device = "cpu") -> torch.Generator:
    """A request's private RNG: seeded → reproducible whatever else is in the batch."""
    g = torch.Generator(device=device)
    g.manual_seed(seed if seed is not None else random.getrandbits(63))
    return g


def processed_logits(logits: torch.Tensor, params: SamplingParams,
                     stable: bool = False) -> torch.Tensor:
    """Temperature, then top-k, then top-p: fp32 logits with the excluded tokens at -inf.

    `stable`: tied logits at the top-p cut are kept or dropped by token id, not by the order an
    unstable sort happens to leave them in."""
    logits = logits.float() / max(params.temperature, 1e-6)
    vocab = logits.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, idx = torch.sort(logits, dim=-1, descending=True, stable=stable)
        probs = sorted_logits.softmax(-1)
        # Drop a token when the mass before it already reaches top_p; the first always stays.
        drop = probs.cumsum(-1) - probs >= params.top_p
        drop[..., 0] = False  # a top_p that rounds to 0 in fp32 (1e-300) would drop it too
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(-1, idx, sorted_logits)
    return logits


def processed_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution a request samples from: softmax of `processed_logits`.

    logits: [n, vocab] fp32 (n positions of one request). Speculative verification uses the
    same function, so draft acceptance tests against exactly what plain sampling would use.
    """
    return processed_logits(logits, params).softmax(-1)


def sample_from(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One token per row of probs ([n, vocab]) by the exponential race (no host sync needed)."""
    noise = torch.empty_like(probs).exponential_(1.0, generator=generator)
    return (probs / noise).argmax(dim=-1)


def mix32(x):
    """A bijective 32-bit integer hash, on a Python int or an int64 tensor of 32-bit values.
    Products are split so that none passes 2**49: exact on every device, no int64 overflow."""
    for shift, c in ((16, 0x7FEB352D), (15, 0x846CA68B)):
        x = x ^ (x >> shift)
        x = (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _M32
    return x ^ (x >> 16)


@functools.lru_cache(maxsize=8)
def _token_keys(vocab: int, device: str) -> torch.Tensor:
    """Every token id hashed once: the per-token half of the noise key."""
    return mix32(torch.arange(vocab, dtype=torch.int64, device=device) ^ 0x2545F491)


def gumbel_noise(seed: int, first: int, n: int, vocab: int,
                 device: str | torch.device = "cpu") -> torch.Tensor:
    """[n, vocab] fp64 standard Gumbel noise for the tokens at indices first..first+n-1 of a
    request seeded `seed`: a pure function of (seed, index, token id), no generator state.
    Built on the device from scalars (no host-to-device copy, no sync)."""
    s = mix32(mix32((seed & _M32) ^ 0x9E3779B9) ^ ((seed >> 32) & _M32))
    idx = torch.arange(first, first + n, dtype=torch.int64, device=device)
    rows = mix32((idx & _M32) ^ s)
    bits = mix32(_token_keys(vocab, str(torch.device(device))) ^ rows[:, None])
    u = (bits.double() + 0.5) * 2.0**-32  # uniform in (0, 1), exact in fp64
    if u.device.type == "cpu":
        # CPU kernels finish a tensor's tail with scalar code whose log can differ in the last
        # bit from the vectorized one: one row at a time keeps each row's bits fixed.
        return torch.cat([-torch.log(-torch.log1p(-r)) for r in u.split(1)])
    return -torch.log(-torch.log1p(-u))


def gumbel_tokens(logits: torch.Tensor, params: SamplingParams, seed: int,
                  first: int) -> torch.Tensor:
    """The deterministic mode's draw: row i of logits ([n, vocab], positions of one request) gives
    the token at index first + i, the argmax of processed logits plus Gumbel noise. That is an
    exact sample of `processed_probs` (Gumbel-max), independent across indices and seeds."""
    x = processed_logits(logits, params, stable=True).double()
    return (x + gumbel_noise(seed, first, x.shape[0], x.shape[1], x.device)).argmax(dim=-1)


class Sampler:
    """Picks the next token of each request from its logits row."""

    def __call__(self, logits: torch.Tensor, params: list[SamplingParams],
                 generators: list[torch.Generator | None]) -> list[int]:
        greedy = logits.argmax(dim=-1)
        out = greedy.tolist()
        for i, (p, g) in enumerate(zip(params, generators)):
            if not p.greedy:
                out[i] = int(sample_from(processed_probs(logits[i : i + 1], p), g)[0])
        return out

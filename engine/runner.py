"""Turns a scheduled batch into model inputs, runs the model, returns logits rows."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.attention import AttentionMetadata
from engine.config import EngineConfig
from engine.model import LlamaModel
from engine.scheduler import Batch


@dataclass
class ForwardInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_rows: list[int]  # packed row of the last token of each batch entry


@dataclass
class ForwardOutput:
    logits: torch.Tensor  # [len(entries), vocab] fp32
    hidden: torch.Tensor  # [T, hidden] final normed hidden states of every packed token
    aux: list[torch.Tensor]  # hidden states entering the requested aux layers
    inputs: ForwardInputs


def allocate_kv_cache(cfg: EngineConfig, num_blocks: int) -> torch.Tensor:
    """One tensor for all layers (target + draft): [layers, 2, blocks, block, kv_heads, d]."""
    m = cfg.model
    shape = (cfg.num_kv_layers, 2, num_blocks, cfg.block_size, m.num_kv_heads, m.head_dim)
    return torch.zeros(shape, dtype=cfg.dtype, device=cfg.device)


def build_inputs(batch: Batch, block_size: int, device: str) -> ForwardInputs:
    """Pack the new tokens of every scheduled sequence (no padding)."""
    ids, pos, slots, starts, lens, rows = [], [], [], [0], [], []
    for seq, n in zip(batch.seqs, batch.num_tokens):
        lo, hi = seq.num_computed, seq.num_computed + n
        ids.extend(seq.token_ids[lo:hi])
        if hi > len(seq):  # a verify step: the drafts follow the last real token
            ids.extend(seq.draft[: hi - len(seq)])
        pos.extend(range(lo, hi))
        table = seq.block_table
        slots.extend(table[p // block_size] * block_size + p % block_size for p in range(lo, hi))
        starts.append(starts[-1] + n)
        lens.append(hi)
        rows.append(starts[-1] - 1)
    width = max(len(s.block_table) for s in batch.seqs)
    tables = [s.block_table + [0] * (width - len(s.block_table)) for s in batch.seqs]

    def t(x, dtype=torch.int64):
        return torch.tensor(x, dtype=dtype, device=device)

    meta = AttentionMetadata(
        slot_mapping=t(slots), query_start=t(starts, torch.int32), seq_lens=t(lens, torch.int32),
        block_tables=t(tables, torch.int32), max_query_len=max(batch.num_tokens),
        max_seq_len=max(lens), query_start_cpu=starts, seq_lens_cpu=lens,
    )
    return ForwardInputs(t(ids), t(pos), meta, rows)


class ModelRunner:
    """Owns the model and the KV tensor; one `forward` per engine step."""

    def __init__(self, cfg: EngineConfig, model: LlamaModel, kv_cache: torch.Tensor):
        self.cfg, self.model, self.kv_cache = cfg, model, kv_cache

    @torch.inference_mode()
    def forward(self, batch: Batch, entries: list[int], aux_layers: tuple[int, ...] = (),
                rows: list[int] | None = None) -> ForwardOutput:
        """Run the batch; logits of the last token of each entry in `entries` (or of the
        packed `rows` when given)."""
        inp = build_inputs(batch, self.cfg.block_size, self.cfg.device)
        hidden, aux = self.model(inp.input_ids, inp.positions, self.kv_cache, inp.meta,
                                 aux_layers)
        if rows is None:
            rows = [inp.logits_rows[i] for i in entries]
        idx = torch.tensor(rows, dtype=torch.int64, device=hidden.device)
        return ForwardOutput(self.model.logits(hidden[idx]), hidden, aux, inp)

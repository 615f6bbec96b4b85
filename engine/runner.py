"""Turns a scheduled batch into model inputs, runs the model, and verifies its drafts."""

from __future__ import annotations

import warnings

import torch

from engine.config import EngineConfig
from engine.errors import ResourceExhaustedError
from engine.graphs import GraphSet, PackedInputs, pack, to_device
from engine.model import LlamaModel
from engine.scheduler import Batch
from engine.spec.lookup import store_tokens
from engine.spec.verify import (
    VerifyResult,
    verify_greedy,
    verify_sampled_device,
    verify_seeded_device,
)
from engine.staging import HostStager


class ForwardOutput:
    """A forward's results for the requested logits rows. `logits` ([rows, vocab] fp32) is
    computed on first use: greedy batches need only `argmax`, which decode and verify graphs
    already produce on the device."""

    def __init__(self, model: LlamaModel, picked: torch.Tensor, hidden: torch.Tensor,
                 aux: list[torch.Tensor], inputs: PackedInputs,
                 argmax: torch.Tensor | None = None):
        self.model, self.picked = model, picked
        self.hidden = hidden  # [T, hidden] final normed hidden states of every packed token
        self.aux = aux  # hidden states entering the requested aux layers
        self.inputs = inputs
        self._argmax, self._logits = argmax, None

    @property
    def logits(self) -> torch.Tensor:
        if self._logits is None:
            with torch.inference_mode():
                self._logits = self.model.logits(self.picked)
        return self._logits

    @property
    def argmax(self) -> torch.Tensor:
        if self._argmax is None:
            with torch.inference_mode():
                self._argmax = self.logits.argmax(dim=-1)
        return self._argmax


PREFILL_LENS = (32, 64, 128, 256, 512)  # prefill chunk lengths captured (padded up to)
PREFILL_BATCH = 4  # sequences per captured prefill chunk


def prefill_graph_set(fn, device: str, max_batch: int, longer_than: int, max_blocks: int,
                      **kw) -> GraphSet:
    """Graphs of `fn` over prompt chunks of up to PREFILL_BATCH sequences, each padded up to
    the next of PREFILL_LENS past `longer_than` (the lengths a decode/verify set captures)."""
    return GraphSet(fn, device, min(max_batch, PREFILL_BATCH),
                    [q for q in PREFILL_LENS if q > longer_than], max_blocks,
                    pad_queries=True, **kw)


def cache_blocks(cfg: EngineConfig) -> int:
    """How many KV blocks the engine's budget holds: `kv_cache_bytes`, or on CUDA a share of
    the memory free now (so engines sharing a GPU, or weights, each fit)."""
    budget = cfg.kv_cache_bytes
    if cfg.on_cuda:
        torch.cuda.empty_cache()
        free, _ = torch.cuda.mem_get_info(cfg.device)
        budget = int(free * cfg.gpu_memory_utilization)
    n = budget // cfg.kv_bytes_per_block
    need = cfg.max_blocks_per_seq
    if n < need:
        raise ResourceExhaustedError(
            f"KV budget holds {n} blocks of {cfg.block_size} tokens, fewer than one "
            f"max_model_len={cfg.max_model_len} context needs ({need})")
    return n


def allocate_kv_cache(cfg: EngineConfig, num_blocks: int) -> torch.Tensor:
    """One tensor for all layers (target + draft): [layers, 2, blocks, block, kv_heads, d]."""
    m = cfg.model
    shape = (cfg.num_kv_layers, 2, num_blocks, cfg.block_size, m.num_kv_heads, m.head_dim)
    return torch.zeros(shape, dtype=cfg.dtype, device=cfg.device)


def pack_batch(batch: Batch, block_size: int) -> PackedInputs:
    """Pack the new tokens of every scheduled sequence (no padding); verify entries carry their
    drafts after the last real token."""
    ids, pos = [], []
    for seq, n in zip(batch.seqs, batch.num_tokens):
        lo, hi = seq.num_computed, seq.num_computed + n
        ids.extend(seq.token_ids[lo:hi])
        if hi > len(seq):
            ids.extend(seq.draft[: hi - len(seq)])
        pos.extend(range(lo, hi))
    return pack(ids, pos, [s.block_table for s in batch.seqs], batch.num_tokens, block_size)


class ModelRunner:
    """Owns the model and the KV tensor; one `run` (forward and verify) per engine step. On
    CUDA with a graph-safe backend, decode/verify batches (any per-sequence K up to the
    captured query lengths) replay captured graphs, and so do prefill chunks of a few
    sequences (padded up to a captured chunk length); longer chunks run eagerly."""

    def __init__(self, cfg: EngineConfig, model: LlamaModel, kv_cache: torch.Tensor,
                 tokens: torch.Tensor | None = None):
        self.cfg, self.model, self.kv_cache = cfg, model, kv_cache
        self.tokens = tokens  # token ids by KV slot (engine/spec/lookup.py), or None
        self.stager = HostStager(cfg.device, 1 << 14)
        self.graphs: GraphSet | None = None
        self.prefill_graphs: GraphSet | None = None
        self.graph_aux: tuple[int, ...] = ()
        self._built: dict[tuple[int, ...], tuple] = {}  # graph sets of other aux layers
        # Set while a speculative engine warms (engine/warming.py): only the one-query decode
        # graphs are captured, so longer queries (short prefill chunks) take the prefill graphs.
        self.plain_only = False

    def enable_graphs(self, max_batch: int, query_lens, aux_layers: tuple[int, ...],
                      laps=None) -> GraphSet:
        """The graph sets of this model (captured later), after timing on this GPU which row
        counts take the prologue linears and which kernels the large projections take
        (`laps`, a `warmup.Laps`: the time of each)."""
        model, kv = self.model, self.kv_cache
        if model.prologue_linears and model.prologue_calibration is None:
            # Before any capture: which row counts take the prologue linears on this GPU.
            try:
                model.calibrate_prologue_rows()
            except Exception as e:  # keep the uncalibrated default (one row)
                warnings.warn(f"prologue-linear calibration failed, keeping "
                              f"{sorted(model.prologue_rows)} rows: {e!r}", stacklevel=2)
            if laps is not None:
                laps.lap("calibrate_prologue_rows")
        if model.large_linear_tuning is None:
            try:  # large projections: our kernels or cuBLAS, per shape on this GPU
                model.tune_large_linears()
            except Exception as e:  # noqa: BLE001 - keep the defaults (ops.LARGE_LINEAR)
                warnings.warn(f"large-linear tuning failed, keeping the defaults: {e!r}",
                              stacklevel=2)
            if laps is not None:
                laps.lap("tune_large_linears")

        tokens = self.tokens

        def fn(ids, pos, meta):
            if tokens is not None:
                store_tokens(tokens, ids, meta.slot_mapping)
            hidden, aux = model(ids, pos, kv, meta, aux_layers)
            # Every row's greedy token inside the graph: a greedy step needs nothing else.
            return (hidden, model.greedy(hidden), *aux)

        self.graphs = GraphSet(fn, self.cfg.device, max_batch, query_lens,
                               self.cfg.max_blocks_per_seq)
        # Prefill chunks of a few sequences, padded up to a captured length: a chunk that
        # arrives beside running decodes (one per step under steady load with speculation)
        # would otherwise launch every kernel of the model from Python.
        self.prefill_graphs = prefill_graph_set(fn, self.cfg.device, max_batch, max(query_lens),
                                                self.cfg.max_blocks_per_seq,
                                                pool=self.graphs.pool)
        self.graph_aux = aux_layers
        return self.graphs

    def graphs_for(self, aux_layers: tuple[int, ...]) -> None:
        """Make the graph sets in use return the inputs of `aux_layers` (a trainer's tap):
        those built for them before, else new ones of the same shape (captured on first use);
        the sets they replace are kept for a later switch back."""
        if self.graphs is None or aux_layers == self.graph_aux:
            return
        self._built[self.graph_aux] = (self.graphs, self.prefill_graphs)
        if aux_layers in self._built:
            self.graphs, self.prefill_graphs = self._built.pop(aux_layers)
            self.graph_aux = aux_layers
        else:
            self.enable_graphs(self.graphs.max_batch, self.graphs.query_lens, aux_layers)

    @torch.inference_mode()
    def forward(self, batch: Batch, rows: list[int], aux_layers: tuple[int, ...] = (),
                decode_graphs: bool = True) -> ForwardOutput:
        """Run the batch; logits of the packed `rows`. `decode_graphs=False`: not through
        the decode graphs, whose outputs a step in flight may still be read from (a
        prefill launched beside it)."""
        inp = pack_batch(batch, self.cfg.block_size)
        return self.forward_packed(inp, rows, aux_layers, decode_graphs)

    def run(self, batch: Batch, aux_layers: tuple[int, ...], generators: dict,
            defer: bool = False):
        """Forward the batch and verify drafts (none: plain sampling) for entries whose tokens are
        all computed, sampled ones drawing from `generators`; results stay on the device until one
        host sync: (forward, {entry: (drafts, VerifyResult)}). `defer`: start the copy and return
        (forward, read) at once; read() waits for those results alone and returns them."""
        done, rows, ks, end = [], [], [], 0
        for i, (s, n) in enumerate(zip(batch.seqs, batch.num_tokens)):
            end += n
            if s.num_computed + n >= len(s):
                k = s.num_computed + n - len(s)  # drafts riding in this entry
                done.append(i)
                ks.append(k)
                rows.extend(range(end - k - 1, end))
        # Deferred: beside a step in flight, whose decode-graph outputs the next step reads.
        fwd = self.forward(batch, rows, aux_layers=aux_layers, decode_graphs=not defer)
        parts, sampled, r = [fwd.argmax], [], 0
        for i, k in zip(done, ks):
            seq = batch.seqs[i]
            if not seq.params.greedy:
                x = self.stager.index(seq.draft[:k])
                q = seq.draft_q[:k] if seq.draft_q is not None and k else None
                g, logits = generators[seq.request_id], fwd.logits[r : r + k + 1]
                if self.cfg.deterministic:  # row 0 draws the token at index len(seq)
                    n, tok = verify_seeded_device(x, logits, seq.params, g.initial_seed(), len(seq))
                else:
                    n, tok = verify_sampled_device(x, q, logits, seq.params, g)
                sampled.append(i)
                parts += [n.view(1), tok.view(1)]
            r += k + 1
        flat = torch.cat(parts) if len(parts) > 1 else parts[0]

        def read(values: list[int]) -> dict:
            argmax, extra = values[: len(rows)], iter(values[len(rows):])
            drawn = {i: (next(extra), next(extra)) for i in sampled}
            results, r = {}, 0
            for i, k in zip(done, ks):
                seq = batch.seqs[i]
                if i in drawn:
                    n, tok = drawn[i]
                    res = VerifyResult([*seq.draft[:n], tok], n)
                else:
                    res = verify_greedy(seq.draft[:k], argmax[r : r + k + 1])
                results[i] = (k, res)
                r += k + 1
            return results

        if defer:
            fetch = self.stager.fetch(flat)
            return fwd, lambda: read(fetch())
        return fwd, read(flat.tolist())  # the sync

    def forward_packed(self, inp: PackedInputs, rows: list[int],
                       aux_layers: tuple[int, ...] = (),
                       decode_graphs: bool = True) -> ForwardOutput:
        top = None
        if self.plain_only and inp.max_query_len > 1:
            decode_graphs = False
        sets = (self.graphs, self.prefill_graphs) if decode_graphs else (self.prefill_graphs,)
        g = next((g for g in sets if g is not None
                  and aux_layers == self.graph_aux and g.supports(inp)), None)
        pre = self.prefill_graphs
        if g is not None:
            hidden, top, *aux = g.run(inp)
        elif pre is not None and aux_layers == self.graph_aux and pre.supports_split(inp):
            hidden, top, *aux = pre.run_split(inp)  # more sequences than a chunk holds
        else:
            ids, pos, meta = to_device(inp, self.stager)
            if self.tokens is not None:
                store_tokens(self.tokens, ids, meta.slot_mapping)
            hidden, aux = self.model(ids, pos, self.kv_cache, meta, aux_layers)
        if len(rows) == inp.num_tokens and rows == list(range(len(rows))):
            picked = hidden
        else:
            sel = self.stager.index(rows)
            picked, top = hidden[sel], None if top is None else top[sel]
        return ForwardOutput(self.model, picked, hidden, list(aux), inp, top)

"""What a serving engine does once before its first request, so that nothing stalls running
streams later: capture every CUDA graph, run one short request through the step path, freeze
the objects alive then out of the garbage collector, and watch for Triton kernels compiled
afterwards. `Engine.generate` on an engine nothing prepared captures the graphs of its own
batches first (`prepare_on_first_use`); a speculative one on CUDA only those plain decoding
replays, decodes plainly, and captures the speculative ones after its calls (`warming.py`)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from tqdm import tqdm

from engine import jit_watch, warming
from engine.attention.triton_backend import long_context as _long_context
from engine.collector import freeze_long_lived

if TYPE_CHECKING:
    from engine.engine import Engine

log = logging.getLogger(__name__)
# The warm-up request: prompt and output tokens (greedy, EOS ignored); on CUDA the prompt is
# one whole prefill chunk where it fits (`warm_prompt_tokens`).
WARM_PROMPT_TOKENS = 24
WARM_OUTPUT_TOKENS = 8


@dataclass(frozen=True)
class Ready:
    """How long an engine took to become ready to serve, in seconds."""

    load: float  # building the engine (weights, KV cache) before it was prepared; 0: not timed
    graphs: float  # capturing CUDA graphs
    total: float  # from the start of the build to ready: load, graphs and the rest

    def __str__(self) -> str:
        return f"ready in {self.total:.1f} s (load {self.load:.1f} s, graphs {self.graphs:.1f} s)"


class Laps:
    """Host seconds each part of a build took, in order (`Engine.build_phases`); a part timed
    twice adds up."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._t = time.perf_counter()

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.seconds[name] = round(self.seconds.get(name, 0.0) + now - self._t, 3)
        self._t = now


def split_max_seqs(eng: Engine) -> int:
    """The most sequences any attention of the model (or draft head) splits keys for:
    larger buckets need no split-KV graph variant."""
    mods = list(eng.model.modules())
    if eng.spec is not None and eng.spec.head is not None:
        mods += list(eng.spec.head.modules())
    dev = torch.device(eng.config.device)
    backends = {id(b): b for b in (getattr(m, "backend", None) for m in mods) if b}
    return max((b.max_split_seqs(dev) for b in backends.values()), default=0)


def pending_graphs(eng: Engine, batch_sizes=None, long_context: bool | None = None) -> list:
    """(graph set, key) of each graph not captured yet that batches of `batch_sizes` (None:
    every bucket) would replay; none off CUDA."""
    if long_context is None:
        long_context = eng.config.max_model_len > _long_context(torch.device(eng.config.device))
    spec = eng.spec
    sets = [eng.runner.graphs, eng.runner.prefill_graphs]
    if spec is not None and spec.graphs is not None:
        k = spec.spec.num_tokens
        sets += [spec.first_graphs, spec.prefill_graphs, spec.graphs]
        sets += [spec.drafter.chain_graph(s) for s in range(1, k)]
        if spec.fused is not None:
            sets += spec.fused.all_sets()
    sets = [g for g in sets if g is not None]
    split_max = split_max_seqs(eng) if sets else 0
    for g in sets:
        g.long_max_batch = split_max
    return [(g, key) for g in sets for key in g.pending(batch_sizes, long_context)]


def capture_graphs(eng: Engine, batch_sizes=None, progress: bool = False,
                   long_context: bool | None = None) -> int:
    """`Engine.capture_graphs`: capture the graphs batches of `batch_sizes` will replay."""
    spec = eng.spec
    keys = pending_graphs(eng, batch_sizes, long_context)
    bar = tqdm(total=len(keys), disable=not progress, desc="cuda graphs", unit="graph")
    with eng.on_device(), torch.inference_mode():
        for g, key in keys:
            g.capture(*key)
            bar.update(1)
        if spec is not None and spec.fused is not None:
            spec.fused.warm_continuation()
    bar.close()
    return len(keys)


def prepare_to_serve(eng: Engine, progress: bool = False, started: float | None = None,
                     freeze: bool = True, batch_sizes=None,
                     long_context: bool | None = None, warm: bool = True) -> int:
    """`Engine.prepare_to_serve`: graphs (of `batch_sizes`, default all), a warm-up request
    (`warm`: a generate preparing itself leaves it out, as its own request follows at once),
    JIT watch and `eng.ready` once, then the garbage collector (`freeze`); on an engine
    `generate` prepared, the graphs it still lacks, speculative ones included (a warming engine
    speculates from then on, or once no request holds KV, `warming.finish`). Returns how many
    graphs were captured."""
    first = eng.ready is None
    t0 = time.perf_counter()
    n, graphs = 0, 0.0
    if eng.warming is not None:  # first its pending speculative graphs, counted as such
        n = warming.finish(eng)
    if eng.prepared_for is not None:  # `generate` captured only its batches' buckets
        eng.prepared_for = None
        n += _capture_more(eng, batch_sizes, progress, long_context)
    if first:
        with jit_watch.starting_up():
            n += eng.capture_graphs(batch_sizes, progress=progress, long_context=long_context)
            graphs = time.perf_counter() - t0
            if warm:
                warm_request(eng)
    if freeze:
        freeze_long_lived()
    if first:
        _mark_ready(eng, started, t0, graphs)
    return n


def warm_request(eng: Engine) -> bool:
    """One greedy request through the whole step path (admission, prefill, decode or
    speculative steps, output), so the first real request does not pay for what is built on
    first use (allocator pools, caches, first-call paths). Only on an idle engine, whose
    requests it would otherwise step; returns whether it ran. Its blocks are free after."""
    from engine.sequence import SamplingParams

    if eng.has_unfinished() or eng.held or eng.reserved:
        return False
    vocab = eng.config.model.vocab_size
    ids = [(7 * i + 3) % vocab for i in range(warm_prompt_tokens(eng))]
    eng.add_request(ids, SamplingParams(temperature=0, max_tokens=WARM_OUTPUT_TOKENS,
                                        ignore_eos=True))
    while eng.has_unfinished():
        eng.step()
    if eng.spec is not None:  # its first-call step times would misprice drafting
        eng.spec.policy.forget()
    return True


def warm_prompt_tokens(eng: Engine) -> int:
    """Prompt tokens of the warm-up request. On CUDA, a whole prefill chunk where the context
    limit and half the free KV blocks hold it: a chunk longer than the captured prefill graphs
    runs eagerly, with kernel variants of its own (heads per rotary program) that would
    otherwise compile while the first long prompt waits. Elsewhere WARM_PROMPT_TOKENS."""
    cfg = eng.config
    if not cfg.on_cuda:
        return WARM_PROMPT_TOKENS
    room = eng.blocks.num_free // 2 * cfg.block_size
    lookahead = cfg.spec.num_tokens + 1 if cfg.spec is not None else 0
    fits = min(cfg.max_num_batched_tokens, cfg.max_model_len - WARM_OUTPUT_TOKENS - lookahead,
               room - WARM_OUTPUT_TOKENS - lookahead)
    return max(WARM_PROMPT_TOKENS, fits)


def prepare_on_first_use(eng: Engine, batch: int) -> None:
    """`Engine.generate` with up to `batch` sequences at once: before its first step, capture
    the graphs of every bucket up to that batch, so no capture stalls the batches that follow
    and a small first call does not wait for the large buckets; a later, larger call captures
    its larger buckets the same way (`eng.prepared_for`). A speculative engine on CUDA
    captures only the graphs plain decoding replays and warms (`warming.py`): the call decodes
    plainly and the speculative graphs are captured after it. An engine prepared to serve has
    them all. The first call also sets the JIT watch and `eng.ready`. The collector is left
    alone: a process that discards engines would never free a frozen one (its cycles, its GPU
    memory)."""
    _prepare_for(eng, batch)
    if eng.warming is not None:  # the call's plain work, which earns capture time, starts
        eng.warming.call_started = time.perf_counter()


def _prepare_for(eng: Engine, batch: int) -> None:
    sizes = range(1, batch + 1)
    if eng.ready is not None:
        if eng.prepared_for is not None and batch > eng.prepared_for:
            t0 = time.perf_counter()
            n = warming.begin(eng, pending_graphs(eng, sizes)) if eng.warming is not None \
                else _capture_more(eng, sizes)
            eng.prepared_for = batch
            log.info("generate: %d more CUDA graphs, for batches of up to %d sequences, in "
                     "%.1f s", n, batch, time.perf_counter() - t0)
        return
    t0 = time.perf_counter()  # making the graph sets of the keys is preparation too
    keys = pending_graphs(eng, sizes)
    if not keys:
        jit_watch.warn_after()
        _mark_ready(eng, None, t0, 0.0)
        return
    if eng.warming is not None or warming.wanted(eng, keys):
        n = warming.begin(eng, keys)
        _mark_ready(eng, None, t0, time.perf_counter() - t0)
        eng.prepared_for = batch
        log.info("generate: the engine prepared itself on first use in %.1f s (%d CUDA graphs "
                 "of plain decoding, for batches of up to %d sequences); %d speculative graphs "
                 "wait, decoding plainly meanwhile", eng.ready.total, n, batch,
                 len(eng.warming.pending) if eng.warming else 0)
        return
    n = prepare_to_serve(eng, freeze=False, warm=False, batch_sizes=sizes)
    eng.prepared_for = batch
    log.info("generate: the engine prepared itself on first use in %.1f s (%d CUDA graphs, "
             "for batches of up to %d sequences)", eng.ready.total, n, batch)


def _capture_more(eng: Engine, batch_sizes, progress: bool = False,
                  long_context: bool | None = None) -> int:
    """The graphs of `batch_sizes` (None: every bucket) that an engine `generate` prepared for
    smaller batches still lacks, captured as start-up work: it runs before any step, so the
    compiles inside stall no stream."""
    with jit_watch.starting_up():
        return eng.capture_graphs(batch_sizes, progress=progress, long_context=long_context)


def _mark_ready(eng: Engine, started: float | None, prepared: float, graphs: float) -> None:
    """Set `eng.ready`: `started` when the engine's build began (None: not timed, only the
    preparation from `prepared` counts)."""
    now = time.perf_counter()
    start = prepared if started is None else started
    eng.ready = Ready(prepared - start, graphs, now - start)

"""The engine: add requests, `step()` (schedule → run → postprocess), offline `generate()`."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import torch

from engine import handoff, loader
from engine.attention import get_backend
from engine.attention.triton_backend import draft_attention
from engine.attention.triton_backend import long_context as _long_context
from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.cost_feed import time_step
from engine.errors import InvalidRequestError, ResourceExhaustedError
from engine.graphs import GraphSet
from engine.handoff import Handoff
from engine.model import LlamaModel
from engine.output import Completion, EngineStats, RequestOutput
from engine.plain_steps import PlainSteps
from engine.postprocess import Postprocessor
from engine.prompt import PromptEncoder
from engine.runner import ModelRunner, allocate_kv_cache
from engine.sampler import new_generator
from engine.scheduler import Batch, Scheduler
from engine.sequence import SamplingParams, Sequence
from engine.spec.lookup import token_store
from engine.spec.runtime import SpecRunner
from engine.spec.verify import VerifyResult, verify_greedy, verify_sampled_device


class Engine:
    """A paged-KV Llama-family engine. Pure compute: no Ray, gRPC or UCX here."""

    def __init__(self, config: EngineConfig, state_dict: dict[str, torch.Tensor] | None = None,
                 tokenizer: loader.Tokenizer | None = None, weights_of: Engine | None = None,
                 draft_head=None):
        """Build from HF-named `state_dict`, or share the weights of engine `weights_of`."""
        self.config = cfg = config
        m = cfg.model
        backend = get_backend(cfg.backend_name)(m.num_heads, m.num_kv_heads, m.head_dim,
                                                cfg.block_size)
        with torch.device(cfg.device):
            self.model = LlamaModel(m, backend).to(cfg.dtype)
        if weights_of is not None:
            self.model.load_state_dict(weights_of.model.state_dict(), assign=True)
            if m.tie_word_embeddings:
                self.model.lm_head.weight = self.model.embed_tokens.weight
            tokenizer = tokenizer or weights_of.tokenizer
            self.model.share_calibration(weights_of.model)
        elif state_dict is not None:
            loader.load_weights(self.model, state_dict)
        self.model.eval()
        self.num_blocks = cfg.num_blocks or self._size_cache()
        self.kv_cache = allocate_kv_cache(cfg, self.num_blocks)
        self.blocks = BlockManager(self.num_blocks, cfg.block_size, cfg.enable_prefix_caching)
        self.scheduler = Scheduler(cfg, self.blocks)
        # Token ids by KV slot, for drafting from the context on the device (lookup.py).
        self.token_store = token_store(self.num_blocks * cfg.block_size, cfg.device) \
            if cfg.spec is not None and cfg.spec.context_drafts and cfg.spec.method == "eagle3" \
            else None
        self.runner = ModelRunner(cfg, self.model, self.kv_cache, self.token_store)
        self.spec = SpecRunner(cfg, self.model, self.kv_cache, self._draft_head(draft_head),
                               self.token_store) if cfg.spec else None
        if cfg.use_cuda_graphs:
            k = cfg.spec.num_tokens if cfg.spec else 0
            self.runner.enable_graphs(min(cfg.max_num_seqs, 256), range(1, k + 2),
                                      self.spec.aux_layers if self.spec else ())
            if self.spec is not None:
                self.spec.enable_graphs(min(cfg.max_num_seqs, 256))
        # Plain greedy decodes launched one step ahead (the fused path of a no-spec engine).
        self.plain = PlainSteps(cfg, self.runner) if self.spec is None else None
        self.tokenizer = tokenizer
        self.eos_ids = set(m.eos_token_ids)
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            self.eos_ids.add(tokenizer.eos_token_id)
        self.seqs: dict[str, Sequence] = {}
        self.held: dict[str, Sequence] = {}  # prefill role: finished, blocks kept for transfer
        self.reserved: dict[str, Sequence] = {}  # decode role: blocks waiting for incoming KV
        # Optional tap for trainers: capture(seq, lo, hidden, aux) sees every computed position
        # (aux: the inputs of capture_layers side by side, [n, len(capture_layers) * h]), cast
        # to capture_dtype where set, once per step for the whole batch.
        self.capture = None
        self.capture_layers: tuple[int, ...] = ()
        self.capture_dtype: torch.dtype | None = None
        self.generators: dict[str, torch.Generator] = {}  # sampled requests' RNGs
        self.detoks: dict[str, loader.Detokenizer] = {}
        self.stats = EngineStats()
        self.clock = time.perf_counter  # step timing for the dynamic-K cost model
        self._inflight = None  # (Batch, FusedHandle): a step launched and not read yet
        self._deferred: list[Sequence] = []  # finished meanwhile: blocks freed after it
        self._carry: list[RequestOutput] = []  # outputs read outside step(), returned next
        self.admitted_in_flight = 0  # requests prefilled beside a step in flight, no drain
        self.post = Postprocessor(self)

    @classmethod
    def from_pretrained(cls, model: str | None = None, **overrides) -> Engine:
        """Load a checkpoint (None → the embedded SmolLM2-135M-Instruct) and build the engine."""
        ckpt = loader.resolve(model)
        mcfg = loader.load_config(ckpt)
        cfg = EngineConfig(model=mcfg, **overrides)
        return cls(cfg, loader.load_state_dict(ckpt, cfg.dtype), loader.Tokenizer.load(ckpt))

    def with_config(self, **overrides) -> Engine:
        """A fresh engine (own KV cache and queues) sharing this one's weights, and its
        EAGLE-3 head where the new spec names the same checkpoint (another is loaded)."""
        from dataclasses import replace

        cfg = replace(self.config, **overrides)
        mine, new = self.config.spec, cfg.spec
        same = self.spec is not None and mine is not None and new is not None \
            and new.method == "eagle3" and new.head == mine.head
        return Engine(cfg, weights_of=self, draft_head=self.spec.head if same else None)

    def _draft_head(self, given):
        """This engine's EAGLE-3 head: sharing the weights of `given`, or loaded from the spec's
        checkpoint. Either way it gets its own attention backend (block size is per engine)."""
        from engine.spec.eagle3 import Eagle3Head, load_head

        spec, m, cfg = self.config.spec, self.config.model, self.config
        if spec.method != "eagle3":
            return None

        def backend(hc):
            kind = get_backend(cfg.backend_name)
            kw = draft_attention(torch.device(cfg.device)) if kind.name == "triton" else {}
            return kind(hc.num_heads, hc.num_kv_heads, hc.head_dim, cfg.block_size, **kw)

        if given is None:
            return load_head(spec.head or loader.shipped_head(m), m, backend, cfg.dtype,
                             cfg.device)
        given.cfg.check_target(m)
        with torch.device("meta"):
            head = Eagle3Head(given.cfg, backend(given.cfg))
        head.load_state_dict(given.state_dict(), assign=True)
        head.rotary = given.rotary
        head.midlayer.self_attn.rotary = given.rotary
        return head.eval()

    def _size_cache(self) -> int:
        cfg = self.config
        budget = cfg.kv_cache_bytes
        if str(cfg.device).startswith("cuda"):
            # A share of what is free now, so engines sharing a GPU (or weights) each fit.
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

    # ---- requests -------------------------------------------------------------------------

    def encode_prompt(self, prompt: str | list[int] | list[dict]) -> list[int]:
        """Text, chat messages or token ids → validated token ids."""
        return self.prompt_encoder()(prompt)

    def prompt_encoder(self) -> PromptEncoder:
        """The same validation, as plain data a router can use without the model."""
        c = self.config
        return PromptEncoder(self.tokenizer, c.model.vocab_size, c.max_model_len, c.block_size,
                             self.num_blocks)

    def add_request(self, prompt: str | list[int] | list[dict],
                    params: SamplingParams | None = None, request_id: str | None = None,
                    hold: bool = False, max_draft: int | None = None,
                    resume: tuple[int, int] | None = None) -> str:
        """Queue a request; returns its id. Bad input raises InvalidRequestError.

        max_draft caps this request's draft tokens per step (0: no speculation).
        hold=True is the prefill role: after the first token the request stops with
        `handoff=True` and keeps its KV blocks until `release()` (see `export_handoff`).
        resume=(n, chars) continues a request that already generated the last `n` ids of
        `prompt` and streamed the first `chars` characters of their text (a stream moved off a
        worker that died): they count as output (max_tokens, usage), their text is rebuilt,
        so stop strings and held-back text carry on as if nothing had happened."""
        params = params or SamplingParams()
        if request_id is not None and (request_id in self.seqs or request_id in self.held):
            raise InvalidRequestError(f"request id {request_id!r} is already running")
        seq = Sequence(self.encode_prompt(prompt), params, request_id)
        seq.hold, seq.max_draft = hold, max_draft
        detok = self._resume(seq, *resume) if resume is not None else None
        seq.arrival_step = self.stats.steps
        self.seqs[seq.request_id] = seq
        if not params.greedy:
            self.generators[seq.request_id] = new_generator(params.seed, self.config.device)
        if self.tokenizer is not None:
            self.detoks[seq.request_id] = detok or loader.Detokenizer(self.tokenizer,
                                                                       seq.token_ids)
        self.scheduler.add(seq)
        return seq.request_id

    def _resume(self, seq: Sequence, num_output: int, emitted_chars: int
                ) -> loader.Detokenizer | None:
        """`add_request(resume=...)`: the last `num_output` ids are output already made;
        returns the request's detokenizer, past them (None without a tokenizer)."""
        if not 0 < num_output < len(seq.token_ids) or emitted_chars < 0:
            raise InvalidRequestError(f"resume: {num_output} output tokens of "
                                      f"{len(seq.token_ids)}, {emitted_chars} characters")
        if num_output >= seq.params.max_tokens:
            raise InvalidRequestError(f"resume: {num_output} output tokens already reach "
                                      f"max_tokens={seq.params.max_tokens}")
        seq.num_prompt_tokens = len(seq.token_ids) - num_output
        detok = None
        if self.tokenizer is not None:
            detok = loader.Detokenizer(self.tokenizer, seq.token_ids[: seq.num_prompt_tokens])
            seq.text = detok.step(seq.token_ids)
        seq.num_emitted_chars = min(emitted_chars, len(seq.text))
        return detok

    def abort(self, request_id: str) -> bool:
        """Cancel a request; its KV blocks are free when this returns."""
        self._carry += self._drain()  # the step in flight may still write into its blocks
        if request_id in self.held or request_id in self.reserved:
            self.release(request_id)
            return True
        seq = self.seqs.get(request_id)
        if seq is None:
            return False
        self.post.finish(seq, "cancelled")
        return True

    def has_unfinished(self) -> bool:
        """Requests still running or waiting, or outputs read by an abort's drain that the
        next `step()` has yet to return."""
        return self.scheduler.has_work() or bool(self._carry)

    # ---- the step -------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule → run → postprocess; returns what each touched request produced.

        Greedy decode steps overlap: the next step is launched from this one's device
        outputs before the host reads them (`SpecRunner.fused_continue` for EAGLE-3,
        `PlainSteps.fused_continue` without speculation), so emitting tokens, detokenizing
        and stop checks run while the GPU computes. Requests that finish drop out of the
        next launch; whenever the batch would change otherwise (a request arrives or is
        aborted) the pipeline drains first."""
        outs, self._carry = self._carry, []
        t0, captures = self.clock(), GraphSet.captures
        with self.on_device():  # kernels, graphs, streams go to this engine's GPU
            if self._inflight is not None:
                how = "overlapped"
                batch, results, more = self._step_overlapped()
            else:
                how = "fresh"
                batch = self.scheduler.schedule()
                outs += [self.post.finished_output(s) for s in batch.out_of_blocks]
                if not batch.seqs:
                    return outs
                batch, results, more = self._step_fresh(batch)
        outs += more
        # A graph captured inside would skew the cost model.
        if self.spec is not None and GraphSet.captures == captures:
            time_step(self.spec, batch, results, self.clock() - t0, how)
        return outs

    def _step_fresh(self, batch: Batch):
        if self._splits():
            dec = [i for i, (s, n) in enumerate(zip(batch.seqs, batch.num_tokens))
                   if s.greedy_decode(n)]
            if dec and len(dec) < len(batch.seqs):
                return self._step_split(batch, dec)
        pipe = self.pipe
        h = None if pipe is None else \
            pipe.fused_launch(batch, self.blocks, self.stats.steps + 1, self.capture)
        if h is None:
            fwd, results = self._run(batch)
            return batch, results, self.post.process(batch, fwd, results)
        nxt = pipe.fused_continue(h, self.blocks, self.stats.steps + 2) \
            if self._can_overlap(batch) else None
        results, drafts = pipe.fused_finish(h)
        if nxt is not None:
            self._inflight = (_entries(nxt), nxt)
        outs = self.post.process(batch, None, results, drafts)
        return batch, results, outs + self._settle()

    def _splits(self) -> bool:
        """Whether a batch mixing greedy decodes with other entries runs the decodes apart
        (`_step_split`): with speculation's fused step, or plain decode graphs."""
        if self.capture is not None:
            return False
        if self.spec is not None:
            return self.spec.fused is not None
        return self.runner.graphs is not None and not self.runner.graph_aux

    def _step_split(self, batch: Batch, dec: list[int]):
        """Greedy decodes beside entries the fused step cannot run (prefill chunks of new
        arrivals, sampled requests): the decodes still run as one fused graph (speculative,
        or a plain decode graph), the rest through the regular forward, in the same engine
        step. Under a steady stream of arrivals this keeps decoding on the graph path instead
        of running every decode through the eager forward of a mixed batch."""
        pick = set(dec)
        d = batch.select(dec)
        r = batch.select([i for i in range(len(batch)) if i not in pick])
        h = self.pipe.fused_launch(d, self.blocks, self.stats.steps + 1)
        fwd, results = self._run(r)  # queued behind the fused graph; its sync covers both
        outs = self.post.process(r, fwd, results)
        if h is not None:
            res_d, drafts = self.pipe.fused_finish(h)
            outs += self.post.process(d, None, res_d, drafts, count_step=False)
        else:  # no graph for the decodes' shape: the regular forward
            fwd, res_d = self._run(d)
            outs += self.post.process(d, fwd, res_d, count_step=False)
        return batch, {}, outs

    @property
    def pipe(self):
        """What launches, continues and reads one-graph decode steps: the speculative
        runner, or `PlainSteps` without speculation."""
        return self.spec if self.spec is not None else self.plain

    def _step_overlapped(self):
        batch, h = self._inflight
        # Requests that finished while h was in flight drop out here: the next step continues
        # the others from h's outputs, and h's rows of theirs are read and discarded.
        # Requests prefilled beside h join it (`_joining`), and requests due to be admitted
        # are prefilled beside it (`_admit_beside`); anything else drains the pipeline.
        keep = _unfinished(batch)
        live = batch.select(keep)
        join = self._joining(live) if keep else None
        nxt = pre = None
        if join is not None:
            due = self._admission_due()
            # The prefill goes on the stream before the continuation, so reading it waits
            # for h and itself, not for the step launched next.
            pre = self._admit_beside(h) if due else None
            if pre is not None or not due:
                nxt = self.pipe.fused_continue(h, self.blocks, self.stats.steps + 2,
                                               keep if len(keep) < len(batch.seqs) else None,
                                               join.seqs)
            if pre is not None and nxt is not None:
                nxt.protect()  # the head's step after the prefill replays graphs of its pool
        if nxt is None:
            outs = self._drain()
            results = {}
        else:
            results, drafts = self._read(h, keep)
            self._inflight = (_entries(nxt), nxt)
            outs = self.post.process(live, None, results, drafts)
        if pre is not None:  # its step mixed in a prefill: not one the cost model prices
            outs += self._read_beside(*pre)
            results = {}
        return live, results, outs + self._settle()

    def _can_overlap(self, batch: Batch) -> bool:
        """The next step may be launched before this one is read: overlap is on, no request
        waits to be admitted, and the running set is exactly this batch (`_joining`: nothing
        beside it)."""
        if self._admission_due():
            return False
        join = self._joining(batch)
        return join is not None and not join.seqs

    def _admission_due(self) -> bool:
        """Whether waiting requests stop the overlap now, to be admitted by the fresh step
        after the drain: when there is room for them (a full batch admits nobody, so they
        wait without costing the pipeline) and enough of them wait, or the oldest has waited
        `admission_delay_steps` steps (`EngineConfig.admission_share`: at 32+ running
        sequences a few arrivals share one drain; below, each is admitted at once)."""
        sch, cfg = self.scheduler, self.config
        if not sch.waiting or len(sch.running) >= cfg.max_num_seqs:
            return False
        if cfg.admission_delay_steps <= 0 or \
                len(sch.waiting) >= max(1, len(sch.running) // cfg.admission_share):
            return True
        oldest = min(s.arrival_step for s in sch.waiting)
        return self.stats.steps - oldest >= cfg.admission_delay_steps

    def _settle(self) -> list[RequestOutput]:
        """After reading a step while the next is in flight: drain if the running set
        changed other than by requests finishing (those the next step leaves out,
        `_step_overlapped`) or being prefilled to join it, or if requests are due to be
        admitted that cannot be prefilled beside it."""
        if self._inflight is None:
            return []
        live = self._inflight[0].select(_unfinished(self._inflight[0]))
        if not live.seqs or self._joining(live) is None or \
                (self._admission_due() and not self._admits_beside()):
            return self._drain()
        return []

    def _joining(self, live: Batch) -> Batch | None:
        """The running requests besides `live` (the unfinished entries of the step in
        flight), as the entries they join its continuation with: requests prefilled beside
        it, each one greedy pending token plus its drafts. None when the running set differs
        from `live` in any other way (then the pipeline drains)."""
        if not self.config.overlap or self.capture is not None:
            return None
        run, n = self.scheduler.running, len(live.seqs)
        if len(run) < n or any(a is not b for a, b in zip(run, live.seqs)):
            return None
        join = Batch()
        for s in run[n:]:
            if not s.greedy_decode(1 + len(s.draft)):
                return None
            join.add(s, 1 + len(s.draft))
        return join

    def _beside_ok(self, seq: Sequence) -> bool:
        """Whether a waiting request may be prefilled beside a decode step in flight: a
        greedy request that decodes here (sampled ones and hand-offs take the drain)."""
        return seq.params.greedy and not seq.hold and \
            seq.num_pending <= self.config.max_num_batched_tokens

    def _admits_beside(self) -> bool:
        """Whether the next waiting request can be prefilled beside the step in flight."""
        sch = self.scheduler
        return self.config.admit_in_flight and bool(sch.waiting) and \
            self._beside_ok(sch.waiting[0]) and self._splits()

    def _admit_beside(self, h):
        """Admit the waiting requests that can be prefilled whole beside the step in flight
        `h` (`_beside_ok`, their KV blocks free) and launch their prefill without waiting for
        it: (batch, forward, read) for `_read_beside`, or None (drain and admit instead)."""
        if not self._admits_beside():
            return None
        r = self.scheduler.admit_whole(self.config.max_num_batched_tokens, self._beside_ok)
        if not r.seqs:
            return None
        # Graphs share memory pools: the prefill's scratch may be where h's outputs live,
        # which the continuation after it reads.
        h.protect()
        self.admitted_in_flight += len(r.seqs)
        return (r, *self._run(r, defer=True))

    def _read_beside(self, batch: Batch, fwd, read) -> list[RequestOutput]:
        """Read a prefill launched beside a step in flight and postprocess it: the first
        token, and (speculation) the head's step over the prompt, which keeps its KV, but no
        drafts. The requests then join the next continuation (`_joining`) at their pending
        token alone, and that fused step chooses their drafts with everyone's. Drafting here
        would read the drafts back to the host, which waits for the step launched after the
        one in flight as well: every arrival would stall the pipeline for a step (under
        steady load at 64 streams, nearly every step)."""
        return self.post.process(batch, fwd, read(), count_step=False, draft=False)

    def _drain(self) -> list[RequestOutput]:
        """Read the step in flight, free the blocks of requests that finished meanwhile (it
        may have written into them), and postprocess the requests still running."""
        if self._inflight is None:
            return []
        batch, h = self._inflight
        self._inflight = None
        keep = _unfinished(batch)
        results, drafts = self._read(h, keep)
        if not keep:
            return []
        return self.post.process(batch.select(keep), None, results, drafts)

    def _read(self, h, keep: list[int]) -> tuple[dict, dict]:
        """Wait for the launched step h; free the blocks of requests that finished while it
        was in flight (it was the last step to write into them); return its results and
        drafts for the entries `keep`, renumbered in that order."""
        results, drafts = self.pipe.fused_finish(h)
        for seq in self._deferred:
            self.blocks.release(seq)
        self._deferred = []
        return ({j: results[i] for j, i in enumerate(keep)},
                {j: drafts[i] for j, i in enumerate(keep)})

    def _split_max_seqs(self) -> int:
        """The most sequences any attention of the model (or draft head) splits keys for:
        larger buckets need no split-KV graph variant."""
        mods = list(self.model.modules())
        if self.spec is not None and self.spec.head is not None:
            mods += list(self.spec.head.modules())
        dev = torch.device(self.config.device)
        backends = {id(b): b for b in (getattr(m, "backend", None) for m in mods) if b}
        return max((b.max_split_seqs(dev) for b in backends.values()), default=0)

    def capture_graphs(self, batch_sizes=None, progress: bool = False,
                       long_context: bool | None = None) -> int:
        """Capture now every decode/verify/draft/prefill graph that batches of `batch_sizes`
        (default: every bucket) will replay, instead of lazily in the middle of serving;
        returns how many were captured. `long_context` (default: when max_model_len allows
        contexts past `long_context`) adds the split-KV variants a batch switches to once a
        context passes that length, so the first long request does not stall every stream
        of its batch for a capture."""
        if long_context is None:
            long_context = self.config.max_model_len > _long_context(torch.device(
                self.config.device))
        sets = [self.runner.graphs, self.runner.prefill_graphs]
        if self.spec is not None and self.spec.graphs is not None:
            k = self.spec.spec.num_tokens
            sets += [self.spec.first_graphs, self.spec.prefill_graphs, self.spec.graphs]
            sets += [self.spec._chain_graph(s) for s in range(1, k)]
            if self.spec.fused is not None:
                sets += self.spec.fused.all_sets()
        sets = [g for g in sets if g is not None]
        split_max = self._split_max_seqs()
        for g in sets:
            g.long_max_batch = split_max
        keys = [(g, key) for g in sets for key in g.pending(batch_sizes, long_context)]
        bar = _progress(len(keys), progress, "cuda graphs", "graph")
        with self.on_device(), torch.inference_mode():
            for g, key in keys:
                g.capture(*key)
                bar.update(1)
            if self.spec is not None and self.spec.fused is not None:
                self.spec.fused.warm_continuation()
        bar.close()
        return len(keys)

    def prepare_to_serve(self, progress: bool = False) -> int:
        """What a serving process does once before its first request: capture every graph
        (`capture_graphs`; CUDA only), exempt the objects alive then from the garbage
        collector (`collector.freeze_long_lived`), and from then on log each Triton kernel
        compiled (`jit_watch.warn_after`): either would otherwise stall running streams.
        Returns how many graphs were captured."""
        from engine import jit_watch
        from engine.collector import freeze_long_lived

        n = self.capture_graphs(progress=progress)
        freeze_long_lived()
        jit_watch.warn_after()
        return n

    def on_device(self):
        """A context where kernels, graphs and streams go to this engine's GPU."""
        dev = torch.device(self.config.device)
        return torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext()

    def _run(self, batch: Batch, defer: bool = False):
        """Forward the batch; for entries whose tokens are all computed now, verify their
        drafts (none: plain sampling) against the target's logits. Greedy and sampled entries
        alike stay on the device until one host sync reads the whole batch's results.
        `defer`: start copying the results to the host and return (forward, read) without
        waiting; read() waits and gives the results (work launched meanwhile is not waited
        for)."""
        done, rows, ks, end = [], [], [], 0
        for i, (s, n) in enumerate(zip(batch.seqs, batch.num_tokens)):
            end += n
            if s.num_computed + n >= len(s):
                k = s.num_computed + n - len(s)  # drafts riding in this entry
                done.append(i)
                ks.append(k)
                rows.extend(range(end - k - 1, end))
        aux = self.spec.aux_layers if self.spec else self.capture_layers
        # Deferred: beside a step in flight, whose decode-graph outputs the next step reads.
        fwd = self.runner.forward(batch, rows, aux_layers=aux, decode_graphs=not defer)
        parts, sampled, r = [fwd.argmax], [], 0
        for i, k in zip(done, ks):
            seq = batch.seqs[i]
            if not seq.params.greedy:
                x = self.runner.stager.index(seq.draft[:k])
                q = seq.draft_q[:k] if seq.draft_q is not None and k else None
                n, tok = verify_sampled_device(x, q, fwd.logits[r : r + k + 1], seq.params,
                                               self.generators[seq.request_id])
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
            fetch = self.runner.stager.fetch(flat)
            return fwd, lambda: read(fetch())
        return fwd, read(flat.tolist())  # the sync

    # ---- disaggregation: the prefill side holds, the decode side reserves and admits -----

    def export_handoff(self, request_id: str) -> Handoff:
        """Everything but the KV blocks that a decode engine needs to continue the request."""
        return handoff.export(self, request_id)

    def held_blocks(self, request_id: str) -> list[int]:
        """The KV blocks of a request held for its hand-off."""
        return list(self.held[request_id].block_table)

    def reserve(self, request_id: str, num_tokens: int) -> list[int]:
        """Set aside blocks for `num_tokens` tokens of KV about to arrive; returns their ids."""
        return handoff.reserve(self, request_id, num_tokens)

    def admit(self, h: Handoff) -> None:
        """Start decoding a request whose KV has landed in its reserved blocks."""
        handoff.admit(self, h)

    def release(self, request_id: str) -> None:
        """Free a held (prefill) or reserved (decode) request's blocks."""
        handoff.release(self, request_id)

    # ---- offline use -----------------------------------------------------------------------

    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool | str = False) -> list[Completion]:
        """Run prompts to completion with continuous batching; results in input order.
        `use_tqdm`: a progress bar (a string: the bar's label)."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        plist = params if isinstance(params, list) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise InvalidRequestError("one SamplingParams per prompt, or a single one")
        seqs = {}
        for p, sp in zip(prompts, plist):
            rid = self.add_request(p, sp)
            seqs[rid] = self.seqs[rid]
        bar = _progress(len(seqs), bool(use_tqdm),
                        use_tqdm if isinstance(use_tqdm, str) else "generate")
        while any(not s.finished for s in seqs.values()):
            for out in self.step():
                if out.finished and out.request_id in seqs:
                    bar.update(1)
        bar.close()
        return [Completion(rid, s.token_ids[: s.num_prompt_tokens], s.output_ids, s.text,
                           s.finish_reason, s.num_cached_tokens, s.num_accepted,
                           s.num_verify_steps) for rid, s in seqs.items()]

    def stream(self, prompt, params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Generate one request, yielding its outputs as they come (other requests keep going)."""
        rid = self.add_request(prompt, params)
        while True:
            for out in self.step():
                if out.request_id == rid:
                    yield out
                    if out.finished:
                        return


def _unfinished(batch: Batch) -> list[int]:
    """Indices of the batch's entries whose requests are still running."""
    return [i for i, s in enumerate(batch.seqs) if not s.finished]


def _entries(h) -> Batch:
    """The batch a launched fused step computes: each sequence's pending token + drafts."""
    return Batch(list(h.seqs), [1 + k for k in h.kcur])


def _progress(total: int, enabled: bool, desc: str = "generate", unit: str = "req"):
    from tqdm import tqdm

    return tqdm(total=total, disable=not enabled, desc=desc, unit=unit)

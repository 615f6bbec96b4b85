"""The engine: add requests, `step()` (schedule → run → postprocess), offline `generate()`."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from dataclasses import replace

import torch
from tqdm import tqdm

from engine import handoff, loader, warming, warmup
from engine.attention import get_backend
from engine.attention.triton_backend import draft_attention
from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.errors import InvalidRequestError
from engine.handoff import Handoff
from engine.model import LlamaModel
from engine.output import Completion, EngineStats, RequestOutput
from engine.overlap import Overlap
from engine.plain_steps import PlainSteps
from engine.postprocess import Postprocessor
from engine.prompt import PromptEncoder, is_one_prompt
from engine.runner import ModelRunner, allocate_kv_cache, cache_blocks
from engine.sampler import new_generator
from engine.scheduler import Scheduler
from engine.sequence import SamplingParams, Sequence, integer
from engine.spec.lookup import compile_store_ahead, needs_token_store, token_store
from engine.spec.runtime import SpecRunner
from engine.step import Stepper
from engine.tokenizer import Detokenizer

log = logging.getLogger("tandem.engine")


class Engine:
    """A paged-KV Llama-family engine. Pure compute: no Ray, gRPC or UCX here.

    Its parts: `scheduler` over `blocks` (what runs next, where its KV lives), `runner`
    (forward and verify), `spec` or `plain` (one-graph decode steps), `stepper` and
    `overlap` (the step pipeline), `post` (what a step's results become)."""

    def __init__(self, config: EngineConfig, state_dict: dict[str, torch.Tensor] | None = None,
                 tokenizer: loader.Tokenizer | None = None, weights_of: Engine | None = None,
                 draft_head=None):
        """Build from HF-named `state_dict`, or share the weights of engine `weights_of`."""
        self.config = cfg = config
        m = cfg.model
        laps = warmup.Laps()  # where the build's time goes (figure 7 reports it)
        backend = get_backend(cfg.backend_name)(m.num_heads, m.num_kv_heads, m.head_dim,
                                                cfg.block_size, deterministic=cfg.deterministic)
        # Weights given (loaded or shared) are assigned: none are drawn at random first.
        self.model = LlamaModel.build(m, backend, cfg.device, cfg.dtype,
                                      init=state_dict is None and weights_of is None)
        if weights_of is not None:
            self.model.load_state_dict(weights_of.model.state_dict(), assign=True)
            if m.tie_word_embeddings:
                self.model.lm_head.weight = self.model.embed_tokens.weight
            tokenizer = tokenizer or weights_of.tokenizer
            self.model.share_calibration(weights_of.model)
        elif state_dict is not None:
            loader.load_weights(self.model, state_dict, cfg.device)
        self.model.eval()
        laps.lap("model")  # on CUDA: the device's start, the weights' copy
        self.num_blocks = cfg.num_blocks or cache_blocks(cfg)
        self.kv_cache = allocate_kv_cache(cfg, self.num_blocks)
        self.blocks = BlockManager(self.num_blocks, cfg.block_size, cfg.enable_prefix_caching)
        self.scheduler = Scheduler(cfg, self.blocks)
        # Token ids by KV slot, for drafting from the context on the device (lookup.py).
        self.token_store = token_store(self.num_blocks * cfg.block_size, cfg.device) \
            if needs_token_store(cfg.spec) else None
        laps.lap("kv_cache")
        self.runner = ModelRunner(cfg, self.model, self.kv_cache, self.token_store)
        self.spec = SpecRunner(cfg, self.model, self.kv_cache,
                               engine_draft_head(cfg, self.model, draft_head),
                               self.token_store) if cfg.spec else None
        laps.lap("runners")
        if cfg.use_cuda_graphs:
            k = cfg.spec.num_tokens if cfg.spec else 0
            self.runner.enable_graphs(min(cfg.max_num_seqs, 256), range(1, k + 2),
                                      self.spec.aux_layers if self.spec else (), laps)
            if self.spec is not None:
                self.spec.enable_graphs(min(cfg.max_num_seqs, 256))
            laps.lap("graph_sets")
        # Plain greedy decodes launched one step ahead (the fused path of a no-spec engine,
        # and of a speculative one while it warms).
        self.plain = PlainSteps(cfg, self.runner)
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
        self.detoks: dict[str, Detokenizer] = {}  # per request, with a tokenizer
        self.stats = EngineStats()
        self.ready: warmup.Ready | None = None  # set once prepared (`prepare_to_serve`)
        # Largest batch `generate` captured graphs for (None: prepared to serve, or not yet).
        self.prepared_for: int | None = None
        self.warming: warming.Warming | None = None  # set: plain decoding, spec graphs pending
        self.clock = time.perf_counter  # step timing for the dynamic-K cost model
        self._carry: list[RequestOutput] = []  # outputs read outside step(), returned next
        self.admitted_in_flight = 0  # requests prefilled beside a step in flight, no drain
        self.stepper = Stepper(self)
        self.overlap = Overlap(self)
        self.post = Postprocessor(self)
        laps.lap("rest")
        self.build_phases = laps.seconds  # host seconds (`from_pretrained` adds read_weights)

    @classmethod
    def from_pretrained(cls, model: str | None = None, **overrides) -> Engine:
        """Load a checkpoint (None → the embedded SmolLM2-135M-Instruct) and build the engine."""
        t0 = time.perf_counter()
        src = loader.Source(loader.resolve(model))  # a GGUF is parsed here, once
        cfg = EngineConfig(model=src.config(), **overrides)
        if needs_token_store(cfg.spec):  # compiles while the weights load
            compile_store_ahead(cfg.device)
        state, tokenizer = src.state_dict(cfg.dtype), src.tokenizer()
        read = round(time.perf_counter() - t0, 3)
        eng = cls(cfg, state, tokenizer)
        eng.build_phases = {"read_weights": read, **eng.build_phases}
        return eng

    def with_config(self, **overrides) -> Engine:
        """A fresh engine (own KV cache and queues) sharing this one's weights, and its
        EAGLE-3 head where the new spec names the same checkpoint (another is loaded)."""
        cfg = replace(self.config, **overrides)
        mine, new = self.config.spec, cfg.spec
        same = self.spec is not None and mine is not None and new is not None \
            and new.method == "eagle3" and new.head == mine.head
        return Engine(cfg, weights_of=self, draft_head=self.spec.head if same else None)

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
        resume=(n, chars) continues a stream moved off a dead worker: the last `n` ids of `prompt`
        were already generated and their first `chars` characters streamed; they count as output
        (max_tokens, usage) and their text is rebuilt, so stop strings and held-back text carry
        on unchanged."""
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"params must be a SamplingParams, got {params!r:.80}")
        if max_draft is not None:  # (a bad one, kept, broke every later step)
            max_draft = integer("max_draft", max_draft)
            if max_draft < 0:
                raise InvalidRequestError(f"max_draft must be >= 0, got {max_draft}")
        if request_id is not None and (request_id in self.seqs or request_id in self.held
                                       or request_id in self.reserved):
            raise InvalidRequestError(f"request id {request_id!r} is already running")
        seq = Sequence(self.encode_prompt(prompt), params, request_id)
        seq.hold, seq.max_draft = hold, max_draft
        detok = self._resume(seq, *resume) if resume is not None else None
        seq.arrival_step = self.stats.steps
        gen = None if params.greedy else new_generator(params.seed, self.config.device)
        if self.tokenizer is not None:
            detok = detok or Detokenizer(self.tokenizer, seq.token_ids)
        self.seqs[seq.request_id] = seq  # (from here on nothing fails: it is all registered)
        if gen is not None:
            self.generators[seq.request_id] = gen
        if detok is not None:
            self.detoks[seq.request_id] = detok
        self.scheduler.add(seq)
        return seq.request_id

    def _resume(self, seq: Sequence, num_output: int, emitted_chars: int
                ) -> Detokenizer | None:
        """`add_request(resume=...)`: the last `num_output` ids are output already made;
        returns the request's detokenizer, past them (None without a tokenizer)."""
        if not 0 < num_output < len(seq.token_ids) or emitted_chars < 0:
            raise InvalidRequestError(f"resume: {num_output} output tokens of "
                                      f"{len(seq.token_ids)}, {emitted_chars} characters")
        if num_output >= seq.params.max_tokens:
            raise InvalidRequestError(f"resume: {num_output} output tokens already reach "
                                      f"max_tokens={seq.params.max_tokens}")
        seq.num_prompt_tokens = len(seq.token_ids) - num_output
        ends = set(seq.params.stop_token_ids) | set(() if seq.params.ignore_eos else self.eos_ids)
        if ended := [t for t in seq.token_ids[seq.num_prompt_tokens :] if t in ends]:
            raise InvalidRequestError(f"resume: the output holds a stop token ({ended[0]}): "
                                      "the stream it continues had finished")
        detok = None
        if self.tokenizer is not None:
            detok = Detokenizer(self.tokenizer, seq.token_ids[: seq.num_prompt_tokens])
            seq.text = detok.step(seq.token_ids)
            if hit := next((s for s in seq.params.stop if s and s in seq.text), None):
                raise InvalidRequestError(f"resume: the output holds the stop string {hit!r}: "
                                          "the stream it continues had finished")
        seq.num_emitted_chars = min(emitted_chars, len(seq.text))
        return detok

    def abort(self, request_id: str) -> bool:
        """Cancel a request; its KV blocks are free when this returns."""
        self._carry += self.overlap.drain()  # the step in flight may still write into its blocks
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

    # ---- the step ---------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule → run → postprocess; returns what each touched request produced.

        Greedy decode steps overlap: the next step is launched from this one's device
        outputs before the host reads them, so emitting tokens, detokenizing and stop checks
        run while the GPU computes (`engine/step.py`, `engine/overlap.py`)."""
        outs, self._carry = self._carry, []
        return outs + self.stepper.step()

    @property
    def pipe(self):
        """What launches, continues and reads one-graph decode steps: the speculative
        runner, or `PlainSteps` without speculation or while it warms."""
        return self.plain if self.spec is None or self.warming is not None else self.spec

    @property
    def aux_layers(self) -> tuple[int, ...]:
        """The layers whose inputs a forward also returns: the EAGLE-3 head's, or the
        capture tap's."""
        return self.spec.aux_layers if self.spec is not None else self.capture_layers

    def set_tap(self, capture, layers: tuple[int, ...] = (), dtype: torch.dtype | None = None):
        """Set the trainers' capture tap (None: clear it): `capture(seq, lo, hidden, aux)` with
        the inputs of `layers` as aux, cast to `dtype`. A graph returns only the aux layers it
        was built with, so an engine without speculation switches to graph sets built for
        `layers`: tapped steps replay graphs instead of running eagerly."""
        layers = tuple(layers) if capture is not None else ()
        self.capture, self.capture_layers, self.capture_dtype = capture, layers, dtype
        if self.spec is None:
            self.runner.graphs_for(layers)

    def on_device(self):
        """A context where kernels, graphs and streams go to this engine's GPU."""
        dev = torch.device(self.config.device)
        return torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext()

    def capture_graphs(self, batch_sizes=None, progress: bool = False,
                       long_context: bool | None = None) -> int:
        """Capture now every decode/verify/draft/prefill graph that batches of `batch_sizes`
        (default: every bucket) will replay, rather than lazily mid-serving; returns how many were
        captured. `long_context` (default: when max_model_len allows it) adds the split-KV variants
        used past that context length, so the first long request does not stall its batch."""
        return warmup.capture_graphs(self, batch_sizes, progress, long_context)

    def prepare_to_serve(self, progress: bool = False, started: float | None = None,
                         batch_sizes=None, long_context: bool | None = None) -> int:
        """What a serving process does once before its first request: capture every graph
        (`capture_graphs`; CUDA only), run one request (`warmup.warm_request`, on an
        idle engine), exempt the objects alive then from the garbage
        collector (`collector.freeze_long_lived`), and from then on log and count each Triton
        kernel compiled (`jit_watch.warn_after`): either would otherwise stall running streams.
        Sets `ready` (`started`: `time.perf_counter()` when the build began, so its load
        counts). `batch_sizes` / `long_context`: only those graphs (`capture_graphs`), for a
        caller that knows its batches. Returns how many graphs were captured; a second call
        captures nothing."""
        return warmup.prepare_to_serve(self, progress, started, batch_sizes=batch_sizes,
                                       long_context=long_context)

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
        `use_tqdm`: a progress bar (a string: the bar's label). First, the graphs its batches
        replay that nothing captured yet (`warmup.prepare_on_first_use`); after, a warming
        engine's share of its speculative graphs (`warming.after_generate`)."""
        if prompts is None or isinstance(prompts, int):
            raise InvalidRequestError(f"prompts must be a prompt or a list of them, got "
                                      f"{prompts!r}")
        prompts = [prompts] if is_one_prompt(prompts) else list(prompts)
        plist = params if isinstance(params, list | tuple) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise InvalidRequestError("one SamplingParams per prompt, or a single one")
        running = len(prompts) + sum(not s.finished for s in self.seqs.values())
        warmup.prepare_on_first_use(self, min(running, self.config.max_num_seqs))
        seqs: dict[str, Sequence] = {}
        try:  # a bad prompt, an interrupt or a fault: none of this call's requests stay behind
            for p, sp in zip(prompts, plist):
                rid = self.add_request(p, sp)
                seqs[rid] = self.seqs[rid]
            bar = tqdm(total=len(seqs), disable=not use_tqdm, unit="req",
                       desc=use_tqdm if isinstance(use_tqdm, str) else "generate")
            while any(not s.finished for s in seqs.values()):
                for out in self.step():
                    if out.finished and out.request_id in seqs:
                        bar.update(1)
            bar.close()
        except BaseException:
            self._abort_quietly([rid for rid, s in seqs.items() if not s.finished])
            raise
        warming.after_generate(self)
        return [Completion(rid, s.token_ids[: s.num_prompt_tokens], s.output_ids, s.text,
                           s.finish_reason, s.num_cached_tokens, s.num_accepted,
                           s.num_verify_steps) for rid, s in seqs.items()]

    def stream(self, prompt, params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Generate one request, yielding its outputs as they come (other requests keep going).
        Leaving the loop early (break, close) aborts the request, so close it on the thread
        that steps the engine; aborted meanwhile, it ends with a last, empty output."""
        rid = self.add_request(prompt, params)
        seq = self.seqs[rid]
        try:
            while True:
                for out in self.step():
                    if out.request_id == rid:
                        yield out
                        if out.finished:
                            return
                # finished with no output left to come (an output held for the next step
                # is `_carry`'s): aborted, which emits nothing for it
                if seq.finished and all(o.request_id != rid for o in self._carry):
                    yield RequestOutput(rid, [], "", True, seq.finish_reason,
                                        seq.num_prompt_tokens, seq.num_output_tokens,
                                        seq.num_cached_tokens, seq.num_accepted)
                    return
        finally:
            if not seq.finished:
                self._abort_quietly([rid])

    def _abort_quietly(self, rids: list[str]) -> None:
        """Abort `rids` while an error propagates: a second error must not hide the first."""
        for rid in rids:
            try:
                self.abort(rid)
            except Exception:  # noqa: BLE001 - the original error is what the caller sees
                log.exception("aborting %s after an error", rid)


def engine_draft_head(cfg: EngineConfig, model, given):
    """An engine's EAGLE-3 head: sharing the weights of `given`, or loaded from the spec's
    checkpoint. Either way it gets its own attention backend (block size is per engine)."""
    from engine.spec.eagle3 import Eagle3Head, load_head

    spec, m = cfg.spec, cfg.model
    if spec.method != "eagle3":
        return None

    def backend(hc):
        kind = get_backend(cfg.backend_name)
        kw = draft_attention(torch.device(cfg.device)) if kind.name == "triton" else {}
        return kind(hc.num_heads, hc.num_kv_heads, hc.head_dim, cfg.block_size, **kw)

    if given is None:
        return load_head(spec.head or loader.shipped_head(m), m, backend, cfg.dtype,
                         cfg.device, target_model=model)
    given.cfg.check_target(m)
    with torch.device("meta"):
        head = Eagle3Head(given.cfg, backend(given.cfg))
    head.load_state_dict(given.state_dict(), assign=True)
    head.rotary = given.rotary
    head.midlayer.self_attn.rotary = given.rotary
    return head.eval()

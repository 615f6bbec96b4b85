"""The engine: add requests, `step()` (schedule → run → postprocess), offline `generate()`."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from engine import loader
from engine.attention import get_backend
from engine.block_manager import BlockManager
from engine.config import EngineConfig, ModelConfig
from engine.errors import InvalidRequestError, ResourceExhaustedError
from engine.model import LlamaModel
from engine.runner import ModelRunner, allocate_kv_cache
from engine.sampler import Sampler, new_generator
from engine.scheduler import Batch, Scheduler
from engine.sequence import SamplingParams, Sequence


@dataclass
class RequestOutput:
    """What one step produced for one request: the new tokens and text delta."""

    request_id: str
    token_ids: list[int]
    text: str
    finished: bool = False
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0


@dataclass
class Completion:
    """A finished request as `generate()` returns it."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    cached_tokens: int = 0


@dataclass
class EngineStats:
    steps: int = 0
    prefill_tokens: int = 0  # prompt tokens computed (prefix-cache hits excluded)
    decode_tokens: int = 0
    generated_tokens: int = 0
    finished: dict[str, int] = field(default_factory=dict)


class Engine:
    """A paged-KV Llama-family engine. Pure compute: no Ray, gRPC or UCX here."""

    def __init__(self, config: EngineConfig, state_dict: dict[str, torch.Tensor] | None = None,
                 tokenizer: loader.Tokenizer | None = None, weights_of: Engine | None = None):
        """Build from HF-named `state_dict`, or share the weights of engine `weights_of`."""
        self.config = cfg = config
        m = cfg.model
        backend = get_backend(cfg.attention_backend)(m.num_heads, m.num_kv_heads, m.head_dim,
                                                    cfg.block_size)
        with torch.device(cfg.device):
            self.model = LlamaModel(m, backend).to(cfg.dtype)
        if weights_of is not None:
            self.model.load_state_dict(weights_of.model.state_dict(), assign=True)
            if m.tie_word_embeddings:
                self.model.lm_head.weight = self.model.embed_tokens.weight
            tokenizer = tokenizer or weights_of.tokenizer
        elif state_dict is not None:
            loader.load_weights(self.model, state_dict)
        self.model.eval()
        self.num_blocks = cfg.num_blocks or self._size_cache()
        self.kv_cache = allocate_kv_cache(cfg, self.num_blocks)
        self.blocks = BlockManager(self.num_blocks, cfg.block_size, cfg.enable_prefix_caching)
        self.scheduler = Scheduler(cfg, self.blocks)
        self.runner = ModelRunner(cfg, self.model, self.kv_cache)
        self.sampler = Sampler()
        self.tokenizer = tokenizer
        self.eos_ids = set(m.eos_token_ids)
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            self.eos_ids.add(tokenizer.eos_token_id)
        self.seqs: dict[str, Sequence] = {}
        self._generators: dict[str, torch.Generator] = {}
        self._detok: dict[str, loader.Detokenizer] = {}
        self.stats = EngineStats()

    @classmethod
    def from_pretrained(cls, model: str | None = None, **overrides) -> Engine:
        """Load a checkpoint (None → the embedded SmolLM2-135M-Instruct) and build the engine."""
        ckpt = loader.resolve(model)
        mcfg = loader.load_config(ckpt)
        cfg = EngineConfig(model=mcfg, **overrides)
        return cls(cfg, loader.load_state_dict(ckpt, cfg.dtype), loader.Tokenizer.load(ckpt))

    def with_config(self, **overrides) -> Engine:
        """A fresh engine (own KV cache and queues) sharing this one's weights."""
        from dataclasses import replace

        return Engine(replace(self.config, **overrides), weights_of=self)

    def _size_cache(self) -> int:
        cfg = self.config
        budget = cfg.kv_cache_bytes
        if str(cfg.device).startswith("cuda"):
            free, total = torch.cuda.mem_get_info(cfg.device)
            budget = int(free - total * (1 - cfg.gpu_memory_utilization))
        n = budget // cfg.kv_bytes_per_block
        need = -(-cfg.max_model_len // cfg.block_size)
        if n < need:
            raise ResourceExhaustedError(
                f"KV budget holds {n} blocks of {cfg.block_size} tokens, fewer than one "
                f"max_model_len={cfg.max_model_len} context needs ({need})")
        return n

    # ---- requests -------------------------------------------------------------------------

    def encode_prompt(self, prompt: str | list[int] | list[dict]) -> list[int]:
        """Text, chat messages or token ids → validated token ids."""
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt is empty")
            ids = self._require_tokenizer().encode(prompt)
        elif prompt and isinstance(prompt[0], dict):
            ids = self._require_tokenizer().apply_chat(list(prompt))
        else:
            ids = [int(t) for t in prompt]
        if not ids:
            raise InvalidRequestError("prompt is empty")
        vocab = self.config.model.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            raise InvalidRequestError(f"prompt token ids must be in [0, {vocab})")
        if len(ids) >= self.config.max_model_len:
            raise InvalidRequestError(
                f"prompt has {len(ids)} tokens; the context holds {self.config.max_model_len} "
                "(prompt plus at least one generated token)")
        if -(-(len(ids) + 1) // self.config.block_size) > self.num_blocks:
            raise ResourceExhaustedError(f"prompt of {len(ids)} tokens exceeds the KV cache")
        return ids

    def add_request(self, prompt: str | list[int] | list[dict],
                    params: SamplingParams | None = None, request_id: str | None = None) -> str:
        """Queue a request; returns its id. Bad input raises InvalidRequestError."""
        params = params or SamplingParams()
        if request_id is not None and request_id in self.seqs:
            raise InvalidRequestError(f"request id {request_id!r} is already running")
        seq = Sequence(self.encode_prompt(prompt), params, request_id)
        seq.arrival_step = self.stats.steps
        self.seqs[seq.request_id] = seq
        if not params.greedy:
            self._generators[seq.request_id] = new_generator(params.seed)
        if self.tokenizer is not None:
            self._detok[seq.request_id] = loader.Detokenizer(self.tokenizer, seq.token_ids)
        self.scheduler.add(seq)
        return seq.request_id

    def _require_tokenizer(self) -> loader.Tokenizer:
        if self.tokenizer is None:
            raise InvalidRequestError("this engine has no tokenizer: send token ids")
        return self.tokenizer

    def abort(self, request_id: str) -> bool:
        """Cancel a request; its KV blocks are free when this returns."""
        seq = self.seqs.get(request_id)
        if seq is None:
            return False
        self._finish(seq, "cancelled")
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    # ---- the step -------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule → run → postprocess; returns what each touched request produced."""
        batch = self.scheduler.schedule()
        outs = [self._finished_output(s) for s in batch.out_of_blocks]
        if batch.seqs:
            outs += self._postprocess(batch, self._run(batch))
        return outs

    def _run(self, batch: Batch) -> dict[str, int]:
        """Forward the batch; sample for entries whose tokens are now all computed."""
        done = [i for i, (s, n) in enumerate(zip(batch.seqs, batch.num_tokens))
                if s.num_computed + n == len(s)]
        logits = self.runner.forward(batch, done).logits
        if not done:
            return {}
        seqs = [batch.seqs[i] for i in done]
        toks = self.sampler(logits, [s.params for s in seqs],
                            [self._generators.get(s.request_id) for s in seqs])
        return {s.request_id: t for s, t in zip(seqs, toks)}

    def _postprocess(self, batch: Batch, sampled: dict[str, int]) -> list[RequestOutput]:
        self.stats.steps += 1
        outs = []
        for seq, n in zip(batch.seqs, batch.num_tokens):
            if seq.num_computed < seq.num_prompt_tokens:
                self.stats.prefill_tokens += n
            else:
                self.stats.decode_tokens += n
            seq.num_computed += n
            self.blocks.commit(seq)
            tok = sampled.get(seq.request_id)
            if tok is not None:
                outs.append(self._append(seq, tok))
        return outs

    def _append(self, seq: Sequence, tok: int) -> RequestOutput:
        seq.token_ids.append(tok)
        self.stats.generated_tokens += 1
        detok = self._detok.get(seq.request_id)
        seq.text += detok.step(seq.token_ids) if detok else ""
        reason = self._stop_reason(seq, tok)
        if seq.params.stop and _cut_at_stop(seq):
            reason = "stop"
        # While a stop string could still be completing, hold its possible start back.
        keep = len(seq.text) - (0 if reason else _stop_prefix_len(seq))
        text, seq.num_emitted_chars = seq.text[seq.num_emitted_chars : keep], keep
        out = RequestOutput(seq.request_id, [tok], text, prompt_tokens=seq.num_prompt_tokens,
                            completion_tokens=len(seq.output_ids),
                            cached_tokens=seq.num_cached_tokens)
        if reason:
            self._finish(seq, reason)
            out.finished, out.finish_reason = True, reason
        return out

    def _stop_reason(self, seq: Sequence, tok: int) -> str | None:
        p = seq.params
        if (tok in self.eos_ids and not p.ignore_eos) or tok in p.stop_token_ids:
            return "stop"
        if len(seq.output_ids) >= p.max_tokens or len(seq) >= self.config.max_model_len:
            return "length"
        return None

    def _finished_output(self, seq: Sequence) -> RequestOutput:
        """Report a request the scheduler had to stop (the KV cache cannot hold it)."""
        self._finish(seq, seq.finish_reason or "length")
        return RequestOutput(seq.request_id, [], "", True, seq.finish_reason,
                             seq.num_prompt_tokens, len(seq.output_ids), seq.num_cached_tokens)

    def _finish(self, seq: Sequence, reason: str) -> None:
        if not seq.finished:
            self.scheduler.finish(seq, reason)
        self.seqs.pop(seq.request_id, None)
        self._generators.pop(seq.request_id, None)
        self._detok.pop(seq.request_id, None)
        self.stats.finished[reason] = self.stats.finished.get(reason, 0) + 1

    # ---- offline use -----------------------------------------------------------------------

    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[Completion]:
        """Run prompts to completion with continuous batching; results in input order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        plist = params if isinstance(params, list) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise InvalidRequestError("one SamplingParams per prompt, or a single one")
        seqs = {}
        for p, sp in zip(prompts, plist):
            rid = self.add_request(p, sp)
            seqs[rid] = self.seqs[rid]
        bar = _progress(len(seqs), use_tqdm)
        while any(not s.finished for s in seqs.values()):
            for out in self.step():
                if out.finished and out.request_id in seqs:
                    bar.update(1)
        bar.close()
        return [Completion(rid, s.token_ids[: s.num_prompt_tokens], s.output_ids, s.text,
                           s.finish_reason, s.num_cached_tokens) for rid, s in seqs.items()]

    def stream(self, prompt, params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Generate one request, yielding its outputs as they come (other requests keep going)."""
        rid = self.add_request(prompt, params)
        while True:
            for out in self.step():
                if out.request_id == rid:
                    yield out
                    if out.finished:
                        return


def _cut_at_stop(seq: Sequence) -> bool:
    """Truncate seq.text before the first stop string in it; True if one was found."""
    stops = seq.params.stop
    start = max(0, seq.num_emitted_chars - max(map(len, stops)) + 1)
    hits = [i for s in stops if (i := seq.text.find(s, start)) >= 0]
    if hits:
        seq.text = seq.text[: min(hits)]
    return bool(hits)


def _stop_prefix_len(seq: Sequence) -> int:
    """Length of the longest tail of seq.text that begins some stop string."""
    text, best = seq.text, 0
    for s in seq.params.stop:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best


def _progress(total: int, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, disable=not enabled, desc="generate", unit="req")


def tiny_config(**kw) -> ModelConfig:
    """A small random Llama shape for unit tests and examples."""
    from engine.config import RopeConfig

    base = dict(model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=128,
                num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6,
                rope=RopeConfig(), max_position=512, eos_token_ids=())
    base.update(kw)
    return ModelConfig(**base)


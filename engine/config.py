"""Frozen configuration: the model's shape (from a transformers config) and the engine's knobs."""

from __future__ import annotations

import numbers
from dataclasses import dataclass

import torch

from engine.errors import UnsupportedModelError

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters (default, linear and llama3 scaling)."""

    theta: float = 10000.0
    type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a Llama-family decoder; built from a transformers config with `from_hf`."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position: int
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    name: str = "model"

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedModelError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )

    @classmethod
    def from_hf(cls, hf, name: str = "model") -> ModelConfig:
        """Build from a transformers `PretrainedConfig`; refuse what the engine cannot run."""
        mt = getattr(hf, "model_type", None)
        if mt not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"unsupported architecture {mt!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        act = getattr(hf, "hidden_act", "silu")
        if act != "silu":
            raise UnsupportedModelError(f"unsupported activation {act!r} (only silu)")
        heads = hf.num_attention_heads
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // heads
        max_pos = hf.max_position_embeddings
        window = getattr(hf, "sliding_window", None)
        if window and (mt == "mistral" or getattr(hf, "use_sliding_window", False)):
            # Within the window, sliding-window attention is plain causal attention.
            max_pos = min(max_pos, window)
        attn_bias = bool(getattr(hf, "attention_bias", False))
        eos = getattr(hf, "eos_token_id", None)
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
        return cls(
            model_type=mt,
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            intermediate_size=hf.intermediate_size,
            num_layers=hf.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(hf, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            rms_norm_eps=hf.rms_norm_eps,
            rope=_rope_from_hf(hf),
            max_position=max_pos,
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            qkv_bias=attn_bias or mt == "qwen2",
            o_bias=attn_bias,
            mlp_bias=bool(getattr(hf, "mlp_bias", False)),
            bos_token_id=getattr(hf, "bos_token_id", None),
            eos_token_ids=eos_ids,
            name=name,
        )


def _rope_from_hf(hf) -> RopeConfig:
    # transformers 5 keeps theta and scaling in `rope_parameters`; 4.x in rope_theta/rope_scaling.
    params = dict(getattr(hf, "rope_parameters", None) or {})
    scaling = getattr(hf, "rope_scaling", None) or {}
    if not params:
        params = dict(scaling)
        params.setdefault("rope_theta", getattr(hf, "rope_theta", 10000.0))
    rtype = params.get("rope_type") or params.get("type") or "default"
    if rtype not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"unsupported rope scaling {rtype!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    return RopeConfig(
        theta=float(params.get("rope_theta", 10000.0)),
        type=rtype,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position=int(params.get("original_max_position_embeddings", 8192)),
    )


SPEC_METHODS = ("eagle3", "ngram")


@dataclass(frozen=True)
class SpecConfig:
    """Speculative decoding: which drafter, how many tokens at most, and when to back off."""

    method: str = "eagle3"
    num_tokens: int = 5  # K, the most drafts per target forward
    head: str | None = None  # EAGLE-3 checkpoint folder (None: the shipped SmolLM2 head)
    dynamic: bool = True  # pick K per sequence and batch from the acceptance seen so far
    ngram_max: int = 4
    ngram_min: int = 2
    # EAGLE-3 only: greedy steps also look the current suffix up in the sequence's own tokens
    # (engine/spec/lookup.py) and, where `context_min_n` to `ngram_max` tokens match, draft
    # what followed its latest earlier copy instead of the head's drafts (bench/README.md).
    context_drafts: bool = True
    context_min_n: int = 3
    # Cost of one extra verified token and of one draft step, as fractions of a plain decode
    # step at batch 1; they set where dynamic K stops paying.
    verify_token_cost: float = 0.03
    draft_step_cost: float = 0.05
    # Greedy decode steps run verify + head + draft chain as one graph replay and one host
    # sync (engine/spec/fused.py); off: the step-by-step path (same tokens, slower).
    fused_step: bool = True
    # How dynamic K predicts the tokens a K-draft step emits: "geometric" (one acceptance
    # rate per sequence) or "runs" (each depth's acceptance given the drafts before it, per
    # sequence: answers that loop accept in long runs, which one rate prices too low).
    accept_model: str = "geometric"
    # Dynamic K only: K stays where a fused step verifies at most this many tokens (batch *
    # (K + 1); 0: no cap): the linear step cost dynamic K prices K by misses how a verify of
    # several hundred tokens leaves the memory-bound regime.
    verify_token_budget: int = 384
    # Dynamic K's fused steps: three choices, off by default (bench/README.md).
    batch_k: int | None = None  # every fused batch drafts this K, not the cost model's pick
    # Mean tokens per verify below which speculation turns itself off, probing for recovery
    # (engine/spec/collapse.py); 0: never. Served deployments set it (speculation.collapse_below).
    collapse_below: float = 0.0
    # The fused step's graph levels grow by 2 from this size on instead of doubling (more
    # graphs; K=5 then runs its own, not K=7's), for batches of at least
    # `dense_levels_min_batch` sequences (0: every batch).
    dense_levels_from: int | None = None
    dense_levels_min_batch: int = 0
    # What the measured-win override drafts at: "model" (the model's best K above 0) or
    # "measured" (the K of the level that measured the most tokens/s at the batch's bucket).
    win_pick: str = "model"

    def __post_init__(self) -> None:
        if self.accept_model not in ("geometric", "runs"):
            raise ValueError(f"accept_model must be 'geometric' or 'runs', got "
                             f"{self.accept_model!r}")
        if self.method not in SPEC_METHODS:
            raise ValueError(f"unknown speculation method {self.method!r}; have {SPEC_METHODS}")
        if not 0 <= self.num_tokens <= 16:
            raise ValueError(f"num_tokens must be in 0..16, got {self.num_tokens}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError("need 1 <= ngram_min <= ngram_max")
        if not 1 <= self.context_min_n <= self.ngram_max:
            raise ValueError(f"need 1 <= context_min_n <= ngram_max ({self.ngram_max}), got "
                             f"{self.context_min_n}")
        if self.verify_token_budget < 0:
            raise ValueError(f"verify_token_budget must be >= 0, got {self.verify_token_budget}")
        if not 0 <= self.collapse_below < 2:
            raise ValueError(f"collapse_below must be in [0, 2), got {self.collapse_below}")
        if self.batch_k is not None and not 0 <= self.batch_k <= self.num_tokens:
            raise ValueError(f"batch_k must be in 0..num_tokens ({self.num_tokens}), got "
                             f"{self.batch_k}")
        if self.dense_levels_from is not None and self.dense_levels_from < 2:
            raise ValueError(f"dense_levels_from must be >= 2, got {self.dense_levels_from}")
        if self.dense_levels_min_batch < 0 or (self.dense_levels_min_batch
                                               and self.dense_levels_from is None):
            raise ValueError(f"dense_levels_min_batch must be >= 0 and needs dense_levels_from, "
                             f"got {self.dense_levels_min_batch}")
        if self.win_pick not in ("model", "measured"):
            raise ValueError(f"win_pick must be 'model' or 'measured', got {self.win_pick!r}")

    @property
    def num_draft_layers(self) -> int:
        return 1 if self.method == "eagle3" else 0


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs, validated once and passed down."""

    model: ModelConfig
    dtype: torch.dtype = torch.float32
    device: str = "cpu"
    block_size: int = 16
    num_blocks: int | None = None  # None: size from kv_cache_bytes / gpu_memory_utilization
    kv_cache_bytes: int = 512 << 20  # CPU default budget for the KV tensor
    gpu_memory_utilization: float = 0.85  # of the GPU memory free when the engine starts
    max_model_len: int | None = None  # None: the model's max_position
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
    num_draft_layers: int = 0
    spec: SpecConfig | None = None
    attention_backend: str = "auto"  # auto: triton on CUDA when importable, else torch
    cuda_graphs: bool = True  # replay captured decode/verify/draft steps (CUDA + triton only)
    # Greedy decode steps overlap: the next is launched from this one's device outputs before
    # the host reads it (same tokens; with speculation K is then chosen two steps ahead).
    overlap: bool = True
    # Under overlap, arrivals join a batch of R decoding sequences at once when
    # max(1, R // admission_share) wait, else within admission_delay_steps steps (0: at once):
    # each admission costs the running streams a step, so at high load a few share one.
    admission_delay_steps: int = 2
    admission_share: int = 16
    # A greedy arrival whose whole prompt fits one forward is prefilled beside the decode
    # step in flight and joins the step after it, instead of draining the pipeline.
    admit_in_flight: bool = True
    # Prefill role: draft the first K tokens before a hand-off (the decode side verifies them
    # at once; seeded sampling stays identical to one engine). False: ship only the head's
    # hidden state and let the decode side draft with the K its own load calls for.
    handoff_drafts: bool = True
    # Every kernel reduces a row in one fixed order, independent of how many rows share the
    # launch (batch, verify width), of chunking and of prefix-cache hits: bit-identical output
    # across all of them, at some cost in speed. Seeded sampling draws per request and position.
    deterministic: bool = False

    def __post_init__(self) -> None:
        for name in ("block_size", "num_blocks", "kv_cache_bytes", "max_model_len",
                     "max_num_seqs", "max_num_batched_tokens", "num_draft_layers",
                     "admission_delay_steps", "admission_share"):
            v = getattr(self, name)  # (NaN rows admitted nothing: generate waited forever)
            if v is not None and (isinstance(v, bool) or not isinstance(v, numbers.Integral)):
                raise TypeError(f"{name} must be an int, got {v!r}")
        if not isinstance(self.spec, SpecConfig | None):
            raise TypeError(f"spec must be a SpecConfig or None, got {self.spec!r}")
        if not isinstance(self.dtype, torch.dtype) or not isinstance(self.device, str):
            raise TypeError(f"dtype must be a torch.dtype and device a str, got {self.dtype!r} "
                            f"and {self.device!r}")
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.max_model_len is None:
            object.__setattr__(self, "max_model_len", self.model.max_position)
        if not 0 < self.max_model_len <= self.model.max_position:
            raise ValueError(
                f"max_model_len={self.max_model_len} must be in 1..{self.model.max_position}"
            )
        if self.max_num_seqs <= 0 or self.max_num_batched_tokens <= 0:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be positive")
        if self.num_blocks is not None and self.num_blocks <= 0:
            raise ValueError("num_blocks must be positive")
        if self.admission_delay_steps < 0 or self.admission_share < 1:
            raise ValueError("admission_delay_steps must be >= 0 and admission_share >= 1")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")
        if self.num_draft_layers < 0:
            raise ValueError("num_draft_layers must be >= 0")
        if self.spec is not None and self.num_draft_layers < self.spec.num_draft_layers:
            object.__setattr__(self, "num_draft_layers", self.spec.num_draft_layers)

    @property
    def max_blocks_per_seq(self) -> int:
        """KV blocks one max_model_len context needs: the width of a full block table."""
        return -(-self.max_model_len // self.block_size)

    @property
    def backend_name(self) -> str:
        """The attention backend this engine runs ("auto" resolved)."""
        if self.attention_backend != "auto":
            return self.attention_backend
        from engine.attention import triton_available

        return "triton" if self.on_cuda and triton_available() else "torch"

    @property
    def on_cuda(self) -> bool:
        """Whether the engine runs on a CUDA device ("cuda" or "cuda:N")."""
        return str(self.device).startswith("cuda")

    @property
    def use_cuda_graphs(self) -> bool:
        return self.cuda_graphs and self.on_cuda and self.backend_name == "triton"

    @property
    def num_kv_layers(self) -> int:
        """Target layers plus draft layers: the first dimension of the KV tensor."""
        return self.model.num_layers + self.num_draft_layers

    @property
    def kv_bytes_per_block(self) -> int:
        m = self.model
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return self.num_kv_layers * 2 * self.block_size * m.num_kv_heads * m.head_dim * itemsize


def tiny_config(**kw) -> ModelConfig:
    """A small random Llama shape for unit tests and examples."""
    base = dict(model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=128,
                num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6,
                rope=RopeConfig(), max_position=512, eos_token_ids=())
    base.update(kw)
    return ModelConfig(**base)

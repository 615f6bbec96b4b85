"""Cluster topology: YAML → frozen dataclasses, validated once in `__post_init__`, passed down.

`load_config(path, overrides)` is the one entry point; `apply_overrides` takes the CLI's
`section.key=value` strings; `engine_kwargs(cfg, role)` turns a role into the keyword arguments
of `engine.Engine.from_pretrained`. This module imports neither torch nor the engine at import
time, so the CLI stays quick.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, get_args, get_type_hints

import yaml

from cluster.yaml_strict import load as strict_yaml

DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")
SPEC_METHODS = ("eagle3", "ngram", "none")
MODES = ("disaggregated", "colocated")
TRANSPORTS = ("ucx", "ucx-tcp")
PROGRESS_MODES = ("thread", "thread-polling")
PULL_ENGINES = ("dst", "src")  # kvtransfer.ipc.ENGINES (not imported: config loads no torch)
ENGINE_ROLES = ("prefill", "decode", "colocated")
MAX_REPLICAS = 1024  # of one role: a bound for typos (each replica is a process)
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}


class ConfigError(ValueError):
    """A config that cannot be built: unknown key, wrong type or value out of range."""


class _Section:
    """Base of every section: check field types against the annotations, then its own rules."""

    def __post_init__(self) -> None:
        hints = get_type_hints(type(self))
        for f in fields(self):
            value = _typed(f.name, getattr(self, f.name), hints[f.name])
            object.__setattr__(self, f.name, value)
        self._validate()

    def _validate(self) -> None:
        """Range and choice checks; raise ConfigError naming the field."""


@dataclass(frozen=True)
class ModelSection(_Section):
    """Which checkpoint, at which precision, and the KV block geometry."""

    path: str | None = None  # None: the embedded SmolLM2-135M-Instruct
    dtype: str = "auto"  # auto: bfloat16 on CUDA, float32 on CPU
    max_model_len: int | None = None  # None: the model's own context length
    block_size: int = 16

    def _validate(self) -> None:
        _choice("dtype", self.dtype, DTYPES)
        _require(self.max_model_len is None or self.max_model_len > 0,
                 f"max_model_len must be > 0, got {self.max_model_len}")
        _require(0 < self.block_size <= 1024 and not self.block_size & (self.block_size - 1),
                 f"block_size must be a power of two up to 1024, got {self.block_size}")


@dataclass(frozen=True)
class EngineSection(_Section):
    """Engine-wide choices every role shares."""

    # true: every kernel reduces a row in one fixed order, whatever else shares its launch, so
    # output is bit-identical across batching, speculation, caching, chunking and roles
    # (`EngineConfig.deterministic`); false: the fastest kernels, lossless only up to rounding
    deterministic: bool = False
    # where Triton keeps compiled kernels (TRITON_CACHE_DIR), so a restart loads them instead
    # of compiling; null: Triton's default (~/.triton/cache)
    triton_cache_dir: str | None = None


@dataclass(frozen=True)
class RouterSection(_Section):
    """The public gRPC endpoint and its admission limits (`router/admission.py`,
    `router/limits.py`)."""

    host: str = "127.0.0.1"
    port: int = 50051  # 0: pick a free port
    http: bool = True  # the OpenAI-compatible HTTP API beside gRPC (router/openai_http.py)
    http_port: int = 8000  # 0: pick a free port
    max_concurrent_requests: int = 256  # running at once; more wait in the queue
    max_queued_requests: int = 1024  # waiting at once; more are RESOURCE_EXHAUSTED
    max_queue_wait_s: float = 120.0  # a wait for admission or KV room; longer: RESOURCE_EXHAUSTED
    max_requests_per_client: int = 0  # running or queued per token or peer address; 0: no cap
    request_timeout_s: float = 600.0  # a request's whole life; longer: DEADLINE_EXCEEDED
    # on SIGTERM/SIGINT running streams get this long to finish; the rest end UNAVAILABLE (the
    # SDK continues them on another router)
    drain_grace_s: float = 30.0
    # disaggregated: while no actor of a role answers, health says NOT_SERVING; after this long
    # (its Ray node gone, say) the router exits with status 3 for its supervisor to restart it
    worker_loss_exit_s: float = 300.0
    max_prompt_chars: int = 256 * 1024  # text or chat content, checked before tokenizing
    # special-token strings in chat content are tokenized as plain text; true trusts every
    # caller to write control tokens (turn markers) into content
    chat_special_tokens: bool = False
    # a stream whose prefill or decode actor dies moves to live (or restarted) actors and goes
    # on where it stopped, at most this many times (0: the stream fails with the worker)
    resume_attempts: int = 3
    # share of finished greedy requests that speculated re-run without speculation, off the
    # request path, to check that output did not drift (router/shadow.py); 0: off
    shadow_sample: float = 0.0

    def _validate(self) -> None:
        _port("port", self.port)
        _port("http_port", self.http_port)
        _require(self.resume_attempts >= 0,
                 f"resume_attempts must be >= 0, got {self.resume_attempts}")
        for key in ("max_concurrent_requests", "max_queued_requests", "max_prompt_chars"):
            _require(getattr(self, key) >= 1, f"{key} must be >= 1, got {getattr(self, key)}")
        _require(self.max_requests_per_client >= 0,
                 f"max_requests_per_client must be >= 0, got {self.max_requests_per_client}")
        _require(0 <= self.shadow_sample <= 1,
                 f"shadow_sample must be in 0..1, got {self.shadow_sample}")
        _require(self.drain_grace_s >= 0, f"drain_grace_s must be >= 0, got {self.drain_grace_s}")
        for key in ("request_timeout_s", "max_queue_wait_s", "worker_loss_exit_s"):
            _require(getattr(self, key) > 0, f"{key} must be > 0, got {getattr(self, key)}")


@dataclass(frozen=True)
class RoleSection(_Section):
    """One engine role (prefill or decode): how many replicas, where, and the engine's knobs."""

    replicas: int = 1
    device: str = "auto"  # auto: cuda when num_gpus > 0, else cpu
    num_gpus: float = 0.0  # Ray GPU reservation per replica; a fraction shares a GPU
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    kv_cache_bytes: int | str | None = None  # int or "512MiB"; None: the engine default (CPU)
    gpu_memory_utilization: float | None = None  # share of free GPU memory; None: engine default
    enable_prefix_caching: bool = True
    # Under overlapped decoding at 32+ running sequences, an arrival may wait this many engine
    # steps for others to share its admission (each admission costs the running streams some
    # time; `EngineConfig.admission_delay_steps`). 0: admit every arrival at once.
    admission_delay_steps: int = 2
    # true: a greedy arrival whose prompt fits one forward is prefilled beside the decode step
    # in flight and joins the next, instead of draining the pipeline
    # (`EngineConfig.admit_in_flight`).
    admit_in_flight: bool = True
    # Ray restarts a replica that died (its model loads again) this many times over the
    # cluster's life; -1: always, 0: never (its streams then move to the other replicas)
    max_restarts: int = -1
    # Ray custom resources each replica books (e.g. {node_b: 1}): it goes only to the nodes
    # `ray start --resources` gave them, so the roles can be kept apart; null: any node
    resources: dict | None = None

    def _validate(self) -> None:
        _require(1 <= self.replicas <= MAX_REPLICAS,
                 f"replicas must be in 1..{MAX_REPLICAS}, got {self.replicas}")
        _require(self.max_restarts >= -1, f"max_restarts must be >= -1, got {self.max_restarts}")
        _require(all(isinstance(k, str) and k not in ("CPU", "GPU") and type(v) in (int, float)
                     and v > 0 for k, v in (self.resources or {}).items()),
                 f"resources must map custom resource names to amounts > 0, got {self.resources}")
        _require(self.admission_delay_steps >= 0,
                 f"admission_delay_steps must be >= 0, got {self.admission_delay_steps}")
        _choice("device", self.device, DEVICES)
        self._validate_gpus()
        _require(self.max_num_seqs >= 1, f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        _require(self.max_num_batched_tokens >= 1,
                 f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if isinstance(self.kv_cache_bytes, str):
            object.__setattr__(self, "kv_cache_bytes", _parse_size(self.kv_cache_bytes))
        _require(self.kv_cache_bytes is None or self.kv_cache_bytes > 0,
                 f"kv_cache_bytes must be > 0, got {self.kv_cache_bytes}")
        u = self.gpu_memory_utilization
        _require(u is None or 0 < u <= 1, f"gpu_memory_utilization must be in (0, 1], got {u}")

    def _validate_gpus(self) -> None:
        g = self.num_gpus
        _require(g >= 0, f"num_gpus must be >= 0, got {g}")
        # Ray only accepts fractions below one GPU; above it, whole GPUs.
        _require(g <= 1 or g.is_integer(), f"num_gpus above 1 must be whole, got {g}")
        _require(self.device != "cpu" or g == 0, f"num_gpus must be 0 when device is cpu, got {g}")
        # Without a reservation Ray does not hide the GPUs, so the engine would use one unbooked.
        _require(self.device != "cuda" or g > 0,
                 "device is cuda but num_gpus is 0 (book one; a fraction such as 0.5 shares a GPU)")

    @property
    def resolved_device(self) -> str:
        """'cpu' or 'cuda': auto follows the Ray GPU reservation."""
        if self.device != "auto":
            return self.device
        return "cuda" if self.num_gpus > 0 else "cpu"


@dataclass(frozen=True)
class SpecSection(_Section):
    """Speculative decoding on the decode side (method none: plain decoding)."""

    method: str = "eagle3"
    num_tokens: int = 5  # K, the most drafts per target forward
    head: str | None = None  # EAGLE-3 checkpoint folder; None: the shipped SmolLM2 head
    dynamic: bool = True  # choose K per sequence from measured acceptance
    # true: prefill drafts the first K (seeded sampling identical to colocated); false: it
    # ships the head's hidden state and the decode side drafts with its own K
    prefill_drafts: bool = True
    # true: greedy decode steps overlap (the next is launched before this one is read; same
    # tokens, K chosen two steps ahead); false: every step is read before the next
    overlap: bool = True
    # EAGLE-3: greedy steps also draft by copying what followed the latest earlier copy of
    # the sequence's current suffix (lossless either way; false: the head's drafts only)
    context_drafts: bool = True
    # mean tokens per verify below which speculation turns itself off until probes show it
    # pays again (engine/spec/collapse.py; metric tandem_spec_collapsed); 0: never
    collapse_below: float = 1.1

    def _validate(self) -> None:
        _choice("method", self.method, SPEC_METHODS)
        _require(0 <= self.num_tokens <= 16, f"num_tokens must be in 0..16, got {self.num_tokens}")
        _require(0 <= self.collapse_below < 2,
                 f"collapse_below must be in [0, 2), got {self.collapse_below}")


@dataclass(frozen=True)
class TransferSection(_Section):
    """How the prefill actors ship KV blocks to the decode actors (`kvtransfer.UcxTransport`)."""

    # ucx: worker addresses (shared memory or NVLink on one host, RDMA/TCP between hosts);
    # ucx-tcp: listeners (TCP connection setup)
    transport: str = "ucx"
    # GPU caches on one host where the prefill actor sees the decode actor's GPU (both on one
    # GPU, e.g. num_gpus 0.5 each, or ipc_across_gpus): it copies the blocks into the decode
    # cache itself (CUDA IPC), UCX carrying only the control messages; no message before the
    # copy starts. Actors pinned to a GPU each keep to UCX messages.
    push: bool = True
    # the other way round, where push is off or only the decode actor sees the other's GPU:
    # it copies the blocks out of the prefill cache once the header is in
    pull: bool = True
    # whose copy engines move a pull between two GPUs: dst (the decode GPU reads the prefill
    # GPU's memory) or src (the prefill GPU writes, as a peer copy does)
    pull_engine: str = "dst"
    # GPU actors see every GPU of their node (Ray leaves CUDA_VISIBLE_DEVICES alone) and run
    # on their own by index, so push and pull reach actors on different GPUs; false: Ray pins
    # each to its own GPUs and those transfers go as UCX messages
    ipc_across_gpus: bool = False
    # ucxx progress: thread idles at ~0 CPU; thread-polling spins a core per actor for lower
    # latency (a round trip ~130 against ~330 us between two host processes)
    progress_mode: str = "thread"
    checksum: bool = False  # crc32 of every payload, compared at the receiver
    timeout_s: float = 30.0  # a transfer (or handshake) that takes longer fails
    # the interfaces UCX binds and reaches peers on, as UCX_NET_DEVICES names them (e.g.
    # "eth0", "mlx5_0:1"; several comma-separated); null: UCX's choice (every usable one)
    net_devices: str | None = None

    def _validate(self) -> None:
        _choice("transport", self.transport, TRANSPORTS)
        _choice("progress_mode", self.progress_mode, PROGRESS_MODES)
        _choice("pull_engine", self.pull_engine, PULL_ENGINES)
        _require(self.pull or self.push or not self.ipc_across_gpus,
                 "ipc_across_gpus needs pull or push: true (it only serves those paths)")
        _require(self.timeout_s > 0, f"timeout_s must be > 0, got {self.timeout_s}")

    def transport_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of `kvtransfer.factory.make_transport` beside the kind."""
        return {"ipc": None if self.pull or self.push else False,
                "pull": None if self.pull else False, "push": None if self.push else False,
                "pull_engine": self.pull_engine,
                "progress_mode": self.progress_mode,
                "checksum": self.checksum, "timeout": self.timeout_s}


@dataclass(frozen=True)
class MetricsSection(_Section):
    """Prometheus endpoints: component k serves on port_base + k (0: each picks a free port)."""

    enabled: bool = True
    host: str = "127.0.0.1"
    port_base: int = 0

    def _validate(self) -> None:
        _port("port_base", self.port_base)


@dataclass(frozen=True)
class SecuritySection(_Section):
    """Who may call the public port (`router/auth.py`): TLS, mTLS and bearer tokens, all off
    by default. The files are read where the router runs, when it starts."""

    tls_cert: str | None = None  # PEM certificate (chain) the router presents; with tls_key
    tls_key: str | None = None  # PEM private key of tls_cert
    tls_client_ca: str | None = None  # PEM CA: clients must show a cert it signed (mTLS)
    tokens_file: str | None = None  # bearer tokens, one a line (blank and # lines skipped)
    tokens_env: str | None = "TANDEM_API_TOKENS"  # env var of comma-separated tokens; null: none
    health_open: bool = True  # grpc.health.v1.Health answers without a token (probes)

    def _validate(self) -> None:
        _require(self.tls_key is not None or self.tls_cert is None,
                 "tls_key must be set with tls_cert (both or neither)")
        _require(self.tls_cert is not None or self.tls_key is None,
                 "tls_cert must be set with tls_key (both or neither)")
        _require(self.tls_client_ca is None or self.tls_cert is not None,
                 "tls_client_ca needs tls_cert and tls_key (mTLS is TLS that checks clients)")
        for name in ("tls_cert", "tls_key", "tls_client_ca", "tokens_file"):
            path = getattr(self, name)
            _require(path is None or Path(path).is_file(), f"{name}: no file {path!r}")
        _require(self.tokens_env is None or bool(_ENV_NAME.match(self.tokens_env)),
                 f"tokens_env must name an environment variable, got {self.tokens_env!r}")


@dataclass(frozen=True)
class ClusterConfig(_Section):
    """The whole deployment. In colocated mode the decode section describes the one engine
    (in the serving process, doing prefill and decode) and the prefill section is unused."""

    model: ModelSection = field(default_factory=ModelSection)
    engine: EngineSection = field(default_factory=EngineSection)
    router: RouterSection = field(default_factory=RouterSection)
    prefill: RoleSection = field(default_factory=RoleSection)
    decode: RoleSection = field(default_factory=RoleSection)
    speculation: SpecSection = field(default_factory=SpecSection)
    transfer: TransferSection = field(default_factory=TransferSection)
    metrics: MetricsSection = field(default_factory=MetricsSection)
    security: SecuritySection = field(default_factory=SecuritySection)
    mode: str = "disaggregated"
    ray_address: str | None = None  # None: start a local Ray; "auto" or an address: connect

    def _validate(self) -> None:
        _choice("mode", self.mode, MODES)
        _require(self.mode != "colocated" or self.decode.replicas == 1,
                 f"colocated mode serves one engine in the serving process: decode.replicas "
                 f"must be 1, got {self.decode.replicas}")
        base, n = self.metrics.port_base, len(self.components())
        _require(base == 0 or base + n - 1 <= 65535,
                 f"metrics.port_base={base} leaves no room for {n} components below 65536")

    @property
    def roles(self) -> tuple[str, ...]:
        """The engine roles this mode runs."""
        return ("prefill", "decode") if self.mode == "disaggregated" else ("colocated",)

    def role_section(self, role: str) -> RoleSection:
        """The section that configures engines of `role` (colocated reads decode)."""
        _choice("role", role, ENGINE_ROLES)
        return self.prefill if role == "prefill" else self.decode

    def components(self) -> list[str]:
        """Every process with a metrics endpoint: 'router', then 'prefill-0', 'decode-0', ..."""
        engines = [f"{r}-{i}" for r in self.roles for i in range(self.role_section(r).replicas)]
        return ["router", *engines]

    def metrics_ports(self) -> dict[str, int]:
        """Metrics port of each component (all 0, meaning pick a free one, when port_base is 0)."""
        base = self.metrics.port_base
        return {name: base + k if base else 0 for k, name in enumerate(self.components())}

    def to_dict(self) -> dict[str, Any]:
        """Plain nested dict; `config_from_dict(cfg.to_dict()) == cfg`."""
        return asdict(self)


_SECTIONS: dict[str, type[_Section]] = {
    "model": ModelSection, "engine": EngineSection, "router": RouterSection,
    "prefill": RoleSection, "decode": RoleSection, "speculation": SpecSection,
    "transfer": TransferSection, "metrics": MetricsSection, "security": SecuritySection,
}


def config_from_dict(d: dict[str, Any] | None) -> ClusterConfig:
    """Build and validate a config from nested dicts (missing keys take their defaults)."""
    d = _mapping(d, "the top level")
    _check_keys(d, ClusterConfig, "the top level")
    kw = {k: _section(k, v) if k in _SECTIONS else v for k, v in d.items()}
    return ClusterConfig(**kw)


def load_config(path: str | Path | None = None,
                overrides: dict[str, Any] | None = None) -> ClusterConfig:
    """Read a YAML file (None: all defaults: 1 prefill + 1 decode replica on CPU, EAGLE-3), then
    apply `overrides`, a dict of dotted paths (or nested dicts) to already typed values."""
    d = _read_yaml(path) if path is not None else {}
    for key, value in (overrides or {}).items():
        _set_path(d, key, value)
    try:
        return config_from_dict(d)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}" if path is not None else str(e)) from None


def apply_overrides(cfg: ClusterConfig, items: list[str]) -> ClusterConfig:
    """A new config with `section.key=value` strings applied (values typed by YAML)."""
    d = cfg.to_dict()
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"override {item!r} is not of the form section.key=value")
        _set_path(d, key.strip(), _parse_value(item, raw))
    return config_from_dict(d)


def _section(name: str, value: Any) -> _Section:
    cls = _SECTIONS[name]
    value = _mapping(value, f"section {name!r}")
    _check_keys(value, cls, f"section {name!r}")
    try:
        return cls(**value)
    except ConfigError as e:
        raise ConfigError(f"{name}.{e}") from None


def _mapping(value: Any, where: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ConfigError(f"{where} must be a mapping, got {value!r}")
    return dict(value)


def _check_keys(d: dict[str, Any], cls: type, where: str) -> None:
    valid = [f.name for f in fields(cls)]
    for key in d:
        if key not in valid:
            close = difflib.get_close_matches(str(key), valid, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(
                f"unknown key {key!r} in {where}{hint}; valid keys: {', '.join(valid)}")


def _read_yaml(path: str | Path) -> dict[str, Any]:
    try:
        data = strict_yaml(Path(path).read_text())
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    except (OSError, UnicodeDecodeError) as e:  # a folder, unreadable, not UTF-8 text
        raise ConfigError(f"{path}: cannot read it as a config file: {e}") from None
    if data is not None and not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping")
    return data or {}


def _parse_value(item: str, raw: str) -> Any:
    try:
        return strict_yaml(raw)
    except yaml.YAMLError:
        raise ConfigError(f"override {item!r}: value is not valid YAML") from None


def _set_path(d: dict[str, Any], dotted: str, value: Any) -> None:
    """Set d[a][b]... = value for 'a.b...'; a dict value is merged into an existing section."""
    *parents, leaf = dotted.split(".")
    node = d
    for i, part in enumerate(parents):
        if node.get(part) is None:
            node[part] = {}
        node = node[part]
        if not isinstance(node, dict):
            raise ConfigError(f"cannot set {dotted!r}: {'.'.join(parents[:i + 1])} is a value")
    if isinstance(value, dict) and isinstance(node.get(leaf), dict):
        for k, v in value.items():
            _set_path(node[leaf], str(k), v)
    else:
        node[leaf] = value


def _typed(name: str, value: Any, hint: Any) -> Any:
    """`value` checked against `hint`: ints pass as floats, bools never pass as numbers."""
    kinds = get_args(hint) or (hint,)
    if value is None and type(None) in kinds:
        return None
    if float in kinds and type(value) is int:
        return float(value)
    if any(isinstance(value, k) and not (k in (int, float) and isinstance(value, bool))
           for k in kinds):
        return value
    names = " or ".join("null" if k is type(None) else k.__name__ for k in kinds)
    raise ConfigError(f"{name} must be {names}, got {value!r}")


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def _choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        close = difflib.get_close_matches(str(value), choices, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(f"{name} must be one of {', '.join(choices)}, got {value!r}{hint}")


def _port(name: str, value: int) -> None:
    _require(0 <= value <= 65535, f"{name} must be in 0..65535, got {value}")


def _parse_size(text: str) -> int:
    """'512MiB' → 536870912; plain digits are bytes."""
    m = _SIZE.match(text)
    if not m:
        raise ConfigError(f"kv_cache_bytes must be bytes or a size like '512MiB', got {text!r}")
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "b").lower()])

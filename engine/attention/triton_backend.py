"""Triton attention over the paged KV cache (kernels in `triton_kernels`).

The attention kernels serve prefill chunks, decode and K+1-token verify alike: sequence i has
`q_len` causal queries at the end of a `seq_len`-token context, with grouped-query heads packed
into the query tile. Launches are shape-static given (num_seqs, max_query_len), so they can be
captured in CUDA graphs; a slot of -1 in `slot_mapping` skips the store (padding rows). CPU
tests run under `TRITON_INTERPRET=1` in fp32/fp16 (the interpreter is wrong for bf16).
"""

from __future__ import annotations

import inspect
import os

import torch

from engine.attention import triton_kernels as kern
from engine.attention.base import AttentionBackend, AttentionMetadata

try:  # Triton is optional: the torch backend needs nothing beyond torch.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where triton is absent
    triton = None
    tl = None


# Keys per split of the split-KV path on CUDA, and the context past which a batch of few
# sequences takes it: a context within one split reduces in the same order on both paths, so a
# row rounds alike whichever kernel its batch takes (a verify row as its decode row), which a
# later start than one split would break.
SPLIT_KEYS = 128
# Off CUDA (Triton's interpreter: CPU tests) every program costs about the same whatever its
# work, so splits there only multiply programs: 1024-key splits keep engine-level CPU tests
# on the one-pass kernel below 1024 keys (kernel tests pick their own split size).
INTERPRETER_SPLIT_KEYS = 1024


# The draft head's attention (`draft_attention`): its numbers need match no other path's, so
# it takes smaller tiles than the target's, which run a chained draft step faster.
DRAFT_SPLIT_KEYS = 64
DRAFT_MIN_TILE = 16

# Deterministic mode's one tile shape (rows, keys per inner step, warps), never chosen from
# the batch or the device, so every launch compiles the same kernel and rounds a row alike.
# 16 rows and 4 warps: a row rounds alike in every launch kind
# (tests/engine/test_attention_deterministic.py), and a batch of decodes wastes fewer rows than
# in a 64-row tile (bench/README.md, figure 6).
DETERMINISTIC_TILE = (16, 64, 4)
# Deterministic mode's keys per split, at fixed absolute positions on every device: two
# 64-key steps, as the default mode's splits on CUDA, so a long context at small batch
# spreads over as many programs as there, with partials (and folds) no more numerous.
DETERMINISTIC_SPLIT_KEYS = 128


def draft_attention(device: torch.device) -> dict:
    """`TritonAttention` keyword arguments for a draft head's layer on `device`."""
    return {"split_keys": DRAFT_SPLIT_KEYS if device.type == "cuda" else None,
            "min_tile": DRAFT_MIN_TILE}


def long_context(device: torch.device) -> int:
    """Keys per split of the default mode on `device`, and the context past which a batch of
    few sequences takes the split-KV path: CUDA graph buckets are captured once per side of it."""
    return SPLIT_KEYS if device.type == "cuda" else INTERPRETER_SPLIT_KEYS


def triton_available() -> bool:
    return triton is not None


# Programmatic dependent launch (Hopper+): kernels with a USE_PDL switch may start while the one
# before still runs and wait (`gdc_wait`) before reading its results. None: on where supported;
# False: off (TANDEM_PDL=0).
PDL: bool | None = False if os.environ.get("TANDEM_PDL", "").lower() in ("0", "off", "false") \
    else None
_PDL_SUPPORT: dict[int, bool] = {}


def pdl_supported(device: torch.device) -> bool:
    """Compute capability 9+ and a Triton with grid dependency control and `launch_pdl`."""
    if device.type != "cuda" or not triton_available():
        return False
    i = device.index if device.index is not None else torch.cuda.current_device()
    if i not in _PDL_SUPPORT:
        try:
            from triton.backends.nvidia.compiler import CUDAOptions
            opts = "launch_pdl" in CUDAOptions.__dataclass_fields__
        except Exception:  # another backend layout: no PDL
            opts = False
        _PDL_SUPPORT[i] = (opts and hasattr(tl.extra.cuda, "gdc_wait")
                           and torch.cuda.get_device_capability(i)[0] >= 9)
    return _PDL_SUPPORT[i]


def pdl_args(t: torch.Tensor, always: bool = False) -> dict:
    """Launch arguments of a kernel with a USE_PDL switch for tensor t's device (always: pass
    USE_PDL=False too, for kernels without a default)."""
    on = PDL is not False and pdl_supported(t.device)
    if on:
        return {"USE_PDL": True, "launch_pdl": True}
    return {"USE_PDL": False} if always else {}


def _no_hooks(hook) -> bool:
    """A Triton launch hook slot holding nothing to call: None, or an empty `HookChain`."""
    return hook is None or (hasattr(hook, "calls") and not hook.calls)


class FastLaunch:
    """Launches a Triton kernel that runs outside CUDA graphs on the host's critical path and
    specializes on none of its int or pointer arguments: after the first JIT launch of a key
    (device, constexprs), later ones call the compiled launcher directly, skipping Triton's
    costly argument binding. Falls back to the JIT launch when launch hooks are set or the
    launcher's calling convention is not the expected one (Triton 3.3+)."""

    def __init__(self, fn) -> None:
        self.fn = fn
        self.compiled: dict = {}
        self.fast = 0  # launches that skipped the JIT's binding
        self.why: str | None = None  # why the last launch did not (None: it did, or first)
        try:
            from triton import knobs
            from triton.runtime import driver
            self._knobs, self._driver = knobs.runtime, driver
        except Exception:  # an older Triton: always the JIT's launch
            self._knobs = self._driver = None

    def __call__(self, key, grid: tuple[int, ...], args: tuple, **options) -> None:
        """Launch fn[grid](*args, **options); `args` every parameter in order, constexprs
        included; `key` (device index first) whatever decides the compiled variant: the
        constexprs and the dtypes that may vary."""
        k = self.compiled.get(key)
        kn = self._knobs
        if k is not None:
            if _no_hooks(kn.launch_enter_hook) and _no_hooks(kn.launch_exit_hook):
                stream = self._driver.active.get_current_stream(key[0])
                g = tuple(grid) + (1, 1)
                k.run(g[0], g[1], g[2], stream, k.function, k.packed_metadata, None, None,
                      None, *args)
                self.fast += 1
                return
            self.why = "launch hooks set"
        k = self.fn[grid](*args, **options)
        if kn is None:
            self.why = "no triton.knobs"
        elif hasattr(k, "run") and hasattr(k, "packed_metadata"):
            self.compiled[key] = k
        else:
            self.why = f"the JIT returned {type(k).__name__}"


class BoundLaunch:
    """`fn[grid](*args, **kw)` for a kernel launched from Python every eager forward: Triton's
    own binder specializes the arguments (so the variant is the one the JIT picks), then the
    compiled variant's launcher runs directly, skipping the rest of the JIT's per-call work
    (the options' cache key, the globals check, launch metadata), about half a launch's host
    time. The JIT's launch under the interpreter, launch or pre-run hooks, debug knobs, for a
    kernel that reads module globals, or a Triton without the expected internals."""

    def __init__(self, fn) -> None:
        self.fn = fn
        self.compiled: dict = {}
        self.fast = 0  # launches past the JIT
        try:
            from triton import knobs
            from triton.runtime import driver
            self._knobs, self._driver = knobs, driver
        except Exception:  # an older Triton: always the JIT's launch
            self._knobs = self._driver = None

    def __getitem__(self, grid: tuple[int, ...]):
        return lambda *args, **kw: self.launch(grid, args, kw)

    def launch(self, grid: tuple[int, ...], args: tuple, kw: dict) -> None:
        device, key, params, k = self._find(args, kw)
        if k is None:  # the JIT's launch, its variant kept where the next may skip it
            k = self.fn[grid](*args, **kw)
            # a kernel reading module globals keeps the JIT's check that they did not change
            if (key is not None and hasattr(k, "run") and hasattr(k, "packed_metadata")
                    and not getattr(self.fn, "used_global_vals", None)):
                self.compiled[key] = k
            return
        g = tuple(grid(params) if callable(grid) else grid) + (1, 1)
        k.run(g[0], g[1], g[2], self._driver.active.get_current_stream(device), k.function,
              k.packed_metadata, None, None, None, *params.values())
        self.fast += 1

    def _find(self, args: tuple, kw: dict) -> tuple:
        """(device, key of the compiled variant, bound arguments, the variant compiled
        before or None) through Triton's binder; key None where the JIT must launch."""
        kn, caches = self._knobs, getattr(self.fn, "device_caches", None)
        if (kn is None or caches is None or getattr(self.fn, "pre_run_hooks", None)
                or kn.runtime.debug
                or getattr(kn.runtime, "add_stages_inspection_hook", None) is not None
                or not (_no_hooks(kn.runtime.launch_enter_hook)
                        and _no_hooks(kn.runtime.launch_exit_hook))):
            return None, None, None, None
        device = self._driver.active.get_current_device()
        if device not in caches or len(caches[device]) != 5:  # first launch, or another Triton
            return device, None, None, None
        params, spec, options = caches[device][4](*args, **kw)
        key = (device, tuple(spec), tuple((k, type(v), v) for k, v in options.items()),
               getattr(kn.compilation, "instrumentation_mode", None),
               getattr(kn.compilation, "fpsan_homomorphic_casts", None))
        try:
            return device, key, params, self.compiled.get(key)
        except TypeError:  # an unhashable constexpr
            return device, None, None, None


if triton is not None:  # the attention launches of an eager forward, past Triton's JIT
    _STORE_KV, _PAGED, _PAGED_SPLIT, _FIXED_SPLIT = map(BoundLaunch, (
        kern.store_kv_kernel, kern.paged_attention_kernel, kern.paged_attention_split_kernel,
        kern.fixed_split_attention_kernel))


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for host code: `triton.cdiv` costs a JIT-function call (~1.5 us)."""
    return -(-a // b)


def next_pow2(n: int, lo: int = 16) -> int:
    return max(lo, 1 << (max(n, 1) - 1).bit_length())


def no_specialize(ints: list[str], ptrs: list[str] = ()) -> dict:
    """`triton.jit` keywords for arguments that change from launch to launch: no
    specialization on the values of `ints`, nor on the alignment of `ints` and `ptrs` (each
    would compile a new variant mid-run); only the keywords this Triton accepts."""
    params = inspect.signature(triton.jit).parameters
    return {k: v for k, v in (("do_not_specialize", list(ints)),
                              ("do_not_specialize_on_alignment", list(ints) + list(ptrs)))
            if k in params}


class TritonAttention(AttentionBackend):
    """Paged attention in Triton: prefill, decode and verify through one kernel, or split-KV
    for a few long contexts.

    With `deterministic`, every launch takes `fixed_split_attention_kernel` with
    `DETERMINISTIC_TILE`: a row's keys split at fixed positions every `keys_per_split` keys,
    each split reduced in 64-key steps from its start, the splits folded in order; nothing
    of this depends on the launch (rows, batch, prefill or decode, cached prefix, split
    programs) or the device, so a row rounds alike wherever it is computed. A launch of few
    sequences of at most 64 query rows each (`use_split`) spreads the splits over programs and folds
    their partials in a second kernel through the same arithmetic; any other launch folds
    them in the program of the tile.
    """

    name = "triton"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
                 split_keys: int | None = None, min_tile: int = 32, deterministic: bool = False):
        if triton is None:
            raise RuntimeError("the triton attention backend needs the `triton` package")
        super().__init__(num_heads, num_kv_heads, head_dim, block_size, deterministic)
        if num_heads % num_kv_heads:
            raise ValueError(f"{num_heads} heads do not group over {num_kv_heads} KV heads")
        self.group = num_heads // num_kv_heads
        # Keys per split of the split-KV path: fixed, so a sequence's partition never depends
        # on how many queries it brings (decode and verify reduce in the same order). None:
        # the device's `long_context` (deterministic: `DETERMINISTIC_SPLIT_KEYS`).
        self.split_keys = split_keys
        if deterministic and split_keys is not None and split_keys % DETERMINISTIC_TILE[1]:
            raise ValueError(f"split_keys={split_keys} is no multiple of the "
                             f"{DETERMINISTIC_TILE[1]}-key step")
        # Fewest rows a program's tile holds (`tile_m`): 32 keeps the target's decode and
        # verify rows rounding alike; the draft head, whose numbers no other path must
        # match, takes 16 (`draft_attention`).
        self.min_tile = min_tile

    def store_kv(self, k, v, kv_cache, meta: AttentionMetadata) -> None:
        t = k.shape[0]
        if t == 0:
            return
        row = self.num_kv_heads * self.head_dim
        k = k.reshape(t, row)
        v = v.reshape(t, row)
        kc, vc = kv_cache[0], kv_cache[1]
        _STORE_KV[(t,)](k, v, kc, vc, meta.slot_mapping, k.stride(0), v.stride(0),
                        kc.stride(1), ROW=row, BLOCK=next_pow2(row))

    def keys_per_split(self, device: torch.device) -> int:
        """Keys per split: this backend's `split_keys`, else the deterministic mode's one size
        on every device, else the default mode's (`long_context`)."""
        if self.split_keys is not None:
            return self.split_keys
        return DETERMINISTIC_SPLIT_KEYS if self.deterministic else long_context(device)

    def long_from(self, device: torch.device) -> int:
        """Contexts past this many keys may take the split-KV path (`use_split`)."""
        return self.split_keys if self.split_keys is not None else long_context(device)

    def block_n(self, device: torch.device) -> int:
        """Keys per inner step (both kernels): 4 pages, 16 to 64, within a split (one
        128-key step per split was slower)."""
        if self.deterministic:
            return DETERMINISTIC_TILE[1]
        return max(16, min(64, 4 * self.block_size, self.keys_per_split(device)))

    def tile_m(self, max_query_len: int) -> int:
        """Rows per program: enough for one step's grouped heads, between 32 and 64, so decode and
        verify share one tile shape and a row reduces in the same order in both (greedy
        speculation stays token-identical to no speculation); deterministic: always
        `DETERMINISTIC_TILE`'s rows."""
        if self.deterministic:
            return DETERMINISTIC_TILE[0]
        return min(64, max(self.min_tile, next_pow2(max_query_len * self.group)))

    def warps(self, block_m: int) -> int:
        """Warps per program for a tile of block_m rows."""
        if self.deterministic:
            return DETERMINISTIC_TILE[2]
        return 4 if block_m <= 32 else 8

    def max_split_seqs(self, device: torch.device) -> int:
        """The most sequences a batch may hold and still take the split-KV path."""
        return (sm_count(device) - 1) // self.num_kv_heads

    def use_split(self, meta: AttentionMetadata, device: torch.device) -> int:
        """Number of splits for this launch (0: the one-pass kernel, or in the deterministic
        mode one program per tile). Split only for contexts past `long_from`, when a sequence
        brings at most 64 query rows (one tile in the default mode) and (KV head, sequence)
        programs alone would leave most of the GPU idle; the split count covers the block
        table's capacity, so it is static for a captured batch bucket."""
        if (meta.block_tables is None or meta.max_query_len * self.group > 64
                or meta.max_seq_len <= self.long_from(device)):
            return 0
        if meta.num_seqs > self.max_split_seqs(device):
            return 0
        capacity = meta.block_tables.shape[1] * self.block_size
        splits = cdiv(capacity, self.keys_per_split(device))
        return splits if splits > 1 else 0

    def split_programs(self, splits: int, num_seqs: int, device: torch.device) -> int:
        """Programs per (KV head, sequence) of a split launch: about four per multiprocessor
        in all (fewer leave too few loads in flight), each taking every P-th split."""
        per = cdiv(4 * sm_count(device), self.num_kv_heads * num_seqs)
        return max(1, min(splits, per))

    def attend(self, q, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        out = torch.empty_like(q)
        if q.shape[0] == 0:
            return out
        kc, vc = kv_cache[0], kv_cache[1]  # [blocks, block, kv_heads, d]
        splits = self.use_split(meta, q.device)
        if self.deterministic:
            return self._attend_fixed_splits(q, kc, vc, out, meta, splits)
        if splits:
            return self._attend_split(q, kc, vc, out, meta, splits)
        block_m = self.tile_m(meta.max_query_len)
        grid = (cdiv(meta.max_query_len * self.group, block_m), self.num_kv_heads,
                meta.num_seqs)
        precision = "ieee" if q.dtype == torch.float32 else "tf32"
        _PAGED[grid](
            q, kc, vc, out, meta.query_start, meta.seq_lens, meta.block_tables, self.scale,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1),
            kc.stride(0), kc.stride(1), kc.stride(2), meta.block_tables.stride(0),
            G=self.group, HEAD_DIM=self.head_dim, BLOCK_D=next_pow2(self.head_dim),
            PAGE=self.block_size, BLOCK_M=block_m, BLOCK_N=self.block_n(q.device),
            PRECISION=precision, num_warps=self.warps(block_m), **pdl_args(q),
        )
        return out

    @staticmethod
    def _partials(q, splits: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Per split and query row, each head's unnormalized acc and its (max, sum)."""
        t, h, dim = q.shape
        return (torch.empty(splits, t, h, dim, dtype=torch.float32, device=q.device),
                torch.empty(splits, t, h, 2, dtype=torch.float32, device=q.device))

    def _attend_fixed_splits(self, q, kc, vc, out, meta: AttentionMetadata, splits: int):
        """The deterministic mode's launch: `splits` from `use_split` spreads each sequence's
        splits over programs (partials, then `fold_splits_kernel`); 0 folds in the tile's."""
        programs = self.split_programs(splits, meta.num_seqs, q.device) if splits else 1
        # One program per tile touches no partials: a stand-in of the same dtype and head
        # stride keeps one compiled kernel for both cases.
        acc, ml = self._partials(q, splits) if programs > 1 else self._partials(q[:1, :1], 1)
        block_m, precision = DETERMINISTIC_TILE[0], "ieee" if q.dtype == torch.float32 else "tf32"
        tiles = cdiv(meta.max_query_len * self.group, block_m)
        _FIXED_SPLIT[(tiles * programs, self.num_kv_heads, meta.num_seqs)](
            q, kc, vc, out, acc, ml, meta.query_start, meta.seq_lens, meta.block_tables,
            self.scale, programs, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
            kc.stride(0), kc.stride(1), kc.stride(2), meta.block_tables.stride(0),
            acc.stride(0), acc.stride(1), acc.stride(2), ml.stride(0), ml.stride(1),
            G=self.group, HEAD_DIM=self.head_dim, BLOCK_D=next_pow2(self.head_dim),
            PAGE=self.block_size, BLOCK_M=block_m, BLOCK_N=DETERMINISTIC_TILE[1],
            SPLIT_KEYS=self.keys_per_split(q.device), PRECISION=precision,
            num_warps=DETERMINISTIC_TILE[2], **pdl_args(q),
        )
        if programs > 1:
            self._combine(kern.fold_splits_kernel, q, acc, ml, out, meta)
        return out

    def _attend_split(self, q, kc, vc, out, meta: AttentionMetadata, splits: int):
        acc, ml = self._partials(q, splits)
        block_m = self.tile_m(meta.max_query_len)
        precision = "ieee" if q.dtype == torch.float32 else "tf32"
        programs = self.split_programs(splits, meta.num_seqs, q.device)
        # Tiles, key blocks and warps as the one-pass kernel's: a context within one split
        # reduces in the same order on both paths.
        _PAGED_SPLIT[(programs, self.num_kv_heads, meta.num_seqs)](
            q, kc, vc, acc, ml, meta.query_start, meta.seq_lens, meta.block_tables, self.scale,
            q.stride(0), q.stride(1), kc.stride(0), kc.stride(1), kc.stride(2),
            meta.block_tables.stride(0), acc.stride(0), acc.stride(1), acc.stride(2),
            ml.stride(0), ml.stride(1),
            G=self.group, HEAD_DIM=self.head_dim, BLOCK_D=next_pow2(self.head_dim),
            PAGE=self.block_size, BLOCK_M=block_m, BLOCK_N=self.block_n(q.device),
            SPLIT_KEYS=self.keys_per_split(q.device), PRECISION=precision,
            num_warps=self.warps(block_m), **pdl_args(q),
        )
        return self._combine(kern.split_reduce_kernel, q, acc, ml, out, meta)

    def _combine(self, kernel, q, acc, ml, out, meta: AttentionMetadata):
        """Launch `kernel` (the default or the deterministic fold) over each query token and head
        to combine the split partials into `out`."""
        kernel[(meta.max_query_len, self.num_heads, meta.num_seqs)](
            acc, ml, out, meta.query_start, meta.seq_lens,
            acc.stride(0), acc.stride(1), acc.stride(2), ml.stride(0), ml.stride(1),
            out.stride(0), out.stride(1), SPLIT_KEYS=self.keys_per_split(q.device),
            HEAD_DIM=self.head_dim, BLOCK_D=next_pow2(self.head_dim), num_warps=1,
            **pdl_args(q),
        )
        return out


_SMS: dict[str, int] = {}


def sm_count(device: torch.device) -> int:
    """Multiprocessors of the device (the CPU interpreter: 8, so tests take the split path)."""
    key = str(device)
    if key not in _SMS:
        _SMS[key] = (torch.cuda.get_device_properties(device).multi_processor_count
                     if device.type == "cuda" else 8)
    return _SMS[key]

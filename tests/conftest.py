"""Shared fixtures: the real model loads once per test session."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest
import torch

# Without a GPU, Triton kernels run in Triton's interpreter (must be set before they are defined).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Under pytest-xdist each worker takes an equal share of the cores for torch's threads (and
# passes it to the processes it starts), unless OMP_NUM_THREADS was set: on the 2-core CI
# machine two workers of two threads each ran tests/spec/test_spec_real_model.py and
# tests/spec/test_eagle3.py in 446 s, one thread each in 293 s.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 0)
if _WORKERS > 1 and "OMP_NUM_THREADS" not in os.environ:
    _share = max(1, (os.cpu_count() or 1) // _WORKERS)
    os.environ["OMP_NUM_THREADS"] = str(_share)
    torch.set_num_threads(_share)


def _row_independent_dots() -> None:
    """The interpreter's tl.dot is one numpy matmul, and numpy's BLAS may sum a one-row
    product (a GEMV) in another order than the same row inside a taller one (on an AVX-512
    EPYC a row of a [6, 64] @ [64, 16] product differed from the row alone by up to 4e-6).
    A GPU tile's MMA computes each row on its own, in the tile's order: the interpreter
    computes each row of a 2-D dot as its own matmul, so kernels whose rows must not depend
    on their neighbours (a verify row against a decode row) are tested as they run."""
    import numpy as np
    from triton.runtime import interpreter

    dot = interpreter.InterpreterBuilder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.data.ndim != 2 or a.data.shape[0] == 1:
            return dot(self, a, b, d, input_precision, max_num_imprecise_acc)
        rows = [dot(self, interpreter.TensorHandle(a.data[i:i + 1], a.dtype), b,
                    interpreter.TensorHandle(d.data[i:i + 1], d.dtype), input_precision,
                    max_num_imprecise_acc).data for i in range(a.data.shape[0])]
        return interpreter.TensorHandle(np.concatenate(rows), d.dtype.scalar)

    interpreter.InterpreterBuilder.create_dot = create_dot


def _lighter_interpreter() -> None:
    """Costs of Triton's interpreter that change no result: these two (together about a third
    of the time of the tests that run kernels on the CPU), then the per-op bookkeeping of the
    functions below it (about another third of what was left):

    - Its options turn on `sanitize_overflow` while `debug` stays off, so every 32-bit
      integer add, sub and mul is recomputed in 64 bits and compared with the bounds for a
      `device_assert` that `debug` off makes a no-op: the check's result is always thrown
      away. Off, as it is on a GPU without debug.
    - Every kernel launch and every call of a device function re-patches the language
      modules, finding their builtins with `inspect.getmembers` (all of a module's members,
      sorted). The names of the builtins never change: found once per module, each launch
      patches the same ones, as before."""
    import dataclasses
    import inspect

    from triton.runtime import interpreter

    builder = interpreter.interpreter_builder
    builder.options = dataclasses.replace(builder.options, sanitize_overflow=False)

    is_builtin = interpreter.tl.core.is_builtin
    names: dict[int, list[str]] = {}

    def patch_builtin(pkg, builder, scope):
        if id(pkg) not in names:
            names[id(pkg)] = [n for n, m in inspect.getmembers(pkg) if is_builtin(m)]
        for name in names[id(pkg)]:
            member = getattr(pkg, name)
            if is_builtin(member):  # not patched already (a device function's call)
                interpreter._patch_attr(pkg, name, member, builder, scope)

    interpreter._patch_builtin = patch_builtin
    interpreter._patch_attr = _builtin_wrapper(interpreter)
    _device_calls_keep_the_launchs_patches(interpreter)
    _np_dtypes_found_once(interpreter)
    _block_types_checked_once(interpreter.tl.core)
    _tensor_shapes_made_once(interpreter.tl.core)
    _equal_blocks_not_broadcast(interpreter)


def _builtin_wrapper(interpreter):
    """`_patch_attr` as the interpreter has it, each patched builtin passing the interpreter's
    semantic in place of any `_semantic` given, without copying the keywords into a new dict on
    every call."""

    def patch_attr(obj, name, member, builder, scope):
        def new_member(*args, **kwargs):
            kwargs.pop("_semantic", None)  # (a dict of this call's own)
            return member(*args, **kwargs, _semantic=interpreter.interpreter_semantic)

        scope.set_attr(obj, name, new_member)

    return patch_attr


def _device_calls_keep_the_launchs_patches(interpreter) -> None:
    """Every call of a device function inside a kernel patches the language modules of its
    module's globals again (builtins, tensor methods, range, reduce: the same functions the
    launch running it patched, never restored by the call), and finds those modules by
    scanning the globals each time. Inside a launch that patched the same modules, a device
    call patches nothing (the launch's patches stay in place until it restores them); modules
    the launch did not patch, functions that see no language module (the interpreter's own
    error), calls outside a launch and calls after a nested launch's restore patch as before.
    Launches are serialised: the patches are the process's, and one thread's restore would
    unpatch another's running kernel."""
    import inspect
    import threading

    tl = interpreter.tl
    real_patch_lang = interpreter._patch_lang
    real_call = interpreter.GridExecutor.__call__
    langs_of: dict = {}
    lock = threading.RLock()
    # Per thread: `starting` while a launch's own patch is next, `patched` the modules the
    # running launch (and its device calls) patched, None outside a launch.
    launch = threading.local()

    def call(self, *args, **kwargs):
        with lock:
            outer = getattr(launch, "patched", None)
            launch.patched, launch.starting = None, True
            try:
                return real_call(self, *args, **kwargs)
            finally:
                # A nested launch's restore undid patches the outer launch may rely on.
                launch.patched, launch.starting = (None if outer is None else set()), False

    def patch_lang(fn):
        langs = langs_of.get(fn)
        if langs is None:
            langs = langs_of[fn] = frozenset(
                id(v) for v in fn.__globals__.values()
                if inspect.ismodule(v) and v in [tl, tl.core])
        patched = getattr(launch, "patched", None)
        if langs and patched is not None and langs <= patched:
            return interpreter._LangPatchScope()  # nothing to restore
        scope = real_patch_lang(fn)
        if getattr(launch, "starting", False):  # the launch's own patch
            launch.patched, launch.starting = set(langs), False
        elif patched is not None:
            patched.update(langs)
        return scope

    interpreter.GridExecutor.__call__ = call
    interpreter._patch_lang = patch_lang


def _np_dtypes_found_once(interpreter) -> None:
    """The interpreter maps a Triton dtype to numpy's by building a dict of every dtype on each
    call: each dtype's answer, found once, is kept, keyed by the dtype's class and name (a
    block type's or pointer's name spells its element type's)."""
    real = interpreter._get_np_dtype
    found: dict = {}

    def get_np_dtype(tt_dtype):
        key = (type(tt_dtype), getattr(tt_dtype, "name", None))
        np_dtype = found.get(key)
        if np_dtype is None:
            np_dtype = real(tt_dtype)
            if key[1] is not None:
                found[key] = np_dtype
        return np_dtype

    interpreter._get_np_dtype = get_np_dtype


def _block_types_checked_once(core) -> None:
    """Every op of every interpreted program makes block types for its result, each unwrapping
    and checking its shape (a power of two per dimension, at most Triton's element count) and
    spelling its name. For a shape of plain ints already seen with the same element type, the
    checked shape, count and name it got then are set again; others are made as before."""
    real_init = core.block_type.__init__
    made: dict = {}

    def init(self, element_ty, shape):
        # Kept: a list or Triton tuple (others fail the real check) of plain ints, of a named type.
        name = getattr(element_ty, "name", None)
        key = ((type(element_ty), name, *shape) if name is not None
               and isinstance(shape, (list, core.tuple)) and all(type(d) is int for d in shape)
               else None)
        hit = made.get(key) if key is not None else None
        if hit is None:
            real_init(self, element_ty, shape)
            if key is not None:
                made[key] = (self.shape, self.numel, self.name)
            return
        self.element_ty = element_ty
        self.shape, self.numel, self.name = hit

    core.block_type.__init__ = init


def _tensor_shapes_made_once(core) -> None:
    """Every tensor an interpreted op makes spells its shape as a Triton tuple of constexprs
    whose tuple type it works out element by element, and its element count as a constexpr.
    For a shape already seen, the tensor takes the constexprs (values, never changed) and the
    tuple type made then, in a tuple of its own; the attributes are the same as before."""
    real_init = core.tensor.__init__
    made: dict = {}

    def init(self, handle, type):
        if type.is_block():
            dims = getattr(type.shape, "values", type.shape)  # a Triton tuple's ints
            key = (*dims,) if all(d.__class__ is int for d in dims) else None
        else:
            key = ()
        hit = made.get(key) if key is not None else None
        if hit is None:
            real_init(self, handle, type)
            if key is not None:
                made[key] = (list(self.shape.values), self.shape.type, self.numel)
            return
        values, tuple_type, numel = hit
        self.handle = handle
        self.numel = numel
        self.type = type
        self.dtype = type.scalar
        self.shape = core.tuple(values, tuple_type)

    core.tensor.__init__ = init


def _equal_blocks_not_broadcast(interpreter) -> None:
    """The semantic's broadcast of two operands returns two blocks of one shape as they are,
    after building the result's shape dimension by dimension and comparing it with each
    operand's (Triton tuples of constexprs): blocks of one shape whose handles hold scalar
    dtypes are returned as they are at once."""
    semantic = interpreter.interpreter_semantic
    real = type(semantic).broadcast_impl_value
    block_type = interpreter.tl.core.block_type

    def broadcast_impl_value(self, lhs, rhs):
        lt, rt = lhs.type, rhs.type
        if (self is semantic and isinstance(lt, block_type) and isinstance(rt, block_type)
                and lt.shape == rt.shape
                and not isinstance(lhs.handle.dtype, block_type)
                and not isinstance(rhs.handle.dtype, block_type)):
            return lhs, rhs
        return real(self, lhs, rhs)

    type(semantic).broadcast_impl_value = broadcast_impl_value


if os.environ.get("TRITON_INTERPRET") == "1":
    try:
        _row_independent_dots()
    except ImportError:  # no Triton: the torch backends only
        pass
    try:
        _lighter_interpreter()
    except (ImportError, AttributeError):  # another Triton: its interpreter as it ships
        pass

CHAT_PROMPTS = [
    "What is the capital of France? Answer in one sentence.",
    "Write a Python function that returns the n-th Fibonacci number.",
    "List three fruits that are red.",
    "Translate 'good morning, my friend' into Spanish.",
    "Explain what a hash table is to a ten-year-old.",
    'Give me a JSON object with keys "name" and "age" for a fictional person.',
    "Write a haiku about the ocean at night.",
    "What is 17 times 23? Show your steps.",
    "Summarize the plot of Romeo and Juliet in two sentences.",
    "Why do cats purr?",
]


# Test files that start a Ray cluster: under pytest-xdist (`make test` runs two workers) they
# go to one worker, since two clusters on one machine at once refuse each other's actors.
RAY_DIRS = ("cluster_e2e",)

# Seconds per unit (a test file, or "ray" for the Ray cluster files) of the last
# `make test-durations` on the 2-core CI machine, only for the order in which xdist workers
# take units (`FileScheduling`): longest first. A unit missing from it (a new file) counts 0.
DURATIONS_FILE = os.path.join(os.path.dirname(__file__), "durations.json")
# Set (to a path) by `make test-durations`: this run's seconds per unit are written there.
RECORD_DURATIONS = os.environ.get("TANDEM_RECORD_DURATIONS")


def _unit(nodeid: str) -> str:
    path = nodeid.split("::")[0]
    return "ray" if any(d in path.split("/") for d in RAY_DIRS) else path


def _load_durations() -> dict[str, float]:
    try:
        with open(DURATIONS_FILE) as f:
            return {str(k): float(v) for k, v in json.load(f).items()}
    except (OSError, ValueError, AttributeError):  # missing or unreadable: no order
        return {}


SLOW_FILES = _load_durations()
_recorded: dict[str, float] = {}


def pytest_runtest_logreport(report):
    """With TANDEM_RECORD_DURATIONS: add each phase's time (setup, call, teardown) to its
    unit's (under xdist the controller sees every worker's reports)."""
    if RECORD_DURATIONS and not os.environ.get("PYTEST_XDIST_WORKER"):
        unit = _unit(report.nodeid)
        _recorded[unit] = _recorded.get(unit, 0.0) + report.duration


def pytest_sessionfinish(session, exitstatus):
    if RECORD_DURATIONS and _recorded and not os.environ.get("PYTEST_XDIST_WORKER"):
        with open(RECORD_DURATIONS, "w") as f:
            json.dump({u: round(t, 1) for u, t in sorted(_recorded.items(),
                                                          key=lambda kv: -kv[1])}, f, indent=1)
            f.write("\n")


if importlib.util.find_spec("xdist") is not None:

    def pytest_xdist_make_scheduler(config, log):
        """--dist loadgroup: whole files per worker (their module fixtures load once), the Ray
        files as one unit. (xdist's own xdist_group marks need it to rename test ids, which
        pytest 9 no longer lets it do.)"""
        if config.getvalue("dist") != "loadgroup":
            return None
        from xdist.scheduler import LoadScopeScheduling

        class FileScheduling(LoadScopeScheduling):
            def _split_scope(self, nodeid: str) -> str:
                return _unit(nodeid)

            def _assign_work_unit(self, node) -> None:
                """The longest unit left first (xdist orders units by test count, which put
                the Ray cluster's few long tests near the end, one worker running them while
                the other sat idle); the many short files fill in at the end."""
                heaviest = max(self.workqueue, key=lambda s: (SLOW_FILES.get(s, 0),
                                                              len(self.workqueue[s])))
                self.workqueue.move_to_end(heaviest, last=False)
                super()._assign_work_unit(node)

        return FileScheduling(config, log)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def smol_engine():
    """The embedded SmolLM2-135M-Instruct, fp32 on CPU, through the engine's own loader, from
    the model's export to safetensors (`embedded_export`: the same config, tokenizer and
    weights, made once per machine), which loads without parsing the GGUF's metadata again."""
    from cluster.soak_cluster import embedded_export
    from engine import Engine

    return Engine.from_pretrained(embedded_export(), dtype=torch.float32, device="cpu")


def _hf_oracle_folder() -> str:
    """The embedded checkpoint as transformers reads it from the GGUF, saved once per machine
    by transformers itself (beside the engine's export, keyed by the same GGUF)."""
    import shutil
    import tempfile

    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM

    from cluster.soak_cluster import embedded_export
    from engine.loader import embedded_checkpoint

    out = os.path.join(os.path.dirname(embedded_export()), "hf-oracle")
    if os.path.isfile(os.path.join(out, "model.safetensors")):
        return out
    ck = embedded_checkpoint()
    hf = AutoModelForCausalLM.from_pretrained(ck.folder, gguf_file=ck.gguf_file,
                                              dtype=torch.float32)
    tmp = tempfile.mkdtemp(dir=os.path.dirname(out))  # renamed into place whole
    # (save_pretrained refuses a model read from a GGUF: its tensors, config and generation
    # config are written as save_pretrained would.)
    try:
        save_model(hf, os.path.join(tmp, "model.safetensors"))
        hf.config.save_pretrained(tmp)
        hf.generation_config.save_pretrained(tmp)
        os.rename(tmp, out)
    except OSError:  # another worker finished first (or the disk refused): nothing left half
        shutil.rmtree(tmp, ignore_errors=True)
        if not os.path.isfile(os.path.join(out, "model.safetensors")):
            raise
    return out


@pytest.fixture(scope="session")
def hf_smol():
    """The same checkpoint loaded by transformers alone: the oracle (transformers' own copy
    of what it read from the GGUF, `_hf_oracle_folder`)."""
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(_hf_oracle_folder(), dtype=torch.float32)
    return m.eval()


@pytest.fixture(scope="session")
def chat_ids(smol_engine):
    """Token ids of the chat prompts, rendered with the model's template."""
    return [smol_engine.tokenizer.apply_chat([{"role": "user", "content": p}])
            for p in CHAT_PROMPTS]

"""The deterministic mode through the engine (CPU, fp32, torch backend): a request's greedy tokens
and every bit of the target's KV it wrote are the same alone or among other streams arriving at
other steps, with speculation none / n-gram / EAGLE-3 at fixed K 1..7 and dynamic K, from a
prefix-cache hit or a miss, prefilled whole or in chunks, disaggregated or colocated, and in a
fresh process's engine. The KV is compared through the prefix cache: after a run, each full
block a request computed is still cached under the hash of its tokens. The default mode's KV
differs between a lone and a batched run (a negative control: these tests can fail)."""

from __future__ import annotations

import hashlib
import os
import random
import subprocess
import sys

import pytest
import torch

from bench.common import staggered, variant
from engine import Engine, SamplingParams
from engine.block_manager import block_hash
from engine.config import SpecConfig
from engine.testing import random_head, tiny_engine
from tests.engine.test_handoff import disaggregated
from tests.helpers import one_thread  # noqa: F401  (autouse: one intra-op thread)

GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
ENGINE = dict(max_num_batched_tokens=256, deterministic=True)




@pytest.fixture(scope="module")
def base() -> Engine:
    return tiny_engine(0, **ENGINE)


@pytest.fixture(scope="module")
def head(base):
    return random_head(base)


def prompts(n: int, seed: int = 11) -> list[list[int]]:
    # Repeated patterns, so n-gram and context drafts are often right and the accept path runs.
    rng = random.Random(seed)
    return [[rng.randrange(30) for _ in range(rng.randrange(3, 14))] * 2 for _ in range(n)]


def engine_like(base: Engine, head=None, spec: dict | None = None, deterministic: bool = True,
                **cfg) -> Engine:
    """`bench.common.variant` with the speculation as SpecConfig keywords (none when empty)."""
    return variant(base, head, deterministic, spec=SpecConfig(**spec) if spec else None, **cfg)


def kv_of(eng: Engine, seq: list[int]) -> dict[bytes, torch.Tensor]:
    """The target layers' K and V of each full block of `seq` still in `eng`'s prefix cache."""
    bs, layers = eng.config.block_size, eng.config.model.num_layers
    out, parent = {}, b""
    for i in range(len(seq) // bs):
        parent = block_hash(parent, seq[i * bs:(i + 1) * bs])
        bid = eng.blocks.by_hash.get(parent)
        if bid is not None:
            out[parent] = eng.kv_cache[:layers, :, bid].clone()
    return out


def run(eng: Engine, ps, stagger: int = 0):
    """Greedy tokens of each prompt and the KV each left in the prefix cache. `stagger`: a new
    request joins every `stagger` engine steps instead of all at once."""
    toks = staggered(eng, ps, GREEDY, stagger)
    eng.blocks.check_all_free()
    return toks, [kv_of(eng, p + t) for p, t in zip(ps, toks)]


def assert_same(got, want) -> None:
    """Same tokens, and every KV block both runs cached bit for bit equal (at least one each)."""
    (gt, gkv), (wt, wkv) = got, want
    assert gt == wt
    for g, w in zip(gkv, wkv):
        common = g.keys() & w.keys()
        assert common
        for h in common:
            assert torch.equal(g[h], w[h])


@pytest.fixture(scope="module")
def alone(base):
    """The reference: each prompt on its own in a fresh engine, no speculation, whole prefill."""
    ps = prompts(6)
    runs = [run(engine_like(base), [p]) for p in ps]
    return ps, ([r[0][0] for r in runs], [r[1][0] for r in runs])


def test_batched_staggered_and_chunked_runs_equal_lone_runs(base, alone):
    ps, want = alone
    assert_same(run(engine_like(base), ps), want)
    assert_same(run(engine_like(base), ps, stagger=3), want)
    chunked = engine_like(base, max_num_batched_tokens=5)  # prompts cut mid-way, several chunks
    assert_same(run(chunked, ps, stagger=2), want)


def test_a_prefix_cache_hit_equals_a_miss(base, alone):
    ps, want = alone
    eng = engine_like(base)
    run(eng, ps)  # every prompt's blocks now cached
    assert_same(run(eng, ps, stagger=2), want)  # each prefill starts from its cached prefix
    assert eng.blocks.prefix_hit_tokens > 0


SPECS = [dict(method="ngram", num_tokens=k, dynamic=False) for k in (1, 4, 7)] + \
        [dict(method="ngram", num_tokens=5, dynamic=True)] + \
        [dict(method="eagle3", num_tokens=k, dynamic=False) for k in (1, 2, 3, 5, 6, 7)] + \
        [dict(method="eagle3", num_tokens=7, dynamic=True)]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s['method']}-k{s['num_tokens']}"
                         f"{'-dyn' if s['dynamic'] else ''}")
def test_speculation_equals_no_speculation_bit_for_bit(base, head, alone, spec):
    ps, want = alone
    eng = engine_like(base, head, spec=spec)
    assert_same(run(eng, ps, stagger=2), want)
    st = eng.spec.stats
    assert st.verify_steps > 0
    if spec["method"] == "ngram":
        assert sum(st.accepted_per_pos) > 0  # verify rows were kept, not only recomputed


@pytest.mark.parametrize("spec", [None, dict(method="eagle3", num_tokens=3, dynamic=False)])
def test_disaggregated_equals_colocated(base, head, alone, spec):
    ps, want = alone
    pre, dec = (engine_like(base, head, spec=spec) for _ in range(2))
    toks = disaggregated(pre, dec, ps, GREEDY)
    assert_same((toks, [kv_of(dec, p + t) for p, t in zip(ps, toks)]), want)


def digest(toks, kvs) -> str:
    """One hash of the tokens and the cached KV bits of a run."""
    h = hashlib.sha256(repr(toks).encode())
    for kv in kvs:
        for key in sorted(kv):
            h.update(key + kv[key].numpy().tobytes())
    return h.hexdigest()


FRESH = """
import torch, sys
sys.path.insert(0, {root!r})
torch.set_num_threads(1)
from engine.testing import tiny_engine
from tests.engine.test_deterministic_engine import ENGINE, digest, prompts, run
print(digest(*run(tiny_engine(0, **ENGINE), prompts(6), stagger=2)))
"""


def test_a_restarted_process_equals_the_first(alone):
    ps, want = alone
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run([sys.executable, "-c", FRESH.format(root=root)], capture_output=True,
                         text=True, timeout=300, cwd=root)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-1] == digest(*want)


def test_default_mode_kv_differs_between_a_lone_and_a_batched_run(base, alone):
    """Negative control: without the deterministic mode, a row's bits depend on the launch, so
    some KV block of a batched run differs from the lone run's (the tokens may still agree)."""
    ps, _ = alone
    plain = engine_like(base, deterministic=False)
    lone = [run(engine_like(base, deterministic=False), [p]) for p in ps]
    _, batched = run(plain, ps)
    differs = [not torch.equal(b[h], lone_kv[1][0][h])
               for b, lone_kv in zip(batched, lone) for h in b.keys() & lone_kv[1][0].keys()]
    assert any(differs)

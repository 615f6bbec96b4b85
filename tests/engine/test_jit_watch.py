"""engine/jit_watch.py: Triton compiles recorded through Triton's JIT hooks (on the CPU the
interpreter compiles nothing, so the hooks are called as Triton calls them)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

triton = pytest.importorskip("triton")


@pytest.fixture
def hooks(monkeypatch):
    from triton import knobs

    from engine import jit_watch

    rt = knobs.runtime
    seen = []
    monkeypatch.setattr(rt, "jit_cache_hook", None)
    monkeypatch.setattr(rt, "jit_post_compile_hook", lambda **kw: seen.append(kw["fn"].name))
    monkeypatch.setattr(jit_watch, "_installed", False)
    monkeypatch.setattr(jit_watch, "_events", [])
    monkeypatch.setattr(jit_watch, "_warn_from", None)
    assert jit_watch.install() and jit_watch.install()  # once; the second call is a no-op
    return rt, seen


def compile_(rt, name: str) -> None:
    fn = SimpleNamespace(name=name)
    assert not rt.jit_cache_hook(key="k", repr=name, fn=fn, compile={},
                                 is_manual_warmup=False, already_compiled=False)
    rt.jit_post_compile_hook(key="k", repr=name, fn=fn, compile={}, is_manual_warmup=False,
                             already_compiled=False)


def test_compiles_are_recorded_per_window_and_earlier_hooks_still_run(hooks):
    from engine import jit_watch

    rt, seen = hooks
    compile_(rt, "_gemv")
    mark = jit_watch.count()
    compile_(rt, "_attn")
    compile_(rt, "_attn")
    events = jit_watch.since(mark)
    assert [e.name for e in events] == ["_attn", "_attn"]
    assert all(e.seconds >= 0 for e in events)
    summary = jit_watch.summary(events)
    assert list(summary) == ["_attn"] and summary["_attn"][0] == 2
    assert seen == ["_gemv", "_attn", "_attn"]  # the hook set before install still called


def test_compiles_after_start_up_are_logged(hooks, caplog):
    from engine import jit_watch

    rt, _ = hooks
    compile_(rt, "_at_start_up")
    jit_watch.warn_after()
    with caplog.at_level(logging.WARNING, logger="engine.jit_watch"):
        compile_(rt, "_while_serving")
    msgs = [r.getMessage() for r in caplog.records]
    assert len(msgs) == 1 and "_while_serving" in msgs[0] and "compiled while serving" in msgs[0]


def test_steady_window_records_compiles_and_captures(hooks, monkeypatch):
    """bench.suite's timed windows carry what compiled, what was captured and the garbage
    collections inside them."""
    import gc

    from bench.suite import window_events, window_mark
    from engine.graphs import GraphSet

    rt, _ = hooks
    monkeypatch.setattr(GraphSet, "captures", GraphSet.captures)
    mark = window_mark()
    compile_(rt, "_late")
    GraphSet.captures += 2
    gc.collect()
    ev = window_events(mark)
    assert ev["compiles"] == {"_late": [1, pytest.approx(ev["compiles"]["_late"][1])]}
    assert ev["captures"] == 2
    assert ev["gc"][0] >= 1 and ev["gc"][1] > 0


@pytest.mark.parametrize("n_tokens,n_seqs", [(1, 1), (3, 2), (7, 3), (16, 5), (33, 8)])
def test_staged_views_are_16_byte_aligned_whatever_the_counts(n_tokens, n_seqs):
    """Eager forwards take their ids, positions, slots and metadata as views of one staged
    buffer, and every view starts 16-byte aligned whatever the token and sequence counts:
    Triton compiles a kernel variant per pointer alignment, so views whose alignment followed
    the counts compiled kernels in the middle of serving. Values survive the padding; the
    graph sets' static buffers are laid out alike."""
    from engine.graphs import GraphSet, pack, to_device
    from engine.staging import HostStager

    qlens = [n_tokens // n_seqs + (i < n_tokens % n_seqs) for i in range(n_seqs)]
    qlens = [q for q in qlens if q] or [1]
    n = sum(qlens)
    tables = [list(range(10 * i, 10 * i + 1 + i % 3)) for i in range(len(qlens))]
    pos = [j for q in qlens for j in range(q)]
    inp = pack(list(range(100, 100 + n)), pos, tables, qlens, 16)
    ids, p, meta = to_device(inp, HostStager("cpu", 64))
    base = ids.data_ptr()
    views = [ids, p, meta.slot_mapping, meta.query_start, meta.seq_lens, meta.block_tables]
    assert all((v.data_ptr() - base) % 16 == 0 for v in views)
    assert ids.tolist() == list(range(100, 100 + n)) and p.tolist() == pos
    assert meta.query_start.tolist() == inp.starts.tolist()
    assert meta.seq_lens.tolist() == inp.lens.tolist()
    assert meta.block_tables.tolist() == inp.tables.tolist()
    assert meta.slot_mapping.tolist() == inp.slots.tolist()
    g = GraphSet(lambda *a: (), "cpu", 2 * n_seqs + 1, (1, 3), 7)
    assert all(o % 2 == 0 for o in g.off.values()) and g.size >= g.off["tables"] + 7 * g.max_batch

"""The prompt sets come from a kept file, not from the running Python's docs: every machine
splits the same prompts the same way, and the name split keeps held-out names out of
training."""

from __future__ import annotations

import gzip
import json

import pytest

from cluster import prompt_sets


def test_build_reads_the_kept_file_not_the_standard_library(monkeypatch):
    """The kept file is what this module describes (its templated prompts are all in it),
    and building from it touches no stdlib module: the same prompts on any Python."""
    sets = prompt_sets.frozen()
    assert set(prompt_sets._templated()) <= set(sets["base"])
    assert set(prompt_sets._templated_more()) <= set(sets["base"]) | set(sets["extended"])
    assert not set(sets["base"]) & set(sets["extended"])
    want = prompt_sets.build(), prompt_sets.build(extended=True)

    def refuse(name, *a, **kw):
        raise AssertionError(f"build imported {name}")

    monkeypatch.setattr(prompt_sets.importlib, "import_module", refuse)
    assert (prompt_sets.build(), prompt_sets.build(extended=True)) == want


def _sets(path, base, extended=()):
    prompt_sets.write(str(path), {"python": "test", "base": list(base),
                                  "extended": list(extended)})
    return str(path)


def test_write_then_build_round_trips_and_a_missing_file_says_how_to_make_it(tmp_path):
    base = [f"Explain `m.f{i}` please." for i in range(40)]
    path = _sets(tmp_path / "s.json.gz", base)
    with gzip.open(path, "rt") as f:
        assert json.load(f)["base"] == base
    train, held = prompt_sets.build(path=path, eval_frac=0.2)
    assert sorted(train + held) == sorted(base) and held and not set(train) & set(held)
    assert prompt_sets.build(path=path, eval_frac=0.2) == (train, held)
    missing = str(tmp_path / "none.json.gz")
    with pytest.raises(FileNotFoundError, match="python -m cluster.prompt_sets --out"):
        prompt_sets.build(path=missing)
    bad = tmp_path / "bad.json.gz"
    with gzip.open(bad, "wt") as f:
        json.dump({"base": "not a list"}, f)
    with pytest.raises(ValueError, match="no 'base' and 'extended'"):
        prompt_sets.build(path=str(bad))


def test_name_split_keeps_held_out_names_out_of_training(tmp_path):
    """Each name is asked about two (base) or three (extended) ways; with the name split no
    training prompt mentions a name a held-out prompt (the set's own or the base set's)
    mentions, the held-out side is unchanged, and templated prompts (no names) stay."""
    names = [f"mod.f{i}" for i in range(60)]
    base = [f"Explain what `{n}` does." for n in names] + ["Explain tides in simple terms."]
    base += [f"Write a Python function that uses `{n}`." for n in names]
    more = [f"What are common mistakes when using `{n}`?" for n in names]
    path = _sets(tmp_path / "s.json.gz", base, more)
    for extended in (False, True):
        train, held = prompt_sets.build(path=path, extended=extended)
        s_train, s_held = prompt_sets.build(path=path, extended=extended, name_split=True)
        assert s_held == held and set(s_train) < set(train)
        bench_held = prompt_sets.build(path=path)[1]
        seen = set().union(*(prompt_sets.mentions(p) for p in held + bench_held))
        assert seen and not any(prompt_sets.mentions(p) & seen for p in s_train)
        assert set(s_train) == {p for p in train if not prompt_sets.mentions(p) & seen}
        assert "Explain tides in simple terms." in train + held
        if "Explain tides in simple terms." in train:
            assert "Explain tides in simple terms." in s_train
    assert prompt_sets.unseen(held, s_train) == [p for p in held if prompt_sets.mentions(p)]

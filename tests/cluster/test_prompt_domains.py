"""The prompt domains (`prompt_sets.domains()`): every domain's held-out side comes from
sources its training side never uses, the kept file is what the generators make (exactly for
the templated domains; for the source-built ones wherever this machine has the same
sources), and the benchmarks' existing split does not move."""

from __future__ import annotations

import ast
import hashlib
import json
import re

import pytest

from cluster import prompt_domains, prompt_sets

# `build()` and `build(extended=True)` as the shipped head and figure 1 know them.
BUILD_SHA1 = "f4c2375d6ba89a5b726360620ad7c358de582570"
EXTENDED_SHA1 = "a258cdee3ea7ed5dbcec579cb193bc844f6d9082"


def _sha1(obj) -> str:
    return hashlib.sha1(json.dumps(obj).encode()).hexdigest()


def _text(msgs) -> str:
    return json.dumps(msgs, ensure_ascii=False)


def test_the_existing_split_is_unchanged():
    assert _sha1(prompt_sets.build()) == BUILD_SHA1
    assert _sha1(prompt_sets.build(extended=True)) == EXTENDED_SHA1


def test_every_domain_holds_out_prompts_from_sources_training_never_uses():
    sets = prompt_sets.domains()
    kept = prompt_domains.frozen()
    assert set(sets) == set(prompt_sets.DOMAINS)
    for name, (train, held) in sets.items():
        assert len(held) >= 24 and len(train) >= 400, name
        assert not {_text(m) for m in train} & {_text(m) for m in held}, name
        assert len({_text(m) for m in train}) == len(train), name
        for msgs in train + held:
            assert msgs[-1]["role"] == "user" and all(m["content"] for m in msgs)
        if name == "general":
            continue
        d = kept["domains"][name]
        assert d["train"] == train and d["held_out"] == held
        assert len(d["train_sources"]) == len(train) and len(d["held_out_sources"]) == len(held)
        assert not set(d["train_sources"]) & set(d["held_out_sources"]), name
        assert len(set(d["held_out_sources"])) >= 4, name  # several sources, not one
    modules = set(kept["held_out_modules"])
    for name in ("code", "summarize"):  # one module split for both
        d = kept["domains"][name]
        assert set(d["held_out_sources"]) <= modules
        assert not set(d["train_sources"]) & modules
    # general: figure 1's held-out prompts; no training prompt names what they name
    general_train, general_held = sets["general"]
    assert [m[0]["content"] for m in general_held] == prompt_sets.build()[1]
    named = set().union(*(prompt_sets.mentions(m[0]["content"]) for m in general_held))
    assert not any(prompt_sets.mentions(m[0]["content"]) & named for m in general_train)


def test_each_domain_has_its_shape():
    sets = prompt_sets.domains()
    for msgs in sum(sets["code"], []):
        block = re.search(r"```python\n(.*)\n```", msgs[0]["content"], re.S).group(1)
        fn = [n for n in ast.walk(ast.parse(block))
              if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
        assert len(fn) == 1 and len(fn[0].body) == 1 and ast.get_docstring(fn[0])
    for msgs in sum(sets["chat"], []):
        users = [m for m in msgs if m["role"] == "user"]
        assert 2 <= len(users) <= 4
        turns = [m["role"] for m in msgs if m["role"] != "system"]
        assert turns == ["user", "assistant"] * (len(users) - 1) + ["user"]
    assert all("JSON" in m[0]["content"] for m in sum(sets["json"], []))
    assert all(re.search(r"\d", m[0]["content"]) for m in sum(sets["math"], []))
    lo, hi = prompt_domains.PAGE_CHARS
    assert all(len(m[0]["content"]) > lo for m in sum(sets["summarize"], []))
    everything = json.dumps(sets).lower()
    for name in ("humaneval", "mbpp", "gsm8k", "mt-bench"):  # templates and local sources only
        assert name not in everything


def test_templated_domains_regenerate_exactly():
    kept = prompt_domains.frozen()["domains"]
    for name in prompt_domains.PER_SOURCE:
        assert prompt_domains.templated(name) == kept[name], name


def test_source_domains_regenerate_where_the_sources_are_the_same():
    """Code and summarization come from this machine's Python files: the kept file records a
    hash of each; where they match (the machine that generated it), the prompts of a sample
    of modules on each side of the split are what those modules make now."""
    kept = prompt_domains.frozen()
    found = prompt_domains.sources()
    held = set(kept["held_out_modules"])
    small = sorted(t for t, fs in found.items() if len(fs) <= 2)
    sample = [t for t in small if t in held][:4] + [t for t in small if t not in held][:8]
    for top in sample:
        for mod, path in found[top]:
            with open(path, "rb") as f:
                if hashlib.sha1(f.read()).hexdigest() != kept["sources"].get(mod):
                    pytest.skip(f"{mod} differs on this machine")
    assert len(sample) == 12
    compared = 0
    for name, make in (("code", prompt_domains._code),
                       ("summarize", prompt_domains._summaries)):
        d = kept["domains"][name]
        for top in sample:
            now = {_text([{"role": "user", "content": p}])
                   for mod, path in found[top] for p in make(mod, *prompt_domains._parsed(path))}
            side = "held_out" if top in held else "train"
            got = [m for m, s in zip(d[side], d[f"{side}_sources"]) if s == top]
            assert {_text(m) for m in got} <= now, (name, top)
            compared += len(got)
            other = "train" if side == "held_out" else "held_out"
            assert not {_text(m) for m in d[other]} & now, (name, top)
    assert compared >= 20


def test_a_mix_takes_counts_and_refuses_unknown_domains():
    sets = prompt_sets.domains()
    train, held = prompt_sets.mix("code:100,chat:50,math")
    assert len(train) == 150 + len(sets["math"][0]) and set(held) == {"code", "chat", "math"}
    texts = {_text(m) for m in train}
    assert {_text(m) for m in sets["code"][0][:100]} <= texts
    assert not {_text(m) for m in sets["code"][0][100:]} & texts
    assert held["chat"] == sets["chat"][1]
    assert prompt_sets.mix("code:100,chat:50,math") == (train, held)  # a fixed shuffle
    assert [_text(m) for m in train] != [_text(m) for m in
                                         sets["code"][0][:100] + sets["chat"][0][:50]
                                         + sets["math"][0]]
    for bad, why in [("poetry", "unknown"), ("code,code", "named twice"),
                     ("code:0", "1..2000"), ("code:99999", "1..2000"),
                     ("code:x", "1..2000"), ("code:", "a count after ':'")]:
        with pytest.raises(ValueError, match=why):
            prompt_sets.mix(bad)


def test_a_missing_domain_file_says_how_to_make_it(tmp_path):
    with pytest.raises(FileNotFoundError, match="--domains-out"):
        prompt_sets.domains(str(tmp_path / "none.json.gz"))

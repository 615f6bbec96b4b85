"""The prompt domains beyond the general set (`cluster.prompt_sets.domains()`): code completion
and summarization built from the Python sources on this machine, and the templated chat, JSON
and math domains of `cluster/prompt_templates.py`. Each domain's held-out prompts come from
sources (modules, subjects, entities, templates) that none of its training prompts come from;
code and summarization share one split of the modules. Kept in `DOMAINS_FROZEN`, the source of
truth: the sources differ between Pythons.

    python -m cluster.prompt_sets --domains-out assets/prompt_domains.json.gz   # generate again
"""

from __future__ import annotations

import ast
import functools
import gzip
import hashlib
import importlib.util
import json
import os
import random
import sys
import textwrap

from cluster import prompt_templates

DOMAINS_FROZEN = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                              "assets", "prompt_domains.json.gz")
# Prompts kept per domain: (train, held out), each side shuffled by a fixed seed, so a prefix
# of the training side is a uniform sample of it.
SIZES = {"code": (2000, 48), "chat": (1500, 48), "json": (1200, 48), "summarize": (480, 32),
         "math": (1200, 48)}
# Held-out prompts of one source, at most: several modules, subjects, entities or templates
# make up each held-out side (code and summarization: `MODULE_CAP`).
PER_SOURCE = {"chat": 6, "json": 12, "math": 12}
MODULE_CAP = 4
# Stdlib modules left out: tests, GUIs, demos, tools and what only re-exports.
SKIP = ("test", "idlelib", "tkinter", "turtledemo", "turtle", "lib2to3", "ensurepip",
        "pydoc_data", "distutils", "this", "antigravity", "__future__", "__hello__",
        "__phello__", "site", "sre_constants", "sre_parse", "sre_compile", "encodings")
# Pure-Python packages of the virtual environment used where installed.
EXTRA = ("click", "jinja2", "jsonschema", "packaging", "idna", "certifi", "attr", "filelock",
         "fsspec", "huggingface_hub", "hypothesis", "yaml", "pluggy", "iniconfig")
CODE = ("Complete the following Python function. Reply with the whole function.\n\n"
        "```python\n{stub}\n```",
        "Implement `{name}` of the `{mod}` module:\n\n```python\n{stub}\n```",
        "```python\n{stub}\n```\n\nWrite the body of this function.",
        "Here is a signature and its docstring. Write an implementation that does what the "
        "docstring says.\n\n```python\n{stub}\n```")
DOCS = ("Summarize the following documentation in a few short paragraphs.\n\n{text}",
        "Read this reference text and list its main points as bullets.\n\n{text}",
        "{text}\n\nGive a summary of the text above in under 200 words.",
        "Write a three-sentence TL;DR of this documentation:\n\n{text}")
SOURCE = ("Summarize what this Python code does, part by part.\n\n```python\n{text}\n```",
          "```python\n{text}\n```\n\nExplain briefly what the code above provides and how it "
          "works.")
PAGE_CHARS = (4600, 9400)  # about 1-3k tokens of English or Python (ASCII)


def _hash(text: str) -> int:
    return int(hashlib.sha1(text.encode()).hexdigest(), 16)


def _files(top: str) -> list[tuple[str, str]]:
    """(module name, source path) of a top-level module or every file of a package."""
    spec = importlib.util.find_spec(top)
    if spec is None or not (spec.origin or "").endswith(".py"):
        return []
    if not spec.submodule_search_locations:
        return [(top, spec.origin)]
    root = os.path.dirname(spec.origin)
    out = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not d.startswith(("test", "_", ".")))
        for n in sorted(names):
            if n.endswith(".py") and not n.startswith("test"):
                rel = os.path.relpath(os.path.join(folder, n), root)[:-3].replace(os.sep, ".")
                mod = top if rel == "__init__" else f"{top}.{rel.removesuffix('.__init__')}"
                out.append((mod, os.path.join(folder, n)))
    return out


def sources() -> dict[str, list[tuple[str, str]]]:
    """{top-level module: [(module, path), ...]} of the stdlib and `EXTRA`, pure Python."""
    tops = [m for m in sorted(sys.stdlib_module_names) if not m.startswith("_")
            and m not in SKIP] + list(EXTRA)
    return {t: f for t in tops if (f := _files(t))}


def _parsed(path: str) -> tuple[ast.Module, list[str]] | None:
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
        return ast.parse(text), text.splitlines()
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return None


def _defs(tree: ast.Module):
    """(class name or None, def node) of the public functions and methods, in order."""
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield None, node
        elif isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
            for n in node.body:
                if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    yield node.name, n


def _stub(node, lines: list[str]) -> str | None:
    """The def line(s) and docstring of a function worth completing (None: not one)."""
    doc = ast.get_docstring(node)
    if node.name.startswith("_") or not doc or not 40 <= len(doc) <= 1500:
        return None
    end = node.body[0].end_lineno
    if len(node.body) < 2 or not 2 <= node.end_lineno - end <= 60:
        return None
    if isinstance(node.body[1], (ast.Pass, ast.Raise)) and len(node.body) == 2:
        return None
    return textwrap.dedent("\n".join(lines[node.lineno - 1 : end]))


def _code(mod: str, tree, lines) -> list[str]:
    out = []
    for cls, node in _defs(tree):
        stub = _stub(node, lines)
        if stub is None:
            continue
        name = f"{cls}.{node.name}" if cls else node.name
        if cls:
            stub = f"class {cls}:\n" + textwrap.indent(stub, "    ")
        out.append(CODE[_hash(f"{mod}.{name}") % len(CODE)].format(stub=stub, name=name,
                                                                      mod=mod))
    return out


def _pack(parts: list[str], lo: int, hi: int) -> list[str]:
    """Consecutive parts joined into pages of lo..hi characters (too long parts, and parts
    not nearly all ASCII, which take more tokens a character, skipped)."""
    pages, cur = [], ""
    for p in parts:
        if len(p.encode()) - len(p) > len(p) // 100:  # UTF-8's extra bytes
            continue
        if len(cur) + len(p) > hi:
            if len(cur) >= lo:
                pages.append(cur)
            cur = ""
        if len(p) <= hi:
            cur = f"{cur}\n\n{p}" if cur else p
    if len(cur) >= lo:
        pages.append(cur)
    return pages


def _summaries(mod: str, tree, lines) -> list[str]:
    """Documentation pages from the module's docstrings, and pages of its source."""
    docs = [f"Module `{mod}`\n\n{ast.get_docstring(tree) or ''}".strip()]
    for cls, node in _defs(tree):
        doc = ast.get_docstring(node)
        if doc and not node.name.startswith("_"):
            name = f"{cls}.{node.name}" if cls else node.name
            docs.append(f"{name}({ast.unparse(node.args)})\n{textwrap.indent(doc, '    ')}")
    src = ["\n".join(lines[n.lineno - 1 : n.end_lineno]) for n in tree.body
           if not isinstance(n, (ast.Import, ast.ImportFrom))]
    h = _hash(mod)
    return ([DOCS[(h + i) % len(DOCS)].format(text=t)
             for i, t in enumerate(_pack(docs, *PAGE_CHARS))]
            + [SOURCE[(h + i) % len(SOURCE)].format(text=t)
               for i, t in enumerate(_pack(src, *PAGE_CHARS))])


def from_sources() -> tuple[dict, dict, dict]:
    """{top: code prompts}, {top: summarization prompts} and {module: sha1 of its file}."""
    code, summ, digests = {}, {}, {}
    for top, files in sources().items():
        for mod, path in files:
            got = _parsed(path)
            if got is None:
                continue
            with open(path, "rb") as f:
                digests[mod] = hashlib.sha1(f.read()).hexdigest()
            code.setdefault(top, []).extend(_code(mod, *got))
            summ.setdefault(top, []).extend(_summaries(mod, *got))
    return code, summ, digests


def held_sources(by_source: list[dict], need: list[int], cap: int) -> set[str]:
    """Sources, in the order of a hash of their names, held out until each of the domains
    `by_source` ({source: prompts}) holds at least its `need` prompts, counting at most `cap`
    a source (so that several sources share the held-out side)."""
    held: set[str] = set()
    for s in sorted(set().union(*by_source), key=_hash):
        if all(sum(min(len(d.get(h, ())), cap) for h in held) >= n
               for d, n in zip(by_source, need)):
            break
        held.add(s)
    return held


def split(by_source: dict, held: set[str], sizes: tuple[int, int], cap: int, seed: int
          ) -> dict[str, list]:
    """One domain's {"train", "held_out"} messages and the source of each ("train_sources",
    "held_out_sources"): up to `cap` prompts of each held source on one side, the other
    sources' prompts on the other, no text on both; each side shuffled and cut to its size."""
    def msgs(p):
        return [{"role": "user", "content": p}] if isinstance(p, str) else p

    key = functools.partial(json.dumps, ensure_ascii=False)
    side: dict[bool, dict] = {True: {}, False: {}}
    for s in sorted(by_source):
        got = [msgs(p) for p in by_source[s]]
        if s in held:
            random.Random(f"{seed}:{s}").shuffle(got)
            got = got[:cap]
        for m in got:
            side[s in held].setdefault(key(m), (s, m))
    train = [v for k, v in side[False].items() if k not in side[True]]
    out = {}
    for name, part, n in (("train", train, sizes[0]),
                          ("held_out", list(side[True].values()), sizes[1])):
        random.Random(seed).shuffle(part)
        out[name] = [m for _, m in part[:n]]
        out[f"{name}_sources"] = [s for s, _ in part[:n]]
    return out


def templated(name: str) -> dict[str, list]:
    """`split` of a templated domain (chat, json, math): the same on every Python."""
    fn = {"chat": prompt_templates.chat, "json": prompt_templates.json_tasks,
          "math": prompt_templates.math_problems}[name]
    d = fn()
    cap = PER_SOURCE[name]
    return split(d, held_sources([d], [SIZES[name][1]], cap), SIZES[name], cap, 0)


def generate() -> dict:
    """Every domain's split, as this Python builds them, and the sources used."""
    code, summ, digests = from_sources()
    held = held_sources([code, summ], [SIZES["code"][1], SIZES["summarize"][1]], MODULE_CAP)
    out = {"code": split(code, held, SIZES["code"], MODULE_CAP, 0),
           "summarize": split(summ, held, SIZES["summarize"], MODULE_CAP, 0)}
    out |= {name: templated(name) for name in PER_SOURCE}
    return {"python": sys.version.split()[0], "sources": digests,
            "held_out_modules": sorted(held), "domains": dict(sorted(out.items()))}


def write(path: str = DOMAINS_FROZEN, sets: dict | None = None) -> dict:
    """Write `generate()`'s domains (or `sets`) to path as gzipped JSON; returns them."""
    sets = generate() if sets is None else sets
    data = json.dumps(sets, ensure_ascii=False, separators=(",", ":")).encode()
    with open(path, "wb") as f, gzip.GzipFile(fileobj=f, mode="wb", mtime=0) as z:
        z.write(data)  # no time stamp: the same prompts give the same bytes
    frozen.cache_clear()
    return sets


def read_kept(path: str, missing: str) -> dict:
    """A kept gzipped JSON file (these domains, `prompt_sets`' sets); `missing`: the error's
    message, saying how to make the file, when there is none."""
    try:
        with gzip.open(path, "rt", encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        raise FileNotFoundError(missing) from None


@functools.lru_cache(maxsize=4)
def frozen(path: str = DOMAINS_FROZEN) -> dict:
    """The kept domains (`write`'s file)."""
    sets = read_kept(path, f"no prompt domains at {path}: run `python -m cluster.prompt_sets "
                           f"--domains-out {path}`")
    if not isinstance(sets.get("domains"), dict):
        raise ValueError(f"{path} has no 'domains'")
    return sets

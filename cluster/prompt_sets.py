"""Prompt sets for self-distillation and the benchmarks' held-out prompts, built from the
Python standard library's documentation and templated chat, code and JSON requests. Generated
once and kept in `FROZEN` so every machine splits the same prompts the same way.

`domains()` adds per-domain sets, each a training and a held-out side drawn from disjoint
sources (`cluster/prompt_domains.py`, kept in `prompt_domains.DOMAINS_FROZEN`): code
completion, multi-turn chat, JSON output, summarization of long inputs, math word problems,
and the general set above. `mix("code:800,chat,...")` is a training mix of them.

    python -m cluster.prompt_sets --out assets/prompt_sets.json.gz   # generate again
    python -m cluster.prompt_sets --domains-out assets/prompt_domains.json.gz   # the domains
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import importlib
import inspect
import json
import os
import random
import re
import sys
import warnings

FROZEN = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets",
                      "prompt_sets.json.gz")

STDLIB = ("os", "os.path", "shutil", "string", "textwrap", "json", "itertools", "functools",
          "collections", "math", "statistics", "re", "datetime", "random", "heapq", "bisect",
          "pathlib", "csv", "glob", "fnmatch", "base64", "hashlib", "uuid", "time", "calendar",
          "decimal", "fractions", "operator", "copy", "pprint", "difflib", "unicodedata",
          "urllib.parse", "html", "zlib", "gzip", "tempfile", "argparse", "logging", "enum",
          "dataclasses", "typing", "contextlib", "threading", "queue", "subprocess", "socket",
          "struct", "array", "secrets", "shlex", "io", "sqlite3", "email.utils", "ipaddress")

# Modules the extended set adds (`build(extended=True)`): more documentation to ask about.
STDLIB_MORE = ("asyncio", "concurrent.futures", "pickle", "zipfile", "tarfile", "configparser",
               "xml.etree.ElementTree", "http.client", "http.server", "colorsys", "platform",
               "traceback", "inspect", "abc", "weakref", "types", "numbers", "cmath", "codecs",
               "mimetypes", "binascii", "selectors", "errno", "signal", "sched", "graphlib",
               "reprlib", "keyword", "token", "tokenize", "ast", "dis", "linecache", "filecmp",
               "stat", "getpass", "locale", "gettext", "wave", "zoneinfo", "smtplib",
               "urllib.request", "json.decoder", "multiprocessing", "unittest", "doctest",
               "timeit", "pdb", "profile", "pstats", "warnings", "atexit", "sysconfig")

TOPICS = ("photosynthesis", "compound interest", "how vaccines work", "black holes",
          "the water cycle", "recursion", "public-key cryptography", "inflation", "plate "
          "tectonics", "the immune system", "neural networks", "supply and demand", "DNS",
          "climate change", "the French Revolution", "relativity", "sorting algorithms",
          "time zones", "garbage collection", "the stock market", "volcanoes", "sleep",
          "electric cars", "coffee brewing", "version control", "the Roman Empire", "rainbows",
          "bread baking", "solar panels", "caching", "binary numbers", "gravity", "tides")
ACTIVITIES = ("learning a new language", "running a first marathon", "saving money",
              "writing clean code", "growing tomatoes", "public speaking", "studying for exams",
              "working from home", "cooking for a crowd", "traveling on a budget",
              "debugging a program", "taking better photos", "staying focused")
THINGS = ("remote work", "electric scooters", "open-source software", "nuclear power",
          "social media", "microservices", "static typing", "city living", "online courses",
          "standing desks", "cloud computing", "self-driving cars", "paper books")
ENTITIES = {
    "book": "title, author, year, genres", "user": "id, name, email, is_active",
    "product": "sku, name, price, tags", "city": "name, country, population, landmarks",
    "recipe": "name, servings, ingredients, steps", "movie": "title, director, year, rating",
    "server": "hostname, ip, cpu_cores, services", "order": "order_id, items, total, status",
    "student": "name, grade, courses, gpa", "event": "name, date, location, attendees",
    "car": "make, model, year, features", "song": "title, artist, duration_s, album",
}
CHAT = ("Explain {t} in simple terms.", "What is {t}? Answer in two paragraphs.",
        "Give me three surprising facts about {t}.", "Write a short poem about {t}.",
        "How would you teach {t} to a twelve-year-old?", "Summarize {t} in five bullet points.")
ADVICE = ("Give me five tips for {a}.", "What mistakes do beginners make when {a}?",
          "Make a one-week plan for {a}.")
OPINION = ("What are the pros and cons of {x}?", "Write a short debate about {x}.")
JSON = ("Return only a JSON object describing a fictional {e} with the fields {f}.",
        "Give a JSON array of three {e} records, each with {f}.",
        "Write a JSON schema for a {e} object with the fields {f}.")


def _doc_prompts(modules=STDLIB, kinds_per_name: int = 2) -> list[str]:
    """Questions about each documented public function or class of `modules`:
    `kinds_per_name` of the four kinds (chosen by a hash of the name; 4: all)."""
    out = []
    for mod_name in modules:
        try:
            mod = importlib.import_module(mod_name)
        except ImportError:
            continue
        for name, obj in sorted(vars(mod).items()):
            if name.startswith("_") or not (inspect.isfunction(obj) or inspect.isclass(obj)
                                            or inspect.isbuiltin(obj)):
                continue
            with warnings.catch_warnings():  # typing.io / typing.re warn when touched
                warnings.simplefilter("ignore", DeprecationWarning)
                doc = inspect.getdoc(obj) or ""
            first = doc.strip().split("\n")[0].strip()
            if len(first) < 12:
                continue
            full = f"{mod_name}.{name}"
            h = int(hashlib.md5(full.encode()).hexdigest(), 16)
            kinds = (
                f"Explain what `{full}` does in Python and show a short example.",
                f"Write a Python function that uses `{full}`. The docs say: {first}",
                f"Summarize this Python documentation in plain words:\n\n{doc[:600]}",
                f"What are common mistakes when using `{full}`?",
            )
            picks = (h % 4, (h + 2) % 4, (h + 1) % 4, (h + 3) % 4)[:kinds_per_name]
            out += [kinds[i] for i in picks]
    return out


def _templated() -> list[str]:
    out = [c.format(t=t) for c in CHAT for t in TOPICS]
    out += [c.format(a=a) for c in ADVICE for a in ACTIVITIES]
    out += [c.format(x=x) for c in OPINION for x in THINGS]
    out += [j.format(e=e, f=f) for j in JSON for e, f in ENTITIES.items()]
    return out


def _templated_more() -> list[str]:
    """Every template with every filler of the other kinds too (a chat template about an
    activity or a thing, advice about a topic), for the extended set."""
    subjects = TOPICS + ACTIVITIES + THINGS
    out = [c.format(t=t) for c in CHAT for t in ACTIVITIES + THINGS]
    out += [c.format(a=a) for c in ADVICE for a in TOPICS]
    out += [c.format(x=x) for c in OPINION for x in subjects if x not in THINGS]
    return out


def generate() -> dict:
    """The prompts as this Python builds them: {"base": the base set, "extended": what the
    extended set adds}, each sorted, and where they came from."""
    base = set(_doc_prompts() + _templated())
    more = set(_doc_prompts(STDLIB, 4) + _doc_prompts(STDLIB_MORE, 4) + _templated_more())
    return {"python": sys.version.split()[0], "torch_imported": "torch" in sys.modules,
            "base": sorted(base), "extended": sorted(more - base)}


def write(path: str = FROZEN, sets: dict | None = None) -> dict:
    """Write `generate()`'s prompts (or `sets`) to path as gzipped JSON; returns them."""
    sets = generate() if sets is None else sets
    with gzip.open(path, "wt", encoding="utf-8") as f:
        json.dump(sets, f, ensure_ascii=False, indent=0)
    frozen.cache_clear()
    return sets


@functools.lru_cache(maxsize=4)
def frozen(path: str = FROZEN) -> dict:
    """The kept prompts (`write`'s file)."""
    from cluster.prompt_domains import read_kept

    sets = read_kept(path, f"no prompt sets at {path}: run `python -m cluster.prompt_sets --out "
                           f"{path}` to generate them")
    if not isinstance(sets.get("base"), list) or not isinstance(sets.get("extended"), list):
        raise ValueError(f"{path} has no 'base' and 'extended' prompt lists")
    return sets


def build(n: int | None = None, seed: int = 0, eval_frac: float = 0.05,
          extended: bool = False, path: str = FROZEN, name_split: bool = False
          ) -> tuple[list[str], list[str]]:
    """(train, eval) user messages from the kept prompts, split by a hash of the text so the
    split never moves. `extended`: a larger self-distillation set keeping the base prompts' sides.
    `name_split`: also leave out of training every prompt mentioning a name a held-out prompt
    mentions."""
    train, held = _split(n, seed, eval_frac, extended, path)
    if name_split:
        bench_held = build(path=path)[1]  # what the benchmarks' `build()` holds out
        seen = set().union(*(mentions(p) for p in held + bench_held))
        train = [p for p in train if not mentions(p) & seen]
    return train, held


def _split(n, seed, eval_frac, extended, path) -> tuple[list[str], list[str]]:
    """`build`'s split of the kept prompts, before any name split."""
    sets = frozen(path)
    prompts = set(sets["base"])
    if extended:
        prompts |= set(sets["extended"])
    prompts = sorted(prompts)
    random.Random(seed).shuffle(prompts)
    if n is not None:
        prompts = prompts[:n]
    is_eval = lambda p: int(hashlib.sha1(p.encode()).hexdigest(), 16) % 1000 < eval_frac * 1000  # noqa: E731
    return [p for p in prompts if not is_eval(p)], [p for p in prompts if is_eval(p)]


def mentions(prompt: str) -> set[str]:
    """What a documentation prompt is about: its backticked names and the first line of any
    documentation it quotes (empty for the templated prompts, whose subjects every set
    shares)."""
    out = set(re.findall(r"`([\w.]+)`", prompt))
    for mark in ("The docs say: ", "in plain words:\n\n"):
        if mark in prompt:
            out.add(prompt.split(mark, 1)[1].split("\n")[0].strip())
    return out


def unseen(held_out: list[str], *train_sets: list[str]) -> list[str]:
    """The held-out documentation prompts none of whose `mentions` any training prompt
    mentions. The split is by prompt text, so a held-out question can share its name with
    other questions in training; these cannot."""
    seen = set().union(*(mentions(p) for t in train_sets for p in t))
    return [p for p in held_out if (m := mentions(p)) and not m & seen]


DOMAINS = ("code", "chat", "json", "summarize", "math", "general")


def domains(path: str | None = None) -> dict[str, tuple[list[list[dict]], list[list[dict]]]]:
    """{domain: (train, held out)} as chat-message lists, from the kept files. "general": the
    extended set's training prompts with the name split, and `build()`'s held-out prompts
    (the benchmarks' split, unchanged)."""
    from cluster import prompt_domains

    kept = prompt_domains.frozen(path or prompt_domains.DOMAINS_FROZEN)["domains"]
    out = {d: (kept[d]["train"], kept[d]["held_out"]) for d in DOMAINS if d in kept}
    user = lambda ps: [[{"role": "user", "content": p}] for p in ps]  # noqa: E731
    out["general"] = (user(build(extended=True, name_split=True)[0]), user(build()[1]))
    return out


def mix(spec: str, path: str | None = None, seed: int = 0
        ) -> tuple[list[list[dict]], dict[str, list[list[dict]]]]:
    """The training messages of a domain mix, "code:800,chat,general:2000" (a domain alone:
    all its training prompts; domain:N its first N), shuffled together by `seed`; and each
    named domain's held-out messages."""
    sets = domains(path)
    train, held = [], {}
    for part in spec.split(","):
        name, colon, count = part.strip().partition(":")
        if name in held:
            raise ValueError(f"domain {name!r} named twice")
        if name not in sets:
            raise ValueError(f"domain {name!r} unknown: pick from {DOMAINS}")
        tr, held[name] = sets[name]
        if colon and not count:
            raise ValueError(f"domain {name}: a count after ':' ({name}:500), or the name "
                             "alone for all its prompts")
        n = int(count) if count.isdigit() else 0 if count else len(tr)
        if not 0 < n <= len(tr):
            raise ValueError(f"domain {name}: {count} prompts asked, 1..{len(tr)} held")
        train += tr[:n]
    random.Random(seed).shuffle(train)
    return train, held


def main(argv=None) -> int:
    import argparse

    p = argparse.ArgumentParser(description="Generate the prompt sets from this Python's "
                                            "standard library and keep them in a file.")
    p.add_argument("--out", default=FROZEN)
    p.add_argument("--no-torch", action="store_true",
                   help="do not import torch first (every user of the sets imports it, and "
                        "it changes what inspect reports)")
    p.add_argument("--domains-out", default=None, metavar="PATH",
                   help="generate the prompt domains (`domains()`) into PATH instead")
    args = p.parse_args(argv)
    if args.domains_out:
        from cluster import prompt_domains

        kept = prompt_domains.write(args.domains_out)["domains"]
        print(f"{args.domains_out}: " + ", ".join(
            f"{d} {len(v['train'])} / {len(v['held_out'])}" for d, v in kept.items()))
        return 0
    if not args.no_torch:
        import torch  # noqa: F401
    sets = write(args.out)
    train, held = build(path=args.out)
    xtrain, xheld = build(path=args.out, extended=True)
    print(f"{args.out}: Python {sets['python']}, base {len(sets['base'])} prompts "
          f"({len(train)} train / {len(held)} held out), extended +{len(sets['extended'])} "
          f"({len(xtrain)} / {len(xheld)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Prompt sets for self-distillation, built from what every machine has: the Python standard
library's own documentation, plus templated chat, code and JSON requests. No hub datasets,
no benchmark text (HumanEval, MT-bench) anywhere."""

from __future__ import annotations

import hashlib
import importlib
import inspect
import random
import re
import warnings

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


def build(n: int | None = None, seed: int = 0, eval_frac: float = 0.05,
          extended: bool = False) -> tuple[list[str], list[str]]:
    """(train, eval) user messages. The split is by a hash of the text, so it never moves.
    `extended`: also all four documentation questions per name, more stdlib modules and
    every template with every filler (for a larger self-distillation set); the base set's
    prompts keep their side of the split, and the base set itself (what the benchmarks'
    held-out prompts come from) does not change."""
    prompts = set(_doc_prompts() + _templated())
    if extended:
        prompts |= set(_doc_prompts(STDLIB, 4) + _doc_prompts(STDLIB_MORE, 4)
                       + _templated_more())
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

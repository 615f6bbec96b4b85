"""The templated prompt domains of `cluster/prompt_domains.py`: multi-turn chat, JSON output and
math word problems, generated from word lists and seeded random numbers only, so every Python
builds the same prompts. Each generator returns {source: [messages, ...]}: the source (a
subject, an entity, a template) decides the side of the split, so no held-out prompt shares
one with training."""

from __future__ import annotations

import json
import random

from cluster.prompt_sets import ACTIVITIES, THINGS, TOPICS

U, A, S = "user", "assistant", "system"
MORE_TOPICS = ("coral reefs", "jet engines", "the printing press", "honeybees", "fermentation",
               "earthquakes", "the internet", "glaciers", "antibiotics", "the moon landing",
               "electricity", "3D printing", "bird migration", "the Silk Road", "magnets",
               "weather forecasting", "the human heart", "blockchains", "compilers", "tea",
               "the Renaissance", "bacteria", "wind turbines", "memory in the brain", "tsunamis",
               "the metric system", "hash tables", "photography", "dinosaurs", "batteries")
MORE_GOALS = ("learning to swim", "keeping a journal", "cycling to work", "learning chess",
              "reading more books", "drawing portraits", "baking sourdough", "learning guitar",
              "cutting down on sugar", "organizing my desk", "training a puppy",
              "writing a novel", "learning to touch type", "meditating daily")
FORMS = ("two-sentence story", "short product description", "haiku", "tweet", "limerick",
         "short paragraph for a newsletter", "slogan", "four-line poem")
EDITS = ("Make it funnier.", "Now make it more formal.", "Shorter, please.",
         "Rewrite it for a five-year-old.", "Add a surprising twist at the end.",
         "Make it rhyme.", "Use simpler words.", "Give it a more hopeful tone.")
DRAFTS = ("Every morning, {s} reminds us that small things add up.",
          "Few people notice {s} until it is gone, and then everyone does.",
          "{S} is simpler than it looks, and more interesting than it sounds.",
          "They said {s} would never catch on. They were wrong.")
PERSONAS = ("a patient tutor", "a concise technical support agent", "a friendly coach",
            "a careful editor", "a cheerful librarian", "a pragmatic engineer")
RULES = ("Answer in at most three sentences.", "Always end with a question to the user.",
         "Use bullet points where they help.", "Avoid jargon.")
PY_TASKS = {"read a CSV file": "csv", "parse a date string": "datetime.strptime",
            "count word frequencies": "collections.Counter", "run a shell command":
            "subprocess.run", "walk a directory tree": "os.walk", "time a piece of code":
            "time.perf_counter", "save a dict as JSON": "json.dump",
            "generate a random password": "secrets", "sort a list of dicts by a key":
            "sorted with a key function", "remove duplicates from a list": "dict.fromkeys",
            "download a web page": "urllib.request", "compress a file": "gzip",
            "parse command-line arguments": "argparse", "log messages to a file": "logging",
            "copy a folder": "shutil.copytree", "find files by pattern": "glob",
            "work with dates across time zones": "zoneinfo", "cache a slow function":
            "functools.lru_cache", "run tasks in parallel": "concurrent.futures",
            "read a file line by line": "open() as an iterator"}
TWISTS = ("the input is very large?", "it has to run on Windows too?",
          "I need it to be as fast as possible?", "the data can be malformed?")


def _pick(rng: random.Random, options):
    return options[rng.randrange(len(options))]


def _explain(rng, t):
    return [{"role": U, "content": _pick(rng, ("Can you explain {t}?", "What is {t}, in a "
                                               "nutshell?", "I keep hearing about {t}. What "
                                               "is it?")).format(t=t)},
            {"role": A, "content": f"Sure. {t[0].upper() + t[1:]} can be described at three "
                                   "levels: what it is, why it matters, and how it works in "
                                   "practice. Would you like the short version or a detailed "
                                   "one?"},
            {"role": U, "content": _pick(rng, ("The short version, please, with one example.",
                                               "The detailed one, but under 300 words.",
                                               "Start with why it matters.",
                                               "Just the common misconceptions, please."))}]


def _plan(rng, g):
    return [{"role": U, "content": _pick(rng, ("I want to get better at {g}. Can you help?",
                                               "Help me make a plan for {g}.")).format(g=g)},
            {"role": A, "content": "Of course. Two questions first: how much time can you "
                                   "spend each week, and what have you tried so far?"},
            {"role": U, "content": f"About {rng.randint(2, 12)} hours a week. "
             + _pick(rng, ("I have never really started.", "I tried a few online videos.",
                           "I did it on and off for a year, then stopped."))}]


def _rewrite(rng, s):
    draft = _pick(rng, DRAFTS).format(s=s, S=s[0].upper() + s[1:])
    return [{"role": U, "content": f"Write a {_pick(rng, FORMS)} about {s}."},
            {"role": A, "content": f"Here is a first draft:\n\n{draft}"},
            {"role": U, "content": _pick(rng, EDITS)}]


def _persona(rng, s):
    return [{"role": S, "content": f"You are {_pick(rng, PERSONAS)}. {_pick(rng, RULES)}"},
            {"role": U, "content": f"I have a question about {s}."},
            {"role": A, "content": "Go ahead, I'm listening."},
            {"role": U, "content": _pick(rng, ("What should a beginner know about {s}?",
                                               "What is the most common mistake with {s}?",
                                               "Why do people disagree about {s}?")
                                         ).format(s=s)}]


def _python(rng, task):
    return [{"role": U, "content": f"How do I {task} in Python?"},
            {"role": A, "content": f"The usual tool is {PY_TASKS[task]}. Do you want a minimal "
                                   "example or one with error handling?"},
            {"role": U, "content": _pick(rng, ("A minimal example.", "With error handling, "
                                               "please.", "A minimal one. And what if "
                                               + _pick(rng, TWISTS)))}]


def _follow_up(rng, msgs):
    """One more exchange on a conversation (a third or fourth user turn)."""
    reply = _pick(rng, ("Here you go. I kept it brief and focused on the main idea; tell me "
                        "if you want more detail on any part.", "Done. I followed your request "
                        "and kept the rest unchanged.", "Sure, here it is, with the key point "
                        "first and an example after it."))
    ask = _pick(rng, ("Thanks! Can you summarize that in one sentence?", "Now turn it into a "
                      "numbered list.", "What would you change if I were an expert?",
                      "Can you give one more example?", "Now say it in a friendlier tone."))
    return msgs + [{"role": A, "content": reply}, {"role": U, "content": ask}]


def chat(seed: int = 1) -> dict[str, list[list[dict]]]:
    """Multi-turn conversations (2-4 user turns; some with a system prompt), by subject."""
    rng = random.Random(seed)
    topics = sorted(set(TOPICS + MORE_TOPICS + THINGS))
    goals = sorted(set(ACTIVITIES + MORE_GOALS))
    out: dict[str, list[list[dict]]] = {}
    makers = [(topics, (_explain, _rewrite, _persona)), (goals, (_plan, _persona)),
              (sorted(PY_TASKS), (_python,))]
    for subjects, fns in makers:
        for s in subjects:
            for fn in fns:
                for _ in range(6):
                    msgs = fn(rng, s)
                    for _ in range(rng.choice((0, 0, 1, 2))):
                        msgs = _follow_up(rng, msgs)
                    out.setdefault(s, []).append(msgs)
    return out


ENTITIES = {
    "book": "title:text author:name year:year pages:int genres:tags isbn:id",
    "user": "id:id name:name email:email is_active:bool signup_date:date country:country",
    "product": "sku:id name:text price:price in_stock:bool tags:tags rating:rating",
    "city": "name:city country:country population:big founded:year landmarks:tags",
    "recipe": "name:text servings:int prep_minutes:int ingredients:tags vegetarian:bool",
    "movie": "title:text director:name year:year rating:rating runtime_min:int",
    "server": "hostname:host ip:ip cpu_cores:int memory_gb:int services:tags region:city",
    "order": "order_id:id customer:name items:tags total:price status:status date:date",
    "student": "name:name grade:int courses:tags gpa:gpa email:email",
    "event": "name:text date:date location:city attendees:int is_public:bool",
    "car": "make:text model:text year:year mileage_km:big features:tags price:price",
    "song": "title:text artist:name duration_s:int album:text year:year",
    "employee": "employee_id:id name:name department:text salary:big start_date:date",
    "flight": "flight_no:id origin:city destination:city departure:date seats_left:int",
    "invoice": "invoice_no:id client:name amount:price due_date:date paid:bool",
    "patient": "patient_id:id name:name age:int blood_type:blood allergies:tags",
    "hotel": "name:text city:city stars:int price_per_night:price amenities:tags",
    "repository": "name:host stars:big language:text open_issues:int license:text",
    "sensor": "sensor_id:id location:city temperature_c:float battery_pct:int online:bool",
    "restaurant": "name:text cuisine:text city:city rating:rating price_level:int",
    "course": "code:id title:text credits:int instructor:name prerequisites:tags",
    "device": "serial:id model:text os_version:text owner:name last_seen:date",
    "ticket": "ticket_id:id title:text priority:status assignee:name created:date",
    "planet": "name:text mass_kg:big moons:int has_rings:bool discovered:year",
    "podcast": "title:text host:name episodes:int topics:tags explicit:bool",
    "shipment": "tracking_no:id carrier:text weight_kg:float destination:city status:status",
    "account": "account_id:id owner:name balance:price currency:text opened:date",
    "team": "name:text sport:text city:city players:tags founded:year",
    "plant": "species:text common_name:text water_days:int sunlight:status toxic:bool",
    "museum": "name:text city:city founded:year exhibits:tags free_entry:bool",
}
WORDS = ("alpha", "harbor", "maple", "quartz", "summit", "willow", "ember", "nova", "river",
         "cedar", "orbit", "lumen", "atlas", "breeze", "pixel", "tundra")
FIRST = ("Maria", "Ken", "Aisha", "Tom", "Lena", "Ravi", "Sofia", "Yuki", "Omar", "Grace")
LAST = ("Lopez", "Tanaka", "Okafor", "Smith", "Novak", "Iyer", "Rossi", "Kim", "Haddad")
CITIES = ("Lisbon", "Osaka", "Nairobi", "Denver", "Krakow", "Lima", "Perth", "Oslo", "Pune")
COUNTRIES = ("Portugal", "Japan", "Kenya", "USA", "Poland", "Peru", "Australia", "Norway")


def _value(rng, kind: str):
    """A random value of a field kind."""
    name = f"{_pick(rng, FIRST)} {_pick(rng, LAST)}"
    gen = {"text": lambda: f"{_pick(rng, WORDS).title()} {_pick(rng, WORDS).title()}",
           "name": lambda: name, "year": lambda: rng.randint(1950, 2024),
           "int": lambda: rng.randint(1, 400), "big": lambda: rng.randint(1000, 9_000_000),
           "price": lambda: round(rng.uniform(1, 999), 2), "bool": lambda: rng.random() < .5,
           "float": lambda: round(rng.uniform(-10, 40), 1), "gpa": lambda: round(
               rng.uniform(2, 4), 2), "rating": lambda: round(rng.uniform(1, 5), 1),
           "id": lambda: f"{_pick(rng, WORDS)[:3].upper()}-{rng.randint(1000, 99999)}",
           "email": lambda: f"{name.split()[0].lower()}.{rng.randint(1, 99)}@example.com",
           "date": lambda: f"20{rng.randint(10, 25)}-{rng.randint(1, 12):02d}-"
                           f"{rng.randint(1, 28):02d}",
           "city": lambda: _pick(rng, CITIES), "country": lambda: _pick(rng, COUNTRIES),
           "host": lambda: f"{_pick(rng, WORDS)}-{rng.randint(1, 60)}",
           "ip": lambda: ".".join(str(rng.randint(1, 254)) for _ in range(4)),
           "status": lambda: _pick(rng, ("new", "pending", "active", "done", "high", "low")),
           "blood": lambda: _pick(rng, ("A+", "B-", "O+", "AB+")),
           "tags": lambda: rng.sample(WORDS, rng.randint(1, 4))}
    return gen[kind]()


def _record(rng, fields):
    return {f: _value(rng, k) for f, k in fields}


def _json_prompts(rng, e: str, spec: str) -> list[str]:
    """Eight JSON tasks about entity `e`, each on a random subset of its fields."""
    fields = [tuple(f.split(":")) for f in spec.split()]
    sub = rng.sample(fields, rng.randint(3, len(fields)))
    keys = ", ".join(f for f, _ in sub)
    rec = _record(rng, sub)
    n = rng.randint(2, 5)
    types = {"int": "integer", "big": "integer", "year": "integer", "bool": "boolean",
             "price": "number", "float": "number", "gpa": "number", "rating": "number",
             "tags": "array"}
    schema = {"type": "object", "required": [f for f, _ in sub], "properties": {
        f: {"type": types.get(k, "string")} for f, k in sub}}
    rows = [_record(rng, [f for f in sub if f[1] != "tags"]) for _ in range(n)]
    csv = "\n".join([",".join(rows[0])] + [",".join(str(v) for v in r.values()) for r in rows])
    broken = json.dumps(rec).replace('"', "'", 2).replace("}", ",}")
    text = " ".join(f"Its {f.replace('_', ' ')} is {v}." for f, v in rec.items())
    return [f"Return only a JSON object describing a fictional {e} with the keys {keys}.",
            f"Give a JSON array of {n} {e} records, each with {keys}. No prose.",
            "Produce a JSON object that validates against this JSON Schema:\n\n```json\n"
            f"{json.dumps(schema, indent=2)}\n```",
            f"Extract the {e}'s details from this note into JSON with the keys {keys}:\n\n"
            f"A new {e} was added. {text}",
            f"Convert this CSV to a JSON array of objects:\n\n{csv}",
            f"This JSON is invalid. Fix it and return only the corrected JSON:\n\n{broken}",
            f"Return JSON with a top-level `{e}s` array of {n} items (fields: {keys}) and a "
            "`count` field.",
            "Turn these lines into one JSON object, with proper types:\n\n"
            + "\n".join(f"{f}: {v}" for f, v in rec.items())]


def json_tasks(seed: int = 2, per_entity: int = 8) -> dict[str, list[list[dict]]]:
    """Structured-output requests (objects, arrays, schemas, extraction, CSV, repair), by
    entity."""
    rng = random.Random(seed)
    return {e: [[{"role": U, "content": p}] for _ in range(per_entity)
                for p in _json_prompts(rng, e, spec)] for e, spec in ENTITIES.items()}


def _math(rng, t: int) -> str:
    """Word problem number `t` with fresh random numbers."""
    r = rng.randint
    a, b, c, d = r(2, 40), r(2, 40), r(2, 9), r(1, 12)
    x, y = r(-9, 12), r(-9, 12)
    who = _pick(rng, FIRST)
    p = [f"{who} buys {a} notebooks at ${c}.{d:02d} each and {b} pens at $1.{c}5 each. How "
         "much is spent in total?",
         f"A jacket costs ${a * 10}. It is on sale for {c * 5}% off. What is the sale price?",
         f"A train travels {a * 10} km in {c} hours. What is its average speed, and how far "
         f"does it go in {d} hours at that speed?",
         f"One pipe fills a tank in {c} hours and another in {c + d} hours. How long do they "
         "take together?",
         f"Solve for x: {c}x + {a} = {c * x + a}.",
         f"Solve the system: x + y = {x + y}, {c}x - y = {c * x - y}.",
         f"Find the roots of x^2 - {c + d}x + {c * d} = 0.",
         f"${a * 100} is invested at {c}% simple interest for {d} years. What is the interest?",
         f"${a * 100} grows at {c}% a year, compounded yearly. What is it worth after {d % 5 + 2}"
         " years?",
         f"{who} and a friend share ${(c + d) * a} in the ratio {c}:{d}. How much does each get?",
         f"A rectangle is {a} cm by {b} cm. What are its area and perimeter?",
         f"{who} is {a} years older than a cousin. In {d} years {who} will be twice the "
         "cousin's age. How old is each now?",
         f"The sum of {c} consecutive integers is {c * a + c * (c - 1) // 2}. What are they?",
         f"What is {c}/{d + 1} + {d}/{c + 1}? Give the answer as a simplified fraction.",
         f"A price rose from ${a} to ${a + b}. What is the percentage increase?",
         f"What are the greatest common divisor and least common multiple of {a * c} and "
         f"{b * c}?",
         f"An arithmetic sequence starts {a}, {a + c}, {a + 2 * c}, ... What is term {d + 10}?",
         f"A bag holds {c} red, {d} blue and {a} green marbles. What is the probability of "
         "drawing two red marbles without replacement?",
         f"A meeting starts at {d % 12 + 1}:{r(0, 5)}5 and lasts {a * 7} minutes. When does it"
         " end?",
         f"{a} liters of a {c * 10}% salt solution are mixed with {b} liters of a {d * 5}% one."
         " What is the concentration of the mix?",
         f"A car uses {c}.{d % 10} liters of fuel per 100 km. How much fuel does a {a * 25} km "
         f"trip take, and what does it cost at $1.{b:02d} per liter?",
         f"The average of {c + 2} numbers is {a}. One number, {b}, is removed. What is the "
         "average of the rest?"]
    ask = _pick(rng, ("", " Show your work.", " Explain each step.", " Answer step by step."))
    return p[t] + ask


def math_problems(seed: int = 3, per_template: int = 80) -> dict[str, list[list[dict]]]:
    """Arithmetic and algebra word problems with random numbers, by template."""
    rng = random.Random(seed)
    return {f"template-{t:02d}": [[{"role": U, "content": _math(rng, t)}]
                                 for _ in range(per_template)] for t in range(22)}

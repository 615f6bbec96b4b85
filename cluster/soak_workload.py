"""The soak's workload: a seeded pool of greedy chat requests and the streams that run them,
each recorded chunk by chunk as the client saw it."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cluster.soak import SoakConfig

TOPICS = ("the sea", "a lighthouse", "volcanoes", "bread", "chess", "the moon", "rivers",
          "a lost key", "bees", "trains", "winter", "a robot", "maps", "tea", "clocks",
          "owls", "glass", "deserts", "music", "a small town")
TASKS = ("Write a short story about {}.", "Explain {} to a ten-year-old.",
         "List five facts about {}.", "Write a poem about {}.", "Describe {} in detail.",
         "What would a scientist say about {}?", "Give advice to someone who loves {}.")


@dataclass(frozen=True)
class Item:
    """One request of the pool: a chat prompt and its length (greedy, EOS ignored)."""

    messages: tuple
    max_tokens: int

    def kwargs(self) -> dict:
        return {"messages": [dict(m) for m in self.messages], "temperature": 0,
                "max_tokens": self.max_tokens, "ignore_eos": True}


def make_pool(n: int, seed: int, min_tokens: int, max_tokens: int) -> list[Item]:
    """`n` chat requests drawn with `seed`: a task about a topic, plus a few more words."""
    rng = random.Random(seed)
    pool = []
    for _ in range(n):
        words = " ".join(rng.choices(TOPICS, k=rng.randint(0, 8)))
        text = rng.choice(TASKS).format(rng.choice(TOPICS)) + (f" Mention {words}." if words
                                                                else "")
        pool.append(Item(((("role", "user"), ("content", text)),),
                         rng.randint(min_tokens, max_tokens)))
    return pool


@dataclass
class Record:
    """One stream as the client saw it (times in seconds since the soak started)."""

    item: int
    cancel_after: int | None  # the client cancels once it has this many tokens
    start: float
    times: list[float] = field(default_factory=list)  # arrival of each chunk
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    end: float | None = None
    outcome: str = "running"  # completed, cancelled, finish_<reason>, truncated, a status code
    detail: str = ""

    def gaps(self) -> list[tuple[float, float]]:
        """(from, to) of each wait for the next chunk, the first from the call's start."""
        marks = [self.start, *self.times]
        return list(zip(marks, marks[1:]))


def _outcome(finish: str | None) -> str:
    if finish is None:
        return "truncated"  # the stream ended without its final chunk
    return "completed" if finish in ("length", "stop") else f"finish_{finish}"


async def run_stream(client, item: Item, rec: Record, clock) -> None:
    """Run one request, recording its chunks; cancel it at `rec.cancel_after` tokens."""
    from tandem_client.errors import TandemError

    stream = client.generate(**item.kwargs())
    finish = None
    try:
        async for chunk in stream:
            rec.times.append(clock())
            rec.tokens += chunk.token_ids
            rec.text += chunk.text
            finish = chunk.finish_reason or finish
            if rec.cancel_after is not None and finish is None and \
                    len(rec.tokens) >= rec.cancel_after:
                stream.cancel()
                rec.outcome = "cancelled"
                break
        else:
            rec.outcome = _outcome(finish)
    except TandemError as e:
        rec.outcome, rec.detail = e.code.name, str(e)[:300]
    finally:
        rec.end = clock()


async def worker(client, pool: list[Item], cfg: SoakConfig, rng: random.Random, clock,
                 running, records: list[Record]) -> None:
    """Streams one after another while `running()`."""
    while running():
        i = rng.randrange(len(pool))
        cancel = rng.random() < cfg.cancel_fraction and pool[i].max_tokens > 1
        rec = Record(i, rng.randint(1, pool[i].max_tokens - 1) if cancel else None, clock())
        records.append(rec)
        await run_stream(client, pool[i], rec, clock)

"""Figure 7's pairs: each repetition runs, per concurrency, a no-spec and an EAGLE-3 cold process
back to back (which goes first alternates), and a concurrency's ratio is the median over its
pairs of EAGLE-3's over its partner's, so one slow process moves one pair, not the headline.
Pure functions of rows; `fig7_cold_start.py` runs the processes."""

from __future__ import annotations

import statistics

from bench.common import ratio, rnd

VARIANTS = ("no_spec", "eagle3_default")
RATIOS = ("per concurrency, each repetition's pair: EAGLE-3's cold process over the no-spec one "
          "run next to it (tokens/s); the headline is the median over the pairs where both "
          "processes succeeded (pairs: every pair's ratios); served_*: the first pass less "
          "its preparation, information only")
# Per pair: the key it is stored under, then the row's tokens/s it divides.
PAIR_KEYS = (("first_pass", ("first_pass", "tokens_per_s")),
             ("served_first_pass", ("first_pass", "served_tokens_per_s")),
             ("second_pass", ("second_pass", "tokens_per_s")))


def pair_order(rep: int, index: int) -> tuple[str, str]:
    """Which variant's process runs first in repetition `rep` (from 1) at the concurrency with
    this index: no-spec first at rep 1's first concurrency, swapped with each step of either."""
    return VARIANTS if (rep - 1 + index) % 2 == 0 else VARIANTS[::-1]


def cold_pairs(conc: list[int], reps: int) -> list[tuple[int, int, tuple[str, str]]]:
    """(rep, concurrency, order) of every pair, all of rep 1's concurrencies before rep 2's, so
    a deadline drops the last repetitions' pairs, never a concurrency's first."""
    return [(r, c, pair_order(r, i)) for r in range(1, reps + 1) for i, c in enumerate(conc)]


def expected_s(done: list[tuple[str, int, float]], group: list[tuple[str, int]]) -> float:
    """Seconds a group of cold processes [(variant, concurrency)] is expected to take, from
    those done [(variant, concurrency, seconds)]: each the longest of its (variant,
    concurrency) so far, else the longest of any, else 0 (nothing to go by)."""
    longest = max((s for _, _, s in done), default=0.0)
    return sum(max((s for v, c, s in done if (v, c) == job), default=longest) for job in group)


def field(row: dict, path: tuple[str, str]):
    return row.get(path[0], {}).get(path[1])


def pair_rows(runs: dict, conc: list[int]) -> dict[int, list[dict]]:
    """Per concurrency, every repetition where both variants' cold processes succeeded: the
    rep, which ran first, and EAGLE-3's tokens/s over no-spec's (`PAIR_KEYS`)."""
    out = {}
    for c in conc:
        by = {v: {r.get("rep", 1): r for r in runs.get(v, [])
                  if r.get("concurrency") == c and "error" not in r} for v in VARIANTS}
        pairs = []
        for rep in sorted(set(by["no_spec"]) & set(by["eagle3_default"])):
            base, spec = by["no_spec"][rep], by["eagle3_default"][rep]
            pair = {"rep": rep, "ran_first": spec.get("ran_first")}
            pair.update({k: ratio(field(spec, p), field(base, p)) for k, p in PAIR_KEYS})
            pairs.append(pair)
        out[c] = pairs
    return out


def median_of(xs: list) -> float | None:
    xs = [x for x in xs if x is not None]
    return rnd(statistics.median(xs)) if xs else None


def summarize(res: dict, conc: list[int]) -> None:
    """Per pass and concurrency, the median over pairs of EAGLE-3 over no speculation, every
    pair's ratios, and time to ready (the median over a variant's cold processes)."""
    pairs = pair_rows(res["runs"], conc)
    res["pairs"] = {str(c): ps for c, ps in pairs.items()}
    for key, _ in PAIR_KEYS:
        res[f"{key}_vs_no_spec"] = {str(c): median_of([p[key] for p in ps])
                                    for c, ps in pairs.items()}
    res["time_to_ready_s"] = {v: {
        "prepare_to_serve": res["ready"].get(v, {}).get("ready_s"),
        "first_generate": {str(c): median_of([r["ready_s"] for r in res["runs"][v]
                                              if r["concurrency"] == c and "error" not in r])
                           for c in conc}} for v in VARIANTS}


def fig7_goals(res: dict, conc: list[int]) -> dict:
    first = res["first_pass_vs_no_spec"]
    ran = [r for rows in res["runs"].values() for r in rows if "error" not in r]
    ran += [r for r in res["ready"].values() if "error" not in r]
    measured = [x for x in first.values() if x is not None]
    low = min(measured) if measured else None
    late = sum(r["compiles_after_ready"] for r in ran)
    firsts = {v: r.get("first_over_steady") for v, r in res["ready"].items()}
    worst = max((x for x in firsts.values() if x is not None), default=None)
    complete = not res["skipped_children"] and not res["failed_children"]
    return {"eagle3_first_pass_vs_no_spec": first,
            "eagle3_first_pass_min_ratio": low,
            "pairs_per_concurrency": {c: len(ps) for c, ps in res.get("pairs", {}).items()},
            # None: no failing measure, but some concurrency was not measured
            "eagle3_first_pass_at_least_0.97x_no_spec": None if low is None
            else (False if low < 0.97 else (True if len(measured) == len(conc) else None)),
            "compiles_after_ready": late,
            "no_compiles_after_ready": None if not ran
            else (False if late else (True if complete else None)),
            "first_request_after_ready_vs_steady": firsts,
            "first_request_within_1.2x_steady": None if worst is None
            else (False if worst > 1.2 else (True if len(firsts) == len(VARIANTS)
                                              and None not in firsts.values() else None)),
            "children_skipped": list(res["skipped_children"]),
            "children_failed": list(res["failed_children"])}

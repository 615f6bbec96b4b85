"""The soak's accounting: every stream against its fault-free reference (lost, duplicated,
differing tokens), each fault's pause, blocks left in use; the JSON result and its summary."""

from __future__ import annotations

import dataclasses
import difflib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cluster.soak import SoakConfig
    from cluster.soak_workload import Item, Record


def count(values) -> dict[str, int]:
    """How many times each value occurs."""
    out: dict[str, int] = {}
    for v in values:
        out[v] = out.get(v, 0) + 1
    return out


def compare(got: list[int], want: list[int], whole: bool) -> tuple[int, int, bool]:
    """(lost, duplicated, differs) of a stream's tokens against the reference's: lost are
    reference tokens missing from the stream, duplicated are stream tokens the reference does
    not have there (token-level diff). A stream that ended early (`whole` False) is held to
    the reference's head only: the tail it never asked for is not lost."""
    ops = difflib.SequenceMatcher(None, want, got, autojunk=False).get_opcodes()
    if not whole and ops and ops[-1][0] == "delete" and ops[-1][2] == len(want):
        ops = ops[:-1]
    lost = sum(i2 - i1 for op, i1, i2, _, _ in ops if op == "delete")
    dup = sum(j2 - j1 for op, _, _, j1, j2 in ops if op == "insert")
    return lost, dup, any(op != "equal" for op, *_ in ops)


def _pct(xs: list[float], q: float) -> float | None:
    """The q-th percentile (linear between ranks), None of nothing."""
    if not xs:
        return None
    xs = sorted(xs)
    k = (len(xs) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return round(xs[lo] + (xs[hi] - xs[lo]) * (k - lo), 4)


def pauses(records: list[Record], faults: list[dict], end: float) -> tuple[list[dict], dict]:
    """Per fault, over the streams live during its outage (until the actor is back and its
    streams moved on): P50 / P99 of each one's longest wait for a chunk before the next fault;
    and the same for streams that lived through no outage, as the baseline."""
    windows = [(f["at_s"], f["at_s"] + max(f.get("recovered_s") or 0, f.get("resumed_s") or 0))
               for f in faults]
    out, faulted = [], set()
    for k, (t, until) in enumerate(windows):
        nxt = windows[k + 1][0] if k + 1 < len(windows) else float("inf")
        live = [r for r in records if r.start <= until and
                (r.end if r.end is not None else end) >= t]
        worst = []
        for r in live:
            faulted.add(id(r))
            gaps = [b - a for a, b in r.gaps() if b > t and a < nxt]
            if gaps:
                worst.append(max(gaps))
        out.append({"live_streams": len(live), "pause_p50_s": _pct(worst, 50),
                    "pause_p99_s": _pct(worst, 99), "pause_max_s": _pct(worst, 100)})
    calm = [max(b - a for a, b in r.gaps()) for r in records if id(r) not in faulted and r.times]
    return out, {"streams": len(calm), "pause_p50_s": _pct(calm, 50),
                 "pause_p99_s": _pct(calm, 99)}


def report(cfg: SoakConfig, pool: list[Item], records: list[Record], faults: list[dict],
           refs: dict, actors: list[tuple[str, dict]] | None, soak_s: float) -> dict:
    """The results as JSON-ready data (the caller adds the command line and machine)."""
    lost = dup = compared = 0
    differing, unreferenced = [], 0
    for r in records:
        ref = refs.get(r.item)
        if not isinstance(ref, tuple):
            unreferenced += 1
            continue
        whole = r.outcome == "completed"
        n_lost, n_dup, differs = compare(r.tokens, ref[0], whole)
        text_ok = r.text == ref[1] if whole else ref[1].startswith(r.text)
        lost, dup, compared = lost + n_lost, dup + n_dup, compared + 1
        if differs or not text_ok:
            differing.append({"item": r.item, "outcome": r.outcome, "lost": n_lost,
                              "duplicated": n_dup, "text_matches": text_ok,
                              "got": r.tokens[:64], "want": ref[0][:64]})
    per_fault, calm = pauses(records, faults, soak_s)
    leaks = None if actors is None else [
        {"actor": name, "blocks_in_use": s["blocks_total"] - s["blocks_free"],
         **{k: s[k] for k in ("blocks_total", "running", "held", "reserved", "waiting")
            if k in s}}
        for name, s in actors]
    completed = [r for r in records if r.outcome == "completed"]
    return {
        "config": dataclasses.asdict(cfg), "soak_s": round(soak_s, 2),
        "streams": len(records), "outcomes": count(r.outcome for r in records),
        "failures": [{"item": r.item, "outcome": r.outcome, "detail": r.detail}
                     for r in records if r.detail][:20],
        "tokens": {"received": sum(len(r.tokens) for r in records),
                   "per_s": round(sum(len(r.tokens) for r in records) / max(soak_s, 1e-9), 2),
                   "lost": lost, "duplicated": dup},
        "compared_streams": compared, "completed_streams": len(completed),
        "outputs_differing": len(differing),
        "differing_completed": sum(d["outcome"] == "completed" for d in differing),
        "differing": differing[:10], "unreferenced_streams": unreferenced,
        "reference": {"how": "each pool request run again on the cluster after the soak, "
                             "fault-free, greedy", "requests": len(refs),
                      "failed": {str(i): str(e)[:200] for i, e in refs.items()
                                 if not isinstance(e, tuple)}},
        "leaked_blocks": None if leaks is None else sum(x["blocks_in_use"] for x in leaks),
        "actors": leaks, "faults": [{**f, **p} for f, p in zip(faults, per_fault)],
        "no_fault_baseline": calm,
        "pool": [{"prompt": dict(it.messages[0])["content"], "max_tokens": it.max_tokens}
                 for it in pool],
    }


def clean(result: dict) -> bool:
    """Streams ran, each completed or was cancelled by the soak (none failed or was cut),
    no lost or duplicated token, no output differing from the fault-free run, no block left
    in use."""
    return (result["completed_streams"] > 0
            and set(result["outcomes"]) <= {"completed", "cancelled"}
            and result["tokens"]["lost"] == 0 and result["tokens"]["duplicated"] == 0
            and result["outputs_differing"] == 0 and not result["leaked_blocks"])


def summary(r: dict) -> str:
    """A few lines of the results."""
    lines = [f"{r['streams']} streams in {r['soak_s']:.0f} s: {r['outcomes']}",
             f"tokens {r['tokens']['received']} ({r['tokens']['per_s']}/s), lost "
             f"{r['tokens']['lost']}, duplicated {r['tokens']['duplicated']}, outputs differing "
             f"{r['outputs_differing']} of {r['compared_streams']}, leaked blocks "
             f"{r['leaked_blocks']}"]
    for f in r["faults"]:
        lines.append(f"  {f['kind']:8s} at {f['at_s']:6.1f} s: back in {f['recovered_s']:.1f} s,"
                     f" streams moving again after {f['resumed_s']} s,"
                     f" {f['live_streams']} live, pause P50 {f['pause_p50_s']} s P99 "
                     f"{f['pause_p99_s']} s" + (f" ERROR {f['error']}" if "error" in f else ""))
    return "\n".join(lines)

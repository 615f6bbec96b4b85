"""Figure 7: cold start, as a user of the Python API meets it. Per variant (no speculation, and
EAGLE-3 as an engine speculates unless told) and concurrency, a fresh process builds the engine
(`Engine.from_pretrained`) and runs figure 3's workload twice through `Engine.generate`: the
first pass prepares the engine on first use (`engine/warmup.py`), the second is the steady
reference; --fig7-reps repetitions, each a no-spec and an EAGLE-3 process side by side per
concurrency (the first alternating; a ratio is the median over pairs, so one slow process
moves one pair, not the headline). Per variant, one more fresh process prepares as a server
does (`prepare_to_serve`) and times one request against the same request repeated. Every
process counts the Triton kernels compiled after ready (`tandem_jit_compiles_after_ready_total`)."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from bench.common import (
    SETTINGS_ENV,
    acceptance,
    held_out_messages,
    lazy_torch,
    log,
    ratio,
    rnd,
    save,
    spec_counts,
    sync,
    torch_dtype,
)
from engine.jit_watch import CACHE_ENV, default_cache_dir

VARIANTS = ("no_spec", "eagle3_default")
RATIOS = ("per concurrency, each repetition's pair: EAGLE-3's cold process over the no-spec one "
          "run next to it (tokens/s); the headline is the median over the pairs where both "
          "processes succeeded (pairs: every pair's ratios); served_*: the first pass less "
          "its preparation, information only")
# Per pair: the key it is stored under, then the row's tokens/s it divides.
PAIR_KEYS = (("first_pass", ("first_pass", "tokens_per_s")),
             ("served_first_pass", ("first_pass", "served_tokens_per_s")),
             ("second_pass", ("second_pass", "tokens_per_s")))
RESULT = "fig7 child:"  # the line a child answers with
FIG7_SMOKE = {"fig7_concurrency": "1", "fig3_tokens": 4, "num_blocks": 256,
              "fig7_ready_reps": 2, "fig7_reps": 2}
GRACE_S = 30.0  # how long past --fig7-deadline-s a process may run before it is killed
CHILD_KEYS = ("model", "head", "device", "dtype", "num_blocks", "fig3_tokens", "prompt_offset",
              "fig7_ready_reps")


def engine_spec(variant: str, head: str | None):
    """None, or EAGLE-3 with every field at its default (the head may be named)."""
    from engine.config import SpecConfig

    return None if variant == "no_spec" else SpecConfig(head=head)


# ---- the child: one fresh process, one variant ------------------------------------------------


def child_main(argv: list[str]) -> None:
    """`python -m bench.fig7_cold_start --child SPEC.json --spawned T`: `cold` or `ready` for
    the spec's variant; prints `RESULT` and the row as JSON. T is the wall clock (time.time())
    of the parent just before it started this process."""
    p = argparse.ArgumentParser()
    p.add_argument("--child", required=True)
    p.add_argument("--spawned", type=float, required=True)
    a = p.parse_args(argv)
    started = time.time() - a.spawned  # the interpreter and this module, imported
    if os.environ.get(SETTINGS_ENV):  # the parent's --set values
        from bench.suite import apply_inherited
        apply_inherited()
    with open(a.child) as f:
        spec = json.load(f)
    row = {"python_started_s": rnd(started, 3)}
    run = cold_child if spec["kind"] == "cold" else ready_child
    row.update(run(argparse.Namespace(**spec), a.spawned))
    print(RESULT + json.dumps(row), flush=True)


def build(args, spawned: float) -> tuple[object, dict]:
    """The variant's engine through `Engine.from_pretrained`, and when it was built (seconds
    since spawn: torch and the engine imported, the engine built)."""
    t0 = time.perf_counter()
    from engine import Engine, jit_watch

    # Record every compile from here on (the figures' hook; it only watches).
    jit_watch.install()
    imported = time.time() - spawned
    t1 = time.perf_counter()
    eng = Engine.from_pretrained(args.model, device=args.device, dtype=torch_dtype(args),
                                 num_blocks=args.num_blocks, enable_prefix_caching=False,
                                 spec=engine_spec(args.variant, args.head))
    now = time.perf_counter()
    return eng, {"imported_s": rnd(imported, 3), "import_s": rnd(t1 - t0, 3),
                 "build_s": rnd(now - t1, 3), "built_s": rnd(time.time() - spawned, 3),
                 "build_started": t1, "build_phases": eng.build_phases}


def workload(eng, args, c: int):
    """Figure 3's burst at `c` streams: the first c held-out prompts (cycled), greedy,
    --fig3-tokens tokens each, EOS ignored."""
    from engine import SamplingParams

    msgs = held_out_messages(c, args.prompt_offset)
    return ([eng.encode_prompt(m) for m in msgs],
            SamplingParams(temperature=0, max_tokens=args.fig3_tokens, ignore_eos=True))


def timed_pass(args, eng, batch, params) -> dict:
    """One `generate` over the batch: wall, tokens/s, acceptance, and the compiles and graph
    captures inside it."""
    from bench.fig3_concurrency import window_events, window_mark

    counts, mark = spec_counts(eng), window_mark()
    sync(args)
    t0 = time.perf_counter()
    outs = eng.generate(batch, params)
    sync(args)
    wall = time.perf_counter() - t0
    tokens = sum(len(o.token_ids) for o in outs)
    warming = eng.warming  # a speculative engine still decoding plainly
    return {"wall_s": rnd(wall, 4), "tokens": tokens, "tokens_per_s": rnd(tokens / wall, 1),
            "acceptance_length": acceptance(counts, spec_counts(eng)),
            "spec_graphs_pending": None if eng.spec is None else
            (len(warming.pending) if warming is not None else 0),
            **window_events(mark), "started": t0}


def after_ready(eng) -> dict:
    """Compiles after ready as the engine's metric exports it
    (`tandem_jit_compiles_after_ready_total`, read from a `Metrics` registry watching the
    engine) and as `jit_watch` counts it; the two agree."""
    from engine import jit_watch
    from engine.metrics import Metrics

    m = Metrics("colocated")
    m.watch_engine(eng)
    metric = m.registry.get_sample_value("tandem_jit_compiles_after_ready_total",
                                         {"role": "colocated"})
    return {"compiles_after_ready": jit_watch.after_ready(),
            "compiles_after_ready_metric": None if metric is None else int(metric)}


def late_kernels(ready_at: float) -> dict:
    """{kernel: [count, seconds]} of the compiles that began after `ready_at`."""
    from engine import jit_watch

    return jit_watch.summary([e for e in jit_watch.since(0) if e.at - e.seconds >= ready_at])


def cold_child(args, spawned: float) -> dict:
    """Build, then two passes of the workload through `generate`; the first prepares the
    engine (`eng.ready`)."""
    eng, row = build(args, spawned)
    batch, params = workload(eng, args, args.concurrency)
    row.pop("build_started")
    called = time.time() - spawned
    first = timed_pass(args, eng, batch, params)
    ready = eng.ready
    ready_at = first.pop("started") + ready.total  # the ready mark, at the end of preparing
    # The same pass less its preparation: what serving the batch took once ready.
    served = first["wall_s"] - ready.total
    first["served_wall_s"] = rnd(served, 4)
    first["served_tokens_per_s"] = rnd(first["tokens"] / served, 1) if served > 0 else None
    row.update({"concurrency": args.concurrency, "ready_s": rnd(called + ready.total, 3),
                "prepare_s": rnd(ready.total, 3), "graphs_s": rnd(ready.graphs, 3),
                "first_pass": first})
    second = timed_pass(args, eng, batch, params)
    second.pop("started")
    row.update({"second_pass": second, **after_ready(eng),
                "compiled_after_ready": late_kernels(ready_at),
                "first_over_second_wall": ratio(first["wall_s"], second["wall_s"])})
    return row


def ready_child(args, spawned: float) -> dict:
    """Build and `prepare_to_serve` as a serving process does, then one request (the
    workload's first prompt) before anything else, then the same request --fig7-ready-reps
    times (the steady latency)."""
    eng, row = build(args, spawned)
    eng.prepare_to_serve(started=row.pop("build_started"))
    ready_at = time.perf_counter()
    row.update({"ready_s": rnd(time.time() - spawned, 3), "ready": {
        "load_s": rnd(eng.ready.load, 3), "graphs_s": rnd(eng.ready.graphs, 3),
        "total_s": rnd(eng.ready.total, 3)}})
    batch, params = workload(eng, args, 1)
    first = timed_pass(args, eng, batch, params)
    steady = [timed_pass(args, eng, batch, params) for _ in range(args.fig7_ready_reps)]
    walls = [s["wall_s"] for s in steady]
    row.update({"first_request_s": first["wall_s"], "first_request": first,
                "steady_request_s": rnd(statistics.median(walls), 4),
                "steady_reps_s": walls, **after_ready(eng),
                "compiled_after_ready": late_kernels(ready_at)})
    row["first_over_steady"] = ratio(row["first_request_s"], row["steady_request_s"])
    for r in (first, *steady):
        r.pop("started")
    return row


# ---- the parent: one child per (variant, concurrency), one per variant after ready -----------


def cold_pairs(conc: list[int], reps: int) -> list[tuple[int, int, tuple[str, str]]]:
    """(rep, concurrency, order) of every pair, all of rep 1's concurrencies before rep 2's, so
    a deadline drops the last repetitions' pairs, never a concurrency's first; no-spec runs
    first at rep 1's first concurrency, the order swapped with each step of either."""
    return [(r, c, VARIANTS[::1 if (r - 1 + i) % 2 == 0 else -1])
            for r in range(1, reps + 1) for i, c in enumerate(conc)]


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


class TritonCache:
    """The Triton disk cache each child gets (TRITON_CACHE_DIR): `cold`, a fresh empty temporary
    folder per child, removed after it; `warm`, the one this process would use (its
    TRITON_CACHE_DIR, else Triton's default), shared by every child."""

    def __init__(self, mode: str) -> None:
        self.mode, self.shared = mode, None
        if mode == "warm":
            self.shared = os.environ.get(CACHE_ENV) or default_cache_dir()

    def record(self) -> dict:
        if self.mode == "cold":
            return {"mode": "cold", "dir": "a fresh empty temporary folder per child, removed "
                                           "after it (TRITON_CACHE_DIR)"}
        return {"mode": "warm", "dir": self.shared, "files_before": files_in(self.shared),
                "order": "shared by every process; the ready processes run first and fill it"}

    def open(self) -> str:
        return tempfile.mkdtemp(prefix="tandem-fig7-triton-") if self.mode == "cold" \
            else self.shared

    def close(self, path: str) -> None:
        if self.mode == "cold":
            shutil.rmtree(path, ignore_errors=True)


def files_in(path: str) -> int:
    return sum(len(files) for _, _, files in os.walk(path)) if os.path.isdir(path) else 0


def run_child(args, cache: TritonCache, kind: str, variant: str, c: int,
              timeout: float) -> dict:
    """One fresh process (`child_main`); its row, with the Triton cache folder it used and the
    files it added there. A failed child raises RuntimeError with its output's tail."""
    spec = {k: getattr(args, k) for k in CHILD_KEYS}
    spec.update({"kind": kind, "variant": variant, "concurrency": c})
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    folder = cache.open()
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(spec, f)
    try:
        before = files_in(folder)
        # The same thread count as this process: on a CPU it sets the speed.
        env = {**os.environ, CACHE_ENV: folder,
               "OMP_NUM_THREADS": str(lazy_torch().get_num_threads())}
        spawned = time.time()
        proc = subprocess.run([sys.executable, "-m", "bench.fig7_cold_start", "--child", f.name,
                               "--spawned", repr(spawned)], cwd=root, env=env,
                              capture_output=True, text=True, timeout=timeout)
        exited = time.time() - spawned
        added = files_in(folder) - before
    finally:
        os.unlink(f.name)
        cache.close(folder)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT)]
    if proc.returncode or not lines:
        raise RuntimeError(f"{kind} {variant} c={c}: the child failed ({proc.returncode}):\n"
                           f"{(proc.stdout + proc.stderr)[-3000:]}")
    row = json.loads(lines[-1][len(RESULT):])
    row.update({"process_s": rnd(exited, 3), "triton_cache_dir": folder,
                "triton_cache_files_added": added})
    return row


def fig_cold_start(args, res: dict) -> None:
    from cluster.soak_cluster import embedded_export
    from engine.testing import tiny_checkpoint

    smoke = bool(getattr(args, "fig7_smoke", False))
    scratch = tempfile.mkdtemp(prefix="tandem-fig7-") if smoke else None
    try:
        if smoke:
            args = argparse.Namespace(**{**vars(args), **FIG7_SMOKE})
            log("fig 7: smoke: a tiny random model with SmolLM2's tokenizer, a random head")
            args.model, args.head = tiny_checkpoint(scratch, embedded_export())
        conc = [int(c) for c in str(args.fig7_concurrency).split(",") if c.strip()]
        cache = TritonCache(args.fig7_triton_cache)
        res["config"] = fig7_config(args, conc, smoke)
        res["triton_cache"] = cache.record()
        groups = [[("ready", v, 1, None)] for v in VARIANTS]
        groups += [[("cold", v, c, rep) for v in order]
                   for rep, c, order in cold_pairs(conc, args.fig7_reps)]
        run_jobs(args, res, cache, groups)
        if cache.shared:
            res["triton_cache"]["files_after"] = files_in(cache.shared)
    finally:
        if scratch:
            shutil.rmtree(scratch, ignore_errors=True)
    summarize(res, conc)
    res["goals"] = fig7_goals(res, conc)


def job_name(kind: str, variant: str, c: int, rep: int | None) -> str:
    return f"ready {variant}" if kind == "ready" else f"cold {variant} c={c} rep {rep}"


def run_jobs(args, res: dict, cache: TritonCache, groups: list[list[tuple]]) -> None:
    """Each group of children [(kind, variant, concurrency, rep)] in turn, a ready child alone
    and a cold pair together: a group starts only if it is expected to end by
    --fig7-deadline-s (`expected_s`), else its children are listed as skipped; any child
    still running GRACE_S past the deadline is killed. A failed child records its error and
    the next still runs."""
    start = time.perf_counter()
    res["ready"], res["runs"] = {}, {v: [] for v in VARIANTS}
    res["skipped_children"], res["failed_children"] = [], []
    done = []  # (variant, concurrency, seconds) of each cold child so far
    for group in groups:
        left = args.fig7_deadline_s - (time.perf_counter() - start)
        if left <= 0 or expected_s(done, [(v, c) for k, v, c, _ in group if k == "cold"]) > left:
            res["skipped_children"] += [job_name(*job) for job in group]
            continue
        for kind, variant, c, rep in group:
            name = job_name(kind, variant, c, rep)
            hard = args.fig7_deadline_s + GRACE_S - (time.perf_counter() - start)
            if hard <= 1:
                res["skipped_children"].append(name)
                continue
            log(f"fig 7: {name}: a fresh process")
            try:
                row = run_child(args, cache, kind, variant, c,
                                min(args.fig7_child_timeout_s, hard))
            except (RuntimeError, subprocess.TimeoutExpired) as e:
                res["failed_children"].append(name)
                row = {"concurrency": c, "error": str(e)}
                log(f"fig 7: {name}: failed")
            if kind == "ready":
                res["ready"][variant] = row
            else:
                row.update({"rep": rep, "ran_first": group[0][1]})
                res["runs"][variant].append(row)
                if "error" not in row:
                    done.append((variant, c, row["process_s"]))
            if "error" not in row:
                log(f"fig 7: {name}: {progress(kind, row)}")
            save(args.out, dict(res, partial=f"running; {name} done"))


def progress(kind: str, row: dict) -> str:
    if kind == "ready":
        return (f"ready {row['ready_s']} s, first request {row['first_request_s']} s against "
                f"{row['steady_request_s']} s steady, compiles after ready "
                f"{row['compiles_after_ready']}")
    return (f"built {row['built_s']} s, ready {row['ready_s']} s; first pass "
            f"{row['first_pass']['tokens_per_s']} tok/s, second "
            f"{row['second_pass']['tokens_per_s']} tok/s; compiles after ready "
            f"{row['compiles_after_ready']}")


def fig7_config(args, conc: list[int], smoke: bool) -> dict:
    spec0 = engine_spec("eagle3_default", args.head)
    return {"smoke": smoke, "model": args.model or "the embedded SmolLM2-135M-Instruct",
            "head": args.head or "the shipped head", "dtype": args.dtype,
            "concurrency": conc, "max_tokens": args.fig3_tokens, "ignore_eos": True,
            "num_blocks": args.num_blocks, "enable_prefix_caching": False,
            "prompts": "held-out split of cluster/prompt_sets.py (figure 3's workload), the "
                       f"first c from offset {args.prompt_offset}, cycled",
            "engine_default_spec": {"method": spec0.method, "num_tokens": spec0.num_tokens,
                                    "dynamic": spec0.dynamic,
                                    "context_drafts": spec0.context_drafts},
            "ready_reps": args.fig7_ready_reps, "reps": args.fig7_reps, "ratios": RATIOS,
            "deadline_s": args.fig7_deadline_s,
            "deadline": "a ready child or cold pair starts only if expected to end by "
                        "deadline_s (its processes' longest times so far); any process is "
                        f"killed {GRACE_S:g} s past it",
            "measures": "per child (a fresh process): seconds from spawn to the engine built "
                        "(built_s) and to ready (ready_s); cold children: two generate calls "
                        "over the burst, the first preparing the engine on first use, the "
                        "second the steady reference (wall, tokens/s; the first's "
                        "served_* leave its preparation out), in pairs (`ratios`); ready "
                        "children, one per variant: prepare_to_serve, one request, then the "
                        "same request ready_reps times (median: steady); compiles after ready "
                        "as the engine's metric counts them"}


def plot_cold_start(plt, res):
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for i, v in enumerate(VARIANTS):
        rows = [r for r in res["runs"][v] if "error" not in r]
        for key, style in (("first_pass", "o"), ("second_pass", "s")):
            a.scatter([r["concurrency"] for r in rows],
                      [r[key]["tokens_per_s"] for r in rows], marker=style, c=f"C{i}",
                      label=f"{v} {key.replace('_', ' ')} (each rep)")
    for i, (key, style) in enumerate((("first_pass", "o"), ("second_pass", "s"))):
        pts = sorted((int(c), x) for c, x in res[f"{key}_vs_no_spec"].items() if x is not None)
        b.plot([c for c, _ in pts], [x for _, x in pts], style + "-", c=f"C{i + 2}",
               label=f"{key} (median over pairs)")
        each = [(int(c), p[key]) for c, ps in res.get("pairs", {}).items() for p in ps
                if p[key] is not None]
        b.scatter([c for c, _ in each], [x for _, x in each], marker=style, c=f"C{i + 2}",
                  alpha=0.4, s=12)
    for ax in (a, b):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent streams")
        ax.legend()
    a.set_yscale("log")
    a.set_ylabel("tokens/s (generate wall, preparing included)")
    b.axhline(1.0, c="gray", ls="--")
    b.axhline(0.97, c="gray", ls=":")
    b.set_ylabel("EAGLE-3 default / no speculation")
    ready = ", ".join(f"{v} {r['ready_s']:.1f} s" for v, r in res["ready"].items()
                      if "error" not in r)
    fig.suptitle(f"fig 7: cold start, {res['environment'].get('gpu') or 'cpu'}; ready after "
                 f"prepare_to_serve: {ready}; compiles after ready "
                 f"{res['goals']['compiles_after_ready']}", fontsize=9)
    return fig


if __name__ == "__main__":
    child_main(sys.argv[1:])

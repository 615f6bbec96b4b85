"""Prometheus metrics for every component: one registry per `Metrics` object, with a `role`
label and, if given, a `model_name` label on every tandem series.

An own registry per component keeps several components in one process from colliding, and
also carries the process metrics (CPU, memory, file descriptors, Python GC).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from prometheus_client import (
    GC_COLLECTOR,
    PLATFORM_COLLECTOR,
    PROCESS_COLLECTOR,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    start_http_server,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from engine import collector, jit_watch

ROLES = ("router", "prefill", "decode", "colocated")
# Per-token gaps (ITL, TPOT): a fast GPU decode step up to a stalled CPU one.
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075,
                 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0)
# Whole-request latencies (TTFT, end to end): a cached short prompt up to a long generation.
REQUEST_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5,
                   10.0, 15.0, 20.0, 30.0, 60.0, 120.0)
# One request's KV handoff: a few blocks over NVLink up to a long prompt over TCP.
TRANSFER_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                    2.5, 5.0, 10.0)

# Tokens in one request's prompt or output: one token up to a long context.
LENGTH_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000,
                  100000)

STEP_PATHS = ("overlapped", "fused", "regular")
PROCESS_COLLECTORS = (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR)


class Metrics:
    """All tandem metrics of one component, in its own registry, labelled with its role and,
    when `model_name` is given (every serving component gives it), the model it serves.
    A registry of its own (`registry` None) also gets the process collectors."""

    def __init__(self, role: str, registry: CollectorRegistry | None = None, *,
                 model_name: str | None = None) -> None:
        if role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
        self.role, self.model_name = role, model_name
        self.label_names = ("role", "model_name") if model_name else ("role",)
        self.bound = (role, model_name) if model_name else (role,)
        self.registry = registry if registry is not None else _own_registry()
        self._engine_counters = EngineCounters(self.label_names, self.bound)
        self.registry.register(self._engine_counters)  # at zero until `watch_engine`
        self._spec_seen: tuple[list[int], list[int]] = ([], [])
        self._steps_seen: list[int] = []
        self._k_seen: dict[tuple[str, str], int] = {}  # (metric, label) -> count fed so far
        self._latency_metrics()
        self._token_metrics()
        self._transfer_metrics()
        self._gauges()

    # ---- construction ------------------------------------------------------------------------

    def _metric(self, kind: type, name: str, doc: str, extra: tuple[str, ...] = (), **kw):
        m = kind(name, doc, (*self.label_names, *extra), registry=self.registry, **kw)
        # Bind role (and model) now so unlabelled series exist (at zero) before the first
        # observation; a metric with labels of its own takes them through `series`.
        return m if extra else m.labels(*self.bound)

    def series(self, metric, *values: str):
        """The child of `metric` (one with labels of its own) for this component and `values`
        of those labels, e.g. `m.series(m.errors, "INTERNAL").inc()`."""
        return metric.labels(*self.bound, *values)

    def _latency_metrics(self) -> None:
        h = Histogram
        self.ttft = self._metric(h, "tandem_ttft_seconds", "Time to first token.",
                                 buckets=REQUEST_BUCKETS)
        self.itl = self._metric(h, "tandem_itl_seconds", "Inter-token latency, per token.",
                                buckets=TOKEN_BUCKETS)
        self.tpot = self._metric(h, "tandem_tpot_seconds",
                                 "Time per output token after the first, per request.",
                                 buckets=TOKEN_BUCKETS)
        self.e2e = self._metric(h, "tandem_e2e_seconds", "Request latency, arrival to finish.",
                                buckets=REQUEST_BUCKETS)
        self.prefill_seconds = self._metric(
            h, "tandem_prefill_seconds", "Time from admission to the first token, per request.",
            buckets=REQUEST_BUCKETS)
        self.decode_seconds = self._metric(
            h, "tandem_decode_seconds", "Time from the first token to the finish, per request.",
            buckets=REQUEST_BUCKETS)
        self.prompt_len = self._metric(h, "tandem_request_prompt_tokens",
                                       "Prompt tokens per finished request.",
                                       buckets=LENGTH_BUCKETS)
        self.output_len = self._metric(h, "tandem_request_generated_tokens",
                                       "Generated tokens per finished request.",
                                       buckets=LENGTH_BUCKETS)

    def _token_metrics(self) -> None:
        c = Counter
        self.requests = self._metric(c, "tandem_requests_total", "Finished requests.",
                                     ("status",))
        self.prompt_tokens = self._metric(c, "tandem_prompt_tokens_total", "Prompt tokens.")
        self.generated_tokens = self._metric(c, "tandem_generated_tokens_total",
                                             "Generated tokens.")
        self.spec_drafted = self._metric(c, "tandem_spec_drafted_tokens_total",
                                         "Draft tokens proposed, by draft position (0-based).",
                                         ("position",))
        self.spec_accepted = self._metric(c, "tandem_spec_accepted_tokens_total",
                                          "Draft tokens accepted, by draft position (0-based).",
                                          ("position",))
        self.spec_k = self._metric(
            c, "tandem_spec_steps_by_k_total",
            "Fused speculative decode steps by the drafts per sequence dynamic K gave them "
            "(0: plain decoding, the draft head's KV kept current).", ("k",))
        self.spec_k_reasons = self._metric(
            c, "tandem_spec_k_reasons_total",
            "Why dynamic K gave each fused step its K: model (the step-cost model drafts), "
            "model_k0 (the model drafts nothing), losing (drafting measured slower than plain "
            "decoding), winning (drafting measured faster where the model said K=0), probe (a "
            "plain step timed), retry (a batch at K=0 drafting one token), collapsed (drafting off "
            "after an acceptance collapse).", ("reason",))
        self.resumes = self._metric(
            c, "tandem_stream_resumes_total",
            "Streams moved to other (or restarted) workers after one died mid-request; they "
            "went on where they stopped.")
        self.continuations = self._metric(
            c, "tandem_stream_continuations_total",
            "Calls that continued a client's broken stream (GenerateRequest.continuation: its "
            "router died or its connection dropped) after the tokens it had received.")
        self.shadow_checks = self._metric(
            c, "tandem_shadow_checks_total",
            "Greedy requests re-run without speculation to check for drift, by outcome: match, "
            "mismatch (the outputs differ), skipped (a check was running), failed.",
            ("outcome",))
        self.engine_steps = self._metric(
            c, "tandem_engine_steps_total",
            "Engine steps by path: overlapped (a one-graph decode step launched before the "
            "previous one was read), fused (one graph, one read: verify, draft head and chain "
            "with speculation, a plain greedy decode without), regular.", ("path",))

    def _transfer_metrics(self) -> None:
        self.kv_bytes = self._metric(Counter, "tandem_kv_transfer_bytes_total",
                                     "KV-cache bytes moved by successful transfers.")
        self.kv_failures = self._metric(Counter, "tandem_kv_transfer_failures_total",
                                        "KV-cache transfers that failed.")
        self.kv_dropped = self._metric(
            Counter, "tandem_kv_dropped_messages_total",
            "Malformed, oversized or truncated transfer control messages dropped (the loop "
            "that received each went on).")
        self.kv_seconds = self._metric(Histogram, "tandem_kv_transfer_seconds",
                                       "Duration of one successful KV-cache transfer.",
                                       buckets=TRANSFER_BUCKETS)
        self.kv_transfers = self._metric(
            Counter, "tandem_kv_transfers_total",
            "Successful KV-cache transfers by how the blocks travelled: push (this GPU copied "
            "them into the receiver's cache), pull (the receiver copied them out of this GPU's "
            "cache), direct or staged (UCX messages), local (one process).", ("path",))

    def _gauges(self) -> None:
        g = Gauge
        self.queue_depth = self._metric(g, "tandem_queue_depth", "Requests waiting.")
        self.running = self._metric(g, "tandem_running_requests", "Requests running.")
        self.blocks_used = self._metric(g, "tandem_kv_blocks_used", "KV blocks in use.")
        self.blocks_total = self._metric(g, "tandem_kv_blocks_capacity", "KV blocks in the cache.")
        self.acceptance_length = self._metric(
            g, "tandem_spec_acceptance_length",
            "Mean tokens emitted per verifying forward (accepted drafts + the target's token).")
        self.inflight = self._metric(g, "tandem_inflight_requests",
                                     "Requests admitted and not yet finished (router).")
        self.queue_seconds = self._metric(
            Histogram, "tandem_queue_seconds",
            "Time a request waited for admission (router) or for KV room on a decode actor.",
            buckets=REQUEST_BUCKETS)
        self.errors = self._metric(
            Counter, "tandem_request_errors_total",
            "Requests that ended with an error status, by gRPC status code: refused before "
            "any work (INVALID_ARGUMENT, UNAUTHENTICATED), at admission (RESOURCE_EXHAUSTED) "
            "or failed later.", ("code",))

    # ---- recording ---------------------------------------------------------------------------

    def observe_request(self, ttft: float | None, itls: Sequence[float], e2e: float,
                        prompt_tokens: int, output_tokens: int, status: str, *,
                        prefill: float | None = None, decode: float | None = None) -> None:
        """One finished request. `ttft` is None when no token came out; TPOT needs two tokens.
        `prefill` (admission to first token) and `decode` (first token to finish): None when
        not measured."""
        self.series(self.requests, status).inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.generated_tokens.inc(output_tokens)
        self.prompt_len.observe(prompt_tokens)
        self.output_len.observe(output_tokens)
        self.e2e.observe(e2e)
        if prefill is not None:
            self.prefill_seconds.observe(prefill)
        if decode is not None:
            self.decode_seconds.observe(decode)
        for gap in itls:
            self.itl.observe(gap)
        if ttft is not None:
            self.ttft.observe(ttft)
            if output_tokens > 1:
                self.tpot.observe((e2e - ttft) / (output_tokens - 1))

    def observe_spec(self, drafted_per_pos: Sequence[int],
                     accepted_per_pos: Sequence[int]) -> None:
        """Add per-position draft counts since the last call (deltas, not totals)."""
        if len(drafted_per_pos) != len(accepted_per_pos):
            raise ValueError("drafted_per_pos and accepted_per_pos differ in length")
        for pos, (d, a) in enumerate(zip(drafted_per_pos, accepted_per_pos)):
            self.series(self.spec_drafted, str(pos)).inc(d)
            self.series(self.spec_accepted, str(pos)).inc(a)

    def observe_spec_totals(self, drafted_per_pos: Sequence[int],
                            accepted_per_pos: Sequence[int]) -> None:
        """Feed cumulative counts (the engine's `SpecStats` lists); records what is new."""
        seen_d, seen_a = self._spec_seen
        self.observe_spec(_delta(drafted_per_pos, seen_d), _delta(accepted_per_pos, seen_a))
        self._spec_seen = (list(drafted_per_pos), list(accepted_per_pos))

    def observe_transfer(self, nbytes: int, seconds: float, ok: bool, path: str = "") -> None:
        """One KV transfer: bytes, duration and path (`TransferStats.path`) when it
        succeeded, a failure otherwise."""
        if not ok:
            self.kv_failures.inc()
            return
        self.kv_bytes.inc(nbytes)
        self.kv_seconds.observe(seconds)
        self.series(self.kv_transfers, path or "unknown").inc()

    def set_engine_gauges(self, queue_depth: int, running: int, blocks_used: int,
                          blocks_total: int, acceptance_length: float | None = None) -> None:
        """Snapshot of an engine (or the router's queue); acceptance None leaves it as it was."""
        self.queue_depth.set(queue_depth)
        self.running.set(running)
        self.blocks_used.set(blocks_used)
        self.blocks_total.set(blocks_total)
        if acceptance_length is not None:
            self.acceptance_length.set(acceptance_length)

    def watch_engine(self, engine) -> None:
        """Queue, running and KV-block gauges, prefix-cache and preemption counters read from
        `engine` at scrape time, so an idle engine reports its idle state and its step does no
        metrics work (plain reads of Python ints and containers, safe from the scrape
        thread)."""
        self.queue_depth.set_function(lambda: len(engine.scheduler.waiting))
        self.running.set_function(lambda: len(engine.scheduler.running))
        self.blocks_used.set_function(lambda: engine.num_blocks - engine.blocks.num_free)
        self.blocks_total.set_function(lambda: engine.num_blocks)
        self._engine_counters.engine = engine
        collector.watch_pauses()

    def count_error(self, code: str, n: int = 1) -> None:
        """`n` requests ended with gRPC status `code` (its name: "UNAUTHENTICATED")."""
        self.series(self.errors, code).inc(n)

    def watch_router(self, service) -> None:
        """The router's in-flight and queued requests, read at scrape time (`service`: a
        `router.server.GenerationService`)."""
        self.inflight.set_function(lambda: service.admission.running)
        self.queue_depth.set_function(lambda: service.queue_depth())

    # ---- exposition --------------------------------------------------------------------------

    def exposition(self) -> bytes:
        """This component's metrics in the Prometheus text format."""
        return generate_latest(self.registry)

    def engine_step(self, engine) -> None:
        """After each engine step: acceptance length, speculation and step counters (queue,
        running and KV blocks are read at scrape time: `watch_engine`)."""
        spec = engine.spec.stats if engine.spec is not None else None
        if spec is not None and spec.verify_steps:
            self.acceptance_length.set(spec.acceptance_length)
        if spec is not None:
            self.observe_spec_totals(spec.drafted_per_pos, spec.accepted_per_pos)
            policy = engine.spec.policy
            self.observe_k_totals(policy.batch_ks, policy.batch_why)
        pipe = getattr(engine, "pipe", None)
        self.observe_step_totals(engine.stats.steps, getattr(pipe, "fused_runs", 0),
                                 getattr(pipe, "overlapped_runs", 0))

    def observe_k_totals(self, by_k: dict[int, int], by_reason: dict[str, int]) -> None:
        """Cumulative dynamic-K counts (`KPolicy.batch_ks`, `batch_why`): fused steps by K and
        by the reason for their K; records what is new."""
        for metric, name, counts in ((self.spec_k, "k", by_k),
                                     (self.spec_k_reasons, "reason", by_reason)):
            for label, total in counts.items():
                key = (name, str(label))
                new = _new(total, self._k_seen.get(key, 0))
                if new:
                    self.series(metric, str(label)).inc(new)
                self._k_seen[key] = total

    def observe_step_totals(self, steps: int, fused: int, overlapped: int) -> None:
        """Cumulative engine counts: steps, fused-step launches, and those of them launched
        overlapped; records what is new per path."""
        totals = [overlapped, fused - overlapped, max(steps - fused, 0)]
        for path, new in zip(STEP_PATHS, _delta(totals, self._steps_seen)):
            self.series(self.engine_steps, path).inc(new)
        self._steps_seen = totals

    def serve(self, host: str = "127.0.0.1", port: int = 0):
        """Serve this registry over HTTP in a daemon thread; returns (server, actual port).

        Port 0 binds a free port; the bound port is read back from the socket, so there is no
        window in which another process could take it. Stop with `server.shutdown()`."""
        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        return server, server.server_address[1]


class EngineCounters:
    """Counts the engine keeps where they happen, exposed at scrape time: prefix-cache lookups
    and hits (tokens, `BlockManager`), preemptions (`Scheduler`), acceptance collapses
    (`spec.collapse.CollapseWatch`); once an engine is watched (its process runs it), Triton
    compiles after ready (`jit_watch.after_ready`) and time to ready (`Engine.ready`)."""

    def __init__(self, label_names: tuple[str, ...], bound: tuple[str, ...]) -> None:
        self.label_names, self.bound = list(label_names), list(bound)
        self.engine = None  # set by `Metrics.watch_engine`

    def collect(self):
        e = self.engine
        blocks, sched = getattr(e, "blocks", None), getattr(e, "scheduler", None)
        for name, doc, n in (
                ("tandem_prefix_cache_queried_tokens", "Prompt tokens of admitted requests "
                 "looked up in the prefix cache (a preempted request's again).",
                 getattr(blocks, "prefix_queried_tokens", 0)),
                ("tandem_prefix_cache_hit_tokens", "Of those, tokens found in the cache.",
                 getattr(blocks, "prefix_hit_tokens", 0)),
                ("tandem_preemptions", "Running requests preempted for KV room (they "
                 "recompute later).", getattr(sched, "num_preemptions", 0))):
            family = CounterMetricFamily(name, doc, labels=self.label_names)
            family.add_metric(self.bound, n)
            yield family
        watch = getattr(getattr(getattr(e, "spec", None), "policy", None), "watch", None)
        family = CounterMetricFamily(
            "tandem_spec_collapses", "Times speculation turned itself off because drafts "
            "stopped being accepted (mean tokens per verify below speculation.collapse_below).",
            labels=self.label_names)
        family.add_metric(self.bound, getattr(watch, "collapses", 0))
        yield family
        family = GaugeMetricFamily(
            "tandem_spec_collapsed", "1 while speculation is off for an acceptance collapse "
            "(only probes draft), else 0.", labels=self.label_names)
        family.add_metric(self.bound, int(getattr(watch, "collapsed", False)))
        yield family
        if e is not None:
            yield from self._start_up(e)

    def _start_up(self, e):
        """What start-up left undone: kernels compiled after ready (each stalled its batch),
        and how long start-up took."""
        family = CounterMetricFamily(
            "tandem_jit_compiles_after_ready", "Triton kernels compiled after this process "
            "reported ready; each stalled every stream of its batch and is logged.",
            labels=self.label_names)
        family.add_metric(self.bound, jit_watch.after_ready())
        yield family
        n, seconds = collector.pauses()
        for name, doc, v in (
                ("tandem_gc_pauses", "Garbage collections of this process since it began "
                 "timing them (at the latest when its engine was watched); each paused every "
                 "stream.", n),
                ("tandem_gc_pause_seconds", "Seconds those collections paused the process.",
                 seconds)):
            family = CounterMetricFamily(name, doc, labels=self.label_names)
            family.add_metric(self.bound, v)
            yield family
        ready = getattr(e, "ready", None)
        if ready is not None:
            family = GaugeMetricFamily(
                "tandem_ready_seconds", "Seconds from the start of the engine's build to ready "
                "to serve: model load, graph capture and warm-up.", labels=self.label_names)
            family.add_metric(self.bound, ready.total)
            yield family

    def describe(self):
        return self.collect()  # the names, for the registry's duplicate check


class RequestTimer:
    """Times one request from arrival (`start`, default now): TTFT on the first streamed chunk,
    ITL after it; prefill from the timer's creation (admission) to the first token, decode from
    there to the finish. A later chunk of n tokens records gap / n, n times; extra tokens of the
    first chunk count as output but record no gap."""

    def __init__(self, metrics: Metrics, prompt_tokens: int = 0,
                 clock: Callable[[], float] = time.perf_counter,
                 start: float | None = None) -> None:
        self.metrics = metrics
        self.prompt_tokens = prompt_tokens  # may be set later, once the prompt is tokenized
        self.clock = clock
        self.admitted = clock()
        self.start = self.admitted if start is None else start
        self.ttft: float | None = None
        self.first: float | None = None
        self.itls: list[float] = []
        self.output_tokens = 0
        self.finished = False
        self._last: float | None = None

    def token(self, n: int = 1) -> None:
        """A streamed chunk carrying `n` tokens arrived now (n = 0 is ignored)."""
        if n < 0:
            raise ValueError(f"token count must be >= 0, got {n}")
        if n == 0:
            return
        now = self.clock()
        if self._last is None:
            self.first, self.ttft = now, now - self.start
        else:
            self.itls.extend([(now - self._last) / n] * n)
        self._last = now
        self.output_tokens += n

    def finish(self, status: str = "stop") -> None:
        """Record the request with its finish status; later calls do nothing."""
        if self.finished:
            return
        self.finished = True
        now, first = self.clock(), self.first
        self.metrics.observe_request(
            self.ttft, self.itls, now - self.start, self.prompt_tokens, self.output_tokens,
            status, prefill=None if first is None else first - self.admitted,
            decode=None if first is None else now - first)


def _own_registry() -> CollectorRegistry:
    """A fresh registry with the process collectors (they read /proc at scrape time)."""
    registry = CollectorRegistry()
    for c in PROCESS_COLLECTORS:
        registry.register(c)
    return registry


def _new(total: int, seen: int) -> int:
    """What a cumulative count added since it read `seen`; a total that went down means the
    source restarted, so all of it is new."""
    return total - seen if total >= seen else total


def _delta(totals: Sequence[int], seen: Sequence[int]) -> list[int]:
    """`_new` for each of a list of counts (`seen` may be shorter: counts it lacks start at
    0)."""
    old = list(seen) + [0] * max(0, len(totals) - len(seen))
    return [_new(t, o) for t, o in zip(totals, old)]

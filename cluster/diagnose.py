"""`tandem diagnose`: read a deployment's metrics endpoints and say, in words, what is wrong.

Every endpoint is scraped twice, `--window` seconds apart, and the checks judge what happened
in between (`--once`: one scrape, totals since each component started). Exit status 0: healthy;
1: a problem found (a finding of severity warning or critical); 2: an endpoint could not be read.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass

from cluster.scrape import Scrape, ScrapeError, collect, config_endpoints, quantile, url_of

SEVERITIES = ("ok", "info", "warning", "critical")  # warning and critical are problems
# Break-even of speculation: a verify forward costs somewhat more than a plain decode step, so
# it must emit clearly more than one token. Conservative bounds: below either, drafting loses.
MIN_ACCEPTANCE_LENGTH = 1.3  # tokens per verify: the accepted drafts + the target's own
MIN_FIRST_ACCEPT = 0.3  # share of first-position drafts accepted
MIN_DRAFTS = 20  # fewer first-position drafts in the window are too few to judge
KV_FULL = 0.95  # KV cache share in use from which new requests wait for room
QUEUE_DEEP = 10  # requests waiting from which a growing queue is a problem
ERRORS_CRITICAL = 0.05  # share of finished requests failing
TRANSFERS_CRITICAL = 0.01  # share of KV transfers failing
TRAFFIC = ("tandem_requests_total", "tandem_generated_tokens_total", "tandem_engine_steps_total")
# Status codes a client causes: reported, but not a problem of the deployment.
CLIENT_CODES = ("CANCELLED", "INVALID_ARGUMENT", "UNAUTHENTICATED", "PERMISSION_DENIED",
                "NOT_FOUND", "ALREADY_EXISTS", "OUT_OF_RANGE")
ERROR_ACTIONS = {
    "UNAVAILABLE": "workers were lost or the router was draining: read the router's log and "
                   "the actors' (`ray logs`)",
    "RESOURCE_EXHAUSTED": "the admission queue or KV room ran out: add decode replicas or "
                          "raise router.max_queued_requests / router.max_queue_wait_s",
    "DEADLINE_EXCEEDED": "requests ran past router.request_timeout_s: see the latency and "
                         "queue findings",
}


@dataclass(frozen=True)
class Finding:
    """One thing to say: how bad, which check, where, what was seen and what to do."""

    severity: str
    check: str
    where: str
    message: str
    action: str = ""

    @property
    def problem(self) -> bool:
        return self.severity in ("warning", "critical")


def _ms(seconds: float, buckets: dict[str, float]) -> str:
    if math.isinf(seconds):
        top = max(float(le) for le in buckets if not math.isinf(float(le)))
        return f"over {top * 1000:g} ms"
    return f"{seconds * 1000:.0f} ms"


def _share(n: float, of: float, what: str) -> str:
    return f"{n / of:.1%} of {of:g} {what}" if of else f"no {what}"


# ---- checks: each takes the scrape and the options, returns its findings -------------------

def check_traffic(s: Scrape, opts) -> list[Finding]:
    """Whether anything was served in the window: nothing is info, not a problem."""
    if any(s.total(name) for name in TRAFFIC):
        req, tokens = s.total("tandem_requests_total"), s.total("tandem_generated_tokens_total")
        return [Finding("ok", "traffic", "router", f"{req:g} requests finished"
                        f"{s.rate(req)}, {tokens:g} tokens generated {s.span}")]
    return [Finding("info", "traffic", "all", f"nothing was served {s.span}: the latency, "
                    "error and speculation checks have nothing to judge",
                    "send traffic while diagnose runs, or give a longer --window")]


def check_errors(s: Scrape, opts) -> list[Finding]:
    """Failed requests by gRPC code, as a rate and a share of finished requests."""
    finished, out = s.total("tandem_requests_total"), []
    for code, n in sorted(s.merged("tandem_request_errors_total", "code").items()):
        if n <= 0:
            continue
        client = code in CLIENT_CODES
        severe = not finished or n / finished >= ERRORS_CRITICAL
        out.append(Finding(
            "info" if client else "critical" if severe else "warning", "errors", "router",
            f"{n:g} requests failed with {code}{s.rate(n)} "
            f"({_share(n, finished, 'finished requests')}) {s.span}",
            "clients sent these: check the callers" if client else
            ERROR_ACTIONS.get(code, "the router's log says why each failed")))
    if not out and finished:
        out.append(Finding("ok", "errors", "router", f"no request failed {s.span}"))
    return out


def check_latency(s: Scrape, opts) -> list[Finding]:
    """P99 ITL and TTFT from the router's histograms against the SLO flags."""
    out = []
    for metric, what, slo_ms, action in (
            ("tandem_itl_seconds", "inter-token latency", opts.itl_slo_ms,
             "decode is overloaded or drafting loses: see KV use, the acceptance finding and "
             "running requests per decode actor; add decode replicas"),
            ("tandem_ttft_seconds", "time to first token", opts.ttft_slo_ms,
             "requests wait for admission, prefill or KV room: see the queue findings; add "
             "prefill replicas or lower the load")):
        buckets = s.merged(f"{metric}_bucket", "le")
        count = buckets.get("+Inf", 0.0)
        if not count:
            continue
        p99 = quantile(0.99, buckets)
        said = (f"P99 {what} {_ms(p99, buckets)} {s.span} (SLO {slo_ms:g} ms, "
                f"{count:g} observations)")
        out.append(Finding("warning", "latency", "router", said, action) if p99 * 1000 > slo_ms
                   else Finding("ok", "latency", "router", said))
    return out


def check_queue(s: Scrape, opts) -> list[Finding]:
    """A queue that is deep and growing, and a P99 queue wait over half the TTFT SLO."""
    out = []
    for ep in s.endpoints:
        depth, before = ep.gauge("tandem_queue_depth"), ep.gauge("tandem_queue_depth", True)
        if depth is not None and depth >= QUEUE_DEEP and (before is None or depth > before):
            grew = "" if before is None else f", up from {before:g} {s.span}"
            out.append(Finding("warning", "queue", ep.name, f"{depth:g} requests wait{grew}",
                               "arrivals outpace what the cluster serves: add replicas or "
                               "lower the load"))
        buckets = ep.deltas("tandem_queue_seconds_bucket", "le")
        p99 = quantile(0.99, buckets) if buckets.get("+Inf") else 0.0
        if p99 * 1000 > opts.ttft_slo_ms / 2:
            out.append(Finding(
                "warning", "queue", ep.name, f"P99 wait for admission or KV room "
                f"{_ms(p99, buckets)} {s.span}, over half the TTFT SLO",
                "add decode replicas (KV room) or raise router.max_concurrent_requests"))
    return out


def check_kv_cache(s: Scrape, opts) -> list[Finding]:
    """KV blocks in use against the capacity of each engine."""
    out, uses = [], []
    for ep in s.endpoints:
        cap, used = ep.gauge("tandem_kv_blocks_capacity"), ep.gauge("tandem_kv_blocks_used")
        if not cap or used is None:
            continue
        uses.append(f"{ep.name} {used / cap:.0%}")
        if used / cap >= KV_FULL:
            out.append(Finding("warning", "kv-cache", ep.name, f"KV cache {used / cap:.0%} full "
                               f"({used:g} of {cap:g} blocks)", "new requests wait for KV room: "
                               "add replicas, give the role more kv_cache_bytes or "
                               "gpu_memory_utilization, or lower max_num_seqs"))
    if uses and not out:
        out.append(Finding("ok", "kv-cache", "engines", "KV cache use: " + ", ".join(uses)))
    return out


def check_acceptance(s: Scrape, opts) -> list[Finding]:
    """Speculation below break-even on an engine that drafted enough to judge."""
    out = []
    for ep in s.endpoints:
        drafted = ep.deltas("tandem_spec_drafted_tokens_total", "position")
        accepted = ep.deltas("tandem_spec_accepted_tokens_total", "position")
        first = drafted.get("0", 0.0)
        if first < MIN_DRAFTS:
            if first:
                out.append(Finding("info", "speculation", ep.name, f"only {first:g} verifies "
                                   f"drafted {s.span}: too few to judge acceptance"))
            continue
        # Every verify of a sequence that drafted checks position 0, so drafts at position 0
        # count the verifies.
        length = 1 + sum(accepted.values()) / first
        rate0 = accepted.get("0", 0.0) / first
        by_pos = ", ".join(f"{accepted.get(p, 0.0) / drafted[p]:.0%}"
                           for p in sorted(drafted, key=int) if drafted[p])
        said = (f"acceptance length {length:.2f} tokens per verify, first draft accepted "
                f"{rate0:.0%} (by position: {by_pos}) {s.span}")
        if length < MIN_ACCEPTANCE_LENGTH or rate0 < MIN_FIRST_ACCEPT:
            out.append(Finding("warning", "speculation", ep.name, said + ": below break-even "
                               f"(length {MIN_ACCEPTANCE_LENGTH} or first-position "
                               f"{MIN_FIRST_ACCEPT:.0%}), drafting costs more than it saves",
                               "check the draft head matches the model and this traffic; "
                               "lower speculation.num_tokens or set speculation.method=none"))
        else:
            out.append(Finding("ok", "speculation", ep.name, said))
    return out


def check_collapse(s: Scrape, opts) -> list[Finding]:
    """The acceptance-collapse detector: speculation off, or collapses that passed."""
    eps = [ep for ep in s.endpoints if ep.has("tandem_spec_collapsed")
           or ep.has("tandem_spec_collapses_total")]
    if not eps:
        return [_not_exported("collapse", "acceptance-collapse detector")]
    out = []
    for ep in eps:
        n = ep.delta("tandem_spec_collapses_total")
        if (ep.gauge("tandem_spec_collapsed") or 0) >= 1:
            out.append(Finding("warning", "collapse", ep.name, "speculation is off: acceptance "
                               f"collapsed below break-even (collapses {s.span}: {n:g})",
                               "the traffic no longer suits the draft head: its log says when; "
                               "check the head matches the model"))
        elif n:
            out.append(Finding("info", "collapse", ep.name, f"acceptance collapsed {n:g} times "
                               f"{s.span}; speculation is on now"))
    return out or [Finding("ok", "collapse", "engines", f"no acceptance collapse {s.span}")]


def check_shadow(s: Scrape, opts) -> list[Finding]:
    """The drift shadow check: speculative output that differed from plain decoding."""
    if not any(ep.has("tandem_shadow_checks_total") for ep in s.endpoints):
        return [_not_exported("drift", "drift shadow check")]
    bad = s.total("tandem_shadow_checks_total", outcome="mismatch")
    runs = bad + s.total("tandem_shadow_checks_total", outcome="match")
    if bad:
        return [Finding("warning", "drift", "engines", f"{bad:g} of {runs:g} shadow checks "
                        f"differed from the output without speculation {s.span}",
                        "speculative output drifted from the target's: the logs name the "
                        "requests; try speculation.method=none and report it")]
    if runs:
        return [Finding("ok", "drift", "engines", f"{runs:g} shadow checks, all matched "
                        f"{s.span}")]
    return [Finding("info", "drift", "engines", f"no drift shadow check ran {s.span}")]


def check_transfers(s: Scrape, opts) -> list[Finding]:
    """KV transfers that failed and transfer messages dropped."""
    out = []
    for ep in s.endpoints:
        failed = ep.delta("tandem_kv_transfer_failures_total")
        dropped = ep.delta("tandem_kv_dropped_messages_total")
        tries = failed + ep.delta("tandem_kv_transfers_total")
        if failed:
            out.append(Finding(
                "critical" if failed / tries >= TRANSFERS_CRITICAL else "warning", "transfer",
                ep.name, f"{failed:g} KV transfers failed{s.rate(failed)} "
                f"({_share(failed, tries, 'transfers')}) {s.span}", "check the network between "
                "prefill and decode actors (transfer.net_devices) and their logs"))
        if dropped:
            out.append(Finding("warning", "transfer", ep.name, f"{dropped:g} malformed, "
                               f"oversized or truncated transfer messages dropped {s.span}",
                               "something else talks to the transfer port, or a node runs "
                               "another tandem version: check the actors' logs"))
    return out


def check_moves(s: Scrape, opts) -> list[Finding]:
    """Streams moved off dead workers, and broken client streams continued."""
    out = []
    moved = s.total("tandem_stream_resumes_total")
    if moved:
        out.append(Finding("warning", "workers", "router", f"{moved:g} streams moved off dead "
                           f"workers {s.span}", "an actor died or restarted: check `ray logs` "
                           "and the actors' restart counts"))
    continued = s.total("tandem_stream_continuations_total")
    if continued:
        out.append(Finding("info", "workers", "router", f"{continued:g} calls continued a "
                           f"client's broken stream {s.span} (a router died or a connection "
                           "dropped)"))
    return out


def _not_exported(check: str, what: str) -> Finding:
    return Finding("info", check, "all", f"{what}: not exported by this version")


CHECKS = (check_traffic, check_errors, check_latency, check_queue, check_kv_cache,
          check_acceptance, check_collapse, check_shadow, check_transfers, check_moves)


def diagnose(s: Scrape, opts) -> list[Finding]:
    """Every check's findings, the worst first."""
    found = [f for check in CHECKS for f in check(s, opts)]
    return sorted(found, key=lambda f: -SEVERITIES.index(f.severity))


# ---- command line ----------------------------------------------------------------------------

def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of `tandem diagnose`."""
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--address", action="append", metavar="HOST:PORT",
                       help="a metrics endpoint (router or node; /metrics implied, a full URL "
                            "also works); repeatable")
    where.add_argument("--config", metavar="YAML",
                       help="topology YAML: read every endpoint it places (metrics.port_base)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a --config value, as for tandem serve (repeatable)")
    p.add_argument("--window", type=float, default=10.0, metavar="SECONDS",
                   help="seconds between the two scrapes the rates come from (default 10)")
    p.add_argument("--once", action="store_true",
                   help="one scrape: judge the totals since each component started")
    p.add_argument("--itl-slo-ms", type=float, default=100.0, metavar="MS",
                   help="P99 inter-token latency SLO (default 100)")
    p.add_argument("--ttft-slo-ms", type=float, default=2000.0, metavar="MS",
                   help="P99 time-to-first-token SLO (default 2000)")
    p.add_argument("--json", action="store_true", help="print the findings as JSON")


def targets_of(args) -> list[tuple[str | None, str]]:
    """(component name or None, URL) of every endpoint the flags name."""
    if args.address:
        if args.set:
            raise ScrapeError("--set overrides --config's values; with --address there are none")
        try:
            return [(None, url_of(a)) for a in args.address]
        except ValueError as e:  # urlsplit's: an unclosed [IPv6 bracket, ...
            raise ScrapeError(f"--address: {e}") from None
    from cluster.config import ConfigError, apply_overrides, load_config

    try:
        return list(config_endpoints(apply_overrides(load_config(args.config), args.set)))
    except (ConfigError, OSError) as e:  # OSError: the YAML file could not be read
        raise ScrapeError(str(e)) from None


def render(s: Scrape, findings: list[Finding]) -> str:
    """The findings for a terminal: one line each, what to do under each problem."""
    names = ", ".join(ep.name for ep in s.endpoints)
    n = len(s.endpoints)
    lines = [f"tandem diagnose: {n} endpoint{'s' * (n != 1)} ({names}), {s.span}"]
    for f in findings:
        lines.append(f"{f.severity.upper():<9}{f.where}: {f.message}")
        lines += [f"{'':<9}→ {f.action}"] if f.action and f.problem else []
    problems = sum(f.problem for f in findings)
    lines.append(f"{problems} problem{'s' * (problems != 1)} found" if problems else "healthy")
    return "\n".join(lines)


def run(args) -> int:
    """`tandem diagnose`: 0 healthy, 1 a problem found, 2 the endpoints could not be read."""
    for flag, value in (("--window", None if args.once else args.window),
                        ("--itl-slo-ms", args.itl_slo_ms), ("--ttft-slo-ms", args.ttft_slo_ms)):
        if value is not None and not (math.isfinite(value) and value > 0):  # (nan, inf too)
            print(f"error: {flag} must be a number > 0, got {value:g}", file=sys.stderr)
            return 2
    try:
        s = collect(targets_of(args), None if args.once else args.window)
    except ScrapeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    findings = diagnose(s, args)
    if args.json:
        print(json.dumps({"healthy": not any(f.problem for f in findings),
                          "window_s": s.seconds,
                          "endpoints": [{"name": ep.name, "url": ep.url, "role": ep.role}
                                        for ep in s.endpoints],
                          "findings": [asdict(f) for f in findings]}, indent=2))
    else:
        print(render(s, findings))
    return 1 if any(f.problem for f in findings) else 0

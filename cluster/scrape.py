"""Reading tandem's Prometheus endpoints: one scrape or two a window apart, and what the
counters, gauges and histograms did in between."""

from __future__ import annotations

import http.client
import math
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from urllib.parse import urlsplit

from prometheus_client.parser import text_string_to_metric_families

# A wildcard bind is reached through the loopback address here.
LOCAL = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]
# Straight to the endpoint, as Prometheus scrapes: no proxy taken from the environment.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class ScrapeError(Exception):
    """An endpoint that could not be read, or no endpoint to read."""


@dataclass
class Endpoint:
    """One /metrics endpoint: its scrape at the end of the window and, unless --once, the one
    at its start."""

    url: str
    name: str
    after: Samples
    before: Samples | None = None
    families: frozenset[str] = frozenset()  # metric names it exports, with samples or not

    @property
    def role(self) -> str:
        return next((dict(ls)["role"] for _, ls in self.after if "role" in dict(ls)), "?")

    def has(self, name: str) -> bool:
        """Whether it exports metric `name` (a labelled one before its first sample too)."""
        return name in self.families or name.removesuffix("_total") in self.families

    def gauge(self, name: str, before: bool = False) -> float | None:
        samples = self.before if before else self.after
        return None if samples is None or not self.has(name) else _sum(samples, name, {})

    def delta(self, name: str, **labels: str) -> float:
        """A counter's (or histogram sample's) increase over the window; a counter that went
        down means its component restarted, so all of it is new."""
        now = _sum(self.after, name, labels)
        then = 0.0 if self.before is None else _sum(self.before, name, labels)
        return now - then if now >= then else now

    def deltas(self, name: str, label: str) -> dict[str, float]:
        values = {dict(ls)[label] for n, ls in self.after if n == name and label in dict(ls)}
        return {v: self.delta(name, **{label: v}) for v in values}


@dataclass
class Scrape:
    """Every endpoint, and the seconds between the two scrapes (None: one scrape, totals)."""

    endpoints: list[Endpoint]
    seconds: float | None

    @property
    def span(self) -> str:
        return "since start" if self.seconds is None else f"in the last {self.seconds:.1f} s"

    def rate(self, n: float) -> str:
        """", 1.5/s" over the window; nothing for one scrape (its totals have no time base)."""
        return "" if self.seconds is None else f", {n / self.seconds:.3g}/s"

    def total(self, name: str, **labels: str) -> float:
        return sum(ep.delta(name, **labels) for ep in self.endpoints)

    def merged(self, name: str, label: str) -> dict[str, float]:
        out: dict[str, float] = {}
        for ep in self.endpoints:
            for value, n in ep.deltas(name, label).items():
                out[value] = out.get(value, 0.0) + n
        return out


def _sum(samples: Samples, name: str, labels: dict[str, str]) -> float:
    return sum(v for (n, ls), v in samples.items()
               if n == name and all(dict(ls).get(k) == want for k, want in labels.items()))


def quantile(q: float, buckets: dict[str, float]) -> float:
    """Prometheus' `histogram_quantile` over cumulative bucket counts keyed by `le`, linear
    within a bucket; math.inf when the rank lies past the highest finite bound."""
    edges = sorted((float(le), n) for le, n in buckets.items())
    rank = q * edges[-1][1]
    low, below = 0.0, 0.0
    for edge, n in edges:
        if n >= rank and n > below:
            return edge if math.isinf(edge) else low + (edge - low) * (rank - below) / (n - below)
        low, below = edge, n
    return math.inf


def url_of(address: str) -> str:
    """A metrics URL from HOST:PORT (the /metrics path implied) or a full URL."""
    if "://" not in address:
        return f"http://{address}/metrics"
    parts = urlsplit(address)
    return address if parts.path not in ("", "/") else parts._replace(path="/metrics").geturl()


def config_endpoints(cfg) -> list[tuple[str, str]]:
    """(component, URL) of every metrics endpoint a config places, where `tandem serve`
    binds them: the router on metrics.port_base, actor k on port_base + k."""
    if not cfg.metrics.enabled:
        raise ScrapeError("metrics.enabled is false in this config: no endpoint to read")
    if not cfg.metrics.port_base:
        raise ScrapeError("metrics.port_base is 0 in this config, so each component took a "
                          "free port: give them with --address (tandem serve prints them)")
    host = LOCAL.get(cfg.metrics.host, cfg.metrics.host)
    host = f"[{host}]" if ":" in host else host
    ports = cfg.metrics_ports()
    names = ["router"] if cfg.mode == "colocated" else list(ports)  # colocated: no actors
    return [(name, url_of(f"{host}:{ports[name]}")) for name in names]


def fetch(url: str, timeout: float = 5.0) -> tuple[Samples, frozenset[str]]:
    """One scrape: {(sample name, sorted labels): value} and the metric names it exports."""
    try:
        with _OPENER.open(url, timeout=timeout) as r:
            text = r.read().decode()
        fams = list(text_string_to_metric_families(text))
        samples = {(x.name, tuple(sorted(x.labels.items()))): x.value
                   for fam in fams for x in fam.samples}
    except http.client.HTTPException as e:  # a port that speaks no HTTP (the gRPC one?)
        raise ScrapeError(f"cannot read {url}: no HTTP reply there ({type(e).__name__}; "
                          "the gRPC port, not the metrics one?)") from None
    except (OSError, ValueError) as e:  # URLError and timeouts are OSErrors
        raise ScrapeError(f"cannot read {url}: {getattr(e, 'reason', None) or e}") from None
    if not any(name.startswith("tandem_") for name, _ in samples):
        raise ScrapeError(f"{url} serves no tandem_ metrics: is it a tandem endpoint?")
    return samples, frozenset(fam.name for fam in fams)


def scrape(urls: list[str]) -> list[tuple[Samples, frozenset[str]]]:
    """Every endpoint at once; ScrapeError naming each that failed."""

    def one(url: str) -> tuple[Samples, frozenset[str]] | ScrapeError:
        try:
            return fetch(url)
        except ScrapeError as e:
            return e

    with ThreadPoolExecutor(max_workers=min(16, len(urls))) as pool:
        got = list(pool.map(one, urls))
    failed = [str(g) for g in got if isinstance(g, ScrapeError)]
    if failed:
        raise ScrapeError("; ".join(failed))
    return got  # type: ignore[return-value]


def _wait(seconds: float) -> None:
    """Sleep until the second scrape, with a countdown on stderr when it is a terminal."""
    end, tty = time.monotonic() + seconds, sys.stderr.isatty()
    while (left := end - time.monotonic()) > 0:
        if tty:
            print(f"\rscraping again in {left:4.1f} s…", end="", file=sys.stderr, flush=True)
        time.sleep(min(left, 0.5))
    if tty:
        print("\r" + " " * 30 + "\r", end="", file=sys.stderr, flush=True)


def collect(targets: list[tuple[str | None, str]], window: float | None) -> Scrape:
    """Scrape every (name, URL) once, or twice `window` seconds apart."""
    urls = [url for _, url in targets]
    t0, first = time.monotonic(), scrape(urls)
    if window is None:
        ends, seconds = [(None, f) for f in first], None
    else:
        _wait(window)
        ends, seconds = list(zip(first, scrape(urls))), time.monotonic() - t0
    eps = [Endpoint(url, name or "", after, before and before[0], fams)
           for (name, url), (before, (after, fams)) in zip(targets, ends)]
    for ep in eps:
        ep.name = ep.name or f"{ep.role}@{urlsplit(ep.url).netloc}"
    return Scrape(eps, seconds)

"""`tandem diagnose` against real metrics endpoints: a healthy deployment exits 0, each problem
is named in words with exit 1, an endpoint it cannot read exits 2 with one line."""

from __future__ import annotations

import json
import random
import socket
import threading

import pytest
from prometheus_client import CollectorRegistry, Counter, start_http_server

from cluster import scrape
from cluster.cli import main
from cluster.config import load_config
from engine.metrics import Metrics


class Deployment:
    """A router's, a prefill actor's and a decode actor's registries, each served over HTTP as a
    running cluster serves them."""

    def __init__(self, base: int = 0) -> None:
        self.router, self.prefill, self.decode = (Metrics(r) for r in ROLES)
        self.servers, self.ports = [], []
        try:
            for k, m in enumerate((self.router, self.prefill, self.decode)):
                server, port = m.serve("127.0.0.1", base + k if base else 0)
                self.servers.append(server)
                self.ports.append(port)
        except OSError:  # a port of base + k taken
            self.close()
            raise

    @property
    def argv(self) -> list[str]:
        return [x for p in self.ports for x in ("--address", f"127.0.0.1:{p}")]

    def close(self) -> None:
        """Stop every server at once: each takes up to its poll interval to notice."""
        stops = [threading.Thread(target=s.shutdown) for s in self.servers]
        for t in stops:
            t.start()
        for t, s in zip(stops, self.servers):
            t.join()
            s.server_close()

    def serve_well(self, n: int = 50) -> None:
        """n requests with good latencies, drafts mostly accepted, KV transfers that land."""
        for _ in range(n):
            self.router.observe_request(0.2, [0.02] * 10, 0.5, 20, 11, "stop")
            self.prefill.observe_transfer(4096, 0.002, ok=True, path="direct")
        self.decode.observe_spec([100, 90, 80], [80, 60, 40])
        self.decode.set_engine_gauges(0, 4, 30, 100)
        self.prefill.set_engine_gauges(0, 1, 5, 100)


ROLES = ("router", "prefill", "decode")


@pytest.fixture
def dep():
    d = Deployment()
    yield d
    d.close()


@pytest.fixture
def during(monkeypatch):
    """What the deployment does between the two scrapes, run instead of waiting the window."""
    actions: list = []
    monkeypatch.setattr(scrape, "_wait", lambda seconds: [a() for a in actions])
    return actions


def run(capsys, argv: list[str]) -> tuple[int, dict]:
    code = main(["diagnose", *argv, "--window", "0.5", "--json"])
    return code, json.loads(capsys.readouterr().out)


def problems(report: dict) -> list[dict]:
    return [f for f in report["findings"] if f["severity"] in ("warning", "critical")]


def test_a_healthy_deployment_exits_0_and_says_what_it_checked(dep, during, capsys):
    during.append(dep.serve_well)
    code, report = run(capsys, dep.argv)
    assert code == 0 and report["healthy"] and not problems(report)
    ok = {f["check"] for f in report["findings"] if f["severity"] == "ok"}
    assert {"traffic", "errors", "latency", "kv-cache", "speculation"} <= ok
    assert [e["role"] for e in report["endpoints"]] == list(ROLES)
    said = {f["check"]: f for f in report["findings"]}
    assert said["collapse"]["severity"] == "ok"  # exported, nothing collapsed
    assert said["drift"]["severity"] in ("ok", "info")  # exported; off by default
    assert "50 requests finished" in said["traffic"]["message"]


def test_metrics_an_older_version_lacks_are_info_not_errors(capsys):
    registry = CollectorRegistry()
    Counter("tandem_requests_total", "finished", ["role"], registry=registry).labels(
        "router").inc()
    server, _ = start_http_server(0, addr="127.0.0.1", registry=registry)
    try:
        code, report = run(capsys, ["--address", f"127.0.0.1:{server.server_address[1]}",
                                    "--once"])
    finally:
        server.shutdown()
        server.server_close()
    assert code == 0
    said = {f["check"]: f["message"] for f in report["findings"]}
    assert said["collapse"] == "acceptance-collapse detector: not exported by this version"
    assert said["drift"] == "drift shadow check: not exported by this version"


def _errors(d: Deployment) -> None:
    d.router.errors.labels("router", "UNAVAILABLE").inc(10)


def _low_acceptance(d: Deployment) -> None:
    d.decode.observe_spec([400, 400, 400], [40, 8, 0])


def _slow_tokens(d: Deployment) -> None:
    for _ in range(20):
        d.router.observe_request(0.2, [0.3] * 20, 6.2, 20, 21, "stop")


def _slow_first_token(d: Deployment) -> None:
    for _ in range(20):
        d.router.observe_request(4.0, [0.02] * 5, 4.1, 20, 6, "stop")


def _kv_full(d: Deployment) -> None:
    d.decode.set_engine_gauges(0, 60, 97, 100)


def _queue_wait(d: Deployment) -> None:
    for _ in range(10):
        d.router.queue_seconds.observe(5.0)


def _transfer_failures(d: Deployment) -> None:
    for _ in range(3):
        d.prefill.observe_transfer(0, 0.0, ok=False)


def _dropped(d: Deployment) -> None:
    d.prefill.kv_dropped.inc(2)


def _moved(d: Deployment) -> None:
    d.router.resumes.inc(3)


def _metric(m: Metrics, kind: type, name: str, labels: tuple[str, ...] = ()):
    """Metric `name` of m's registry where this version exports it, else registered there now
    as a version that exports it would."""
    found = m.registry._names_to_collectors.get(name)
    return found if found is not None else kind(name, name, ("role", *labels),
                                                registry=m.registry)


def _collapsed(d: Deployment) -> None:
    """The decode engine's collapse watch went off once and is off now."""
    from types import SimpleNamespace

    from engine.spec.collapse import CollapseWatch

    watch = CollapseWatch(1.5, 3)
    watch.collapsed, watch.collapses = True, 1
    d.decode._engine_counters.engine = SimpleNamespace(
        spec=SimpleNamespace(policy=SimpleNamespace(watch=watch)))


def _drifted(d: Deployment) -> None:
    c = _metric(d.decode, Counter, "tandem_shadow_checks_total", ("outcome",))
    c.labels("decode", "match").inc(9)
    c.labels("decode", "mismatch").inc(1)


@pytest.mark.parametrize("problem, check, severity, words", [
    (_errors, "errors", "critical", ["10 requests failed with UNAVAILABLE", "20.0% of 50"]),
    (_low_acceptance, "speculation", "warning", ["acceptance length 1.46", "first draft "
                                                  "accepted 24%", "below break-even"]),
    (_slow_tokens, "latency", "warning", ["P99 inter-token latency", "SLO 100 ms"]),
    (_slow_first_token, "latency", "warning", ["P99 time to first token", "SLO 2000 ms"]),
    (_kv_full, "kv-cache", "warning", ["KV cache 97% full (97 of 100 blocks)"]),
    (_queue_wait, "queue", "warning", ["P99 wait for admission or KV room"]),
    (_transfer_failures, "transfer", "critical", ["3 KV transfers failed", "5.7% of 53"]),
    (_dropped, "transfer", "warning", ["2 malformed, oversized or truncated"]),
    (_moved, "workers", "warning", ["3 streams moved off dead workers"]),
    (_collapsed, "collapse", "warning", ["speculation is off", "collapses in the last"]),
    (_drifted, "drift", "warning", ["1 of 10 shadow checks differed"]),
], ids=lambda v: v.__name__.strip("_") if callable(v) else None)
def test_each_problem_is_found_in_words_and_exits_1(dep, during, capsys, problem, check,
                                                    severity, words):
    during.extend([dep.serve_well, lambda: problem(dep)])
    code, report = run(capsys, dep.argv)
    assert code == 1 and not report["healthy"]
    found = [f for f in problems(report) if f["check"] == check]
    assert len(found) == 1, problems(report)
    assert found[0]["severity"] == severity and found[0]["action"]
    for w in words:
        assert w in found[0]["message"]
    assert len(problems(report)) == 1, "a healthy rest of the deployment was judged a problem"


def test_a_growing_queue_is_a_problem_a_steady_one_is_not(dep, during, capsys):
    dep.router.queue_depth.set(12)
    during.extend([dep.serve_well, lambda: dep.router.queue_depth.set(40)])
    code, report = run(capsys, dep.argv)
    assert code == 1
    assert "40 requests wait, up from 12" in problems(report)[0]["message"]
    during[1] = lambda: dep.router.queue_depth.set(12)
    assert run(capsys, dep.argv)[0] == 0


def test_errors_clients_cause_are_reported_not_judged(dep, during, capsys):
    during.extend([dep.serve_well,
                   lambda: dep.router.errors.labels("router", "INVALID_ARGUMENT").inc(5)])
    code, report = run(capsys, dep.argv)
    assert code == 0
    assert any(f["severity"] == "info" and "INVALID_ARGUMENT" in f["message"]
               for f in report["findings"])


def test_no_traffic_in_the_window_is_info_not_a_problem(dep, capsys):
    dep.serve_well()  # before the window: only the totals move, not the window's increments
    code, report = run(capsys, dep.argv)  # a real wait of 0.5 s between the scrapes
    assert code == 0 and report["window_s"] >= 0.5
    assert report["findings"][0]["check"] == "traffic"
    assert report["findings"][0]["message"].startswith("nothing was served in the last")


def test_once_judges_the_totals_without_waiting(dep, monkeypatch, capsys):
    monkeypatch.setattr(scrape, "_wait", lambda s: pytest.fail("--once waited"))
    dep.serve_well()
    _errors(dep)
    code, report = run(capsys, [*dep.argv, "--once"])
    assert code == 1 and report["window_s"] is None
    assert "since start" in problems(report)[0]["message"]


def test_text_output_names_the_problem_and_what_to_do(dep, during, capsys):
    during.extend([dep.serve_well, lambda: _kv_full(dep)])
    assert main(["diagnose", *dep.argv, "--itl-slo-ms", "150"]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("tandem diagnose: 3 endpoints (router@127.0.0.1:")
    assert out[1].startswith(f"WARNING  decode@127.0.0.1:{dep.ports[2]}: KV cache 97% full")
    assert out[2].lstrip().startswith("→ new requests wait for KV room")
    assert "(SLO 150 ms" in "\n".join(out) and out[-1] == "1 problem found"


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_unreachable_endpoint_exits_2_with_one_line(dep, capsys):
    port = _closed_port()
    assert main(["diagnose", *dep.argv, "--address", f"127.0.0.1:{port}", "--once"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.splitlines() == [f"error: cannot read http://127.0.0.1:{port}/metrics: "
                                "[Errno 111] Connection refused"]


def test_a_port_that_speaks_no_http_exits_2_with_one_line(capsys):
    """The gRPC port given by mistake (`tandem status` takes that one): not an HTTP reply."""
    import threading

    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen()
        port = srv.getsockname()[1]

        def garbage():
            conn, _ = srv.accept()
            with conn:
                conn.recv(4096)
                conn.sendall(b"\x00\x00\x06\x04\x00\x00\x00\x00\x00not http\r\n\r\n")

        t = threading.Thread(target=garbage, daemon=True)
        t.start()
        assert main(["diagnose", "--address", f"127.0.0.1:{port}", "--once"]) == 2
        t.join(10)
    err = capsys.readouterr().err
    assert err.startswith(f"error: cannot read http://127.0.0.1:{port}/metrics") and \
        len(err.splitlines()) == 1


def test_an_endpoint_without_tandem_metrics_exits_2(capsys):
    server, _ = start_http_server(0, addr="127.0.0.1", registry=CollectorRegistry())
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/metrics"
        assert main(["diagnose", "--address", url, "--once"]) == 2
        assert "serves no tandem_ metrics" in capsys.readouterr().err
    finally:
        server.shutdown()
        server.server_close()


def test_addresses_and_urls_name_the_metrics_path():
    assert scrape.url_of("10.0.0.5:9100") == "http://10.0.0.5:9100/metrics"
    assert scrape.url_of("http://h:9100") == "http://h:9100/metrics"
    assert scrape.url_of("https://h:9100/") == "https://h:9100/metrics"
    assert scrape.url_of("http://h:9100/custom") == "http://h:9100/custom"


def test_a_config_places_the_endpoints_where_serve_binds_them():
    cfg = load_config(None, {"metrics.port_base": 9100, "metrics.host": "0.0.0.0",
                             "decode.replicas": 2})
    assert scrape.config_endpoints(cfg) == [
        ("router", "http://127.0.0.1:9100/metrics"), ("prefill-0", "http://127.0.0.1:9101/metrics"),
        ("decode-0", "http://127.0.0.1:9102/metrics"), ("decode-1", "http://127.0.0.1:9103/metrics")]
    colocated = load_config(None, {"metrics.port_base": 9100, "mode": "colocated"})
    assert scrape.config_endpoints(colocated) == [("router", "http://127.0.0.1:9100/metrics")]


def test_diagnose_reads_a_running_config(during, capsys, tmp_path):
    for _ in range(20):  # three consecutive free ports
        base = random.randrange(20000, 60000)
        try:
            d = Deployment(base)
            break
        except OSError:
            continue
    topology = tmp_path / "topology.yaml"
    topology.write_text("metrics:\n  host: 127.0.0.1\n")
    try:
        during.append(d.serve_well)
        code, report = run(capsys, ["--config", str(topology), "--set",
                                    f"metrics.port_base={base}"])
        assert code == 0
        assert [e["name"] for e in report["endpoints"]] == ["router", "prefill-0", "decode-0"]
    finally:
        d.close()


@pytest.mark.parametrize("argv, says", [
    (["--config", "deploy/examples/local.yaml", "--set", "metrics.port_base=0"],
     "metrics.port_base is 0"),
    (["--config", "deploy/examples/local.yaml", "--set", "metrics.enabled=false"],
     "metrics.enabled is false"),
    (["--config", "/nonexistent/topology.yaml"], "No such file"),
    (["--address", "127.0.0.1:9", "--window", "0"], "--window must be a number > 0"),
    (["--address", "127.0.0.1:9", "--window", "nan"], "--window must be a number > 0"),
    (["--address", "127.0.0.1:9", "--window", "inf"], "--window must be a number > 0"),
    (["--address", "127.0.0.1:9", "--once", "--itl-slo-ms", "nan"], "--itl-slo-ms must be"),
    (["--address", "127.0.0.1:9", "--once", "--ttft-slo-ms", "-5"], "--ttft-slo-ms must be"),
    (["--address", "http://[::1", "--once"], "--address: Invalid IPv6 URL"),
    (["--address", "127.0.0.1:9", "--once", "--set", "x=1"], "--set overrides --config's"),
])
def test_what_leaves_nothing_to_read_exits_2_in_one_line(capsys, argv, says):
    assert main(["diagnose", *argv]) == 2
    err = capsys.readouterr().err
    assert says in err and len(err.splitlines()) == 1

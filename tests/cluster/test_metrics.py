"""engine.metrics: exposition, exact counter values, the HTTP endpoint, RequestTimer math."""

from __future__ import annotations

import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.metrics import Metrics, RequestTimer


def samples(text: str | bytes) -> dict[tuple[str, frozenset], float]:
    """Parse exposition text into {(sample name, labels): value}."""
    if isinstance(text, bytes):
        text = text.decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def value(m: Metrics, name: str, **labels: str) -> float:
    return samples(m.exposition())[(name, frozenset({"role": m.role, **labels}.items()))]


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_exposition_parses_and_names_every_metric_with_its_role():
    m = Metrics("decode")
    fams = {f.name: f for f in text_string_to_metric_families(m.exposition().decode())}
    for name in ("tandem_ttft_seconds", "tandem_itl_seconds", "tandem_tpot_seconds",
                 "tandem_e2e_seconds", "tandem_kv_transfer_seconds", "tandem_queue_depth",
                 "tandem_running_requests", "tandem_kv_blocks_used", "tandem_kv_blocks_capacity",
                 "tandem_spec_acceptance_length", "tandem_prompt_tokens",
                 "tandem_generated_tokens", "tandem_kv_transfer_bytes",
                 "tandem_kv_transfer_failures"):
        assert name in fams, name
        assert all(s.labels["role"] == "decode" for s in fams[name].samples)
    assert fams["tandem_ttft_seconds"].type == "histogram"
    assert fams["tandem_prompt_tokens"].type == "counter"


def test_components_in_one_process_do_not_collide():
    a, b = Metrics("prefill"), Metrics("decode")
    a.observe_transfer(10, 0.1, ok=True)
    assert value(a, "tandem_kv_transfer_bytes_total") == 10
    assert value(b, "tandem_kv_transfer_bytes_total") == 0


def test_unknown_role_is_refused():
    with pytest.raises(ValueError, match="role"):
        Metrics("worker")


def test_observe_request_moves_counters_and_histograms():
    m = Metrics("router")
    m.observe_request(ttft=0.2, itls=[0.01, 0.03], e2e=1.2, prompt_tokens=7,
                      output_tokens=3, status="stop")
    m.observe_request(ttft=None, itls=[], e2e=0.05, prompt_tokens=4, output_tokens=0,
                      status="error")
    assert value(m, "tandem_requests_total", status="stop") == 1
    assert value(m, "tandem_requests_total", status="error") == 1
    assert value(m, "tandem_prompt_tokens_total") == 11
    assert value(m, "tandem_generated_tokens_total") == 3
    assert value(m, "tandem_ttft_seconds_count") == 1
    assert value(m, "tandem_ttft_seconds_sum") == pytest.approx(0.2)
    assert value(m, "tandem_e2e_seconds_count") == 2
    assert value(m, "tandem_itl_seconds_sum") == pytest.approx(0.04)
    assert value(m, "tandem_itl_seconds_bucket", le="0.01") == 1
    assert value(m, "tandem_tpot_seconds_sum") == pytest.approx(0.5)  # (1.2 - 0.2) / 2


def test_observe_spec_adds_deltas_per_position():
    m = Metrics("decode")
    m.observe_spec([4, 4, 3], [3, 2, 1])
    m.observe_spec([1, 1, 0], [1, 0, 0])
    got = [(value(m, "tandem_spec_drafted_tokens_total", position=str(p)),
            value(m, "tandem_spec_accepted_tokens_total", position=str(p))) for p in range(3)]
    assert got == [(5, 4), (5, 2), (3, 1)]
    with pytest.raises(ValueError):
        m.observe_spec([1], [1, 0])


def test_observe_spec_totals_records_only_what_is_new():
    m = Metrics("colocated")
    m.observe_spec_totals([2, 2], [1, 0])
    m.observe_spec_totals([5, 4], [3, 1])
    assert value(m, "tandem_spec_drafted_tokens_total", position="0") == 5
    assert value(m, "tandem_spec_accepted_tokens_total", position="1") == 1


def test_dynamic_k_counts_record_only_what_is_new():
    """Fused steps by K and by the reason for their K, fed cumulative counts as an engine's
    `KPolicy` keeps them; a count that goes down is a restarted engine's."""
    m = Metrics("decode")
    m.observe_k_totals({0: 4, 7: 10}, {"probe": 4, "model": 10})
    m.observe_k_totals({0: 9, 3: 2, 7: 12}, {"probe": 4, "losing": 5, "model": 14})
    assert value(m, "tandem_spec_steps_by_k_total", k="0") == 9
    assert value(m, "tandem_spec_steps_by_k_total", k="3") == 2
    assert value(m, "tandem_spec_steps_by_k_total", k="7") == 12
    assert value(m, "tandem_spec_k_reasons_total", reason="losing") == 5
    assert value(m, "tandem_spec_k_reasons_total", reason="model") == 14
    m.observe_k_totals({7: 3}, {"model": 3})  # the engine started over
    assert value(m, "tandem_spec_steps_by_k_total", k="7") == 15
    assert value(m, "tandem_spec_k_reasons_total", reason="model") == 17


def test_engine_steps_are_counted_by_path():
    m = Metrics("decode")
    m.observe_step_totals(steps=10, fused=6, overlapped=4)
    m.observe_step_totals(steps=15, fused=10, overlapped=7)
    assert value(m, "tandem_engine_steps_total", path="overlapped") == 7
    assert value(m, "tandem_engine_steps_total", path="fused") == 3
    assert value(m, "tandem_engine_steps_total", path="regular") == 5


def test_observe_transfer_counts_bytes_or_failures():
    m = Metrics("prefill")
    m.observe_transfer(1000, 0.002, ok=True, path="pull")
    m.observe_transfer(500, 0.004, ok=True, path="staged")
    m.observe_transfer(200, 0.001, ok=True, path="pull")
    m.observe_transfer(700, 1.0, ok=False)
    assert value(m, "tandem_kv_transfer_bytes_total") == 1700
    assert value(m, "tandem_kv_transfers_total", path="pull") == 2
    assert value(m, "tandem_kv_transfers_total", path="staged") == 1
    assert value(m, "tandem_kv_transfer_failures_total") == 1
    assert value(m, "tandem_kv_transfer_seconds_count") == 3
    assert value(m, "tandem_kv_transfer_seconds_sum") == pytest.approx(0.007)


def test_set_engine_gauges():
    m = Metrics("decode")
    m.set_engine_gauges(3, 5, 40, 100, acceptance_length=2.5)
    m.set_engine_gauges(1, 6, 42, 100)
    got = [value(m, n) for n in ("tandem_queue_depth", "tandem_running_requests",
                                 "tandem_kv_blocks_used", "tandem_kv_blocks_capacity",
                                 "tandem_spec_acceptance_length")]
    assert got == [1, 6, 42, 100, 2.5]


def test_http_endpoint_serves_parseable_text():
    m = Metrics("router")
    m.observe_request(0.1, [], 0.1, 2, 1, "stop")
    server, port = m.serve("127.0.0.1", 0)
    try:
        assert port > 0
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            text = r.read().decode()
    finally:
        server.shutdown()
        server.server_close()
    key = ("tandem_requests_total", frozenset({"role": "router", "status": "stop"}.items()))
    assert samples(text)[key] == 1


def test_request_timer_ttft_and_per_token_itl():
    m, clock = Metrics("router"), FakeClock()
    t = RequestTimer(m, prompt_tokens=9, clock=clock)
    clock.now += 0.5
    t.token(2)  # first chunk: TTFT only, both tokens count as output
    clock.now += 0.3
    t.token(3)  # 0.1 per token, three times
    clock.now += 0.2
    t.token(0)  # an empty chunk changes nothing
    t.token()
    clock.now += 0.1
    t.finish("length")
    t.finish("error")  # a second finish is ignored
    assert t.ttft == pytest.approx(0.5)
    assert t.itls == pytest.approx([0.1, 0.1, 0.1, 0.2])
    assert t.output_tokens == 6
    assert value(m, "tandem_requests_total", status="length") == 1
    assert ("tandem_requests_total", frozenset({"role": "router", "status": "error"}.items())) \
        not in samples(m.exposition())
    assert value(m, "tandem_e2e_seconds_sum") == pytest.approx(1.1)
    assert value(m, "tandem_tpot_seconds_sum") == pytest.approx(0.6 / 5)
    assert value(m, "tandem_prompt_tokens_total") == 9
    assert value(m, "tandem_itl_seconds_count") == 4


def test_request_timer_without_tokens_records_no_ttft():
    m, clock = Metrics("router"), FakeClock()
    t = RequestTimer(m, clock=clock)
    clock.now += 2.0
    t.finish("cancelled")
    assert t.ttft is None
    assert value(m, "tandem_ttft_seconds_count") == 0
    assert value(m, "tandem_e2e_seconds_sum") == pytest.approx(2.0)
    with pytest.raises(ValueError):
        t.token(-1)


def test_request_timer_splits_queue_prefill_and_decode():
    """Made at admission with the arrival as `start`: TTFT and e2e from arrival, prefill from
    admission to the first token, decode from there to the finish; lengths per request."""
    m, clock = Metrics("router", model_name="m"), FakeClock()
    t = RequestTimer(m, prompt_tokens=30, clock=clock, start=clock.now - 0.4)
    clock.now += 0.25
    t.token(1)
    clock.now += 1.0
    t.token(2)
    t.finish("stop")
    get = lambda name, **kw: m.registry.get_sample_value(
        name, {"role": "router", "model_name": "m", **kw})
    assert get("tandem_ttft_seconds_sum") == pytest.approx(0.65)
    assert get("tandem_e2e_seconds_sum") == pytest.approx(1.65)
    assert get("tandem_prefill_seconds_sum") == pytest.approx(0.25)
    assert get("tandem_decode_seconds_sum") == pytest.approx(1.0)
    assert get("tandem_request_prompt_tokens_bucket", le="50.0") == 1
    assert get("tandem_request_prompt_tokens_bucket", le="20.0") == 0
    assert get("tandem_request_generated_tokens_sum") == 3


def test_a_request_with_no_token_has_no_prefill_or_decode_time():
    m = Metrics("router")
    RequestTimer(m, prompt_tokens=4).finish("cancelled")
    assert value(m, "tandem_prefill_seconds_count") == 0
    assert value(m, "tandem_decode_seconds_count") == 0
    assert value(m, "tandem_request_generated_tokens_bucket", le="1.0") == 1


def test_model_name_labels_every_series_when_given_and_series_binds_it():
    m = Metrics("decode", model_name="llama")
    m.series(m.errors, "INTERNAL").inc()
    m.observe_spec([2], [1])
    for fam in text_string_to_metric_families(m.exposition().decode()):
        if fam.name.startswith("tandem_"):
            assert all(s.labels.get("model_name") == "llama" for s in fam.samples), fam.name
    assert value(Metrics("decode"), "tandem_kv_blocks_used") == 0  # none given: no label


def test_a_node_serves_its_metrics_on_the_host_and_port_configured():
    import socket

    from node_common.node import serve_metrics

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    m, bound = serve_metrics("decode", port, "127.0.0.1")
    assert bound == port
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
    assert b'tandem_kv_blocks_used{role="decode"}' in body
    assert serve_metrics("decode", None)[1] is None  # metrics off: no listener


def test_engine_gauges_are_read_when_scraped():
    class Blocks:
        num_free = 7

    class Sched:
        waiting, running = [1, 2], [3]

    class Eng:
        num_blocks, blocks, scheduler = 10, Blocks(), Sched()

    m, e = Metrics("decode"), Eng()
    m.watch_engine(e)
    get = lambda name: m.registry.get_sample_value(name, {"role": "decode"})
    assert (get("tandem_queue_depth"), get("tandem_running_requests"),
            get("tandem_kv_blocks_used")) == (2, 1, 3)
    e.scheduler.waiting, e.scheduler.running, e.blocks.num_free = [], [], 10  # idle now
    assert (get("tandem_queue_depth"), get("tandem_running_requests"),
            get("tandem_kv_blocks_used")) == (0, 0, 0)

"""The vLLM-parity metrics, moved by real traffic through `GenerationService` over a tiny
engine: requests by outcome and by refusal code (INVALID_ARGUMENT, RESOURCE_EXHAUSTED,
UNAUTHENTICATED at both doors), queue / prefill / decode time and prompt / output length
histograms, prefix-cache lookups and hits, preemptions, the model_name label, process metrics;
the exposition passes promtool."""

from __future__ import annotations

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine import SamplingParams
from engine.metrics import Metrics
from router.auth import BearerAuth
from tandem_proto.v1 import generation_pb2 as pb
from tandem_proto.v1 import generation_pb2_grpc as pb_grpc
from tests.deploy.test_promtool import PROMTOOL, _promtool
from tests.helpers import tiny_engine
from tests.router.test_server import Served

TOKEN = "s3cret"
PROMPT = list(range(20, 33))  # 13 tokens: three full blocks of 4 can come from the cache


def samples(m: Metrics) -> dict[tuple[str, frozenset], float]:
    """{(sample name, labels without role and model_name): value} of `m`'s exposition."""
    out = {}
    for fam in text_string_to_metric_families(m.exposition().decode()):
        for s in fam.samples:
            labels = {k: v for k, v in s.labels.items() if k not in ("role", "model_name")}
            out[(s.name, frozenset(labels.items()))] = s.value
    return out


def get(m: Metrics, name: str, **labels: str) -> float:
    return samples(m).get((name, frozenset(labels.items())), 0.0)


def generate(target: str, request: pb.GenerateRequest, token: str | None = TOKEN):
    """The raw call's responses, or its grpc.RpcError."""
    meta = (("authorization", f"Bearer {token}"),) if token else ()
    with grpc.insecure_channel(target) as ch:
        try:
            return list(pb_grpc.GenerationStub(ch).Generate(request, timeout=60, metadata=meta))
        except grpc.RpcError as e:
            return e


def greedy(ids: list[int], max_tokens: int, **kw) -> pb.GenerateRequest:
    return pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), sampling=pb.SamplingParams(
        temperature=0, max_tokens=max_tokens, ignore_eos=True), **kw)


@pytest.fixture(scope="module")
def traffic():
    """One served deployment after: a finished request, the same prompt again (a prefix-cache
    hit), and one refusal of each kind. Yields (router metrics, engine metrics, auth)."""
    engine = tiny_engine(0, max_position=128)
    name = engine.config.model.name
    router, node = Metrics("router", model_name=name), Metrics("colocated", model_name=name)
    node.watch_engine(engine)
    auth = BearerAuth([TOKEN])
    s = Served(engine, metrics=router, server_kw={"interceptors": [auth]})
    try:
        for _ in range(2):
            out = generate(s.target, greedy(PROMPT, 5))
            assert out[-1].finish_reason == pb.FINISH_REASON_LENGTH
        assert out[-1].usage.cached_tokens == 12
        bad = generate(s.target, greedy(PROMPT, 5, request_id="x" * 10_000))
        assert bad.code() == grpc.StatusCode.INVALID_ARGUMENT
        adm = s.service.admission
        adm.max_running, adm.max_queued = 0, 0  # no room: the next call is refused at once
        full = generate(s.target, greedy(PROMPT, 5))
        adm.max_running, adm.max_queued = 1024, 1024
        assert full.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        denied = generate(s.target, greedy(PROMPT, 5), token="wrong")
        assert denied.code() == grpc.StatusCode.UNAUTHENTICATED
        auth.refuse()  # the HTTP door counts its refusals on the same object
        yield router, node, auth
    finally:
        s.close()


def test_finished_requests_are_counted_by_outcome(traffic):
    router, _, _ = traffic
    assert get(router, "tandem_requests_total", status="length") == 2


def test_each_refusal_is_counted_by_its_code(traffic):
    router, _, auth = traffic
    assert auth.refused == 2
    assert get(router, "tandem_request_errors_total", code="INVALID_ARGUMENT") == 1
    assert get(router, "tandem_request_errors_total", code="RESOURCE_EXHAUSTED") == 1
    assert get(router, "tandem_request_errors_total", code="UNAUTHENTICATED") == 2


def test_length_and_phase_histograms_move_per_finished_request(traffic):
    router, _, _ = traffic
    assert get(router, "tandem_request_prompt_tokens_count") == 2
    assert get(router, "tandem_request_prompt_tokens_sum") == 2 * len(PROMPT)
    assert get(router, "tandem_request_prompt_tokens_bucket", le="10.0") == 0
    assert get(router, "tandem_request_prompt_tokens_bucket", le="20.0") == 2
    assert get(router, "tandem_request_generated_tokens_sum") == 10
    assert get(router, "tandem_request_generated_tokens_bucket", le="5.0") == 2
    for name in ("tandem_prefill_seconds", "tandem_decode_seconds", "tandem_ttft_seconds"):
        assert get(router, f"{name}_count") == 2, name
        assert get(router, f"{name}_sum") > 0, name
    # Arrival to first token holds admission to first token.
    assert get(router, "tandem_ttft_seconds_sum") >= get(router, "tandem_prefill_seconds_sum")
    # Queue time: one observation per admitted request (the refused ones never waited).
    assert get(router, "tandem_queue_seconds_count") == 2
    assert get(router, "tandem_queue_seconds_bucket", le="+Inf") == 2


def test_prefix_cache_lookups_and_hits_are_counted(traffic):
    _, node, _ = traffic
    assert get(node, "tandem_prefix_cache_queried_tokens_total") == 2 * len(PROMPT)
    assert get(node, "tandem_prefix_cache_hit_tokens_total") == 12
    assert get(node, "tandem_preemptions_total") == 0


def test_every_tandem_series_carries_role_and_model_name(traffic):
    for m in traffic[:2]:
        fams = list(text_string_to_metric_families(m.exposition().decode()))
        tandem = [s for f in fams if f.name.startswith("tandem_") for s in f.samples]
        assert tandem and all(s.labels["role"] == m.role and s.labels["model_name"] == "model"
                              for s in tandem)


def test_process_metrics_are_in_each_registry(traffic):
    for m in traffic[:2]:
        names = {n for n, _ in samples(m)}
        assert {"process_cpu_seconds_total", "process_resident_memory_bytes",
                "process_open_fds", "python_info"} <= names


@pytest.mark.skipif(PROMTOOL is None, reason="promtool missing: run make venv")
def test_the_expositions_after_traffic_pass_promtool(traffic):
    for m in traffic[:2]:
        r = _promtool("check", "metrics", stdin=m.exposition())
        assert r.returncode == 0, r.stdout.decode() + r.stderr.decode()


def test_preemptions_are_read_from_the_scheduler():
    eng = tiny_engine(1, num_blocks=12, max_num_seqs=4)  # 48 token slots for 4 x 28 tokens
    m = Metrics("decode", model_name="tiny")
    m.watch_engine(eng)
    eng.generate([[i + 1] * 8 for i in range(4)],
                 SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    assert eng.scheduler.num_preemptions > 0
    assert get(m, "tandem_preemptions_total") == eng.scheduler.num_preemptions


def test_a_request_waiting_for_room_is_looked_up_once():
    """The head of the queue is matched against the cache each step it waits for blocks;
    only the lookup that admits it is counted."""
    eng = tiny_engine(2, num_blocks=8)  # 32 token slots
    m = Metrics("prefill", model_name="tiny")
    m.watch_engine(eng)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    eng.add_request(list(range(1, 17)), params)  # 16 + 8 tokens: 6 blocks
    eng.step()
    eng.add_request(list(range(40, 56)), params)  # 4 more blocks: waits for the first
    for _ in range(3):
        eng.step()
        assert len(eng.scheduler.waiting) == 1
    while eng.has_unfinished():
        eng.step()
    assert get(m, "tandem_prefix_cache_queried_tokens_total") == 32
    assert get(m, "tandem_prefix_cache_hit_tokens_total") == 0

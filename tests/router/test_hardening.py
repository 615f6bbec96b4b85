"""The public server against bad input and overload: bounded fields, garbage bytes, short
inert errors, the request timeout, admission in arrival order instead of refusal."""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.metrics import Metrics
from router.admission import Admission
from router.limits import MAX_DETAIL_CHARS, Limits
from tandem_client import Client
from tandem_proto.v1 import generation_pb2 as pb
from tandem_proto.v1 import generation_pb2_grpc as pb_grpc
from tests.helpers import tiny_engine
from tests.router.test_server import Served

GEN = "/tandem.v1.Generation/Generate"


@pytest.fixture
def served():
    m = Metrics("router")
    s = Served(tiny_engine(0, max_position=128), metrics=m, limits=Limits(max_prompt_chars=1000))
    s.service_metrics = m
    yield s
    s.close()


def _status(target: str, request) -> grpc.RpcError:
    with grpc.insecure_channel(target) as ch, pytest.raises(grpc.RpcError) as e:
        list(pb_grpc.GenerationStub(ch).Generate(request, timeout=30))
    return e.value


def _errors(m: Metrics) -> dict[str, float]:
    fams = {f.name: f for f in text_string_to_metric_families(m.exposition().decode())}
    return {s.labels["code"]: s.value for s in fams["tandem_request_errors"].samples}


def _ok(target: str) -> list[int]:
    with Client(target, retries=0) as c:
        return list(c.complete(token_ids=[1, 2], temperature=0, max_tokens=3).token_ids)


def _until(cond, timeout=30.0):
    """Wait until `cond()` holds (asserting it came within `timeout` seconds)."""
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out waiting"
        time.sleep(0.01)


def _ids(n):
    return pb.TokenIds(ids=[1] * n)


@pytest.mark.parametrize("request_, field", [
    (pb.GenerateRequest(request_id="x" * 193, token_ids=_ids(2)), "request_id has 193 bytes"),
    (pb.GenerateRequest(request_id="a\nb", token_ids=_ids(2)), "request_id holds control"),
    (pb.GenerateRequest(text="y" * 1001), "text has 1001 characters; the limit is 1000"),
    (pb.GenerateRequest(chat=pb.ChatMessages(messages=[
        pb.ChatMessage(role="r" * 20_000, content="hi")])), "chat.messages[0].role"),
    (pb.GenerateRequest(chat=pb.ChatMessages(messages=[
        pb.ChatMessage(role="user", content="z" * 600)] * 2)), "chat content"),
    (pb.GenerateRequest(token_ids=_ids(2), sampling=pb.SamplingParams(stop=["s"] * 17)),
     "sampling.stop has 17"),
    (pb.GenerateRequest(token_ids=_ids(2), sampling=pb.SamplingParams(stop=["s" * 513])),
     "sampling.stop[0] has 513"),
    (pb.GenerateRequest(token_ids=_ids(2), sampling=pb.SamplingParams(
        stop_token_ids=[1] * 65)), "sampling.stop_token_ids has 65"),
])
def test_each_field_is_bounded_with_a_clear_short_error(served, request_, field):
    e = _status(served.target, request_)
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, e.details()
    assert field in e.details() and len(e.details()) <= MAX_DETAIL_CHARS
    assert "\n" not in e.details()
    assert _ok(served.target)
    assert _errors(served.service_metrics)["INVALID_ARGUMENT"] == 1


def test_an_unknown_role_is_echoed_clipped(served):
    e = _status(served.target, pb.GenerateRequest(chat=pb.ChatMessages(messages=[
        pb.ChatMessage(role="evil\x1b[31m" + "q" * 20, content="hi")])))
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and "\x1b" not in e.details()
    assert len(e.details()) < 120  # the chat role limit let 33 characters through


@pytest.mark.parametrize("data", [b"\xff\xff\xff", b"\x12\x03\xff\xfe\xfd", b"\x0a" * 3])
def test_bytes_that_do_not_parse_are_invalid_argument(served, data):
    with grpc.insecure_channel(served.target) as ch:
        call = ch.unary_stream(GEN)  # no serializer: the bytes go out as they are
        with pytest.raises(grpc.RpcError) as e:
            list(call(data, timeout=30))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "not a valid GenerateRequest" in e.value.details()
    assert _ok(served.target)


def test_model_info_answers_bytes_that_do_not_parse_as_generate_does(served):
    with grpc.insecure_channel(served.target) as ch:
        info = ch.unary_unary("/tandem.v1.Generation/GetModelInfo")
        with pytest.raises(grpc.RpcError) as e:
            info(b"\xff\xff\xff", timeout=30)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "not a valid ModelInfoRequest" in e.value.details()
        assert pb.ModelInfo.FromString(info(b"", timeout=30)).vocab_size > 0


class SlowBackend:
    """Tokenizes in `encode_s` seconds (a stand-in for a long prompt's tokenizer) and then
    streams `tokens` one every `gap_s`; or fails with `error` (unit-test stand-in)."""

    def __init__(self, encode_s=0.0, tokens=3, gap_s=0.0, error=None):
        self.encode_s, self.tokens, self.gap_s, self.error = encode_s, tokens, gap_s, error
        self.cancelled = []

    def encode(self, prompt):
        time.sleep(self.encode_s)
        return [1, 2]

    def info(self):
        return {"model": "slow", "vocab_size": 256, "max_model_len": 128, "block_size": 16,
                "dtype": "float32", "speculation": "none", "deterministic": True}

    async def generate(self, rid, ids, params, cap=None, resume=None):
        from engine.output import RequestOutput

        try:
            for i in range(self.tokens):
                await asyncio.sleep(self.gap_s)
                if self.error is not None:
                    raise self.error
                last = i == self.tokens - 1
                yield RequestOutput(request_id=rid, text="a", token_ids=[7], finished=last,
                                    finish_reason="length" if last else None)
        except BaseException:
            self.cancelled.append(rid)
            raise

    def close(self):
        pass


def StubServed(backend, **service_kw):  # noqa: N802 - reads as the class it builds
    return Served(None, backend, **service_kw)


def _complete(target, rid="", timeout=30, **kw):
    req = pb.GenerateRequest(request_id=rid, text="hi", **kw)
    with grpc.insecure_channel(target) as ch:
        return list(pb_grpc.GenerationStub(ch).Generate(req, timeout=timeout))


def test_tokenizing_runs_off_the_event_loop():
    s = StubServed(SlowBackend(encode_s=1.5))
    try:
        slow = threading.Thread(target=_complete, args=(s.target,))
        slow.start()
        _until(lambda: s.service.inflight)  # the slow request is tokenizing now
        t0 = time.perf_counter()
        with grpc.insecure_channel(s.target) as ch:
            info = pb_grpc.GenerationStub(ch).GetModelInfo(pb.ModelInfoRequest(), timeout=10)
        assert time.perf_counter() - t0 < 0.5
        assert info.deterministic  # the engine's mode reaches GetModelInfo
        slow.join(30)
    finally:
        s.close()


def test_the_request_timeout_is_deadline_exceeded_and_stops_the_work():
    backend = SlowBackend(tokens=50, gap_s=0.1)
    s = StubServed(backend, request_timeout_s=0.5)
    try:
        e = _status(s.target, pb.GenerateRequest(request_id="slow", text="hi"))
        assert e.code() == grpc.StatusCode.DEADLINE_EXCEEDED and "0.5 s" in e.details()
        assert len(backend.cancelled) == 1 and backend.cancelled[0].startswith("slow.")
    finally:
        s.close()


def test_an_internal_failure_is_short_and_logged_in_full(caplog):
    s = StubServed(SlowBackend(error=KeyError("/secret/path at pid 4242")))
    try:
        with caplog.at_level(logging.ERROR, logger="tandem.router"):
            e = _status(s.target, pb.GenerateRequest(request_id="boom", text="hi"))
        assert e.code() == grpc.StatusCode.INTERNAL
        assert "secret" not in e.details() and "'boom'" in e.details()
        assert any("secret" in (r.exc_text or "") for r in caplog.records)
    finally:
        s.close()


def test_requests_past_the_running_limit_wait_and_complete():
    s = StubServed(SlowBackend(tokens=4, gap_s=0.1), admission=Admission(1, max_queued=8))
    try:
        done = []
        ts = [threading.Thread(target=lambda i=i: done.append(len(_complete(s.target, f"q{i}"))))
              for i in range(4)]
        [t.start() for t in ts]
        [t.join(30) for t in ts]
        assert done == [4, 4, 4, 4]
    finally:
        s.close()


def test_a_full_queue_and_a_long_wait_are_resource_exhausted():
    s = StubServed(SlowBackend(tokens=50, gap_s=0.1), admission=Admission(1, max_queued=1,
                                                                           max_wait_s=0.5))
    try:
        first = threading.Thread(target=_complete, args=(s.target, "a"))
        first.start()
        _until(lambda: s.service.admission.running == 1)
        waiter = threading.Thread(target=lambda: _status(s.target, pb.GenerateRequest(
            request_id="b", text="hi")))
        waiter.start()
        _until(lambda: s.service.admission.queued == 1)
        full = _status(s.target, pb.GenerateRequest(request_id="c", text="hi"))
        assert full.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "full" in full.details()
        waiter.join(10)
        late = _status(s.target, pb.GenerateRequest(request_id="d", text="hi"))
        assert late.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "waited" in late.details()
        first.join(30)
    finally:
        s.close()


def test_admission_is_first_in_first_out_and_caps_each_client():
    async def run():
        adm, order = Admission(1, per_client=2), []

        async def req(name, client, hold=0.05):
            async with adm.slot(client):
                order.append(name)
                await asyncio.sleep(hold)

        first = asyncio.ensure_future(req("a", "x", 0.2))
        await asyncio.sleep(0.01)
        rest = [asyncio.ensure_future(req(n, c)) for n, c in (("b", "y"), ("c", "z"), ("d", "x"))]
        await asyncio.sleep(0.01)
        with pytest.raises(Exception, match="this client has 2 requests"):
            await req("e", "x")
        gone = asyncio.ensure_future(req("f", "w"))
        await asyncio.sleep(0.01)
        gone.cancel()  # a caller that leaves the queue gives up its place
        await asyncio.gather(first, *rest)
        assert order == ["a", "b", "c", "d"] and adm.running == 0 and adm.queued == 0

    asyncio.run(run())


@pytest.mark.parametrize("auth", [False, True])
def test_the_per_client_cap_holds_however_the_token_is_spelled(auth):
    """One client, one slot: with tokens checked, every spelling of the same bearer token
    counts as one client; with none checked, made-up tokens count as their peer address."""
    from router.auth import BearerAuth

    s = StubServed(SlowBackend(tokens=50, gap_s=0.1),
                   admission=Admission(8, max_queued=8, per_client=1),
                   server_kw={"interceptors": (BearerAuth(["s3cret"]),)} if auth else None)
    spellings = ["Bearer s3cret", "bearer  s3cret", "BEARER s3cret ", "Bearer other"]
    try:
        def call(value):
            with grpc.insecure_channel(s.target) as ch:
                stub = pb_grpc.GenerationStub(ch)
                return list(stub.Generate(pb.GenerateRequest(text="hi"), timeout=30,
                                          metadata=(("authorization", value),)))

        first = threading.Thread(target=lambda: call(spellings[0]))
        first.start()
        _until(lambda: s.service.admission.running == 1)
        for value in spellings[1:]:
            with pytest.raises(grpc.RpcError) as e:
                call(value)
            code = e.value.code()
            if auth and value == "Bearer other":  # a wrong token: turned away at the door
                assert code == grpc.StatusCode.UNAUTHENTICATED
            else:
                assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, (value, e.value.details())
        assert s.service.admission.running == 1
        first.join(30)
    finally:
        s.close()


def _health(target: str) -> int:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(target) as ch:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(
            service="tandem.v1.Generation"), timeout=10).status


def test_drain_finishes_short_streams_cuts_long_ones_and_refuses_new_ones():
    from grpc_health.v1 import health_pb2

    s = StubServed(SlowBackend(tokens=60, gap_s=0.05))
    try:
        got: dict[str, object] = {}

        def call(rid, **kw):
            try:
                got[rid] = len(_complete(s.target, rid, **kw))
            except grpc.RpcError as e:
                got[rid] = e.code()

        long = threading.Thread(target=call, args=("long",))
        long.start()
        _until(lambda: "long" in s.service.inflight)
        drain = asyncio.run_coroutine_threadsafe(s.service.drain(0.5), s.loop)
        _until(lambda: s.service.draining)
        assert _health(s.target) == health_pb2.HealthCheckResponse.NOT_SERVING
        call("new")
        drain.result(30)
        long.join(30)
        # 60 tokens take 3 s: the long stream outlived the grace period and was cut so the
        # SDK continues it elsewhere; the new one was refused the same way.
        assert got == {"long": grpc.StatusCode.UNAVAILABLE, "new": grpc.StatusCode.UNAVAILABLE}
        assert not s.service.inflight
    finally:
        s.close()


def test_a_drained_stream_goes_on_through_the_sdk_on_the_next_server(smol_engine):
    s = Served(smol_engine)
    kw = {"messages": [{"role": "user", "content": "List four metals and one use of each."}],
          "temperature": 0, "max_tokens": 30}
    try:
        with Client(s.target, backoff=0.05) as c:
            want = c.complete(**kw)
            stream = c.generate(**kw)
            got = [next(stream) for _ in range(3)]
            asyncio.run_coroutine_threadsafe(s.service.drain(0.0), s.loop).result(30)
            s.restart()
            got += list(stream)
    finally:
        s.close()
    assert [t for g in got for t in g.token_ids] == list(want.token_ids)
    assert "".join(g.text for g in got) == want.text


def test_health_follows_the_workers_and_the_router_gives_up_when_they_stay_lost():
    from grpc_health.v1 import health_pb2

    backend = SlowBackend()
    backend.up = True

    async def serving():
        return backend.up

    backend.serving = serving
    s = StubServed(backend)
    serving_, not_serving = (health_pb2.HealthCheckResponse.SERVING,
                             health_pb2.HealthCheckResponse.NOT_SERVING)
    try:
        watch = asyncio.run_coroutine_threadsafe(
            s.service.supervise(every_s=0.02, give_up_s=60.0), s.loop)
        backend.up = False  # every actor of a role gone (its Ray node, say)
        _until(lambda: _health(s.target) == not_serving)
        backend.up = True  # Ray restarted them
        _until(lambda: _health(s.target) == serving_)
        assert not watch.done()
        watch.cancel()
        backend.up = False
        lost = asyncio.run_coroutine_threadsafe(
            s.service.supervise(every_s=0.02, give_up_s=0.3), s.loop)
        lost.result(30)  # returns: the server exits for its supervisor
        assert _health(s.target) == not_serving
    finally:
        s.close()


def test_an_error_raised_on_a_worker_is_answered_with_its_own_message():
    ray_exceptions = pytest.importorskip("ray.exceptions")
    from engine import InvalidRequestError

    cause = InvalidRequestError("request id 'x' is already here")
    wrapped = ray_exceptions.RayTaskError(
        "DecodeNode.reserve", 'Traceback (most recent call last):\n  File "/srv/node.py"',
        cause, proctitle="ray::DecodeNode.reserve() (pid=4242, ip=10.0.0.7)",
        ip="10.0.0.7").as_instanceof_cause()
    assert isinstance(wrapped, InvalidRequestError) and "pid=4242" in str(wrapped)
    s = StubServed(SlowBackend(error=wrapped))
    try:
        e = _status(s.target, pb.GenerateRequest(text="hi"))
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert e.details() == "request id 'x' is already here"
    finally:
        s.close()


@pytest.mark.parametrize("path", ["grpc.reflection.v1.ServerReflection",
                                  "grpc.reflection.v1alpha.ServerReflection"])
def test_reflection_answers_under_v1_and_v1alpha(path):
    from grpc_reflection.v1alpha import reflection_pb2 as rpb

    s = StubServed(SlowBackend())
    try:
        with grpc.insecure_channel(s.target) as ch:
            call = ch.stream_stream(f"/{path}/ServerReflectionInfo",
                                    request_serializer=rpb.ServerReflectionRequest.SerializeToString,
                                    response_deserializer=rpb.ServerReflectionResponse.FromString)
            resp = next(iter(call(iter([rpb.ServerReflectionRequest(list_services="")]),
                                  timeout=10)))
        names = {x.name for x in resp.list_services_response.service}
        assert {"tandem.v1.Generation", "grpc.health.v1.Health",
                "grpc.reflection.v1.ServerReflection"} <= names
    finally:
        s.close()

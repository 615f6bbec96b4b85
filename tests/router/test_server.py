"""The public gRPC server in colocated mode, driven through the real SDK over localhost."""

from __future__ import annotations

import asyncio
import threading

import grpc
import pytest

from engine import SamplingParams
from router.backends import LocalBackend
from router.server import GenerationService, start_server
from tandem_client import Client
from tandem_client.errors import InvalidArgumentError, ResourceExhaustedError
from tandem_proto.v1 import generation_pb2 as pb
from tandem_proto.v1 import generation_pb2_grpc as pb_grpc
from tests.helpers import tiny_engine


class Served:
    """A server on its own event-loop thread, so sync clients can call it from the test."""

    def __init__(self, engine, backend=None, server_kw=None, **service_kw):
        """`server_kw`: start_server's keyword arguments (TLS credentials, interceptors)."""
        self.engine = engine
        self.backend = backend or LocalBackend(engine)
        self.loop = asyncio.new_event_loop()
        ready = threading.Event()

        async def boot():
            self.service = GenerationService(self.backend, **service_kw)
            self.server, self.port = await start_server(self.service, **(server_kw or {}))
            ready.set()

        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        asyncio.run_coroutine_threadsafe(boot(), self.loop)
        assert ready.wait(30)
        self.target = f"127.0.0.1:{self.port}"

    def restart(self, metrics=None):
        """Stop the gRPC server (its calls break off, UNAVAILABLE) and start a new one on the
        same port over the same backend: a router that died and came back."""
        asyncio.run_coroutine_threadsafe(self.server.stop(0), self.loop).result(10)

        async def boot():
            return await start_server(GenerationService(self.backend, metrics=metrics),
                                      port=self.port)

        self.server, port = asyncio.run_coroutine_threadsafe(boot(), self.loop).result(30)
        assert port == self.port

    def close(self):
        asyncio.run_coroutine_threadsafe(self.server.stop(0), self.loop).result(10)
        self.backend.close()
        self.loop.call_soon_threadsafe(self.loop.stop)


@pytest.fixture
def served():
    s = Served(tiny_engine(0, max_position=128))
    yield s
    s.close()


def test_streams_what_the_engine_generates(served):
    prompts = [[1, 2, 3], [7] * 20, list(range(40, 90))]
    want = [c.token_ids for c in served.engine.with_config().generate(
        prompts, SamplingParams(temperature=0, max_tokens=12))]
    with Client(served.target) as c:
        got = [c.complete(token_ids=p, temperature=0, max_tokens=12) for p in prompts]
    assert [list(g.token_ids) for g in got] == want
    assert all(g.finish_reason == "length" and g.usage.completion_tokens == 12 for g in got)
    assert got[0].usage.prompt_tokens == 3


def test_concurrent_streams(served):
    prompts = [[i, i + 1, i + 2] for i in range(1, 17)]
    want = [c.token_ids for c in served.engine.with_config().generate(
        prompts, SamplingParams(temperature=0, max_tokens=10))]
    out = [None] * len(prompts)

    def run(i):
        with Client(served.target) as c:
            out[i] = list(c.complete(token_ids=prompts[i], temperature=0, max_tokens=10).token_ids)

    ts = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    [t.start() for t in ts]
    [t.join(60) for t in ts]
    assert out == want


@pytest.mark.parametrize("kwargs", [
    {"token_ids": []}, {"prompt": "text needs a tokenizer"}, {"token_ids": [1], "max_tokens": 0},
    {"token_ids": [1], "temperature": -1.0}, {"token_ids": [1], "top_p": 1.5},
    {"token_ids": [10_000]}, {"token_ids": [1] * 200}, {"token_ids": [1], "stop": [""]},
    {"token_ids": [1], "speculation": "ngram"},
])
def test_bad_requests_are_invalid_argument_and_server_keeps_serving(served, kwargs):
    with Client(served.target, retries=0) as c:
        with pytest.raises(InvalidArgumentError):
            c.complete(**kwargs)
        assert c.complete(token_ids=[1, 2], temperature=0, max_tokens=3).token_ids
    served.engine.blocks.check_all_free()


def test_prompt_larger_than_the_kv_cache_is_resource_exhausted():
    s = Served(tiny_engine(0, num_blocks=4, max_position=128))
    try:
        with Client(s.target, retries=0) as c, pytest.raises(ResourceExhaustedError):
            c.complete(token_ids=list(range(1, 60)))
    finally:
        s.close()


def test_cancel_mid_stream_frees_blocks(served):
    with Client(served.target) as c:
        stream = c.generate(token_ids=list(range(1, 30)), temperature=0, max_tokens=100,
                            ignore_eos=True)
        got = 0
        for chunk in stream:
            got += len(chunk.token_ids)
            if got >= 3:
                stream.cancel()
                break
    for _ in range(100):  # the abort reaches the engine thread asynchronously
        if not served.engine.seqs:
            break
        threading.Event().wait(0.05)
    assert not served.engine.seqs
    served.engine.blocks.check_all_free()


def test_model_info_and_health(served):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with Client(served.target) as c:
        info = c.model_info()
    assert info.vocab_size == 256 and info.max_model_len == 128
    with grpc.insecure_channel(served.target) as ch:
        resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(
            service="tandem.v1.Generation"))
    assert resp.status == health_pb2.HealthCheckResponse.SERVING


def test_metrics_move_with_traffic():
    from prometheus_client.parser import text_string_to_metric_families

    from engine.metrics import Metrics

    m = Metrics("router")
    s = Served(tiny_engine(0, max_position=128))
    try:
        asyncio.run_coroutine_threadsafe(s.server.stop(0), s.loop).result(10)

        async def boot():
            return await start_server(GenerationService(s.backend, metrics=m))

        s.server, port = asyncio.run_coroutine_threadsafe(boot(), s.loop).result(30)
        with Client(f"127.0.0.1:{port}") as c:
            for n in (3, 5):
                c.complete(token_ids=[1, 2, 3], temperature=0, max_tokens=n)
        fams = {f.name: f for f in text_string_to_metric_families(m.exposition().decode())}
        gen = sum(x.value for x in fams["tandem_generated_tokens"].samples)
        reqs = [x for x in fams["tandem_requests"].samples if x.name.endswith("_total")]
        ttft = [x for x in fams["tandem_ttft_seconds"].samples if x.name.endswith("_count")]
        assert gen == 8 and sum(x.value for x in reqs) == 2 and ttft[0].value == 2
    finally:
        s.close()


def _call(target, request):
    """The raw Generate call (the SDK sets a continuation only when it resumes)."""
    with grpc.insecure_channel(target) as ch:
        return list(pb_grpc.GenerationStub(ch).Generate(request, timeout=60))


def test_a_continuation_streams_only_what_follows(served):
    """The output of an unbroken call, cut anywhere: a continuation carrying its head streams
    its tail, token for token, and the usage of the whole completion."""
    prompt = [5, 9, 14, 3]
    with Client(served.target) as c:
        want = c.complete(token_ids=prompt, temperature=0, max_tokens=12, ignore_eos=True)
    ids = list(want.token_ids)
    for cut in (1, 5, 11):
        req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), request_id=f"cut{cut}",
                                 sampling=pb.SamplingParams(temperature=0, max_tokens=12,
                                                            ignore_eos=True),
                                 continuation=pb.Continuation(token_ids=ids[:cut]))
        got = _call(served.target, req)
        assert [t for r in got for t in r.token_ids] == ids[cut:]
        assert {r.request_id for r in got} == {f"cut{cut}"}
        assert got[-1].usage.completion_tokens == 12 and got[-1].usage.prompt_tokens == 4
        # the prompt's block came from the cache; the continuation's own (cached too) are
        # no prompt tokens
        assert got[-1].usage.cached_tokens == 4
        assert got[-1].finish_reason == pb.FINISH_REASON_LENGTH
    served.engine.blocks.check_all_free()


@pytest.mark.parametrize("continuation, match", [
    (pb.Continuation(), "no token ids"), (pb.Continuation(token_ids=[10_000]), "token ids"),
    (pb.Continuation(token_ids=[7] * 6), "max_tokens"),
    (pb.Continuation(token_ids=[7] * 130), "context")])
def test_bad_continuations_are_invalid_argument(served, continuation, match):
    req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 2]), continuation=continuation,
                             sampling=pb.SamplingParams(max_tokens=6 if len(
                                 continuation.token_ids) < 100 else 200))
    with pytest.raises(grpc.RpcError) as e:
        _call(served.target, req)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and match in e.value.details()
    if match in ("token ids", "context"):  # the engine's refusal, which names the
        assert e.value.details().startswith("continuation.token_ids (")  # continuation
    with Client(served.target) as c:
        assert c.complete(token_ids=[1, 2], temperature=0, max_tokens=3).token_ids
    served.engine.blocks.check_all_free()


def test_a_continuation_past_a_stop_token_is_invalid_argument(served):
    """Output holding the model's end token or a stop id had finished: continuing it would
    generate past the end."""
    eos = 5
    served.engine.eos_ids.add(eos)  # the tiny random model has no end token of its own
    for made, extra in [([7, eos], {}), ([7, 9], {"stop_token_ids": [9]})]:
        req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 2]), sampling=pb.SamplingParams(
            max_tokens=6, **extra), continuation=pb.Continuation(token_ids=made))
        with pytest.raises(grpc.RpcError) as e:
            _call(served.target, req)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "stop token" in e.value.details() and "had finished" in e.value.details()
    ok = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 2]), sampling=pb.SamplingParams(
        max_tokens=6, ignore_eos=True), continuation=pb.Continuation(token_ids=[7, eos]))
    assert _call(served.target, ok)  # past the end token on purpose: ignore_eos
    served.engine.blocks.check_all_free()


def test_a_stream_goes_on_when_its_server_dies(smol_engine):
    """The router's server dies mid-stream and a new one comes up on its port: the SDK's
    stream continues after what it received, and the whole of it (text, tokens, usage) is
    the unbroken call's; the continued call is counted."""
    from prometheus_client.parser import text_string_to_metric_families

    from engine.metrics import Metrics

    s, m = Served(smol_engine), Metrics("router")
    kw = {"messages": [{"role": "user", "content": "Name five rivers and a fact about each."}],
          "temperature": 0, "max_tokens": 40, "stop": ["Danube"]}
    try:
        with Client(s.target, backoff=0.05) as c:
            want = c.complete(**kw)
            stream = c.generate(**kw)
            got = [next(stream) for _ in range(4)]
            s.restart(metrics=m)
            got += list(stream)
    finally:
        s.close()
    assert "".join(g.text for g in got) == want.text and len(want.token_ids) > 8
    assert [t for g in got for t in g.token_ids] == list(want.token_ids)
    assert got[-1].finish_reason == want.finish_reason
    assert got[-1].usage.completion_tokens == want.usage.completion_tokens
    assert got[-1].usage.prompt_tokens == want.usage.prompt_tokens
    assert len({g.request_id for g in got}) == 1
    fams = {f.name: f for f in text_string_to_metric_families(m.exposition().decode())}
    assert fams["tandem_stream_continuations"].samples[0].value == 1
    for _ in range(100):  # the broken call's abort reaches the engine thread asynchronously
        if not smol_engine.seqs:
            break
        threading.Event().wait(0.05)
    smol_engine.blocks.check_all_free()

"""The blocking Client against a real in-process gRPC server (conftest.FakeGeneration)."""

from __future__ import annotations

import socket
import threading
import time

import grpc
import pytest

from tandem_client import (
    Chunk,
    Client,
    DeadlineExceededError,
    InvalidArgumentError,
    ResourceExhaustedError,
    TandemError,
    UnavailableError,
    Usage,
)
from tandem_proto.v1 import generation_pb2 as pb

from .conftest import FAST_RETRY, FakeGeneration, start_server


@pytest.fixture
def client(fake):
    with Client(fake.target, **FAST_RETRY) as c:
        yield c


def test_chunks_stream_in_order_and_complete_joins_them(client):
    chunks = list(client.generate("hi"))
    assert [c.text for c in chunks] == ["Hel", "lo", "!"]
    assert [c.token_ids for c in chunks] == [(1,), (2, 3), (4,)]
    assert [c.finish_reason for c in chunks] == [None, None, "stop"]
    assert [c.usage is None for c in chunks] == [True, True, False]
    assert chunks[-1].usage == Usage(5, 4, 2, 1, 12.5)
    assert {c.request_id for c in chunks} == {"srv-1"}  # the server assigned one

    done = client.complete("hi", request_id="mine")
    assert (done.text, done.token_ids, done.finish_reason) == ("Hello!", (1, 2, 3, 4), "stop")
    assert done.usage == chunks[-1].usage and done.request_id == "mine"


def test_each_prompt_kind_reaches_the_server_as_its_oneof(client, fake):
    client.complete("Once upon")
    client.chat([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    client.complete(token_ids=[5, 6, 7])
    text, chat, ids = fake.requests
    assert text.WhichOneof("prompt") == "text" and text.text == "Once upon"
    assert chat.WhichOneof("prompt") == "chat"
    assert [(m.role, m.content) for m in chat.chat.messages] == [("system", "Be brief."),
                                                                 ("user", "Hi")]
    assert ids.WhichOneof("prompt") == "token_ids" and list(ids.token_ids.ids) == [5, 6, 7]


def test_sampling_params_and_speculation_reach_the_server(client, fake):
    client.complete("x", temperature=0.0, top_p=0.9, top_k=5, seed=7, max_tokens=12, stop="END",
                    stop_token_ids=[2], ignore_eos=True, speculation="ngram",
                    num_speculative_tokens=3)
    s, spec = fake.requests[0].sampling, fake.requests[0].speculation
    assert s.HasField("temperature") and s.temperature == 0.0  # explicit greedy, not "unset"
    assert (s.top_p, s.top_k, s.seed, s.max_tokens) == (0.9, 5, 7, 12)
    assert (list(s.stop), list(s.stop_token_ids), s.ignore_eos) == (["END"], [2], True)
    assert spec.method == pb.SPECULATION_METHOD_NGRAM and spec.num_tokens == 3


def test_unset_sampling_params_stay_unset_for_server_defaults(client, fake):
    client.complete("x")
    req = fake.requests[0]
    assert not any(req.sampling.HasField(f) for f in ("temperature", "top_p", "seed"))
    assert req.sampling.max_tokens == 0 and not req.HasField("speculation")


def test_metadata_is_sent_with_every_call(fake):
    with Client(fake.target, metadata=[("authorization", "Bearer t")]) as c:
        c.complete("x")
    assert fake.metadata[0]["authorization"] == "Bearer t"


def test_deadline_exceeded_raises_with_its_code(client, fake):
    fake.mode = "hang"
    t0 = time.monotonic()
    with pytest.raises(DeadlineExceededError) as e:
        client.complete("x", timeout=0.2)
    assert e.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert time.monotonic() - t0 < 2
    assert fake.client_gone.wait(5)  # the server saw the call end too


def test_client_default_timeout_applies_to_every_call(fake):
    fake.mode = "hang"
    with Client(fake.target, timeout=0.2) as c, pytest.raises(DeadlineExceededError):
        c.complete("x")


def test_unavailable_before_any_chunk_is_retried(client, fake):
    fake.fail_first = [grpc.StatusCode.UNAVAILABLE] * 2
    assert client.complete("x").text == "Hello!"
    assert len(fake.requests) == 3


def test_retries_give_up_after_the_configured_count(fake):
    fake.fail_first = [grpc.StatusCode.UNAVAILABLE] * 10
    with Client(fake.target, retries=2, **FAST_RETRY) as c, pytest.raises(UnavailableError):
        c.complete("x")
    assert len(fake.requests) == 3


def test_unavailable_after_a_chunk_is_continued_after_what_arrived(client, fake):
    """Every call breaks off after one chunk: each retry carries what arrived so far, under
    the id the server gave, and the chunks go on where they stopped (not from the start)."""
    fake.fail_after_first_chunk = grpc.StatusCode.UNAVAILABLE
    chunks = list(client.generate("x"))
    assert [c.text for c in chunks] == ["Hel", "lo", "!"]
    assert [c.token_ids for c in chunks] == [(1,), (2, 3), (4,)]
    assert chunks[-1].finish_reason == "stop"
    first, *more = fake.requests
    assert not first.HasField("continuation")
    assert [(list(r.continuation.token_ids), r.continuation.text_length, r.request_id)
            for r in more] == [([1], 3, "srv-1"), ([1, 2, 3], 5, "srv-1")]
    assert all(r.text == "x" for r in more)


def test_retries_of_a_broken_stream_start_again_after_each_chunk(fake):
    """retries=1 is one retry per break, not per stream: three breaks, each after new output."""
    fake.fail_after_first_chunk = grpc.StatusCode.UNAVAILABLE
    fake.chunks = [("a", [1]), ("b", [2]), ("c", [3]), ("d", [4])]
    with Client(fake.target, retries=1, **FAST_RETRY) as c:
        assert c.complete("x").text == "abcd"
    assert len(fake.requests) == 4


def test_without_resume_unavailable_after_a_chunk_is_not_retried(fake):
    fake.fail_after_first_chunk = grpc.StatusCode.UNAVAILABLE
    with Client(fake.target, resume=False, **FAST_RETRY) as c:
        stream = c.generate("x")
        assert next(stream).text == "Hel"
        with pytest.raises(UnavailableError, match="mid-stream"):
            next(stream)
    assert len(fake.requests) == 1  # a retry would have streamed "Hel" twice


def test_other_errors_after_a_chunk_are_not_continued(client, fake):
    fake.fail_after_first_chunk = grpc.StatusCode.INTERNAL
    stream = client.generate("x")
    assert next(stream).text == "Hel"
    with pytest.raises(TandemError):
        next(stream)
    assert len(fake.requests) == 1


@pytest.mark.parametrize("code, exc", [(grpc.StatusCode.INVALID_ARGUMENT, InvalidArgumentError),
                                       (grpc.StatusCode.RESOURCE_EXHAUSTED,
                                        ResourceExhaustedError)])
def test_server_errors_surface_as_their_exception_and_are_not_retried(client, fake, code, exc):
    fake.fail_first = [code]
    with pytest.raises(exc) as e:
        client.complete("x")
    assert isinstance(e.value, TandemError)
    assert (e.value.code, e.value.details) == (code, "scripted failure")
    assert len(fake.requests) == 1


def test_breaking_out_of_the_loop_cancels_on_the_server(client, fake):
    fake.mode = "endless"
    got = []
    for chunk in client.generate("x"):
        got.append(chunk)
        if len(got) == 2:
            break
    assert fake.client_gone.wait(5)


def test_cancel_stops_the_server_and_ends_the_stream_quietly(client, fake):
    fake.mode = "endless"
    stream = client.generate("x")
    assert isinstance(next(stream), Chunk)
    stream.cancel()
    assert list(stream) == []
    assert fake.client_gone.wait(5)


def test_cancel_from_another_thread_unblocks_a_waiting_reader(client, fake):
    fake.mode = "hang"
    stream = client.generate("x")
    threading.Timer(0.1, stream.cancel).start()
    assert list(stream) == []
    assert fake.client_gone.wait(5)


def test_model_info(client):
    info = client.model_info()
    assert (info.model, info.vocab_size, info.max_model_len) == ("fake-135m", 49152, 8192)
    assert (info.default_speculation, info.block_size, info.dtype) == ("eagle3", 16, "bfloat16")
    assert info.deterministic is True


def test_model_info_is_retried_on_unavailable(client, fake):
    fake.fail_first = [grpc.StatusCode.UNAVAILABLE]
    assert client.model_info().model == "fake-135m"


def test_no_server_at_all_is_unavailable():
    with Client(_closed_port_target(), retries=1, **FAST_RETRY) as c:
        with pytest.raises(UnavailableError):
            c.complete("x", timeout=5)


def test_a_server_that_comes_up_late_is_reached_by_retrying():
    # Needs RetryPolicy.channel_options: with gRPC's default reconnect backoff (1 s at first)
    # the retries fail at once while the channel waits, though the server is up at 0.3 s.
    target = _closed_port_target()
    servicer, servers = FakeGeneration(), []
    timer = threading.Timer(0.3, lambda: servers.append(start_server(servicer, target)))
    timer.start()
    try:
        with Client(target, retries=30, backoff=0.05, max_backoff=0.1) as c:
            assert c.complete("x", timeout=10).text == "Hello!"
    finally:
        timer.join()
        for s in servers:
            s.stop(grace=None)


def _closed_port_target() -> str:
    """An address where nothing listens (a port just freed by the OS)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"

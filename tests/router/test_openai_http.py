"""The OpenAI-compatible HTTP API through the official `openai` package, against the real
aiohttp server over the gRPC servicer and the embedded model: the same output as gRPC,
streaming and not, OpenAI's error shapes and codes, tokens, cancellation."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request

import pytest

from router.admission import Admission
from router.auth import BearerAuth
from router.openai_http import OpenAIServer
from tandem_client import Client
from tests.router.test_server import Served

openai = pytest.importorskip("openai")
CHAT = [{"role": "user", "content": "Name three colors of the rainbow."}]


class Api:
    """`Served` (the gRPC servicer on its own loop) with the HTTP API beside it."""

    def __init__(self, engine, auth=None, **service_kw):
        self.served = Served(engine, **service_kw)
        self.http = OpenAIServer(self.served.service, auth)
        self.port = self._call(self.http.start("127.0.0.1", 0))
        self.base = f"http://127.0.0.1:{self.port}"
        self.model = self.served.backend.info()["model"]

    def _call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.served.loop).result(30)

    def client(self, key: str = "unused", **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base + "/v1", api_key=key, max_retries=0,
                             timeout=120, **kw)

    def raw(self, method: str, path: str, body: bytes | None = None, headers=None):
        """(HTTP status, parsed JSON) of a request sent as is."""
        req = urllib.request.Request(self.base + path, data=body, method=method,
                                     headers={"Content-Type": "application/json",
                                              **(headers or {})})
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    def close(self):
        self._call(self.http.stop())
        self.served.close()


@pytest.fixture
def api(smol_engine):
    a = Api(smol_engine)
    yield a
    a.close()


def test_models_lists_the_served_model(api):
    c = api.client()
    assert [m.id for m in c.models.list().data] == [api.model]
    assert c.models.retrieve(api.model).id == api.model
    with pytest.raises(openai.NotFoundError):
        c.models.retrieve("not-this-one")


def test_chat_equals_grpc_whole_and_streamed(api):
    with Client(api.served.target, retries=0) as g:
        ref = g.complete(messages=CHAT, temperature=0, max_tokens=12)
    c = api.client()
    whole = c.chat.completions.create(model=api.model, messages=CHAT, temperature=0,
                                      max_completion_tokens=12)
    assert whole.choices[0].message.content == ref.text
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].finish_reason == "length"
    assert whole.usage.completion_tokens == 12
    assert whole.usage.prompt_tokens == ref.usage.prompt_tokens
    chunks = list(c.chat.completions.create(model=api.model, messages=CHAT, temperature=0,
                                            max_tokens=12, stream=True,
                                            stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == ref.text
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert all(ch.usage is None for ch in chunks[:-1])


def test_completions_text_ids_prompts_and_stop(api):
    c = api.client()
    one = c.completions.create(model=api.model, prompt="The capital of France is",
                               temperature=0, max_tokens=8)
    ids = api.served.engine.encode_prompt("The capital of France is")
    by_ids = c.completions.create(model=api.model, prompt=ids, temperature=0, max_tokens=8)
    assert one.choices[0].text == by_ids.choices[0].text and one.choices[0].text
    two = c.completions.create(model=api.model, prompt=["The capital of France is", "1, 2,"],
                               temperature=0, max_tokens=8)
    assert [ch.index for ch in two.choices] == [0, 1]
    assert two.choices[0].text == one.choices[0].text
    assert two.usage.prompt_tokens == one.usage.prompt_tokens + len(
        api.served.engine.encode_prompt("1, 2,"))
    word = one.choices[0].text.split()[0]
    cut = c.completions.create(model=api.model, prompt="The capital of France is",
                               temperature=0, max_tokens=8, stop=[word])
    assert word not in cut.choices[0].text and cut.choices[0].finish_reason == "stop"
    streamed = list(c.completions.create(model=api.model, prompt="The capital of France is",
                                         temperature=0, max_tokens=8, stream=True))
    assert "".join(ch.choices[0].text for ch in streamed) == one.choices[0].text


def test_default_completion_length_is_openais(api):
    out = api.client().completions.create(model=api.model, prompt="Once upon a time",
                                          temperature=0, extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 16


def test_seeded_sampling_repeats_and_n_draws_differ(api):
    c = api.client()
    kw = dict(model=api.model, messages=CHAT, temperature=1.0, max_tokens=16, seed=7)
    a, b = c.chat.completions.create(**kw), c.chat.completions.create(**kw)
    assert a.choices[0].message.content == b.choices[0].message.content
    many = c.chat.completions.create(**kw, n=3)
    texts = [ch.message.content for ch in many.choices]
    assert [ch.index for ch in many.choices] == [0, 1, 2]
    assert texts[0] == a.choices[0].message.content and len(set(texts)) > 1
    assert many.usage.prompt_tokens == a.usage.prompt_tokens  # one prompt, three choices


@pytest.mark.parametrize("kw, param", [
    ({"temperature": 3}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"n": 0}, "n"),
    ({"n": 17}, "n"),
    ({"logprobs": True}, "logprobs"),
    ({"stop": [1]}, "stop"),
    ({"frequency_penalty": 0.5}, "frequency_penalty"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, None),
    ({"messages": []}, None),
    ({"temperature": 10**400}, "temperature"),  # past float's range
    ({"seed": 1 << 63}, "seed"),  # past a signed 64-bit integer
])
def test_bad_fields_are_400_naming_the_field(api, kw, param):
    body = {"model": api.model, "messages": CHAT, **kw}
    with pytest.raises(openai.BadRequestError) as e:
        api.client().chat.completions.create(**body)
    assert e.value.status_code == 400
    err = e.value.body
    assert err["type"] == "invalid_request_error" and err["message"]
    if param is not None:
        assert err["param"] == param and param in err["message"]


def test_errors_keep_openais_shape_for_any_input(api):
    for method, path, body in [("POST", "/v1/chat/completions", b"{not json"),
                               ("POST", "/v1/chat/completions", b"[1, 2]"),
                               ("POST", "/v1/completions", json.dumps(
                                   {"model": api.model}).encode()),
                               ("GET", "/v1/nowhere", None),
                               ("GET", "/v1/chat/completions", None)]:
        status, out = api.raw(method, path, body)
        assert status in (400, 404, 405), (path, status, out)
        assert set(out["error"]) == {"message", "type", "param", "code"}, out
    status, out = api.raw("POST", "/v1/completions", json.dumps(
        {"model": "gpt-4", "prompt": "hi"}).encode())
    assert status == 404 and out["error"]["code"] == "model_not_found"
    # over the server's prompt limit: the gRPC path's check and message
    limit = api.served.service.limits.max_prompt_chars
    status, out = api.raw("POST", "/v1/completions", json.dumps(
        {"model": api.model, "prompt": "x" * (limit + 1)}).encode())
    assert status == 400 and f"the limit is {limit}" in out["error"]["message"]
    status, out = api.raw("POST", "/v1/completions", b'{"model": "m", "prompt": "' +
                          b"y" * (api.http.max_body + 1) + b'"}')
    assert status == 413 and "larger than" in out["error"]["message"]
    # nested past the JSON parser's depth: not valid JSON, not a crash
    status, out = api.raw("POST", "/v1/completions", b"[" * 5000 + b"]" * 5000)
    assert status == 400 and "not valid JSON" in out["error"]["message"]


def test_loose_stream_flags_and_unreadable_bodies_are_400(api):
    body = {"model": api.model, "messages": CHAT, "max_tokens": 2}
    for extra, param in [({"stream": 1}, "stream"), ({"stream": 0}, "stream"),
                         ({"stream_options": {"include_usage": True}}, "stream_options"),
                         ({"stream": True, "stream_options": "yes"}, "stream_options"),
                         ({"stream": True, "stream_options": {"include_usage": "false"}},
                          "stream_options")]:
        status, out = api.raw("POST", "/v1/chat/completions", json.dumps(
            {**body, **extra}).encode())
        assert status == 400 and out["error"]["param"] == param, (extra, out)
    errors = api.served.service.metrics
    before = errors and errors.errors.labels(*errors.bound, "INTERNAL")._value.get()
    status, out = api.raw("POST", "/v1/chat/completions", json.dumps(body).encode(),
                          headers={"Content-Encoding": "gzip"})  # the bytes are no gzip
    assert status == 400 and "cannot be read" in out["error"]["message"], out
    assert not errors or errors.errors.labels(*errors.bound, "INTERNAL")._value.get() == before


def test_a_stalled_client_is_cut_off(smol_engine, monkeypatch):
    """A body that stops coming is a 408 after BODY_S; a connection that never sends a whole
    request is closed after IDLE_S: neither holds a descriptor for long."""
    import socket
    import time

    from router import openai_http

    monkeypatch.setattr(openai_http, "BODY_S", 0.5)
    monkeypatch.setattr(openai_http, "IDLE_S", 1.0)
    a = Api(smol_engine)
    try:
        with socket.create_connection(("127.0.0.1", a.port), timeout=30) as s:
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                      b"Content-Length: 1000\r\n\r\n{")
            assert s.recv(65536).startswith(b"HTTP/1.1 408")
        with socket.create_connection(("127.0.0.1", a.port), timeout=30) as s:
            t0 = time.monotonic()
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")  # and no more
            assert s.recv(65536) == b"" and time.monotonic() - t0 < 20
        assert a.raw("GET", "/health")[0] == 200
    finally:
        a.close()


def test_a_malformed_request_logs_no_traceback(api, caplog):
    import logging
    import socket

    with caplog.at_level(logging.DEBUG):
        with socket.create_connection(("127.0.0.1", api.port), timeout=30) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n")
            assert s.recv(65536).startswith(b"HTTP/1.")  # aiohttp's own 400
        assert api.raw("GET", "/health")[0] == 200
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    assert "a malformed request" in caplog.text


def test_unreadable_and_abandoned_bodies_log_no_traceback_and_count_no_fault(smol_engine,
                                                                            caplog,
                                                                            monkeypatch):
    """A body that does not follow its Content-Encoding: a 400 with one line of aiohttp's
    reason (aiohttp logged it again, with a traceback, as it discarded the rest); a client that
    hangs up before its body arrived: counted CANCELLED, not INTERNAL, and no traceback."""
    import logging
    import socket

    from engine.metrics import Metrics

    m = Metrics("router")
    api = Api(smol_engine, metrics=m)

    def count(code):
        return m.errors.labels(*m.bound, code)._value.get()

    try:
        with caplog.at_level(logging.DEBUG):
            status, out = api.raw("POST", "/v1/completions", b"not gzip at all",
                                  headers={"Content-Encoding": "gzip"})
            assert status == 400 and out["error"]["message"] == (
                "the request body cannot be read: Can not decode content-encoding: gzip"), out
            with socket.create_connection(("127.0.0.1", api.port), timeout=30) as s:
                s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                          b"application/json\r\nContent-Length: 500\r\n\r\n{\"prompt\": \"x\"")
            end = time.monotonic() + 30
            while not count("CANCELLED") and time.monotonic() < end:
                time.sleep(0.02)
            assert api.raw("GET", "/health")[0] == 200
            # From Python 3.12 the hang-up reaches the body's read as the handler's
            # cancellation: counted the same way.
            from aiohttp import web_request

            async def cancelled(self):
                raise asyncio.CancelledError

            monkeypatch.setattr(web_request.BaseRequest, "read", cancelled)
            with pytest.raises(Exception):  # noqa: B017 - the connection ends unanswered
                api.raw("POST", "/v1/completions", b"{}")
            monkeypatch.undo()
            assert api.raw("GET", "/health")[0] == 200
    finally:
        api.close()
    assert (count("CANCELLED"), count("INTERNAL"), count("INVALID_ARGUMENT")) == (2, 0, 1)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text


@pytest.mark.parametrize("path, field, param", [
    ("/v1/completions", '"prompt": "a\\ud800b"', "prompt"),
    ("/v1/completions", '"prompt": ["ok", "\\udfff"]', "prompt"),
    ("/v1/completions", '"prompt": "a", "stop": ["\\ud83d"]', "stop"),
    ("/v1/chat/completions", '"messages": [{"role": "user", "content": "\\ud83d!"}]',
     "messages"),
])
def test_lone_surrogates_are_400_naming_the_field(api, path, field, param):
    """JSON's escapes can spell half an emoji, which is no Unicode text."""
    body = f'{{"model": "{api.model}", "max_tokens": 2, {field}}}'.encode()
    status, out = api.raw("POST", path, body)
    assert status == 400 and out["error"]["param"] == param, out
    assert "lone surrogate" in out["error"]["message"]


def test_a_server_fault_is_a_500_in_openais_shape(api, monkeypatch):
    import router.openai_http as http

    def broken(*_a, **_k):
        raise RuntimeError("broken converter")

    monkeypatch.setattr(http, "completion_requests", broken)
    status, out = api.raw("POST", "/v1/completions", json.dumps(
        {"model": api.model, "prompt": "hi"}).encode())
    assert status == 500 and out["error"]["type"] == "server_error", out
    assert "broken" not in out["error"]["message"]  # the log has it, not the client
    status, _ = api.raw("GET", "/v1/models")  # the server goes on
    assert status == 200


def test_a_prompt_past_the_context_is_openais_context_length_exceeded(api):
    with pytest.raises(openai.BadRequestError) as e:
        api.client().completions.create(model=api.model, prompt=[1] * 9000, max_tokens=2)
    assert e.value.code == "context_length_exceeded" and "the context holds" in str(e.value)
    assert e.value.param == "prompt"
    with pytest.raises(openai.BadRequestError) as e:
        api.client().chat.completions.create(model=api.model, max_tokens=2, messages=[
            {"role": "user", "content": "seven " * 9000}])
    assert e.value.code == "context_length_exceeded" and e.value.param == "messages"


def test_a_request_id_header_that_is_no_utf8_is_a_400(api):
    status, out = api.raw("POST", "/v1/completions", json.dumps(
        {"model": api.model, "prompt": "hi", "max_tokens": 2}).encode(),
        headers={"X-Request-Id": "r\xff1"})
    assert status == 400 and out["error"]["param"] == "X-Request-Id", out


def test_bearer_tokens_are_the_grpc_ports(smol_engine):
    auth = BearerAuth(["s3cret"])
    a = Api(smol_engine, auth=auth)
    try:
        with pytest.raises(openai.AuthenticationError) as e:
            a.client("wrong").models.list()
        assert e.value.status_code == 401
        assert a.raw("GET", "/health")[0] == 200  # probes need no secret
        out = a.client("s3cret").completions.create(model=a.model, prompt=[1, 2, 3],
                                                    max_tokens=2, temperature=0)
        assert out.usage.completion_tokens == 2 and auth.refused == 1
        # header bytes that are no UTF-8 (they arrive as surrogates): refused, not a 500
        assert a.raw("GET", "/v1/models", headers={"Authorization": "Bearer s3cr\xff"})[0] == 401
    finally:
        a.close()


def test_a_full_queue_is_429_and_a_hang_up_frees_the_engine(smol_engine):
    a = Api(smol_engine, admission=Admission(1, 0, 5.0))
    try:
        c = a.client()
        stream = c.completions.create(model=a.model, prompt="Count: 1, 2, 3,", max_tokens=400,
                                      temperature=0, stream=True,
                                      extra_body={"ignore_eos": True})
        next(iter(stream))  # it runs: the one slot is taken
        with pytest.raises(openai.RateLimitError) as e:
            c.completions.create(model=a.model, prompt="hi", max_tokens=2)
        assert e.value.status_code == 429
        stream.close()  # the client hangs up mid-stream
        end = time.monotonic() + 60
        while smol_engine.seqs and time.monotonic() < end:
            time.sleep(0.02)
        assert not smol_engine.seqs
        smol_engine.blocks.check_all_free()
        out = c.completions.create(model=a.model, prompt="hi", max_tokens=2, temperature=0)
        assert out.usage.completion_tokens == 2  # the slot came back
    finally:
        a.close()


def test_the_request_bounds_name_the_http_fields(api):
    """The gRPC request's bounds (`router.limits`), met through the HTTP door, name the
    OpenAI field the value came in (stop, not sampling.stop) in the message and as param."""
    c = api.client()
    for kw, param, start in [
            ({"stop": [f"s{i}" for i in range(17)]}, "stop", "stop has 17 strings"),
            ({"stop": ["x" * 600]}, "stop", "stop[0] has 600 characters"),
            ({"messages": CHAT * 513}, "messages", "messages has 513 messages"),
            ({"messages": [{"role": "user", "content": "x" * 200_000}] * 2}, "messages",
             "messages' content has 400000 characters")]:
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(**{"model": api.model, "messages": CHAT,
                                         "max_tokens": 1, **kw})
        assert e.value.body["param"] == param and e.value.body["message"].startswith(start), \
            e.value.body
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model=api.model, prompt="x" * 300_000, max_tokens=1)
    assert e.value.body["param"] == "prompt"
    assert e.value.body["message"].startswith("prompt has 300000")


def test_a_request_id_header_keeps_room_for_the_choices_suffixes(api):
    """Choice i of n runs as "<X-Request-Id>-i": the header's limit leaves room for that, and
    the refusal names the header and the size the client sent."""
    body = json.dumps({"model": api.model, "prompt": "hi", "max_tokens": 1, "n": 2}).encode()
    status, out = api.raw("POST", "/v1/completions", body, headers={"X-Request-Id": "r" * 191})
    assert status == 400 and out["error"]["message"] == (
        "X-Request-Id has 191 bytes; the limit is 190 for 2 choice(s)"), out
    status, out = api.raw("POST", "/v1/completions", body, headers={"X-Request-Id": "r" * 190})
    assert status == 200 and len(out["choices"]) == 2, out
    status, out = api.raw("POST", "/v1/completions", body, headers={"X-Request-Id": "a\tb"})
    assert status == 400 and out["error"]["message"].startswith("X-Request-Id holds"), out


def test_more_choices_than_the_server_admits_at_once_is_a_400_naming_n(smol_engine):
    """Each choice is a request of its own: n past what one client may have running or
    queued would always end in a 429, so it is refused as a bad request instead."""
    a = Api(smol_engine, admission=Admission(8, max_queued=8, per_client=2))
    try:
        c = a.client()
        out = c.completions.create(model=a.model, prompt="hi", max_tokens=2, n=2)
        assert len(out.choices) == 2
        with pytest.raises(openai.BadRequestError) as e:
            c.completions.create(model=a.model, prompt="hi", max_tokens=2, n=3)
        assert e.value.body["param"] == "n" and "at most 2 requests" in e.value.message
        with pytest.raises(openai.BadRequestError) as e:  # three prompts, one choice each
            c.completions.create(model=a.model, prompt=["a", "b", "c"], max_tokens=2)
        assert e.value.body["param"] == "prompt"
        smol_engine.blocks.check_all_free()
    finally:
        a.close()
    a = Api(smol_engine, admission=Admission(1, 0, 5.0))  # one running, none queued
    try:
        with pytest.raises(openai.BadRequestError) as e:
            a.client().chat.completions.create(model=a.model, messages=CHAT, max_tokens=2, n=2)
        assert "at most 1 requests in all" in e.value.message
    finally:
        a.close()


def test_refusals_before_the_servicer_are_counted(smol_engine):
    from prometheus_client.parser import text_string_to_metric_families

    from engine.metrics import Metrics

    m = Metrics("router")
    a = Api(smol_engine, metrics=m)
    try:
        assert a.raw("POST", "/v1/completions", b"{not json")[0] == 400
        assert a.raw("POST", "/v1/completions", json.dumps(
            {"model": "other", "prompt": "hi"}).encode())[0] == 404
        assert a.raw("GET", "/v1/nowhere")[0] == 404
        fams = {f.name: f for f in text_string_to_metric_families(m.exposition().decode())}
        codes = {s.labels["code"]: s.value for s in fams["tandem_request_errors"].samples
                 if s.name.endswith("_total")}
        assert codes == {"INVALID_ARGUMENT": 1.0, "NOT_FOUND": 2.0}
    finally:
        a.close()

"""Fuzzing the public API of a real disaggregated server (Ray prefill and decode actors, KV over
UCX): GenerateRequests over every field, and raw bytes that may not even parse, each call ending
only in OK, INVALID_ARGUMENT, RESOURCE_EXHAUSTED or UNAUTHENTICATED. Afterwards the server is
healthy, a fixed greedy request gives what it gave before, and no KV block is in use.

Each run sends the same inputs: first fixed ones (every field out of its bounds in an otherwise
valid request, every long or malformed shape the strategies know), then the draws.
Every failing input is collected (not shrunk): the assertion lists them all, input -> status."""

from __future__ import annotations

import math
from collections import Counter

import pytest

pytest.importorskip("ray")
pytest.importorskip("ucxx")
pytest.importorskip("hypothesis")

import grpc  # noqa: E402
from hypothesis import HealthCheck, Phase, example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from cluster import soak  # noqa: E402
from tandem_client import Client  # noqa: E402
from tandem_proto.v1 import generation_pb2 as pb  # noqa: E402
from tandem_proto.v1 import generation_pb2_grpc as pb_grpc  # noqa: E402

GEN = "/tandem.v1.Generation/Generate"
ALLOWED = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT,
           grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAUTHENTICATED}
CALL_TIMEOUT_S = 30.0  # past this a call counts as hung (DEADLINE_EXCEEDED)
READ_AT_MOST = 2  # responses read from a stream that was accepted, then it is cancelled
VOCAB = 49152  # SmolLM2's; ids at and past it are out of range
GREEDY = {"messages": [{"role": "user", "content": "Name three primary colours."}],
          "temperature": 0, "max_tokens": 16}


def fuzz_settings(n: int):
    """`n` examples, reproducible, no example database written into the checkout, no
    shrinking (failures are collected, not raised)."""
    return settings(max_examples=n, deadline=None, database=None, derandomize=True,
                    phases=[Phase.explicit, Phase.generate],
                    suppress_health_check=list(HealthCheck))


# --- strategies ---------------------------------------------------------------------------

U32 = st.one_of(st.integers(0, 2**32 - 1),
                st.sampled_from([0, 1, 2, VOCAB - 1, VOCAB, 2**31, 2**32 - 1]))
U64 = st.one_of(st.integers(0, 2**64 - 1), st.sampled_from([0, 2**63 - 1, 2**63, 2**64 - 1]))
FLOATS = st.one_of(st.floats(), st.sampled_from(
    [0.0, -0.0, 1.0, 0.5, 1e-300, 5e-324, -1.0, 1e308, math.nan, math.inf, -math.inf]))
CHARS = st.characters(blacklist_categories=("Cs",))  # lone surrogates do not serialize
# Long strings of one character (newlines, NULs, multi-byte, a special token's spelling),
# from just past a limit up to past gRPC's 4 MiB message limit.
HUGE_CHARS = ["a", "\n", "\x00", "é", "🙂", "<|im_start|>", "\u202e"]
HUGE_LENGTHS = [257, 600, 5_000, 300_000, 5_000_000]
HUGE_TEXT = st.builds(lambda s, n: s * n, st.sampled_from(HUGE_CHARS),
                      st.sampled_from(HUGE_LENGTHS))
TEXT = st.one_of(st.text(CHARS, max_size=40), HUGE_TEXT,
                 st.sampled_from(["", " ", "\n", "\r\n", "\x1b[31m", "<|im_end|>", "a\nb"]))
LONG_IDS = [2047, 2048, 70_000, 1 << 20, (1 << 20) + 1]  # about max_model_len, and far past
IDS = st.one_of(
    st.lists(st.one_of(st.integers(0, VOCAB - 1), U32), max_size=24),
    st.builds(lambda v, n: [v] * n, st.sampled_from([0, 1, 2, VOCAB - 1, VOCAB, 2**32 - 1]),
              st.sampled_from(LONG_IDS)))
ROLES = st.one_of(st.sampled_from(["system", "user", "assistant", "tool", "", "User",
                                   "bot", "user\n", "r" * 40]), st.text(CHARS, max_size=8))
MANY_MESSAGES = [513, 5_000]
MESSAGES = st.one_of(
    st.lists(st.builds(pb.ChatMessage, role=ROLES, content=TEXT), max_size=4),
    st.builds(lambda n: [pb.ChatMessage(role="user", content="hi")] * n,
              st.sampled_from(MANY_MESSAGES)))


@st.composite
def sampling(draw) -> pb.SamplingParams:
    s = pb.SamplingParams()
    for name, values in (("temperature", FLOATS), ("top_p", FLOATS), ("seed", U64),
                         ("max_tokens", st.one_of(U32, st.integers(0, 4)))):
        if draw(st.booleans()):
            setattr(s, name, draw(values))
    s.top_k = draw(st.one_of(st.just(0), U32))
    s.stop.extend(draw(st.lists(TEXT, max_size=3) | st.just(["x"] * 17)))
    s.stop_token_ids.extend(draw(st.lists(U32, max_size=3) | st.just([5] * 65)))
    s.ignore_eos = draw(st.booleans())
    return s


@st.composite
def wild(draw) -> pb.GenerateRequest:
    """A GenerateRequest with every field drawn, in or out of its bounds."""
    req = pb.GenerateRequest(request_id=draw(st.one_of(st.just(""), TEXT)))
    kind = draw(st.sampled_from(["none", "text", "chat", "token_ids"]))
    if kind == "text":
        req.text = draw(TEXT)
    elif kind == "chat":
        req.chat.messages.extend(draw(MESSAGES))
    elif kind == "token_ids":
        req.token_ids.ids.extend(draw(IDS))
    if draw(st.booleans()):
        req.sampling.CopyFrom(draw(sampling()))
    if draw(st.booleans()):
        req.speculation.method = draw(st.sampled_from([0, 1, 2, 3, 4, 99, -1, 2**31 - 1]))
        if draw(st.booleans()):
            req.speculation.num_tokens = draw(U32)
    if draw(st.booleans()):
        req.continuation.token_ids.extend(draw(IDS))
        req.continuation.text_length = draw(U32)
    return req


@st.composite
def valid(draw) -> pb.GenerateRequest:
    """A request the server should serve: a short prompt, sane sampling, a few tokens."""
    short = st.text(CHARS, min_size=1, max_size=60)
    req = pb.GenerateRequest(request_id=draw(st.just("") | st.text(CHARS.filter(
        str.isprintable), min_size=1, max_size=20)))
    kind = draw(st.sampled_from(["text", "chat", "token_ids"]))
    if kind == "text":
        req.text = draw(short)
    elif kind == "chat":
        req.chat.messages.extend(draw(st.lists(st.builds(pb.ChatMessage, role=st.sampled_from(
            ["system", "user", "assistant"]), content=short), min_size=1, max_size=3)))
    else:
        req.token_ids.ids.extend(draw(st.lists(st.integers(0, VOCAB - 1), min_size=1,
                                               max_size=64)))
    s = req.sampling
    s.temperature = draw(st.sampled_from([0.0, 0.7, 1.0]) | st.floats(0, 2))
    s.top_p = draw(st.floats(0.01, 1.0))
    s.top_k = draw(st.integers(0, 100))
    s.seed = draw(st.integers(0, 2**63 - 1))
    s.max_tokens = draw(st.integers(1, 8))
    s.stop.extend(draw(st.lists(short, max_size=2)))
    s.stop_token_ids.extend(draw(st.lists(st.integers(0, VOCAB - 1), max_size=2)))
    s.ignore_eos = draw(st.booleans())
    if draw(st.booleans()):
        req.speculation.method = draw(st.sampled_from([0, 1, 2]))
        req.speculation.num_tokens = draw(st.integers(0, 8))
    if s.max_tokens > 1 and draw(st.booleans()):
        req.continuation.token_ids.extend(draw(st.lists(st.integers(0, VOCAB - 1), min_size=1,
                                                        max_size=s.max_tokens - 1)))
        req.continuation.text_length = draw(st.integers(0, 20))
    return req


def _one_field(req: pb.GenerateRequest, other: pb.GenerateRequest, name: str) -> None:
    """Give `req` the field `name` (the prompt, a top-level field or sampling.<field>) of
    `other`, set or unset as it is there."""
    src, dst = (other.sampling, req.sampling) if name.startswith("sampling.") else (other, req)
    names = ("text", "chat", "token_ids") if name == "prompt" else (name.split(".")[-1],)
    for n in names:
        dst.ClearField(n)
    for f, v in src.ListFields():
        if f.name not in names:
            continue
        if hasattr(v, "extend"):  # repeated
            getattr(dst, f.name).extend(v)
        elif hasattr(v, "ListFields"):  # a message
            getattr(dst, f.name).CopyFrom(v)
        else:
            setattr(dst, f.name, v)


FIELDS = ["request_id", "prompt", "speculation", "continuation",
          *(f"sampling.{f.name}" for f in pb.SamplingParams.DESCRIPTOR.fields)]


@st.composite
def near_valid(draw) -> pb.GenerateRequest:
    """A valid request with one field taken from a wild one: reaches the paths behind the
    first check a request that is wrong in many ways stops at."""
    req = draw(valid())
    _one_field(req, draw(wild()), draw(st.sampled_from(FIELDS)))
    return req


def requests():
    return st.one_of(wild(), near_valid(), valid())


# A value out of its bounds for each of FIELDS (the sampling fields by their names, so a new
# field fails here until it has one).
_SAMPLING_OUT = {"temperature": math.nan, "top_p": -1.0, "top_k": 2**32 - 1, "seed": 2**64 - 1,
                 "max_tokens": 2**32 - 1, "stop": ["x"] * 17, "stop_token_ids": [5] * 65,
                 "ignore_eos": True}


def _out_of_bounds(name: str) -> pb.GenerateRequest:
    """A request whose field `name` (as FIELDS names it) holds a value out of its bounds."""
    if name.startswith("sampling."):
        key = name.split(".", 1)[1]
        s, value = pb.SamplingParams(), _SAMPLING_OUT[key]
        if isinstance(value, list):
            getattr(s, key).extend(value)
        else:
            setattr(s, key, value)
        return pb.GenerateRequest(sampling=s)
    return {"request_id": pb.GenerateRequest(request_id="\x00" * 600),
            "prompt": pb.GenerateRequest(text="a" * 300_000),
            "speculation": pb.GenerateRequest(speculation=pb.Speculation(
                method=99, num_tokens=2**32 - 1)),
            "continuation": pb.GenerateRequest(continuation=pb.Continuation(
                token_ids=[VOCAB, 2**32 - 1], text_length=2**32 - 1)),
            }[name]


def request_examples() -> list[pb.GenerateRequest]:
    """Inputs every run sends besides the drawn ones: each of FIELDS out of bounds in an
    otherwise valid request, the empty request, and every long shape the strategies draw from
    (each long text length, each character, each long id list, each long chat)."""
    out = [pb.GenerateRequest()]
    for name in FIELDS:
        req = pb.GenerateRequest(text="Once upon a time",
                                 sampling=pb.SamplingParams(temperature=0, max_tokens=4))
        _one_field(req, _out_of_bounds(name), name)
        out.append(req)
    out += [pb.GenerateRequest(text=c * HUGE_LENGTHS[i % len(HUGE_LENGTHS)])
            for i, c in enumerate(HUGE_CHARS)]
    out += [pb.GenerateRequest(token_ids=pb.TokenIds(ids=[VOCAB - 1] * n)) for n in LONG_IDS]
    out += [pb.GenerateRequest(chat=pb.ChatMessages(
        messages=[pb.ChatMessage(role="user", content="hi")] * n)) for n in MANY_MESSAGES]
    return out


def _garbage_of(req: pb.GenerateRequest, cut: int) -> bytes:
    """A valid request's bytes cut short (a length that runs past the end)."""
    data = req.SerializeToString()
    return data[: max(0, len(data) - cut)]


MALFORMED = [
    b"", b"\xff" * 16, b"\x0a\x01\xff",  # request_id that is not UTF-8
    b"\x12\x02\xc3\x28",  # text: invalid UTF-8
    b"\x22\x03\x0a\x01\x80",  # token_ids holding a truncated varint
    b"\x0a\xff\xff\xff\xff\x0f",  # a length past the end
    b"\x1a" + b"\x80" * 10 + b"\x01",  # an overlong varint length
    b"\x2a\x05\x09" + b"\x00" * 4,  # sampling: a double cut short
    (b"\x1a\x02\x0a\x00") * 1000,  # many empty chat messages
    b"\x38\x01",  # field 7 (continuation) with the wrong wire type
    b"\x78\x01" * 10_000,  # an unknown field, many times
    b"\x00" * (5 << 20),  # past gRPC's 4 MiB
]
GARBAGE = st.one_of(st.binary(max_size=64), st.builds(_garbage_of, wild(), st.integers(1, 8)),
                    st.sampled_from(MALFORMED))


# --- calls --------------------------------------------------------------------------------


def status_of(call) -> tuple[grpc.StatusCode, str]:
    """Read a server-streaming call's first responses (then cancel it: accepted is OK) and
    return its status and details."""
    try:
        for i, _ in enumerate(call, 1):
            if i >= READ_AT_MOST:
                call.cancel()
                return grpc.StatusCode.OK, ""
        return call.code(), call.details() or ""
    except grpc.RpcError as e:
        return e.code(), e.details() or ""


def describe(msg, limit: int = 300) -> str:
    """A one-line account of a message's set fields, long values given by size."""
    def value(v) -> str:
        if hasattr(v, "ListFields"):
            return "{" + ", ".join(f"{f.name}={value(x)}" for f, x in v.ListFields()) + "}"
        if isinstance(v, (str, bytes)) and len(v) > 24:
            return f"<{len(v)} {'chars' if isinstance(v, str) else 'bytes'} {v[:12]!r}…>"
        if not isinstance(v, (str, bytes, int, float, bool)):  # repeated
            items = list(v)
            if len(items) > 6 or any(hasattr(x, "ListFields") for x in items):
                head = ", ".join(value(x) for x in items[:2])
                return f"<{len(items)} items: {head}…>"
            return repr(items)
        return repr(v)
    text = value(msg) if hasattr(msg, "ListFields") else value(bytes(msg))
    return text if len(text) <= limit else text[: limit - 1] + "…"


def report(failures: list[tuple[str, str, str]]) -> str:
    lines = [f"{len(failures)} calls ended outside {sorted(c.name for c in ALLOWED)}:"]
    lines += [f"  {what} -> {code}: {details[:160]!r}" for what, code, details in failures[:40]]
    return "\n".join(lines)


# --- tests --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def served(served_cluster):
    with Client(served_cluster.target, timeout=120) as c:  # before any fuzz: what it gives
        served_cluster.greedy_before = c.complete(**GREEDY)
    return served_cluster


@pytest.fixture(scope="module")
def channel(served):
    with grpc.insecure_channel(served.target) as ch:
        yield ch


def inert(details: str) -> bool:
    """An error's details as the server may send them: one short line, nothing of its
    internals (tracebacks, pids, addresses, terminal codes)."""
    return len(details) <= 300 and not any(
        bad in details for bad in ("\n", "\x1b", "Traceback", 'File "', "pid=", "ip="))


def fuzz(strategy, n: int, call, examples=()) -> list[tuple[str, str, str]]:
    """`examples`, then `n` inputs drawn from `strategy`, each sent with `call`; the (input,
    status, details) of those that ended outside ALLOWED or with details that are not `inert`.
    Prints how many ended in each status."""
    failures, tally = [], Counter()

    def one(x):
        code, details = status_of(call(x, timeout=CALL_TIMEOUT_S))
        tally[code.name] += 1
        if code not in ALLOWED or not inert(details):
            failures.append((describe(x), code.name, details))

    for x in examples:
        one = example(x)(one)
    fuzz_settings(n)(given(strategy)(one))()
    print(dict(tally))
    assert sum(tally.values()) >= len(examples) + n // 2, tally  # the draws were sent too
    return failures


def test_fuzzed_requests_end_in_an_allowed_status(channel):
    failures = fuzz(requests(), 50, pb_grpc.GenerationStub(channel).Generate,
                    request_examples())
    assert not failures, report(failures)


def test_garbage_bytes_end_in_an_allowed_status(channel):
    raw = channel.unary_stream(GEN, request_serializer=None, response_deserializer=None)
    failures = fuzz(GARBAGE, 100, raw, MALFORMED)
    assert not failures, report(failures)


def test_a_request_id_is_free_again_once_its_call_was_cancelled(channel):
    """Found by the fuzz (it draws one request id in several examples in a row): a call
    cancelled after its first responses, then the same request again under the same id. The
    id is no longer in flight for the caller, so every call is served."""
    stub = pb_grpc.GenerationStub(channel)
    req = pb.GenerateRequest(request_id="fuzz-reused-id", text="Once upon a time",
                             sampling=pb.SamplingParams(temperature=0, max_tokens=8))
    got = [status_of(stub.Generate(req, timeout=CALL_TIMEOUT_S)) for _ in range(6)]
    assert all(code == grpc.StatusCode.OK for code, _ in got), [
        f"{code.name}: {details[:120]}" for code, details in got]


# Last in this file: what the fuzz left behind.
def test_after_the_fuzz_the_server_serves_as_before(served):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(served.target) as ch:
        health = health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service="tandem.v1.Generation"), timeout=10)
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    with Client(served.target, timeout=120) as c:
        after = c.complete(**GREEDY)
    before = served.greedy_before
    assert (after.token_ids, after.text) == (before.token_ids, before.text)
    stats = soak.settled_stats(served.cluster)
    assert all(s["blocks_free"] == s["blocks_total"] and s["running"] == 0 for s in stats), stats

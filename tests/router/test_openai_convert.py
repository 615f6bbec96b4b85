"""`router.openai_convert` on its own: each OpenAI sampling field lands in the GenerateRequest
the gRPC path runs, with OpenAI's defaults where a body leaves a field out, and each gRPC
status becomes one HTTP status and OpenAI error type."""

from __future__ import annotations

import grpc
import pytest

from router.openai_convert import ApiError, chat_requests, completion_requests

CHAT = [{"role": "user", "content": "hi"}]


def test_sampling_fields_reach_the_request():
    (req,) = chat_requests({"messages": CHAT, "temperature": 0.7, "top_p": 0.9, "seed": -1,
                            "stop": ["\n\n", "END"], "max_tokens": 5,
                            "max_completion_tokens": 9}, "r1", 2048)
    s = req.sampling
    assert (s.temperature, s.top_p) == (0.7, 0.9)
    assert s.seed == (1 << 63) - 1  # a signed 64-bit seed, taken modulo 2**63 (the engine's range)
    assert list(s.stop) == ["\n\n", "END"]
    assert s.max_tokens == 9  # max_completion_tokens wins over the older max_tokens
    assert req.request_id == "r1" and req.chat.messages[0].content == "hi"
    (one,) = completion_requests({"prompt": "x", "stop": "END"}, "r2", 2048)
    assert list(one.sampling.stop) == ["END"]


def test_any_signed_64_bit_seed_maps_into_the_engines_range():
    top = (1 << 63) - 1
    reqs = completion_requests({"prompt": "x", "seed": top, "n": 2}, "r", 2048)
    assert [r.sampling.seed for r in reqs] == [top, 0]  # choice i: seed + i, wrapped
    (low,) = completion_requests({"prompt": "x", "seed": -(1 << 63)}, "r", 2048)
    assert low.sampling.seed == 0
    with pytest.raises(ApiError, match="64-bit") as e:
        completion_requests({"prompt": "x", "seed": -(1 << 63) - 1}, "r", 2048)
    assert e.value.param == "seed"


@pytest.mark.parametrize("body, param, echoed", [
    ({"max_tokens": 2.0}, "max_tokens", "got 2.0"),
    ({"max_tokens": "5"}, "max_tokens", 'got "5"'),
    ({"max_tokens": -(10 ** 80)}, "max_tokens", "got -100000"),
    ({"n": 10 ** 300}, "n", "n=100000"),
    ({"temperature": "hot"}, "temperature", 'got "hot"'),
    ({"response_format": {"type": "json_object"}}, "response_format",
     'response_format "json_object" is not'),
    ({"messages": [{"role": "user", "content": "hi"}], "prompt": None, "seed": 2.5}, "seed",
     "got 2.5"),
    ({"prompt": [[1, "two"]]}, "prompt[0]", 'holds "two"'),
])
def test_refused_values_are_echoed_as_their_json_cut_short(body, param, echoed):
    """A refused value is echoed as the JSON it was sent as (2.0, "5"), not quoted twice as
    if a string had been sent, and cut to a few dozen characters however long it is."""
    convert = chat_requests if "response_format" in body or "messages" in body \
        else completion_requests
    with pytest.raises(ApiError) as e:
        convert({"prompt": "x", "messages": CHAT, **body}, "r", 2048)
    assert e.value.param == param and echoed in str(e.value), str(e.value)
    assert len(str(e.value)) < 120


def test_openais_defaults_of_unsupported_fields_pass_and_the_rest_are_refused():
    """best_of equal to n (OpenAI's default 1) makes no choice among draws; a completions
    logprobs of 0 asks for the chosen tokens' logprobs, which this server does not give."""
    assert len(completion_requests({"prompt": "x", "best_of": 1}, "r", 2048)) == 1
    assert len(completion_requests({"prompt": "x", "best_of": 3, "n": 3}, "r", 2048)) == 3
    assert len(chat_requests({"messages": CHAT, "logprobs": False}, "r", 2048)) == 1
    for body, param in [({"best_of": 2}, "best_of"), ({"best_of": True}, "best_of"),
                        ({"best_of": 1, "n": 3}, "best_of"), ({"logprobs": 0}, "logprobs"),
                        ({"logprobs": 0.0}, "logprobs"), ({"logprobs": 3}, "logprobs")]:
        with pytest.raises(ApiError) as e:
            completion_requests({"prompt": "x", **body}, "r", 2048)
        assert e.value.param == param and "not supported" in str(e.value)


def test_left_out_fields_take_openais_defaults():
    (chat,) = chat_requests({"messages": CHAT}, "r", 2048)
    (text,) = completion_requests({"prompt": "x"}, "r", 2048)
    assert chat.sampling.max_tokens == 2048 and text.sampling.max_tokens == 16
    for req in (chat, text):
        assert not req.sampling.HasField("seed") and not req.sampling.stop
        assert not req.sampling.HasField("temperature") and not req.sampling.HasField("top_p")


@pytest.mark.parametrize("code, status, kind", [
    (grpc.StatusCode.INVALID_ARGUMENT, 400, "invalid_request_error"),
    (grpc.StatusCode.UNAUTHENTICATED, 401, "authentication_error"),
    (grpc.StatusCode.PERMISSION_DENIED, 403, "permission_error"),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, 429, "rate_limit_error"),
    (grpc.StatusCode.UNAVAILABLE, 503, "service_unavailable_error"),
    (grpc.StatusCode.DEADLINE_EXCEEDED, 504, "timeout_error"),
    (grpc.StatusCode.INTERNAL, 500, "server_error"),
])
def test_a_grpc_status_is_one_http_status_and_error_type(code, status, kind):
    err = ApiError.of_status(code, "why")
    assert err.status == status
    assert err.body() == {"error": {"message": "why", "type": kind, "param": None,
                                    "code": code.name.lower()}}

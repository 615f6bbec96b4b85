"""Argument shapes, response conversion, error mapping and retry policy: no server needed."""

from __future__ import annotations

import grpc
import pytest

from tandem_client import (
    Chunk,
    Client,
    Completion,
    InvalidArgumentError,
    RequestCancelledError,
    TandemError,
)
from tandem_client._retry import Deadline, RetryPolicy
from tandem_client.errors import error_for
from tandem_proto.v1 import generation_pb2 as pb


@pytest.fixture
def client():
    with Client("127.0.0.1:1") as c:  # never dialled: building a request makes no call
        yield c


@pytest.mark.parametrize("kw", [{}, {"prompt": "a", "token_ids": [1]},
                                {"prompt": ["a", "b"]}, {"messages": [{"text": "hi"}]}])
def test_a_prompt_of_the_wrong_shape_is_a_type_error_at_call_time(client, kw):
    prompt = kw.pop("prompt", None)
    with pytest.raises(TypeError):
        client.generate(prompt, **kw)


@pytest.mark.parametrize("kw, error, says", [
    ({"seed": -(1 << 63) - 1}, ValueError, "seed: "), ({"seed": 1 << 64}, ValueError, "seed: "),
    ({"max_tokens": -1}, ValueError, "max_tokens: "), ({"top_k": -1}, ValueError, "top_k: "),
    ({"max_tokens": 1 << 32}, ValueError, "max_tokens: "),
    ({"stop_token_ids": [3, -1]}, ValueError, "stop_token_ids: "),
    ({"token_ids": [-1]}, ValueError, "token_ids: "),
    ({"num_speculative_tokens": -1}, ValueError, "num_speculative_tokens: "),
    ({"stop": ["ok", "a\ud800"]}, ValueError, "stop: "),
    ({"prompt": "a\ud800"}, ValueError, "prompt: "),
    ({"messages": [{"role": "user", "content": "x\ud800"}]}, ValueError, "messages[0]: "),
    ({"request_id": "r\ud800"}, ValueError, "request_id: "),
    ({"temperature": True}, TypeError, "temperature must be a number"),
    ({"top_k": "3"}, TypeError, "top_k: ")])
def test_values_the_wire_cannot_carry_name_their_argument(client, kw, error, says):
    kw = {"prompt": "x"} | kw if "messages" not in kw and "token_ids" not in kw else kw
    with pytest.raises(error) as e:
        client.generate(kw.pop("prompt", None), **kw)
    assert str(e.value).startswith(says), str(e.value)


def test_a_signed_seed_travels_as_the_openai_door_maps_it():
    from tandem_client._request import sampling_params

    none = dict.fromkeys(["temperature", "top_p", "top_k", "max_tokens", "stop",
                          "stop_token_ids", "ignore_eos"])
    assert sampling_params(seed=-1, **none).seed == (1 << 63) - 1
    assert sampling_params(seed=-(1 << 63), **none).seed == 0
    assert sampling_params(seed=7, **none).seed == 7


def test_unknown_speculation_method_is_a_value_error(client):
    with pytest.raises(ValueError, match="eagle3"):
        client.generate("x", speculation="medusa")


def test_an_unknown_finish_reason_from_a_newer_server_still_ends_the_stream():
    assert Chunk.from_pb(pb.GenerateResponse(finish_reason=99)).finish_reason == "error"
    assert Chunk.from_pb(pb.GenerateResponse()).finish_reason is None


def test_joining_no_chunks_gives_an_empty_unfinished_completion():
    assert Completion.join([]) == Completion("", (), None, None, "")


def test_status_codes_map_to_exception_classes():
    assert type(error_for(grpc.StatusCode.INVALID_ARGUMENT)) is InvalidArgumentError
    assert type(error_for(grpc.StatusCode.CANCELLED, "bye")) is RequestCancelledError
    rare = error_for(grpc.StatusCode.DATA_LOSS, "oops")
    assert type(rare) is TandemError and rare.code == grpc.StatusCode.DATA_LOSS
    assert str(rare) == "DATA_LOSS: oops"


def test_retry_policy_retries_unavailable_only_and_never_past_the_deadline():
    policy, forever = RetryPolicy(retries=2, backoff=0.1, max_backoff=0.15), Deadline(None)
    delays = [policy.delay(grpc.StatusCode.UNAVAILABLE, a, forever) for a in range(3)]
    assert 0.05 <= delays[0] <= 0.1 and 0.075 <= delays[1] <= 0.15 and delays[2] is None
    assert policy.delay(grpc.StatusCode.INTERNAL, 0, forever) is None
    assert policy.delay(grpc.StatusCode.UNAVAILABLE, 0, Deadline(0.01)) is None


def test_channel_reconnects_as_fast_as_the_policy_retries_unless_overridden():
    opts = dict(RetryPolicy(backoff=0.05, max_backoff=1.0).channel_options([]))
    assert opts == {"grpc.initial_reconnect_backoff_ms": 50, "grpc.max_reconnect_backoff_ms": 1000}
    mine = RetryPolicy().channel_options([("grpc.initial_reconnect_backoff_ms", 7)])
    assert [v for k, v in mine if k == "grpc.initial_reconnect_backoff_ms"] == [7]

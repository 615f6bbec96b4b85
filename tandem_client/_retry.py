"""When to try a call again, and the deadline that bounds all of its attempts."""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from tandem_proto.v1 import generation_pb2 as pb


@dataclass(frozen=True)
class RetryPolicy:
    """Exponential backoff with jitter, on UNAVAILABLE only.

    UNAVAILABLE means the request was not taken or its server went away, so retrying cannot run
    it twice. Once output arrived, the next attempt continues the stream (`Progress`), or, with
    resuming off, retrying stops so tokens are not generated again.
    """

    retries: int = 3  # attempts after the first
    backoff: float = 0.1  # seconds before the first retry
    max_backoff: float = 2.0
    multiplier: float = 2.0

    def __post_init__(self) -> None:
        if self.retries < 0 or self.backoff < 0 or self.max_backoff < self.backoff:
            raise ValueError(f"bad retry policy: {self}")

    def delay(self, code: grpc.StatusCode | None, attempt: int, deadline: Deadline) -> float | None:
        """Seconds to wait after failed attempt number `attempt` (0-based), or None: give up."""
        if code != grpc.StatusCode.UNAVAILABLE or attempt >= self.retries:
            return None
        base = min(self.max_backoff, self.backoff * self.multiplier**attempt)
        # Jitter spreads out the clients a restarting server turned away all at once.
        wait = base * random.uniform(0.5, 1.0)
        left = deadline.remaining()
        return None if left is not None and left <= wait else wait

    def channel_options(self, extra: Sequence[tuple[str, Any]]) -> list[tuple[str, Any]]:
        """Channel arguments: reconnect no slower than this policy retries, then `extra`.

        gRPC fails calls at once while its channel waits to reconnect (1 s at first, growing to
        2 min), so retries of a fail-fast call against a restarting server would all be spent in
        that wait. Keeping the channel's reconnect backoff within ours makes each retry a real try.
        """
        ms = max(1, int(self.backoff * 1000))
        # Not grpc.min_reconnect_backoff_ms: despite its name it is the connect timeout (20 s).
        own = [("grpc.initial_reconnect_backoff_ms", ms),
               ("grpc.max_reconnect_backoff_ms", max(ms, int(self.max_backoff * 1000)))]
        names = {k for k, _ in extra}
        return [kv for kv in own if kv[0] not in names] + list(extra)


class Deadline:
    """One deadline for a call and all its retries (a `timeout` is per call, not per attempt)."""

    def __init__(self, timeout: float | None) -> None:
        self._at = None if timeout is None else time.monotonic() + timeout

    def remaining(self) -> float | None:
        """Seconds left (never negative), or None: no deadline."""
        return None if self._at is None else max(0.0, self._at - time.monotonic())


class Progress:
    """What one stream has received, so that a call that broke off can be continued by the next
    attempt (`GenerateRequest.continuation`) instead of generating that output again."""

    def __init__(self, request: pb.GenerateRequest, resume: bool) -> None:
        self.request, self.resume = request, resume
        self.token_ids: list[int] = []
        self.text_length = 0  # code points
        self.request_id = request.request_id  # the server's, once it named one
        self.finished = False  # the last chunk (finish_reason set) arrived

    def saw(self, resp: pb.GenerateResponse) -> None:
        self.token_ids += resp.token_ids
        self.text_length += len(resp.text)
        self.request_id = self.request_id or resp.request_id
        self.finished = self.finished or resp.finish_reason != pb.FINISH_REASON_UNSPECIFIED

    @property
    def started(self) -> bool:
        """Output arrived: a new attempt must continue it, or repeat it."""
        return bool(self.token_ids or self.text_length)

    def may_retry(self) -> bool:
        return not self.started or (self.resume and bool(self.token_ids))

    def next_request(self) -> pb.GenerateRequest:
        """The request of the next attempt: the same, continued after what arrived (under the
        id the server gave it, so logs and metrics follow one request)."""
        if not self.started:
            return self.request
        req = pb.GenerateRequest()
        req.CopyFrom(self.request)
        req.request_id = self.request_id
        req.continuation.token_ids.extend(self.token_ids)
        req.continuation.text_length = self.text_length
        return req

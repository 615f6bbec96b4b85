"""The blocking client: `Client` and the `Stream` its `generate` returns."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import grpc

from tandem_client._base import ChannelOptions, ClientBase
from tandem_client._retry import Deadline, Progress, RetryPolicy
from tandem_client.errors import from_rpc_error
from tandem_client.types import Chunk, Completion, Message, ModelInfo
from tandem_proto.v1 import generation_pb2 as pb


class Stream(Iterator[Chunk]):
    """One Generate call, as an iterator of `Chunk`s.

    Cancels the RPC on the server on `cancel()` (any thread), on leaving a `with` block, or when
    the stream is dropped (so `break` cancels); iteration then simply ends. A call broken off
    after some output is continued by the next attempt (the client's `resume`).
    """

    def __init__(self, start: Callable[[pb.GenerateRequest, Deadline], Any], policy: RetryPolicy,
                 deadline: Deadline, progress: Progress) -> None:
        self._start, self._policy, self._deadline = start, policy, deadline
        self._progress = progress  # what arrived: the next attempt continues after it
        self._call: Any = None  # the current attempt's grpc call; None between attempts
        self._attempt = 0
        self._done = False
        self._cancelled = threading.Event()

    def __iter__(self) -> Stream:
        return self

    def __next__(self) -> Chunk:
        while not (self._done or self._cancelled.is_set()):
            if self._call is None:
                self._call = self._start(self._progress.next_request(), self._deadline)
                if self._cancelled.is_set():  # cancel() ran before the call existed
                    self._call.cancel()
            try:
                resp = next(self._call)
            except StopIteration:
                self._done = True
                break
            except grpc.RpcError as err:
                self._call = None
                if self._progress.finished:  # the whole completion is in: nothing is lost
                    self._done = True
                    break
                self._retry_or_raise(err)
                continue
            if resp.token_ids:
                self._attempt = 0  # progress: a later break gets the full retries again
            self._progress.saw(resp)
            return Chunk.from_pb(resp)
        raise StopIteration

    def _retry_or_raise(self, err: grpc.RpcError) -> None:
        """Sleep before the next attempt, or end the stream with the error as a TandemError."""
        if self._cancelled.is_set():
            return  # our own cancel surfaces as CANCELLED: end quietly
        code = err.code()  # grpc's call errors are grpc.Call objects too
        delay = (self._policy.delay(code, self._attempt, self._deadline)
                 if self._progress.may_retry() else None)
        if delay is None:
            self._done = True
            raise from_rpc_error(err) from err
        self._attempt += 1
        self._cancelled.wait(delay)  # a cancel during the backoff ends it at once

    def cancel(self) -> None:
        """Stop the RPC (no-op if already finished). Safe from another thread."""
        self._cancelled.set()
        call = self._call
        if call is not None:
            call.cancel()

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.cancel()

    def __del__(self) -> None:
        if not self._done:
            try:
                self.cancel()
            except Exception:  # at interpreter exit grpc may be half torn down; nothing to stop
                pass


class Client(ClientBase[Stream]):
    """A blocking client of a tandem router. Thread-safe; use one per process and target.

    >>> with Client("localhost:50051") as c:
    ...     for chunk in c.generate("Once upon a time", max_tokens=32):
    ...         print(chunk.text, end="")
    """

    def _make_channel(self, target: str, credentials: grpc.ChannelCredentials | None,
                      options: ChannelOptions) -> grpc.Channel:
        if credentials is None:
            return grpc.insecure_channel(target, options)
        return grpc.secure_channel(target, credentials, options)

    def _open(self, request: pb.GenerateRequest, deadline: Deadline) -> Stream:
        start = lambda req, d: self._stub.Generate(req, **self._call_kwargs(d))
        return Stream(start, self._policy, deadline, Progress(request, self.resume))

    def complete(self, prompt: str | None = None, **kwargs: Any) -> Completion:
        """Generate to the end and return the joined chunks. Takes `generate`'s arguments.

        On a failure mid-stream the error is raised and the partial output is not returned;
        iterate `generate` instead to keep it.
        """
        with self.generate(prompt, **kwargs) as stream:
            return Completion.join(stream)

    def chat(self, messages: Sequence[Message], **kwargs: Any) -> Completion:
        """`complete` of a conversation: [{"role": "user", "content": "Hi"}, ...]."""
        return self.complete(messages=messages, **kwargs)

    def model_info(self, *, timeout: float | None = None) -> ModelInfo:
        """Describe the served model (retried on UNAVAILABLE like any call)."""
        deadline, attempt = self._deadline(timeout), 0
        while True:
            try:
                info = self._stub.GetModelInfo(pb.ModelInfoRequest(),
                                               **self._call_kwargs(deadline))
                return ModelInfo.from_pb(info)
            except grpc.RpcError as err:
                delay = self._policy.delay(err.code(), attempt, deadline)
                if delay is None:
                    raise from_rpc_error(err) from err
            attempt += 1
            time.sleep(delay)

    def close(self) -> None:
        """Close the channel; calls still in flight are cancelled."""
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

"""The asyncio client: `AsyncClient` and the `AsyncStream` its `generate` returns (grpc.aio)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import grpc
import grpc.aio

from tandem_client._base import ChannelOptions, ClientBase
from tandem_client._retry import Deadline, Progress, RetryPolicy
from tandem_client.errors import error_for, from_rpc_error
from tandem_client.types import Chunk, Completion, Message, ModelInfo
from tandem_proto.v1 import generation_pb2 as pb


class AsyncStream(AsyncIterator[Chunk]):
    """One Generate call, as an async iterator of `Chunk`s.

    Cancelled like `Stream`: `cancel()`, leaving an `async with` block, or dropping the stream
    (so `break` out of `async for` cancels). After a cancel by this side, iteration ends.
    """

    def __init__(self, start: Callable[[pb.GenerateRequest, Deadline], Any], policy: RetryPolicy,
                 deadline: Deadline, progress: Progress,
                 closed: Callable[[], bool] = lambda: False) -> None:
        self._start, self._policy, self._deadline = start, policy, deadline
        self._closed = closed  # whether the client was closed (its calls cancelled)
        self._progress = progress  # what arrived: the next attempt continues after it
        self._call: Any = None  # the current attempt's grpc.aio call; None between attempts
        self._attempt = 0
        self._done = False
        self._cancelled = asyncio.Event()

    def __aiter__(self) -> AsyncStream:
        return self

    async def __anext__(self) -> Chunk:
        while not (self._done or self._cancelled.is_set()):
            if self._call is None:
                self._call = self._start(self._progress.next_request(), self._deadline)
            try:
                resp = await self._call.read()
            except grpc.RpcError as err:
                self._call = None
                if self._progress.finished:  # the whole completion is in: nothing is lost
                    self._done = True
                    break
                await self._retry_or_raise(err)
                continue
            except asyncio.CancelledError:
                # grpc.aio raises this from read() when the call is cancelled. If we cancelled
                # it, the stream just ends; if the task itself is being cancelled, propagate;
                # if the client was closed under it, fail as the sync client does.
                if _task_cancelling():
                    raise
                if self._cancelled.is_set():
                    break
                if self._closed():
                    self._call, self._done = None, True
                    raise error_for(grpc.StatusCode.CANCELLED,
                                    "the client was closed during the call") from None
                raise
            if resp is grpc.aio.EOF:
                self._done = True
                break
            if resp.token_ids:
                self._attempt = 0  # progress: a later break gets the full retries again
            self._progress.saw(resp)
            return Chunk.from_pb(resp)
        raise StopAsyncIteration

    async def _retry_or_raise(self, err: grpc.RpcError) -> None:
        """Wait before the next attempt, or end the stream with the error as a TandemError."""
        if self._cancelled.is_set():
            return
        code = err.code()
        delay = (self._policy.delay(code, self._attempt, self._deadline)
                 if self._progress.may_retry() else None)
        if delay is None:
            self._done = True
            raise from_rpc_error(err) from err
        self._attempt += 1
        try:  # a cancel during the backoff ends it at once
            await asyncio.wait_for(self._cancelled.wait(), delay)
        except asyncio.TimeoutError:
            pass

    def cancel(self) -> None:
        """Stop the RPC (no-op if already finished). Call it from the event loop's thread."""
        self._cancelled.set()
        if self._call is not None:
            self._call.cancel()

    async def __aenter__(self) -> AsyncStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.cancel()

    def __del__(self) -> None:
        if not self._done and self._call is not None:
            try:
                self._call.cancel()
            except Exception:  # the event loop may already be closed; nothing left to stop
                pass


def _task_cancelling() -> bool:
    """Whether the current task has a pending cancel (Python >= 3.11; else assume not)."""
    task = asyncio.current_task()
    return bool(task is not None and getattr(task, "cancelling", lambda: 0)())


class AsyncClient(ClientBase[AsyncStream]):
    """The asyncio twin of `Client`; create it inside the event loop that will use it.

    >>> async with AsyncClient("localhost:50051") as c:
    ...     async for chunk in c.generate("Once upon a time", max_tokens=32):
    ...         print(chunk.text, end="")
    """

    _closing = False  # set by `close`

    def _make_channel(self, target: str, credentials: grpc.ChannelCredentials | None,
                      options: ChannelOptions) -> grpc.aio.Channel:
        if credentials is None:
            return grpc.aio.insecure_channel(target, options)
        return grpc.aio.secure_channel(target, credentials, options)

    def _open(self, request: pb.GenerateRequest, deadline: Deadline) -> AsyncStream:
        start = lambda req, d: self._stub.Generate(req, **self._call_kwargs(d))
        return AsyncStream(start, self._policy, deadline, Progress(request, self.resume),
                           lambda: self._closing)

    async def complete(self, prompt: str | None = None, **kwargs: Any) -> Completion:
        """Generate to the end and return the joined chunks. Takes `generate`'s arguments.

        On a failure mid-stream the error is raised and the partial output is not returned;
        iterate `generate` instead to keep it.
        """
        async with self.generate(prompt, **kwargs) as stream:
            return Completion.join([c async for c in stream])

    async def chat(self, messages: Sequence[Message], **kwargs: Any) -> Completion:
        """`complete` of a conversation: [{"role": "user", "content": "Hi"}, ...]."""
        return await self.complete(messages=messages, **kwargs)

    async def model_info(self, *, timeout: float | None = None) -> ModelInfo:
        """Describe the served model (retried on UNAVAILABLE like any call)."""
        deadline, attempt = self._deadline(timeout), 0
        while True:
            try:
                info = await self._stub.GetModelInfo(pb.ModelInfoRequest(),
                                                     **self._call_kwargs(deadline))
                return ModelInfo.from_pb(info)
            except grpc.RpcError as err:
                delay = self._policy.delay(err.code(), attempt, deadline)
                if delay is None:
                    raise from_rpc_error(err) from err
            attempt += 1
            await asyncio.sleep(delay)

    async def close(self) -> None:
        """Close the channel; calls still in flight are cancelled (their streams raise
        `RequestCancelledError`)."""
        self._closing = True
        await self._channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

"""AsyncClient against the same real in-process server (each test runs its own event loop)."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from tandem_client import (
    AsyncClient,
    DeadlineExceededError,
    InvalidArgumentError,
    RequestCancelledError,
    UnavailableError,
)

from .conftest import FAST_RETRY


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 10))  # a hang fails the test instead of the run


def test_chunks_stream_in_order_and_complete_joins_them(fake):
    async def main():
        async with AsyncClient(fake.target, **FAST_RETRY) as c:
            chunks = [ch async for ch in c.generate(token_ids=[1, 2], temperature=0.0)]
            done = await c.chat([{"role": "user", "content": "Hi"}], max_tokens=3)
        return chunks, done

    chunks, done = run(main())
    assert [c.text for c in chunks] == ["Hel", "lo", "!"]
    assert [c.finish_reason for c in chunks] == [None, None, "stop"]
    assert (done.text, done.token_ids, done.usage.completion_tokens) == ("Hello!", (1, 2, 3, 4), 4)
    first, second = fake.requests
    assert first.WhichOneof("prompt") == "token_ids" and first.sampling.HasField("temperature")
    assert second.WhichOneof("prompt") == "chat" and second.sampling.max_tokens == 3


def test_breaking_out_of_async_for_cancels_on_the_server(fake):
    fake.mode = "endless"

    async def main():
        async with AsyncClient(fake.target) as c:
            n = 0
            async for _ in c.generate("x"):
                n += 1
                if n == 2:
                    break
            # The server learns of it while the channel is still open.
            return await asyncio.to_thread(fake.client_gone.wait, 5)

    assert run(main())


def test_cancel_stops_the_server_and_ends_the_stream_quietly(fake):
    fake.mode = "endless"

    async def main():
        async with AsyncClient(fake.target) as c:
            stream = c.generate("x")
            await stream.__anext__()
            stream.cancel()
            rest = [ch async for ch in stream]
            return rest, await asyncio.to_thread(fake.client_gone.wait, 5)

    assert run(main()) == ([], True)


def test_cancelling_the_task_propagates_and_cancels_the_rpc(fake):
    fake.mode = "hang"

    async def main():
        async with AsyncClient(fake.target) as c:
            task = asyncio.ensure_future(c.complete("x"))
            await asyncio.sleep(0.1)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            return await asyncio.to_thread(fake.client_gone.wait, 5)

    assert run(main())


def test_closing_the_client_under_a_reader_raises_request_cancelled(fake):
    """As the sync client: a TandemError in the reader, not a bare CancelledError in a task
    nobody cancelled."""
    fake.mode = "endless"

    async def main():
        c = AsyncClient(fake.target)
        stream = c.generate("x")
        await stream.__anext__()

        async def reader():
            async for _ in stream:
                pass

        task = asyncio.ensure_future(reader())
        await asyncio.sleep(0.1)
        await c.close()
        with pytest.raises(RequestCancelledError) as e:
            await task
        assert not task.cancelled() and "closed" in str(e.value)

    run(main())


def test_deadline_exceeded(fake):
    fake.mode = "hang"

    async def main():
        async with AsyncClient(fake.target, timeout=0.2) as c:
            await c.complete("x")

    with pytest.raises(DeadlineExceededError) as e:
        run(main())
    assert e.value.code == grpc.StatusCode.DEADLINE_EXCEEDED


def test_unavailable_is_retried_and_continued_after_output(fake):
    """Before any chunk, a retry starts over; after, it continues after what arrived (or,
    with resume off, the stream fails)."""
    async def main():
        async with AsyncClient(fake.target, **FAST_RETRY) as c:
            fake.fail_first = [grpc.StatusCode.UNAVAILABLE] * 2
            assert (await c.complete("x")).text == "Hello!"
            assert len(fake.requests) == 3
            fake.fail_after_first_chunk = grpc.StatusCode.UNAVAILABLE
            chunks = [ch async for ch in c.generate("x")]
            assert [ch.text for ch in chunks] == ["Hel", "lo", "!"]
            assert [list(r.continuation.token_ids) for r in fake.requests[3:]] == [
                [], [1], [1, 2, 3]]
        async with AsyncClient(fake.target, resume=False, **FAST_RETRY) as c:
            stream = c.generate("x")
            assert (await stream.__anext__()).text == "Hel"
            with pytest.raises(UnavailableError):
                await stream.__anext__()
            assert len(fake.requests) == 7

    run(main())


def test_invalid_argument_and_model_info(fake):
    async def main():
        async with AsyncClient(fake.target) as c:
            fake.fail_first = [grpc.StatusCode.INVALID_ARGUMENT]
            with pytest.raises(InvalidArgumentError):
                await c.complete("x")
            return await c.model_info()

    assert run(main()).default_speculation == "eagle3"

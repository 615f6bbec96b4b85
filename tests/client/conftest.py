"""A real in-process gRPC server with a scripted fake Generation servicer (the router is not
built yet): the SDK is tested against the wire, not against mocks of grpc."""

from __future__ import annotations

import threading
import time
from concurrent import futures

import grpc
import pytest

from tandem_proto.v1 import generation_pb2 as pb
from tandem_proto.v1 import generation_pb2_grpc as pb_grpc

HELLO = [("Hel", [1]), ("lo", [2, 3]), ("!", [4])]
USAGE = pb.Usage(prompt_tokens=5, completion_tokens=4, cached_tokens=2, accepted_draft_tokens=1,
                 ttft_ms=12.5)


class FakeGeneration(pb_grpc.GenerationServicer):
    """Answers Generate as the test sets it up; records every request it receives.

    mode "script": stream `chunks`, the last with finish_reason STOP and usage (a continuation:
    those after the tokens it carries).
    mode "endless": a chunk every 10 ms until the client goes away.
    mode "hang": send nothing until the client goes away (deadline, cancel).
    """

    def __init__(self) -> None:
        self.target = ""
        self.mode = "script"
        self.chunks = HELLO
        self.fail_first: list[grpc.StatusCode] = []  # abort the next attempts with these codes
        self.fail_after_first_chunk: grpc.StatusCode | None = None
        self.requests: list[pb.GenerateRequest] = []
        self.metadata: list[dict[str, str]] = []
        self.client_gone = threading.Event()  # set when a handler saw the RPC die under it

    def Generate(self, request, context):
        self.requests.append(request)
        self.metadata.append(dict(context.invocation_metadata()))
        if self.fail_first:
            context.abort(self.fail_first.pop(0), "scripted failure")
        rid = request.request_id or f"srv-{len(self.requests)}"
        try:
            yield from self._respond(rid, context, len(request.continuation.token_ids))
        finally:  # also runs when grpc closes the generator because the client went away
            if not context.is_active():
                self.client_gone.set()

    def _respond(self, rid, context, skip=0):
        if self.mode == "hang":
            while context.is_active():
                time.sleep(0.005)
            return
        if self.mode == "endless":
            for i in range(10_000):
                yield pb.GenerateResponse(request_id=rid, text=f"{i} ", token_ids=[i])
                time.sleep(0.01)
            return
        chunks = list(self.chunks)
        while skip > 0 and chunks:  # a continuation: what the broken call already streamed
            skip -= len(chunks.pop(0)[1])
        for i, (text, ids) in enumerate(chunks):
            last = i == len(chunks) - 1
            yield pb.GenerateResponse(
                request_id=rid, text=text, token_ids=ids,
                finish_reason=pb.FINISH_REASON_STOP if last else pb.FINISH_REASON_UNSPECIFIED,
                usage=USAGE if last else None)
            if self.fail_after_first_chunk is not None:
                context.abort(self.fail_after_first_chunk, "node lost mid-stream")

    def GetModelInfo(self, request, context):
        if self.fail_first:
            context.abort(self.fail_first.pop(0), "scripted failure")
        return pb.ModelInfo(model="fake-135m", vocab_size=49152, max_model_len=8192,
                            default_speculation=pb.SPECULATION_METHOD_EAGLE3, block_size=16,
                            dtype="bfloat16", deterministic=True)


def start_server(servicer: FakeGeneration, address: str = "127.0.0.1:0") -> grpc.Server:
    """A started grpc server for `servicer`; sets servicer.target to where it listens."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    pb_grpc.add_GenerationServicer_to_server(servicer, server)
    port = server.add_insecure_port(address)
    server.start()
    servicer.target = f"127.0.0.1:{port}"
    return server


@pytest.fixture
def fake() -> FakeGeneration:
    """A fresh fake servicer behind a real server on a free localhost port."""
    servicer = FakeGeneration()
    server = start_server(servicer)
    yield servicer
    server.stop(grace=None)


# Tiny backoffs keep retry tests fast; the policy's shape is what is under test, not its scale.
FAST_RETRY = {"backoff": 0.01, "max_backoff": 0.05}

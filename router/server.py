"""The public gRPC server: validation, tokenization, streaming, cancellation, health checks,
reflection. Backends (colocated engine loop, or prefill/decode actors) do the generating."""

from __future__ import annotations

import asyncio
import itertools
import logging
import time

import grpc

from engine import InvalidRequestError, ResourceExhaustedError
from engine.metrics import RequestTimer
from router.convert import FINISH, continuation_of, prompt_of, sampling_of, spec_cap_of
from tandem_client._gen.tandem.v1 import generation_pb2 as pb
from tandem_client._gen.tandem.v1 import generation_pb2_grpc as pb_grpc

log = logging.getLogger("tandem.router")
CONTINUATION_WAIT_S = 2.0  # how long a continuation waits for its broken call to end here
SPEC_ENUM = {"none": pb.SPECULATION_METHOD_NONE, "eagle3": pb.SPECULATION_METHOD_EAGLE3,
             "ngram": pb.SPECULATION_METHOD_NGRAM}


class GenerationService(pb_grpc.GenerationServicer):
    """Serves `tandem.v1.Generation` over a backend with `encode`, `generate`, `info`."""

    def __init__(self, backend, metrics=None, max_inflight: int = 1024):
        self.backend, self.metrics, self.max_inflight = backend, metrics, max_inflight
        self.inflight: set[str] = set()
        self._ids = itertools.count()

    async def Generate(self, request, context):
        t0 = time.perf_counter()
        rid = request.request_id or f"r{next(self._ids)}-{int(t0 * 1e6) % 10**9}"
        try:
            params = sampling_of(request)
            more = continuation_of(request, params)
            if rid in self.inflight and more is not None:
                # A broken call's continuation may come in before the server has seen that
                # call end (a dropped connection): the old one is cancelled on its own.
                await self._left(rid, CONTINUATION_WAIT_S)
            if rid in self.inflight:
                raise InvalidRequestError(f"request_id {rid!r} is already in flight")
            if len(self.inflight) >= self.max_inflight:
                raise ResourceExhaustedError("too many requests in flight; retry later")
            ids = self.backend.encode(prompt_of(request))
            resume = None
            if more is not None:  # the output so far becomes the prompt's tail, as output
                made, chars = more
                ids = self.backend.encode(ids + made)
                resume = (len(made), chars)
            cap = spec_cap_of(request, self.backend.info()["speculation"])
        except InvalidRequestError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except ResourceExhaustedError as e:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        self.inflight.add(rid)
        timer = None
        if self.metrics is not None:
            timer = RequestTimer(self.metrics, len(ids) - (resume[0] if resume else 0))
            if resume is not None:
                self.metrics.continuations.inc()
        status, first = "cancelled", None
        try:
            # A continuation runs under its own engine id: the broken call's request may still
            # be winding down in the engine (its cancel in flight).
            eid = rid if resume is None else f"{rid}+{resume[0]}"
            async for out in self.backend.generate(eid, ids, params, cap, resume=resume):
                if first is None and out.token_ids:
                    first = time.perf_counter()
                if timer is not None and out.token_ids:
                    timer.token(len(out.token_ids))
                resp = pb.GenerateResponse(request_id=rid, text=out.text,
                                           token_ids=out.token_ids)
                if out.finished:
                    status = out.finish_reason or "stop"
                    resp.finish_reason = FINISH.get(status, pb.FINISH_REASON_ERROR)
                    resp.usage.CopyFrom(pb.Usage(
                        prompt_tokens=out.prompt_tokens, completion_tokens=out.completion_tokens,
                        cached_tokens=out.cached_tokens, accepted_draft_tokens=out.accepted_tokens,
                        ttft_ms=((first or time.perf_counter()) - t0) * 1000))
                yield resp
        except InvalidRequestError as e:
            status = "invalid"
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except ResourceExhaustedError as e:
            status = "rejected"
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        finally:
            self.inflight.discard(rid)
            if timer is not None:
                timer.finish(status if status in FINISH else "error")

    async def _left(self, rid: str, timeout: float) -> None:
        """Until request `rid` is no longer in flight, or `timeout` seconds have passed."""
        end = time.monotonic() + timeout
        while rid in self.inflight and time.monotonic() < end:
            await asyncio.sleep(0.01)

    async def GetModelInfo(self, request, context):
        i = self.backend.info()
        return pb.ModelInfo(model=i["model"], vocab_size=i["vocab_size"],
                            max_model_len=i["max_model_len"], block_size=i["block_size"],
                            dtype=i["dtype"], default_speculation=SPEC_ENUM[i["speculation"]])


async def start_server(service: GenerationService, host: str = "127.0.0.1", port: int = 0
                       ) -> tuple[grpc.aio.Server, int]:
    """Bind and start; returns the server and its port. Adds health checking and reflection."""
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection

    server = grpc.aio.server()
    pb_grpc.add_GenerationServicer_to_server(service, server)
    hs = health.aio.HealthServicer() if hasattr(health, "aio") else health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(hs, server)
    names = (pb.DESCRIPTOR.services_by_name["Generation"].full_name,
             health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
             reflection.SERVICE_NAME)
    reflection.enable_server_reflection(names, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    await server.start()
    for name in ("", names[0]):
        r = hs.set(name, health_pb2.HealthCheckResponse.SERVING)
        if hasattr(r, "__await__"):
            await r
    return server, bound

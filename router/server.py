"""The public gRPC server: validation, tokenization, admission, streaming, cancellation,
health checks, reflection; backends (colocated engine loop, or prefill/decode actors)
generate. Requests are bounded first (`router.limits`), tokenized off the event loop and
admitted in order (`router.admission`); failures end with a short status detail and the full
story is logged under the request id."""

from __future__ import annotations

import asyncio
import functools
import hashlib
import itertools
import logging
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import grpc

from engine import InvalidRequestError, ResourceExhaustedError
from engine.metrics import RequestTimer
from router.admission import Admission
from router.auth import BearerAuth, bearer_token
from router.convert import FINISH, continuation_of, prompt_of, sampling_of, spec_cap_of
from router.limits import Limits, clip, detail
from router.shadow import ShadowCheck
from tandem_proto.v1 import generation_pb2 as pb
from tandem_proto.v1 import generation_pb2_grpc as pb_grpc

log = logging.getLogger("tandem.router")
REUSE_WAIT_S = 2.0  # how long a call waits for an earlier one of its request id to end here
SPEC_ENUM = {"none": pb.SPECULATION_METHOD_NONE, "eagle3": pb.SPECULATION_METHOD_EAGLE3,
             "ngram": pb.SPECULATION_METHOD_NGRAM}
SERVICE = "tandem.v1.Generation"


class Refused(Exception):
    """Ends a call with `code` and a short detail (the request failed, not the server)."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code


class GenerationService(pb_grpc.GenerationServicer):
    """Serves `tandem.v1.Generation` over a backend with `encode`, `generate`, `info`.
    `max_inflight` requests run at once, more wait in `admission`'s queue; each may take
    `request_timeout_s` in all (DEADLINE_EXCEEDED past it)."""

    def __init__(self, backend, metrics=None, max_inflight: int = 1024, *,
                 admission: Admission | None = None, limits: Limits | None = None,
                 request_timeout_s: float | None = None, shadow_sample: float = 0.0):
        self.backend, self.metrics = backend, metrics
        self.shadow = ShadowCheck(backend, shadow_sample, metrics)
        self.admission = admission or Admission(max_inflight)
        self.limits = limits or Limits()
        self.request_timeout_s = request_timeout_s
        self.inflight: set[str] = set()
        self._ids = itertools.count()
        self._calls = itertools.count()  # engine ids: `_stream`
        self.draining = False  # refuse new requests (UNAVAILABLE): the server is going away
        self._closing = asyncio.Event()  # set: cut the running streams (`drain`)
        self.health: Health | None = None  # set by `start_server`
        # The per-client cap counts by bearer token where a token checker guards the gRPC
        # door (`start_server`; the HTTP door's calls say for themselves), else by peer
        # address: unchecked tokens are free.
        self.clients_by_token = False
        # Tokenizing a long prompt takes a while: never on the event loop.
        self._tokenize = ThreadPoolExecutor(2, thread_name_prefix="tandem-tokenize")
        if metrics is not None:
            metrics.watch_router(self)

    @classmethod
    def from_config(cls, backend, router, metrics=None) -> GenerationService:
        """The service a topology's router section (`cluster.config.RouterSection`) asks for."""
        return cls(backend, metrics, request_timeout_s=router.request_timeout_s,
                   shadow_sample=router.shadow_sample,
                   limits=Limits(max_prompt_chars=router.max_prompt_chars),
                   admission=Admission(router.max_concurrent_requests,
                                       router.max_queued_requests, router.max_queue_wait_s,
                                       router.max_requests_per_client))

    async def Generate(self, request, context):
        t0 = time.perf_counter()
        rid, code = getattr(request, "request_id", ""), grpc.StatusCode.OK
        try:
            if request is None:  # bytes that do not parse (`_lenient`)
                raise InvalidRequestError("the request is not a valid GenerateRequest")
            if self.draining:
                raise Refused(grpc.StatusCode.UNAVAILABLE, "the server is shutting down; "
                              "retry on another")
            self.limits.check(request)
            rid = rid or f"r{next(self._ids)}-{int(t0 * 1e6) % 10**9}"
            deadline = None if self.request_timeout_s is None else t0 + self.request_timeout_s
            by_token = getattr(context, "token_checked", self.clients_by_token)  # (its door's)
            async with self.admission.slot(_client_of(context, by_token)) as waited:
                if self.metrics is not None:
                    self.metrics.queue_seconds.observe(waited)
                async for resp in self._generate(rid, request, t0, deadline):
                    yield resp
        except Exception as e:  # noqa: BLE001 - every failure ends in a status, never a trace
            code, message = self._status_of(rid, e)
            await context.abort(code, detail(message))
        finally:
            if self.metrics is not None and code != grpc.StatusCode.OK:
                self.metrics.count_error(code.name)

    async def _generate(self, rid: str, request, t0: float, deadline: float | None):
        params = sampling_of(request)
        more = continuation_of(request, params)
        if rid in self.inflight:
            # A call that reuses the id of one its caller just cancelled (or a continuation of
            # one whose connection dropped) may come in before the server has seen the old one
            # end: it ends on its own in a moment.
            await _until(lambda: rid not in self.inflight, REUSE_WAIT_S)
        if rid in self.inflight:
            raise InvalidRequestError(f"request_id {clip(rid)} is already in flight")
        self.inflight.add(rid)
        try:
            ids, resume = await self._encode(request, more)
            cap = spec_cap_of(request, self.backend.info()["speculation"])
            async for resp in self._stream(rid, ids, params, cap, resume, t0, deadline):
                yield resp
        finally:
            self.inflight.discard(rid)

    async def _encode(self, request, more) -> tuple[list[int], tuple[int, int] | None]:
        """Prompt ids (a continuation's output as their tail) off the event loop."""
        loop = asyncio.get_running_loop()
        ids = await loop.run_in_executor(self._tokenize, self.backend.encode,
                                         prompt_of(request))
        if more is None:
            return ids, None
        made, chars = more
        try:  # the prompt alone passed: what fails now is the continuation's
            whole = await loop.run_in_executor(self._tokenize, self.backend.encode, ids + made)
        except InvalidRequestError as e:
            raise InvalidRequestError(f"continuation.token_ids ({len(made)} after a prompt of "
                                      f"{len(ids)} tokens): {e}") from None
        return whole, (len(made), chars)

    async def _stream(self, rid, ids, params, cap, resume, t0, deadline):
        timer = None
        if self.metrics is not None:
            # From arrival (t0): TTFT and end-to-end include the wait for admission, as the
            # usage's ttft_ms does; prefill time starts now.
            timer = RequestTimer(self.metrics, len(ids) - (resume[0] if resume else 0),
                                 start=t0)
            if resume is not None:
                self.metrics.continuations.inc()
        status, first = "cancelled", None
        # Each call runs under an engine id of its own: an earlier call of the same request id
        # (cancelled, or a broken call this one continues) may still be winding down on the
        # workers, its cancel in flight.
        eid = f"{rid}.{next(self._calls)}"
        shadow = self.shadow.wants(params, cap, resume is not None)
        made: list[int] = []  # the tokens streamed, for the drift check
        outs = self.backend.generate(eid, ids, params, cap, resume=resume).__aiter__()
        closing = asyncio.ensure_future(self._closing.wait())
        try:
            while True:
                try:
                    out = await self._next(outs, closing, deadline)
                except StopAsyncIteration:
                    break
                if first is None and out.token_ids:
                    first = time.perf_counter()
                if timer is not None and out.token_ids:
                    timer.token(len(out.token_ids))
                if shadow:
                    made += out.token_ids
                resp = pb.GenerateResponse(request_id=rid, text=out.text,
                                           token_ids=out.token_ids)
                if out.finished:
                    status = out.finish_reason or "stop"
                    if shadow and status in ("stop", "length"):
                        self.shadow.offer(eid, ids, params, made)
                    resp.finish_reason = FINISH.get(status, pb.FINISH_REASON_ERROR)
                    resp.usage.CopyFrom(pb.Usage(
                        prompt_tokens=out.prompt_tokens, completion_tokens=out.completion_tokens,
                        cached_tokens=out.cached_tokens, accepted_draft_tokens=out.accepted_tokens,
                        ttft_ms=((first or time.perf_counter()) - t0) * 1000))
                yield resp
        except asyncio.TimeoutError:
            status = "timeout"
            raise Refused(grpc.StatusCode.DEADLINE_EXCEEDED,
                          f"the request ran past the server's limit of "
                          f"{self.request_timeout_s:g} s") from None
        except InvalidRequestError:
            status = "invalid"
            raise
        except ResourceExhaustedError:
            status = "rejected"
            raise
        finally:
            closing.cancel()
            await outs.aclose()
            if timer is not None:
                timer.finish(status if status in FINISH else "error")

    async def _next(self, outs, closing: asyncio.Future, deadline: float | None):
        """The backend's next output; TimeoutError past `deadline`, UNAVAILABLE once the server
        is cutting its streams (`drain`), so the SDK continues them elsewhere."""
        nxt = asyncio.ensure_future(outs.__anext__())
        try:
            done, _ = await asyncio.wait({nxt, closing}, timeout=_left_of(deadline),
                                         return_when=asyncio.FIRST_COMPLETED)
        finally:  # the caller left (cancelled), or the output did not come: stop waiting for it
            if not nxt.done():
                nxt.cancel()
                await asyncio.wait({nxt})
            if nxt.done() and not nxt.cancelled():
                nxt.exception()  # read: the end of the stream (or a failure) is no news here
        if nxt in done:
            return nxt.result()
        if closing in done:
            raise Refused(grpc.StatusCode.UNAVAILABLE, "the server is shutting down; continue "
                          "the stream on another")
        raise asyncio.TimeoutError

    async def drain(self, grace_s: float) -> None:
        """Stop admitting (UNAVAILABLE, health NOT_SERVING), let running streams finish for up
        to `grace_s` seconds, then end the rest with UNAVAILABLE."""
        self.draining = True
        if self.health is not None:
            await self.health.set_all(False)
        await _until(lambda: not self.inflight, grace_s)
        self._closing.set()
        await _until(lambda: not self.inflight, 5.0)

    async def supervise(self, every_s: float = 2.0, give_up_s: float = 300.0) -> None:
        """Health follows the backend (`serving()`): NOT_SERVING while it cannot serve, SERVING
        when it can again. Returns once it could not serve for `give_up_s` seconds in a row
        (its Ray node is gone, say), so the process can exit for its supervisor."""
        down_since = None
        while True:
            await asyncio.sleep(every_s)
            if await self.backend.serving():
                if down_since is not None and not self.draining:
                    log.warning("workers answer again: SERVING")
                    await self.health.set_all(True)
                down_since = None
                continue
            now = time.monotonic()
            if down_since is None:
                down_since = now
                log.error("no live worker for a role: NOT_SERVING")
                await self.health.set_all(False)
            elif now - down_since >= give_up_s:
                log.error("no live worker for a role for %.0f s: giving up", now - down_since)
                return

    def _status_of(self, rid: str, e: Exception) -> tuple[grpc.StatusCode, str]:
        """The status a failure ends its call with; what is not the caller's doing is logged
        in full under the request id."""
        if isinstance(e, Refused):
            return e.code, str(e)
        if isinstance(e, InvalidRequestError):
            return grpc.StatusCode.INVALID_ARGUMENT, _message(e)
        if isinstance(e, ResourceExhaustedError):
            return grpc.StatusCode.RESOURCE_EXHAUSTED, _message(e)
        log.error("request %s failed", clip(rid, 80), exc_info=e)
        if _worker_lost(e):
            return grpc.StatusCode.UNAVAILABLE, (f"a worker failed (request {clip(rid)}); "
                                                 "safe to retry")
        return grpc.StatusCode.INTERNAL, (f"internal error; the server log has it under "
                                          f"request {clip(rid)}")

    def queue_depth(self) -> int:
        """Requests waiting: for admission, and (disaggregated) for KV room on a decode actor."""
        return self.admission.queued + getattr(self.backend, "kv_waiting", 0)

    async def GetModelInfo(self, request, context):
        if request is None:  # bytes that do not parse (`_lenient`), as Generate answers them
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                "the request is not a valid ModelInfoRequest")
        i = self.backend.info()
        return pb.ModelInfo(model=i["model"], vocab_size=i["vocab_size"],
                            max_model_len=i["max_model_len"], block_size=i["block_size"],
                            dtype=i["dtype"], default_speculation=SPEC_ENUM[i["speculation"]],
                            deterministic=i.get("deterministic", False))

    def close(self) -> None:
        self._tokenize.shutdown(wait=False, cancel_futures=True)
        self.shadow.close()


class Health:
    """The gRPC health service's status for the server as a whole and for Generation."""

    def __init__(self, servicer):
        self.servicer = servicer

    async def set_all(self, serving: bool) -> None:
        from grpc_health.v1 import health_pb2

        status = health_pb2.HealthCheckResponse.SERVING if serving else \
            health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", SERVICE):
            r = self.servicer.set(name, status)
            if hasattr(r, "__await__"):
                await r


async def _until(done, timeout: float) -> None:
    """Until `done()` holds, or `timeout` seconds have passed."""
    end = time.monotonic() + timeout
    while not done() and time.monotonic() < end:
        await asyncio.sleep(0.01)


def _message(e: Exception) -> str:
    """An error's own message: raised on a worker, Ray wraps it with the worker's traceback,
    pid and address (`RayTaskError.cause` is the original)."""
    cause = getattr(e, "cause", None)
    return str(cause if isinstance(cause, Exception) else e)


def _left_of(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.perf_counter())


def _client_of(context, by_token: bool) -> str:
    """Who a request counts against for the per-client cap: its bearer token (hashed; the
    token as the auth check reads it) where tokens are checked, else its peer's address
    without the port."""
    token = bearer_token(context.invocation_metadata() or ()) if by_token else None
    if token is not None:
        return "token:" + hashlib.sha256(token.encode()).hexdigest()[:16]
    peer = context.peer() or ""
    return peer.rsplit(":", 1)[0] if peer.count(":") > 1 else peer


def _worker_lost(e: Exception) -> bool:
    """A prefill or decode actor died or its transfer failed: the request may be retried."""
    try:
        from ray.exceptions import RayActorError
    except ImportError:  # colocated serving without Ray installed
        return False
    from kvtransfer.base import TransferError

    return isinstance(e, (RayActorError, TransferError, ConnectionError))


def _lenient(cls):
    """A request deserializer that hands the method None for bytes that do not parse, so it
    answers INVALID_ARGUMENT (gRPC would answer UNKNOWN)."""
    def parse(data: bytes):
        try:
            return cls.FromString(data)
        except Exception:  # noqa: BLE001 - DecodeError, bad UTF-8 in a string field
            return None
    return parse


REFLECTION_V1 = "grpc.reflection.v1.ServerReflection"


def _add_reflection(server, names) -> None:
    """One reflection servicer under its v1alpha and v1 names (grpcurl and Postman ask v1
    first; grpcio-reflection serves only v1alpha). The two protocols' messages are the same on
    the wire."""
    from grpc_reflection.v1alpha import reflection
    from grpc_reflection.v1alpha import reflection_pb2 as rpb

    servicer = (reflection.aio.ReflectionServicer if hasattr(reflection, "aio")
                else reflection.ReflectionServicer)(names)
    info = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=rpb.ServerReflectionRequest.FromString,
        response_serializer=rpb.ServerReflectionResponse.SerializeToString)
    server.add_generic_rpc_handlers(tuple(
        grpc.method_handlers_generic_handler(name, {"ServerReflectionInfo": info})
        for name in (reflection.SERVICE_NAME, REFLECTION_V1)))


def add_service(service: GenerationService, server) -> None:
    """Register `service` with lenient request parsing (`_lenient`)."""
    rpcs = {
        "Generate": grpc.unary_stream_rpc_method_handler(
            service.Generate, request_deserializer=_lenient(pb.GenerateRequest),
            response_serializer=pb.GenerateResponse.SerializeToString),
        "GetModelInfo": grpc.unary_unary_rpc_method_handler(
            service.GetModelInfo, request_deserializer=_lenient(pb.ModelInfoRequest),
            response_serializer=pb.ModelInfo.SerializeToString),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, rpcs),))


def _count_refusals(service: GenerationService, interceptors) -> None:
    """Calls an auth interceptor turns away (at either door) count as UNAUTHENTICATED
    errors in the service's metrics."""
    if service.metrics is None:
        return
    for i in interceptors:
        if hasattr(i, "on_refused"):
            i.on_refused = functools.partial(service.metrics.count_error, "UNAUTHENTICATED")


async def start_server(service: GenerationService, host: str = "127.0.0.1", port: int = 0, *,
                       credentials: grpc.ServerCredentials | None = None,
                       interceptors: Sequence[grpc.aio.ServerInterceptor] = ()
                       ) -> tuple[grpc.aio.Server, int]:
    """Bind and start; returns the server and its port. Adds health checking and reflection.
    `credentials` (`router.auth.server_credentials`): TLS, else plaintext; `interceptors`:
    e.g. `router.auth.BearerAuth`, run before every call."""
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection

    # no SO_REUSEPORT: a second server on a port in use fails to bind instead of sharing it
    server = grpc.aio.server(interceptors=list(interceptors), options=[("grpc.so_reuseport", 0)])
    _count_refusals(service, interceptors)
    service.clients_by_token |= any(isinstance(i, BearerAuth) for i in interceptors)
    add_service(service, server)
    hs = health.aio.HealthServicer() if hasattr(health, "aio") else health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(hs, server)
    names = (pb.DESCRIPTOR.services_by_name["Generation"].full_name,
             health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
             reflection.SERVICE_NAME, REFLECTION_V1)
    _add_reflection(server, names)
    address = f"{host}:{port}"
    try:
        bound = (server.add_secure_port(address, credentials) if credentials is not None
                 else server.add_insecure_port(address))
    except RuntimeError as e:  # grpc's "Failed to bind": the port is taken or not ours
        raise OSError(f"cannot listen on {address} (in use?): {e}") from None
    await server.start()
    service.health = Health(hs)
    await service.health.set_all(True)
    return server, bound

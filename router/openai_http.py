"""The OpenAI-compatible HTTP API beside gRPC: /v1/models, /v1/completions,
/v1/chat/completions (whole or streamed over server-sent events), /health.

Requests are converted to `tandem.v1` GenerateRequests (`router.openai_convert`) and run
through `GenerationService.Generate`, so limits, admission, auth, timeouts, metrics and error
codes match gRPC. aiohttp serves it on the router's event loop."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import re
import ssl
import time
from collections.abc import AsyncIterator

import grpc
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestPayloadError

from engine.errors import CONTEXT_FULL
from router.openai_convert import (
    ApiError,
    chat_requests,
    check_model,
    completion_requests,
    envelope,
    finish_name,
    unicode_text,
    usage,
)
from router.server import GenerationService

log = logging.getLogger("tandem.router")
STREAMING = web.RequestKey("streaming", bool)  # set once a stream's 200 went out
BODY_LOST = web.RequestKey("body_lost", bool)  # set where the client left during its body
# an HTTP refusal's gRPC status name, for the metrics
_GRPC_CODE = {400: "INVALID_ARGUMENT", 404: "NOT_FOUND", 405: "UNIMPLEMENTED",
              408: "DEADLINE_EXCEEDED", 413: "INVALID_ARGUMENT"}
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
               "X-Accel-Buffering": "no"}
# A connection that sends no whole request for IDLE_S seconds is closed, and a request body
# must arrive within BODY_S: a stalled client cannot hold a descriptor for an hour.
IDLE_S, BODY_S = 75.0, 60.0


class _ClientFaults(logging.Filter):
    """aiohttp logs each malformed request (a bad Content-Length, a header past its limit)
    with a traceback before any handler runs, and a body that does not follow its
    Content-Encoding again as it discards the rest after the 400: the client's fault, one
    line at debug instead."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, (HttpProcessingError, RequestPayloadError)):
            log.debug("HTTP: a malformed request: %s", exc)
            return False
        return True


logging.getLogger("aiohttp.server").addFilter(_ClientFaults())


class Aborted(Exception):
    """`context.abort` of a call made through `Call`: the status the gRPC call would end with."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(details)
        self.code = code

    def api_error(self, path: str = "") -> ApiError:
        """The OpenAI error of this status for a request to `path`: a bound of the gRPC
        request (`router.limits`) is named by the HTTP field it came from."""
        message, param = str(self), None
        invalid = self.code == grpc.StatusCode.INVALID_ARGUMENT
        if invalid and (hit := _GRPC_FIELD.match(message)):
            name, param = _HTTP_FIELD[hit[1]]
            message = name + message[hit.end():]
        err = ApiError.of_status(self.code, message)
        err.param = param
        if invalid and CONTEXT_FULL.search(str(self)):
            err.code = "context_length_exceeded"  # OpenAI's code, which clients trim history on
            err.param = "messages" if path.endswith("/chat/completions") else "prompt"
        return err


# `router.limits`' gRPC field names -> (the name the HTTP request gave it, its param)
_HTTP_FIELD = {"sampling.stop_token_ids": ("stop_token_ids", "stop_token_ids"),
               "sampling.stop": ("stop", "stop"), "token_ids": ("prompt", "prompt"),
               "text": ("prompt", "prompt"), "chat.messages": ("messages", "messages"),
               "chat content": ("messages' content", "messages"),
               "request_id": ("X-Request-Id", None)}  # a header, not a param
_GRPC_FIELD = re.compile("(" + "|".join(map(re.escape, _HTTP_FIELD)) + r")(?=[ \[])")


class Call:
    """What `GenerationService.Generate` reads of a gRPC context, for an HTTP request: the
    caller's bearer token and address (the per-client cap), and `abort`."""

    def __init__(self, request: web.Request, token_checked: bool):
        self._auth = request.headers.get("Authorization")
        self.token_checked = token_checked  # this door's: the per-client cap may trust it
        remote = request.remote or "unknown"
        self._peer = f"ipv6:[{remote}]:0" if ":" in remote else f"ipv4:{remote}:0"

    def invocation_metadata(self):
        return (("authorization", self._auth),) if self._auth else ()

    def peer(self) -> str:
        return self._peer

    async def abort(self, code: grpc.StatusCode, details: str):
        raise Aborted(code, details)


class OpenAIServer:
    """Serves the OpenAI-compatible API over `service`. `auth` (a `BearerAuth`): tokens
    required on every path but /health (and that one too unless `auth.health_open`)."""

    def __init__(self, service: GenerationService, auth=None):
        self.service, self.auth = service, auth
        self.created = int(time.time())
        self._ids = itertools.count()
        self.max_body = service.limits.max_prompt_chars * 8 + (1 << 20)  # JSON escapes, fields
        self.app = web.Application(client_max_size=self.max_body, middlewares=[self._errors])
        self.app.add_routes([
            web.get("/health", self.health),
            web.get("/v1/models", self.models),
            web.get("/v1/models/{model:.+}", self.model),
            web.post("/v1/completions", self.completions),
            web.post("/v1/chat/completions", self.chat),
        ])
        self._runner: web.AppRunner | None = None

    async def start(self, host: str, port: int, ssl_context: ssl.SSLContext | None = None
                    ) -> int:
        """Bind and serve; returns the port (`port` 0: a free one)."""
        # handler_cancellation: a client that hangs up cancels its handler, which cancels
        # its generation (the engine frees its KV blocks) as a cancelled gRPC call does.
        self._runner = web.AppRunner(self.app, access_log=None, handler_cancellation=True,
                                     keepalive_timeout=IDLE_S)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port, ssl_context=ssl_context)
        await site.start()
        return site._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    # --- routes --------------------------------------------------------------------------

    @web.middleware
    async def _errors(self, request: web.Request, handler):
        """Bearer auth, then every failure as OpenAI's error JSON."""
        try:
            self._authorize(request)
            return await handler(request)
        except Aborted as e:  # the servicer ended it and counted it
            return _error(e.api_error(request.path))
        except asyncio.CancelledError:  # a client that left mid-body: counted as a gRPC call
            if request.get(BODY_LOST):  # its caller cancelled, not as a server fault
                self._client_left(request)
            raise
        except ApiError as e:
            err = e
        except web.HTTPRequestEntityTooLarge:
            err = ApiError(f"the request body is larger than this server takes "
                           f"({self.max_body} bytes)", 413)
        except web.HTTPException as e:  # unknown path (404), wrong method (405)
            if e.status < 400:
                raise
            err = ApiError(f"{request.method} {request.path}: {e.reason}", e.status)
        except Exception:  # a fault of the server's: still OpenAI's error JSON, and logged
            if request.get(STREAMING):  # the 200 went out: aiohttp ends the connection
                raise
            log.exception("%s %s failed", request.method, request.path)
            err = ApiError("internal server error (logged)", 500)
        # refused before the servicer saw it: counted here (401 by the auth's own count)
        if self.service.metrics is not None and err.status != 401:
            self.service.metrics.count_error(_GRPC_CODE.get(err.status, "INTERNAL"))
        return _error(err)

    def _client_left(self, request: web.Request) -> None:
        log.debug("%s %s: the client left before its body arrived", request.method,
                  request.path)
        if self.service.metrics is not None:
            self.service.metrics.count_error("CANCELLED")

    def _authorize(self, request: web.Request) -> None:
        if self.auth is None:
            return
        method = "/grpc.health.v1.Health/Check" if request.path == "/health" else request.path
        if not self.auth.allows(method, (("authorization", request.headers.get(
                "Authorization")),)):
            self.auth.refuse()
            raise ApiError("missing or invalid bearer token", 401,
                           type_="authentication_error", code="invalid_api_key")

    async def health(self, request: web.Request) -> web.Response:
        """200 while the server takes requests; 503 while draining or its workers are lost."""
        serving = getattr(self.service.backend, "serving", None)  # disaggregated only
        ok = not self.service.draining and (serving is None or await serving())
        return web.json_response({"status": "ok" if ok else "unavailable"},
                                 status=200 if ok else 503)

    def _card(self) -> dict:
        info = self.service.backend.info()
        return {"id": info["model"], "object": "model", "created": self.created,
                "owned_by": "tandem", "max_model_len": info["max_model_len"]}

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [self._card()]})

    async def model(self, request: web.Request) -> web.Response:
        card = self._card()
        if request.match_info["model"] != card["id"]:
            raise ApiError(f"the model {request.match_info['model'][:80]!r} does not exist",
                           404, "model", code="model_not_found")
        return web.json_response(card)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, "text_completion", completion_requests)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, "chat.completion", chat_requests)

    # --- generation ----------------------------------------------------------------------

    async def _serve(self, request: web.Request, kind: str, convert) -> web.StreamResponse:
        body = await _json(request)
        info = self.service.backend.info()
        if isinstance(body, dict):
            check_model(body, info["model"])
        rid = request.headers.get("X-Request-Id") or \
            f"{kind[:4]}{next(self._ids)}-{time.time_ns() % 10**9}"
        unicode_text(rid, "X-Request-Id")  # header bytes that are no UTF-8 arrive as surrogates
        reqs = convert(body, rid, info["max_model_len"])
        # each choice's id is the header's with "-i" after it: the header keeps room for that
        room = self.service.limits.max_request_id_bytes - max(
            len(r.request_id.encode()) for r in reqs) + len(rid.encode())
        if "X-Request-Id" in request.headers and len(rid.encode()) > room:
            raise ApiError(f"X-Request-Id has {len(rid.encode())} bytes; the limit is {room} "
                           f"for {len(reqs)} choice(s)")
        per_prompt = body.get("n") or 1  # choices per prompt (checked by `convert`)
        adm = self.service.admission
        if len(reqs) > adm.room:  # one request per choice: past the room, some always fail
            whose = "of one client" if adm.room == adm.per_client else "in all"
            raise ApiError(f"{len(reqs)} choices in all: this server takes at most {adm.room} "
                           f"requests {whose} at once", param="n" if per_prompt > 1
                           else "prompt")
        stream, opts = body.get("stream"), body.get("stream_options")
        if stream is not None and not isinstance(stream, bool):  # (1 == True in Python)
            raise ApiError("stream must be a boolean", param="stream")
        if opts is not None and (not stream or not isinstance(opts, dict) or not isinstance(
                opts.get("include_usage", False), bool)):
            raise ApiError("stream_options must be an object like {\"include_usage\": true}, "
                           "and only with stream true", param="stream_options")
        outs = _merged(self.service, reqs, Call(request, self.auth is not None))
        try:
            # The first output (or the refusal) before any header: a refused request gets its
            # HTTP status, not a 200 with an error event.
            first = await anext(outs, None)
            if not stream:
                return await _whole(kind, rid, info["model"], len(reqs), per_prompt, first, outs)
            return await _streamed(request, kind, rid, info["model"], len(reqs), per_prompt,
                                   first, outs, bool((opts or {}).get("include_usage")))
        finally:
            await outs.aclose()


async def _merged(service: GenerationService, reqs, call: Call) -> AsyncIterator[tuple]:
    """(choice index, GenerateResponse) of every request, as they come. The first failure
    ends them all and is raised."""
    if len(reqs) == 1:
        async with contextlib.aclosing(service.Generate(reqs[0], call)) as one:
            async for resp in one:
                yield 0, resp
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, req) -> None:
        try:
            async with contextlib.aclosing(service.Generate(req, call)) as one:
                async for resp in one:
                    queue.put_nowait((i, resp, None))
            queue.put_nowait((i, None, None))
        except Exception as e:  # noqa: BLE001 - handed to the reader, raised there
            queue.put_nowait((i, None, e))

    tasks = [asyncio.ensure_future(pump(i, r)) for i, r in enumerate(reqs)]
    try:
        left = len(tasks)
        while left:
            i, resp, err = await queue.get()
            if err is not None:
                raise err
            if resp is None:
                left -= 1
            else:
                yield i, resp
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class _Tally:
    """Usage over a response's choices: the n choices of one prompt count its prompt (and its
    cached tokens) once."""

    def __init__(self, per_prompt: int):
        self.per_prompt, self.prompt, self.cached, self.completion = per_prompt, {}, {}, 0

    def add(self, i: int, resp) -> str | None:
        """Counts choice `i`'s last response; its finish reason (None before the last)."""
        if not resp.HasField("usage"):
            return None
        self.prompt[i // self.per_prompt] = resp.usage.prompt_tokens
        self.cached[i // self.per_prompt] = resp.usage.cached_tokens
        self.completion += resp.usage.completion_tokens
        return finish_name(resp)

    def usage(self) -> dict:
        return usage(sum(self.prompt.values()), self.completion, sum(self.cached.values()))


async def _whole(kind, rid, model, n, per_prompt, first, outs) -> web.Response:
    texts, finish, tally = [""] * n, [None] * n, _Tally(per_prompt)
    item = first
    while item is not None:
        i, resp = item
        texts[i] += resp.text
        finish[i] = tally.add(i, resp) or finish[i]
        item = await anext(outs, None)
    chat = kind.startswith("chat")
    choices = [{"index": i, "logprobs": None, "finish_reason": finish[i],
                **({"message": {"role": "assistant", "content": texts[i]}} if chat
                   else {"text": texts[i]})} for i in range(n)]
    return web.json_response(envelope(kind, rid, model, _created(), choices, tally.usage()))


async def _streamed(request, kind, rid, model, n, per_prompt, first, outs,
                    include_usage: bool) -> web.StreamResponse:
    chat = kind.startswith("chat")
    chunk_kind = kind + ".chunk" if chat else kind  # OpenAI streams completions as is
    created, tally = _created(), _Tally(per_prompt)
    response = web.StreamResponse(headers=SSE_HEADERS)
    await response.prepare(request)
    request[STREAMING] = True

    async def send(obj) -> None:
        await response.write(b"data: " + json.dumps(obj, separators=(",", ":")).encode()
                             + b"\n\n")

    def chunk(choices, use=None) -> dict:
        out = envelope(chunk_kind, rid, model, created, choices, use)
        if include_usage and use is None:
            out["usage"] = None
        return out

    if chat:  # the role first, as OpenAI's streams open
        await send(chunk([{"index": i, "delta": {"role": "assistant", "content": ""},
                           "logprobs": None, "finish_reason": None} for i in range(n)]))
    item = first
    try:
        while item is not None:
            i, resp = item
            done = tally.add(i, resp)
            if resp.text or done is not None:
                part = {"delta": {"content": resp.text} if resp.text else {}} if chat \
                    else {"text": resp.text}
                await send(chunk([{"index": i, **part, "logprobs": None,
                                   "finish_reason": done}]))
            item = await anext(outs, None)
        if include_usage:
            await send(chunk([], tally.usage()))
    except (Aborted, ApiError) as e:  # after the 200 went out: an error event ends the stream
        err = e if isinstance(e, ApiError) else e.api_error(request.path)
        await send(err.body())
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


async def _json(request: web.Request):
    try:
        raw = await asyncio.wait_for(request.read(), BODY_S)
    except asyncio.TimeoutError:
        raise ApiError(f"the request body did not arrive within {BODY_S:g} s", 408) from None
    except RequestPayloadError as e:  # torn chunks, a Content-Encoding the bytes do not follow
        why = getattr(e.__cause__, "message", None) or str(e)  # aiohttp's, without its status
        raise ApiError(f"the request body cannot be read: {' '.join(why.split())}") from None
    except (ConnectionResetError, asyncio.CancelledError):  # the client hung up before its
        request[BODY_LOST] = True  # body arrived (from 3.12 as the handler's cancellation):
        raise asyncio.CancelledError from None  # nobody to answer
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError):  # (nested past the parser's depth)
        raise ApiError("the request body is not valid JSON") from None


def _error(e: ApiError) -> web.Response:
    return web.json_response(e.body(), status=e.status)


def _created() -> int:
    return int(time.time())


def ssl_context(section) -> ssl.SSLContext | None:
    """TLS for the HTTP port from the `security` config section's PEM files (the gRPC port's):
    None without a certificate; with `tls_client_ca`, client certificates are required."""
    if not section.tls_cert:
        return None
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(section.tls_cert, section.tls_key)
    if section.tls_client_ca:
        ctx.load_verify_locations(section.tls_client_ca)
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def bearer_of(security: dict):
    """The `BearerAuth` among `router.auth.server_security`'s interceptors, if any."""
    from router.auth import BearerAuth

    return next((i for i in security.get("interceptors", ()) if isinstance(i, BearerAuth)),
                None)

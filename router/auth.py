"""Who may call the public port: TLS (mTLS with a client CA) and bearer tokens.

`server_security(section)` turns the `security` config section into `start_server`'s keyword
arguments. Tokens come from a file (one a line) and an environment variable (comma-separated);
none leaves auth off. Every method, reflection included, needs `authorization: Bearer
<token>`; `health_open` keeps health checks open for probes.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import grpc

from tandem_client.security import is_token

log = logging.getLogger("tandem.router")

HEALTH_PREFIX = "/grpc.health.v1.Health/"
DENIED = "missing or invalid bearer token"  # the same for both: no hint of which it was


def load_tokens(tokens_file: str | None = None, tokens_env: str | None = None) -> list[str]:
    """The tokens of `tokens_file` (one a line; blank lines and `#` comments skipped) and of
    the environment variable `tokens_env` (comma-separated; unset or empty: none). A file
    that holds no token is an error: it would leave auth silently off."""
    tokens = []
    if tokens_file:
        lines = Path(tokens_file).read_text().splitlines()
        tokens += _checked(tokens_file, (s.strip() for s in lines
                                         if s.strip() and not s.strip().startswith("#")))
        if not tokens:
            raise ValueError(f"security.tokens_file: no token in {tokens_file} "
                             "(one a line; an empty file would turn auth off)")
    if tokens_env:
        raw = os.environ.get(tokens_env, "")
        tokens += _checked(f"${tokens_env}", (s.strip() for s in raw.split(",") if s.strip()))
    return tokens


def _checked(where: str, tokens: Iterable[str]) -> list[str]:
    out = list(tokens)
    for i, t in enumerate(out):
        if not is_token(t):
            raise ValueError(f"{where}: token {i + 1} holds a space or a character a gRPC "
                             "header cannot carry (printable ASCII only)")
    return out


def _digest(token: str) -> bytes:
    # Comparing fixed-length digests keeps even a token's length out of the timing.
    return hashlib.sha256(token.encode()).digest()


def bearer_token(metadata: Iterable[tuple[str, str | bytes]]) -> str | None:
    """The token of the first `authorization` entry if it reads `Bearer <token>` (the scheme
    in any case, spaces around the token dropped), else None."""
    value = next((v for k, v in metadata if k == "authorization"), None)
    if not isinstance(value, str) or not value.isascii():  # (undecodable bytes: surrogates)
        return None
    scheme, _, token = value.partition(" ")
    return token.strip() if scheme.lower() == "bearer" else None


class BearerAuth(grpc.aio.ServerInterceptor):
    """Refuses (UNAUTHENTICATED) any call without a valid `authorization: Bearer <token>`.

    Only the first `authorization` entry counts, compared in constant time against every token,
    so a call cannot probe tokens. `refused` counts refusals (`refuse`); `on_refused`, if set, is
    called for each.
    """

    def __init__(self, tokens: Sequence[str], health_open: bool = True) -> None:
        if not tokens:
            raise ValueError("BearerAuth needs at least one token")
        self._digests = [_digest(t) for t in tokens]
        self.health_open = health_open
        self.on_refused: Callable[[], None] | None = None
        self.refused = 0

    def refuse(self) -> None:
        """Count one call turned away (and tell `on_refused`)."""
        self.refused += 1
        if self.on_refused is not None:
            self.on_refused()

    def allows(self, method: str, metadata: Iterable[tuple[str, str | bytes]]) -> bool:
        """Whether a call of `method` ("/package.Service/Method") with `metadata` may go on."""
        if self.health_open and method.startswith(HEALTH_PREFIX):
            return True
        token = bearer_token(metadata)
        return token is not None and self._valid(token)

    def _valid(self, token: str) -> bool:
        d, ok = _digest(token), False
        for known in self._digests:
            ok |= hmac.compare_digest(d, known)
        return ok

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if self.allows(details.method, details.invocation_metadata or ()):
            return handler
        self.refuse()
        return _denying(handler)


async def _deny(request, context) -> None:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, DENIED)


_HANDLERS = {  # (request streaming, response streaming) -> handler factory
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


def _denying(handler: grpc.RpcMethodHandler | None) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that refuses the call. It deserializes
    nothing: an unauthenticated request is not even parsed. An unknown method is refused the
    same way, rather than answered UNIMPLEMENTED."""
    shape = (handler.request_streaming, handler.response_streaming) if handler else (False, False)
    return _HANDLERS[shape](_deny)


def server_credentials(tls_cert: str | None, tls_key: str | None,
                       tls_client_ca: str | None = None) -> grpc.ServerCredentials | None:
    """TLS credentials from PEM files (None without a certificate: plaintext). With a client
    CA, a client must present a certificate it signed (mTLS)."""
    if not tls_cert:
        return None
    pair = (_pem(tls_key, "tls_key"), _pem(tls_cert, "tls_cert"))
    ca = _pem(tls_client_ca, "tls_client_ca") if tls_client_ca else None
    return grpc.ssl_server_credentials([pair], root_certificates=ca,
                                       require_client_auth=ca is not None)


def _pem(path: str | None, key: str) -> bytes:
    data = Path(path or "").read_bytes()
    if b"-----BEGIN " not in data:
        raise ValueError(f"security.{key}: {path} is not PEM")
    return data


def server_security(section) -> dict:
    """`start_server`'s `credentials` and `interceptors` for a `cluster.config.SecuritySection`
    (or any object with its fields). Reads the PEM and token files now."""
    creds = server_credentials(section.tls_cert, section.tls_key, section.tls_client_ca)
    tokens = load_tokens(section.tokens_file, section.tokens_env)
    if tokens and creds is None:
        log.warning("bearer tokens without TLS: they cross the network in plaintext")
    auth = BearerAuth(tokens, section.health_open) if tokens else None
    log.info("public port: TLS %s, client certificates %s, %d bearer token(s)",
             "on" if creds else "off", "required" if section.tls_client_ca else "not asked",
             len(tokens))
    return {"credentials": creds, "interceptors": (auth,) if auth else ()}

"""TLS and bearer tokens on the client side: what `Client(tls=..., token=...)` turns into."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

_TOKEN = re.compile(r"[\x21-\x7e]+")  # a whole token (fullmatch): printable ASCII, no spaces


def is_token(text: str) -> bool:
    """Whether `text` can travel as a bearer token in a gRPC header: printable ASCII, no
    spaces or line ends (the server's token files follow the same rule)."""
    return _TOKEN.fullmatch(text) is not None
Pem = str | Path | bytes  # a path to a PEM file, or the PEM itself


@dataclass(frozen=True)
class TLS:
    """Whom a client trusts and, for mTLS, who it is. Paths are read when the TLS is made.

    ca: root certificates for the server's; None: the system's roots.
    cert, key: the client's certificate (chain) and private key for mTLS; both or neither.
    server_name: the name the server's certificate must carry when the target's host is not it.
    """

    ca: Pem | None = None
    cert: Pem | None = None
    key: Pem | None = None
    server_name: str | None = None

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise ValueError("TLS: give cert and key together (the client's identity for mTLS)")
        for name in ("ca", "cert", "key"):
            object.__setattr__(self, name, _read(getattr(self, name)))

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(self.ca, self.key, self.cert)

    def options(self) -> list[tuple[str, Any]]:
        """Channel arguments: the expected server name, if one was given."""
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []


def _read(pem: Pem | None) -> bytes | None:
    if pem is None or isinstance(pem, bytes):
        return pem
    return Path(pem).read_bytes()


def channel_security(credentials: grpc.ChannelCredentials | None, tls: TLS | bool | None,
                     token: str | None
                     ) -> tuple[grpc.ChannelCredentials | None, tuple[tuple[str, str], ...],
                                list[tuple[str, Any]]]:
    """(channel credentials or None for plaintext, metadata for every call, channel options).

    On a TLS channel the token goes as call credentials, which gRPC never sends over a
    plaintext connection. A plaintext channel cannot carry call credentials, so there it goes
    as plain `authorization` metadata: readable by anyone on the path, for localhost only.
    """
    if tls and credentials is not None:
        raise ValueError("give tls or credentials, not both")
    if tls is True:
        tls = TLS()
    options: list[tuple[str, Any]] = []
    if tls:
        credentials, options = tls.credentials(), tls.options()
    if token is None:
        return credentials, (), options
    if not is_token(token):
        raise ValueError("token: printable ASCII without spaces or a line end (it travels as a "
                         "gRPC header)")
    if credentials is None:
        return None, (("authorization", f"Bearer {token}"),), options
    call = grpc.access_token_call_credentials(token)
    return grpc.composite_channel_credentials(credentials, call), (), options


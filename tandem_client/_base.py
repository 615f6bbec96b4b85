"""What Client and AsyncClient share: construction, the `generate` signature, the request."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, Generic, TypeVar

import grpc

from tandem_client import _request
from tandem_client._retry import Deadline, RetryPolicy
from tandem_client.security import TLS, channel_security
from tandem_client.types import Message, SpeculationMethod
from tandem_proto.v1 import generation_pb2 as pb
from tandem_proto.v1 import generation_pb2_grpc as pb_grpc

StreamT = TypeVar("StreamT")
ChannelOptions = Sequence[tuple[str, Any]]

DEFAULT_TARGET = "localhost:50051"


class ClientBase(ABC, Generic[StreamT]):
    """A connection to a tandem router. `StreamT` is what `generate` returns."""

    def __init__(self, target: str = DEFAULT_TARGET, *, timeout: float | None = None,
                 retries: int = 3, backoff: float = 0.1, max_backoff: float = 2.0,
                 resume: bool = True, token: str | None = None, tls: TLS | bool | None = None,
                 credentials: grpc.ChannelCredentials | None = None,
                 metadata: Sequence[tuple[str, str]] = (), options: ChannelOptions = ()) -> None:
        """Open a channel to `target` ("host:port"; gRPC connects lazily, on the first call).

        timeout: default deadline of each call in seconds, retries included; None: no deadline.
        retries, backoff, max_backoff: retry a call that failed UNAVAILABLE before any output,
            up to `retries` times, waiting `backoff` seconds doubling up to `max_backoff`.
        resume: a stream that breaks off with UNAVAILABLE after some output is retried too, sending
            the tokens received so far (GenerateRequest.continuation) so the server streams only
            what follows; greedy output equals an unbroken call's. False: such a break raises
            UnavailableError. The retry count restarts whenever output arrives; to wait out a
            restart of the only router, raise `retries` and `max_backoff` (e.g. 30 and 2.0).
        token: a bearer token (`authorization: Bearer ...`): call credentials over TLS; plain
            metadata over plaintext (local use only: readable on the path).
        tls: a `TLS` (roots to trust, client certificate for mTLS), or True for the system's
            roots; None: plaintext.
        credentials: grpc channel credentials instead of `tls` (either, not both).
        metadata: sent with every call.
        options: extra gRPC channel arguments.
        A refused token raises AuthenticationError, never retried; a failed TLS handshake is
        UNAVAILABLE.
        """
        self.target = target
        self.timeout = timeout
        self._policy = RetryPolicy(retries, backoff, max_backoff)
        self.resume = resume
        credentials, auth, tls_opts = channel_security(credentials, tls, token)
        self._metadata = tuple(metadata) + auth
        opts = self._policy.channel_options([*tls_opts, *options])
        self._channel = self._make_channel(target, credentials, opts)
        self._stub = pb_grpc.GenerationStub(self._channel)

    @abstractmethod
    def _make_channel(self, target: str, credentials: grpc.ChannelCredentials | None,
                      options: ChannelOptions) -> Any: ...

    @abstractmethod
    def _open(self, request: pb.GenerateRequest, deadline: Deadline) -> StreamT: ...

    def generate(
        self,
        prompt: str | None = None,
        *,
        messages: Sequence[Message] | None = None,
        token_ids: Sequence[int] | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
        seed: int | None = None,
        max_tokens: int | None = None,
        stop: str | Sequence[str] | None = None,
        stop_token_ids: Sequence[int] | None = None,
        ignore_eos: bool | None = None,
        speculation: SpeculationMethod | None = None,
        num_speculative_tokens: int | None = None,
        request_id: str | None = None,
        timeout: float | None = None,
    ) -> StreamT:
        """Start generating; returns a stream of `Chunk`s (the RPC starts on the first read).

        The prompt is exactly one of `prompt` (plain text), `messages` (a chat, rendered with the
        model's template) or `token_ids`. Sampling arguments left None keep the server's defaults
        (temperature 1.0; 0 is greedy). `speculation` ("none", "eagle3", "ngram") and
        `num_speculative_tokens` override speculative decoding for this request (speed only, not
        outputs). `timeout` overrides the client's deadline. Wrong shapes and what the wire
        cannot carry (negative counts, lone surrogates) raise TypeError / ValueError here, naming
        the argument; other bad values raise InvalidArgumentError from the server. A negative
        `seed` (down to -2**63) is taken modulo 2**63, as the OpenAI endpoint takes it.
        """
        sampling = _request.sampling_params(
            temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, max_tokens=max_tokens,
            stop=stop, stop_token_ids=stop_token_ids, ignore_eos=ignore_eos)
        req = _request.prompt_request(prompt, messages, token_ids)
        with _request.named("request_id"):
            req.request_id = request_id or ""
        req.sampling.CopyFrom(sampling)
        spec = _request.speculation(speculation, num_speculative_tokens)
        if spec is not None:
            req.speculation.CopyFrom(spec)
        return self._open(req, self._deadline(timeout))

    @property
    def channel(self) -> Any:
        """The gRPC channel, for other services of the same server, e.g. health checks:
        `HealthStub(c.channel).Check(req, metadata=c.metadata)`."""
        return self._channel

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        """What every call sends beside the channel's own credentials (the token, over
        plaintext)."""
        return self._metadata

    def _deadline(self, timeout: float | None) -> Deadline:
        return Deadline(self.timeout if timeout is None else timeout)

    def _call_kwargs(self, deadline: Deadline) -> dict[str, Any]:
        """Per-attempt keyword arguments of a stub call: what is left of the deadline."""
        return {"timeout": deadline.remaining(), "metadata": self._metadata}

"""The SDK's token and TLS arguments against the scripted server (plaintext): what goes on the
wire, what is refused before any call, and UNAUTHENTICATED as a final AuthenticationError."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from tandem_client import TLS, AsyncClient, AuthenticationError, Client

from .conftest import FAST_RETRY


def test_a_token_goes_as_bearer_metadata_on_every_call(fake):
    with Client(fake.target, token="t0k-en", metadata=[("x-team", "a")]) as c:
        c.complete("x")
        c.model_info()  # not recorded by the fake, but must not fail
        c.complete("y")
    assert [m.get("authorization") for m in fake.metadata] == ["Bearer t0k-en"] * 2
    assert fake.metadata[0]["x-team"] == "a"


def test_async_client_sends_the_token_too(fake):
    async def main():
        async with AsyncClient(fake.target, token="t0k-en") as c:
            await c.complete("x")

    asyncio.run(asyncio.wait_for(main(), 10))
    assert fake.metadata[0]["authorization"] == "Bearer t0k-en"


def test_no_token_sends_no_authorization(fake):
    with Client(fake.target) as c:
        c.complete("x")
    assert "authorization" not in fake.metadata[0]


@pytest.mark.parametrize("make", [Client, AsyncClient])
def test_unauthenticated_is_an_authentication_error_never_retried(fake, make):
    fake.fail_first = [grpc.StatusCode.UNAUTHENTICATED] * 4

    async def call_async():
        async with AsyncClient(fake.target, retries=3, **FAST_RETRY) as c:
            await c.complete("x")

    with pytest.raises(AuthenticationError) as e:
        if make is Client:
            with Client(fake.target, retries=3, **FAST_RETRY) as c:
                c.complete("x")
        else:
            asyncio.run(asyncio.wait_for(call_async(), 10))
    assert e.value.code == grpc.StatusCode.UNAUTHENTICATED
    assert len(fake.requests) == 1


@pytest.mark.parametrize("token", ["with space", "", "naïve", "line\nbreak", "read-from-a-file\n"])
def test_a_token_a_header_cannot_carry_is_refused_at_once(token):
    with pytest.raises(ValueError, match="token"):
        Client("127.0.0.1:1", token=token)


def test_tls_settings_are_checked_and_read_when_made(tmp_path):
    pem = tmp_path / "ca.pem"
    pem.write_bytes(b"-----BEGIN CERTIFICATE-----\n")
    assert TLS(ca=str(pem)).ca == pem.read_bytes() == TLS(ca=pem).ca
    assert TLS(ca=b"raw").ca == b"raw"
    with pytest.raises(ValueError, match="cert and key together"):
        TLS(cert=str(pem))
    with pytest.raises(FileNotFoundError):
        TLS(ca=str(tmp_path / "missing.pem"))
    assert TLS(server_name="router.internal").options() == [
        ("grpc.ssl_target_name_override", "router.internal")]
    with pytest.raises(ValueError, match="tls or credentials"):
        Client("127.0.0.1:1", tls=True, credentials=grpc.ssl_channel_credentials())

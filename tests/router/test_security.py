"""TLS, mTLS and bearer tokens on the public port: a real grpc.aio server over a tiny engine,
called with the official grpc client, the SDK and the CLI. Certificates are made per run."""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from cluster.cli import main
from cluster.config import ConfigError, SecuritySection, config_from_dict
from router.auth import DENIED, BearerAuth, load_tokens, server_credentials, server_security
from tandem_client import TLS, AsyncClient, AuthenticationError, Client, UnavailableError
from tandem_proto.v1 import generation_pb2 as pb
from tandem_proto.v1 import generation_pb2_grpc as pb_grpc
from tests.helpers import tiny_engine
from tests.router.test_server import Served

TOKEN, OTHER = "s3cret-token", "another-token"
BEARER = [("authorization", f"Bearer {TOKEN}")]
REQUEST = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 2, 3]),
                             sampling=pb.SamplingParams(temperature=0, max_tokens=4))


# ---- a throwaway PKI ---------------------------------------------------------------------------

def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _issue(cn: str, issuer: tuple | None, *, ca: bool = False, server: bool = False):
    """(certificate, key) for `cn`, signed by `issuer` = (cert, key) or by itself."""
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    signer_cert, signer_key = issuer or (None, key)
    b = (x509.CertificateBuilder().subject_name(_name(cn))
         .issuer_name(signer_cert.subject if signer_cert else _name(cn))
         .public_key(key.public_key()).serial_number(x509.random_serial_number())
         .not_valid_before(now - datetime.timedelta(minutes=5))
         .not_valid_after(now + datetime.timedelta(days=1))
         .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if server:
        b = b.add_extension(x509.SubjectAlternativeName([
            x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False)
    if not ca:
        usage = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
        b = b.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    return b.sign(signer_key, hashes.SHA256()), key


def _write(folder: Path, name: str, cert, key) -> tuple[str, str]:
    c, k = folder / f"{name}.pem", folder / f"{name}.key"
    c.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    k.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                    serialization.PrivateFormat.PKCS8,
                                    serialization.NoEncryption()))
    return str(c), str(k)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """A CA, a server certificate (localhost, 127.0.0.1) and a client certificate it signed,
    and a client certificate of another CA."""
    d = tmp_path_factory.mktemp("pki")
    ca = _issue("tandem test CA", None, ca=True)
    rogue_ca = _issue("rogue CA", None, ca=True)
    p = SimpleNamespace()
    p.ca, _ = _write(d, "ca", *ca)
    p.rogue_ca, _ = _write(d, "rogue-ca", *rogue_ca)
    p.server_cert, p.server_key = _write(d, "server", *_issue("localhost", ca, server=True))
    p.client_cert, p.client_key = _write(d, "client", *_issue("client", ca))
    p.rogue_cert, p.rogue_key = _write(d, "rogue", *_issue("rogue", rogue_ca))
    return p


@pytest.fixture
def serve():
    """Start a server over a tiny engine with start_server's keyword arguments."""
    made = []

    def start(**server_kw) -> Served:
        made.append(Served(tiny_engine(0, max_position=128), server_kw=server_kw))
        return made[-1]

    yield start
    for s in made:
        s.close()


def _code(fn, *args) -> grpc.StatusCode:
    """The status code `fn(*args)` fails with."""
    with pytest.raises(grpc.RpcError) as e:
        fn(*args)
    return e.value.code()


def _generate(channel, metadata=()):
    return list(pb_grpc.GenerationStub(channel).Generate(REQUEST, metadata=metadata, timeout=30))


def _tls(pki, **kw) -> grpc.ServerCredentials:
    return server_credentials(pki.server_cert, pki.server_key, **kw)


# ---- TLS and mTLS ------------------------------------------------------------------------------

def test_tls_streams_and_plaintext_is_refused(serve, pki):
    s = serve(credentials=_tls(pki))
    with Client(s.target, tls=TLS(ca=pki.ca), retries=0) as c:
        done = c.complete(token_ids=[1, 2, 3], temperature=0, max_tokens=4)
    assert len(done.token_ids) == 4 and done.finish_reason == "length"
    with grpc.secure_channel(s.target, grpc.ssl_channel_credentials(
            Path(pki.ca).read_bytes())) as ch:
        assert sum(len(r.token_ids) for r in _generate(ch)) == 4
    with grpc.insecure_channel(s.target) as ch:
        assert _code(_generate, ch) == grpc.StatusCode.UNAVAILABLE
    # a client that trusts another CA does not accept the server
    with Client(s.target, tls=TLS(ca=pki.rogue_ca), retries=0) as c, \
            pytest.raises(UnavailableError):
        c.model_info()


def test_mtls_refuses_a_client_without_a_certificate_of_its_ca(serve, pki):
    s = serve(credentials=_tls(pki, tls_client_ca=pki.ca))
    with Client(s.target, tls=TLS(ca=pki.ca, cert=pki.client_cert, key=pki.client_key),
                retries=0) as c:
        assert len(c.complete(token_ids=[1, 2], temperature=0, max_tokens=3).token_ids) == 3
    for tls in (TLS(ca=pki.ca), TLS(ca=pki.ca, cert=pki.rogue_cert, key=pki.rogue_key)):
        with Client(s.target, tls=tls, retries=0) as c, pytest.raises(UnavailableError):
            c.complete(token_ids=[1, 2], max_tokens=3)


# ---- bearer tokens -----------------------------------------------------------------------------

def test_every_method_wants_a_valid_bearer_token(serve):
    auth = BearerAuth([OTHER, TOKEN])
    s = serve(interceptors=[auth])
    wrong = [[], [("authorization", "Bearer nope")], [("authorization", f"Basic {TOKEN}")],
             [("authorization", f"Bearer {TOKEN}x")], [("authorization", TOKEN)]]
    with grpc.insecure_channel(s.target) as ch:
        for md in wrong:
            with pytest.raises(grpc.RpcError) as e:
                _generate(ch, md)
            assert (e.value.code(), e.value.details()) == (
                grpc.StatusCode.UNAUTHENTICATED, DENIED)
        assert auth.refused == len(wrong)
        assert sum(len(r.token_ids) for r in _generate(ch, BEARER)) == 4
        assert sum(len(r.token_ids) for r in _generate(
            ch, [("authorization", f"bearer {OTHER}")])) == 4  # the scheme is case-blind
        info = pb_grpc.GenerationStub(ch).GetModelInfo
        assert _code(info, pb.ModelInfoRequest()) == grpc.StatusCode.UNAUTHENTICATED
        assert info(pb.ModelInfoRequest(), metadata=BEARER).vocab_size > 0
        # reflection follows the same rule (a bidirectional stream)
        refl = reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo
        ask = lambda md: list(refl(iter([reflection_pb2.ServerReflectionRequest(
            list_services="")]), metadata=md, timeout=10))
        assert _code(ask, ()) == grpc.StatusCode.UNAUTHENTICATED
        names = {x.name for x in ask(BEARER)[0].list_services_response.service}
        assert "tandem.v1.Generation" in names


def test_only_the_first_authorization_entry_counts(serve):
    s = serve(interceptors=[BearerAuth([TOKEN])])
    with grpc.insecure_channel(s.target) as ch:
        md = [("authorization", "Bearer guess"), *BEARER]
        assert _code(_generate, ch, md) == grpc.StatusCode.UNAUTHENTICATED


@pytest.mark.parametrize("health_open", [True, False])
def test_health_is_open_only_when_configured(serve, health_open):
    s = serve(interceptors=[BearerAuth([TOKEN], health_open=health_open)])
    req = health_pb2.HealthCheckRequest(service="tandem.v1.Generation")
    with grpc.insecure_channel(s.target) as ch:
        check = health_pb2_grpc.HealthStub(ch).Check
        assert check(req, metadata=BEARER).status == health_pb2.HealthCheckResponse.SERVING
        if health_open:
            assert check(req).status == health_pb2.HealthCheckResponse.SERVING
        else:
            assert _code(check, req) == grpc.StatusCode.UNAUTHENTICATED


def test_sdk_sends_its_token_over_tls_and_a_refusal_is_not_retried(serve, pki):
    auth = BearerAuth([TOKEN])
    s = serve(credentials=_tls(pki), interceptors=[auth])
    with Client(s.target, tls=TLS(ca=pki.ca), token=TOKEN) as c:
        assert len(c.complete(token_ids=[5, 6], temperature=0, max_tokens=3).token_ids) == 3
        assert c.metadata == ()  # over TLS the token rides as call credentials
    for token in ("wrong", None):
        with Client(s.target, tls=TLS(ca=pki.ca), token=token, retries=3) as c, \
                pytest.raises(AuthenticationError):
            c.complete(token_ids=[5, 6], max_tokens=3)
    assert auth.refused == 2  # one call each: UNAUTHENTICATED is final

    async def both():
        async with AsyncClient(s.target, tls=TLS(ca=pki.ca), token=TOKEN) as c:
            done = await c.complete(token_ids=[5, 6], temperature=0, max_tokens=3)
        async with AsyncClient(s.target, tls=TLS(ca=pki.ca), token="wrong", retries=3) as c:
            with pytest.raises(AuthenticationError):
                await c.model_info()
        return done

    assert len(asyncio.run(asyncio.wait_for(both(), 30)).token_ids) == 3
    assert auth.refused == 3


def test_sdk_token_over_plaintext_goes_as_metadata(serve):
    s = serve(interceptors=[BearerAuth([TOKEN])])
    with Client(s.target, token=TOKEN) as c:
        assert c.metadata == (("authorization", f"Bearer {TOKEN}"),)
        assert len(c.complete(token_ids=[5, 6], temperature=0, max_tokens=3).token_ids) == 3


# ---- where tokens come from --------------------------------------------------------------------

def test_tokens_come_from_a_file_and_the_environment(tmp_path, monkeypatch, serve):
    f = tmp_path / "tokens"
    f.write_text("# the team's tokens\n\n  file-token  \n#commented-out\nsecond\n")
    monkeypatch.setenv("TEST_TANDEM_TOKENS", " env-a, ,env-b,")
    assert load_tokens(str(f), "TEST_TANDEM_TOKENS") == ["file-token", "second", "env-a",
                                                          "env-b"]
    assert load_tokens(None, "TEST_TANDEM_UNSET_VAR") == []
    sec = SecuritySection(tokens_file=str(f), tokens_env="TEST_TANDEM_TOKENS", health_open=False)
    kw = server_security(sec)
    assert kw["credentials"] is None and len(kw["interceptors"]) == 1
    s = serve(**kw)
    with grpc.insecure_channel(s.target) as ch:
        bearer = lambda token: [("authorization", f"Bearer {token}")]
        for token in ("file-token", "env-b"):
            assert _generate(ch, bearer(token))
        for md in map(bearer, ("commented-out", "#commented-out", "")):
            assert _code(_generate, ch, md) == grpc.StatusCode.UNAUTHENTICATED


def test_no_tokens_leaves_auth_off(monkeypatch):
    monkeypatch.delenv("TANDEM_API_TOKENS", raising=False)
    assert server_security(SecuritySection()) == {"credentials": None, "interceptors": ()}


@pytest.mark.parametrize("text, says", [
    ("# only a comment\n\n", "security.tokens_file: no token"),
    ("good\nwith space\n", "token 2 holds a space"),
])
def test_a_bad_tokens_file_is_refused(tmp_path, text, says):
    f = tmp_path / "tokens"
    f.write_text(text)
    with pytest.raises(ValueError, match=says):
        load_tokens(str(f))


def test_a_file_that_is_not_pem_is_refused(tmp_path, pki):
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate")
    with pytest.raises(ValueError, match="security.tls_cert: .* is not PEM"):
        server_credentials(str(junk), pki.server_key)


# ---- config ------------------------------------------------------------------------------------

def test_security_config_defaults_and_round_trip(pki):
    sec = config_from_dict({}).security
    assert (sec.tls_cert, sec.tokens_file, sec.tokens_env, sec.health_open) == (
        None, None, "TANDEM_API_TOKENS", True)
    cfg = config_from_dict({"security": {"tls_cert": pki.server_cert, "tls_key": pki.server_key,
                                         "tls_client_ca": pki.ca, "tokens_env": None}})
    assert config_from_dict(cfg.to_dict()) == cfg


@pytest.mark.parametrize("section, says", [
    ({"tls_cert": "CERT"}, "security.tls_key must be set with tls_cert"),
    ({"tls_key": "KEY"}, "security.tls_cert must be set with tls_key"),
    ({"tls_client_ca": "CA"}, "security.tls_client_ca needs tls_cert"),
    ({"tls_cert": "/no/such.pem", "tls_key": "KEY"}, "security.tls_cert: no file"),
    ({"tokens_file": "/no/tokens"}, "security.tokens_file: no file"),
    ({"tokens_env": "NOT A NAME"}, "security.tokens_env must name an environment variable"),
    ({"health_open": "yes"}, "security.health_open must be bool"),
    ({"tls_crt": "CERT"}, "did you mean 'tls_cert'"),
])
def test_security_config_errors_name_the_key(pki, section, says):
    real = {"CERT": pki.server_cert, "KEY": pki.server_key, "CA": pki.ca}
    section = {k: real.get(v, v) for k, v in section.items()}
    with pytest.raises(ConfigError, match=says):
        config_from_dict({"security": section})


# ---- the CLI -----------------------------------------------------------------------------------

def test_status_with_token_and_tls(serve, pki, capsys, monkeypatch):
    monkeypatch.delenv("TANDEM_API_TOKEN", raising=False)
    s = serve(credentials=_tls(pki), interceptors=[BearerAuth([TOKEN], health_open=False)])
    assert main(["status", "--address", s.target, "--tls-ca", pki.ca, "--token", TOKEN]) == 0
    assert "SERVING" in capsys.readouterr().out
    assert main(["status", "--address", s.target, "--tls-ca", pki.ca]) == 1
    assert "UNAUTHENTICATED" in capsys.readouterr().err
    monkeypatch.setenv("TANDEM_API_TOKEN", TOKEN)
    assert main(["status", "--address", s.target, "--tls-ca", pki.ca]) == 0


def test_status_with_a_client_certificate(serve, pki, capsys):
    s = serve(credentials=_tls(pki, tls_client_ca=pki.ca))
    ca = ["--address", s.target, "--tls-ca", pki.ca]
    assert main(["status", *ca, "--tls-cert", pki.client_cert, "--tls-key", pki.client_key]) == 0
    assert main(["status", *ca]) == 1
    assert "UNAVAILABLE" in capsys.readouterr().err


def test_generate_sends_the_token(serve, capsys):
    s = serve(interceptors=[BearerAuth([TOKEN])])
    assert main(["generate", "--address", s.target, "hi", "--token", "wrong"]) == 2
    assert "UNAUTHENTICATED" in capsys.readouterr().err
    # past auth, the tiny engine (no tokenizer) refuses text: the call reached the service
    assert main(["generate", "--address", s.target, "hi", "--token", TOKEN]) == 2
    assert "INVALID_ARGUMENT" in capsys.readouterr().err


@pytest.mark.parametrize("argv, says", [
    (["status", "--tls-cert", "CERT"], "give cert and key together"),
    (["status", "--tls-ca", "/no/ca.pem"], "/no/ca.pem"),
    (["generate", "--address", "127.0.0.1:1", "hi", "--tls-key", "KEY"],
     "give cert and key together"),
    (["serve", "--colocated", "--tls-cert", "CERT"], "security.tls_key must be set"),
    (["serve", "--colocated", "--tls-cert", "/no/c.pem", "--tls-key", "KEY"],
     "security.tls_cert: no file"),
    (["serve", "--colocated", "--tokens-file", "/no/tokens"], "security.tokens_file: no file"),
])
def test_security_flags_refuse_bad_values_in_one_line(pki, capsys, argv, says):
    real = {"CERT": pki.server_cert, "KEY": pki.server_key}
    assert main([real.get(a, a) for a in argv]) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and err.startswith("error:") and len(err.splitlines()) == 1

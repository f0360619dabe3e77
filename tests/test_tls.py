"""TLS material for the server's listener (``aenv.tls``): the local CA that
``--tls-self-signed`` makes, and the checks on a certificate brought with ``--tls-cert``.

Certificates are checked the way clients check them: an in-memory TLS handshake with
Python's ``ssl`` (OpenSSL) against the CA, for the host names the E2B SDK builds.
"""

from __future__ import annotations

import datetime as dt
import logging
import socket
import ssl
import stat
import threading
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from aenv import tls
from aenv.tls import TlsError, listener_tls, local_ca

DOMAIN = "aenv.test"
T0 = dt.datetime.now(dt.UTC).replace(microsecond=0)  # real: handshakes check the clock


def _cert(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def _handshake(made: tls.ListenerTls, ca: Path, host: str) -> None:
    """A TLS handshake in memory: the server serves ``made``, the client trusts only
    ``ca`` and asks for ``host``; raises ssl.SSLCertVerificationError if it refuses."""
    server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_ctx.load_cert_chain(made.cert, made.key)
    client_ctx = ssl.create_default_context(cafile=str(ca))
    c_in, c_out, s_in, s_out = (ssl.MemoryBIO() for _ in range(4))
    client = client_ctx.wrap_bio(c_in, c_out, server_hostname=host)
    server = server_ctx.wrap_bio(s_in, s_out, server_side=True)
    done = {client: False, server: False}
    for _ in range(20):
        for side, out, peer_in in ((client, c_out, s_in), (server, s_out, c_in)):
            if not done[side]:
                try:
                    side.do_handshake()
                    done[side] = True
                except ssl.SSLWantReadError:
                    pass
            peer_in.write(out.read())
        if all(done.values()):
            return
    raise AssertionError("handshake did not finish")


@pytest.fixture
def made(tmp_path: Path) -> tls.ListenerTls:
    return local_ca(tmp_path / "tls", DOMAIN, now=T0)


# -- what the local CA makes --------------------------------------------------------------

def test_the_certificate_names_the_domain_and_every_host_one_label_below(made) -> None:
    cert = _cert(made.cert)
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert sans.get_values_for_type(x509.DNSName) == [DOMAIN, f"*.{DOMAIN}"]
    assert made.names == (DOMAIN, f"*.{DOMAIN}")
    eku = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(eku) == [ExtendedKeyUsageOID.SERVER_AUTH]
    assert cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca is False


def test_clients_trusting_the_ca_accept_the_api_and_sandbox_hosts(made) -> None:
    for host in (f"api.{DOMAIN}", f"8080-abc123.{DOMAIN}", f"49983-abc123.{DOMAIN}", DOMAIN):
        _handshake(made, made.ca, host)


def test_names_outside_the_wildcard_are_refused(made) -> None:
    for host in (f"a.8080-abc123.{DOMAIN}", "api.example.com", "localhost"):
        with pytest.raises(ssl.SSLCertVerificationError):
            _handshake(made, made.ca, host)


def test_the_ca_can_vouch_only_for_its_domain(made, tmp_path: Path) -> None:
    """Trusting the local CA system-wide must not let its key (on the server's disk) sign
    a certificate for any other site: the CA is name-constrained to the domain."""
    ca = _cert(made.ca)
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca is True
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.path_length == 0
    nc = ca.extensions.get_extension_for_class(x509.NameConstraints)
    assert nc.critical and nc.value.permitted_subtrees == [x509.DNSName(DOMAIN)]
    usage = ca.extensions.get_extension_for_class(x509.KeyUsage).value
    assert usage.key_cert_sign and usage.crl_sign and not usage.digital_signature

    # A leaf for another name, signed with the CA's own key, is refused by OpenSSL.
    ca_key = serialization.load_pem_private_key((made.ca.parent / "ca-key.pem").read_bytes(),
                                                None)
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.UTC)
    forged = (x509.CertificateBuilder()
              .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "bank.example")]))
              .issuer_name(ca.subject).public_key(key.public_key())
              .serial_number(x509.random_serial_number())
              .not_valid_before(now - dt.timedelta(hours=1))
              .not_valid_after(now + dt.timedelta(days=1))
              .add_extension(x509.SubjectAlternativeName([x509.DNSName("bank.example")]), False)
              .sign(ca_key, hashes.SHA256()))
    (tmp_path / "forged.pem").write_bytes(forged.public_bytes(serialization.Encoding.PEM))
    (tmp_path / "forged-key.pem").write_bytes(key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption()))
    fake = tls.ListenerTls(cert=tmp_path / "forged.pem", key=tmp_path / "forged-key.pem",
                           ca=None, names=("bank.example",), not_after=now)
    with pytest.raises(ssl.SSLCertVerificationError):
        _handshake(fake, made.ca, "bank.example")


def test_validity_periods(made) -> None:
    cert, ca = _cert(made.cert), _cert(made.ca)
    # An hour of slack for clients whose clock is behind the server's.
    assert cert.not_valid_before_utc == T0 - dt.timedelta(hours=1)
    assert cert.not_valid_after_utc == T0 + dt.timedelta(days=tls.CERT_DAYS)
    assert tls.CERT_DAYS <= 397  # the most browsers and Apple platforms accept
    assert made.not_after == cert.not_valid_after_utc
    assert ca.not_valid_after_utc == T0 + dt.timedelta(days=tls.CA_DAYS)
    cert.verify_directly_issued_by(ca)


def test_files_are_private_and_nothing_half_written_is_left(made, tmp_path: Path) -> None:
    where = tmp_path / "tls" / DOMAIN
    assert made.ca == where / "ca.pem" and made.cert.parent == where
    assert stat.S_IMODE((tmp_path / "tls").stat().st_mode) == 0o700
    assert stat.S_IMODE(where.stat().st_mode) == 0o700
    assert sorted(p.name for p in where.iterdir()) == [
        "ca-key.pem", "ca.pem", "server-key.pem", "server.pem"]
    for p in where.iterdir():
        assert stat.S_IMODE(p.stat().st_mode) == 0o600, p


def test_each_file_is_written_durably(tmp_path: Path, monkeypatch) -> None:
    """Every file goes through durable.write_atomic (fsync, rename, fsync of the directory)."""
    written: list[tuple[str, int]] = []
    real = tls.write_atomic

    def spy(path: Path, data: bytes, mode: int = 0o644) -> None:
        written.append((path.name, mode))
        real(path, data, mode)

    monkeypatch.setattr(tls, "write_atomic", spy)
    local_ca(tmp_path / "tls", DOMAIN, now=T0)
    # Each key before its certificate: a crash in between leaves a certificate that does
    # not match its key, which the next start notices and replaces.
    assert written == [("ca-key.pem", 0o600), ("ca.pem", 0o600),
                       ("server-key.pem", 0o600), ("server.pem", 0o600)]


# -- restarts -----------------------------------------------------------------------------

def _contents(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


def test_a_restart_reuses_the_ca_and_the_certificate(made, tmp_path: Path) -> None:
    before = _contents(tmp_path / "tls" / DOMAIN)
    again = local_ca(tmp_path / "tls", DOMAIN, now=T0 + dt.timedelta(days=200))
    assert again == made
    assert _contents(tmp_path / "tls" / DOMAIN) == before


def test_a_certificate_close_to_expiry_is_renewed_by_the_same_ca(made, tmp_path: Path) -> None:
    d = tmp_path / "tls" / DOMAIN
    before = _contents(d)
    later = T0 + dt.timedelta(days=tls.CERT_DAYS - tls.RENEW_DAYS + 1)
    renewed = local_ca(tmp_path / "tls", DOMAIN, now=later)
    after = _contents(d)
    assert after["ca.pem"] == before["ca.pem"] and after["ca-key.pem"] == before["ca-key.pem"]
    assert after["server.pem"] != before["server.pem"]
    assert renewed.not_after == later + dt.timedelta(days=tls.CERT_DAYS)
    _cert(renewed.cert).verify_directly_issued_by(_cert(made.ca))


@pytest.mark.parametrize("damage", ["missing", "truncated", "other key"])
def test_a_damaged_certificate_is_remade_by_the_same_ca(made, tmp_path: Path,
                                                         damage: str) -> None:
    d = tmp_path / "tls" / DOMAIN
    ca_before = (d / "ca.pem").read_bytes()
    if damage == "missing":
        (d / "server.pem").unlink()
    elif damage == "truncated":
        (d / "server.pem").write_bytes((d / "server.pem").read_bytes()[:100])
    else:  # a crash between writing a new key and its certificate
        (d / "server-key.pem").write_bytes((d / "ca-key.pem").read_bytes())
    again = local_ca(tmp_path / "tls", DOMAIN, now=T0)
    assert (d / "ca.pem").read_bytes() == ca_before
    _handshake(again, made.ca, f"api.{DOMAIN}")


def test_a_lost_ca_key_means_a_new_ca(made, tmp_path: Path) -> None:
    d = tmp_path / "tls" / DOMAIN
    ca_before = (d / "ca.pem").read_bytes()
    (d / "ca-key.pem").unlink()
    again = local_ca(tmp_path / "tls", DOMAIN, now=T0)
    assert (d / "ca.pem").read_bytes() != ca_before
    _handshake(again, again.ca, f"api.{DOMAIN}")
    (tmp_path / "old-ca.pem").write_bytes(ca_before)
    with pytest.raises(ssl.SSLCertVerificationError):  # the old CA no longer vouches for it
        _handshake(again, tmp_path / "old-ca.pem", f"api.{DOMAIN}")


def test_each_domain_has_its_own_ca(made, tmp_path: Path) -> None:
    before = _contents(tmp_path / "tls" / DOMAIN)
    other = local_ca(tmp_path / "tls", "sbx.example.org", now=T0)
    assert other.ca == tmp_path / "tls" / "sbx.example.org" / "ca.pem"
    assert other.names == ("sbx.example.org", "*.sbx.example.org")
    assert _contents(tmp_path / "tls" / DOMAIN) == before  # switching back needs no re-trust


@pytest.mark.parametrize("bad", ["", "*.aenv.test", "aenv..test", "-a.test", "a_b.test",
                                 "10.0.0.1", "a" * 64 + ".test"])
def test_a_domain_that_is_no_host_name_is_refused(tmp_path: Path, bad: str) -> None:
    with pytest.raises(TlsError, match="AENV_DOMAIN"):
        local_ca(tmp_path / "tls", bad)
    assert not (tmp_path / "tls").exists()


def test_the_domain_is_case_insensitive(tmp_path: Path) -> None:
    assert local_ca(tmp_path / "tls", "AEnv.Test", now=T0).names == (DOMAIN, f"*.{DOMAIN}")


# -- listener_tls: what the server's options turn into ------------------------------------

def test_no_tls_options_mean_plain_http(tmp_path: Path) -> None:
    assert listener_tls(tmp_path, DOMAIN, cert=None, key=None, self_signed=False) is None
    assert not any(tmp_path.iterdir())


def test_self_signed_lives_under_secrets_tls(tmp_path: Path) -> None:
    got = listener_tls(tmp_path / "secrets", DOMAIN, cert=None, key=None, self_signed=True)
    assert got is not None and got.ca == tmp_path / "secrets/tls" / DOMAIN / "ca.pem"


def test_a_certificate_needs_its_key_and_excludes_self_signed(tmp_path: Path, made) -> None:
    with pytest.raises(TlsError, match="--tls-cert and --tls-key go together"):
        listener_tls(tmp_path, DOMAIN, cert=made.cert, key=None, self_signed=False)
    with pytest.raises(TlsError, match="--tls-cert and --tls-key go together"):
        listener_tls(tmp_path, DOMAIN, cert=None, key=made.key, self_signed=False)
    with pytest.raises(TlsError, match="either --tls-cert/--tls-key or --tls-self-signed"):
        listener_tls(tmp_path, DOMAIN, cert=made.cert, key=made.key, self_signed=True)


def test_a_brought_certificate_is_checked_and_used_as_it_is(tmp_path: Path, made) -> None:
    got = listener_tls(tmp_path / "secrets", DOMAIN, cert=made.cert, key=made.key,
                       self_signed=False)
    assert got == tls.ListenerTls(cert=made.cert, key=made.key, ca=None, names=made.names,
                                  not_after=made.not_after)
    assert not (tmp_path / "secrets").exists()


def test_a_key_that_does_not_match_is_refused_naming_both_files(tmp_path: Path, made) -> None:
    wrong = made.ca.parent / "ca-key.pem"
    with pytest.raises(TlsError, match=f"{wrong} .*{made.cert}|{made.cert} .*{wrong}"):
        listener_tls(tmp_path, DOMAIN, cert=made.cert, key=wrong, self_signed=False)


def test_an_unreadable_or_non_pem_certificate_is_refused(tmp_path: Path, made) -> None:
    with pytest.raises(TlsError, match="cannot read"):
        listener_tls(tmp_path, DOMAIN, cert=tmp_path / "nope.pem", key=made.key,
                     self_signed=False)
    (tmp_path / "junk.pem").write_text("not a certificate\n")
    with pytest.raises(TlsError, match=str(tmp_path / "junk.pem")):
        listener_tls(tmp_path, DOMAIN, cert=tmp_path / "junk.pem", key=made.key,
                     self_signed=False)


def test_an_expired_certificate_is_refused(tmp_path: Path) -> None:
    old = local_ca(tmp_path / "tls", DOMAIN, now=dt.datetime(2020, 1, 1, tzinfo=dt.UTC))
    with pytest.raises(TlsError, match="expired on 2021-02-01"):
        listener_tls(tmp_path, DOMAIN, cert=old.cert, key=old.key, self_signed=False)


def test_a_certificate_for_other_names_starts_with_a_warning(tmp_path: Path, caplog) -> None:
    other = local_ca(tmp_path / "tls", "elsewhere.example")
    with caplog.at_level(logging.WARNING, logger="aenv.tls"):
        got = listener_tls(tmp_path, DOMAIN, cert=other.cert, key=other.key,
                           self_signed=False)
    assert got is not None
    assert f"does not cover api.{DOMAIN}" in caplog.text
    assert f"<port>-<sandbox>.{DOMAIN}" in caplog.text


def test_covers_matches_one_label_wildcards_only() -> None:
    names = ("aenv.test", "*.aenv.test")
    assert tls.covers(names, "aenv.test") and tls.covers(names, "API.aenv.test")
    assert tls.covers(names, "8080-abc.aenv.test")
    assert not tls.covers(names, "a.b.aenv.test") and not tls.covers(names, "xaenv.test")


# -- uvicorn serves it on the socket the CLI bound ----------------------------------------

def test_uvicorn_serves_https_on_an_already_bound_socket(made) -> None:
    import uvicorn

    async def app(scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        host = dict(scope["headers"]).get(b"host", b"").decode()
        body = f"{scope['scheme']} {host}".encode()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off",
                                           **made.uvicorn_options()))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        ctx = ssl.create_default_context(cafile=str(made.ca))
        for _ in range(100):
            if server.started:
                break
            threading.Event().wait(0.05)
        with socket.create_connection(("127.0.0.1", port), timeout=5) as raw, \
                ctx.wrap_socket(raw, server_hostname=f"8080-abc123.{DOMAIN}") as s:
            # No port in the Host: what https://<get_host(8080)> sends on 443.
            s.sendall(f"GET / HTTP/1.1\r\nHost: 8080-abc123.{DOMAIN}\r\n"
                      "Connection: close\r\n\r\n".encode())
            reply = b""
            while chunk := s.recv(65536):
                reply += chunk
            assert s.version() in ("TLSv1.2", "TLSv1.3")
        assert reply.startswith(b"HTTP/1.1 200")
        assert reply.endswith(f"https 8080-abc123.{DOMAIN}".encode())
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()

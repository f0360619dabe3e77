"""TLS for the server's one listener, which serves the REST API and sandbox traffic alike.

``sandbox.get_host(port)`` is ``<port>-<id>.<domain>`` and clients put ``https://`` in front
with no port, and an SDK given only ``E2B_DOMAIN`` talks to ``https://api.<domain>`` and
``https://49983-<id>.<domain>``. So the listener needs a certificate for ``<domain>`` and
``*.<domain>`` on 443. There are two ways to get one:

* ``--tls-cert``/``--tls-key``: PEM files you bring (the certificate file may hold the
  chain). They are checked at start: readable, the key matching, not expired; a
  certificate that does not cover ``api.<domain>`` or ``*.<domain>`` starts with a warning.
* ``--tls-self-signed``: a local CA and a certificate from it, made once under
  ``<secrets>/tls/<domain>/`` (``ca.pem``, ``ca-key.pem``, ``server.pem``,
  ``server-key.pem``; directory 0700, files 0600, each written whole and fsynced) and
  reused on every start. Clients trust ``ca.pem``. The CA is name-constrained to the
  domain, so trusting it lets it vouch for nothing else even if its key leaks. The server
  certificate is renewed at start when fewer than ``RENEW_DAYS`` of its ``CERT_DAYS`` are
  left (same CA, nothing to re-trust); a missing or damaged file is remade, a lost CA key
  means a new CA. Each domain has its own directory and CA.

Contract: call ``listener_tls`` once the instance lock is held (it writes into the home)
and before the server builds anything; it raises ``TlsError`` with a one-line message
naming the option or file. Nothing here reads the environment or binds a socket.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import logging
import re
import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from .envd import ENVD_PORT
from .storage.durable import write_atomic

log = logging.getLogger(__name__)

CA_DAYS = 3650
# Browsers refuse longer-lived certificates from public CAs and Apple platforms from any
# CA (825 days); 397 is accepted everywhere.
CERT_DAYS = 397
RENEW_DAYS = 30
CLOCK_SKEW = dt.timedelta(hours=1)  # not_before slack for clients whose clock lags
# Python's own default for TLS 1.2 (uvicorn before 0.3x forced the obsolete "TLSv1" list);
# TLS 1.3 suites are not affected by it.
CIPHERS = ("@SECLEVEL=2:ECDH+AESGCM:ECDH+CHACHA20:ECDH+AES:DHE+AES:!aNULL:!eNULL:!aDSS"
           ":!SHA1:!AESCCM")

_LABEL = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")


class TlsError(Exception):
    """TLS cannot be set up as asked; the message names the option or file to fix."""


@dataclass(frozen=True)
class ListenerTls:
    cert: Path                 # PEM certificate (and chain) the listener serves
    key: Path                  # its private key
    ca: Path | None            # the local CA clients must trust (--tls-self-signed)
    names: tuple[str, ...]     # DNS names the certificate covers
    not_after: dt.datetime

    def uvicorn_options(self) -> dict[str, Any]:
        """Keyword arguments for ``uvicorn.Config``."""
        return {"ssl_certfile": str(self.cert), "ssl_keyfile": str(self.key),
                "ssl_ciphers": CIPHERS}


def listener_tls(secrets_dir: Path, domain: str, *, cert: Path | None, key: Path | None,
                 self_signed: bool, now: dt.datetime | None = None) -> ListenerTls | None:
    """What the server's TLS options mean: None (plain HTTP), the certificate brought, or
    the local CA's for ``domain``."""
    if (cert is None) != (key is None):
        raise TlsError("--tls-cert and --tls-key go together (AENV_TLS_CERT, AENV_TLS_KEY)")
    if cert is not None and self_signed:
        raise TlsError("give either --tls-cert/--tls-key or --tls-self-signed, not both")
    if self_signed:
        return local_ca(secrets_dir / "tls", domain, now=now)
    if cert is None or key is None:
        return None  # plain HTTP
    return _brought(cert, key, domain, now or _now())


def local_ca(tls_dir: Path, domain: str, *, now: dt.datetime | None = None) -> ListenerTls:
    """The local CA's certificate for ``domain`` and ``*.domain``: reused, or made (see
    the module docstring for when)."""
    domain = _check_domain(domain)
    now = now or _now()
    where = tls_dir / domain
    for d in (tls_dir, where):
        d.mkdir(mode=0o700, exist_ok=True, parents=d is tls_dir)
        d.chmod(0o700)
    ca = _usable_ca(where, domain, now)
    if ca is None:
        ca = _new_ca(where, domain, now)
        log.warning("made a new local CA for %s: %s; clients must trust it "
                    "(SSL_CERT_FILE, NODE_EXTRA_CA_CERTS or the system store)",
                    domain, where / "ca.pem")
    names = (domain, f"*.{domain}")
    leaf = _usable_leaf(where, ca[0], names, now)
    if leaf is None:
        leaf = _new_leaf(where, ca, names, now)
        log.info("issued a TLS certificate for %s from %s, valid until %s",
                 ", ".join(names), where / "ca.pem", leaf.not_valid_after_utc.date())
    return ListenerTls(cert=where / "server.pem", key=where / "server-key.pem",
                       ca=where / "ca.pem", names=names, not_after=leaf.not_valid_after_utc)


def covers(names: tuple[str, ...] | list[str], host: str) -> bool:
    """Whether a certificate naming ``names`` is valid for ``host`` (a wildcard stands for
    exactly one left-most label, as TLS clients match it)."""
    host = host.lower().rstrip(".")
    for name in names:
        name = name.lower()
        if name.startswith("*."):
            first, _, rest = host.partition(".")
            if first and rest == name[2:]:
                return True
        elif name == host:
            return True
    return False


# -- certificates brought by the user -----------------------------------------------------

def _brought(cert: Path, key: Path, domain: str, now: dt.datetime) -> ListenerTls:
    try:
        pem = cert.read_bytes()
        key.read_bytes()
    except OSError as e:
        raise TlsError(f"cannot read the TLS file {e.filename}: {e.strerror}") from None
    try:
        leaf = x509.load_pem_x509_certificate(pem)
    except ValueError:
        raise TlsError(f"{cert} (--tls-cert) holds no PEM certificate") from None
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(cert, key)
    except ssl.SSLError as e:
        raise TlsError(f"the TLS key {key} does not fit the certificate {cert}, or is "
                       f"encrypted or not PEM ({e.reason or e})") from None
    end = leaf.not_valid_after_utc
    if end <= now:
        raise TlsError(f"the TLS certificate {cert} expired on {end.date()}")
    names = tuple(_dns_names(leaf))
    probes = ((f"api.{domain}", f"api.{domain}"),
              (f"<port>-<sandbox>.{domain}", f"{ENVD_PORT}-x.{domain}"))
    uncovered = [shown for shown, probe in probes if not covers(names, probe)]
    if uncovered:
        log.warning("the TLS certificate %s names %s, which does not cover %s: clients that "
                    "reach the server by those names will refuse it", cert,
                    ", ".join(names) or "no DNS name", " or ".join(uncovered))
    return ListenerTls(cert=cert, key=key, ca=None, names=names, not_after=end)


# -- the local CA -------------------------------------------------------------------------

def _check_domain(domain: str) -> str:
    d = domain.lower().rstrip(".")
    try:
        ipaddress.ip_address(d)
        is_ip = True
    except ValueError:
        is_ip = False
    if is_ip or not d or len(d) > 253 or not all(_LABEL.match(x) for x in d.split(".")):
        raise TlsError(f"AENV_DOMAIN (--domain) {domain!r} is not a DNS name; sandbox hosts "
                       "are <port>-<id>.<domain>, so it must be one (e.g. sbx.example.com)")
    return d


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC).replace(microsecond=0)


def _dns_names(cert: x509.Certificate) -> list[str]:
    try:
        ext = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName)
    except x509.ExtensionNotFound:
        return []
    return ext.value.get_values_for_type(x509.DNSName)


def _load(where: Path, cert_name: str, key_name: str
          ) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey] | None:
    """A certificate and its key, or None when either is missing, unreadable or they do
    not belong together."""
    try:
        cert = x509.load_pem_x509_certificate((where / cert_name).read_bytes())
        key = serialization.load_pem_private_key((where / key_name).read_bytes(), None)
    except (OSError, ValueError, TypeError):
        return None
    if not isinstance(key, ec.EllipticCurvePrivateKey) or \
            key.public_key().public_numbers() != _public_numbers(cert):
        return None
    return cert, key


def _public_numbers(cert: x509.Certificate) -> object:
    pub = cert.public_key()
    return pub.public_numbers() if isinstance(pub, ec.EllipticCurvePublicKey) else None


def _usable_ca(where: Path, domain: str, now: dt.datetime
               ) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey] | None:
    ca = _load(where, "ca.pem", "ca-key.pem")
    if ca is None:
        return None
    try:
        nc = ca[0].extensions.get_extension_for_class(x509.NameConstraints).value
    except x509.ExtensionNotFound:
        return None
    if nc.permitted_subtrees != [x509.DNSName(domain)]:
        return None
    if ca[0].not_valid_after_utc - now < dt.timedelta(days=RENEW_DAYS + CERT_DAYS):
        return None  # would not outlive a certificate issued now
    return ca


def _usable_leaf(where: Path, ca: x509.Certificate, names: tuple[str, ...],
                 now: dt.datetime) -> x509.Certificate | None:
    got = _load(where, "server.pem", "server-key.pem")
    if got is None:
        return None
    leaf = got[0]
    try:
        leaf.verify_directly_issued_by(ca)
    except (ValueError, TypeError, InvalidSignature):
        return None
    if tuple(_dns_names(leaf)) != names:
        return None
    if leaf.not_valid_after_utc - now < dt.timedelta(days=RENEW_DAYS):
        return None
    if leaf.not_valid_before_utc > now + CLOCK_SKEW:
        return None  # issued by a clock that ran ahead
    return leaf


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    write_atomic(path, key.private_bytes(serialization.Encoding.PEM,
                                         serialization.PrivateFormat.PKCS8,
                                         serialization.NoEncryption()), mode=0o600)


def _write_cert(path: Path, cert: x509.Certificate) -> None:
    write_atomic(path, cert.public_bytes(serialization.Encoding.PEM), mode=0o600)


def _new_ca(where: Path, domain: str, now: dt.datetime
            ) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "aenv"),
                      x509.NameAttribute(NameOID.COMMON_NAME, f"aenv local CA for {domain}")])
    ski = x509.SubjectKeyIdentifier.from_public_key(key.public_key())
    cert = (x509.CertificateBuilder()
            .subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - CLOCK_SKEW)
            .not_valid_after(now + dt.timedelta(days=CA_DAYS))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(
                digital_signature=False, content_commitment=False, key_encipherment=False,
                data_encipherment=False, key_agreement=False, key_cert_sign=True,
                crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.NameConstraints(
                permitted_subtrees=[x509.DNSName(domain)], excluded_subtrees=None),
                critical=True)
            .add_extension(ski, critical=False)
            .sign(key, hashes.SHA256()))
    _write_key(where / "ca-key.pem", key)
    _write_cert(where / "ca.pem", cert)
    return cert, key


def _new_leaf(where: Path, ca: tuple[x509.Certificate, ec.EllipticCurvePrivateKey],
              names: tuple[str, ...], now: dt.datetime) -> x509.Certificate:
    ca_cert, ca_key = ca
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, names[0])]))
            .issuer_name(ca_cert.subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - CLOCK_SKEW)
            .not_valid_after(now + dt.timedelta(days=CERT_DAYS))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(n) for n in names]),
                           critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(
                digital_signature=True, content_commitment=False, key_encipherment=False,
                data_encipherment=False, key_agreement=False, key_cert_sign=False,
                crl_sign=False, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]),
                           critical=False)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()),
                           critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(
                ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256()))
    _write_key(where / "server-key.pem", key)
    _write_cert(where / "server.pem", cert)
    return cert

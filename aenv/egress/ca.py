"""The node's egress CA: it signs the certificates the proxy shows a guest for the HTTPS
hosts whose requests it must change (header transforms). Guests trust it through envd's
``/init`` (``caBundle``); nothing else does.

Made once under ``<secrets>/egress-ca/`` (``ca.pem``, and ``ca-key.pem`` 0600), reused at
every start. Leaf certificates are minted per name on first use (ECDSA P-256, valid for
``LEAF_DAYS``) and kept in memory with a server ``SSLContext`` that offers HTTP/1.1 only,
since the proxy rewrites HTTP/1 request heads. ``cryptography`` (already a dependency,
for ``aenv.tls``) builds the certificates; ``ssl`` serves them.
"""

from __future__ import annotations

import datetime as dt
import ssl
import tempfile
import threading
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from ..storage.durable import write_atomic

CA_DAYS = 3650
LEAF_DAYS = 30
_SKEW = dt.timedelta(hours=1)


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


class EgressCA:
    def __init__(self, directory: Path) -> None:
        self.directory = directory
        cert_path, key_path = directory / "ca.pem", directory / "ca-key.pem"
        if cert_path.exists() and key_path.exists():
            self.cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
            key = serialization.load_pem_private_key(key_path.read_bytes(), None)
            assert isinstance(key, ec.EllipticCurvePrivateKey)
            self.key = key
        else:
            self.key, self.cert = self._new()
            directory.mkdir(parents=True, exist_ok=True, mode=0o700)
            write_atomic(key_path, _pem_key(self.key), mode=0o600)
            write_atomic(cert_path, self.pem.encode(), mode=0o644)
        self._contexts: dict[str, ssl.SSLContext] = {}
        self._lock = threading.Lock()

    @property
    def pem(self) -> str:
        """The CA certificate a guest must trust (``caBundle``)."""
        return self.cert.public_bytes(serialization.Encoding.PEM).decode()

    @staticmethod
    def _new() -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
        key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "aenv egress CA")])
        now = dt.datetime.now(dt.UTC)
        cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
                .public_key(key.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(now - _SKEW).not_valid_after(now + dt.timedelta(days=CA_DAYS))
                .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
                .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True,
                                             crl_sign=True, content_commitment=False,
                                             key_encipherment=False, data_encipherment=False,
                                             key_agreement=False, encipher_only=False,
                                             decipher_only=False), critical=True)
                .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()),
                               critical=False)
                .sign(key, hashes.SHA256()))
        return key, cert

    def leaf(self, name: str) -> tuple[bytes, bytes]:
        """(certificate PEM, key PEM) for ``name``, signed by this CA."""
        key = ec.generate_private_key(ec.SECP256R1())
        now = dt.datetime.now(dt.UTC)
        cert = (x509.CertificateBuilder()
                .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name[:64])]))
                .issuer_name(self.cert.subject).public_key(key.public_key())
                .serial_number(x509.random_serial_number())
                .not_valid_before(now - _SKEW)
                .not_valid_after(now + dt.timedelta(days=LEAF_DAYS))
                .add_extension(x509.SubjectAlternativeName([x509.DNSName(name)]), critical=False)
                .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]),
                               critical=False)
                .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(
                    self.key.public_key()), critical=False)
                .sign(self.key, hashes.SHA256()))
        return cert.public_bytes(serialization.Encoding.PEM), _pem_key(key)

    def server_context(self, name: str) -> ssl.SSLContext:
        """A TLS server context presenting a leaf for ``name`` (made once per name)."""
        with self._lock:
            ctx = self._contexts.get(name)
            if ctx is None:
                cert, key = self.leaf(name)
                ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
                ctx.minimum_version = ssl.TLSVersion.TLSv1_2
                ctx.set_alpn_protocols(["http/1.1"])
                # ssl loads chains from files only: a private temporary file, gone at once.
                with tempfile.NamedTemporaryFile(dir=self.directory, suffix=".pem") as f:
                    f.write(cert + key)
                    f.flush()
                    ctx.load_cert_chain(f.name)
                self._contexts[name] = ctx
            return ctx

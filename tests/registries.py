"""Real registries for tests: Debian's docker-registry on a free loopback port, and OCI
layouts written here and pushed into it with skopeo.

``Registry`` runs one docker-registry (plain HTTP, no auth) with its storage in a temp
directory and stops it (process group) when the test session ends. ``oci_layout``
writes a deterministic single-image layout (same input, same digests), so a layout under
the cache dir is reused across sessions.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import subprocess
import tarfile
from pathlib import Path

from tests.conftest import free_port, stop_process


class Registry:
    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.host = f"127.0.0.1:{self.port}"
        self.storage = root / "storage"
        config = root / "config.yml"
        config.write_text(self._config())
        self.log = open(root / "registry.log", "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(["docker-registry", "serve", str(config)],
                                     stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        _wait(self._ready_url(), self.proc)

    def _config(self) -> str:
        return ("version: 0.1\nlog:\n  level: warn\nstorage:\n  filesystem:\n"
                f"    rootdirectory: {self.storage}\n  delete:\n    enabled: true\n"
                f"http:\n  addr: 127.0.0.1:{self.port}\n")

    def _ready_url(self) -> str:
        return f"http://{self.host}/v2/"

    def push(self, layout: Path, repo: str, tag: str = "latest") -> str:
        """Push the layout's image as ``repo:tag``; returns ``host/repo:tag``."""
        subprocess.run(["skopeo", "copy", "--quiet", "--all", "--dest-tls-verify=false",
                        f"oci:{layout}:{tag}", f"docker://{self.host}/{repo}:{tag}"],
                       check=True, capture_output=True)
        return f"{self.host}/{repo}:{tag}"

    def blob_file(self, digest: str) -> Path:
        hexdigest = digest.partition(":")[2]
        return (self.storage / "docker/registry/v2/blobs/sha256" / hexdigest[:2] / hexdigest
                / "data")

    def stop(self) -> None:
        stop_process(self.proc)
        self.log.close()


def _wait(url: str, proc: subprocess.Popen[bytes], timeout: float = 20.0) -> None:
    import time

    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"docker-registry exited with {proc.returncode}")
        try:
            httpx.get(url, verify=False, timeout=1.0)
            return
        except httpx.HTTPError:
            time.sleep(0.05)
    raise TimeoutError(f"{url} did not answer within {timeout} s")


def tar_layer(files: dict[str, bytes], *, compress: str = "gzip") -> bytes:
    """A layer of regular files (mtime 0), ``compress`` gzip, zstd or none."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in sorted(files.items()):
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(data), 0o644, 0
            tar.addfile(info, io.BytesIO(data))
    raw = buf.getvalue()
    if compress == "gzip":
        return gzip.compress(raw, compresslevel=1, mtime=0)
    if compress == "zstd":
        return subprocess.run(["zstd", "-q", "-c", "-1"], input=raw, capture_output=True,
                              check=True).stdout
    return raw


LAYER_TYPE = {"gzip": "application/vnd.oci.image.layer.v1.tar+gzip",
              "zstd": "application/vnd.oci.image.layer.v1.tar+zstd",
              "none": "application/vnd.oci.image.layer.v1.tar"}


def _blob(root: Path, data: bytes) -> dict[str, object]:
    digest = hashlib.sha256(data).hexdigest()
    d = root / "blobs" / "sha256"
    d.mkdir(parents=True, exist_ok=True)
    (d / digest).write_bytes(data)
    return {"digest": f"sha256:{digest}", "size": len(data)}


def oci_layout(root: Path, layers: list[tuple[bytes, str]], *, tag: str = "latest",
               arch: str = "amd64", env: list[str] | None = None) -> Path:
    """An OCI layout with one image of ``layers`` ((bytes, compression)), lowest first."""
    desc = _image(root, layers, arch, env)
    return _index(root, [{**desc, "annotations": {"org.opencontainers.image.ref.name": tag}}])


def oci_index_layout(root: Path, images: list[tuple[str, list[tuple[bytes, str]]]], *,
                     tag: str = "latest", env: list[str] | None = None) -> Path:
    """An OCI layout whose ``tag`` is an image index: one ``linux/<arch>`` image per
    ``(arch, layers)`` of ``images``, in that order (a multi-platform image)."""
    descs = [{**_image(root, layers, arch, env),
              "platform": {"os": "linux", "architecture": arch}}
             for arch, layers in images]
    index = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json",
             "manifests": descs}
    desc = {"mediaType": "application/vnd.oci.image.index.v1+json",
            **_blob(root, json.dumps(index).encode()),
            "annotations": {"org.opencontainers.image.ref.name": tag}}
    return _index(root, [desc])


def _image(root: Path, layers: list[tuple[bytes, str]], arch: str,
           env: list[str] | None) -> dict[str, object]:
    """The descriptor of an image manifest (its blobs written under ``root``)."""
    root.mkdir(parents=True, exist_ok=True)
    config = {"architecture": arch, "os": "linux",
              "config": {"Env": env or ["PATH=/bin"]},
              "rootfs": {"type": "layers", "diff_ids": []}}
    manifest = {
        "schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                   **_blob(root, json.dumps(config).encode())},
        "layers": [{"mediaType": LAYER_TYPE[kind], **_blob(root, data)}
                   for data, kind in layers]}
    return {"mediaType": "application/vnd.oci.image.manifest.v1+json",
            **_blob(root, json.dumps(manifest).encode())}


def _index(root: Path, manifests: list[dict[str, object]]) -> Path:
    (root / "oci-layout").write_text(json.dumps({"imageLayoutVersion": "1.0.0"}))
    (root / "index.json").write_text(json.dumps(
        {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json",
         "manifests": manifests}))
    return root


def tls_files(where: Path) -> tuple[Path, Path, Path]:
    """(CA, server cert, server key) PEM files for 127.0.0.1, made with cryptography."""
    import datetime as dt
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    where.mkdir(parents=True, exist_ok=True)
    now = dt.datetime.now(dt.UTC)
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(
        ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "aenv test registry CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(now - dt.timedelta(hours=1))
          .not_valid_after(now + dt.timedelta(days=2))
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .sign(ca_key, hashes.SHA256()))
    leaf = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")]))
            .issuer_name(ca_name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(hours=1))
            .not_valid_after(now + dt.timedelta(days=2))
            .add_extension(x509.SubjectAlternativeName(
                [x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
            .sign(ca_key, hashes.SHA256()))
    pem = serialization.Encoding.PEM
    (where / "ca.pem").write_bytes(ca.public_bytes(pem))
    (where / "cert.pem").write_bytes(leaf.public_bytes(pem))
    (where / "key.pem").write_bytes(key.private_bytes(
        pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    return where / "ca.pem", where / "cert.pem", where / "key.pem"


class AuthRegistry(Registry):
    """A docker-registry over TLS (its htpasswd auth requires it) with one user."""

    def __init__(self, root: Path, username: str, password: str) -> None:
        root.mkdir(parents=True, exist_ok=True)
        self.ca, cert, key = tls_files(root / "tls")
        htpasswd = root / "htpasswd"
        htpasswd.write_text(subprocess.run(["htpasswd", "-Bbn", username, password],
                                           capture_output=True, text=True,
                                           check=True).stdout)
        self._extra = (f"  tls:\n    certificate: {cert}\n    key: {key}\n"
                       f"auth:\n  htpasswd:\n    realm: test\n    path: {htpasswd}\n")
        self.username, self.password = username, password
        super().__init__(root)

    def _config(self) -> str:
        return super()._config() + self._extra

    def _ready_url(self) -> str:
        return f"https://{self.host}/v2/"

    def push(self, layout: Path, repo: str, tag: str = "latest") -> str:
        subprocess.run(["skopeo", "copy", "--quiet", "--all", "--dest-tls-verify=false",
                        "--dest-creds", f"{self.username}:{self.password}",
                        f"oci:{layout}:{tag}", f"docker://{self.host}/{repo}:{tag}"],
                       check=True, capture_output=True)
        return f"{self.host}/{repo}:{tag}"

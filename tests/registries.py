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

from tests.conftest import free_port, stop_process, wait_http


class Registry:
    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.host = f"127.0.0.1:{self.port}"
        self.storage = root / "storage"
        config = root / "config.yml"
        config.write_text(
            "version: 0.1\nlog:\n  level: warn\nstorage:\n  filesystem:\n"
            f"    rootdirectory: {self.storage}\n  delete:\n    enabled: true\n"
            f"http:\n  addr: 127.0.0.1:{self.port}\n")
        self.log = open(root / "registry.log", "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(["docker-registry", "serve", str(config)],
                                     stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        wait_http(f"http://{self.host}/v2/", proc=self.proc)

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
    root.mkdir(parents=True, exist_ok=True)
    (root / "oci-layout").write_text(json.dumps({"imageLayoutVersion": "1.0.0"}))
    config = {"architecture": arch, "os": "linux",
              "config": {"Env": env or ["PATH=/bin"]},
              "rootfs": {"type": "layers", "diff_ids": []}}
    manifest = {
        "schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                   **_blob(root, json.dumps(config).encode())},
        "layers": [{"mediaType": LAYER_TYPE[kind], **_blob(root, data)}
                   for data, kind in layers]}
    desc = {"mediaType": "application/vnd.oci.image.manifest.v1+json",
            **_blob(root, json.dumps(manifest).encode()),
            "annotations": {"org.opencontainers.image.ref.name": tag}}
    (root / "index.json").write_text(json.dumps(
        {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json",
         "manifests": [desc]}))
    return root

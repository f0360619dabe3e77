"""Build small tar layers and OCI layouts by hand for the storage tests."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import tarfile
from pathlib import Path


def layer(entries: list[dict], *, compress: bool = True) -> bytes:
    """A tar from entries like {"name", "type": "file|dir|symlink|link|fifo", "data",
    "target", "mode", "uid", "gid"}."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for e in entries:
            info = tarfile.TarInfo(e["name"])
            info.mode = e.get("mode", 0o644 if e.get("type", "file") == "file" else 0o755)
            info.uid, info.gid = e.get("uid", 0), e.get("gid", 0)
            info.mtime = e.get("mtime", 1_700_000_000)
            kind = e.get("type", "file")
            data = e.get("data", b"")
            if kind == "dir":
                info.type = tarfile.DIRTYPE
            elif kind == "symlink":
                info.type, info.linkname = tarfile.SYMTYPE, e["target"]
            elif kind == "link":
                info.type, info.linkname = tarfile.LNKTYPE, e["target"]
            elif kind == "fifo":
                info.type = tarfile.FIFOTYPE
            else:
                info.size = len(data)
            tar.addfile(info, io.BytesIO(data) if kind == "file" else None)
    raw = buf.getvalue()
    return gzip.compress(raw, mtime=0) if compress else raw


def _blob(root: Path, data: bytes) -> dict:
    digest = hashlib.sha256(data).hexdigest()
    (root / "blobs" / "sha256").mkdir(parents=True, exist_ok=True)
    (root / "blobs" / "sha256" / digest).write_bytes(data)
    return {"digest": f"sha256:{digest}", "size": len(data)}


def oci_layout(root: Path, layers: list[bytes], env: list[str] | None = None) -> Path:
    """An OCI image layout at ``root`` with ``layers`` (gzip tars), lowest first."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "oci-layout").write_text(json.dumps({"imageLayoutVersion": "1.0.0"}))
    config = {"architecture": "amd64", "os": "linux",
              "config": {"Env": env or ["PATH=/usr/bin:/bin"]},
              "rootfs": {"type": "layers", "diff_ids": []}}
    manifest = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                   **_blob(root, json.dumps(config).encode())},
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip",
                    **_blob(root, data)} for data in layers],
    }
    desc = _blob(root, json.dumps(manifest).encode())
    index = {"schemaVersion": 2, "manifests": [{
        "mediaType": "application/vnd.oci.image.manifest.v1+json", **desc,
        "platform": {"architecture": "amd64", "os": "linux"}}]}
    (root / "index.json").write_text(json.dumps(index))
    return root


def docker_save(path: Path, layers: list[bytes]) -> Path:
    """A ``docker save``-style archive (manifest.json + <id>/layer.tar) with ``layers``."""
    buf = io.BytesIO()
    names = []
    with tarfile.open(fileobj=buf, mode="w") as tar:
        def add(name: str, data: bytes) -> None:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))

        for i, data in enumerate(layers):
            name = f"layer{i}/layer.tar"
            add(name, gzip.decompress(data) if data[:2] == b"\x1f\x8b" else data)
            names.append(name)
        add("config.json", json.dumps({"config": {"Env": []}}).encode())
        add("manifest.json", json.dumps(
            [{"Config": "config.json", "RepoTags": ["t:latest"], "Layers": names}]).encode())
    path.write_bytes(buf.getvalue())
    return path

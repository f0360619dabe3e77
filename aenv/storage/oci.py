"""Read container images: an OCI image layout directory, an OCI archive, or ``docker save``.

``open_image`` yields an ``OciImage``: the layer files in the order they apply (lowest
first), the image config (``Env``, ``Entrypoint``, ``User``...), and the digest that names the
image (the manifest's own digest for a layout; the archive's sha256 for ``docker save``).
Blob digests are checked as layers are read, so a corrupt download fails here, not at boot.
Archives are unpacked into a scratch directory that lives as long as the context.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import tarfile
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import LayerError

_INDEX_TYPES = {
    "application/vnd.oci.image.index.v1+json",
    "application/vnd.docker.distribution.manifest.list.v2+json",
}


@dataclass(frozen=True)
class OciImage:
    """An image ready to unpack: ``layers`` lowest first, ``config`` the image config's
    ``config`` object. A registry pull (``registry.pull_image``) also fills
    ``layer_media_types`` (one per layer), ``bytes_transferred`` (blob bytes this pull
    downloaded; 0 when every blob was cached) and ``reference`` (what was pulled)."""

    digest: str
    layers: list[Path]
    config: dict[str, Any] = field(default_factory=dict)
    layer_media_types: list[str] = field(default_factory=list)
    bytes_transferred: int = 0
    reference: str = ""


def is_oci_layout(path: Path) -> bool:
    return path.is_dir() and (path / "oci-layout").is_file() and (path / "index.json").is_file()


def is_image_archive(path: Path) -> bool:
    """Whether ``path`` is a tar holding an OCI layout or a ``docker save`` manifest."""
    if not path.is_file() or not tarfile.is_tarfile(path):
        return False
    with tarfile.open(path) as tar:
        names = {n.lstrip("./") for n in tar.getnames()[:4096]}
    return "manifest.json" in names or {"oci-layout", "index.json"} <= names


@contextlib.contextmanager
def open_image(path: Path, *, scratch: Path | None = None) -> Iterator[OciImage]:
    """The image at ``path`` (layout directory or archive), for the duration of the block."""
    if is_oci_layout(path):
        yield _from_layout(path)
        return
    if not is_image_archive(path):
        raise LayerError(f"{path} is neither an OCI layout nor an image archive")
    if scratch is not None:
        scratch.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=scratch, prefix="oci-") as tmp:
        root = Path(tmp)
        with tarfile.open(path) as tar:
            tar.extractall(root, filter="data")
        if is_oci_layout(root):
            yield _from_layout(root)
        else:
            yield _from_docker_save(root, _file_sha256(path))


def _from_layout(root: Path) -> OciImage:
    index = _json(root / "index.json")
    descriptor = _pick_manifest(root, index)
    manifest = json.loads(_blob(root, descriptor["digest"]).read_bytes())
    config = json.loads(_blob(root, manifest["config"]["digest"]).read_bytes())
    layers = [_blob(root, layer["digest"]) for layer in manifest.get("layers", [])]
    for layer, desc in zip(layers, manifest.get("layers", []), strict=True):
        _verify(layer, desc["digest"])
    return OciImage(descriptor["digest"], layers, config.get("config") or {})


def _pick_manifest(root: Path, index: dict[str, Any]) -> dict[str, Any]:
    """The linux/amd64 manifest (descending into nested indexes), or the only one there is."""
    manifests: list[dict[str, Any]] = index.get("manifests") or []
    if not manifests:
        raise LayerError("OCI index lists no manifest")
    chosen = manifests[0]
    for desc in manifests:
        platform = desc.get("platform") or {}
        if platform.get("os", "linux") == "linux" and platform.get("architecture") in (
            "amd64", None
        ):
            chosen = desc
            break
    if chosen.get("mediaType") in _INDEX_TYPES:
        return _pick_manifest(root, json.loads(_blob(root, chosen["digest"]).read_bytes()))
    return chosen


def _from_docker_save(root: Path, archive_digest: str) -> OciImage:
    entries = _json(root / "manifest.json")
    if not isinstance(entries, list) or not entries:
        raise LayerError("docker save manifest.json lists no image")
    entry = entries[0]
    config_file = _inside(root, entry["Config"])
    config = _json(config_file)
    layers = [_inside(root, name) for name in entry.get("Layers", [])]
    return OciImage(f"sha256:{archive_digest}", layers, config.get("config") or {})


def _blob(root: Path, digest: str) -> Path:
    algo, _, hexdigest = digest.partition(":")
    if algo != "sha256" or not hexdigest.isalnum():
        raise LayerError(f"unsupported blob digest {digest!r}")
    path = root / "blobs" / algo / hexdigest
    if not path.is_file():
        raise LayerError(f"blob {digest} is missing from {root}")
    return path


def _verify(path: Path, digest: str) -> None:
    if _file_sha256(path) != digest.partition(":")[2]:
        raise LayerError(f"blob {path.name} does not match its digest {digest}")


def _inside(root: Path, name: str) -> Path:
    path = (root / name).resolve()
    if root.resolve() not in path.parents or not path.is_file():
        raise LayerError(f"archive entry {name!r} is missing or outside the archive")
    return path


def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise LayerError(f"cannot read {path.name}: {e}") from None


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()

"""Pull an image from a registry (OCI distribution API v2) into the shared blob cache.

``pull_image(settings, "alpine:3.19")`` is a context manager yielding an ``OciImage``
whose layers are files in the blob cache, lowest first, exactly as ``oci.open_image``
yields one read from a layout: the image builder applies them with
``tar_layers.apply_layer(..., whiteouts=True)``. While the block runs, every blob of the
image is pinned, so the cache's garbage collection cannot take them away.

What a pull does: the manifest (``Accept``: OCI index and manifest, Docker manifest list
and schema 2) is fetched and checked against its digest (the reference's, or the
``Docker-Content-Digest`` the registry sends); an index or list is resolved to its
``linux/amd64`` manifest; the config and each layer are fetched unless cached, streamed
into the cache while hashed, and refused unless they match their digest and size. A
second pull of the same image transfers no blob bytes: a tag costs one manifest request,
a digest whose manifests are cached costs no request at all. Errors are
``registry_errors``; none holds a credential, and nothing here logs one.

The client is synchronous (httpx): callers on an event loop run a pull in a thread, as
every image build does.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import urljoin

import httpx

from ..config import Settings
from .blob_cache import BlobCache, digest_hex
from .oci import OciImage
from .registry_auth import Authorizer, RegistryCredentials
from .registry_errors import (
    AuthFailed,
    DigestMismatch,
    ImageNotFound,
    NoPlatform,
    RegistryError,
    RegistryUnreachable,
    UnsupportedManifest,
)
from .registry_ref import ImageReference, parse_reference
from .registry_transport import TransportPolicy, make_client

log = logging.getLogger(__name__)

OCI_INDEX = "application/vnd.oci.image.index.v1+json"
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
DOCKER_LIST = "application/vnd.docker.distribution.manifest.list.v2+json"
DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
ACCEPT = ", ".join((OCI_INDEX, OCI_MANIFEST, DOCKER_LIST, DOCKER_MANIFEST))
INDEX_TYPES = frozenset({OCI_INDEX, DOCKER_LIST})
MANIFEST_TYPES = frozenset({OCI_MANIFEST, DOCKER_MANIFEST})
LAYER_TYPES = frozenset({
    "application/vnd.oci.image.layer.v1.tar",
    "application/vnd.oci.image.layer.v1.tar+gzip",
    "application/vnd.oci.image.layer.v1.tar+zstd",
    "application/vnd.docker.image.rootfs.diff.tar.gzip",
    "application/vnd.docker.image.rootfs.diff.tar",
    "application/vnd.docker.image.rootfs.diff.tar.zstd",
})
PLATFORM = ("linux", "amd64")
MAX_MANIFEST_BYTES = 4 << 20
MAX_REDIRECTS = 5
CHUNK = 1 << 20


@dataclass(frozen=True)
class BlobProgress:
    """One step of one blob: ``done`` of ``total`` bytes; ``cached`` when no byte had
    to move (the blob was in the cache)."""

    digest: str
    kind: str  # "config" or "layer"
    done: int
    total: int
    cached: bool = False


ProgressFn = Callable[[BlobProgress], None]


@contextlib.contextmanager
def pull_image(settings: Settings, reference: str | ImageReference, *,
               credentials: RegistryCredentials | None = None,
               progress: ProgressFn | None = None,
               transport: httpx.BaseTransport | None = None) -> Iterator[OciImage]:
    """The image ``reference`` names, its blobs cached and pinned for the block.

    ``transport`` replaces httpx's network transport (unit tests only)."""
    ref = parse_reference(reference) if isinstance(reference, str) else reference
    cache = BlobCache(settings.registry_blobs_dir, settings.layer_cache_mb << 20)
    t0 = time.monotonic()
    with contextlib.ExitStack() as pins:
        with _Puller(ref, settings, credentials, cache, pins, progress, transport) as puller:
            image = puller.pull()
        collected = cache.collect()
        log.info("pulled %s: %s, %d layers, %d bytes transferred in %.2f s "
                 "(cache: %d bytes, %d blobs collected)", ref, image.digest,
                 len(image.layers), image.bytes_transferred, time.monotonic() - t0,
                 collected.kept_bytes, collected.removed)
        yield image


class _Puller:
    """One pull of one reference: the registry conversation and the cache around it."""

    def __init__(self, ref: ImageReference, settings: Settings,
                 credentials: RegistryCredentials | None, cache: BlobCache,
                 pins: contextlib.ExitStack, progress: ProgressFn | None,
                 transport: httpx.BaseTransport | None) -> None:
        self.ref = ref
        self.name = str(ref)
        self.cache = cache
        self.pins = pins
        self.progress = progress or (lambda _event: None)
        self.policy = TransportPolicy(settings)
        self.transport = transport
        self.clients: dict[bool, httpx.Client] = {}
        self.scheme: str | None = None
        self.transferred = 0
        self.auth = Authorizer(self.name, ref.registry, ref.repository, credentials,
                               self._token_get)

    def __enter__(self) -> _Puller:
        return self

    def __exit__(self, *exc: object) -> None:
        for client in self.clients.values():
            client.close()

    # -- the image ---------------------------------------------------------------------

    def pull(self) -> OciImage:
        digest, manifest = self._resolve()
        config_desc = manifest.get("config")
        if not isinstance(config_desc, dict) or "digest" not in config_desc:
            raise UnsupportedManifest(f"the manifest of {self.name!r} has no config")
        config_blob = self._blob(config_desc, "config")
        try:
            config = json.loads(config_blob.read_bytes())
        except ValueError as e:
            raise UnsupportedManifest(f"the config of {self.name!r} is not JSON: {e}") from None
        self._check_config_platform(config)
        layers, types = [], []
        for desc in manifest.get("layers") or []:
            media_type = desc.get("mediaType", "")
            if media_type not in LAYER_TYPES:
                raise UnsupportedManifest(
                    f"{self.name!r} has a layer of type {media_type!r}, which aenv cannot "
                    "unpack (it reads tar, tar+gzip and tar+zstd layers)")
            layers.append(self._blob(desc, "layer"))
            types.append(media_type)
        return OciImage(digest, layers, config.get("config") or {}, types, self.transferred,
                        self.name)

    def _resolve(self) -> tuple[str, dict[str, Any]]:
        """(digest, body) of the ``linux/amd64`` image manifest."""
        digest, body = self._manifest(self.ref.reference)
        for _depth in range(4):
            kind = _media_type(body)
            if kind in MANIFEST_TYPES:
                return digest, body
            if kind not in INDEX_TYPES:
                raise UnsupportedManifest(
                    f"{self.name!r} has a manifest of type {kind or 'unknown'!r}; aenv reads "
                    "OCI and Docker schema 2 manifests and indexes")
            desc = self._pick_platform(body)
            digest, body = self._manifest(desc["digest"])
        raise UnsupportedManifest(f"{self.name!r}: image indexes nest too deep")

    def _pick_platform(self, index: dict[str, Any]) -> dict[str, Any]:
        manifests = [d for d in index.get("manifests") or [] if isinstance(d, dict)]
        seen = []
        for desc in manifests:
            platform = desc.get("platform") or {}
            os_, arch = platform.get("os"), platform.get("architecture")
            if (os_, arch) == PLATFORM:
                return desc
            if os_ or arch:
                variant = platform.get("variant")
                seen.append("/".join(p for p in (os_, arch, variant) if p))
        if len(manifests) == 1 and not (manifests[0].get("platform") or {}):
            return manifests[0]  # an index of one manifest that names no platform
        raise NoPlatform(
            f"image {self.name!r} has no linux/amd64 variant (it has: "
            f"{', '.join(sorted(set(seen))) or 'no platform named'})", sorted(set(seen)))

    def _check_config_platform(self, config: dict[str, Any]) -> None:
        os_, arch = config.get("os"), config.get("architecture")
        if (os_ and os_ != PLATFORM[0]) or (arch and arch != PLATFORM[1]):
            found = f"{os_ or '?'}/{arch or '?'}"
            raise NoPlatform(f"image {self.name!r} is built for {found}, not linux/amd64",
                             [found])

    # -- manifests and blobs ----------------------------------------------------------

    def _manifest(self, reference: str) -> tuple[str, dict[str, Any]]:
        by_digest = reference.startswith("sha256:")
        data = self.cache.read(reference) if by_digest else None
        if data is None:
            data = self._fetch_manifest(reference, by_digest)
        try:
            body = json.loads(data)
        except ValueError as e:
            raise UnsupportedManifest(f"the manifest of {self.name!r} is not JSON: {e}") \
                from None
        if not isinstance(body, dict):
            raise UnsupportedManifest(f"the manifest of {self.name!r} is not a JSON object")
        if body.get("schemaVersion") == 1:
            raise UnsupportedManifest(f"{self.name!r} has a Docker schema 1 manifest, which "
                                      "aenv does not read (push it again with a newer tool)")
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        self.pins.enter_context(self.cache.use(digest))
        return digest, body

    def _fetch_manifest(self, reference: str, by_digest: bool) -> bytes:
        path = f"/v2/{self.ref.repository}/manifests/{reference}"
        with self._get(path, {"Accept": ACCEPT}, what="manifest") as response:
            data = b""
            for chunk in response.iter_bytes():
                data += chunk
                if len(data) > MAX_MANIFEST_BYTES:
                    raise UnsupportedManifest(f"the manifest of {self.name!r} is larger than "
                                              f"{MAX_MANIFEST_BYTES} bytes")
            sent = response.headers.get("docker-content-digest", "")
        actual = "sha256:" + hashlib.sha256(data).hexdigest()
        expected = reference if by_digest else (sent if sent.startswith("sha256:") else None)
        if expected is not None and actual != expected:
            raise DigestMismatch(f"the manifest of {self.name!r} does not match its digest "
                                 f"{expected} (it hashes to {actual})")
        self.cache.put(actual, data, what="manifest")
        return data

    def _blob(self, desc: dict[str, Any], kind: str) -> Any:
        digest = desc.get("digest")
        size = desc.get("size")
        if not isinstance(digest, str):
            raise UnsupportedManifest(f"a {kind} of {self.name!r} has no digest")
        digest_hex(digest)
        if desc.get("urls"):
            raise UnsupportedManifest(f"{self.name!r} has a foreign {kind} (fetched from other "
                                      "URLs), which aenv does not pull")
        total = size if isinstance(size, int) and size >= 0 else None
        path = self.pins.enter_context(self.cache.use(digest))
        with self.cache.writing(digest, total, what=f"{kind} of {self.name!r}") as writer:
            if writer is None:
                self.progress(BlobProgress(digest, kind, total or 0, total or 0, cached=True))
                return path
            self.progress(BlobProgress(digest, kind, 0, total or 0))
            path_v2 = f"/v2/{self.ref.repository}/blobs/{digest}"
            with self._get(path_v2, {}, what=kind) as response:
                try:
                    for chunk in response.iter_bytes(CHUNK):
                        writer.write(chunk)
                        self.transferred += len(chunk)
                        self.progress(BlobProgress(digest, kind, writer.written, total or 0))
                except httpx.HTTPError as e:
                    raise RegistryUnreachable(
                        f"the download of a {kind} of {self.name!r} from {self.ref.registry} "
                        f"broke off: {type(e).__name__}") from None
        return path

    # -- HTTP ----------------------------------------------------------------------------

    @contextlib.contextmanager
    def _get(self, path: str, headers: dict[str, str], *, what: str
             ) -> Iterator[httpx.Response]:
        """A streamed 200 answer to GET ``path`` on the registry: auth challenges answered,
        redirects followed under the transport policy, errors mapped."""
        response = self._send(path, headers)
        if response.status_code == 401:
            response.close()
            self.auth.answer(response)
            response = self._send(path, headers)
            if response.status_code == 401:
                response.close()
                raise self.auth.refused()
        try:
            if response.status_code != 200:
                self._raise_for(response, what)
            yield response
        finally:
            response.close()

    def _send(self, path: str, headers: dict[str, str]) -> httpx.Response:
        """GET on the registry (scheme chosen on the first request), then each redirect."""
        response = self._registry_get(path, headers)
        host = self.ref.registry
        for _hop in range(MAX_REDIRECTS):
            if response.status_code not in (301, 302, 303, 307, 308):
                return response
            location = response.headers.get("location", "")
            url = urljoin(str(response.url), location)
            response.close()
            if not self.policy.url_allowed(url):
                raise RegistryUnreachable(
                    f"registry {self.ref.registry} redirected {self.name!r} to a plain-HTTP "
                    "host that is neither loopback nor in AENV_INSECURE_REGISTRIES")
            next_host = httpx.URL(url).netloc.decode()
            # Credentials go to the registry only, never to blob storage elsewhere.
            extra = {"Authorization": self.auth.header} \
                if self.auth.header and next_host == host else {}
            response = self._request(url, {**headers, **extra}, next_host)
        raise RegistryUnreachable(f"registry {self.ref.registry} redirected {self.name!r} more "
                                  f"than {MAX_REDIRECTS} times")

    def _registry_get(self, path: str, headers: dict[str, str]) -> httpx.Response:
        hostport = self.ref.registry
        if self.auth.header:
            headers = {**headers, "Authorization": self.auth.header}
        schemes = [self.scheme] if self.scheme else self.policy.schemes(hostport)
        failures = []
        for scheme in schemes:
            try:
                response = self._request(f"{scheme}://{hostport}{path}", headers, hostport)
            except RegistryUnreachable as e:
                failures.append(str(e))
                continue
            if scheme == "http" and failures and response.status_code == 400:
                response.close()  # an HTTPS-only server answering plain HTTP
                break
            self.scheme = scheme
            return response
        hint = "" if len(self.policy.schemes(hostport)) > 1 else (
            " (plain HTTP is used only for loopback registries and those in "
            "AENV_INSECURE_REGISTRIES)")
        raise RegistryUnreachable(f"cannot reach registry {hostport} for {self.name!r}: "
                                  f"{failures[0] if failures else 'no answer'}{hint}")

    def _request(self, url: str, headers: dict[str, str], hostport: str) -> httpx.Response:
        verify_ok = self.policy.verify_for(hostport) is not False
        client = self.clients.get(verify_ok)
        if client is None:
            client = self.clients[verify_ok] = make_client(
                self.policy.verify_for(hostport), self.transport)
        try:
            return client.send(client.build_request("GET", url, headers=headers), stream=True)
        except httpx.HTTPError as e:
            raise RegistryUnreachable(f"{httpx.URL(url).copy_with(query=None)}: "
                                      f"{_describe(e)}") from None

    def _token_get(self, realm: str, params: dict[str, str], authorization: str | None
                   ) -> httpx.Response:
        if not self.policy.url_allowed(realm):
            raise RegistryUnreachable(
                f"registry {self.ref.registry} names a token service over plain HTTP on a host "
                "that is neither loopback nor in AENV_INSECURE_REGISTRIES")
        headers = {"Authorization": authorization} if authorization else {}
        url = httpx.URL(realm).copy_merge_params(params)
        response = self._request(str(url), headers, url.netloc.decode())
        response.read()
        response.close()
        return response

    def _raise_for(self, response: httpx.Response, what: str) -> None:
        status = response.status_code
        code = _error_code(response)
        if status == 404 or code in ("MANIFEST_UNKNOWN", "NAME_UNKNOWN", "BLOB_UNKNOWN"):
            if what in ("manifest",):
                raise ImageNotFound(f"image {self.name!r} not found in the registry")
            raise ImageNotFound(f"a {what} of image {self.name!r} is missing from the registry")
        if status == 403 or code == "DENIED":
            raise AuthFailed(f"registry {self.ref.registry} denied access to {self.name!r}")
        if status == 429 or code == "TOOMANYREQUESTS":
            raise RegistryUnreachable(f"registry {self.ref.registry} is rate-limiting pulls "
                                      f"(429) of {self.name!r}; try again later")
        if status >= 500:
            raise RegistryUnreachable(f"registry {self.ref.registry} failed ({status}) on the "
                                      f"{what} of {self.name!r}")
        raise RegistryError(f"registry {self.ref.registry} answered {status}"
                            f"{f' {code}' if code else ''} to the {what} of {self.name!r}")


def _media_type(body: dict[str, Any]) -> str:
    """The manifest's declared media type, or the one its shape implies (OCI allows
    leaving it out)."""
    declared = body.get("mediaType")
    if isinstance(declared, str) and declared:
        return declared
    if "manifests" in body:
        return OCI_INDEX
    if "layers" in body and "config" in body:
        return OCI_MANIFEST
    return ""


def _error_code(response: httpx.Response) -> str | None:
    """The first ``errors[].code`` of a registry's JSON error body, if any."""
    try:
        response.read()
        body = json.loads(response.content[:65536])
    except (ValueError, httpx.HTTPError):
        return None
    errors = body.get("errors") if isinstance(body, dict) else None
    if isinstance(errors, list) and errors and isinstance(errors[0], dict):
        code = errors[0].get("code")
        return code if isinstance(code, str) else None
    return None


def _describe(e: httpx.HTTPError) -> str:
    """A transport error in a few words (its text names hosts and reasons, not headers)."""
    text = str(e) or type(e).__name__
    return f"{type(e).__name__}: {text}"[:300]

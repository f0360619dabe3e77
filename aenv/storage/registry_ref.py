"""Image references as Docker reads them, parsed in one place.

``parse_reference`` turns what a user writes (``alpine``, ``node:20``,
``ghcr.io/org/img@sha256:...``, ``localhost:5000/x``) into an ``ImageReference``: the
registry host (with its port), the repository path, and a tag or a digest. The rules are
Docker's: the first path component is a registry only if it contains a ``.`` or a ``:``
or is ``localhost``; otherwise the image is on Docker Hub (``registry-1.docker.io``),
where one-component names live under ``library/``; no tag and no digest means
``latest``. Anything else (upper case in the path, an empty component, a malformed
digest) is a ``BadReference`` naming the text, never a guess.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .registry_errors import BadReference

DOCKER_HUB = "registry-1.docker.io"
_HUB_ALIASES = frozenset({"docker.io", "index.docker.io", "registry-1.docker.io"})
DEFAULT_TAG = "latest"

# The grammar of distribution/reference: lower-case components separated by . _ __ or -.
_COMPONENT = re.compile(r"[a-z0-9]+(?:(?:\.|_|__|-+)[a-z0-9]+)*")
_TAG = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}")
_DIGEST = re.compile(r"sha256:[a-f0-9]{64}")
_HOST = re.compile(r"(?:[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?(?:\.[A-Za-z0-9-]+)*"
                   r"|\[[0-9A-Fa-f:.]+\])(?::[0-9]{1,5})?")


@dataclass(frozen=True)
class ImageReference:
    """One image in one registry: ``registry`` is ``host[:port]``, ``repository`` the
    path inside it, and exactly one of ``tag`` / ``digest`` says which manifest (a
    reference written with both keeps both; the digest wins when pulling)."""

    registry: str
    repository: str
    tag: str | None = None
    digest: str | None = None

    @property
    def reference(self) -> str:
        """What goes after ``/manifests/``: the digest if there is one, else the tag."""
        return self.digest or self.tag or DEFAULT_TAG

    @property
    def host(self) -> str:
        """The registry's host name without the port (brackets stripped for IPv6)."""
        host = self.registry
        if host.startswith("["):
            return host[1:host.index("]")]
        return host.rsplit(":", 1)[0] if ":" in host else host

    def __str__(self) -> str:
        text = f"{self.registry}/{self.repository}"
        if self.tag:
            text += f":{self.tag}"
        if self.digest:
            text += f"@{self.digest}"
        return text


def parse_reference(text: str) -> ImageReference:
    """``text`` as an image reference, with Docker's defaults filled in."""
    raw = text.strip()
    if not raw or any(c.isspace() for c in raw):
        raise BadReference(f"{text!r} is not an image reference")
    rest, digest = raw, None
    if "@" in rest:
        rest, _, digest = rest.partition("@")
        if not _DIGEST.fullmatch(digest):
            raise BadReference(f"{text!r}: {digest!r} is not a sha256 digest "
                               "(sha256: and 64 lower-case hex digits)")
    first, slash, remainder = rest.partition("/")
    if slash and ("." in first or ":" in first or first == "localhost"
                  or first.startswith("[")):
        if not _HOST.fullmatch(first):
            raise BadReference(f"{text!r}: {first!r} is not a registry host[:port]")
        registry, path = first, remainder
    else:
        registry, path = DOCKER_HUB, rest
    if registry.lower() in _HUB_ALIASES:
        registry = DOCKER_HUB
    tag = None
    last_slash = path.rfind("/")
    colon = path.rfind(":")
    if colon > last_slash:
        path, tag = path[:colon], path[colon + 1:]
        if not _TAG.fullmatch(tag):
            raise BadReference(f"{text!r}: {tag!r} is not a valid tag")
    components = path.split("/")
    for component in components:
        if not _COMPONENT.fullmatch(component):
            raise BadReference(
                f"{text!r}: repository {path!r} must be lower-case letters, digits and "
                "separators (. _ -), with no empty component")
    if registry == DOCKER_HUB and len(components) == 1:
        path = f"library/{path}"
    if tag is None and digest is None:
        tag = DEFAULT_TAG
    return ImageReference(registry, path, tag, digest)

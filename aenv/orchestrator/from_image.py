"""A template build's ``fromImage``: pull the image, make it a guest, stand it in as the parent.

E2B's SDK sends ``fromImage`` for ``Template().from_image(ref)``, the ``from_*_image``
helpers, ``from_dockerfile`` (its ``FROM``) and ``from_base_image()`` (``e2bdev/base``,
which is aenv's own ``base`` template and is built from it, not pulled). Any other
reference is pulled from its registry (``storage.registry``) with the credentials of
``fromImageRegistry``, unpacked into an image that boots with the shared tools drive
(``storage.images``, ``guest_layer="tools"``: envd needs nothing from the image), and
named ``image:<digest>``. The build then starts from that image as it would from a parent
template's: its steps run on top, and the finished VM becomes the template's snapshot.

The image's config applies to the template as E2B applies it: ``Env`` becomes the
template's environment (``PATH`` included: ``node``, ``golang`` and ``python`` images put
their tools there), ``WorkingDir`` and ``User`` its default working directory and user when
the image sets them (else E2B's ``/home/user`` and ``user``). ``Entrypoint`` and ``Cmd`` are
not run: a template starts a process only when it asks for one (``startCmd``).

Credentials live only in memory for the build; they are never logged, and neither the
build's stored spec nor the template record holds them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from ..config import Settings
from ..storage import images
from ..storage.image_ref import ImageRef
from ..storage.registry import BlobProgress, pull_image
from ..storage.registry_auth import RegistryCredentials
from ..storage.registry_errors import RegistryError
from ..storage.registry_ref import ImageReference, parse_reference
from .errors import InvalidRequest

# What E2B's SDK sends for from_base_image(): E2B's base image, which aenv's ``base`` is.
E2B_BASE_IMAGE = "e2bdev/base"
DEFAULT_WORKDIR = "/home/user"
DEFAULT_USER = "user"

Say = Callable[[str], None]


@dataclass(frozen=True)
class ImageRequest:
    """A checked ``fromImage``: the reference, and the credentials to pull it with."""

    reference: ImageReference
    credentials: RegistryCredentials | None = field(default=None, repr=False)


@dataclass(frozen=True)
class PreparedImage:
    """An image a build can start from, and what its config gives the template."""

    image: str  # ``image:<digest>``
    env: dict[str, str]
    workdir: str | None
    user: str | None
    digest: str  # the registry's manifest digest, for the log


class ImageSource(Protocol):
    def prepare(self, request: ImageRequest, say: Say) -> PreparedImage: ...

    def base_with(self, layers: Sequence[images.CopyLayer], say: Say) -> str:
        """``image:<digest>``: the base image with ``layers`` laid in on the host;
        ``images.NotLayerable`` when one cannot be."""
        ...


def is_e2b_base(reference: str) -> bool:
    """Whether ``reference`` names E2B's base image (any tag), which is aenv's ``base``."""
    name = reference.strip()
    name = name.removeprefix("docker.io/").removeprefix("index.docker.io/")
    return name.split("@")[0].split(":")[0] == E2B_BASE_IMAGE


def check_request(reference: str, registry: Mapping[str, Any] | None) -> ImageRequest:
    """``fromImage`` and ``fromImageRegistry`` as a pull request; ``InvalidRequest`` (a 400,
    and the build's error) for a malformed reference or unusable credentials."""
    try:
        ref = parse_reference(reference)
        creds = RegistryCredentials.from_e2b(registry) if registry is not None else None
    except RegistryError as e:
        raise InvalidRequest(str(e)) from None
    return ImageRequest(ref, creds)


def image_settings(config: Mapping[str, Any]) -> tuple[dict[str, str], str | None, str | None]:
    """(environment, working directory, user) from an OCI image config's ``config``."""
    env: dict[str, str] = {}
    for item in config.get("Env") or []:
        if isinstance(item, str) and "=" in item:
            key, _, value = item.partition("=")
            if key:
                env[key] = value
    workdir = config.get("WorkingDir") or None
    user = config.get("User") or None
    if isinstance(user, str):
        user = user.split(":")[0] or None  # "name:group" or "uid:gid": envd takes the user
    return env, workdir if isinstance(workdir, str) else None, \
        user if isinstance(user, str) else None


class _PullLog:
    """Build-log lines for a pull: one when a blob starts, one when it is done; the
    registry reports every chunk, which would drown the log."""

    def __init__(self, say: Say) -> None:
        self.say = say
        self.started: set[str] = set()

    def __call__(self, p: BlobProgress) -> None:
        short = p.digest.removeprefix("sha256:")[:12]
        size = f"{p.total / 1e6:.1f} MB"
        if p.cached:
            if p.digest not in self.started:
                self.say(f"{p.kind} {short}: cached ({size})")
            self.started.add(p.digest)
            return
        if p.digest not in self.started:
            self.started.add(p.digest)
            self.say(f"pulling {p.kind} {short} ({size})")
        if p.total and p.done >= p.total:
            self.say(f"{p.kind} {short}: done")


class RegistryImages:
    """``ImageSource`` of a node: pulls into the shared blob cache, builds into the images
    directory. Blocking: a build runs it in a worker thread."""

    def __init__(self, settings: Settings, *, kernel_flavor: str = "cloud") -> None:
        self.settings = settings
        self.kernel_flavor = kernel_flavor

    def base_with(self, layers: Sequence[images.CopyLayer], say: Say) -> str:
        built = images.base_image_with(self.settings, layers, say,
                                       kernel_flavor=self.kernel_flavor)
        return str(ImageRef.image(built.digest))

    def prepare(self, request: ImageRequest, say: Say) -> PreparedImage:
        say(f"pulling {request.reference}")
        with pull_image(self.settings, request.reference, credentials=request.credentials,
                        progress=_PullLog(say)) as pulled:
            say(f"pulled {pulled.digest}: {len(pulled.layers)} layers, "
                f"{pulled.bytes_transferred / 1e6:.1f} MB transferred")
            built = images.build_image(
                self.settings, f"oci-{pulled.digest.removeprefix('sha256:')[:12]}", pulled,
                guest_layer="tools", progress=say)
        env, workdir, user = image_settings(pulled.config)
        return PreparedImage(str(ImageRef.image(built.digest)), env, workdir, user,
                             pulled.digest)

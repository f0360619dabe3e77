"""What a template's ``image`` names: the node's base image, a built image, a committed disk
layer or a snapshot — parsed once, here, instead of by string prefixes wherever it is read.

The store keeps an image reference as text (``TemplateRecord.image``, a sandbox's
``snapshot_id`` and ``restored_from``, the orchestrator's pins and garbage-collection roots):

- none (``None`` or ``""``): the node's base image (``storage.images``);
- ``image:<digest>``: an image built by ``storage.images`` (``images_dir/<digest>``), say
  from a registry pull; one whose manifest says it boots with the tools drive gets it;
- ``layer:<id>``: a committed disk layer, ``<id>.<fmt>`` in ``Settings.layers_dir``
  (``storage.disk_layers``);
- ``snapshot:<id>``: a snapshot directory ``<id>`` in ``Settings.snapshots_dir``, either a
  VM snapshot (memory and devices, restored) or a disk-only one (booted); which one is the
  snapshot store's to say (``storage.snapshot_store``).

An id becomes a file or directory name, so ``parse`` refuses one that is empty, holds a
``/`` or starts with ``.``; an image's is a whole sha256 in lowercase hex. The text form
never changes: records written by any aenv read back the same.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from .errors import StorageError


class ImageKind(StrEnum):
    BASE = "base"
    IMAGE = "image"
    LAYER = "layer"
    SNAPSHOT = "snapshot"


IMAGE_PREFIX = "image:"
LAYER_PREFIX = "layer:"
SNAPSHOT_PREFIX = "snapshot:"
_PREFIXES = {ImageKind.IMAGE: IMAGE_PREFIX, ImageKind.LAYER: LAYER_PREFIX,
             ImageKind.SNAPSHOT: SNAPSHOT_PREFIX}


class BadImageRef(StorageError, ValueError):
    """Text that is no image reference: no known kind, or an id that cannot be a file name."""


@dataclass(frozen=True)
class ImageRef:
    kind: ImageKind
    id: str = ""  # empty for the base image

    @classmethod
    def image(cls, digest: str) -> ImageRef:
        return cls._checked(ImageKind.IMAGE, digest)

    @classmethod
    def layer(cls, layer_id: str) -> ImageRef:
        return cls._checked(ImageKind.LAYER, layer_id)

    @classmethod
    def snapshot(cls, snapshot_id: str) -> ImageRef:
        return cls._checked(ImageKind.SNAPSHOT, snapshot_id)

    @classmethod
    def parse(cls, text: str | None) -> ImageRef:
        """The reference ``text`` is (see the module docstring); ``BadImageRef`` otherwise."""
        if not text:
            return BASE_IMAGE
        for kind, prefix in _PREFIXES.items():
            if text.startswith(prefix):
                return cls._checked(kind, text.removeprefix(prefix))
        raise BadImageRef(f"not an image reference: {text!r}")

    @classmethod
    def _checked(cls, kind: ImageKind, ident: str) -> ImageRef:
        if (not ident or "/" in ident or ident.startswith(".")
                or (kind is ImageKind.IMAGE and not _is_sha256_hex(ident))):
            raise BadImageRef(f"bad {kind} reference: {_PREFIXES[kind] + ident!r}")
        return cls(kind, ident)

    @property
    def is_base(self) -> bool:
        return self.kind is ImageKind.BASE

    @property
    def is_image(self) -> bool:
        return self.kind is ImageKind.IMAGE

    @property
    def is_layer(self) -> bool:
        return self.kind is ImageKind.LAYER

    @property
    def is_snapshot(self) -> bool:
        return self.kind is ImageKind.SNAPSHOT

    def __str__(self) -> str:
        """The stored text (``""`` for the base image, which records store as ``None``)."""
        return _PREFIXES[self.kind] + self.id if not self.is_base else ""


def _is_sha256_hex(text: str) -> bool:
    return len(text) == 64 and all(c in "0123456789abcdef" for c in text)


BASE_IMAGE = ImageRef(ImageKind.BASE)

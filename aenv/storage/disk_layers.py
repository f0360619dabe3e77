"""Read-only disk layers made from sandbox disks (template builds commit one each, on a node
that cannot snapshot VMs).

A disk layer is the copy-on-write disk of a stopped build VM, moved — not copied — into
``Settings.layers_dir``: a qcow2 overlay whose backing chain ends at a base image, or a
reflink clone (raw) where the data directory supports it. New sandboxes get a disk over the
layer exactly as over a base image. Layers are never written again. A template names one
as ``layer:<id>`` (``image_ref``).

Not to be confused with the tar layers an image is built from (``tar_layers``) or the
memory layers of a VM snapshot (``snapshots``).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from . import durable
from .disks import Disk
from .errors import StorageError
from .image_ref import BadImageRef, ImageRef

LayerFormat = Literal["raw", "qcow2"]


class DiskLayerError(StorageError):
    """A layer could not be committed or found."""


@dataclass(frozen=True)
class DiskLayer:
    id: str
    path: Path
    format: LayerFormat

    def ref(self) -> str:
        """How the store refers to this layer."""
        return str(ImageRef.layer(self.id))


def commit(disk: Disk, directory: Path, layer_id: str) -> DiskLayer:
    """Move ``disk`` (its VM stopped) into the layer store and freeze it; durable on
    return (data, metadata and the directory entries fsynced)."""
    directory.mkdir(parents=True, exist_ok=True)
    dest = directory / f"{layer_id}.{disk.format}"
    if dest.exists():
        raise DiskLayerError(f"layer {layer_id} already exists")
    os.replace(disk.path, dest)
    os.chmod(dest, 0o444)
    durable.fsync_file(dest)
    meta = {"id": layer_id, "format": disk.format, "base": str(disk.base)}
    durable.write_atomic(directory / f"{layer_id}.json", json.dumps(meta).encode())
    return DiskLayer(layer_id, dest, disk.format)


def layer_id(ref: str | ImageRef) -> str:
    """The id a ``layer:<id>`` reference names (checked: it becomes a file name)."""
    parsed = _parse(ref)
    if not parsed.is_layer:
        raise DiskLayerError(f"bad layer reference: {str(ref)!r}")
    return parsed.id


def resolve(ref: str | ImageRef, directory: Path) -> DiskLayer:
    """The layer a template's ``image`` reference names."""
    parsed = _parse(ref)
    if not parsed.is_layer:
        raise DiskLayerError(f"not a layer reference: {str(ref)!r}")
    layer_id = parsed.id
    for fmt in ("qcow2", "raw"):
        path = directory / f"{layer_id}.{fmt}"
        if path.exists():
            return DiskLayer(layer_id, path, fmt)
    raise DiskLayerError(f"layer {layer_id} is missing from {directory}")


def _parse(ref: str | ImageRef) -> ImageRef:
    try:
        return ref if isinstance(ref, ImageRef) else ImageRef.parse(ref)
    except BadImageRef as e:
        raise DiskLayerError(str(e)) from None


def remove(ref: str, directory: Path) -> None:
    try:
        layer = resolve(ref, directory)
    except DiskLayerError:
        return
    layer.path.unlink(missing_ok=True)
    (layer.path.parent / f"{layer.id}.json").unlink(missing_ok=True)

"""The version check every driver's persisted machine record goes through.

A driver records the shape of each VM's machine (what a restore must rebuild exactly) in
the working directory's ``vm.json`` and in every snapshot manifest (``Manifest.vm``). Each
driver keeps that record as one frozen dataclass with a ``VERSION``, written by its
``to_json`` and read by its ``from_json`` only (``qemu_snapshot.QemuMachine``,
``firecracker_snapshot.FirecrackerMachine``), and ``from_json`` starts with ``fields``
here. Records written before they carried a version are version 1, the shape they have;
any other version than the reader's is refused with ``MachineRecordError``, never guessed
at.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .base import MachineRecordError

FIRST_VERSION = 1  # what a record without a "version" is


def fields(data: object, *, version: int, kind: str, where: object) -> Mapping[str, Any]:
    """``data`` (a decoded record) once it is known to be a ``kind`` record of ``version``;
    ``where`` names the file it came from, for the error."""
    if not isinstance(data, Mapping):
        raise MachineRecordError(f"{where}: the {kind} is not an object")
    found = data.get("version", FIRST_VERSION)
    if found != version:
        raise MachineRecordError(f"{where}: {kind} version {found!r}; this aenv reads "
                                 f"version {version}")
    return data
